"""Progress: one bar for a whole run (tqdm) or silence, drawn from lifecycle events.

Registered as the entry point ``progress`` in group ``jaxnitro``. Two jobs:

**The display.** It subscribes to ``jaxnitro_setup_step`` (``setup [building
data]`` ... ``setup done``), ``jaxnitro_run_start``, ``jaxnitro_phase_start``
(``epoch 3/40: train [compiling train step]``), ``jaxnitro_steps_read`` (the
bar moves to the last step read back), ``jaxnitro_epoch_end``,
``jaxnitro_progress_note`` (a note from a hook redraws at once) and
``jaxnitro_run_finish`` (``done: 40/40 epochs``). It draws on the reporter
the core's setting chooses (``jn.progress_reporter``; ``"auto"`` by
default, asked through the hook below, so a plugin answering ``"auto"``
replaces the bar without replacing the display).

**The reporters.** The hook :func:`jaxnitro_make_progress_reporter` answers:

* ``"tqdm"``: a :class:`TqdmReporter` (terminal, or a widget in a notebook);
* ``"silent"`` / ``"none"``: a :class:`SilentReporter`;
* ``"auto"`` (the default): :class:`TqdmReporter` in a notebook kernel or when
  stderr is a terminal, unless the environment variable ``CI`` is set; else
  :class:`SilentReporter`, so CI logs and captured output stay clean;
* anything else: ``None`` (not ours).

A reporter implements the contract of ``jaxnitro_make_progress_reporter``:
``begin(total, label)``, ``update(position, label)`` (``position`` in epochs,
fractional) and ``close(label)``.
"""

from __future__ import annotations

import inspect
import os
import sys
import time
from typing import IO, Any

from jaxnitro.plugin import current_note, hookimpl, make_reporter

__all__ = [
    "TqdmReporter",
    "SilentReporter",
    "in_notebook",
    "auto_wants_bar",
    "jaxnitro_make_progress_reporter",
]

BAR_FORMAT = "{desc} {percentage:3.0f}%|{bar}| {n:.2f}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}]"
"""tqdm ``bar_format`` of :class:`TqdmReporter`: position with two decimals, the run's ETA."""

STEPS_FORMAT = "{desc} {percentage:3.0f}%|{bar}| {n:,.0f}/{total:,.0f} [{elapsed}<{remaining}, {rate_fmt}]"
"""tqdm ``bar_format`` of a step-budgeted run's bar (``unit="step"``): whole steps, thousands separated."""

PHASES_FORMAT = "{desc} [{elapsed}]"
"""tqdm ``bar_format`` for a stretch with no epochs (``total == 0``, setup): the label and the time."""


class SilentReporter:
    """A progress reporter that shows nothing. Every method is a no-op."""

    __slots__ = ()

    def begin(self, total: int, label: str) -> None:
        """Do nothing."""

    def update(self, position: float, label: str) -> None:
        """Do nothing."""

    def close(self, label: str) -> None:
        """Do nothing."""

    def __repr__(self) -> str:
        return "SilentReporter()"


