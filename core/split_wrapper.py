"""The wrapped split the loop reads: :class:`SplitWrapper`, the :class:`EpochStream` it opens,
and :class:`NoPrefetch`, the core's serial wrapper and the fallback.

In: a data source (see :mod:`jaxnitro.source_contract`); a foreign loader (a torch
``DataLoader``, a grain ``MapDataset``) is adapted first, through the adapter
jaxnitro installs (:func:`~jaxnitro.source_contract.adapted`), so wrapping a loader
reads it as the framework would unwrapped. A wrapper validates it once
(``TypeError`` for one without ``len()`` that is addressable or an iterator, or for
one already wrapped). Out, for each call of ``epoch(epoch, transfer, start)``: an
:class:`EpochStream` of transferred batches. Iterating it raises ``PrefetchError``
when a batch cannot be produced or transferred, and ``RuntimeError`` once a newer
stream of the same wrapper has closed it (the one-stream rule: ``begin_epoch`` sets
state on the shared source).

Every split is wrapped at setup through the ``jaxnitro_make_prefetcher`` hook (the
built-in ``prefetch`` plugin answers with its ``PrefetchIterator``, a subclass of
:class:`SplitWrapper` that produces batches ahead in threads). When no plugin answers
(the ``prefetch`` plugin disabled), the core wraps the split in :class:`NoPrefetch`:
each batch is read and transferred in the consumer's thread
(:func:`jaxnitro.serial_pass.serial`), with the same order, the same errors and so
the same parameters. Any object with the :class:`jaxnitro.plugin.Prefetcher` shape
can stand in for a wrapper; :class:`SplitWrapper` is a base a plugin may build on
(``jaxnitro.plugin.SplitWrapper``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from .contracts import Prefetcher
from .serial_pass import serial
from .source_contract import adapted, check_epoch, describe, is_addressable

__all__ = ["EpochStream", "NoPrefetch", "SplitWrapper"]


class SplitWrapper:
    """What every jaxnitro split wrapper shares: the source, its one open stream,
    ``len()``, ``epoch()``, ``info()``, ``release()`` and the serial path.

    The settings ``workers``, ``device_batches``, ``host_batches`` and
    ``ordered`` are set by each subclass; :class:`NoPrefetch` is the serial path
    with ``workers=0`` and ``device_batches=0``. A subclass that reads the source
    another way (the ``prefetch`` plugin's ``PrefetchIterator``: producer threads,
    transfers staged ahead) overrides ``_stream(epoch, transfer, start) -> iterator of
    transferred batches`` and ``_path() -> str`` (what ``info()["path"]`` says);
    ``epoch()`` validates the arguments and enforces the one-stream rule around it.
    """

    source: Any
    addressable: bool
    split: str | None = None  # the split's name, for messages (set by jaxnitro when it wraps a split)
    workers: int
    device_batches: int
    host_batches: int
    ordered: bool

    def __init__(self, source: Any, name: str, unwrap_hint: str, len_hint: str = ""):
        if isinstance(source, Prefetcher):
            raise TypeError(f"{name} got a {type(source).__name__} as its source; {unwrap_hint}")
        source = adapted(source)  # a foreign loader (torch, grain) through its plugin's adapter
        if isinstance(source, Prefetcher):  # an adapter that wraps: these settings win
            source = source.source
        self.addressable = is_addressable(source)
        try:
            len(source)
            self.sized = True
        except TypeError:
            if hasattr(type(source), "__next__"):  # an iterator or generator: one pass only
                raise TypeError(
                    f"jaxnitro: {describe(source)} is an iterator, read once: its second epoch would be "
                    f"empty. A stream without len() (in a run bounded by max_steps) must be an iterable "
                    f"whose __iter__ starts a new pass each epoch (a class with __iter__, a grain "
                    f"IterDataset); or pass a list of batches."
                ) from None
            if self.addressable:  # batch_at(i) is defined for 0 <= i < len(source)
                raise TypeError(
                    f"a data source must have len() (the number of batches per epoch); "
                    f"{describe(source)} has none{len_hint}"
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
        """The serial path: read and transfer each batch in the consumer's thread."""
        return serial(self.source, self.addressable, epoch, transfer, self.split, start)

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
    """The iterator that :meth:`SplitWrapper.epoch` returns (a ``PrefetchIterator``'s too).

    Iterate it once. ``close()`` (or leaving a ``with`` block, or dropping the
    last reference) tears the stream down and joins its producer threads; a
    ``for`` loop that ends or breaks does the same once the stream is no longer
    referenced. A wrapper has one open stream at a time: starting another, or
    :meth:`SplitWrapper.release`, closes this one, and a later ``next()``
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

    def _supersede(self, owner: SplitWrapper) -> None:
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


class NoPrefetch(SplitWrapper):
    """Opt a split out of prefetching: produce and transfer each batch on demand.

    Same interface as ``jn.PrefetchIterator`` (the ``prefetch`` plugin), and the same
    serial path as ``PrefetchIterator(source, workers=0, device_batches=0)``:
    :meth:`epoch` calls ``begin_epoch(epoch)`` and ``batch_at(i)`` for an addressable
    source, or iterates the source, in the consumer's thread, and applies ``transfer``
    to each batch just before delivering it. No threads, nothing staged ahead.

    **The fallback.** This is the core's own wrapper: when no plugin answers
    ``jaxnitro_make_prefetcher`` for a split (the ``prefetch`` plugin disabled,
    ``JAXNITRO_DISABLE_PLUGINS=prefetch``), setup wraps the split in a ``NoPrefetch``,
    so a run still trains, in the same batch order, to the same parameters.
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
    """What the data band should say about ``source`` (see :meth:`SplitWrapper.info`)."""
    note = getattr(source, "prefetch_note", "")
    if note:
        return str(note)
    if isinstance(source, (list, tuple)):
        return "a list of batches: the same order every epoch (not reshuffled)"
    return ""
