"""The data-source contract: what a source offers, and a check that it keeps it.

A *source* is what a data split is made of: anything with ``len()`` (batches
per epoch) that is iterable, or *index-addressable* (:func:`is_addressable`).
A batch is a dict of NumPy arrays, batch dimension first.

In: a source object. Out:

* :func:`is_addressable`: whether several producers can read it (never raises);
* :func:`accessors`: its ``(batch_at, begin_epoch)`` pair, a list or tuple
  read by indexing;
* :func:`default_workers`: what ``PrefetchIterator(workers=None)`` resolves to;
  ``ValueError`` for a bad ``prefetch_workers`` attribute;
* :func:`check_epoch`: an epoch number as an ``int``; ``ValueError`` unless
  it is an int >= 0;
* optionally, a *column source* also offers ``columns()`` (``{field: in-memory array}``,
  or None), ``order(epoch)`` (the epoch's row order) and ``batch_size``, such that batch
  ``i`` of epoch ``e`` is ``{f: columns[f][order(e)[i * batch_size:(i + 1) * batch_size]]}``;
  the loop then reads ``steps_per_dispatch`` blocks by row numbers (``jaxnitro.blocks``);
* :func:`check_batch_at`: ``None`` when an addressable source keeps the
  contract; ``TypeError`` when it lacks a method or ``len()``, ``ValueError``
  naming the batch index and field that breaks it;
* optionally, a source that shuffles defines ``bind_seed(seed: int) -> None``:
  :func:`bind_seed` calls it once at setup with the run's ``seed`` knob, before
  any epoch is read, and a source built without its own seed then draws its
  order from it (one built with an explicit seed ignores the call). The call
  must leave the plan a function of ``(seed, epoch)`` only, so that a fixed
  run seed still reproduces a run at any worker count;
* :func:`adapted`: a foreign loader (a torch ``DataLoader``, a grain
  ``MapDataset``) as a jaxnitro source, through the adapter jaxnitro installs
  with :func:`use_adapter` (its ``jaxnitro_adapt_source`` plugin hook). The
  wrappers adapt their source with it, so a loader is adapted whether the
  framework wraps it or the user does (``PrefetchIterator(loader, workers=3)``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np


_adapter: Callable[[Any, str | None], Any] | None = None


def use_adapter(fn: Callable[[Any, str | None], Any] | None) -> None:
    """Install ``fn(source, split) -> adapted source or None`` as the adapter :func:`adapted`
    uses (jaxnitro installs its ``jaxnitro_adapt_source`` hook at import; this package imports
    no other part of jaxnitro). ``None`` removes it."""
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

    :func:`check_batch_at` verifies an implementation.
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


def default_workers(source: Any, addressable: bool) -> int:
    """What ``workers=None`` means for ``source``; see PrefetchIterator."""
    hint = getattr(source, "prefetch_workers", None)
    if hint is not None:
        if isinstance(hint, bool) or not isinstance(hint, (int, np.integer)) or hint < 0:
            raise ValueError(
                f"{describe(source)}.prefetch_workers is {hint!r}; it must be an int >= 0 "
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


def describe(source: Any) -> str:
    """How messages name ``source``: its type."""
    return type(source).__qualname__


def check_epoch(epoch: Any) -> int:
    """``epoch`` as an ``int``; ``ValueError`` unless it is an int >= 0."""
    if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
        raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
    return int(epoch)


# --------------------------------------------------------------------------
# verifying an index-addressable source


_CONTRACT = (
    "An index-addressable source defines begin_epoch(epoch) -> None, which fixes that "
    "epoch's plan (its shuffle) from the epoch number, and batch_at(i) -> batch, which "
    "returns the i-th batch of that epoch for 0 <= i < len(source): the same arrays every "
    "time it is called, safely from several threads at once."
)


def _fields(batch: Any, i: int) -> dict[str, np.ndarray]:
    if not isinstance(batch, Mapping):
        raise ValueError(
            f"batch_at({i}) returned a {type(batch).__name__}; a batch is a dict of "
            "NumPy arrays, batch dimension first"
        )
    return {str(k): np.asarray(v) for k, v in batch.items()}


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    try:
        return bool(np.array_equal(a, b, equal_nan=True))
    except TypeError:  # dtypes without NaN (strings, objects)
        return bool(np.array_equal(a, b))


def _require_same(
    i: int, ref: dict[str, np.ndarray], again: dict[str, np.ndarray], problem: str
) -> None:
    """Raise ``batch_at(i) field 'name' <problem>`` for the first field of ``ref`` that
    ``again`` (batch ``i`` fetched anew) lacks or holds a different array in."""
    for name, a in ref.items():
        if name not in again or not _same(a, again[name]):
            raise ValueError(f"batch_at({i}) field {name!r} {problem}")


def check_batch_at(source: Any, epoch: int = 0) -> None:
    """Verify that ``source`` is a correct index-addressable source.

    Calls ``source.begin_epoch(epoch)``, then ``source.batch_at(i)`` twice for
    every ``i`` in ``range(len(source))``, and checks that

    - every batch is a dict with the field names of ``batch_at(0)``, and each
      field has ``batch_at(0)``'s dtype and shape, except that the final batch
      may be shorter along the batch (first) dimension;
    - both calls for the same ``i`` return equal arrays (determinism);
    - all ``len(source)`` batches exist (an ``IndexError`` before the end is
      an error);
    - calling ``begin_epoch(epoch)`` again gives the same first and last batch,
      so the plan depends on the epoch, not on how often it was set (a resumed
      run sees the same order).

    Thread safety cannot be proved by a check; ``batch_at`` must not mutate
    shared state.

    **Raises:** ``TypeError`` if ``batch_at``, ``begin_epoch`` or ``len`` is
    missing; ``ValueError`` naming the index and the field that fails.
    **Returns:** ``None``.
    """
    if not is_addressable(source):
        missing = [m for m in ("batch_at", "begin_epoch") if not callable(getattr(source, m, None))]
        raise TypeError(f"{describe(source)} lacks {' and '.join(missing)}. {_CONTRACT}")
    try:
        n = len(source)
    except TypeError:
        raise TypeError(
            f"{describe(source)} has no len(); it must return the number of batches per epoch"
        ) from None
    epoch = check_epoch(epoch)
    batch_at, begin = accessors(source)
    begin(epoch)
    if n == 0:
        return

    def fetch(i: int) -> dict[str, np.ndarray]:
        try:
            return _fields(batch_at(i), i)
        except ValueError:  # _fields' own message
            raise
        except IndexError as exc:
            raise ValueError(
                f"batch_at({i}) raised IndexError, but len(source) is {n}, so batches "
                f"0..{n - 1} must exist: {exc}"
            ) from exc
        except Exception as exc:
            raise ValueError(f"batch_at({i}) raised {type(exc).__name__}: {exc}") from exc

    first = fetch(0)
    if not first:
        raise ValueError("batch_at(0) returned an empty dict; a batch needs at least one field")
    names = set(first)
    last = first
    for i in range(n):
        b = first if i == 0 else fetch(i)
        if set(b) != names:
            extra, lacking = sorted(set(b) - names), sorted(names - set(b))
            field = (lacking or extra)[0]
            raise ValueError(
                f"batch_at({i}) field {field!r}: batch {i} has fields {sorted(b)}, batch 0 has "
                f"{sorted(names)}" + (f"; missing {lacking}" if lacking else "")
                + (f"; extra {extra}" if extra else "")
            )
        for name, a in b.items():
            ref = first[name]
            if a.dtype != ref.dtype:
                raise ValueError(
                    f"batch_at({i}) field {name!r}: dtype {a.dtype}, batch 0 has {ref.dtype}"
                )
            final = i == n - 1
            if a.ndim != ref.ndim or a.shape[1:] != ref.shape[1:] or (
                a.shape[:1] != ref.shape[:1] and not (final and a.ndim and a.shape[0] <= ref.shape[0])
            ):
                raise ValueError(
                    f"batch_at({i}) field {name!r}: shape {a.shape}, batch 0 has {ref.shape}"
                    + ("" if final else "; only the final batch may be shorter in its first dimension")
                )
        _require_same(
            i, b, fetch(i),
            "differs between two calls; batch_at must be deterministic for a given epoch (draw "
            "any randomness in begin_epoch, from the epoch number)",
        )
        last = b
    begin(epoch)
    for i, ref in ((0, first), (n - 1, last)):
        _require_same(
            i, ref, fetch(i),
            f"changed after begin_epoch({epoch}) was called again; the epoch's plan must be a "
            "function of the epoch (and the source's seed), so that a resumed run sees the same "
            "order",
        )
