"""``jn.check_batch_at``: verify that an index-addressable source keeps its contract.

In: a source with ``batch_at(i)``, ``begin_epoch(epoch)`` and ``len()`` (the shape
:class:`jaxnitro.plugin.IndexedSource`), the contract several producer threads rely on.
Out: ``None`` when it keeps it; ``TypeError`` when it lacks a method or ``len()``,
``ValueError`` naming the batch index and field that breaks it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxnitro.plugin import (
    SourceLengthError, accessors, batch_rows, check_epoch, check_past_end, describe_source, is_addressable,
)

__all__ = ["check_batch_at"]


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
      an error), and ``batch_at(len(source))``, one past them, serves no full
      batch (``len()`` would hide it: what the run refuses too);
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
        raise TypeError(f"{describe_source(source)} lacks {' and '.join(missing)}. {_CONTRACT}")
    try:
        n = len(source)
    except TypeError:
        raise TypeError(
            f"{describe_source(source)} has no len(); it must return the number of batches per epoch"
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
    try:
        check_past_end(batch_at, n, batch_rows(first), None, epoch, subject="len(source)")
    except SourceLengthError as exc:
        raise ValueError(str(exc)) from None
    begin(epoch)
    for i, ref in ((0, first), (n - 1, last)):
        _require_same(
            i, ref, fetch(i),
            f"changed after begin_epoch({epoch}) was called again; the epoch's plan must be a "
            "function of the epoch (and the source's seed), so that a resumed run sees the same "
            "order",
        )
