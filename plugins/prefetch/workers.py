"""How many producer threads ``PrefetchIterator(workers=None)`` runs for a source.

:func:`default_workers`: the source's own ``prefetch_workers`` attribute when it has
one (``ValueError`` for a value that is not an int >= 0), ``0`` for a list or tuple of
batches, ``min(4, cpu count)`` for another index-addressable source, ``1`` otherwise.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from jaxnitro.plugin import describe_source

__all__ = ["default_workers"]


def default_workers(source: Any, addressable: bool) -> int:
    """What ``workers=None`` means for ``source``; see PrefetchIterator."""
    hint = getattr(source, "prefetch_workers", None)
    if hint is not None:
        if isinstance(hint, bool) or not isinstance(hint, (int, np.integer)) or hint < 0:
            raise ValueError(
                f"{describe_source(source)}.prefetch_workers is {hint!r}; it must be an int >= 0 "
                "(the producer threads PrefetchIterator(workers=None) runs for this source)"
            )
        return int(hint)
    if isinstance(source, (list, tuple)):
        return 0
    if addressable:
        return min(4, _default_cpus())
    return 1


def _default_cpus() -> int:
    fn = getattr(os, "process_cpu_count", None)  # Python 3.13+
    if fn is not None:
        n = fn()
    elif hasattr(os, "sched_getaffinity"):
        n = len(os.sched_getaffinity(0))
    else:
        n = os.cpu_count()
    return max(1, n or 1)
