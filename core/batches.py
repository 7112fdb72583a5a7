"""Host-side batch helpers: width, padding, slicing, peeking and source checks."""

from __future__ import annotations

from collections.abc import Mapping

import jax
import numpy as np

from .contracts import PREFETCHER_MEMBERS, Prefetcher
from .hookcalls import latest_answers
from .plugin_manager import first_result
from .serial_pass import batch_rows, check_past_end
from .source_contract import adapted, is_addressable
from .source_errors import SourceLengthError, failure_error
from .split_wrapper import NoPrefetch

__all__ = [
    "batch_width", "check_batch_first", "check_is_dict", "pad_batch", "slice_outputs", "peek",
    "wrap_split", "check_train_split",
]


def describe_batch(batch) -> str:
    """How messages name a batch that is not a dict: ``a tuple of 2``, ``a bare array of shape (16, 8)``."""
    if isinstance(batch, tuple):
        return f"a tuple of {len(batch)}"
    if isinstance(batch, list):
        return f"a list of {len(batch)}"
    if hasattr(batch, "shape") and hasattr(batch, "dtype"):
        return f"a bare array of shape {tuple(np.shape(batch))}"
    return f"a {type(batch).__name__}"


def check_is_dict(batch, split: str = "batch") -> None:
    """Refuse a batch that is not a dict (``(x, y)`` tuples, a bare array), naming the split and the fix."""
    if not isinstance(batch, Mapping):
        raise TypeError(
            f"jaxnitro: the {split} is {describe_batch(batch)}, not a dict. A batch is a dict "
            f"{{field: array}} with the batch dimension first, so that each field reaches the hooks "
            f"that name it as a keyword-only parameter. Fix: yield dicts, e.g. "
            f"`{{'x': x, 'label': y}}` instead of `(x, y)` (for a list of tuples: "
            f"`[{{'x': x, 'label': y}} for x, y in batches]`)."
        )


def field_specs(batch: Mapping) -> dict:
    """``{field: (trailing shape, dtype)}`` of a batch's array fields."""
    return {f: (np.shape(v)[1:], np.asarray(v).dtype) for f, v in batch.items() if np.ndim(v) > 0}


def batch_width(batch: Mapping, split: str = "batch") -> int:
    """The leading dimension shared by every array field of ``batch``.

    Raises ``TypeError`` when ``batch`` is not a dict, ``ValueError`` naming the fields
    when leading dims disagree or are 0 (a batch with no rows).
    """
    check_is_dict(batch, split)
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
    width = values.pop()
    if width == 0:
        raise ValueError(
            f"jaxnitro: the {split} has no rows (fields {sorted(dims)} have length 0). An empty "
            f"batch would compile a program for width 0 and give a NaN loss, reported as a "
            f"divergence. Fix: drop empty batches from the source."
        )
    return width


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


def check_batch_first(outputs, width: int, n: int | None = None) -> None:
    """Refuse an output leaf whose first dimension is not the padded ``width``.

    Evaluation and prediction pad a partial batch to the compiled width and slice the
    outputs back to the real rows; a leaf that is not batch-first (a scalar, a
    ``(classes, batch)`` array) cannot be sliced, so padding rows would reach
    ``metrics``. Refused whatever the batch, so that it fails on the first one.
    """
    for path, leaf in jax.tree_util.tree_flatten_with_path(outputs)[0]:
        shape = tuple(np.shape(leaf))
        if not shape or shape[0] != width:
            where = f"outputs{jax.tree_util.keystr(path)}" if path else "the output"
            rows = f" ({n} real rows padded to {width})" if n is not None and n != width else ""
            raise ValueError(
                f"jaxnitro: `forward` returned {where} with shape {shape}, but the batch has "
                f"{width} rows{rows}. Outputs must be batch-first (first dimension = the batch's "
                f"rows), so that evaluation and prediction can slice away the padding rows of a "
                f"partial batch before `metrics` sees them. Fix: return per-example arrays with "
                f"the batch dimension first (transpose it, e.g. `out.T`), and compute batch-wide "
                f"values in `metrics` or `loss` instead."
            )


