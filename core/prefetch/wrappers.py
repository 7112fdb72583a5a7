"""The public wrappers: PrefetchIterator, NoPrefetch, and the EpochStream they open.

In: a data source (see :mod:`.contract`); a foreign loader (a torch
``DataLoader``, a grain ``MapDataset``) is adapted first, through the adapter
jaxnitro installs (:func:`.contract.adapted`), so wrapping a loader reads it as
the framework would unwrapped. A wrapper validates it once
(``TypeError`` for one without ``len()``, or neither iterable nor addressable,
or already wrapped; ``ValueError`` for a bad setting). Out, for each call of
``epoch(epoch, transfer)``: an :class:`EpochStream` of staged batches.
Iterating it raises ``PrefetchError`` when a batch cannot be produced or
transferred, and ``RuntimeError`` once a newer stream of the same wrapper has
closed it (the one-stream rule: ``begin_epoch`` sets state on the shared
source).

A pass over the split runs a two-stage pipeline:

1. **Host stage.** Producers build host batches (dicts of NumPy arrays, batch
   dimension first) ahead of the consumer, at most ``host_batches`` of them
   produced or in production and not yet handed on (:mod:`.producers`).

   * An *index-addressable* source (see :func:`is_addressable`) is read by
     ``workers`` producer threads, each calling ``source.batch_at(i)`` for the
     next unclaimed index ``i``. ``source.begin_epoch(epoch)`` is called first,
     in the consumer's thread.
   * Any other source is iterated (``iter(source)``) by one producer thread,
     because an iterator cannot be shared.
   * ``workers=0`` produces in the consumer's own thread: no threads at all
     (:func:`.staging.synchronous`, the path :class:`NoPrefetch` always takes).
     ``workers=None`` (the default) reads a source's ``prefetch_workers``
     attribute when it has one, so a source whose batches are cheap to make
     (gathered from arrays in memory) can say ``prefetch_workers = 0``.

2. **Staging.** ``transfer(batch)`` (typically a host-to-device copy of the
   fields the hooks use) is applied in the consumer's thread, ``device_batches``
   batches ahead of the one being consumed (:func:`.staging.staged`). JAX
   dispatches transfers asynchronously, so the copy of the next batch overlaps
   the current step.

Delivery is in index order by default (``ordered=True``), whatever the number
of workers, so a fixed seed reproduces a run bitwise at any worker count.

Each epoch stream is built when its iteration starts and torn down when it
ends: exhausted, closed early (``break`` in a ``for`` loop, ``.close()``,
garbage collection) or failed. Teardown stops and joins every producer thread,
so training and validation prefetch memory never coexist. An exception raised
by ``batch_at``, by the source's iterator or by ``transfer`` is re-raised in
the consumer as a :class:`PrefetchError` naming the batch index, with the
original exception as its ``__cause__``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import structlog

from .contract import _default_cpus, adapted, check_epoch, default_workers, describe, is_addressable
from .producers import Producers
from .staging import staged, synchronous


class _Wrapper:
    """What PrefetchIterator and NoPrefetch share: the source, its one open
    stream, ``epoch()``, ``info()`` and the synchronous path.

    The settings ``workers``, ``device_batches``, ``host_batches`` and
    ``ordered`` are set by each subclass; NoPrefetch is the synchronous path
    with ``workers=0`` and ``device_batches=0``.
    """

    source: Any
    addressable: bool
    split: str | None = None  # the split's name, for messages (set by jaxnitro when it wraps a split)
    workers: int
    device_batches: int
    host_batches: int
    ordered: bool

    def __init__(self, source: Any, name: str, unwrap_hint: str, len_hint: str = ""):
        if isinstance(source, _Wrapper):
            raise TypeError(f"{name} got a {type(source).__name__} as its source; {unwrap_hint}")
        source = adapted(source)  # a foreign loader (torch, grain) through its plugin's adapter
        if isinstance(source, _Wrapper):  # an adapter that wraps: these settings win
            source = source.source
        self.addressable = is_addressable(source)
        try:
            len(source)
            self.sized = True
        except TypeError:
            one_shot = hasattr(type(source), "__next__")  # an iterator or generator: one pass only
            if self.addressable or one_shot:  # batch_at(i) is defined for 0 <= i < len(source)
                raise TypeError(
                    f"a data source must have len() (the number of batches per epoch); "
                    f"{describe(source)} has none{len_hint}"
                    + (" (an iterator is read once: a stream without len() must be an iterable "
                       "whose __iter__ starts a new pass each epoch)" if one_shot else "")
                ) from None
            self.sized = False  # a stream: an epoch ends when its iterator does
        self.source = source

    def __len__(self) -> int:
        if not self.sized:
            raise TypeError(
                f"{describe(self.source)} is a stream without len(): its batches per epoch are "
                f"known only when it ends. It can be the train split of a run bounded by "
                f"max_steps; give it __len__ (or batch_at/begin_epoch) for anything else"
            )
        return len(self.source)

    def __iter__(self) -> Iterator:
        """One pass in epoch 0's order with no transfer: ``self.epoch(0)``."""
        return self.epoch(0)

    def info(self) -> dict:
        """How this split is prefetched, for the binding report.

        ``{"path", "workers", "device_batches", "host_batches", "ordered",
        "addressable", "note"}``, where ``path`` is ``"batch_at, N producers"``,
        ``"iterate, 1 producer"`` or ``"synchronous"`` (``workers=0``) for a
        PrefetchIterator, and ``workers``/``host_batches`` are the resolved
        values. A NoPrefetch reports ``"none (NoPrefetch)"`` with
        ``workers``, ``device_batches`` and ``host_batches`` 0. ``note`` is what
        the user should know about the source: its own ``prefetch_note`` (an
        adapter's, e.g. "iterated by one producer"), or, for a plain list or tuple
        of batches, that it is not reshuffled; empty otherwise.
        """
        return {
            "path": self._path(),
            "workers": self.workers,
            "device_batches": self.device_batches,
            "host_batches": self.host_batches,
            "ordered": self.ordered,
            "addressable": self.addressable,
            "note": _note_of(self.source),
        }

    def _path(self) -> str:
        raise NotImplementedError

    def epoch(self, epoch: int, transfer: Callable[[Any], Any] | None = None, start: int = 0) -> EpochStream:
        """One pass over the source: an iterator of staged batches.

        Nothing happens until the first ``next()``. Then, for an addressable
        source, ``source.begin_epoch(epoch)`` is called in the consumer's
        thread and batches ``0 .. len(source) - 1`` are produced with
        ``source.batch_at``; any other source is iterated once. Each batch is
        passed through ``transfer`` (default: identity), ``device_batches``
        batches ahead of delivery (NoPrefetch: just before it).

        Leaving the loop early (``break``), ``.close()`` on the iterator, an
        exception in the consumer, or exhaustion tears the stream down and
        joins its producer threads. A failure in the source or in
        ``transfer`` raises :class:`PrefetchError` naming the batch index,
        after every earlier batch has been delivered when ``ordered``.

        ``start`` continues an epoch from its batch ``start`` (a resumed run): an
        addressable source produces batches ``start ..`` only; any other source is
        read from its beginning and the first ``start`` batches are dropped unstaged.
        """
        epoch = check_epoch(epoch)
        if transfer is not None and not callable(transfer):
            raise TypeError(f"transfer must be a callable batch -> staged batch, got {transfer!r}")
        if isinstance(start, bool) or not isinstance(start, (int, np.integer)) or start < 0:
            raise ValueError(f"epoch(start={start!r}): expected the index of a batch, an int >= 0")
        return self._open(self._stream(epoch, transfer, int(start)))

    def _stream(self, epoch: int, transfer: Callable[[Any], Any] | None, start: int = 0) -> Iterator:
        """The synchronous path: produce and stage in the consumer's thread."""
        return synchronous(self.source, self.addressable, epoch, transfer, self.device_batches, self.split, start)

    def release(self) -> None:
        """Stop any open epoch stream, then call ``source.release()`` if defined.

        The framework calls this once per handle, when the run ends (done or
        failed). A source that holds something open (a file, a data server)
        defines ``release()``; any other source is left alone.
        """
        self._close_live()
        fn = getattr(self.source, "release", None)
        if callable(fn):
            fn()

    # one open stream per wrapper: begin_epoch sets state on the shared source
    _live: weakref.ref | None = None

    def _close_live(self) -> None:
        ref, self._live = self._live, None
        stream = ref() if ref is not None else None
        if stream is not None:
            stream._supersede(self)

    def _open(self, gen: Iterator) -> EpochStream:
        self._close_live()
        stream = EpochStream(gen)
        self._live = weakref.ref(stream)
        return stream


