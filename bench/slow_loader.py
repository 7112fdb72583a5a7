"""How much of an epoch the loop waits for a slow source, at 0, 1, 2 and 4 prefetch workers.

The source sleeps ``--load-ms`` per batch (a decode or a network read that releases the
GIL) and then gathers the batch from arrays; the model is an MLP sized so that one
optimizer step takes about ``--load-ms`` as well. The figure is the ``data_wait_frac`` that
jaxnitro logs per epoch (the share of the epoch the loop spent waiting for a batch), read
back from ``metrics.jsonl``, with the epoch's wall time:

    python bench/slow_loader.py [--load-ms 2] [--epochs 3] [--hidden 1024]

With the load per worker at or below the step time, 2 workers should bring the wait under
5% of the epoch; 0 workers (synchronous) waits the whole load time.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import jaxnitro as jn
from jaxnitro.loggers.jsonl import read_jsonl


class SlowSource:
    """Index-addressable; every ``batch_at`` sleeps ``load_s`` (GIL released) then gathers."""

    def __init__(self, n_batches: int, batch: int, load_s: float, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.x = rng.normal(size=(n_batches * batch, 784)).astype(np.float32)
        self.y = np.eye(10, dtype=np.float32)[rng.integers(0, 10, n_batches * batch)]
        self.n, self.batch, self.load_s = n_batches, batch, load_s

    def __len__(self) -> int:
        return self.n

    def begin_epoch(self, epoch: int) -> None:
        pass

    def batch_at(self, i: int) -> dict:
        time.sleep(self.load_s)
        sl = slice(i * self.batch, (i + 1) * self.batch)
        return {"img": self.x[sl], "label": self.y[sl]}

    def __iter__(self):
        return (self.batch_at(i) for i in range(self.n))


@jn.experiment
class Wide:
    hidden: jn.GraphConst[int] = 1024

    def build_model(self, key):
        return eqx.nn.MLP(784, 10, self.hidden, 2, key=key)

    def forward(self, model, state, *, img):
        return jax.vmap(model)(img), state

    def loss(self, logits, *, label):
        return -jnp.mean(jnp.sum(label * jax.nn.log_softmax(logits), -1))


def run(workers: int, args, source, run_dir: str) -> tuple[float, float]:
    data = {"train": jn.PrefetchIterator(source, workers=workers)}
    n = jn.Nitro(Wide(hidden=args.hidden), data=data, max_epochs=args.epochs, run_dir=run_dir)
    t = time.perf_counter()
    n.train()
    wall = (time.perf_counter() - t) / args.epochs
    lines = read_jsonl(Path(n.run_dir) / "metrics.jsonl")
    waits = [x["data_wait_frac"] for x in lines if x.get("context") == "data"][1:]  # epoch 1 compiles
    return statistics.median(waits), wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--load-ms", type=float, default=2.0)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=1024)
    args = parser.parse_args()
    source = SlowSource(args.batches, args.batch, args.load_ms / 1000)
    with tempfile.TemporaryDirectory() as run_dir:
        jn.Nitro(Wide(hidden=args.hidden), data={"train": source}, max_epochs=1, run_dir=run_dir, logger=None).train()
        t = time.perf_counter()
        step = jn.Nitro(Wide(hidden=args.hidden), data={"train": jn.NoPrefetch(SlowSource(args.batches, args.batch, 0.0))},
                        max_epochs=1, run_dir=run_dir, logger=None)
        step.train()
        step_ms = (time.perf_counter() - t) / args.batches * 1000
        print(f"load per batch {args.load_ms:.1f} ms; step without loading ~{step_ms:.1f} ms "
              f"(MLP 784-{args.hidden}-{args.hidden}-10, batch {args.batch}, {args.batches} steps/epoch)")
        print(f"{'workers':>8} {'data_wait_frac':>15} {'epoch s':>8}")
        for workers in (0, 1, 2, 4):
            wait, wall = run(workers, args, source, run_dir)
            print(f"{workers:>8} {wait:>15.3f} {wall:>8.2f}")


if __name__ == "__main__":
    main()