class TqdmReporter:
    """One tqdm bar for the whole run, in epochs, labelled with the current stretch.

    **Arguments:**

    - `file`: where the bar is written. ``None`` (the default) means
        ``sys.stderr`` as it is at :meth:`begin`, drawn with ``tqdm.auto`` (a
        widget in a Jupyter kernel with ipywidgets, text otherwise). An explicit
        stream always gets the text bar.
    - `mininterval`: the fewest seconds between two redraws caused by position
        alone (default 0.1).
    - `leave`: keep the finished bar on screen (default ``True``).

    **Contract.**

    - :meth:`begin` ``(total, label)`` opens the bar: ``total`` epochs,
        ``label`` as its description. An open bar is closed first. ``total ==
        0`` opens a line of phases with no epochs (setup): the label and the
        elapsed time, no bar and no rate.
    - :meth:`update` ``(position, label)`` sets the bar to ``position`` epochs
        (a float: completed epochs plus the running stretch's fraction) with
        ``label`` as the description. It is cheap (well under a microsecond of
        Python per call when it does not redraw) so it may be called once per
        optimizer step. A position change redraws at most every
        `mininterval` seconds; a label change redraws at once, so a label put
        up before a long blocking step (``epoch 1/40: train [compiling
        gradient]``) is visible while it runs. Labels should therefore name
        phases, not per-step counters: the position carries those.
    - :meth:`close` ``(label)`` draws the final state with ``label`` (e.g.
        ``done: 40/40 epochs``) and closes the bar. The bar is not forced to
        100%: a run that stops early shows where it stopped.

    ``update`` and ``close`` without an open bar do nothing. The ETA is the
    run's: remaining epochs over a smoothed rate in epochs per second.
    """

    def __init__(self, file: IO[str] | None = None, *, mininterval: float = 0.1, leave: bool = True):
        self.file = file
        self._shown = None  # a notebook widget's display handle
        self.mininterval = float(mininterval)
        self.leave = leave
        self._bar: Any = None
        self._pos = 0.0
        self._label = ""
        self._shown_label = ""
        self._next_draw = 0.0
        self._fresh = True

    def __repr__(self) -> str:
        where = "stderr" if self.file is None else type(self.file).__name__
        return f"TqdmReporter(file={where}, mininterval={self.mininterval})"

    def begin(self, total: int, label: str, unit: str = "epoch") -> None:
        """Open a bar of ``total`` units (``unit``: epochs, or steps for a step-budgeted run)
        labelled ``label`` (closing any open one)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self.file is None:
            try:
                from tqdm.auto import tqdm as bar_cls
            except ImportError:  # a broken notebook stack: fall back to text
                from tqdm.std import tqdm as bar_cls
            file = sys.stderr
        else:
            from tqdm.std import tqdm as bar_cls

            file = self.file
        phases = total == 0
        total = total if total and total > 0 else None
        kwargs = dict(
            total=total,
            desc=label,
            file=file,
            bar_format=PHASES_FORMAT if phases else STEPS_FORMAT if unit == "step" else BAR_FORMAT,
            unit=unit,
            leave=self.leave,
            disable=False,
            # This class throttles; tqdm draws whenever asked.
            mininterval=0,
            miniters=0,
            dynamic_ncols=self.file is None,
        )
        self._shown = None
        widget = any(c.__module__ == "tqdm.notebook" for c in getattr(bar_cls, "__mro__", ()))
        try:
            self._bar = bar_cls(**kwargs, display=False) if widget else bar_cls(**kwargs)
        except ImportError:  # tqdm.notebook without ipywidgets
            from tqdm.std import tqdm as text_cls

            self._bar = text_cls(**kwargs)
            widget = False
        if widget:  # shown by us, so close() can refresh the text a notebook saves with it
            from IPython.display import display

            self._shown = display(self._bar.container, display_id=True)
        self._pos = 0.0
        self._label = self._shown_label = label
        self._fresh = True
        self._next_draw = time.monotonic() + self.mininterval

    def update(self, position: float, label: str) -> None:
        """Move the bar to ``position`` epochs, labelled ``label``; redraw if due."""
        self._pos = position
        if label != self._shown_label:
            self._label = label
            self._draw()
            return
        now = time.monotonic()
        if now >= self._next_draw:
            self._next_draw = now + self.mininterval
            self._draw()

    def close(self, label: str) -> None:
        """Show the final state labelled ``label`` and close the bar."""
        bar = self._bar
        if bar is None:
            return
        self._bar = None
        bar.set_description_str(label, refresh=False)
        bar.n = self._pos
        bar.close()
        if self._shown is not None:  # the saved text/plain shows the end, not the start
            self._shown.update(bar.container)
            self._shown = None

    def _draw(self) -> None:
        bar = self._bar
        if bar is None:
            return
        if self._label != self._shown_label:
            bar.set_description_str(self._label, refresh=False)
            self._shown_label = self._label
        pos = float(self._pos)
        if self._fresh:
            # The first position counts as the starting point (a resumed run
            # begins mid-way), so the rate and ETA see only this process's work.
            self._fresh = False
            bar.initial = bar.n = bar.last_print_n = pos
            bar.refresh()
            bar.last_print_t = bar._time()
        else:
            bar.update(pos - bar.n)  # draws (tqdm's own throttle is off) and feeds its smoothed rate


def in_notebook() -> bool:
    """Whether this process is an IPython/Jupyter kernel (a notebook, VS Code, Colab).

    Only looks at an already-imported IPython; never imports it.
    """
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    try:
        shell = ipython.get_ipython()
    except Exception:  # noqa: BLE001
        return False
    if shell is None:
        return False
    try:
        if "IPKernelApp" in shell.config:
            return True
    except Exception:  # noqa: BLE001
        pass
    return any(c.__name__ == "ZMQInteractiveShell" for c in type(shell).__mro__)


def _ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def auto_wants_bar() -> bool:
    """The ``"auto"`` rule: a bar in a notebook kernel or on a terminal stderr, never under ``CI``.

    ``CI`` counts as set unless it is empty, ``0``, ``false`` or ``no``.
    """
    if _ci():
        return False
    if in_notebook():
        return True
    try:
        return bool(sys.stderr is not None and sys.stderr.isatty())
    except Exception:  # noqa: BLE001 - a closed or odd stream
        return False


@hookimpl(trylast=True)
def jaxnitro_make_progress_reporter(name):
    """Return the built-in reporter for ``name``, or ``None`` if ``name`` is not ours.

    ``"tqdm"`` -> :class:`TqdmReporter`; ``"silent"``/``"none"`` ->
    :class:`SilentReporter`; ``"auto"`` -> :class:`TqdmReporter` if
    :func:`auto_wants_bar` else :class:`SilentReporter`. Case-insensitive.
    """
    if not isinstance(name, str):
        return None
    key = name.lower()
    if key == "tqdm":
        return TqdmReporter()
    if key in ("silent", "none"):
        return SilentReporter()
    if key == "auto":
        return TqdmReporter() if auto_wants_bar() else SilentReporter()
    return None


# -- the display: lifecycle events -> one reporter per stretch of work ------------------------


class _SetupDisplay:
    """``Nitro(e)``'s setup as one line: ``setup [building data]`` ... ``setup done``."""

    def __init__(self, reporter):
        self.reporter, self.step = reporter, "starting"
        reporter.begin(0, self.label())  # total 0: phases, no epochs and no rate

    def label(self) -> str:
        note = current_note()
        return f"setup [{self.step}: {note}]" if note else f"setup [{self.step}]"

    def to(self, step: str) -> None:
        self.step = step
        self.redraw()

    def redraw(self) -> None:
        self.reporter.update(0, self.label())

    def close(self, ok: bool) -> None:
        self.reporter.close("setup done" if ok else "setup failed")


