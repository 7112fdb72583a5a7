"""The built-in prefetcher (entry point ``prefetch``): batches produced ahead of the step.

It answers ``jaxnitro_make_prefetcher`` for every split setup wraps with
:class:`PrefetchIterator` (``trylast``: an installed plugin answering the same
hook wins), and exports ``jn.PrefetchIterator`` and ``jn.check_batch_at``.
Disabled (``JAXNITRO_DISABLE_PLUGINS=prefetch``), the core reads every split
serially with its own ``jn.NoPrefetch``: same batches, same order, same
parameters, no threads.

* :mod:`.wrappers`: :class:`PrefetchIterator` (a ``jaxnitro.plugin.SplitWrapper``);
* :mod:`.workers`: what ``workers=None`` resolves to for a source;
* :mod:`.producers`: producer threads, bounded slots, ordered delivery, transfers staged
  ahead of delivery, teardown;
* :mod:`.check`: :func:`check_batch_at`, which verifies an index-addressable source.

The source contract, the serial pass, ``NoPrefetch`` and the errors
(``jn.PrefetchError``, ``jn.SourceLengthError``) are the core's, reached through
``jaxnitro.plugin``.
"""

from __future__ import annotations

from typing import Any

from jaxnitro.plugin import hookimpl

from .check import check_batch_at
from .wrappers import PrefetchIterator

__all__ = ["PrefetchIterator", "check_batch_at"]


@hookimpl(trylast=True)
def jaxnitro_make_prefetcher(source: Any, split: str) -> PrefetchIterator:
    """Every split: a :class:`PrefetchIterator` with its defaults."""
    return PrefetchIterator(source)


@hookimpl(trylast=True)
def jaxnitro_exports() -> dict[str, Any]:
    return {"PrefetchIterator": PrefetchIterator, "check_batch_at": check_batch_at}
