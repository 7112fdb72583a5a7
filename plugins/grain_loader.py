"""Adapt grain data pipelines: ``jn.GrainSource`` and ``jn.GrainStream``.

Entry point ``grain_loader``. A split that ``build_data`` returns as a grain
pipeline is adapted through ``jaxnitro_adapt_source``:

* a ``grain.MapDataset`` whose elements are batches (it has a ``.batch(...)``)
  becomes a :class:`GrainSource`, *index-addressable*: several producer
  threads read it, delivery is ordered, a run is reproducible bit for bit at
  any worker count;
* a ``grain.IterDataset`` or a ``grain.DataLoader`` becomes a
  :class:`GrainStream`, iterated by one producer (an iterator cannot be
  shared); its ``prefetch_note`` says so. When the pipeline does not make the
  batches per pass certain (a filter, an endless sampler or repeat, ...) it is a
  stream without ``len()``: each pass an epoch that ends when grain's iterator
  does, for a run bounded by ``max_steps``.

A ``MapDataset`` of single records is refused, naming the fix
(``.batch(batch_size, drop_remainder=True)``, or
``jn.GrainSource(ds, batch_size=...)``).

**Epochs.** jaxnitro's epoch ``e`` of a ``GrainSource`` is grain's epoch
``e``: batch ``i`` is ``ds[e * len(ds) + i]``. grain's global shuffle reseeds
each epoch (seed ``+ e``) and ``random_map`` draws per index, so every epoch
differs and the same pipeline seed repeats the run. A ``GrainStream`` starts a
fresh iterator each epoch: the pass grain's iterator makes from its start (all of
it, for a stream without ``len()``).

**Reading at batch level.** Each ``batch_at`` is one grain read of a whole
batch. When the pipeline ends in ``.batch(...)`` the records of the batch are
fetched with one batched call down the pipeline (grain's ``_getitems``,
which a source with batched reads, such as ``ArrayRecordDataSource``, serves
in one go) and stacked with the batch's ``batch_fn``: the same values as
``ds[index]``, without a per-record call chain. ``bench/grain_read.py``
measures the paths.

grain is imported only when a pipeline is adapted (``sys.modules``): this
module loads, registers and answers ``None`` without grain installed.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import structlog

from jaxnitro.plugin import (
    PassStates, ProcessPart, SourceLengthError, as_batch, check_epoch, check_fields, hookimpl, split_by_process,
)

__all__ = ["GrainSource", "GrainStream"]

log = structlog.get_logger("jaxnitro")


def _grain():
    try:
        import grain
    except ImportError as err:  # pragma: no cover - exercised without grain only
        raise ImportError(
            "jaxnitro: the grain adapter needs grain; install it with `pip install jaxnitro[grain]`"
        ) from err
    return grain


_FIX = "make the pipeline yield dicts (`.map(lambda r: {'x': r[0], 'label': r[1]})`), or name the parts: jn.GrainSource(ds, fields=('x', 'label'))"


def _as_batch(value: Any, fields: Sequence[str] | None, what: str) -> dict:
    """A grain element as a jaxnitro batch: a dict of NumPy arrays."""
    return as_batch(value, fields, what, _FIX, np.asarray)




# -- index-addressable: a batched MapDataset ---------------------------------------------


def _nodes(ds):
    """Every node of a pipeline (public ``parents``)."""
    seen, todo = [], [ds]
    while todo:
        node = todo.pop()
        seen.append(node)
        todo.extend(getattr(node, "parents", ()))
    return seen


def _hiding_sources(ds) -> list[tuple[str, int]]:
    """``(type name, len)`` of each data source at the pipeline's roots (grain's
    ``SourceMapDataset._source``) that serves ``source[len(source)]``: records past its
    ``__len__``, which grain (reading ``index % len``) never reads. Any exception there, or a
    grain whose internals differ, is a no."""
    found = []
    for node in _nodes(ds):
        src = getattr(node, "_source", None) if type(node).__name__ == "SourceMapDataset" else None
        if src is None:
            continue
        try:
            n = len(src)
            src[n]
        except Exception:  # noqa: BLE001 - the end of the source
            continue
        found.append((type(src).__name__, n))
    return found


def _is_batched(ds) -> bool:
    return any(type(n).__name__ in ("BatchMapDataset", "BatchIterDataset") for n in _nodes(ds))


def _batched_read(ds):
    """``index -> batch`` with the batch's records fetched in one batched call, or None.

    For a pipeline ending in ``.batch(...)`` (grain's ``BatchMapDataset``), the
    same records ``ds[index]`` reads, fetched with ``parent._getitems`` and
    stacked with the node's ``batch_fn`` (grain's own batched-read pushdown).
    Any other pipeline, or a grain whose internals differ, reads ``ds[index]``.
    """
    if type(ds).__name__ != "BatchMapDataset":
        return None
    try:
        parent = ds.parents[0]
        size, fn, getitems = int(ds._batch_size), ds._batch_fn, parent._getitems
    except (AttributeError, IndexError, TypeError):
        return None
    n_batches, n_records = len(ds), len(parent)

    def read(index: int):
        epoch, i = divmod(index, n_batches)
        start = epoch * n_records + i * size
        stop = epoch * n_records + min(n_records, (i + 1) * size)
        return fn(getitems(list(range(start, stop))))

    return read


class GrainSource:
    """An index-addressable jaxnitro source over a ``grain.MapDataset`` of batches.

    ``jn.GrainSource(grain.MapDataset.source(src).seed(0).shuffle().map(f).batch(100, drop_remainder=True))``

    **Arguments:**

    - ``dataset``: a ``grain.MapDataset`` whose elements are batches (it
      contains a ``.batch(...)``), or of records when ``batch_size`` is given.
      Elements are dicts of arrays (or tuples, with ``fields``).
    - ``batch_size``, ``drop_last``: batch a dataset of records here
      (``dataset.batch(batch_size, drop_remainder=drop_last)``).
    - ``fields``: names for the parts of tuple elements (``("x", "label")``).
    - ``workers``: producer threads jaxnitro runs for this split
      (``prefetch_workers``); default: jaxnitro's, ``min(4, cpus)``.

    ``len()`` is ``len(dataset)``, batches per epoch. ``begin_epoch(e)`` selects
    grain's epoch ``e`` (indices ``e * len .. (e + 1) * len - 1``);
    ``batch_at(i)`` reads batch ``i`` of it: the pipeline's own values, so its
    seed, shuffle, maps, random maps, slicing and batch function are honoured.
    Its randomness is the pipeline's (``ds.seed(...)``), not the run's ``seed``:
    grain refuses a shuffle or random map without a seed, so there is no unseeded
    order for the run's seed to fill in (no ``bind_seed``).

    **Raises:** ``TypeError`` for a non-``MapDataset`` or a dataset of records
    without ``batch_size``; ``ValueError`` for an empty dataset. ``batch_at``
    raises ``ValueError`` when grain returns ``None`` for a batch (a filter
    after ``.batch`` emptied it) and ``TypeError`` for an element that is not a
    dict (and no ``fields``).
    """

    def __init__(
        self,
        dataset: Any,
        *,
        batch_size: int | None = None,
        drop_last: bool = False,
        fields: Sequence[str] | None = None,
        workers: int | None = None,
    ):
        grain = _grain()
        if not isinstance(dataset, grain.MapDataset):
            hint = (
                "; an IterDataset or DataLoader is iterated: use jn.GrainStream"
                if isinstance(dataset, (grain.IterDataset, grain.DataLoader)) else ""
            )
            raise TypeError(f"GrainSource takes a grain.MapDataset, got {type(dataset).__name__}{hint}")
        if batch_size is not None:
            if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
                raise ValueError(f"GrainSource: batch_size must be an int >= 1, got {batch_size!r}")
            dataset = dataset.batch(batch_size, drop_remainder=bool(drop_last))
        elif not _is_batched(dataset):
            raise TypeError(
                f"GrainSource: this grain.MapDataset yields single records ({len(dataset)} of them), "
                f"not batches. Fix: batch it, `ds.batch(batch_size, drop_remainder=True)` (the train "
                f"split drops its partial batch), or pass jn.GrainSource(ds, batch_size=...)"
            )
        if workers is not None:
            if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
                raise ValueError(f"GrainSource: workers must be an int >= 0, got {workers!r}")
            self.prefetch_workers = workers
        self.dataset = dataset
        self.fields = check_fields(fields)
        self._len = len(dataset)
        if self._len == 0:
            raise ValueError("GrainSource: the grain.MapDataset has no batches (len 0)")
        if self._len >= sys.maxsize:
            raise ValueError(
                "GrainSource: the grain.MapDataset is endless (`.repeat()` with no count); drop the "
                "repeat: jaxnitro's epochs repeat the data, each epoch reshuffled by grain"
            )
        self._read = _batched_read(dataset) or dataset.__getitem__
        self._part = None  # a ProcessPart after for_process: this process's slice of every batch
        self._plan = (0, 0)  # (epoch, grain index of the epoch's batch 0)

    def __len__(self) -> int:
        return self._len

    @property
    def epoch(self) -> int:
        return self._plan[0]

    def begin_epoch(self, epoch: int) -> None:
        """Serve grain's epoch ``epoch``: indices ``epoch * len(self) + i``."""
        epoch = check_epoch(epoch)
        self._plan = (epoch, epoch * self._len)

    def batch_at(self, i: int) -> dict:
        """Batch ``i`` (``0 <= i < len(self)``) of the current epoch; else ``IndexError``.

        ``batch_at(len(self))``, jaxnitro's check one past the end, raises
        ``SourceLengthError`` instead when a data source at the pipeline's root serves a
        record at its own ``__len__`` (:func:`_hiding_sources`): grain reads a source modulo
        its length, so records past it would never be read."""
        if not 0 <= i < self._len:
            hiding = _hiding_sources(self.dataset) if i == self._len else []
            if hiding:
                name, n = hiding[0]
                raise SourceLengthError.hidden(
                    None, self._len, self.epoch,
                    f"its grain pipeline's data source ({name}) still serves a record at its "
                    f"__len__ of {n} (source[{n}] returned one), while grain reads it modulo that "
                    f"length",
                    "make the data source's __len__ return the number of records it serves, or make "
                    "its __getitem__ raise IndexError for an index >= __len__.",
                )
            raise IndexError(f"GrainSource: batch {i} out of range [0, {self._len})")
        epoch, offset = self._plan
        return self._batch(epoch, offset, int(i))

    def for_process(self, process_index: int, process_count: int) -> "GrainSource":
        """This source as process ``process_index`` of ``process_count`` reads it in a
        multi-process job (jaxnitro calls it for the splits ``build_data`` returns): of each of
        the pipeline's batches, process ``p`` keeps the ``p``-th of ``process_count`` equal row
        slices, so the parts put together are the one-process batch (see
        ``jaxnitro.distributed.ProcessPart``). grain assembles a batch whole, so each process
        reads every batch and keeps its slice; to read less, shard the records in the pipeline
        (e.g. ``ds[process_index::process_count]`` before ``.batch``) and hand each process its
        own pipeline (``build_data`` receives ``dist``).

        Raises ``ValueError`` when the first batch's rows do not divide by ``process_count``.
        """
        def part() -> ProcessPart:  # the batch width from the pipeline's first and last batches
            width = len(next(iter(self._batch(0, 0, 0).values())))
            last = len(next(iter(self._batch(0, 0, self._len - 1).values())))
            return ProcessPart.of(process_index, process_count, width, (self._len - 1) * width + last, "GrainSource")

        return split_by_process(self, process_index, process_count, part, self._len, "GrainSource")

    def _batch(self, epoch: int, offset: int, i: int) -> dict:
        if self._part is not None:
            start, stop = self._part.span(i)
            first = i * self._part.batch_size
            batch = self._whole(epoch, offset, i)
            return {k: v[start - first : stop - first] for k, v in batch.items()}
        return self._whole(epoch, offset, i)

    def _whole(self, epoch: int, offset: int, i: int) -> dict:
        value = self._read(offset + i)
        if value is None:
            raise ValueError(
                f"GrainSource: grain returned None for batch {i} of epoch {epoch} (a filter emptied "
                f"it). A MapDataset with a filter is not index-addressable: filter before batching "
                f"on an IterDataset (ds.to_iter_dataset().batch(...)), handed over as jn.GrainStream"
            )
        return _as_batch(value, self.fields, f"grain batch {i} of epoch {epoch}")

    def __iter__(self):
        """The current epoch's batches in order (the epoch is read once, at the start)."""
        epoch, offset = self._plan
        for i in range(self._len):
            yield self._batch(epoch, offset, i)

    def __repr__(self) -> str:
        part = "" if self._part is None else f", process={self._part.index} of {self._part.count}"
        return f"GrainSource({len(self)} batches, epoch {self.epoch}{part}, {self.dataset})"


