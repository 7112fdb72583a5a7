"""Prefetching: produce batches ahead of the step that consumes them.

Every data split the framework iterates is wrapped in a :class:`PrefetchIterator`
unless the user returned one already, or opted out with :class:`NoPrefetch`. A
pass over the split (one *epoch stream*, from :meth:`PrefetchIterator.epoch`)
runs a two-stage pipeline:

1. **Host stage.** Producers build host batches (dicts of NumPy arrays, batch
   dimension first) ahead of the consumer, at most ``host_batches`` of them
   produced or in production and not yet handed on.

   * An *index-addressable* source (see :func:`is_addressable`) is read by
     ``workers`` producer threads, each calling ``source.batch_at(i)`` for the
     next unclaimed index ``i``. ``source.begin_epoch(epoch)`` is called first,
     in the consumer's thread.
   * Any other source is iterated (``iter(source)``) by one producer thread,
     because an iterator cannot be shared.
   * ``workers=0`` produces in the consumer's own thread: no threads at all.
     ``workers=None`` (the default) reads a source's ``prefetch_workers``
     attribute when it has one, so a source whose batches are cheap to make
     (gathered from arrays in memory) can say ``prefetch_workers = 0``.

2. **Staging.** ``transfer(batch)`` (typically a host-to-device copy of the
   fields the hooks use) is applied in the consumer's thread, ``device_batches``
   batches ahead of the one being consumed. JAX dispatches transfers
   asynchronously, so the copy of the next batch overlaps the current step.

Delivery is in index order by default (``ordered=True``), whatever the number
of workers, so a fixed seed reproduces a run bitwise at any worker count.

Each epoch stream is built when its iteration starts and torn down when it
ends: exhausted, closed early (``break`` in a ``for`` loop, ``.close()``,
garbage collection) or failed. Teardown stops and joins every producer thread,
so training and validation prefetch memory never coexist. An exception raised
by ``batch_at``, by the source's iterator or by ``transfer`` is re-raised in
the consumer as a :class:`PrefetchError` naming the batch index, with the
original exception as its ``__cause__``.

This module imports no other part of jaxnitro.
"""

from __future__ import annotations

import collections
import itertools
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import structlog

__all__ = [
    "EpochStream",
    "NoPrefetch",
    "PrefetchError",
    "PrefetchIterator",
    "check_batch_at",
    "is_addressable",
]

#: Longest time, in seconds, that tearing down an epoch stream waits for a
#: producer thread that is still inside ``batch_at`` or the source's iterator.
#: A producer never waits on the pipeline once the stream is stopped, so only a
#: source call that itself takes this long can reach it; the thread is then
#: left to finish that call and exit, and a warning says so.
JOIN_TIMEOUT_S = 30.0

_THREAD_PREFIX = "jaxnitro-prefetch"


class PrefetchError(RuntimeError):
    """A batch could not be produced or transferred.

    Raised in the consumer's thread. ``index`` is the batch's position in the
    epoch, ``epoch`` the epoch, and ``__cause__`` the exception the source (or
    ``transfer``) raised, with its original traceback.
    """

    def __init__(self, message: str, *, index: int, epoch: int):
        super().__init__(message)
        self.index = index
        self.epoch = epoch


# --------------------------------------------------------------------------
# source protocol


def is_addressable(source: Any) -> bool:
    """Whether several producers can read ``source``.

    True for a ``list`` or ``tuple`` of batches (indexing is ``batch_at``,
    ``begin_epoch`` is a no-op) and for any object with callable ``batch_at``
    and ``begin_epoch`` attributes:

    * ``begin_epoch(epoch: int) -> None`` fixes that epoch's plan (its shuffle);
    * ``batch_at(i: int) -> batch`` then returns the ``i``-th batch of that
      epoch, for ``0 <= i < len(source)``: deterministic, and safe to call from
      several threads at once.

    :func:`check_batch_at` verifies an implementation.
    """
    if isinstance(source, (list, tuple)):
        return True
    return callable(getattr(source, "batch_at", None)) and callable(
        getattr(source, "begin_epoch", None)
    )


