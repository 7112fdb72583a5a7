"""The logger relay: how a run's lifecycle events reach its loggers (entry point ``logger_relay``).

The core makes the run's logger objects from the ``logger`` knob (names through
``jaxnitro_make_logger``, objects as given; :attr:`jaxnitro.RunContext.loggers`) and checks
their verbs; this plugin decides what each logger is told, and when:

* run start: ``resume(step)`` first when the run continues an existing run folder and the
  logger has that verb, then ``log_params`` (:func:`run_params`: experiment fields, run knobs,
  prefetch settings, parameter count, run folder) and ``log_other("binding_report", ...)``;
* a stretch of steps read: one ``train`` line per step (every ``log_every_n_steps``-th);
* an epoch trained: a ``data`` line (the data pipeline's figures);
* a split evaluated: a ``validate`` line;
* a history row's end: a ``throughput`` line (steps/s and the measured figures of
  :mod:`jaxnitro.plugins.throughput`, in ``nitro.record.throughput``), then ``flush()``;
* a step boundary a plugin asked for (a checkpointer's ``every_n_steps``): ``flush()``;
* run finish: ``finish(status)``. A failed run's error text (``"<ExceptionType>:
  <message>"``) goes to ``finish(status, error=text)`` when the logger's ``finish`` takes the
  keyword ``error``, else first to ``log_other("error", text)``.

``flush()`` is called only when the logger has it. Every hook here is ``tryfirst``: the lines
of a row or a step boundary are out (and flushed) before the checkpointer (``trylast``) saves
there, so a resume from that checkpoint finds them. The loggers of one run are driven in the
reverse of the order they were made (the order the core's per-logger relays had).

A logger that raises does not end training, nor stop the run's other loggers: the failure is
reported once (a ``RuntimeWarning`` and a structlog error naming the logger, its file or
address, the verb and the cause, also kept in ``nitro.record.problems``), and that logger gets
nothing more this run. An ``OSError`` (a full disk, a file-size limit, a lost connection) is
reported as an I/O fault; any other exception (a metric name it refuses, a bug) as the
logger's. The per-logger state (has it failed) lives in the run's store (``run.store``).
"""

from __future__ import annotations

import inspect
import warnings

import jax
import numpy as np
import structlog

from jaxnitro.plugin import describe, fields_of, hookimpl, identify_logger, summarize_value

__all__ = ["run_params"]

log = structlog.get_logger("jaxnitro")

_REPR_KNOBS = ("logger", "early_stop", "schedules", "checkpointer", "ema")
"""Knobs whose value is an object: logged as its ``repr``."""


def _json_safe(v):
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    if isinstance(v, np.generic):
        return v.item()
    if hasattr(v, "shape") and np.ndim(v) == 0:
        return np.asarray(v).item()
    return summarize_value(v)


def run_params(nitro, run_dir: str) -> dict:
    """The run's parameters: experiment fields (Device fields at their live value), run
    knobs, prefetch settings, parameter count and the run folder."""
    e = nitro.experiment
    params = {"experiment": type(e).__name__}
    for name, info in fields_of(e).items():
        value = nitro.device_value(name) if info.is_device else getattr(e, name)
        params[f"field/{name}"] = _json_safe(value)
    for name, r in nitro.settings.knobs.items():
        value = nitro.settings.logger if name == "logger" else r.value
        if name in _REPR_KNOBS:
            params[f"knob/{name}"] = repr(value) if value is not None else None
        else:
            params[f"knob/{name}"] = _json_safe(value)
    for split, src in nitro.data.items():
        for k, v in (src.info() if hasattr(src, "info") else {}).items():
            params[f"prefetch/{split}/{k}"] = _json_safe(v)
    params["monitor"] = list(nitro.settings.monitor) if nitro.settings.monitor else None  # jaxnitro runs
    params["n_params"] = int(sum(np.size(x) for x in jax.tree_util.tree_leaves(nitro.params)))
    params["run_dir"] = run_dir
    return params


def _takes_error(finish) -> bool:
    """Whether a logger's ``finish`` accepts the keyword ``error`` (the failure's text)."""
    try:
        params = inspect.signature(finish).parameters
    except (TypeError, ValueError):
        return False
    return "error" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


