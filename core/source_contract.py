"""The data-source contract the core relies on: what a source offers, read without threads.

A *source* is what a data split is made of: anything with ``len()`` (batches
per epoch) that is iterable, or *index-addressable* (:func:`is_addressable`).
A batch is a dict of NumPy arrays, batch dimension first. The shapes are
:class:`jaxnitro.plugin.Source` and :class:`jaxnitro.plugin.IndexedSource`;
``jn.check_batch_at`` (the ``prefetch`` plugin) verifies an addressable one.

In: a source object. Out:

* :func:`is_addressable`: whether several producers can read it (never raises);
* :func:`accessors`: its ``(batch_at, begin_epoch)`` pair, a list or tuple
  read by indexing;
* :func:`length_of`: ``len(source)``, or None for a stream without one;
* :func:`check_epoch`: an epoch number as an ``int``; ``ValueError`` unless
  it is an int >= 0;
* optionally, a *column source* also offers ``columns()`` (``{field: in-memory array}``,
  or None), ``order(epoch)`` (the epoch's row order) and ``batch_size``, such that batch
  ``i`` of epoch ``e`` is ``{f: columns[f][order(e)[i * batch_size:(i + 1) * batch_size]]}``;
  the loop then reads ``steps_per_dispatch`` blocks by row numbers (``jaxnitro.blocks``);
* optionally, a source that shuffles defines ``bind_seed(seed: int) -> None``:
  :func:`bind_seed` calls it once at setup with the run's ``seed`` knob, before
  any epoch is read, and a source built without its own seed then draws its
  order from it (one built with an explicit seed ignores the call). The call
  must leave the plan a function of ``(seed, epoch)`` only, so that a fixed
  run seed still reproduces a run at any worker count;
* :func:`adapted`: a foreign loader (a torch ``DataLoader``, a grain
  ``MapDataset``) as a jaxnitro source, through the adapter jaxnitro installs
  with :func:`use_adapter` (its ``jaxnitro_adapt_source`` plugin hook). The
  split wrappers adapt their source with it, so a loader is adapted whether the
  framework wraps it or the user does (``PrefetchIterator(loader, workers=3)``).

This module imports no other part of jaxnitro.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np


_adapter: Callable[[Any, str | None], Any] | None = None


def use_adapter(fn: Callable[[Any, str | None], Any] | None) -> None:
    """Install ``fn(source, split) -> adapted source or None`` as the adapter :func:`adapted`
    uses (jaxnitro installs its ``jaxnitro_adapt_source`` hook at import, from
    :mod:`jaxnitro.sources`; this module imports no other part of jaxnitro). ``None`` removes it."""
    global _adapter
    _adapter = fn


def adapted(source: Any, split: str | None = None) -> Any:
    """``source`` as a jaxnitro source: what the installed adapter makes of it (a plugin that
    knows the loader's type), else ``source`` itself. ``split`` names the split in the
    adapter's messages (None when not known yet: a wrapper built in ``build_data``)."""
    if _adapter is None:
        return source
    out = _adapter(source, split)
    return source if out is None else out


def bind_seed(source: Any, seed: int) -> bool:
    """Call ``source.bind_seed(seed)`` when the source defines it; whether it did.

    The framework calls this once per split at setup with the run's ``seed`` knob
    (see the module docstring)."""
    fn = getattr(source, "bind_seed", None)
    if not callable(fn):
        return False
    fn(int(seed))
    return True


def is_addressable(source: Any) -> bool:
    """Whether several producers can read ``source``.

    True for a ``list`` or ``tuple`` of batches (indexing is ``batch_at``,
    ``begin_epoch`` is a no-op) and for any object with callable ``batch_at``
    and ``begin_epoch`` attributes:

    * ``begin_epoch(epoch: int) -> None`` fixes that epoch's plan (its shuffle);
    * ``batch_at(i: int) -> batch`` then returns the ``i``-th batch of that
      epoch, for ``0 <= i < len(source)``: deterministic, and safe to call from
      several threads at once.

    ``jn.check_batch_at`` (the ``prefetch`` plugin) verifies an implementation.
    """
    if isinstance(source, (list, tuple)):
        return True
    return callable(getattr(source, "batch_at", None)) and callable(
        getattr(source, "begin_epoch", None)
    )


def accessors(source: Any) -> tuple[Callable[[int], Any], Callable[[int], None]]:
    """``(batch_at, begin_epoch)`` of an addressable ``source``."""
    if isinstance(source, (list, tuple)):
        return source.__getitem__, _no_begin
    return source.batch_at, source.begin_epoch


def _no_begin(epoch: int) -> None:
    return None


def length_of(source: Any) -> int | None:
    """``len(source)``, or None for a stream without one (read until it ends)."""
    try:
        return len(source)
    except TypeError:
        return None


def describe(source: Any) -> str:
    """How messages name ``source``: its type."""
    return type(source).__qualname__


def check_epoch(epoch: Any) -> int:
    """``epoch`` as an ``int``; ``ValueError`` unless it is an int >= 0."""
    if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
        raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
    return int(epoch)
