"""Between the source and the epoch stream: producer threads, bounded slots, delivery,
transfer-ahead staging (:func:`staged`), teardown.

In: a source, an epoch and a worker count. :meth:`Producers.start` calls
``begin_epoch(epoch)`` in the caller's thread and starts the threads (named
``jaxnitro-prefetch-<n>``, or ``jaxnitro-prefetch-iter`` for the one thread
iterating a source that is not addressable). Out: an iterator of ``(index,
batch)`` pairs, in index order when ``ordered``, else as they complete. A
failure in the source is carried to the consumer as a :class:`Failure` in
place of a batch, and raised from that iterator as a ``PrefetchError`` at the
failed batch's turn; a ``len()`` that disagrees with the batches is a
``SourceLengthError`` at the pass's end (an iterated source's extra batch, an
addressable one's full batch at ``batch_at(len())``). :meth:`Producers.stop`
(always call it) stops and joins every thread and drops whatever was produced
ahead. :meth:`Producers.stream` is the whole threaded pass: started at its first
``next()``, its items staged, its threads stopped when it ends or is closed.
"""

from __future__ import annotations

import collections
import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import structlog

from jaxnitro.plugin import (
    PrefetchError, SourceLengthError, accessors, batch_rows, check_past_end, failure_error, length_of, skipped,
    transferred,
)

#: Longest time, in seconds, that tearing down an epoch stream waits for a
#: producer thread that is still inside ``batch_at`` or the source's iterator.
#: A producer never waits on the pipeline once the stream is stopped, so only a
#: source call that itself takes this long can reach it; the thread is then
#: left to finish that call and exit, and a warning says so.
JOIN_TIMEOUT_S = 30.0

_THREAD_PREFIX = "jaxnitro-prefetch"

_END = object()  # the iterating producer ran out of batches


class Failure:
    """A producer's exception, carried to the consumer in place of a batch."""

    __slots__ = ("index", "exc")

    def __init__(self, index: int, exc: BaseException):
        self.index = index
        self.exc = exc


class Producers:
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

    def start(
        self, source: Any, addressable: bool, epoch: int, workers: int, ordered: bool,
        split: str | None = None, start: int = 0,
    ) -> Iterator[tuple[int, Any]]:
        """Start producing ``epoch`` of ``source`` from batch ``start`` on; the ``(index,
        batch)`` pairs. An iterated source is read from its beginning (the batches before
        ``start`` are dropped) and, with ``len()``, must yield ``len(source)`` batches
        (:class:`SourceLengthError` naming ``split``)."""
        if not addressable:
            n = length_of(source)
            self._start_iterating(source)
            return skipped(_iterated(self, epoch, n, split), start)
        batch_at, begin = accessors(source)
        begin(epoch)
        n = len(source)
        self._start_indexed(batch_at, n, workers, start)
        if ordered or workers == 1:
            return _indexed_ordered(self, batch_at, n, epoch, start, split)
        return _indexed_unordered(self, batch_at, n, epoch, start, split)

    def stream(
        self, source: Any, addressable: bool, epoch: int, workers: int, ordered: bool,
        transfer: Callable[[Any], Any] | None, depth: int, split: str | None = None, start: int = 0,
    ) -> Iterator[Any]:
        """The staged batches of :meth:`start`'s pass (see :func:`staged`); nothing starts
        before the first ``next()``, and the producers are stopped when it ends or is closed."""
        try:
            yield from staged(self.start(source, addressable, epoch, workers, ordered, split, start),
                              transfer, depth, epoch, split)
        finally:
            self.stop()

    # -- producers ---------------------------------------------------------

    def _start_indexed(self, batch_at: Callable[[int], Any], n: int, workers: int, start: int = 0) -> None:
        claim = itertools.count(start).__next__
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
                    put(Failure(i, exc))

        for w in range(min(workers, max(n - start, 0))):
            self._spawn(work, f"{_THREAD_PREFIX}-{w}")

    def _start_iterating(self, source: Iterable) -> None:
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
                put(Failure(i, exc))
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
        """Stop and join every producer (idempotent); drop undelivered batches."""
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


# --------------------------------------------------------------------------
# delivery: each taken item gives its slot back


def _indexed_ordered(p: Producers, batch_at: Callable[[int], Any], n: int, epoch: int, start: int = 0,
                     split: str | None = None) -> Iterator[tuple[int, Any]]:
    get, release = p.out.get, p.slots.put
    pending: dict[int, Any] = {}
    width = None  # the first delivered batch's rows: a full batch at batch_at(n) is one len() hides
    for k in range(start, n):
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
        if item.__class__ is Failure:
            raise failure_error(k, item.exc, epoch, f"batch_at({k})", split, n)
        if width is None:
            width = batch_rows(item[1])
        yield item
    check_past_end(batch_at, n, width, split, epoch)


def _indexed_unordered(p: Producers, batch_at: Callable[[int], Any], n: int, epoch: int, start: int = 0,
                       split: str | None = None) -> Iterator[tuple[int, Any]]:
    get, release = p.out.get, p.slots.put
    width = 0  # the widest delivered batch (the first may be a partial final one)
    for _ in range(start, n):
        item = get()
        release(None)
        if item.__class__ is Failure:
            raise failure_error(item.index, item.exc, epoch, f"batch_at({item.index})", split, n)
        width = max(width, batch_rows(item[1]) or 0)
        yield item
    check_past_end(batch_at, n, width or None, split, epoch)


def _iterated(p: Producers, epoch: int, n: int, split: str | None) -> Iterator[tuple[int, Any]]:
    get, release = p.out.get, p.slots.put
    count = 0
    while True:
        item = get()
        if item is _END:
            if n is not None and count != n:
                raise SourceLengthError(split, n, count, epoch)
            return
        release(None)
        if item.__class__ is Failure:
            raise failure_error(item.index, item.exc, epoch, "iterating the source", split)
        if n is not None and count == n:
            raise SourceLengthError(split, n, n + 1, epoch)
        count += 1
        yield item


# --------------------------------------------------------------------------
# staging: transfers applied ahead of delivery


def staged(
    items: Iterator[tuple[int, Any]], transfer: Callable[[Any], Any] | None, depth: int, epoch: int,
    split: str | None = None,
) -> Iterator[Any]:
    """Apply ``transfer`` ``depth`` batches ahead of delivery to ``(index, batch)`` pairs from
    either host stage (the producer threads, or the core's serial ``host_items`` for
    ``workers=0``): an iterator of staged batches, so the host-to-device copy of batch ``k + 1``
    overlaps step ``k`` (JAX dispatches transfers asynchronously). For ``depth <= 0`` or no
    ``transfer``, the core's ``transferred`` itself: each batch just before its delivery.

    A failure in ``batch_at``, the source's iterator or ``transfer`` is raised as a
    ``PrefetchError`` naming the batch, after every batch before it was delivered, whatever
    the depth."""
    if transfer is None or depth <= 0:
        return transferred(items, transfer, epoch, split)
    return _ahead(items, transfer, depth, epoch, split)


def _ahead(
    items: Iterator[tuple[int, Any]], transfer: Callable[[Any], Any], depth: int, epoch: int,
    split: str | None,
) -> Iterator[Any]:
    ahead: collections.deque = collections.deque()
    push, pop = ahead.append, ahead.popleft
    nxt = items.__next__
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
            error = failure_error(i, exc, epoch, "transfer", split)
            break
        if len(ahead) > depth:
            yield pop()
    # batches already staged were produced and transferred without error: deliver
    # them, so that a failure surfaces at the same batch whatever device_batches is
    while ahead:
        yield pop()
    if error is not None:
        raise error
