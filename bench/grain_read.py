"""How fast batches come out of grain, read per record and per batch, next to ``jn.ArraySource``.

MNIST-shaped rows (784 float32 pixels, an int32 label), batches of 100, 12,000 rows (120
batches per epoch), the rows shuffled every epoch. Each line is the median of 5 epochs,
in batches per second, read in this thread unless it says "producers":

* ``grain ds[i]``: ``MapDataset.source(rows).seed(0).shuffle().batch(100)[i]``: grain's
  own per-record path (a ``__getitem__`` chain per row, then stacking);
* ``grain iter(to_iter_dataset())``: grain's iterator with its default read threads;
* ``GrainSource.batch_at``: the adapter, one batched ``_getitems`` call per batch, over a
  per-record source and over a source with batched reads (``_getitems`` doing one
  NumPy fancy index);
* ``PrefetchIterator(GrainSource, workers=k)``: the adapter under jaxnitro's producers;
* ``ArraySource.batch_at``: one fancy index per field over a shuffled plan, in memory and
  memory-mapped (``np.load(mmap_mode="r")``, page cache warm).

Run ``python bench/grain_read.py`` (needs grain and the jaxnitro plugins installed or on the
path: ``pip install -e .[grain]``).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROWS, BATCH, EPOCHS = 12_000, 100, 5


def data():
    rng = np.random.default_rng(0)
    return rng.random((ROWS, 784), dtype=np.float32), rng.integers(0, 10, ROWS).astype(np.int32)


class Rows:
    """A grain random-access source: one dict per row."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"img": self.x[i], "label": self.y[i]}


class BatchedRows(Rows):
    """The same rows, with grain's batched read: one fancy index for many rows."""

    def _getitems(self, indices):
        idx = np.asarray(indices)
        img, label = self.x[idx], self.y[idx]
        return [{"img": img[k], "label": label[k]} for k in range(len(idx))]


def rate(epoch_fn, n_batches: int) -> float:
    """Median batches/s over EPOCHS epochs; ``epoch_fn(epoch)`` reads one epoch."""
    epoch_fn(0)  # warm up
    times = []
    for e in range(1, EPOCHS + 1):
        t0 = time.perf_counter()
        epoch_fn(e)
        times.append(time.perf_counter() - t0)
    return n_batches / statistics.median(times)


def addressed(src):
    def epoch(e):
        src.begin_epoch(e)
        for i in range(len(src)):
            src.batch_at(i)

    return epoch


def main() -> None:
    import grain

    import jaxnitro as jn
    from jaxnitro.plugins.array_source import ArraySource
    from jaxnitro.plugins.grain_loader import GrainSource

    x, y = data()
    n = ROWS // BATCH

    def record(name, r):
        print(f"{name:58s} {r:9,.0f} batches/s", flush=True)

    ds = grain.MapDataset.source(Rows(x, y)).seed(0).shuffle().batch(BATCH, drop_remainder=True)
    record("grain ds[i] (per record)", rate(lambda e: [ds[e * n + i] for i in range(n)], n))

    def grain_iter(e):
        it = iter(ds.to_iter_dataset())
        for _ in range(n):
            next(it)

    record("grain iter(to_iter_dataset()), default read threads", rate(grain_iter, n))
    record("GrainSource.batch_at, per-record source", rate(addressed(GrainSource(ds)), n))
    batched = grain.MapDataset.source(BatchedRows(x, y)).seed(0).shuffle().batch(BATCH, drop_remainder=True)
    record("GrainSource.batch_at, source with batched reads", rate(addressed(GrainSource(batched)), n))
    for workers in (1, 2):
        p = jn.PrefetchIterator(GrainSource(batched), workers=workers)
        record(f"PrefetchIterator(GrainSource, batched reads), {workers} producers",
               rate(lambda e, p=p: [None for _ in p.epoch(e)], n))

    ram = ArraySource({"img": x, "label": y}, BATCH, shuffle=True, drop_last=True)
    record("ArraySource.batch_at, in memory", rate(addressed(ram), n))
    with tempfile.TemporaryDirectory() as tmp:
        np.save(Path(tmp) / "img.npy", x)
        np.save(Path(tmp) / "label.npy", y)
        mm = {k: np.load(Path(tmp) / f"{k}.npy", mmap_mode="r") for k in ("img", "label")}
        disk = ArraySource(mm, BATCH, shuffle=True, drop_last=True)
        record("ArraySource.batch_at, memory-mapped (page cache warm)", rate(addressed(disk), n))
    print(f"\n{ROWS} rows, batch {BATCH}, median of {EPOCHS} epochs; python {sys.version.split()[0]}, "
          f"numpy {np.__version__}, grain {grain.__version__}")


if __name__ == "__main__":
    main()
