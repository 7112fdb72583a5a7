"""Latency of the exported inference program against ``nitro.predict`` on the same batch.

The tutorial's model (its ``MLP``, 784-128-10, imported from the example), a serving handle (``jn.Nitro(e, data={})``) whose width is set by a
first predict of 100 rows, exported with ``nitro.export``. For batches of 1 and 100 rows,
the median wall time per call (after warm-up) of:

* ``nitro.predict({"img": x})``;
* the loaded export, ``f(img=x)`` (pads a narrower batch to the compiled width, as predict
  does, so its outputs are bitwise equal);
* ``f.jitted({"img": x})``: the exported program at the batch's own size (the batch
  dimension is symbolic), without the padding and host conversion.

    python bench/export.py [--calls 300] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

import jaxnitro as jn
from jaxnitro import GraphConst

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "mnist"))
from mnist_tutorial import MLP  # noqa: E402  the tutorial's network


@jn.experiment
class Mnist:
    width: GraphConst[int] = 128
    "Hidden width."

    def build_model(self, key):
        return MLP(self.width, key)

    def forward(self, model, state, *, img):
        return jax.vmap(model)(img), state

    def loss(self, logits, *, label):
        return -(label * jax.nn.log_softmax(logits)).sum(-1).mean()


def per_call(fn, calls: int, repeats: int) -> float:
    """Median over ``repeats`` of the mean seconds per call over ``calls`` calls."""
    for _ in range(20):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    x100 = rng.random((100, 784), dtype=np.float32)
    nitro = jn.Nitro(Mnist(), data={})
    nitro.predict({"img": x100})  # the compiled width: 100
    with tempfile.TemporaryDirectory() as tmp:
        f = jn.load_exported(nitro.export(tmp))
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, MLP 784-128-10, compiled width 100, "
          f"batch dim symbolic: {f.symbolic}")
    print(f"{'batch':>5}  {'predict (us)':>13}  {'export (us)':>12}  {'export/predict':>14}  "
          f"{'exported at own size (us)':>25}  bitwise")
    for n in (1, 100):
        x = x100[:n]
        same = np.array_equal(f(img=x), nitro.predict({"img": x}))
        t_pred = per_call(lambda: nitro.predict({"img": x}), args.calls, args.repeats)
        t_exp = per_call(lambda: f(img=x), args.calls, args.repeats)
        t_raw = per_call(lambda: jax.block_until_ready(f.jitted({"img": x})), args.calls, args.repeats)
        print(f"{n:>5}  {t_pred * 1e6:>13.1f}  {t_exp * 1e6:>12.1f}  {t_exp / t_pred:>14.2f}  {t_raw * 1e6:>25.1f}  {same}")


if __name__ == "__main__":
    main()
