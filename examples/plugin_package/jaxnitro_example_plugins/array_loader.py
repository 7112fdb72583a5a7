"""A loader over in-memory arrays, and the jaxnitro adapter that turns it into a data source.

Registered as the entry point ``array_loader`` in group ``jaxnitro``.

:class:`ArrayLoader` describes how to batch a dict of equal-length arrays
(``{"x": X, "label": Y}`` plus a batch size): it is what a user hands over
instead of building batch dicts themselves. It is not itself a jaxnitro
source (it has no ``len()`` and is not iterable); jaxnitro calls the hook
:func:`jaxnitro_adapt_source` for every split it is given, and this plugin
answers for an ``ArrayLoader`` with an :class:`ArraySource`, which is one:

* ``len(source)`` batches per epoch; each batch a dict with the loader's field
  names, NumPy arrays with the batch dimension first;
* index-addressable: ``begin_epoch(epoch)`` fixes the epoch's row order (a
  permutation drawn from ``(seed, epoch)`` when shuffling, so a run is
  reproducible and every epoch differs), then ``batch_at(i)`` returns the
  ``i``-th batch of that epoch, deterministic and thread-safe;
* ``prefetch_workers = 0``: gathering rows from memory is cheap, so jaxnitro's
  prefetcher makes the batches in its consumer thread.

What depends on the split (the ``split`` argument of the hook): with
``drop_last=None`` (the default) the ``"train"`` split drops its partial final
batch (jaxnitro requires it) and the other splits keep it (jaxnitro pads it for
evaluation); with ``shuffle=None`` (the default) only ``"train"`` is shuffled.
Any other object is not ours: the hook returns ``None``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxnitro.plugin import IndexedSource, hookimpl  # a plugin imports only jaxnitro and jaxnitro.plugin

__all__ = ["ArrayLoader", "ArraySource", "jaxnitro_adapt_source"]


class ArrayLoader:
    """Batches of ``batch_size`` rows from a dict of equal-length arrays.

    **Arguments:**

    - `arrays`: ``{field name: array-like}``; every value converts to a NumPy
        array with at least one dimension, and all share their first dimension
        (the rows). The field names become the batch fields the experiment's
        hooks receive (``def forward(self, model, state, *, x)``).
    - `batch_size`: rows per batch, a positive int.
    - `shuffle`: reorder the rows every epoch; ``None`` (default) shuffles the
        ``"train"`` split only.
    - `seed`: the shuffle seed; epoch ``e`` uses the permutation drawn from
        ``numpy.random.default_rng((seed, e))``.
    - `drop_last`: drop a final batch of fewer than ``batch_size`` rows;
        ``None`` (default) drops it for ``"train"`` and keeps it elsewhere.

    Raises ``ValueError`` (naming the field) for an empty dict, a scalar field,
    fields of different lengths, or a batch size below 1.
    """

    def __init__(
        self,
        arrays: Mapping[str, Any],
        batch_size: int,
        *,
        shuffle: bool | None = None,
        seed: int = 0,
        drop_last: bool | None = None,
    ):
        if not isinstance(arrays, Mapping) or not arrays:
            raise ValueError("ArrayLoader: `arrays` must be a non-empty dict {field name: array}.")
        self.arrays = {str(k): np.asarray(v) for k, v in arrays.items()}
        lengths = {}
        for name, a in self.arrays.items():
            if a.ndim == 0:
                raise ValueError(f"ArrayLoader: field {name!r} is a scalar; every field needs a first (row) dimension.")
            lengths[name] = a.shape[0]
        if len(set(lengths.values())) > 1:
            raise ValueError(f"ArrayLoader: the fields disagree on the number of rows: {lengths}.")
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"ArrayLoader: batch_size must be a positive int, got {batch_size!r}.")
        self.rows = next(iter(lengths.values()))
        self.batch_size = int(batch_size)
        self.shuffle = shuffle
        self.seed = int(seed)
        self.drop_last = drop_last

    def __repr__(self) -> str:
        return (
            f"ArrayLoader(fields={list(self.arrays)}, rows={self.rows}, batch_size={self.batch_size}, "
            f"shuffle={self.shuffle}, seed={self.seed}, drop_last={self.drop_last})"
        )

    def source(self, split: str = "train") -> ArraySource:
        """The :class:`ArraySource` for ``split`` (what the adapter hook returns for it)."""
        shuffle = (split == "train") if self.shuffle is None else bool(self.shuffle)
        drop_last = (split == "train") if self.drop_last is None else bool(self.drop_last)
        return ArraySource(self, shuffle=shuffle, drop_last=drop_last)


class ArraySource:
    """A jaxnitro data source over an :class:`ArrayLoader`'s arrays (see the module docstring).

    ``len()`` is the number of batches per epoch: ``rows // batch_size`` with
    ``drop_last``, else ``ceil(rows / batch_size)``. Before the first
    ``begin_epoch`` the rows are in their original order. Iterating yields the
    current epoch's batches in order. Raises ``ValueError`` when there would be
    no batch at all (fewer rows than ``batch_size`` with ``drop_last``).
    """

    prefetch_workers = 0

    def __init__(self, loader: ArrayLoader, *, shuffle: bool, drop_last: bool):
        self.loader, self.shuffle, self.drop_last = loader, shuffle, drop_last
        rows, b = loader.rows, loader.batch_size
        self._len = rows // b if drop_last else -(-rows // b)
        if self._len == 0:
            raise ValueError(
                f"ArrayLoader: {rows} rows make no batch of batch_size={b}"
                f"{' with drop_last' if drop_last else ''}; lower the batch size."
            )
        self._order = np.arange(rows)
        self.epoch: int | None = None

    def __len__(self) -> int:
        return self._len

    def begin_epoch(self, epoch: int) -> None:
        """Fix epoch ``epoch``'s row order: a permutation from ``(seed, epoch)``, or the identity."""
        self.epoch = int(epoch)
        rows = self.loader.rows
        if self.shuffle:
            self._order = np.random.default_rng((self.loader.seed, self.epoch)).permutation(rows)
        else:
            self._order = np.arange(rows)

    def batch_at(self, i: int) -> dict:
        """The ``i``-th batch of the current epoch, ``0 <= i < len(self)``; else ``IndexError``."""
        if not 0 <= i < self._len:
            raise IndexError(f"ArraySource: batch {i} of {self._len}")
        b = self.loader.batch_size
        rows = self._order[i * b : (i + 1) * b]
        return {name: a[rows] for name, a in self.loader.arrays.items()}

    def __iter__(self):
        order = self._order  # one epoch's plan, even if begin_epoch runs meanwhile
        b = self.loader.batch_size
        for i in range(self._len):
            rows = order[i * b : (i + 1) * b]
            yield {name: a[rows] for name, a in self.loader.arrays.items()}


@hookimpl
def jaxnitro_adapt_source(source: Any, split: str | None) -> IndexedSource | None:
    """Return ``source.source(split)`` for an :class:`ArrayLoader`; ``None`` for anything else."""
    if isinstance(source, ArrayLoader):
        return source.source(split)
    return None