# -- iterated: an IterDataset or a DataLoader ------------------------------------------------

# IterDataset nodes that yield one element per parent element.
_ONE_TO_ONE = {
    "MapIterDataset", "RandomMapIterDataset", "MapWithIndexIterDataset", "PrefetchIterDataset",
    "ThreadPrefetchIterDataset", "WithOptionsIterDataset", "_WithSeedIterDataset",
}
_SPARSE_MAP = {"FilterMapDataset", "FlatMapMapDataset"}  # yield None, which to_iter_dataset skips


def _batches(records: int, size: int, drop: bool) -> int:
    return records // size if drop else -(-records // size)


def _iter_length(ds, grain) -> int | None:
    """Batches one pass of an IterDataset yields, when the pipeline makes it certain.

    A chain of one-to-one nodes, at most one ``batch``, over a MapDataset with no
    filter; ``mp_prefetch`` only below the batch (each worker would batch its own share).
    """
    node, batch = ds, None
    while not isinstance(node, grain.MapDataset):
        name = type(node).__name__
        if name == "BatchIterDataset":
            if batch is not None:
                return None
            batch = (int(node._batch_size), bool(node._drop_remainder))
        elif not (name in _ONE_TO_ONE or (name == "ProcessPrefetchIterDataset" and batch is not None)):
            return None
        parents = getattr(node, "parents", ())
        if len(parents) != 1:
            return None
        node = parents[0]
    if any(type(n).__name__ in _SPARSE_MAP for n in _nodes(node)):
        return None
    records = len(node)
    return records if batch is None else _batches(records, *batch)