class EpochStream:
    """The iterator that :meth:`PrefetchIterator.epoch` returns.

    Iterate it once. ``close()`` (or leaving a ``with`` block, or dropping the
    last reference) tears the stream down and joins its producer threads; a
    ``for`` loop that ends or breaks does the same once the stream is no longer
    referenced. A wrapper has one open stream at a time: starting another, or
    :meth:`PrefetchIterator.release`, closes this one, and a later ``next()``
    on it raises ``RuntimeError`` rather than ending the loop early.
    """

    __slots__ = ("_gen", "_next", "__weakref__")

    def __init__(self, gen: Iterator):
        self._gen = gen
        self._next = gen.__next__

    def __iter__(self) -> EpochStream:
        return self

    def __next__(self) -> Any:
        return self._next()

    def close(self) -> None:
        """Tear the stream down now; idempotent."""
        self._gen.close()

    def __enter__(self) -> EpochStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self._gen.close()

    def _supersede(self, owner: _Wrapper) -> None:
        if self._gen.gi_frame is None:  # already finished
            return
        try:
            self._gen.close()
        except ValueError:  # executing in another thread; nothing safe to do here
            return
        message = (
            f"this epoch stream of {owner!r} was closed because a new stream was started "
            "on the same wrapper (or it was released) before this one finished. Finish or "
            "close() one stream before starting the next: begin_epoch sets state on the "
            "shared source"
        )

        def closed() -> Any:
            raise RuntimeError(message)

        self._next = closed


