"""A streaming train split's own iterator state: recorded in checkpoints, restored on resume.

A source that is iterated (no ``batch_at``/``begin_epoch``) and implements
:class:`~jaxnitro.contracts.StatefulStream` (``iterator_state(batches)``,
``restore_iterator(state)``) resumes mid-epoch exactly where the checkpoint was taken,
with nothing read again. The loop records ``{"source": <module.qualname>, "state": ...}``
as ``data_position["stream_state"]`` of a mid-epoch checkpoint (:func:`capture`); on
``resume=`` setup refuses a state saved by another source type (:func:`check_resume`)
and the loop hands the state back to the source before the epoch's pass starts
(:func:`restore`). Any other stream is read again from the epoch's start and its trained
batches dropped, with a warning.

The state is captured *alongside each batch as it is produced*, by the source (in the
thread that iterates it), because prefetch reads ahead of the step being trained: the
loop asks for the state after the batches it trained, a count the pass has already
yielded. :class:`PassStates` keeps those per-batch states for a source.
"""

from __future__ import annotations

import collections
import json
import threading
from typing import Any

from .contracts import StatefulStream

__all__ = ["PassStates", "capture", "check_resume", "is_stateful", "kind_of", "restore"]

KEEP = 4096
"""How many of the latest per-batch states :class:`PassStates` keeps (far more batches
than prefetch reads ahead of training)."""


class PassStates:
    """The state after each batch of a stream's current pass (what
    ``StatefulStream.iterator_state(batches)`` answers from).

    In the thread that iterates the pass: :meth:`begin` (the pass starts, with the
    iterator's state before its first batch), then :meth:`record` after each batch the
    pass yields. From any thread: :meth:`after`. The ``keep`` latest states are kept; recording
    costs a deque append under a lock.
    """

    def __init__(self, keep: int = KEEP):
        self._states: collections.deque = collections.deque(maxlen=keep + 1)
        self._count = -1  # batches the pass has yielded; -1: no pass yet
        self._lock = threading.Lock()

    def begin(self, state: Any) -> None:
        """A new pass starts; ``state`` is where it starts (0 batches yielded)."""
        with self._lock:
            self._states.clear()
            self._states.append(state)
            self._count = 0

    def record(self, state: Any) -> None:
        """The pass yielded its next batch; ``state`` continues after it."""
        with self._lock:
            self._states.append(state)
            self._count += 1

    def after(self, batches: int) -> Any:
        """The state after the pass's first ``batches`` batches.

        Raises ``LookupError`` for no pass yet, a count the pass has not yielded, or one
        older than the ``keep`` latest (more batches read ahead than that)."""
        with self._lock:
            count, held = self._count, len(self._states)
            if count < 0:
                raise LookupError("no pass over the stream has started")
            if batches > count:
                raise LookupError(f"the pass has yielded {count} batches, not {batches}")
            back = count - batches
            if back >= held:
                raise LookupError(
                    f"the state after batch {batches} is gone: only the {held - 1} latest batches' "
                    f"states are kept and the pass has yielded {count}"
                )
            return self._states[held - 1 - back]


def kind_of(source) -> str:
    """The source's type as ``module.qualname`` (what a saved state is tied to)."""
    t = type(source)
    return f"{t.__module__}.{t.__qualname__}"


def is_stateful(source, addressable: bool) -> bool:
    """Whether ``source`` (unwrapped) is a stream that records and restores its iterator state."""
    return not addressable and isinstance(source, StatefulStream)


def capture(source, batches: int, split: str = "train") -> dict | None:
    """``{"source", "state"}`` after the current pass's first ``batches`` batches, or None
    when the source cannot say. Raises ``TypeError`` for a state that is not JSON-able
    (naming the source and the fix) and ``RuntimeError`` when the state is gone."""
    try:
        state = source.iterator_state(batches)
    except LookupError as err:
        raise RuntimeError(
            f"jaxnitro: the `{split}` split's {type(source).__name__} has no iterator state after "
            f"batch {batches} of its pass ({err}); a checkpoint cannot say where the stream was. "
            f"Keep more states (PassStates(keep=...)) or read fewer batches ahead (host_batches)."
        ) from err
    if state is None:
        return None
    try:
        json.dumps(state, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise TypeError(
            f"jaxnitro: the `{split}` split's {type(source).__name__}.iterator_state() returned a "
            f"value that is not JSON-able ({type(err).__name__}: {err}); a checkpoint records it in "
            f"its JSON record. Fix: return dicts, lists, str, int, float, bool and None only "
            f"(encode arrays or tensors, e.g. with .tolist(), and bytes with .decode())."
        ) from err
    return {"source": kind_of(source), "state": state}


def check_resume(source, addressable: bool, saved: dict | None, path: str, split: str = "train") -> None:
    """Refuse to resume from a checkpoint whose stream state (``saved``: its data position's
    ``stream_state``, or None) another source type saved (``ValueError`` naming both types and the fix)."""
    if saved is None:
        return
    here = kind_of(source)
    if is_stateful(source, addressable) and saved.get("source") == here:
        return
    raise ValueError(
        f"jaxnitro: the checkpoint {path} holds the iterator state of a `{split}` split read from "
        f"{saved.get('source')}, but this handle's `{split}` split is a {here}"
        f"{'' if is_stateful(source, addressable) else ' (which restores no iterator state)'}: the "
        f"state says where that source's pass was, and means nothing to another one. Resume with "
        f"the same kind of `{split}` source, or start a new run from these weights with `weights=`."
    )


def restore(source, saved: dict, step: int, split: str = "train") -> None:
    """Hand a saved state back to ``source``: its next pass continues from there
    (``RuntimeError`` naming the split and the step when the source refuses it)."""
    try:
        source.restore_iterator(saved["state"])
    except Exception as err:  # noqa: BLE001 - re-raised, naming the split and the step
        raise RuntimeError(
            f"jaxnitro: restoring the `{split}` split's iterator state (saved at step {step}) into "
            f"its {type(source).__name__} failed: {err}. Resume with the source (and the data) the "
            f"checkpoint's run read."
        ) from err