def _loader_length(loader, grain) -> int | None:
    """Batches one pass of a ``grain.DataLoader`` yields: a finite sampler, Map/RandomMap
    operations and one Batch, no worker processes (each would batch its own share)."""
    try:
        if loader.multiprocessing_options.num_workers > 0:
            return None
        records = len(loader._sampler)
        if records >= sys.maxsize:  # num_epochs=None: endless
            return None
        records //= loader._shard_options.shard_count
        ops = list(loader._operations)
    except (AttributeError, TypeError):
        return None
    batch = None
    for op in ops:
        if isinstance(op, grain.transforms.Batch) and batch is None:
            batch = (int(op.batch_size), bool(op.drop_remainder))
        elif not isinstance(op, (grain.transforms.Map, grain.transforms.RandomMap)) or batch is not None:
            return None
    return records if batch is None else _batches(records, *batch)


class GrainStream:
    """A jaxnitro source that iterates a ``grain.IterDataset`` or ``grain.DataLoader``.

    Not index-addressable: one producer thread iterates it (``prefetch_workers
    = 1``); grain's own parallelism (``mp_prefetch``, ``worker_count``,
    ``ReadOptions``) works inside that iteration. Each epoch starts a fresh
    iterator, ``iter(dataset)``, so a pipeline shuffled before
    ``to_iter_dataset()`` gives the same order every epoch: hand over the
    ``MapDataset`` (:class:`GrainSource`) to reshuffle per epoch.

    **Arguments:**

    - ``dataset``: a ``grain.IterDataset`` or ``grain.DataLoader`` yielding batches.
    - ``batches_per_epoch``: gives the stream a ``len()``: the batches an epoch
      takes from each fresh iterator (the first ones; a shorter pass fails the
      epoch naming the split). Without it, ``len()`` is inferred when the
      pipeline makes it certain: an IterDataset of one-to-one steps and one
      ``batch`` over an unfiltered ``MapDataset``; a DataLoader with a finite
      sampler (``num_epochs`` set), ``worker_count=0``, Map/RandomMap operations
      and one ``Batch``. Otherwise (a filter, an endless sampler or repeat, worker
      processes batching their own shares, ...) it is a *stream without len()*
      (``len()`` raises ``TypeError``): each epoch is one whole pass of a fresh
      iterator, ending when grain's does, and it can be the train split of a run
      bounded by ``max_steps`` (setup refuses it without one, naming the fix).
    - ``fields``: names for the parts of tuple elements.

    **Resume.** A :class:`jaxnitro.plugin.StatefulStream`: after each batch it yields, it
    keeps grain's iterator state (``DatasetIterator.get_state()``, a ``DataLoader``
    iterator's JSON text), with the batch's number in the pass; a checkpoint records the one
    after the last trained batch, and ``restore_iterator`` makes the next pass
    ``set_state`` it, so a resumed run continues mid-epoch with nothing read again.

    **Raises:** ``TypeError`` for another type (a ``MapDataset`` is
    :class:`GrainSource`'s); ``ValueError`` for a pipeline certain to yield no batch.
    """

    prefetch_workers = 1

    def __init__(self, dataset: Any, *, batches_per_epoch: int | None = None, fields: Sequence[str] | None = None):
        grain = _grain()
        if isinstance(dataset, grain.MapDataset):
            raise TypeError("GrainStream takes an IterDataset or DataLoader; a grain.MapDataset is "
                            "index-addressable: use jn.GrainSource")
        loader = isinstance(dataset, grain.DataLoader)
        if not (loader or isinstance(dataset, grain.IterDataset)):
            raise TypeError(f"GrainStream takes a grain.IterDataset or grain.DataLoader, got "
                            f"{type(dataset).__name__}")
        self.kind = "DataLoader" if loader else "IterDataset"
        if batches_per_epoch is not None:
            if isinstance(batches_per_epoch, bool) or not isinstance(batches_per_epoch, int) or batches_per_epoch < 1:
                raise ValueError(f"GrainStream: batches_per_epoch must be an int >= 1, got {batches_per_epoch!r}")
            n = batches_per_epoch
        else:
            # None: the pipeline does not make it certain, a stream without len()
            n = _loader_length(dataset, grain) if loader else _iter_length(dataset, grain)
            if n == 0:
                raise ValueError(f"GrainStream: the grain {self.kind} yields no batch")
        self.dataset, self.fields = dataset, check_fields(fields)
        self._len, self._take = n, batches_per_epoch is not None
        epochs = (
            "each epoch restarts its iterator" if n is not None else
            "no len(): each epoch is a pass of a fresh iterator, ending when grain's does (bound the "
            "run with max_steps, or give it batches_per_epoch=N)"
        )
        self.prefetch_note = (
            f"grain {self.kind}: not index-addressable, 1 producer; {epochs}; "
            f"a resume restores its iterator state"
        )
        self._states = PassStates()  # the iterator's state after each batch of the current pass
        self._restore = None  # the state the next pass starts from (restore_iterator)

    def __len__(self) -> int:
        if self._len is None:  # TypeError: what len() of an object without __len__ raises
            raise TypeError(
                f"jaxnitro: this grain {self.kind} is a stream without len(): its pipeline does not "
                f"make the number of batches per pass certain (a filter, an endless sampler or "
                f"repeat, worker processes batching their own shares, ...), so an epoch ends when "
                f"grain's iterator does. It trains in a run bounded by max_steps; for a len(), "
                f"jn.GrainStream(ds, batches_per_epoch=N) (each epoch takes the first N batches of a "
                f"fresh iterator), or hand over the grain.MapDataset (index-addressable)"
            )
        return self._len

    def __iter__(self):
        it = iter(self.dataset)
        restore, self._restore = self._restore, None
        done = 0
        if restore is not None:
            it.set_state(_grain_state(restore["iterator"], self.kind))
            done = restore["batches"]
        states, get_state = self._states, it.get_state
        states.begin({"batches": done, "iterator": _jsonable_state(get_state())})
        try:
            values = itertools.islice(it, self._len - done) if self._take else it
            for k, value in enumerate(values, done + 1):
                batch = _as_batch(value, self.fields, f"grain {self.kind} batch {k - 1}")
                states.record({"batches": k, "iterator": _jsonable_state(get_state())})
                yield batch
        finally:
            close = getattr(it, "close", None)
            if callable(close):
                close()

    def iterator_state(self, batches: int) -> dict:
        """``{"batches": n, "iterator": grain's state}`` after the current pass's first
        ``batches`` batches (``n`` counts from the epoch's start)."""
        return self._states.after(batches)

    def restore_iterator(self, state: dict) -> None:
        """The next pass starts from ``state`` (what :meth:`iterator_state` returned)."""
        if not (isinstance(state, dict) and isinstance(state.get("batches"), int) and "iterator" in state):
            raise ValueError(
                f"GrainStream.restore_iterator takes what iterator_state returned, a dict "
                f"{{'batches': int, 'iterator': grain's state}}; got {state!r}"
            )
        if state["batches"] < 0 or (self._len is not None and state["batches"] > self._len):
            of = "" if self._len is None else f" of {self._len}"
            raise ValueError(f"GrainStream: the state is {state['batches']} batches into a pass{of}")
        self._restore = state

    def __repr__(self) -> str:
        if self._len is None:
            return f"GrainStream({self.kind}, a stream without len(): each epoch one pass of grain's iterator)"
        return f"GrainStream({self.kind}, {self._len} batches per epoch)"


