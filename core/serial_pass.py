"""One pass over a source in the consumer's own thread: no threads, nothing staged ahead.

:func:`host_items` is the serial host stage: in a source, an epoch and a start
index; out a generator of ``(index, batch)`` pairs. Nothing happens until its
first ``next()``; then ``begin_epoch(epoch)`` and ``batch_at(i)`` are called
for an addressable source, or the source is iterated once (the batches before
``start`` read and dropped). :func:`transferred` applies ``transfer`` to each
pair's batch just before delivering it. :func:`serial` is the two together: the
path :class:`jaxnitro.NoPrefetch` (the core's fallback wrapper) always takes; the
``prefetch`` plugin's ``PrefetchIterator(workers=0)`` reads :func:`host_items`
too and stages its transfers ahead.

A failure in ``batch_at``, the source's iterator or ``transfer`` is raised as
a :class:`~jaxnitro.source_errors.PrefetchError` naming the batch; an iterated
source with ``len()`` that yields another number of batches raises
:class:`~jaxnitro.source_errors.SourceLengthError` naming the split, and so does
an addressable one that serves a full batch one past ``len()`` at the end of a
complete pass (:func:`check_past_end`, which the ``prefetch`` plugin's passes
call too).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from .source_contract import accessors, length_of
from .source_errors import SourceLengthError, failure_error

__all__ = ["batch_rows", "check_past_end", "host_items", "serial", "skipped", "transferred"]


def serial(
    source: Any,
    addressable: bool,
    epoch: int,
    transfer: Callable[[Any], Any] | None,
    split: str | None = None,
    start: int = 0,
) -> Iterator[Any]:
    """One pass over ``source`` in the consumer's thread from batch ``start`` on, each batch
    transferred just before delivery (see the module docstring)."""
    return transferred(host_items(source, addressable, epoch, split, start), transfer, epoch, split)


def host_items(
    source: Any, addressable: bool, epoch: int, split: str | None = None, start: int = 0,
) -> Iterator[tuple[int, Any]]:
    """The ``(index, batch)`` pairs of ``epoch`` from batch ``start`` on, read in the caller's thread.

    An iterated source with ``len()`` must yield exactly ``len(source)`` batches
    (:class:`SourceLengthError` naming ``split`` otherwise); one without is read to its end."""
    if addressable:
        return _indexed(source, epoch, split, start)
    return skipped(_iterated(source, epoch, split), start)


def skipped(items: Iterator[tuple[int, Any]], start: int) -> Iterator[tuple[int, Any]]:
    """``items`` without those whose index is below ``start`` (read, then dropped)."""
    if start <= 0:
        return items
    return (item for item in items if (item[0] if item.__class__ is tuple else item.index) >= start)


def _indexed(source: Any, epoch: int, split: str | None = None, start: int = 0) -> Iterator[tuple[int, Any]]:
    batch_at, begin = accessors(source)
    begin(epoch)
    n = len(source)
    width = None
    for i in range(start, n):
        try:
            batch = batch_at(i)
        except Exception as exc:  # noqa: BLE001
            raise failure_error(i, exc, epoch, f"batch_at({i})", split, n)
        if width is None:
            width = batch_rows(batch)
        yield i, batch
    check_past_end(batch_at, n, width, split, epoch)


def batch_rows(batch: Any) -> int | None:
    """The rows of ``batch`` (a dict's first array field's first dimension), or None when it
    is not a dict or has no array field."""
    if not isinstance(batch, Mapping):
        return None
    for value in batch.values():
        shape = np.shape(value)
        if shape:
            return int(shape[0])
    return None


def check_past_end(
    batch_at: Callable[[int], Any], n: int, width: int | None, split: str | None, epoch: int,
    when: str = "", subject: str | None = None,
) -> None:
    """After the batches below ``len()`` (``n``) were read: ``batch_at(n)`` must not serve a
    full batch, one with at least ``width`` rows (the pass's first batch's; None: nothing was
    read, nothing is checked). Raises :class:`SourceLengthError` naming ``split`` when it does:
    the source has more batches than ``len()``, and an epoch would never read them.

    A source keeping the contract raises ``IndexError`` there (``jn.ArraySource`` and the torch
    and grain adapters do), or returns an empty or partial batch (a slice past its rows, a
    partial final batch that ``len()`` drops), and any exception counts as "no batch": so a
    ``len()`` one short of the batches is caught unless the batch it hides is partial (then it
    cannot be told from a dropped remainder). A source that can tell its ``len()`` hides data
    (the torch and grain adapters, whose dataset serves the index at its own length) raises
    ``SourceLengthError.hidden`` from ``batch_at(n)``: raised again here naming ``split``.
    ``batch_at`` is called once, in the caller's thread, while the epoch's plan
    (``begin_epoch``) is still the pass's. ``subject``: how the message names the length
    that disagrees instead of ``jaxnitro: the `<split>` split's len()`` (``jn.check_batch_at``
    says ``len(source)``)."""
    if not width:
        return
    try:
        extra = batch_at(n)
    except SourceLengthError as err:  # the source knows its len() hides data (an adapter)
        detail = getattr(err, "detail", None)
        if detail is None:
            raise
        raise SourceLengthError.hidden(split, n, epoch, detail, err.fix, when, subject) from None
    except Exception:  # noqa: BLE001 - the end of the batches, as the contract says
        return
    rows = batch_rows(extra)
    if rows is not None and rows >= width:
        raise SourceLengthError.past_end(split, n, rows, width, epoch, when, subject)


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


def transferred(
    items: Iterator[tuple[int, Any]], transfer: Callable[[Any], Any] | None, epoch: int,
    split: str | None = None,
) -> Iterator[Any]:
    """The batches of ``items``, each passed through ``transfer`` (None: as they are) just
    before it is delivered; a failing ``transfer`` raises ``PrefetchError`` naming the batch."""
    if transfer is None:
        for _, batch in items:
            yield batch
        return
    for i, batch in items:
        try:
            out = transfer(batch)
        except Exception as exc:  # noqa: BLE001
            raise failure_error(i, exc, epoch, "transfer", split)
        yield out
