"""Progress reporting: one reporter for every later call, and notes from inside hooks.

The core never names a concrete reporter. ``"auto"`` (the default) asks the
``jaxnitro_make_progress_reporter`` extension hook, which the built-in
``progress`` plugin answers with a tqdm bar in a terminal or notebook and
silence in CI or captured output.

A reporter has ``begin(total, label)``, ``update(position, label)`` and
``close(label)``; ``position`` is in epochs and may be fractional.
"""

from __future__ import annotations

import contextlib
import threading

__all__ = ["progress_reporter", "with_progress_note", "progress_note", "Progress", "SetupProgress"]

_installed: object = "auto"
_notes = threading.local()


class _Silent:
    def begin(self, total, label):
        pass

    def update(self, position, label):
        pass

    def close(self, label):
        pass


def progress_reporter(reporter="auto"):
    """Install the reporter used by every later verb and return the previous setting.

    ``reporter`` is ``"auto"``, another name a plugin answers (``"tqdm"``,
    ``"silent"``), ``None`` to silence progress, or an object with
    ``begin``/``update``/``close``. Raises ``TypeError`` for an object lacking
    those methods and ``ValueError`` for a name no plugin knows.
    """
    global _installed
    if reporter is not None and not isinstance(reporter, str):
        missing = [m for m in ("begin", "update", "close") if not callable(getattr(reporter, m, None))]
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
    from .plugin_manager import first_result

    made = first_result("jaxnitro_make_progress_reporter", name=name)
    if made is None:
        if name == "auto":
            return _Silent()
        raise ValueError(
            f"jaxnitro: no plugin provides a progress reporter named {name!r}. Built-in names: "
            f"'auto', 'tqdm', 'silent'; or pass an object with begin/update/close, or None."
        )
    return made


def current_reporter():
    """A fresh reporter for one stretch of work, per the installed setting."""
    if _installed is None:
        return _Silent()
    if isinstance(_installed, str):
        return _make(_installed)
    return _installed


def _stack() -> list:
    if not hasattr(_notes, "stack"):
        _notes.stack = []
    return _notes.stack


@contextlib.contextmanager
def with_progress_note(note: str):
    """Show ``note`` beside the current phase for the duration of the block (innermost wins).

    Use it inside a hook that takes a while (``build_data``, ``derive``,
    ``finalize_metrics``): the display updates at once.
    """
    stack = _stack()
    stack.append(str(note))
    _redraw()
    try:
        yield
    finally:
        stack.pop()
        _redraw()


def progress_note(note: str) -> None:
    """Replace the innermost note (or set one if none is open); the display updates at once."""
    stack = _stack()
    if stack:
        stack[-1] = str(note)
    else:
        stack.append(str(note))
    _redraw()


_active: list = []  # the stretch being reported (setup or a run), so notes can redraw it


def _redraw() -> None:
    if _active:
        _active[-1].note(None)


def clear_notes() -> None:
    _stack().clear()


class Progress:
    """One bar for a whole run: ``total`` epochs, the running stretch interpolated.

    Labels read ``epoch 3/40: train [compiling train step]`` and end
    ``done: 40/40 epochs``. While it is open, notes from
    :func:`with_progress_note` / :func:`progress_note` redraw it.
    """

    def __init__(self, total: int, start: int = 0):
        self.total = total
        self.reporter = current_reporter()
        self.epoch = start
        self.phase = "setup"
        self.reporter.begin(total, "setup")
        _active.append(self)

    def label(self, detail: str | None = None) -> str:
        notes = _stack()
        text = f"epoch {self.epoch}/{self.total}: {self.phase}"
        extra = detail or (notes[-1] if notes else None)
        return f"{text} [{extra}]" if extra else text

    def phase_start(self, epoch: int, phase: str, detail: str | None = None) -> None:
        self.epoch, self.phase = epoch, phase
        clear_notes()
        self.reporter.update(epoch - 1, self.label(detail))

    def note(self, detail: str | None) -> None:
        self.reporter.update(max(self.epoch - 1, 0), self.label(detail))

    def advance(self, fraction: float) -> None:
        self.reporter.update(self.epoch - 1 + min(fraction, 1.0), self.label())

    def close(self, epochs_done: int, status: str = "done") -> None:
        if self in _active:
            _active.remove(self)
        self.reporter.close(f"{status}: {epochs_done}/{self.total} epochs")


class SetupProgress:
    """``Nitro(e)``'s setup as one line: ``setup [building data]`` ... ``setup done``."""

    def __init__(self):
        self.reporter = current_reporter()
        self.step = "starting"
        self.reporter.begin(1, self.label())
        _active.append(self)

    def label(self, detail: str | None = None) -> str:
        notes = _stack()
        extra = detail or (f"{self.step}: {notes[-1]}" if notes else self.step)
        return f"setup [{extra}]"

    def to(self, step: str) -> None:
        """Name the step setup is in now (``"building data"``, ``"building model"``, ...)."""
        self.step = step
        self.reporter.update(0, self.label())

    def note(self, detail: str | None) -> None:
        self.reporter.update(0, self.label(detail))

    def close(self, ok: bool = True) -> None:
        if self in _active:
            _active.remove(self)
        label = "setup done" if ok else "setup failed"
        if ok:
            self.reporter.update(1, label)
        self.reporter.close(label)
