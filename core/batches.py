"""Host-side batch helpers: width, padding, slicing, peeking and source checks."""

from __future__ import annotations

from collections.abc import Mapping

import jax
import numpy as np

from .prefetch import NoPrefetch, PrefetchIterator, is_addressable

__all__ = ["batch_width", "pad_batch", "slice_outputs", "peek", "wrap_split", "check_train_split"]


def batch_width(batch: Mapping, split: str = "batch") -> int:
    """The leading dimension shared by every array field of ``batch``.

    Raises ``ValueError`` naming the fields when leading dims disagree.
    """
    dims = {k: np.shape(v)[0] for k, v in batch.items() if np.ndim(v) > 0}
    if not dims:
        raise ValueError(
            f"jaxnitro: the {split} has no array fields with a batch dimension "
            f"(fields: {sorted(batch)}); batch fields are arrays with the batch dimension first."
        )
    values = set(dims.values())
    if len(values) > 1:
        raise ValueError(
            f"jaxnitro: the {split}'s fields disagree on the batch size (first dimension): {dims}. "
            f"Every field of a batch must have the batch dimension first and the same length."
        )
    return values.pop()


def pad_batch(batch: Mapping, width: int) -> dict:
    """Pad every array field along axis 0 to ``width`` rows by repeating its last row."""
    out = {}
    for k, v in batch.items():
        v = np.asarray(v)
        n = v.shape[0] if v.ndim else 0
        if v.ndim and n < width:
            v = np.concatenate([v, np.repeat(v[-1:], width - n, axis=0)], axis=0)
        out[k] = v
    return out


def slice_outputs(outputs, n: int, width: int):
    """Slice every output leaf whose leading dimension is ``width`` back to ``n`` rows."""
    if n == width:
        return outputs
    return jax.tree_util.tree_map(
        lambda x: x[:n] if np.ndim(x) and np.shape(x)[0] == width else x, outputs
    )


def unwrap(source):
    """The user's source inside a PrefetchIterator/NoPrefetch wrapper."""
    return getattr(source, "source", source) if isinstance(source, (PrefetchIterator, NoPrefetch)) else source


def peek(source, epoch: int = 1):
    """The first batch of ``source`` without disturbing later epochs, or None if it cannot be read cheaply.

    Index-addressable sources (and lists) are read with ``begin_epoch(epoch)``
    + ``batch_at(0)``; plain iterables with one ``next(iter(source))``.
    """
    src = unwrap(source)
    if len(src) == 0:
        return None
    if isinstance(src, (list, tuple)):
        return src[0]
    if is_addressable(src):
        src.begin_epoch(epoch)
        return src.batch_at(0)
    return next(iter(src))


def last_batch(source, epoch: int = 1):
    """The last batch of an index-addressable source, or None for other sources."""
    src = unwrap(source)
    if isinstance(src, (list, tuple)):
        return src[-1]
    if is_addressable(src):
        src.begin_epoch(epoch)
        return src.batch_at(len(src) - 1)
    return None


def wrap_split(source, split: str):
    """Wrap a split in a PrefetchIterator unless it already is one (or NoPrefetch)."""
    if isinstance(source, (PrefetchIterator, NoPrefetch)):
        return source
    from .plugin_manager import first_result

    adapted = first_result("jaxnitro_adapt_source", source=source, split=split)
    if adapted is not None:  # a plugin knows this loader type (grain, torch, ...)
        source = adapted
        if isinstance(source, (PrefetchIterator, NoPrefetch)):
            return source
    if isinstance(source, Mapping):
        raise TypeError(
            f"jaxnitro: split `{split}` is a single dict; a split is a source of batches (an "
            f"iterable of dicts with len()). Wrap one batch in a list: `[batch]`."
        )
    try:
        len(source)
    except TypeError:
        raise TypeError(
            f"jaxnitro: split `{split}` ({type(source).__name__}) has no len(); a source is an "
            f"iterable of batch dicts with len() (or a list of batches)."
        ) from None
    return PrefetchIterator(source)


def check_train_split(train, accum: int) -> int:
    """Check the train split for ``accum``: batch count divisible, no partial final batch.

    Returns the batch width. Raises ``ValueError`` naming the split and the fix.
    """
    n = len(train)
    if n == 0:
        raise ValueError("jaxnitro: the `train` split has no batches.")
    if n % accum:
        raise ValueError(
            f"jaxnitro: the `train` split has {n} batches, which does not divide by accum={accum}: "
            f"every optimizer step accumulates {accum} micro-batches, so a remainder would be "
            f"dropped silently. Fix: choose an `accum` that divides {n}, or change the batch size "
            f"or the number of batches (e.g. drop {n % accum} more)."
        )
    first = peek(train)
    if first is None:
        raise ValueError("jaxnitro: the `train` split yielded no batch.")
    width = batch_width(first, "`train` split's first batch")
    last = last_batch(train)
    if last is not None:
        last_w = batch_width(last, "`train` split's last batch")
        if last_w != width:
            raise ValueError(
                f"jaxnitro: the `train` split ends with a partial batch ({last_w} rows, the others "
                f"have {width}). The train split must drop its partial final batch (a partial batch "
                f"would compile a second gradient program and weight its rows differently). Fix: "
                f"build the loader with drop_last=True / drop the final batch. Evaluation splits may "
                f"keep theirs: they are padded."
            )
    return width