class _RunDisplay:
    """One bar for a whole run: ``total`` epochs, the read steps interpolated.

    Labels read ``epoch 3/40: train [compiling train step]``, followed once an
    epoch has ended by its figures (``| train_loss 0.4123 | macro_recall
    0.9207``: the mean train loss and the monitored metric of the last finished
    epoch), and end ``done: 30/40 epochs``. The position is the last step read
    back from the device (not merely dispatched), in epochs, so the rate and
    ETA come from work actually done; at the end it is the epochs done.
    """

    unit = "epoch"  # what the bar counts

    def __init__(self, reporter, total: int, steps_per_epoch: int, monitor):
        self.reporter, self.total, self.steps_per_epoch = reporter, total, max(steps_per_epoch, 1)
        self.monitor = monitor[0] if monitor else None
        self.epoch, self.phase, self.detail, self.position, self.figures = 0, "starting", None, 0.0, ""
        begin = reporter.begin  # a reporter may take the unit (optional: the built-in tqdm one does)
        if "unit" in inspect.signature(begin).parameters:
            begin(total, self.label(), unit=self.unit)
        else:
            begin(total, self.label())

    def where(self) -> str:
        """Where the run is: ``epoch 3/40``."""
        return f"epoch {self.epoch}/{self.total}"

    def label(self) -> str:
        text = f"{self.where()}: {self.phase}"
        extra = self.detail or current_note()
        text = f"{text} [{extra}]" if extra else text
        return f"{text} | {self.figures}" if self.figures else text

    def epoch_end(self, row: dict) -> None:
        # the train columns: train_loss, or a train_step's train_<name> columns
        figures = [f"{k} {v:.4g}" for k, v in row.items() if k.startswith("train_") and isinstance(v, float)][:3]
        value = row.get(self.monitor) if self.monitor else None
        if isinstance(value, (int, float)):
            figures.append(f"{self.monitor} {value:.4g}")
        self.figures = " | ".join(figures)
        self.detail = None  # the phase's first step ("compiling forward") is over
        self.move(float(row["epoch"]))

    def phase_start(self, epoch: int, phase: str, detail: str | None) -> None:
        self.epoch, self.phase, self.detail = epoch, phase, detail
        self.move(epoch - 1)

    def move(self, position: float) -> None:
        self.position = max(self.position, min(position, float(self.epoch)))
        self.reporter.update(self.position, self.label())

    def redraw(self) -> None:
        self.detail = None  # a note replaces the phase's first detail
        self.reporter.update(self.position, self.label())

    def close(self, status: str, epochs_done: int) -> None:
        self.reporter.close(f"{status}: {epochs_done}/{self.total} epochs")

    def epochs_done(self, run) -> int:
        """Complete epochs: the history's last row (an interrupted epoch is not one)."""
        return run.nitro.rows[-1]["epoch"] if run.nitro.rows else 0


