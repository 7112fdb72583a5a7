"""The synchronous host stage, and transfer-ahead staging for both stages.

:func:`synchronous` is the one path that produces batches in the consumer's
own thread, with no threads at all: ``NoPrefetch`` always, and
``PrefetchIterator(workers=0)``. In: a source, an epoch, ``transfer`` and a
staging depth. Out: a generator of staged batches. Nothing happens until its
first ``next()``; then ``begin_epoch(epoch)`` and ``batch_at(i)`` are called
for an addressable source, or the source is iterated once.

:func:`staged` takes ``(index, batch)`` pairs from either host stage and
applies ``transfer`` ``depth`` batches ahead of delivery.

A failure in ``batch_at``, the source's iterator or ``transfer`` is raised as
a ``PrefetchError`` naming the batch, after every batch before it has been
delivered, whatever the depth.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from .contract import accessors
from .failures import PrefetchError, SourceLengthError, failure_error


def synchronous(
    source: Any,
    addressable: bool,
    epoch: int,
    transfer: Callable[[Any], Any] | None,
    depth: int,
    split: str | None = None,
    start: int = 0,
) -> Iterator[Any]:
    """One pass over ``source`` in the consumer's thread, staged ``depth`` ahead, from batch
    ``start`` on (an iterated source reads and drops the batches before it).

    An iterated source with ``len()`` must yield exactly ``len(source)`` batches
    (:class:`SourceLengthError` naming ``split`` otherwise); one without is read to its end."""
    items = _indexed(source, epoch, split, start) if addressable else skipped(_iterated(source, epoch, split), start)
    return staged(items, transfer, depth, epoch, split)


def skipped(items: Iterator[tuple[int, Any]], start: int) -> Iterator[tuple[int, Any]]:
    """``items`` without those whose index is below ``start`` (read, then dropped)."""
    if start <= 0:
        return items
    return (item for item in items if (item[0] if item.__class__ is tuple else item.index) >= start)


def _indexed(source: Any, epoch: int, split: str | None = None, start: int = 0) -> Iterator[tuple[int, Any]]:
    batch_at, begin = accessors(source)
    begin(epoch)
    n = len(source)
    for i in range(start, n):
        try:
            batch = batch_at(i)
        except Exception as exc:  # noqa: BLE001
            raise failure_error(i, exc, epoch, f"batch_at({i})", split, n)
        yield i, batch


def _iterated(source: Iterable, epoch: int, split: str | None = None) -> Iterator[tuple[int, Any]]:
    i = 0
    n = length_of(source)
    try:
        it = iter(source)
    except Exception as exc:  # noqa: BLE001
        raise failure_error(0, exc, epoch, "iterating the source", split)
    try:
        while True:
            try:
                batch = next(it)
            except StopIteration:
                if n is not None and i != n:
                    raise SourceLengthError(split, n, i, epoch) from None
                return
            except Exception as exc:  # noqa: BLE001
                raise failure_error(i, exc, epoch, "iterating the source", split)
            if n is not None and i == n:
                raise SourceLengthError(split, n, n + 1, epoch)
            yield i, batch
            i += 1
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()


def length_of(source: Any) -> int | None:
    """``len(source)``, or None for a stream without one (read until it ends)."""
    try:
        return len(source)
    except TypeError:
        return None


def staged(
    items: Iterator[tuple[int, Any]], transfer: Callable[[Any], Any] | None, depth: int, epoch: int,
    split: str | None = None,
) -> Iterator[Any]:
    """Apply ``transfer`` ``depth`` batches ahead of delivery; yield staged batches."""
    if transfer is None:
        for _, batch in items:
            yield batch
        return
    if depth <= 0:
        for i, batch in items:
            try:
                out = transfer(batch)
            except Exception as exc:  # noqa: BLE001
                raise failure_error(i, exc, epoch, "transfer", split)
            yield out
        return
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
