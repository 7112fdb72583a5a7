"""``jn.ArraySource``: batches read from NumPy arrays, in memory or memory-mapped.

Entry point ``array_source``. It exports :class:`ArraySource` as
``jaxnitro.ArraySource`` (through ``jaxnitro_exports``) and implements no other
hook: an ``ArraySource`` already is a jaxnitro source, so no adapter is needed.

An ``ArraySource`` is *index-addressable* (``begin_epoch`` / ``batch_at``), so
several producer threads can read it and a fixed seed reproduces a run bit for
bit at any worker count:

* ``begin_epoch(epoch)`` fixes the epoch's plan: with ``shuffle`` a permutation
  of the rows drawn from ``numpy.random.default_rng((seed, epoch))``, cut into
  batches, each batch's rows sorted ascending; without it, the rows in order;
* ``batch_at(i)`` reads batch ``i`` of that plan with ONE fancy index per field
  (a slice when unshuffled), whatever the storage.

Sorting a batch's rows makes a memory-mapped read walk the file forward (and
keeps in-memory gathers cache-friendly); the batch holds the same rows as the
unsorted permutation would, so it changes no statistics. A memory-mapped field
(``np.load(path, mmap_mode="r")``, ``np.memmap``) is never read whole: each
batch copies only its rows, in the producer thread, so a data set larger than
memory streams.

**Seed.** A source built without ``seed=`` takes its order from the run's
``seed`` knob: jaxnitro calls :meth:`ArraySource.bind_seed` once at setup, so
``jn.train(e, seed=1)`` and ``seed=0`` read different orders (and the default
run seed 0 reads the order of :data:`DEFAULT_SEED`). An explicit ``seed=`` wins:
the order then stays the same whatever the run's seed (``seed=self.data_seed``
from an experiment field fixes the data order while a sweep varies the rest).
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from jaxnitro.plugin import ProcessPart, aligned, check_epoch, hookimpl, split_by_process

__all__ = ["DEFAULT_SEED", "ArraySource"]

DEFAULT_SEED = 0
"""The shuffle seed of an ``ArraySource`` built without ``seed=``."""


def _is_mapped(a: np.ndarray) -> bool:
    """Whether ``a`` (or an array it views) is backed by a memory-mapped file."""
    while a is not None:
        if isinstance(a, (np.memmap, mmap.mmap)):
            return True
        a = getattr(a, "base", None)
    return False


def _check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"ArraySource: {name} must be an int >= {low}, got {value!r}")
    return int(value)


class ArraySource:
    """Batches of ``batch_size`` rows gathered from a dict of equal-length arrays.

    ``jn.ArraySource({"img": x, "label": y}, batch_size=100, shuffle=True, drop_last=True, seed=0)``

    **Arguments:**

    - ``fields``: ``{field name: array}``, batch dimension first; every array
      has the same number of rows. The names become the batch fields the hooks
      receive (``def loss(self, outputs, *, label)``). A ``np.memmap`` (what
      ``np.load(path, mmap_mode="r")`` returns) stays on disk; anything else is
      converted with ``np.asarray``.
    - ``batch_size``: rows per batch, an int >= 1.
    - ``shuffle``: a new row order every epoch (default ``False``: rows in order).
    - ``drop_last``: drop a final batch shorter than ``batch_size`` (default
      ``False``). The ``train`` split must drop it; evaluation splits may keep it.
    - ``seed``: the shuffle seed, an int >= 0; ``None`` (default): the run's
      ``seed`` knob once jaxnitro sets the run up (:meth:`bind_seed`),
      :data:`DEFAULT_SEED` until then. Epoch ``e`` uses
      ``default_rng((seed, e))``, so two sources with the same seed give the same
      epochs and every epoch differs.

    ``len()`` is the number of batches per epoch. Before the first
    ``begin_epoch`` the plan is epoch 0's. Batches of an unshuffled in-memory
    source are views of the arrays (do not write into them); every other batch
    is a fresh array. ``prefetch_workers`` is 0 for arrays in memory (gathering
    costs microseconds: threads would only contend for the GIL) and unset when
    a field is memory-mapped, so jaxnitro's default producer threads overlap
    the disk reads.

    **Raises:** ``ValueError`` naming the field for an empty dict, a scalar
    field or a row-count mismatch; ``ValueError`` for a bad ``batch_size`` or
    ``seed``, or when no batch results (fewer rows than ``batch_size`` with
    ``drop_last``).
    """

    def __init__(
        self,
        fields: Mapping[str, Any],
        batch_size: int,
        *,
        shuffle: bool = False,
        drop_last: bool = False,
        seed: int | None = None,
    ):
        if not isinstance(fields, Mapping) or not fields:
            raise ValueError("ArraySource: fields must be a non-empty dict {field name: array}")
        self.batch_size = _check_int("batch_size", batch_size, 1)
        self.seed = DEFAULT_SEED if seed is None else _check_int("seed", seed, 0)
        self.seed_from = "the run's seed" if seed is None else "seed="
        """Where :attr:`seed` comes from: ``"seed="`` (given: :meth:`bind_seed` leaves it) or
        ``"the run's seed"`` (bound at setup)."""
        if not isinstance(shuffle, bool) or not isinstance(drop_last, bool):
            raise TypeError(
                f"ArraySource: shuffle and drop_last must be True or False, got "
                f"shuffle={shuffle!r}, drop_last={drop_last!r}"
            )
        self.shuffle, self.drop_last = shuffle, drop_last
        arrays: dict[str, np.ndarray] = {}
        mapped = []
        first = None
        for name, value in fields.items():
            a = value if isinstance(value, np.ndarray) else np.asarray(value)
            if a.ndim == 0:
                raise ValueError(
                    f"ArraySource: field {name!r} is a scalar; every field needs a leading batch axis"
                )
            if first is None:
                first = name
            elif len(a) != len(arrays[first]):
                raise ValueError(
                    f"ArraySource: field {name!r} has {len(a)} rows but field {first!r} has "
                    f"{len(arrays[first])}; all fields must have the same number of rows"
                )
            if _is_mapped(a):
                mapped.append(str(name))
            arrays[str(name)] = a
        self.fields = arrays
        self.mapped = tuple(mapped)
        """The memory-mapped fields (read batch by batch, never whole)."""
        self.rows = len(arrays[str(first)])
        full, part = divmod(self.rows, self.batch_size)
        self._len = full if drop_last or not part else full + 1
        if self._len == 0:
            raise ValueError(
                f"ArraySource: {self.rows} rows make no batch of batch_size={self.batch_size}"
                f"{' with drop_last' if drop_last else ''}; lower the batch size"
            )
        if not mapped:
            self.prefetch_workers = 0
        self._global_len = self._len  # batches of the whole data set (all processes)
        self._part = ProcessPart.of(0, 1, self.batch_size, self.rows, "ArraySource")  # the rows it reads
        self._lock = threading.Lock()
        self._plan: tuple[int, np.ndarray | None] = (0, None)
        self.begin_epoch(0)

    def __len__(self) -> int:
        return self._len

    @property
    def process(self) -> tuple[int, int]:
        """``(process_index, process_count)`` this source reads for (see :meth:`for_process`)."""
        return self._part.index, self._part.count

    @property
    def epoch(self) -> int:
        """The epoch whose plan ``batch_at`` serves."""
        return self._plan[0]

    def order(self, epoch: int) -> np.ndarray:
        """The rows epoch ``epoch`` reads, in reading order: batch ``i`` is
        ``order[i * batch_size:(i + 1) * batch_size]`` (rows dropped by
        ``drop_last`` are absent)."""
        plan = self._make_plan(epoch)
        used = min(self.rows, self._global_len * self.batch_size)
        return np.arange(used) if plan is None else plan

    def columns(self) -> dict[str, np.ndarray] | None:
        """The fields as in-memory arrays, for a loop that gathers batches itself (on the
        device, by the rows of :meth:`order`; see ``jaxnitro.blocks``), or None when that would
        read differently: a memory-mapped field (never read whole) or a per-process part.

        On the CPU backend each field is C-contiguous and 64-byte aligned, so that it is used
        in place: the field itself when it already is, else a copy made on the first call and
        kept (later runs copy nothing). Batches then come from these arrays too, so write
        into the fields after training with ``steps_per_dispatch`` > 1 has begun and the
        source keeps reading the copy: build a new source for new data. (An accelerator
        copies the fields to its memory anyway: there they are returned as they are.)"""
        if self.mapped or self.process != (0, 1):
            return None
        if jax.default_backend() == "cpu":
            with self._lock:
                self.fields = {name: aligned(a) for name, a in self.fields.items()}
        return dict(self.fields)

    def _make_plan(self, epoch: int) -> np.ndarray | None:
        if not self.shuffle:
            return None
        b, full = self.batch_size, self.rows // self.batch_size
        perm = np.random.default_rng((self.seed, epoch)).permutation(self.rows)
        perm = perm[: self._global_len * b]  # drop_last drops the rows of the partial batch
        head = perm[: full * b].reshape(full, b)
        head.sort(axis=1)  # in place: each batch's rows ascending (a forward read of a memmap)
        perm[full * b :].sort()
        return perm

    def bind_seed(self, seed: int) -> None:
        """Take the run's ``seed`` as the shuffle seed, unless ``seed=`` was given.

        jaxnitro calls it once at setup, before any epoch is read (the source contract's
        optional ``bind_seed``). A negative run seed is taken modulo 2**64 (NumPy seeds are
        non-negative); 0 is :data:`DEFAULT_SEED`. The current epoch's plan is redrawn."""
        if self.seed_from == "seed=":
            return
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise TypeError(f"ArraySource.bind_seed: the seed must be an int, got {seed!r}")
        self.seed = int(seed) % 2**64
        self.begin_epoch(self.epoch)

    def begin_epoch(self, epoch: int) -> None:
        """Fix epoch ``epoch``'s plan (a function of ``(seed, epoch)`` only)."""
        epoch = check_epoch(epoch)
        plan = self._make_plan(epoch)
        with self._lock:  # serialize writers; batch_at reads the tuple in one load
            self._plan = (epoch, plan)

    def batch_at(self, i: int) -> dict[str, np.ndarray]:
        """Batch ``i`` (``0 <= i < len(self)``) of the current epoch; else ``IndexError``."""
        if not 0 <= i < self._len:
            raise IndexError(f"ArraySource: batch {i} out of range [0, {self._len})")
        return self._read(self._plan[1], int(i))

    def for_process(self, process_index: int, process_count: int) -> "ArraySource":
        """This source as process ``process_index`` of ``process_count`` reads it in a
        multi-process job (jaxnitro calls it for the splits ``build_data`` returns).

        Every process draws the same epoch plan (the same ``seed``); of every batch of
        ``batch_size`` rows, process ``p`` reads the ``p``-th of ``process_count`` equal
        parts, so the processes' parts put together are the one-process batch, row for row.
        Batches are ``batch_size // process_count`` rows; a partial final batch is cut the
        same way (a process whose part of it is empty has one batch fewer). A memory-mapped
        field is read only at this process's rows.

        Raises ``ValueError`` when ``batch_size`` does not divide by ``process_count``.
        """
        used = min(self.rows, self._global_len * self.batch_size)
        return split_by_process(
            self, process_index, process_count,
            lambda: ProcessPart.of(process_index, process_count, self.batch_size, used, "ArraySource"),
            self._global_len, "ArraySource",
        )

    def _read(self, plan: np.ndarray | None, i: int) -> dict[str, np.ndarray]:
        start, stop = self._part.span(i)
        if plan is None:
            return {
                k: np.array(a[start:stop]) if k in self.mapped else a[start:stop]
                for k, a in self.fields.items()
            }
        idx = plan[start:stop]
        return {k: np.asarray(a[idx]) for k, a in self.fields.items()}

    def __iter__(self):
        """The current epoch's batches in order (the plan is read once, at the start)."""
        plan = self._plan[1]
        for i in range(self._len):
            yield self._read(plan, i)

    def __repr__(self) -> str:
        shapes = ", ".join(
            f"{k}: {a.dtype}{list(a.shape[1:])}{' (mmap)' if k in self.mapped else ''}"
            for k, a in self.fields.items()
        )
        part = f", process={self.process[0]} of {self.process[1]}" if self.process[1] > 1 else ""
        return (
            f"ArraySource({{{shapes}}}, rows={self.rows}, batch_size={self.batch_size}, "
            f"batches={self._len}, shuffle={self.shuffle}, drop_last={self.drop_last}, "
            f"seed={self.seed}{part})"
        )


@hookimpl(trylast=True)
def jaxnitro_exports():
    return {"ArraySource": ArraySource}
