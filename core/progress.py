"""The progress contract: which reporter draws, notes from inside hooks, and the events.

The core draws nothing. It keeps the process-wide reporter setting
(:func:`progress_reporter`), the stack of notes hooks set
(:func:`with_progress_note`, :func:`progress_note`), and emits the lifecycle
events a display subscribes to: ``jaxnitro_setup_step`` (each step of
``Nitro(e)``'s setup), ``jaxnitro_phase_start`` (an epoch's train or
validate phase begins), ``jaxnitro_progress_note`` (the current note
changed), plus the run events every plugin sees. The built-in ``progress``
plugin turns them into one bar per run.

A reporter has ``begin(total, label)``, ``update(position, label)`` and
``close(label)``; ``position`` is in epochs and may be fractional. The
setting ``"auto"`` (the default) asks the ``jaxnitro_make_progress_reporter``
hook; the core names no concrete reporter.
"""

from __future__ import annotations

import contextlib
import threading

from .contracts import REPORTER_METHODS
from .hookcalls import emit
from .interrupts import check as check_stop
from .plugin_manager import disabled_note, first_result

__all__ = [
    "SetupSteps",
    "current_note",
    "make_reporter",
    "phase_start",
    "progress_note",
    "progress_reporter",
    "with_progress_note",
]

_installed: object = "auto"
_notes = threading.local()


def progress_reporter(reporter="auto"):
    """Install the reporter used by every later verb and return the previous setting.

    ``reporter`` is ``"auto"``, another name a plugin answers (``"tqdm"``,
    ``"silent"``), ``None`` to silence progress, or an object with
    ``begin``/``update``/``close``. Raises ``TypeError`` for an object lacking
    those methods and ``ValueError`` for a name no plugin knows.
    """
    global _installed
    if reporter is not None and not isinstance(reporter, str):
        missing = [m for m in REPORTER_METHODS if not callable(getattr(reporter, m, None))]
        if missing:
            raise TypeError(
                f"jaxnitro: a progress reporter needs methods begin(total, label), "
                f"update(position, label) and close(label); {type(reporter).__name__} lacks {missing}."
            )
    elif isinstance(reporter, str) and reporter != "auto":
        _make(reporter)  # validate now
    previous, _installed = _installed, reporter
    return previous


def _make(name: str):
    made = first_result("jaxnitro_make_progress_reporter", name=name)
    if made is None and name != "auto":
        raise ValueError(
            f"jaxnitro: no plugin provides a progress reporter named {name!r}{disabled_note()}. "
            f"Built-in names: 'auto', 'tqdm', 'silent'; or pass an object with begin/update/close, "
            f"or None."
        )
    return made


def make_reporter():
    """A reporter for one stretch of work per the installed setting; None means silence."""
    if _installed is None:
        return None
    if isinstance(_installed, str):
        return _make(_installed)
    return _installed


# -- notes ---------------------------------------------------------------------------------


def _stack() -> list:
    if not hasattr(_notes, "stack"):
        _notes.stack = []
    return _notes.stack


def current_note() -> str | None:
    """The innermost open note of this thread, or None."""
    stack = _stack()
    return stack[-1] if stack else None


def _changed() -> None:
    emit("jaxnitro_progress_note", note=current_note())


@contextlib.contextmanager
def with_progress_note(note: str):
    """Show ``note`` beside the current phase for the duration of the block (innermost wins).

    Use it inside a hook that takes a while (``build_data``, ``derive``,
    ``finalize_metrics``): the display updates at once.
    """
    stack = _stack()
    stack.append(str(note))
    _changed()
    try:
        yield
    finally:
        stack.pop()
        _changed()


def progress_note(note: str) -> None:
    """Replace the innermost note (or set one if none is open); the display updates at once."""
    stack = _stack()
    if stack:
        stack[-1] = str(note)
    else:
        stack.append(str(note))
    _changed()


# -- events ---------------------------------------------------------------------------------


def phase_start(run, epoch: int, phase: str, detail: str | None = None) -> None:
    """An epoch's ``phase`` (``"train"``, ``"validate"``) begins: notes left open by earlier
    work are dropped, then ``jaxnitro_phase_start`` is emitted. ``detail`` says what the
    phase is doing first (``"compiling train step"``)."""
    _stack().clear()
    emit("jaxnitro_phase_start", run=run, epoch=epoch, phase=phase, detail=detail)


class SetupSteps:
    """``Nitro(e)``'s setup as ``jaxnitro_setup_step`` events: ``"starting"``, each named step,
    then ``"done"`` or ``"failed"``."""

    def __init__(self, experiment):
        self.experiment = experiment
        self.to("starting")

    def to(self, step: str) -> None:
        """Name the step setup is in now (``"building data"``, ``"building model"``, ...).

        Raises a Ctrl-C / SIGTERM that arrived and was swallowed by the step before."""
        check_stop()
        emit("jaxnitro_setup_step", experiment=self.experiment, step=step)

    def close(self, ok: bool = True) -> None:
        emit("jaxnitro_setup_step", experiment=self.experiment, step="done" if ok else "failed")