def _default_workers(source: Any, addressable: bool) -> int:
    """What ``workers=None`` means for ``source``; see PrefetchIterator."""
    hint = getattr(source, "prefetch_workers", None)
    if hint is not None:
        if isinstance(hint, bool) or not isinstance(hint, (int, np.integer)) or hint < 0:
            raise ValueError(
                f"{_describe(source)}.prefetch_workers is {hint!r}; it must be an int >= 0 "
                "(the producer threads PrefetchIterator(workers=None) runs for this source)"
            )
        return int(hint)
    if isinstance(source, (list, tuple)):
        return 0
    if addressable:
        return min(4, _default_cpus())
    return 1


def _accessors(source: Any) -> tuple[Callable[[int], Any], Callable[[int], None]]:
    if isinstance(source, (list, tuple)):
        return source.__getitem__, _no_begin
    return source.batch_at, source.begin_epoch


def _no_begin(epoch: int) -> None:
    return None


def _default_cpus() -> int:
    fn = getattr(os, "process_cpu_count", None)  # Python 3.13+
    if fn is not None:
        n = fn()
    elif hasattr(os, "sched_getaffinity"):
        n = len(os.sched_getaffinity(0))
    else:
        n = os.cpu_count()
    return max(1, n or 1)


def _describe(source: Any) -> str:
    return type(source).__qualname__


# --------------------------------------------------------------------------
# the host stage


class _Failure:
    """A producer's exception, carried to the consumer in place of a batch."""

    __slots__ = ("index", "exc")

    def __init__(self, index: int, exc: BaseException):
        self.index = index
        self.exc = exc


_END = object()  # the iterate producer ran out of batches


def _failure_error(f: _Failure, epoch: int, what: str) -> PrefetchError:
    exc = f.exc
    err = PrefetchError(
        f"{what} raised {type(exc).__name__} for batch {f.index} of epoch {epoch}: {exc}",
        index=f.index,
        epoch=epoch,
    )
    err.__cause__ = exc  # as `raise err from exc`, when raised later
    return err


def _raise_failure(f: _Failure, epoch: int, what: str) -> None:
    raise _failure_error(f, epoch, what)


class _Producers:
    """Producer threads feeding one epoch stream, and their teardown.

    Every produced item goes into one unbounded ``SimpleQueue``; the bound is a
    semaphore of ``capacity`` slots that a producer takes *before* it claims an
    index and the consumer gives back when it takes an item. Producers thus
    never block on the queue, and stopping is: set the flag, then release one
    slot per producer so that every one blocked on the semaphore wakes, sees
    the flag and returns.

    Indices are claimed in increasing order, so ordered delivery cannot
    deadlock: while the consumer waits for index ``k``, either ``k`` is being
    produced, or nothing is claimed at all and every slot is free.
    """

    def __init__(self, capacity: int):
        self.out: queue.SimpleQueue = queue.SimpleQueue()
        # a semaphore made of a C queue of tokens: cheaper than threading.Semaphore
        self.slots: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(capacity):
            self.slots.put(None)
        self.stopped = False
        self.threads: list[threading.Thread] = []

    # -- producers ---------------------------------------------------------

    def start_indexed(self, batch_at: Callable[[int], Any], n: int, workers: int) -> None:
        claim = itertools.count().__next__
        claim_lock = threading.Lock()

        def work() -> None:
            put, acquire = self.out.put, self.slots.get
            while True:
                acquire()
                if self.stopped:
                    return
                with claim_lock:
                    i = claim()
                if i >= n:
                    return
                try:
                    put((i, batch_at(i)))
                except BaseException as exc:  # noqa: BLE001 - carried to the consumer
                    put(_Failure(i, exc))

        for w in range(min(workers, n)):
            self._spawn(work, f"{_THREAD_PREFIX}-{w}")

    def start_iterating(self, source: Iterable) -> None:
        def work() -> None:
            put, acquire = self.out.put, self.slots.get
            i = 0
            it = None
            try:
                it = iter(source)
                while True:
                    acquire()
                    if self.stopped:
                        return
                    try:
                        batch = next(it)
                    except StopIteration:
                        put(_END)
                        return
                    put((i, batch))
                    i += 1
            except BaseException as exc:  # noqa: BLE001 - carried to the consumer
                put(_Failure(i, exc))
            finally:
                close = getattr(it, "close", None)
                if close is not None:
                    try:
                        close()
                    except Exception:  # noqa: BLE001 - already finishing
                        pass

        self._spawn(work, f"{_THREAD_PREFIX}-iter")

    def _spawn(self, fn: Callable[[], None], name: str) -> None:
        t = threading.Thread(target=fn, name=name, daemon=True)
        self.threads.append(t)
        t.start()

    # -- teardown ------------------------------------------------------------

    def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        for _ in self.threads:
            self.slots.put(None)
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in self.threads if t.is_alive()]
        if alive:
            structlog.get_logger("jaxnitro").warning(
                "prefetch producer still running after teardown",
                threads=alive,
                waited_s=JOIN_TIMEOUT_S,
                note="it is inside the source's batch_at or iterator and exits "
                "when that call returns",
            )
        # drop whatever was produced ahead; it is never delivered
        while True:
            try:
                self.out.get_nowait()
            except queue.Empty:
                break


