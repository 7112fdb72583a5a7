"""Prefetching: produce batches ahead of the step that consumes them.

Every data split the framework iterates is wrapped in a :class:`PrefetchIterator`
unless the user returned one already, or opted out with :class:`NoPrefetch`.

* :mod:`.contract`: what a data source offers; :func:`check_batch_at`.
* :mod:`.failures`: :class:`PrefetchError`, how a failed batch reaches the consumer;
  :class:`SourceLengthError`, a source yielding other than ``len()`` batches.
* :mod:`.producers`: producer threads, bounded slots, delivery, teardown.
* :mod:`.staging`: the synchronous path and transfer-ahead staging.
* :mod:`.wrappers`: :class:`PrefetchIterator`, :class:`NoPrefetch`, :class:`EpochStream`.

This package imports no other part of jaxnitro.
"""

from __future__ import annotations

from .contract import check_batch_at, is_addressable
from .failures import PrefetchError, SourceLengthError
from .wrappers import EpochStream, NoPrefetch, PrefetchIterator

__all__ = [
    "EpochStream",
    "NoPrefetch",
    "PrefetchError",
    "SourceLengthError",
    "PrefetchIterator",
    "check_batch_at",
    "is_addressable",
]
