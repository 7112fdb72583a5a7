"""How much does PrefetchIterator cost, or save, on a cheap in-memory source?

Prints batches/s (median of interleaved repeats) for consuming 2000 batches of
``{"img": (100, 784) float32, "label": (100, 10) float32}`` gathered by fancy
indexing from NumPy arrays (MNIST-sized), each copied to the device with
``jax.device_put``:

  plain        a loop calling batch_at(i) then jax.device_put, no prefetch
  workers=0    PrefetchIterator, produced in the consumer's thread
  workers=1    one producer thread
  workers=2    two producer threads
  NoPrefetch   the opt-out wrapper

With ``--step`` the consumer also runs a jitted 784-128-10 MLP SGD step on
each batch (the tutorial's model), which is the loop the framework runs. With
``--io-us N`` every batch_at also waits N microseconds with the GIL released
(``time.sleep``), standing in for a file read or a decode in native code: the
case producer threads are for.

    python bench/prefetch_overhead.py [--step] [--io-us 0] [--repeats 5] [--batches 2000]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxnitro import NoPrefetch
from jaxnitro.plugins.prefetch import PrefetchIterator


class ArraySource:
    """Index-addressable source over in-memory arrays, shuffled per epoch."""

    def __init__(self, n_batches: int, batch: int = 100, rows: int = 60_000, seed: int = 0, io_us: float = 0):
        rng = np.random.default_rng(seed)
        self.img = rng.random((rows, 784), dtype=np.float32)
        self.label = np.eye(10, dtype=np.float32)[rng.integers(0, 10, rows)]
        self.n, self.batch, self.rows, self.seed = n_batches, batch, rows, seed
        self.order = None
        self.io_s = io_us * 1e-6

    def __len__(self) -> int:
        return self.n

    def begin_epoch(self, epoch: int) -> None:
        rng = np.random.default_rng((self.seed, epoch))
        self.order = rng.integers(0, self.rows, self.n * self.batch)

    def batch_at(self, i: int) -> dict:
        if self.io_s:
            time.sleep(self.io_s)
        idx = self.order[i * self.batch : (i + 1) * self.batch]
        return {"img": self.img[idx], "label": self.label[idx]}

    def __iter__(self):
        return (self.batch_at(i) for i in range(self.n))


def make_step():
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {
        "w1": jax.random.normal(k1, (784, 128)) * 0.03,
        "b1": jnp.zeros(128),
        "w2": jax.random.normal(k2, (128, 10)) * 0.1,
        "b2": jnp.zeros(10),
    }

    def loss(p, img, label):
        h = jax.nn.relu(img @ p["w1"] + p["b1"])
        logits = h @ p["w2"] + p["b2"]
        return -jnp.mean(jnp.sum(label * jax.nn.log_softmax(logits), axis=-1))

    @jax.jit
    def step(p, img, label):
        g = jax.grad(loss)(p, img, label)
        return jax.tree.map(lambda a, b: a - 0.01 * b, p, g)

    return params, step


def run(kind: str, src: ArraySource, epoch: int, step) -> float:
    put = jax.device_put
    params, fn = step if step is not None else (None, None)
    last = None
    t0 = time.perf_counter()
    if kind == "plain":
        src.begin_epoch(epoch)
        for i in range(len(src)):
            last = put(src.batch_at(i))
            if fn is not None:
                params = fn(params, last["img"], last["label"])
    else:
        if kind == "NoPrefetch":
            wrapped = NoPrefetch(src)
        else:
            wrapped = PrefetchIterator(src, workers=int(kind.split("=")[1]))
        for last in wrapped.epoch(epoch, put):
            if fn is not None:
                params = fn(params, last["img"], last["label"])
    jax.block_until_ready(params if fn is not None else last)
    return len(src) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--step", action="store_true", help="run a jitted MLP step per batch")
    ap.add_argument("--io-us", type=float, default=0, help="GIL-free wait per batch_at, in microseconds")
    args = ap.parse_args()

    src = ArraySource(args.batches, io_us=args.io_us)
    step = make_step() if args.step else None
    kinds = ["plain", "workers=0", "workers=1", "workers=2", "NoPrefetch"]
    for k in kinds:  # warm up: compile, allocate
        run(k, ArraySource(50), 0, step)
    rates: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(args.repeats):
        for k in kinds:
            rates[k].append(run(k, src, r, step))
    print(
        f"jax {jax.__version__}, {jax.devices()[0].platform}, {args.batches} batches of (100, 784)+(100, 10) "
        f"float32, {'with' if step else 'without'} an MLP step, batch_at I/O wait {args.io_us:g} us, "
        f"median of {args.repeats}"
    )
    base = statistics.median(rates["plain"])
    for k in kinds:
        m = statistics.median(rates[k])
        print(f"  {k:<11} {m:9,.0f} batches/s  ({m / base:.2f}x plain)  [{min(rates[k]):,.0f} .. {max(rates[k]):,.0f}]")


if __name__ == "__main__":
    main()