def _indexed_ordered(p: _Producers, n: int, epoch: int) -> Iterator[tuple[int, Any]]:
    get, release = p.out.get, p.slots.put
    pending: dict[int, Any] = {}
    for k in range(n):
        if k in pending:
            item = pending.pop(k)
        else:
            while True:
                item = get()
                i = item[0] if item.__class__ is tuple else item.index
                if i == k:
                    break
                pending[i] = item
        release(None)
        if item.__class__ is _Failure:
            _raise_failure(item, epoch, f"batch_at({k})")
        yield item


def _indexed_unordered(p: _Producers, n: int, epoch: int) -> Iterator[tuple[int, Any]]:
    get, release = p.out.get, p.slots.put
    for _ in range(n):
        item = get()
        release(None)
        if item.__class__ is _Failure:
            _raise_failure(item, epoch, f"batch_at({item.index})")
        yield item


def _iterated(p: _Producers, epoch: int) -> Iterator[tuple[int, Any]]:
    get, release = p.out.get, p.slots.put
    while True:
        item = get()
        if item is _END:
            return
        release(None)
        if item.__class__ is _Failure:
            _raise_failure(item, epoch, "iterating the source")
        yield item


def _sync_indexed(batch_at: Callable[[int], Any], n: int, epoch: int) -> Iterator[tuple[int, Any]]:
    for i in range(n):
        try:
            batch = batch_at(i)
        except Exception as exc:  # noqa: BLE001
            _raise_failure(_Failure(i, exc), epoch, f"batch_at({i})")
        yield i, batch


def _sync_iterated(source: Iterable, epoch: int) -> Iterator[tuple[int, Any]]:
    i = 0
    try:
        it = iter(source)
    except Exception as exc:  # noqa: BLE001
        _raise_failure(_Failure(0, exc), epoch, "iterating the source")
    try:
        while True:
            try:
                batch = next(it)
            except StopIteration:
                return
            except Exception as exc:  # noqa: BLE001
                _raise_failure(_Failure(i, exc), epoch, "iterating the source")
            yield i, batch
            i += 1
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()


# --------------------------------------------------------------------------
# staging


def _staged(
    items: Iterator[tuple[int, Any]], transfer: Callable[[Any], Any] | None, depth: int, epoch: int
) -> Iterator[Any]:
    """Apply ``transfer`` ``depth`` batches ahead of delivery; yield staged batches."""
    if transfer is None:
        for _, batch in items:
            yield batch
        return
    if depth <= 0:
        for i, batch in items:
            try:
                staged = transfer(batch)
            except Exception as exc:  # noqa: BLE001
                _raise_failure(_Failure(i, exc), epoch, "transfer")
            yield staged
        return
    ahead: collections.deque = collections.deque()
    push, pop = ahead.append, ahead.popleft
    nxt = iter(items).__next__
    error: PrefetchError | None = None
    while True:
        try:
            i, batch = nxt()
        except StopIteration:
            break
        except PrefetchError as exc:  # the source failed: deliver what is staged first
            error = exc
            break
        try:
            push(transfer(batch))
        except Exception as exc:  # noqa: BLE001
            error = _failure_error(_Failure(i, exc), epoch, "transfer")
            break
        if len(ahead) > depth:
            yield pop()
    # batches already staged were produced and transferred without error: deliver
    # them, so that a failure surfaces at the same batch whatever device_batches is
    while ahead:
        yield pop()
    if error is not None:
        raise error


