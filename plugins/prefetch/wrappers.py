"""``jn.PrefetchIterator``: a split read ahead of the step by producer threads, in order.

In: a data source (see ``jaxnitro.source_contract``); a foreign loader (a torch
``DataLoader``, a grain ``MapDataset``) is adapted first, through the adapter
jaxnitro installs (``jaxnitro.plugin.adapted``), so wrapping a loader reads it as
the framework would unwrapped. It is a ``jaxnitro.plugin.SplitWrapper`` (which
``jn.NoPrefetch``, the core's serial wrapper, is too). A wrapper validates it once
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
     (the core's serial host stage, ``jaxnitro.plugin.host_items``, which
     ``jn.NoPrefetch`` always takes).
     ``workers=None`` (the default) reads a source's ``prefetch_workers``
     attribute when it has one, so a source whose batches are cheap to make
     (gathered from arrays in memory) can say ``prefetch_workers = 0``.

2. **Staging.** ``transfer(batch)`` (typically a host-to-device copy of the
   fields the hooks use) is applied in the consumer's thread, ``device_batches``
   batches ahead of the one being consumed (:func:`.producers.staged`). JAX
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

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import structlog

from jaxnitro.plugin import SplitWrapper, describe_source, host_items

from .producers import Producers, staged
from .workers import _default_cpus, default_workers

__all__ = ["PrefetchIterator"]


class PrefetchIterator(SplitWrapper):
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
      (:meth:`adopt`, at setup).

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
                f"{describe_source(source)} is neither"
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
                source=describe_source(source),
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
            source=describe_source(self.source),
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

    def adopt(self, split: str | None = None) -> None:
        """jaxnitro took this wrapper as split ``split`` (at setup): :meth:`warn_one_producer`."""
        self.warn_one_producer(split)

    def _stream(self, epoch: int, transfer: Callable[[Any], Any] | None, start: int = 0) -> Iterator:
        if self.workers == 0:  # the consumer's thread, transfers staged ahead
            items = host_items(self.source, self.addressable, epoch, self.split, start)
            return staged(items, transfer, self.device_batches, epoch, self.split)
        return Producers(self.host_batches).stream(self.source, self.addressable, epoch, self.workers, self.ordered,
                                                   transfer, self.device_batches, self.split, start)

    def __repr__(self) -> str:
        i = self.info()
        return (
            f"PrefetchIterator({describe_source(self.source)}, {len(self) if self.sized else 'a stream of'} batches, {i['path']}, "
            f"device_batches={i['device_batches']}, host_batches={i['host_batches']}, "
            f"ordered={i['ordered']})"
        )

