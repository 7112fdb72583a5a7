"""Transfer-ahead staging: ``transfer`` applied ``depth`` batches ahead of delivery.

:func:`staged` takes ``(index, batch)`` pairs from either host stage (the
producer threads of :mod:`.producers`, or the core's serial
``jaxnitro.plugin.host_items`` for ``workers=0``) and applies ``transfer``
``depth`` batches ahead of delivery, so the host-to-device copy of batch
``k + 1`` overlaps step ``k`` (JAX dispatches transfers asynchronously).
``depth=0`` is the core's ``transferred``: each batch just before its delivery.

A failure in ``batch_at``, the source's iterator or ``transfer`` is raised as
a ``PrefetchError`` naming the batch, after every batch before it has been
delivered, whatever the depth.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from typing import Any

from jaxnitro.plugin import PrefetchError, failure_error, transferred

__all__ = ["staged"]


def staged(
    items: Iterator[tuple[int, Any]], transfer: Callable[[Any], Any] | None, depth: int, epoch: int,
    split: str | None = None,
) -> Iterator[Any]:
    """Apply ``transfer`` ``depth`` batches ahead of delivery: an iterator of staged batches
    (for ``depth <= 0`` or no ``transfer``, the core's ``transferred`` itself: no extra layer)."""
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