class _Relay:
    """One logger of one run: its verbs called through :meth:`call`, which stops at its first failure."""

    def __init__(self, logger, run):
        self.logger, self.run = logger, run
        self.failed: Exception | None = None

    def call(self, verb: str, *args, **kwargs) -> None:
        if self.failed is not None:
            return
        try:
            getattr(self.logger, verb)(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - one logger never ends the run or the others
            self.failed = err
            where = identify_logger(self.logger)
            fix = (
                "Free the disk (or fix the destination) and log again in a new run."
                if isinstance(err, OSError)
                else "Fix the logger (or what it was given) and log again in a new run."
            )
            text = (
                f"jaxnitro: logger {type(self.logger).__name__} ({where}) failed in `{verb}`: {type(err).__name__}: {err}. "
                f"It gets nothing more this run; training and the other loggers go on, and the "
                f"handle keeps its state. {fix}"
            )
            self.run.nitro.record.problems.append(text)
            log.error("logger failed", logger=type(self.logger).__name__, verb=verb, error=repr(err), **where)
            warnings.warn(text, RuntimeWarning, stacklevel=2)

    def has(self, verb: str) -> bool:
        return callable(getattr(self.logger, verb, None))

    def flush(self) -> None:
        if self.failed is None and self.has("flush"):
            self.call("flush")


def _relays(run) -> list[_Relay]:
    """The run's relays, one per logger of ``run.loggers``, made at the first hook that needs them."""
    store = run.store(__name__)
    if "relays" not in store:
        store["relays"] = [_Relay(logger, run) for logger in reversed(run.loggers)]
    return store["relays"]


@hookimpl(tryfirst=True)
def jaxnitro_run_start(run):
    for relay in _relays(run):
        step = run.resumed_step
        if step is not None and relay.has("resume"):
            relay.call("resume", step)  # before anything of this run is logged
        relay.call("log_params", run_params(run.nitro, run.run_dir))
        relay.call("log_other", "binding_report", describe(run.nitro, "report"))


@hookimpl(tryfirst=True)
def jaxnitro_steps_read(run, stretch):
    for relay in _relays(run):
        if relay.failed is None:
            for step, epoch, line in stretch.lines(run.settings.log_every_n_steps):
                relay.call("log_metrics", line, step=step, epoch=epoch, context="train")


@hookimpl(tryfirst=True)
def jaxnitro_epoch_trained(run, epoch, step, stats):
    for relay in _relays(run) if stats else ():  # none: a resumed run closing the row its checkpoint left open
        relay.call("log_metrics", dict(stats), step=step, epoch=epoch, context="data")


@hookimpl(tryfirst=True)
def jaxnitro_epoch_end(run, row):
    timed = run.nitro.record.throughput  # the row's measured throughput (the throughput plugin)
    for relay in _relays(run):
        if relay.failed is None and timed and timed[-1]["step"] == row["step"]:
            figures = {k: v for k, v in timed[-1].items() if k not in ("epoch", "step")}
            relay.call("log_metrics", figures, step=row["step"], epoch=row["epoch"], context="throughput")
        relay.flush()


@hookimpl(tryfirst=True)
def jaxnitro_step_boundary(run, step, epoch):
    for relay in _relays(run):
        relay.flush()


@hookimpl(tryfirst=True)
def jaxnitro_split_evaluated(run, split, metrics, context):
    for relay in _relays(run):
        relay.call("log_metrics", metrics, step=run.nitro.step, epoch=run.nitro.epoch, context=context)


@hookimpl(tryfirst=True)
def jaxnitro_run_finish(run, status):
    error = getattr(run, "error", None)
    for relay in _relays(run):
        if status != "failed" or error is None:
            relay.call("finish", status)
            continue
        text = f"{type(error).__name__}: {error}"[:4000]
        if _takes_error(relay.logger.finish):
            relay.call("finish", status, error=text)  # the finish line names it
        else:
            relay.call("log_other", "error", text)
            relay.call("finish", status)