class PrefetchIterator(_Wrapper):
    """Wrap a data source so that batches are produced ahead of the consumer.

    **Arguments:**

    - ``source``: an iterable of batches with ``len()``. A batch is a dict of
      NumPy arrays, batch dimension first. A loader a plugin adapts (a torch
      ``DataLoader``, a grain ``MapDataset``) is adapted here
      (``jaxnitro_adapt_source``): ``.source`` is then the adapted source. If the source is *index-addressable*
      (:func:`is_addressable`: it has ``batch_at(i)`` and ``begin_epoch(epoch)``,
      or it is a ``list``/``tuple`` of batches), several producers read it;
      otherwise one producer iterates it.
    - ``workers``: producer threads; ``0`` produces in the consumer's thread,
      with no threads at all. ``None`` (the default) picks, in this order:
      the source's own ``prefetch_workers`` attribute if it has one; ``0`` for
      a ``list`` or ``tuple`` (producing a batch is a pointer load);
      ``min(4, cpu count)`` for another addressable source; ``1`` for any
      other source. More than one worker on a source that is not addressable
      logs a warning and runs one producer: implementing
      ``batch_at``/``begin_epoch`` is the fix, and :func:`check_batch_at`
      verifies it. The default on such a source (with no ``prefetch_workers``,
      on more than one CPU) warns the same once jaxnitro names the split
      (:meth:`warn_one_producer`, at setup).

      Threads pay off when producing a batch is slow and releases the GIL
      (reading files, decoding, native augmentation). For a batch gathered
      from in-memory NumPy arrays they cost more than they save: the producer
      and the consumer take turns on the GIL. A source of that kind should
      set ``prefetch_workers = 0``.
    - ``device_batches``: how many transferred batches wait ahead of the
      consumer. With the default 1, ``transfer`` of batch ``k + 1`` is called
      before batch ``k`` is delivered, so its copy overlaps step ``k``. ``0``
      transfers each batch just before delivering it.
    - ``host_batches``: the most batches produced (or in production) and not
      yet handed to ``transfer``. Default ``2 * workers``. Bounds host memory;
      fewer than ``workers`` also limits how many producers run at once.
    - ``ordered``: deliver in index order whatever the number of workers
      (default), so a fixed seed reproduces a run bitwise at any worker count.
      ``False`` delivers batches as they complete.

    A ``PrefetchIterator`` holds no threads between epochs: each call of
    :meth:`epoch` builds a stream when its iteration starts and tears it down
    when the iteration ends. One stream is open per wrapper at a time; starting
    another closes the previous one.
    """

    def __init__(
        self,
        source: Any,
        workers: int | None = None,
        device_batches: int = 1,
        host_batches: int | None = None,
        ordered: bool = True,
    ):
        super().__init__(
            source,
            "PrefetchIterator",
            "wrap the underlying source once, e.g. PrefetchIterator(source, workers=2)",
            ". Define __len__ on it, or pass a list of batches.",
        )
        if not self.addressable and not (
            hasattr(type(source), "__iter__") or hasattr(type(source), "__getitem__")
        ):  # never call iter() here: it may start a loader's worker processes
            raise TypeError(
                f"a data source must be iterable or define batch_at(i) and begin_epoch(epoch); "
                f"{describe(source)} is neither"
            )
        for name, value, low in (
            ("workers", workers, 0),
            ("device_batches", device_batches, 0),
            ("host_batches", host_batches, 1),
        ):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
                raise ValueError(f"PrefetchIterator({name}={value!r}): expected an int >= {low}")
        if not isinstance(ordered, bool):
            raise ValueError(f"PrefetchIterator(ordered={ordered!r}): expected True or False")

        self.ordered = ordered
        self.device_batches = int(device_batches)
        source = self.source  # adapted
        if workers is None:
            workers = default_workers(source, self.addressable)
            if not self.addressable and getattr(source, "prefetch_workers", None) is None:
                several = min(4, _default_cpus())  # what an addressable source would get
                if several > 1:
                    self._unsaid_default = several  # said once, naming the split: warn_one_producer
        workers = int(workers)
        if not self.addressable and workers > 1:
            structlog.get_logger("jaxnitro").warning(
                "several prefetch producers need an index-addressable source; running one",
                source=describe(source),
                workers_requested=workers,
                fix="define batch_at(i) -> batch and begin_epoch(epoch) -> None on the source; "
                "jaxnitro.check_batch_at(source) verifies an implementation",
            )
            workers = 1
        self.workers = workers
        if workers == 0:
            self.host_batches = 0
        else:
            self.host_batches = int(host_batches) if host_batches is not None else 2 * workers

    _unsaid_default: int = 0  # producers the default would run on an addressable source, unsaid

    def warn_one_producer(self, split: str | None = None) -> None:
        """Warn (once) that this source runs in one producer where the default would run
        several: it is not index-addressable. jaxnitro calls this at setup, naming the split;
        an explicit ``workers > 1`` warned already, when the wrapper was built."""
        several, self._unsaid_default = self._unsaid_default, 0
        if not several:
            return
        structlog.get_logger("jaxnitro").warning(
            "source is not index-addressable: one prefetch producer reads it",
            split=split or self.split,
            source=describe(self.source),
            workers_default=several,
            fix="define batch_at(i) -> batch and begin_epoch(epoch) -> None on the source so that "
            f"{several} producers read it; jaxnitro.check_batch_at(source) verifies an implementation "
            "(PrefetchIterator(source, workers=1) says one producer is meant)",
        )

    def _path(self) -> str:
        if self.workers == 0:
            return "synchronous"
        if self.addressable:
            return f"batch_at, {self.workers} producer{'s' if self.workers != 1 else ''}"
        return "iterate, 1 producer"

    def _stream(self, epoch: int, transfer: Callable[[Any], Any] | None, start: int = 0) -> Iterator:
        if self.workers == 0:
            return super()._stream(epoch, transfer, start)
        return self._threaded(epoch, transfer, start)

    def _threaded(self, epoch: int, transfer: Callable[[Any], Any] | None, start: int = 0) -> Iterator:
        producers = Producers(self.host_batches)
        try:
            items = producers.start(self.source, self.addressable, epoch, self.workers, self.ordered, self.split, start)
            yield from staged(items, transfer, self.device_batches, epoch, self.split)
        finally:
            producers.stop()

    def __repr__(self) -> str:
        i = self.info()
        return (
            f"PrefetchIterator({describe(self.source)}, {len(self) if self.sized else 'a stream of'} batches, {i['path']}, "
            f"device_batches={i['device_batches']}, host_batches={i['host_batches']}, "
            f"ordered={i['ordered']})"
        )


class NoPrefetch(_Wrapper):
    """Opt a split out of prefetching: produce and transfer each batch on demand.

    Same interface as :class:`PrefetchIterator`, and the same synchronous path
    as ``PrefetchIterator(source, workers=0, device_batches=0)``: :meth:`epoch`
    calls ``begin_epoch(epoch)`` and ``batch_at(i)`` for an addressable source,
    or iterates the source, in the consumer's thread, and applies ``transfer``
    to each batch just before delivering it. No threads, nothing staged ahead.
    """

    def __init__(self, source: Any):
        super().__init__(source, "NoPrefetch", "pass the underlying source")
        self.workers = 0
        self.device_batches = 0
        self.host_batches = 0
        self.ordered = True

    def _path(self) -> str:
        return "none (NoPrefetch)"

    def __repr__(self) -> str:
        return f"NoPrefetch({describe(self.source)}, {len(self) if self.sized else 'a stream of'} batches)"


def _note_of(source: Any) -> str:
    """What the data band should say about ``source`` (see :meth:`_Wrapper.info`)."""
    note = getattr(source, "prefetch_note", "")
    if note:
        return str(note)
    if isinstance(source, (list, tuple)):
        return "a list of batches: the same order every epoch (not reshuffled)"
    return ""