def slice_outputs(outputs, n: int, width: int):
    """Slice every output leaf back to ``n`` rows; each must be batch-first (``width`` rows)."""
    check_batch_first(outputs, width, n)
    if n == width:
        return outputs
    return jax.tree_util.tree_map(lambda x: x[:n], outputs)


def is_sized(source) -> bool:
    """Whether ``source`` (a split, wrapped or not) has a ``len()``; a stream has none."""
    if isinstance(source, Prefetcher):
        return source.sized
    try:
        len(source)
        return True
    except TypeError:
        return False


def unwrap(source):
    """The user's source inside a wrapped split (a :class:`~jaxnitro.contracts.Prefetcher`)."""
    return source.source if isinstance(source, Prefetcher) else source


def peek(source, epoch: int = 1):
    """The first batch of ``source`` without disturbing later epochs, or None if it cannot be read cheaply.

    Index-addressable sources (and lists) are read with ``begin_epoch(epoch)``
    + ``batch_at(0)``; plain iterables with one ``next(iter(source))``.
    """
    src = unwrap(source)
    if is_sized(src) and len(src) == 0:
        return None
    if isinstance(src, (list, tuple)):
        first = src[0]
    elif is_addressable(src):
        src.begin_epoch(epoch)
        first = _read_at(source, 0, epoch, "first")
    else:
        split = getattr(source, "split", None)
        try:
            first = next(iter(src))
        except StopIteration:
            if not is_sized(src):
                raise ValueError(f"jaxnitro: {split_name(source)} is a stream that yielded no batch.") from None
            raise SourceLengthError(split, len(src), 0, epoch) from None
        except Exception as exc:  # noqa: BLE001 - said naming the split, the user's error as the cause
            raise failure_error(0, exc, epoch, "iterating the source", split,
                                when=" (setup's read of its first batch)") from exc
    check_is_dict(first, f"first batch of {split_name(source)}")
    return first


def _read_at(source, i: int, epoch: int, which: str):
    """``batch_at(i)`` of the wrapped ``source``'s own source, at setup: a failure is a
    ``PrefetchError`` naming the split (``SourceLengthError`` for an ``IndexError`` below
    ``len()``: the source's ``len()`` and its batches disagree), the source's error its cause."""
    src = unwrap(source)
    try:
        return src.batch_at(i)
    except Exception as exc:  # noqa: BLE001 - said naming the split, the user's error as the cause
        raise failure_error(i, exc, epoch, f"batch_at({i})", getattr(source, "split", None), len(src),
                            when=f" (setup's read of its {which} batch)") from exc


def split_name(source) -> str:
    """How messages name a wrapped split: ``the `train` split`` (``a split`` when unnamed)."""
    name = getattr(source, "split", None)
    return f"the `{name}` split" if name else "a split"


def last_batch(source, epoch: int = 1):
    """The last batch of an index-addressable source, or None for other sources.

    Then ``batch_at(len())``, one past it, must serve no batch as wide as the last
    (:func:`~jaxnitro.serial_pass.check_past_end`): ``SourceLengthError`` naming the split
    when it does, since the batches past ``len()`` would never be read."""
    src = unwrap(source)
    if isinstance(src, (list, tuple)):
        return src[-1]
    if is_addressable(src):
        src.begin_epoch(epoch)
        n = len(src)
        last = _read_at(source, n - 1, epoch, "last")
        check_past_end(src.batch_at, n, batch_rows(last), getattr(source, "split", None), epoch,
                       when=" (setup's check of its last batch)")
        return last
    return None