def _jsonable_state(state):
    """grain's iterator state as a JSON value: a dataset iterator's is a dict already; a
    ``DataLoader`` iterator's is JSON text as bytes (kept as text)."""
    return state.decode("utf-8") if isinstance(state, bytes) else state


def _grain_state(state, kind: str):
    """What ``set_state`` takes back: bytes for a ``DataLoader`` iterator."""
    return state.encode("utf-8") if kind == "DataLoader" and isinstance(state, str) else state


# -- the hooks --------------------------------------------------------------------------------


@hookimpl(trylast=True)
def jaxnitro_adapt_source(source, split):
    """A batched ``grain.MapDataset`` -> :class:`GrainSource`; an ``IterDataset`` or
    ``DataLoader`` -> :class:`GrainStream` (noted at setup; without ``len()`` when the
    pipeline does not make its batches per pass certain); anything else -> ``None``."""
    grain = sys.modules.get("grain")
    if grain is None:  # nobody imported grain, so this is no grain pipeline
        return None
    if isinstance(source, grain.MapDataset):
        if not _is_batched(source):
            where = f"split `{split}`" if split else "this data source"
            raise TypeError(
                f"jaxnitro: {where} is a grain.MapDataset of single records, not batches. "
                f"Fix: return `ds.batch(batch_size, drop_remainder=True)` (evaluation splits may keep "
                f"the partial batch), or jn.GrainSource(ds, batch_size=...)"
            )
        return GrainSource(source)
    if isinstance(source, (grain.IterDataset, grain.DataLoader)):
        stream = GrainStream(source)
        log.info("split is iterated by one producer", split=split, note=stream.prefetch_note,
                 fix="hand over a batched grain.MapDataset for several ordered producers")
        return stream
    return None


@hookimpl(trylast=True)
def jaxnitro_exports():
    return {"GrainSource": GrainSource, "GrainStream": GrainStream}
