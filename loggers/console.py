"""The console logger: one readable line per epoch and per validation, ``logger="console"``.

Registered as the entry point ``console`` in group ``jaxnitro``; needs nothing
beyond jaxnitro (it writes through ``structlog``). Meant for CI logs and
terminals without a progress bar (combine it with ``jn.progress_reporter("silent")``
if a bar is drawn on the same terminal). The hook :func:`jaxnitro_make_logger`
answers ``"console"`` with a :class:`ConsoleLogger` on standard output;
``jaxnitro.ConsoleLogger`` (exported through ``jaxnitro_exports``) builds a
configured one. A run prints::

    12:04:30 run start            experiment=Tiny n_params=212 run_dir=runs/20261130-120430-1
    12:04:31 epoch 1/2 train      step=6 loss=1.7032 data_wait=0.0%
    12:04:31 epoch 1/2 validate   step=6 loss=1.7251
    12:04:32 epoch 2/2 train      step=12 loss=1.5988 data_wait=9.6%
    12:04:32 epoch 2/2 validate   step=12 loss=1.6895
    12:04:32 run done             epochs=2 steps=12 elapsed=1.9s

* an epoch's ``train`` line comes once its steps are all read (at its validation,
  at the next epoch's first step, or at the end); it holds the epoch's last
  step, the mean of each train metric over the epoch's logged steps (with
  ``log_every_n_steps=1`` that is the history's ``train_loss``), the last value
  of each ``schedule/...``, and the share of the epoch spent waiting for data;
* a ``validate`` line per validation, with every metric;
* ``run <status>`` at the end. NaN and infinities print as ``nan``/``inf``.

Lines are structlog events (the event is the text before the key-values; the
values are numbers, rounded only by the default renderer). By default a private
structlog pipeline renders them (a time stamp, :class:`structlog.dev.ConsoleRenderer`
without levels, colour on a terminal) whatever the application configured; pass
``logger=structlog.get_logger("jaxnitro.console")`` to send them through the
application's own structlog configuration instead (JSON lines, say).
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any, TextIO

import structlog

from jaxnitro.plugin import hookimpl, scalar_value

__all__ = ["ConsoleLogger", "jaxnitro_exports", "jaxnitro_make_logger"]

_RESERVED = ("event", "timestamp")


class _RoundFloats:
    """A structlog processor writing floats with ``digits`` significant digits."""

    def __init__(self, digits: int):
        self.digits = digits

    def __call__(self, logger, method_name, event_dict):
        for key, value in event_dict.items():
            if isinstance(value, float) and key != "timestamp":
                event_dict[key] = _format_float(value, self.digits)
        return event_dict


def _format_float(value: float, digits: int) -> str:
    if not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return f"{value:.{digits}g}"


class ConsoleLogger:
    """Print a run as one line per epoch, one per validation, and its start and end.

    Implements jaxnitro's logger contract (``log_params``, ``log_other``,
    ``log_metrics``, ``finish``, ``info``, ``backend``); see the module
    docstring for the lines.

    **Arguments:**

    - `stream`: where the default pipeline prints (default: ``sys.stdout`` as
        it is when the run starts).
    - `logger`: a structlog logger to emit through instead of the default
        pipeline (then `stream`, `colors` and `digits` are not used).
    - `colors`: colour the key-values (default: when `stream` is a terminal).
    - `digits`: significant digits of a printed float (default 5).
    - `report`: also print the binding report at run start (default False).

    A logger object given as the ``logger`` knob serves every run it is given
    to: each ``log_params`` starts a new run's lines. Nothing is buffered
    beyond the epoch being read, so :meth:`finish` has nothing to close.
    """

    def __init__(
        self,
        stream: TextIO | None = None,
        *,
        logger=None,
        colors: bool | None = None,
        digits: int = 5,
        report: bool = False,
    ):
        self.stream = stream
        self.logger = logger
        self.colors = colors
        self.digits = int(digits)
        self.report = bool(report)
        self._log = logger
        self._resumed_at: int | None = None  # a resumed run's step: its first epoch line says from where
        self._reset()

    def __repr__(self) -> str:
        """The configuration only (it is logged as the ``knob/logger`` param of every run)."""
        if self.logger is not None:
            return "ConsoleLogger(logger=<structlog logger>)"
        return f"ConsoleLogger({getattr(self.stream, 'name', 'stream') if self.stream else '<stdout>'})"

    def _reset(self) -> None:
        self._max_epochs: int | None = None
        self._epoch: int | None = None  # the epoch whose train lines are being gathered
        self._sums: dict[str, list[float]] = {}  # name -> [sum, count, last]
        self._epoch_step = 0
        self._data: dict[int, dict] = {}
        self._rates: list[float] = []
        self._step = 0
        self._last_epoch = 0
        self._started = time.monotonic()

    # -- the logger contract ---------------------------------------------------

    def resume(self, step: int) -> None:
        """A resumed run continues its folder from ``step``: the interrupted run printed the steps
        before, so the next epoch line averages the steps after it and says so (``from_step``)."""
        self._resumed_at = int(step)

    def log_params(self, params: dict) -> None:
        """Start a run: print ``run start`` with the experiment, parameter count and run folder."""
        self._reset()
        self._log = self.logger if self.logger is not None else self._pipeline()
        max_epochs = params.get("knob/max_epochs")
        self._max_epochs = max_epochs if isinstance(max_epochs, int) and not isinstance(max_epochs, bool) else None
        shown = {k: params[k] for k in ("experiment", "n_params", "run_dir") if k in params}
        self._emit("run start", shown)

    def log_other(self, key: str, value: Any) -> None:
        """Print the binding report when ``report=True``; anything else is not printed."""
        if self.report and key == "binding_report":
            self._emit(str(key), {"text": "\n" + str(value)})

    def log_metrics(self, metrics: dict, *, step: int, epoch: int, context: str) -> None:
        """Gather ``train`` values into the epoch's line; print a ``validate`` (or any other
        context's) line at once; keep ``data`` figures for the epoch's line."""
        step, epoch = int(step), int(epoch)
        self._step, self._last_epoch = max(self._step, step), max(self._last_epoch, epoch)
        if context == "train":
            if self._epoch is not None and epoch != self._epoch:
                self._emit_epoch()
            self._epoch, self._epoch_step = epoch, step
            for name, value in metrics.items():
                number = scalar_value(value)
                if number is None:
                    continue
                acc = self._sums.setdefault(str(name), [0.0, 0, 0.0])
                acc[0] += number
                acc[1] += 1
                acc[2] = number
        elif context == "data":
            self._data[epoch] = dict(metrics)
        elif context == "throughput":  # a row's measured steps/s: their mean goes on the run's last line
            rate = scalar_value(metrics.get("steps_per_sec"))
            if rate is not None:
                self._rates.append(rate)
        else:
            if self._epoch is not None:
                self._emit_epoch()
            values = {str(k): _value(v) for k, v in metrics.items()}
            self._emit(f"{self._epoch_label(epoch)} {context}", {"step": step}, values)

    def finish(self, status: str) -> None:
        """Print the last epoch's line if pending, then ``run <status>``."""
        if self._epoch is not None:
            self._emit_epoch()
        elapsed = time.monotonic() - self._started
        last = {"epochs": self._last_epoch, "steps": self._step, "elapsed": f"{elapsed:.1f}s"}
        if self._rates:
            last["steps_per_sec"] = f"{sum(self._rates) / len(self._rates):.1f}"  # always a decimal point
        self._emit(f"run {status}", last)

    # -- queries -----------------------------------------------------------------

    def info(self) -> dict:
        """``{"backend": "console", "stream": <name>}``."""
        target = "structlog" if self.logger is not None else getattr(self.stream or sys.stdout, "name", "stream")
        return {"backend": "console", "stream": str(target)}

    @property
    def backend(self):
        """The structlog logger the lines go through."""
        return self._log if self._log is not None else self._pipeline()

    # -- internals ---------------------------------------------------------------

    def _pipeline(self):
        stream = self.stream if self.stream is not None else sys.stdout
        colors = self.colors if self.colors is not None else bool(getattr(stream, "isatty", lambda: False)())
        return structlog.wrap_logger(
            structlog.PrintLogger(stream),
            processors=[
                structlog.processors.TimeStamper(fmt="%H:%M:%S", utc=False),
                _RoundFloats(self.digits),
                structlog.dev.ConsoleRenderer(colors=colors, sort_keys=False, pad_event_to=20),
            ],
            wrapper_class=structlog.BoundLogger,
        )

    def _epoch_label(self, epoch: int) -> str:
        return f"epoch {epoch}/{self._max_epochs}" if self._max_epochs else f"epoch {epoch}"

    def _emit_epoch(self) -> None:
        epoch, sums = self._epoch, self._sums
        values = {
            name: (last if name.startswith("schedule/") else total / count)
            for name, (total, count, last) in sums.items()
        }
        data = self._data.pop(epoch, {})
        wait = scalar_value(data.get("data_wait_frac"))
        if wait is not None:
            values["data_wait"] = f"{100 * wait:.1f}%"
        self._epoch, self._sums = None, {}
        fields = {"step": self._epoch_step}
        if self._resumed_at is not None:  # its steps up to the resume point were the interrupted run's
            fields["from_step"], self._resumed_at = self._resumed_at + 1, None
        self._emit(f"{self._epoch_label(epoch)} train", fields, values)

    def _emit(self, event: str, fields: dict, values: dict | None = None) -> None:
        """Log ``event`` with ``fields``, then ``values``; a value named like a field, ``event``
        or ``timestamp`` gets a trailing ``_``."""
        fields = dict(fields)
        for name, value in (values or {}).items():
            while name in fields or name in _RESERVED:
                name += "_"
            fields[name] = value
        if self._log is None:
            self._log = self._pipeline()
        self._log.info(event, **fields)


def _value(value: Any) -> Any:
    number = scalar_value(value)
    if number is not None:
        return number
    return value if isinstance(value, str) else repr(value)


@hookimpl(trylast=True)
def jaxnitro_make_logger(name, run_dir, experiment):
    """A :class:`ConsoleLogger` on standard output for ``"console"``; ``None`` otherwise."""
    if not isinstance(name, str) or name.lower() != "console":
        return None
    return ConsoleLogger()


@hookimpl(trylast=True)
def jaxnitro_exports():
    return {"ConsoleLogger": ConsoleLogger}
