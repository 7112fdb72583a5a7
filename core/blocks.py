"""Blocks of ``k * accum`` batches for ``steps_per_dispatch`` = k > 1, read by row numbers.

With k steps per dispatch the host's own work per step (reading a batch, stacking k of
them, copying the block to the device) is what stands between the loop and the
throughput of one compiled ``lax.scan`` over the epoch. A *column source* lets the
loop skip it: its fields are in memory and its batches are rows picked by an epoch's
row order, so the fields the train hooks read are put on the device once per run and
a block is just its ``[k, accum, batch]`` array of row numbers. The ``train_block``
program gathers each micro-batch's rows inside its scan, next to the step that reads
them (:data:`ROWS`): the host sends a few kilobytes a block, and no block of data is
ever stacked or materialised whole. Measured on the tutorial's MLP on the CPU backend:
at k=32, 2,650 steps/s gathered in the program against 2,000 gathered by NumPy on the
host (which then copies every block into the program's arguments).

On the CPU backend the device array of a field is the host array itself when NumPy's
buffer is 64-byte aligned (``device_put(..., may_alias=True)`` then copies nothing; XLA
needs that alignment), else one aligned NumPy copy per run: ~15 ms for the 172 MB of
55,000 MNIST images on an idle machine, but 200-370 ms measured when fresh memory is
scarce (page faults), against ~100 ms for ``jax.device_put`` of the unaligned array. So
``jn.ArraySource.columns()`` returns aligned arrays on the CPU backend, copied once per
source.

The contract (an optional part of a source's, see
:mod:`jaxnitro.source_contract`): ``columns()`` returns ``{field: in-memory array}``
(or None when it cannot, e.g. memory-mapped fields), ``order(epoch)`` the epoch's row
order, and ``batch_size`` its rows per batch, such that batch ``i`` of epoch ``e`` is
``{f: columns[f][order(e)[i * batch_size:(i + 1) * batch_size]]}``, exactly what
``batch_at(i)`` returns after ``begin_epoch(e)``. ``jn.ArraySource`` keeps it. The
values are those of the host path, so results are bitwise those of ``k = 1``.

In: the train source, the fields the train hooks read. Out: :class:`ColumnBlocks`, or
None (a source without columns, a sharded run, fields over :data:`MAX_DEVICE_BYTES`):
the loop then reads batch by batch and stacks them on the host.
"""

from __future__ import annotations

import jax
import numpy as np

from .routing import KEY_COUNT

__all__ = ["ColumnBlocks", "MAX_DEVICE_BYTES", "ROWS", "ALIGN", "aligned"]

MAX_DEVICE_BYTES = 1 << 30
"""The most bytes of train fields put on the device for gathering (1 GiB); larger data is
staged from the host batch by batch."""

ROWS = "__jaxnitro_rows__"
"""The batch entry of a gathered block: ``[k, accum, batch]`` int32 row numbers into the
device columns, replacing the fields themselves."""


ALIGN = 64
"""The byte alignment XLA's CPU backend needs to use a host buffer in place."""


def aligned(a: np.ndarray) -> np.ndarray:
    """``a`` itself when C-contiguous and :data:`ALIGN`-byte aligned, else a copy that is
    (on the CPU backend, ``device_put(..., may_alias=True)`` of it then copies nothing).
    A column source can keep such copies itself (``jn.ArraySource`` does), so that runs
    after the first copy nothing."""
    if a.flags.c_contiguous and a.ctypes.data % ALIGN == 0:
        return a
    buf = np.empty(a.nbytes + ALIGN, np.uint8)
    start = -buf.ctypes.data % ALIGN
    out = buf[start : start + a.nbytes].view(a.dtype).reshape(a.shape)
    np.copyto(out, a)
    return out


class ColumnBlocks:
    """The train fields of a column source, on the device; blocks and single batches by row.

    ``device`` is ``{field: device array}`` (the ``columns`` argument of ``train_block``).
    ``block(epoch, i, count)`` is the block of ``epoch`` from batch ``i`` on (a segment
    starts anywhere: after a cut, or at a resumed run's position) as
    ``{ROWS: [k, accum, batch] int32}``, with ``KEY_COUNT`` ``[k, accum]`` micro-batch
    numbers from ``count`` when ``keyed``; ``batch(epoch, i, count)`` is batch ``i`` on
    the host, for the epoch's remainder steps.
    """

    def __init__(self, columns: dict, order, batch_size: int, k: int, accum: int, keyed: bool):
        self.host = columns
        self.device = {f: jax.device_put(aligned(c), may_alias=True) for f, c in columns.items()}
        self.order, self.width = order, batch_size
        self.k, self.accum, self.keyed = k, accum, keyed
        self._epoch, self._rows = None, None

    @classmethod
    def of(cls, source, fields, k: int, accum: int, keyed: bool, sharded: bool) -> "ColumnBlocks | None":
        """For the unwrapped train ``source`` and the ``fields`` its hooks read, or None when the
        source offers no columns, when ``sharded`` (a data mesh: blocks are sharded from the
        host batch by batch), or when the fields exceed :data:`MAX_DEVICE_BYTES`."""
        columns = getattr(source, "columns", None)
        if sharded or not callable(columns) or not callable(getattr(source, "order", None)):
            return None
        all_columns = columns()
        if all_columns is None:
            return None
        needed = {f: np.asarray(all_columns[f]) for f in fields if f in all_columns}
        if not needed or sum(a.nbytes for a in needed.values()) > MAX_DEVICE_BYTES:
            return None
        return cls(needed, source.order, int(source.batch_size), k, accum, keyed)

    def _epoch_rows(self, epoch: int) -> np.ndarray:
        if self._epoch != epoch:
            self._epoch, self._rows = epoch, np.asarray(self.order(epoch), np.int32)
        return self._rows

    def block(self, epoch: int, index: int, count: int) -> dict:
        """The ``k * accum`` batches of ``epoch`` from batch ``index`` on, as row numbers."""
        size = self.k * self.accum
        rows = self._epoch_rows(epoch)[index * self.width : (index + size) * self.width]
        block = {ROWS: rows.reshape(self.k, self.accum, self.width)}
        if self.keyed:
            block[KEY_COUNT] = np.arange(count, count + size, dtype=np.uint32).reshape(self.k, self.accum)
        return block

    def batch(self, epoch: int, i: int, count: int) -> dict:
        rows = self._epoch_rows(epoch)[i * self.width : (i + 1) * self.width]
        batch = {f: col[rows] for f, col in self.host.items()}
        if self.keyed:
            batch[KEY_COUNT] = np.uint32(count)
        return batch