def wrap_split(source, split: str):
    """The split as the loop reads it: a :class:`~jaxnitro.contracts.Prefetcher`.

    A split that is one already (``jn.PrefetchIterator(...)``, ``jn.NoPrefetch(...)``, a
    plugin's) is used as it is; any other is adapted (``jaxnitro_adapt_source``), checked,
    and wrapped by the plugin that answers ``jaxnitro_make_prefetcher`` (once per split,
    here at setup; the built-in ``prefetch`` plugin's ``PrefetchIterator``), or, when none
    does, in the core's serial :class:`~jaxnitro.split_wrapper.NoPrefetch`.
    """
    if isinstance(source, Prefetcher):  # adapted when it was built
        return _named(source, split)
    source = adapted(source, split)  # a plugin knows this loader type (grain, torch, ...)
    if isinstance(source, Prefetcher):
        return _named(source, split)
    if isinstance(source, Mapping):
        raise TypeError(
            f"jaxnitro: split `{split}` is a single dict; a split is a source of batches (an "
            f"iterable of dicts with len()). Wrap one batch in a list: `[batch]`."
        )
    if not is_sized(source) and (split != "train" or is_addressable(source)):
        raise TypeError(
            f"jaxnitro: split `{split}` ({type(source).__name__}) has no len(); a source is an "
            f"iterable of batch dicts with len() (or a list of batches). Only the `train` split "
            f"may be a stream without one, in a run bounded by max_steps."
        )
    made = first_result("jaxnitro_make_prefetcher", source=source, split=split)
    if made is None:  # no prefetching plugin: read serially, in the consumer's thread
        return _named(NoPrefetch(source), split)
    if not isinstance(made, Prefetcher):
        raise TypeError(_not_a_prefetcher(made, split))
    return _named(made, split)


def _not_a_prefetcher(made, split: str) -> str:
    """The refusal of a ``jaxnitro_make_prefetcher`` answer without a prefetcher's members."""
    who = [a.plugin for a in latest_answers()
           if a.hook == "jaxnitro_make_prefetcher" and a.question == f"split={split!r}"]
    missing = [m for m in PREFETCHER_MEMBERS if not hasattr(made, m)]
    return (
        f"jaxnitro: plugin `{who[-1] if who else '?'}` answered jaxnitro_make_prefetcher for split "
        f"`{split}` with an instance of {type(made).__name__}, which lacks {', '.join(missing)}. A prefetcher has "
        f"source, sized, split, len(), epoch(epoch, transfer=None, start=0), release() and info() "
        f"(jaxnitro.plugin.Prefetcher). Fix: return such an object (jaxnitro.plugin.SplitWrapper "
        f"is a base with all of them), or None to leave the split to another plugin."
    )


def _named(wrapper, split: str):
    """Give ``wrapper`` its split's name (for messages) unless it has one already; then
    call its optional ``adopt(split)``."""
    if getattr(wrapper, "split", None) is None:
        wrapper.split = split
    adopt = getattr(wrapper, "adopt", None)
    if callable(adopt):
        adopt(wrapper.split)
    return wrapper


def check_train_split(train, accum: int) -> int:
    """Check the train split for ``accum``: batch count divisible, no partial final batch.

    Returns the batch width. Raises ``ValueError`` naming the split and the fix.
    """
    if not is_sized(train):  # a stream: its batches are counted as they come
        first = peek(train)
        width = batch_width(first, "`train` split's first batch")
        train.first_batch_spec = field_specs(first)
        return width
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
    train.first_batch_spec = field_specs(first)  # what predict compares its inputs with
    src = unwrap(train)
    if isinstance(src, (list, tuple)):  # batches in memory: every width is cheap to read
        for i, batch in enumerate(src[1:-1], start=1):
            w = batch_width(batch, f"`train` split's batch {i}")
            if w != width:
                raise ValueError(
                    f"jaxnitro: the `train` split's batch {i} (of {n}) has {w} rows; its first batch "
                    f"has {width}. Every train batch must have the same width: another width "
                    f"compiles a second train step and weights its rows differently. Fix: make all "
                    f"train batches {width} rows (drop or merge the short ones)."
                )
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
