"""What happens when a source's ``len()`` lies: one less, or one more, than the batches it has.

Each kind of source (a plain iterable, an index-addressable one, a torch ``DataLoader`` over
a dataset whose ``__len__`` lies, a torch ``IterableDataset`` with a lying ``__len__``, a grain
``MapDataset`` over a sequence whose ``__len__`` lies) is read in each position (the train
split at ``steps_per_dispatch`` 1 and 2, the ``val`` split with and without a ``monitor``,
``evaluate("test")``) behind each wrapper (the default ``PrefetchIterator``,
``PrefetchIterator(workers=0)``, ``PrefetchIterator(workers=3, ordered=False)``,
``NoPrefetch``). One line per case: the exception's type and the start of its message, or
``SILENT`` when the run ends without a word (with how many batches the split served).

    python bench/lying_len.py            # every case
    python bench/lying_len.py torch      # only the kinds whose name contains "torch"

The torch and grain kinds are left out when the package is not installed.

Measured (120 cases): before the check one past the end, 35 ended without a word, every
one a ``len()`` one short over an index-addressable source (a custom one behind each
wrapper, a ``jn.ArraySource`` subclass, a torch map-style dataset, a grain ``MapDataset``);
the iterated kinds were refused both ways. After it, none: each is a
``SourceLengthError`` naming the split (at setup for ``train``/``val``, at the pass's end
for ``test``).
"""

from __future__ import annotations

import os
import sys
import tempfile
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import numpy as np  # noqa: E402

import jaxnitro as jn  # noqa: E402
import jaxnitro.exports  # noqa: E402,F401
from tiny import Tiny, make_arrays, tiny_data  # noqa: E402

BATCH = 16


@jn.experiment
class Monitored(Tiny):
    """Tiny with a monitored metric: setup runs the first val batch through the programs."""

    def monitor(self):
        return ("loss", "min")


class Counting:
    """Counts the batches a source served (reset per case)."""

    served = 0


class Iterated:
    """A plain iterable: ``len()`` says ``length``; ``__iter__`` yields every batch of ``batches``."""

    def __init__(self, batches, length):
        self.batches, self.length = batches, length

    def __len__(self):
        return self.length

    def __iter__(self):
        for b in self.batches:
            Counting.served += 1
            yield b


class Addressable:
    """``batch_at``/``begin_epoch`` over a list (``IndexError`` past its end); ``len()`` says ``length``."""

    def __init__(self, batches, length):
        self.batches, self.length = batches, length

    def __len__(self):
        return self.length

    def begin_epoch(self, epoch):
        pass

    def batch_at(self, i):
        b = self.batches[i]
        Counting.served += 1
        return b


def rows_of(batches):
    return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


def torch_map(batches, length):
    import torch

    rows = rows_of(batches)

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return length * BATCH

        def __getitem__(self, i):
            Counting.served += 1 if i % BATCH == 0 else 0
            return {k: v[i] for k, v in rows.items()}  # IndexError past the rows

    return torch.utils.data.DataLoader(Rows(), batch_size=BATCH)


def torch_iterable(batches, length):
    import torch

    rows = rows_of(batches)
    n = len(next(iter(rows.values())))

    class Rows(torch.utils.data.IterableDataset):
        def __len__(self):
            return length * BATCH

        def __iter__(self):
            for i in range(n):
                Counting.served += 1 if i % BATCH == 0 else 0
                yield {k: v[i] for k, v in rows.items()}

    return torch.utils.data.DataLoader(Rows(), batch_size=BATCH)


def grain_map(batches, length):
    import grain

    rows = rows_of(batches)

    class Seq:
        def __len__(self):
            return length * BATCH

        def __getitem__(self, i):
            Counting.served += 1 if i % BATCH == 0 else 0
            return {k: v[i] for k, v in rows.items()}

    return grain.MapDataset.source(Seq()).batch(BATCH, drop_remainder=True)


def array_source(batches, length):
    """A ``jn.ArraySource`` subclass whose ``__len__`` lies (its own ``len()`` cannot)."""

    class Lying(jn.ArraySource):
        def __len__(self):
            return length

    return Lying(rows_of(batches), batch_size=BATCH, shuffle=False)


KINDS = {
    "array-source": array_source,
    "iterable": Iterated,
    "addressable": Addressable,
    "torch-map": torch_map,
    "torch-iterable": torch_iterable,
    "grain-map": grain_map,
}

WRAPPERS = {
    "default": lambda s: s,
    "Prefetch(workers=0)": lambda s: jn.PrefetchIterator(s, workers=0),
    "Prefetch(workers=3,unordered)": lambda s: jn.PrefetchIterator(s, workers=3, ordered=False),
    "NoPrefetch": lambda s: jn.NoPrefetch(s),
}


def full_batches(n):
    x, y, oh = make_arrays(n * BATCH, seed=1)
    return [{"x": x[i:i + BATCH], "label": oh[i:i + BATCH], "y": y[i:i + BATCH]} for i in range(0, n * BATCH, BATCH)]


def case(kind: str, wrap: str, position: str, delta: int) -> str:
    real = 6 if position.startswith("train") else 3
    batches = full_batches(real)
    source = WRAPPERS[wrap](KINDS[kind](batches, real + delta))
    d = tiny_data()
    kw = {}
    experiment = Tiny
    if position.startswith("train"):
        data = {"train": source}
        if position == "train k=2":
            kw["steps_per_dispatch"] = 2
    elif position == "test":
        data = {"train": d["train"], "test": source}
    else:
        data = {"train": d["train"], "val": source}
    experiment = Monitored if position == "val+monitor" else Tiny
    Counting.served = 0
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            nitro = jn.train(experiment(max_epochs=1), data=data, logger=None, run_dir=tmp, **kw)
            if position == "test":
                Counting.served = 0
                nitro.evaluate("test")
        except Exception as exc:  # noqa: BLE001 - what the user sees is the point
            return f"{type(exc).__name__}: {str(exc)[:150]}"
        said = [str(w.message)[:150] for w in caught if "len()" in str(w.message)]
    if said:
        return f"WARNING: {said[0]}"
    return f"SILENT (served {Counting.served} batches, real {real}, len() {real + delta})"


def main() -> None:
    only = sys.argv[1] if len(sys.argv) > 1 else ""
    positions = ("train k=1", "train k=2", "val", "val+monitor", "test")
    for kind in KINDS:
        if only not in kind:
            continue
        try:
            KINDS[kind](full_batches(1), 1)
        except ImportError as exc:
            print(f"{kind}: skipped ({exc})")
            continue
        wraps = WRAPPERS if kind in ("iterable", "addressable") else {"default": WRAPPERS["default"]}
        for wrap in wraps:
            for position in positions:
                for delta in (-1, +1):
                    label = f"{kind:15s} {wrap:30s} {position:12s} len {'-1' if delta < 0 else '+1'}"
                    print(f"@ {label} -> {case(kind, wrap, position, delta)}", flush=True)


if __name__ == "__main__":
    main()