class _StepDisplay(_RunDisplay):
    """:class:`_RunDisplay` for a step-budgeted run (``max_steps``): the bar counts optimizer
    steps, ``step 3,000/20,000: train | train_loss 0.41``, ending ``done: 20,000/20,000 steps``."""

    unit = "step"

    def __init__(self, reporter, total_steps: int, run, monitor):
        self.run = run
        super().__init__(reporter, total_steps, 1, monitor)

    def where(self) -> str:
        return f"step {int(self.position):,}/{self.total:,}"

    def epoch_end(self, row: dict) -> None:
        super().epoch_end(row)
        self.move(float(row["step"]))

    def phase_start(self, epoch: int, phase: str, detail: str | None) -> None:
        self.epoch, self.phase, self.detail = epoch, phase, detail
        self.move(float(self.run.nitro.step))

    def move(self, position: float) -> None:
        self.position = max(self.position, min(position, float(self.total)))
        self.reporter.update(self.position, self.label())

    def close(self, status: str, steps_done: int) -> None:
        self.reporter.close(f"{status}: {steps_done:,}/{self.total:,} steps")

    def epochs_done(self, run) -> int:
        return int(run.nitro.step)


def _display(reporter, run):
    """The run's bar: in steps for a step-budgeted run, in epochs otherwise."""
    s = run.settings
    if s.max_steps is not None:
        spe = run.steps_per_epoch
        total = s.max_steps if s.max_epochs is None or spe is None else min(s.max_steps, s.max_epochs * spe)
        return _StepDisplay(reporter, total, run, run.monitor)
    return _RunDisplay(reporter, s.max_epochs, run.steps_per_epoch, run.monitor)


_displays: list = []  # open displays, innermost last (a handle built inside a hook nests)


@hookimpl(trylast=True)
def jaxnitro_setup_step(experiment, step):
    if step == "starting":
        reporter = make_reporter()
        _displays.append(_SetupDisplay(reporter) if reporter is not None else None)
        return
    display = _displays[-1] if _displays else None
    if step in ("done", "failed"):
        if _displays:
            _displays.pop()
        if display is not None:
            display.close(step == "done")
    elif display is not None:
        display.to(step)


@hookimpl(trylast=True)
def jaxnitro_run_start(run):
    reporter = make_reporter()
    display = _display(reporter, run) if reporter else None
    run.store(__name__)["display"] = display
    _displays.append(display)


@hookimpl(trylast=True)
def jaxnitro_phase_start(run, epoch, phase, detail):
    display = run.store(__name__).get("display")
    if display is not None:
        display.phase_start(epoch, phase, detail)


@hookimpl(trylast=True)
def jaxnitro_steps_read(run, stretch):
    display = run.store(__name__).get("display")
    if display is not None and len(stretch):
        display.detail = None  # steps were computed: the phase's first step (a compile) is over
        display.move((stretch.first_step + len(stretch) - 1) / display.steps_per_epoch)


@hookimpl(trylast=True)
def jaxnitro_epoch_end(run, row):
    display = run.store(__name__).get("display")
    if display is not None:
        display.epoch_end(row)


@hookimpl(trylast=True)
def jaxnitro_progress_note(note):
    display = _displays[-1] if _displays else None
    if display is not None:
        display.redraw()


@hookimpl(trylast=True)
def jaxnitro_run_finish(run, status):
    display = run.store(__name__).pop("display", None)
    if display in _displays:
        _displays.remove(display)
    if display is not None:
        display.close(status, display.epochs_done(run))
