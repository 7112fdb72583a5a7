"""Blocks of ``k * accum`` batches for ``steps_per_dispatch`` = k > 1, read by row numbers.

With k steps per dispatch the host's own work per step (reading a batch, stacking k of
them, copying the block to the device) is what stands between the loop and the
throughput of one compiled ``lax.scan`` over the epoch. A *column source* lets the
loop read a whole block at once: its fields are in memory and its batches are rows
picked by an epoch's row order, so a block is ONE gather per field by a
``[k, accum, batch]`` array of row numbers, already in the block's layout (no
per-batch reads, no stacking copy):

* on an accelerator the fields the train hooks read are put on the device once per run
  and each block is gathered there by a small compiled program: the host sends a few
  kilobytes a block instead of the block;
* on the CPU backend the gather is NumPy's, on the host (measured on the tutorial's MLP:
  faster than XLA's gather there, and no copy of the data set per run).

The contract (an optional part of a source's, see
:mod:`jaxnitro.prefetch.contract`): ``columns()`` returns ``{field: in-memory array}``
(or None when it cannot, e.g. memory-mapped fields), ``order(epoch)`` the epoch's row
order, and ``batch_size`` its rows per batch, such that batch ``i`` of epoch ``e`` is
``{f: columns[f][order(e)[i * batch_size:(i + 1) * batch_size]]}``, exactly what
``batch_at(i)`` returns after ``begin_epoch(e)``. ``jn.ArraySource`` keeps it. The
values are those of the host path, so results are bitwise those of ``k = 1``.

In: the train source, the fields the train hooks read. Out: :class:`ColumnBlocks`, or
None (a source without columns, a sharded run): the loop then reads batch by batch and
stacks them on the host.
"""

from __future__ import annotations

import jax
import numpy as np

from .routing import KEY_COUNT

__all__ = ["ColumnBlocks", "MAX_DEVICE_BYTES"]

MAX_DEVICE_BYTES = 1 << 30
"""The most bytes of train fields put on the device for gathering (1 GiB); larger data is
staged from the host batch by batch."""


@jax.jit
def _gather(columns: dict, rows):
    """``{f: columns[f][rows]}`` with ``rows`` ``[k, accum, batch]``: one block, on the device."""
    return {f: col[rows] for f, col in columns.items()}


class ColumnBlocks:
    """The train fields of a column source (on the device when gathered there); blocks and
    single batches by row.

    ``block(epoch, b, count)`` is block ``b`` of ``epoch`` (batches ``b * k * accum`` on) as
    ``{field: [k, accum, batch, ...]}`` device arrays, with ``KEY_COUNT`` ``[k, accum]``
    micro-batch numbers from ``count`` when ``keyed``; ``batch(epoch, i, count)`` is batch
    ``i`` on the host, for the epoch's remainder steps.
    """

    def __init__(self, columns: dict, order, batch_size: int, k: int, accum: int, keyed: bool, on_device: bool):
        self.host = columns
        self.device = jax.device_put(columns) if on_device else None
        self.order, self.width = order, batch_size
        self.k, self.accum, self.keyed = k, accum, keyed
        self._epoch, self._rows = None, None

    @classmethod
    def of(cls, source, fields, k: int, accum: int, keyed: bool, sharded: bool, on_device: bool) -> "ColumnBlocks | None":
        """For the unwrapped train ``source`` and the ``fields`` its hooks read, or None when the
        source offers no columns or ``sharded`` (a data mesh: blocks are sharded from the host
        batch by batch). ``on_device``: gather on the device (an accelerator), unless the
        fields exceed :data:`MAX_DEVICE_BYTES` (then on the host)."""
        columns = getattr(source, "columns", None)
        if sharded or not callable(columns) or not callable(getattr(source, "order", None)):
            return None
        all_columns = columns()
        if all_columns is None:
            return None
        needed = {f: np.asarray(all_columns[f]) for f in fields if f in all_columns}
        if not needed:
            return None
        on_device = on_device and sum(a.nbytes for a in needed.values()) <= MAX_DEVICE_BYTES
        return cls(needed, source.order, int(source.batch_size), k, accum, keyed, on_device)

    def _epoch_rows(self, epoch: int) -> np.ndarray:
        if self._epoch != epoch:
            self._epoch, self._rows = epoch, np.asarray(self.order(epoch), np.int32)
        return self._rows

    def block(self, epoch: int, b: int, count: int) -> dict:
        size = self.k * self.accum
        rows = self._epoch_rows(epoch)[b * size * self.width : (b + 1) * size * self.width]
        rows = rows.reshape(self.k, self.accum, self.width)
        block = _gather(self.device, rows) if self.device is not None else {f: c[rows] for f, c in self.host.items()}
        if self.keyed:
            block[KEY_COUNT] = np.arange(count, count + size, dtype=np.uint32).reshape(self.k, self.accum)
        return block

    def batch(self, epoch: int, i: int, count: int) -> dict:
        rows = self._epoch_rows(epoch)[i * self.width : (i + 1) * self.width]
        batch = {f: col[rows] for f, col in self.host.items()}
        if self.keyed:
            batch[KEY_COUNT] = np.uint32(count)
        return batch