# --------------------------------------------------------------------------
# public wrappers


class _Wrapper:
    """What PrefetchIterator and NoPrefetch share: the source and its lifetime."""

    source: Any

    def __len__(self) -> int:
        return len(self.source)

    def __iter__(self) -> Iterator:
        """One pass in epoch 0's order with no transfer: ``self.epoch(0)``."""
        return self.epoch(0)

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
      NumPy arrays, batch dimension first. If the source is *index-addressable*
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
      verifies it.

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
        if isinstance(source, _Wrapper):
            raise TypeError(
                f"PrefetchIterator got a {type(source).__name__} as its source; "
                "wrap the underlying source once, e.g. PrefetchIterator(source, workers=2)"
            )
        try:
            len(source)
        except TypeError:
            raise TypeError(
                f"a data source must have len() (the number of batches per epoch); "
                f"{_describe(source)} has none. Define __len__ on it, or pass a list of batches."
            ) from None
        if not is_addressable(source) and not (
            hasattr(type(source), "__iter__") or hasattr(type(source), "__getitem__")
        ):  # never call iter() here: it may start a loader's worker processes
            raise TypeError(
                f"a data source must be iterable or define batch_at(i) and begin_epoch(epoch); "
                f"{_describe(source)} is neither"
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

        self.source = source
        self.addressable = is_addressable(source)
        self.ordered = ordered
        self.device_batches = int(device_batches)
        self._requested_workers = workers
        if workers is None:
            workers = _default_workers(source, self.addressable)
        workers = int(workers)
        if not self.addressable and workers > 1:
            structlog.get_logger("jaxnitro").warning(
                "several prefetch producers need an index-addressable source; running one",
                source=_describe(source),
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

    def info(self) -> dict:
        """How this split is prefetched, for the binding report.

        ``{"path", "workers", "device_batches", "host_batches", "ordered",
        "addressable"}``, where ``path`` is ``"batch_at, N producers"``,
        ``"iterate, 1 producer"`` or ``"synchronous"`` (``workers=0``), and
        ``workers``/``host_batches`` are the resolved values.
        """
        if self.workers == 0:
            path = "synchronous"
        elif self.addressable:
            path = f"batch_at, {self.workers} producer{'s' if self.workers != 1 else ''}"
        else:
            path = "iterate, 1 producer"
        return {
            "path": path,
            "workers": self.workers,
            "device_batches": self.device_batches,
            "host_batches": self.host_batches,
            "ordered": self.ordered,
            "addressable": self.addressable,
        }

    def epoch(self, epoch: int, transfer: Callable[[Any], Any] | None = None) -> EpochStream:
        """One pass over the source: an iterator of staged batches.

        Nothing happens until the first ``next()``. Then, for an addressable
        source, ``source.begin_epoch(epoch)`` is called in the consumer's
        thread and batches ``0 .. len(source) - 1`` are produced with
        ``source.batch_at``; any other source is iterated once. Each batch is
        passed through ``transfer`` (default: identity), ``device_batches``
        batches ahead of delivery.

        Leaving the loop early (``break``), ``.close()`` on the iterator, an
        exception in the consumer, or exhaustion tears the stream down and
        joins its producer threads. A failure in the source or in
        ``transfer`` raises :class:`PrefetchError` naming the batch index,
        after every earlier batch has been delivered when ``ordered``.
        """
        epoch = _check_epoch(epoch)
        if transfer is not None and not callable(transfer):
            raise TypeError(f"transfer must be a callable batch -> staged batch, got {transfer!r}")
        return self._open(self._stream(epoch, transfer))

    def _stream(self, epoch: int, transfer: Callable[[Any], Any] | None) -> Iterator:
        source, workers = self.source, self.workers
        if workers == 0:
            if self.addressable:
                batch_at, begin = _accessors(source)
                begin(epoch)
                items = _sync_indexed(batch_at, len(source), epoch)
            else:
                items = _sync_iterated(source, epoch)
            yield from _staged(items, transfer, self.device_batches, epoch)
            return

        producers = _Producers(self.host_batches)
        try:
            if self.addressable:
                batch_at, begin = _accessors(source)
                begin(epoch)
                n = len(source)
                producers.start_indexed(batch_at, n, workers)
                if self.ordered or workers == 1:
                    items = _indexed_ordered(producers, n, epoch)
                else:
                    items = _indexed_unordered(producers, n, epoch)
            else:
                producers.start_iterating(source)
                items = _iterated(producers, epoch)
            yield from _staged(items, transfer, self.device_batches, epoch)
        finally:
            producers.stop()

    def __repr__(self) -> str:
        i = self.info()
        return (
            f"PrefetchIterator({_describe(self.source)}, {len(self)} batches, {i['path']}, "
            f"device_batches={i['device_batches']}, host_batches={i['host_batches']}, "
            f"ordered={i['ordered']})"
        )


class NoPrefetch(_Wrapper):
    """Opt a split out of prefetching: produce and transfer each batch on demand.

    Same interface as :class:`PrefetchIterator`. :meth:`epoch` calls
    ``begin_epoch(epoch)`` and ``batch_at(i)`` for an addressable source, or
    iterates the source, in the consumer's thread, and applies ``transfer``
    to each batch just before delivering it. No threads, nothing staged ahead.
    """

    def __init__(self, source: Any):
        if isinstance(source, _Wrapper):
            raise TypeError(
                f"NoPrefetch got a {type(source).__name__} as its source; pass the underlying source"
            )
        try:
            len(source)
        except TypeError:
            raise TypeError(
                f"a data source must have len() (the number of batches per epoch); "
                f"{_describe(source)} has none"
            ) from None
        self.source = source
        self.addressable = is_addressable(source)

    def info(self) -> dict:
        """``{"path": "none (NoPrefetch)", "workers": 0, "device_batches": 0,
        "host_batches": 0, "ordered": True, "addressable": ...}``."""
        return {
            "path": "none (NoPrefetch)",
            "workers": 0,
            "device_batches": 0,
            "host_batches": 0,
            "ordered": True,
            "addressable": self.addressable,
        }

    def epoch(self, epoch: int, transfer: Callable[[Any], Any] | None = None) -> EpochStream:
        """One synchronous pass; see the class docstring."""
        epoch = _check_epoch(epoch)
        if transfer is not None and not callable(transfer):
            raise TypeError(f"transfer must be a callable batch -> staged batch, got {transfer!r}")
        return self._open(self._stream(epoch, transfer))

    def _stream(self, epoch: int, transfer: Callable[[Any], Any] | None) -> Iterator:
        if self.addressable:
            batch_at, begin = _accessors(self.source)
            begin(epoch)
            items = _sync_indexed(batch_at, len(self.source), epoch)
        else:
            items = _sync_iterated(self.source, epoch)
        yield from _staged(items, transfer, 0, epoch)

    def __repr__(self) -> str:
        return f"NoPrefetch({_describe(self.source)}, {len(self)} batches)"


def _check_epoch(epoch: Any) -> int:
    if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
        raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
    return int(epoch)


# --------------------------------------------------------------------------
# verifying a source


_CONTRACT = (
    "An index-addressable source defines begin_epoch(epoch) -> None, which fixes that "
    "epoch's plan (its shuffle) from the epoch number, and batch_at(i) -> batch, which "
    "returns the i-th batch of that epoch for 0 <= i < len(source): the same arrays every "
    "time it is called, safely from several threads at once."
)


def _fields(batch: Any, i: int) -> dict[str, np.ndarray]:
    if not isinstance(batch, Mapping):
        raise ValueError(
            f"batch_at({i}) returned a {type(batch).__name__}; a batch is a dict of "
            "NumPy arrays, batch dimension first"
        )
    return {str(k): np.asarray(v) for k, v in batch.items()}


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    try:
        return bool(np.array_equal(a, b, equal_nan=True))
    except TypeError:  # dtypes without NaN (strings, objects)
        return bool(np.array_equal(a, b))


def _require_same(
    i: int, ref: dict[str, np.ndarray], again: dict[str, np.ndarray], problem: str
) -> None:
    """Raise ``batch_at(i) field 'name' <problem>`` for the first field of ``ref`` that
    ``again`` (batch ``i`` fetched anew) lacks or holds a different array in."""
    for name, a in ref.items():
        if name not in again or not _same(a, again[name]):
            raise ValueError(f"batch_at({i}) field {name!r} {problem}")


def check_batch_at(source: Any, epoch: int = 0) -> None:
    """Verify that ``source`` is a correct index-addressable source.

    Calls ``source.begin_epoch(epoch)``, then ``source.batch_at(i)`` twice for
    every ``i`` in ``range(len(source))``, and checks that

    - every batch is a dict with the field names of ``batch_at(0)``, and each
      field has ``batch_at(0)``'s dtype and shape, except that the final batch
      may be shorter along the batch (first) dimension;
    - both calls for the same ``i`` return equal arrays (determinism);
    - all ``len(source)`` batches exist (an ``IndexError`` before the end is
      an error);
    - calling ``begin_epoch(epoch)`` again gives the same first and last batch,
      so the plan depends on the epoch, not on how often it was set (a resumed
      run sees the same order).

    Thread safety cannot be proved by a check; ``batch_at`` must not mutate
    shared state.

    **Raises:** ``TypeError`` if ``batch_at``, ``begin_epoch`` or ``len`` is
    missing; ``ValueError`` naming the index and the field that fails.
    **Returns:** ``None``.
    """
    if not is_addressable(source):
        missing = [m for m in ("batch_at", "begin_epoch") if not callable(getattr(source, m, None))]
        raise TypeError(f"{_describe(source)} lacks {' and '.join(missing)}. {_CONTRACT}")
    try:
        n = len(source)
    except TypeError:
        raise TypeError(
            f"{_describe(source)} has no len(); it must return the number of batches per epoch"
        ) from None
    epoch = _check_epoch(epoch)
    batch_at, begin = _accessors(source)
    begin(epoch)
    if n == 0:
        return None

    def fetch(i: int) -> dict[str, np.ndarray]:
        try:
            return _fields(batch_at(i), i)
        except ValueError:
            raise
        except IndexError as exc:
            raise ValueError(
                f"batch_at({i}) raised IndexError, but len(source) is {n}, so batches "
                f"0..{n - 1} must exist: {exc}"
            ) from exc
        except Exception as exc:
            raise ValueError(f"batch_at({i}) raised {type(exc).__name__}: {exc}") from exc

    first = fetch(0)
    if not first:
        raise ValueError("batch_at(0) returned an empty dict; a batch needs at least one field")
    names = set(first)
    last = first
    for i in range(n):
        b = first if i == 0 else fetch(i)
        if set(b) != names:
            extra, lacking = sorted(set(b) - names), sorted(names - set(b))
            field = (lacking or extra)[0]
            raise ValueError(
                f"batch_at({i}) field {field!r}: batch {i} has fields {sorted(b)}, batch 0 has "
                f"{sorted(names)}" + (f"; missing {lacking}" if lacking else "")
                + (f"; extra {extra}" if extra else "")
            )
        for name, a in b.items():
            ref = first[name]
            if a.dtype != ref.dtype:
                raise ValueError(
                    f"batch_at({i}) field {name!r}: dtype {a.dtype}, batch 0 has {ref.dtype}"
                )
            final = i == n - 1
            if a.ndim != ref.ndim or a.shape[1:] != ref.shape[1:] or (
                a.shape[:1] != ref.shape[:1] and not (final and a.ndim and a.shape[0] <= ref.shape[0])
            ):
                raise ValueError(
                    f"batch_at({i}) field {name!r}: shape {a.shape}, batch 0 has {ref.shape}"
                    + ("" if final else "; only the final batch may be shorter in its first dimension")
                )
        _require_same(
            i, b, fetch(i),
            "differs between two calls; batch_at must be deterministic for a given epoch (draw "
            "any randomness in begin_epoch, from the epoch number)",
        )
        last = b
    begin(epoch)
    for i, ref in ((0, first), (n - 1, last)):
        _require_same(
            i, ref, fetch(i),
            f"changed after begin_epoch({epoch}) was called again; the epoch's plan must be a "
            "function of the epoch (and the source's seed), so that a resumed run sees the same "
            "order",
        )
    return None
