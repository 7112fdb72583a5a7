"""The logger contract: loggers made by name through plugins, and driven by lifecycle events.

A logger is any object with the verbs the framework calls (no base class):
``log_params(params)``, ``log_other(key, value)``,
``log_metrics(metrics, *, step, epoch, context)`` and ``finish(status)``;
optionally ``info()`` (identifying parameters), ``backend`` (a wrapped
tracker object), ``resume(step)`` (the run continues an existing run folder from
optimizer step ``step``: called once, before any other verb of the run) and
``flush()`` (push what is buffered to its destination: called at each history row's
end and each step boundary, before the checkpointer saves). A run that failed passes the
failure's text (``"<ExceptionType>: <message>"``) to ``finish(status, error=text)`` when the
logger's ``finish`` takes the keyword ``error``, else logs it first as ``log_other("error", text)``. The ``logger`` run knob is a name (made by the
``jaxnitro_make_logger`` hook), a logger object, a list of those (several
loggers at once), or ``None``. Left unset, the ``jaxnitro_default_logger``
hook names it; the core names no logger.

Each logger of a run is wrapped in a :class:`LoggerRelay`, a run-scoped plugin
that turns lifecycle events into verbs: ``params`` and the binding report at
run start (preceded by ``resume(step)`` when the run continues an existing run
folder and the logger has that verb), a ``train`` line per step (every
``log_every_n_steps``-th) per stretch read, a ``data`` line per epoch trained, a
``validate`` line per validation, a ``throughput`` line per history row (steps/s and the
measured figures of :mod:`jaxnitro.throughput`), ``flush()`` at each history row's end and each step
boundary a plugin asked for (a checkpointer's ``every_n_steps``), when the logger has it,
``finish(status)`` at the end.
"""

from __future__ import annotations

import pathlib
import warnings

import jax
import numpy as np
import structlog

from .contracts import LOGGER_VERBS, Logger
from .experiment import fields_of, summarize_value
from .hookspecs import hookimpl
from .plugin_manager import disabled_note, first_result, plugins_info

__all__ = [
    "DEFAULT_LOGGER",
    "LOGGER_VERBS",
    "LoggerRelay",
    "backend",
    "check_logger_knob",
    "logger_info",
    "make_loggers",
    "run_params",
    "scalar_value",
]

# LOGGER_VERBS (the required verbs) and the Logger protocol live in jaxnitro.contracts.

log = structlog.get_logger("jaxnitro")


class _DefaultLogger:
    """The ``logger`` knob's default: whatever the ``jaxnitro_default_logger`` hook names."""

    def __repr__(self) -> str:
        return "<default logger>"


DEFAULT_LOGGER = _DefaultLogger()


def _as_list(spec) -> list:
    if spec is None:
        return []
    return list(spec) if isinstance(spec, (list, tuple)) else [spec]


def check_logger_knob(spec, source: str):
    """Resolve the default and check every entry of the ``logger`` knob at setup.

    Returns the knob with the default replaced by the name the plugins choose
    (``None`` when no plugin names one). Raises ``ValueError`` for a name whose
    plugin is disabled, and ``AttributeError`` for a logger object lacking a verb.
    """
    if spec is DEFAULT_LOGGER:
        return first_result("jaxnitro_default_logger")
    from .plugin_manager import plugin_manager

    for entry in _as_list(spec):
        if isinstance(entry, str):
            if plugin_manager().is_blocked(entry):
                raise ValueError(
                    f"jaxnitro: logger {entry!r} ({source}) comes from the plugin `{entry}`, which is "
                    f"disabled{disabled_note()}. Enable it, or choose another logger (logger=None "
                    f"turns logging off)."
                )
        elif not isinstance(entry, Logger):  # the protocol's check; then name the missing verb
            for verb in LOGGER_VERBS:
                verb_of(entry, verb)
    return spec


def verb_of(logger, verb: str):
    """``logger.<verb>``; a logger lacking the verb raises ``AttributeError`` naming it and the fix."""
    fn = getattr(logger, verb, None)
    if fn is None:
        raise AttributeError(
            f"jaxnitro: the logger {type(logger).__name__} has no `{verb}` method. A logger is any "
            f"object with the verbs the framework calls: {', '.join(LOGGER_VERBS)}. Add `{verb}` "
            f"(or pass logger=None to disable logging)."
        )
    return fn


def make_loggers(spec, run_dir: str, experiment) -> list:
    """The run's logger objects: names made through ``jaxnitro_make_logger``, objects as given."""
    out = []
    for entry in _as_list(spec):
        if not isinstance(entry, str):
            out.append(entry)
            continue
        made = first_result(
            "jaxnitro_make_logger", name=entry, run_dir=pathlib.Path(run_dir), experiment=experiment
        )
        if made is None:
            raise ValueError(
                f"jaxnitro: no plugin makes a logger named {entry!r}. Loaded plugins: "
                f"{[p.name for p in plugins_info()]}{disabled_note()}. Pass `logger=None` to "
                f"disable logging, or a logger object."
            )
        out.append(made)
    return out


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
        if name in ("logger", "early_stop", "schedules", "checkpointer", "ema"):
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


class LoggerRelay:
    """A run-scoped plugin that drives one logger from the lifecycle events of one run.

    A logger that raises does not end training, nor stop the run's other loggers:
    the failure is reported once (a ``RuntimeWarning`` and a structlog error naming
    the logger, its file or address, the verb and the cause, also kept in
    ``nitro.record.problems``), and that logger gets nothing more this run. An
    ``OSError`` (a full disk, a file-size limit, a lost connection) is reported as an
    I/O fault; any other exception (a metric name it refuses, a bug) as the logger's.
    """

    def __init__(self, logger, run):
        self.logger, self.run = logger, run
        self.failed: Exception | None = None
        for verb in LOGGER_VERBS:
            verb_of(logger, verb)  # a missing verb fails at run start, not mid-run

    def _call(self, verb: str, *args, **kwargs) -> None:
        if self.failed is not None:
            return
        try:
            getattr(self.logger, verb)(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - one logger never ends the run or the others
            self.failed = err
            where = _info_or_type(self.logger)
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

    def _mine(self, run) -> bool:
        return run is self.run

    @hookimpl
    def jaxnitro_run_start(self, run):
        if self._mine(run):
            from .describe import describe

            step = run.resumed_step
            if step is not None and callable(getattr(self.logger, "resume", None)):
                self._call("resume", step)  # before anything of this run is logged
            self._call("log_params", run_params(run.nitro, run.run_dir))
            self._call("log_other", "binding_report", describe(run.nitro, "report"))

    @hookimpl
    def jaxnitro_steps_read(self, run, stretch):
        if self._mine(run) and self.failed is None:
            for step, epoch, line in stretch.lines(run.settings.log_every_n_steps):
                self._call("log_metrics", line, step=step, epoch=epoch, context="train")

    @hookimpl
    def jaxnitro_epoch_trained(self, run, epoch, step, stats):
        if self._mine(run):
            self._call("log_metrics", dict(stats), step=step, epoch=epoch, context="data")

    def _flush(self, run) -> None:
        if self._mine(run) and self.failed is None and callable(getattr(self.logger, "flush", None)):
            self._call("flush")

    # before the checkpointer saves (it subscribes to both, trylast): every line up to a
    # checkpoint's step is out before the checkpoint exists, so a resume from it finds them

    @hookimpl(tryfirst=True)
    def jaxnitro_epoch_end(self, run, row):
        if self._mine(run) and self.failed is None:  # the row's measured throughput (jaxnitro.throughput)
            timed = run.nitro.record.throughput
            if timed and timed[-1]["step"] == row["step"]:
                figures = {k: v for k, v in timed[-1].items() if k not in ("epoch", "step")}
                self._call("log_metrics", figures, step=row["step"], epoch=row["epoch"], context="throughput")
        self._flush(run)

    @hookimpl(tryfirst=True)
    def jaxnitro_step_boundary(self, run, step, epoch):
        self._flush(run)

    @hookimpl
    def jaxnitro_split_evaluated(self, run, split, metrics, context):
        if self._mine(run):
            self._call("log_metrics", metrics, step=run.nitro.step, epoch=run.nitro.epoch, context=context)

    @hookimpl
    def jaxnitro_run_finish(self, run, status):
        if not self._mine(run):
            return
        error = getattr(run, "error", None)
        if status != "failed" or error is None:
            self._call("finish", status)
            return
        text = f"{type(error).__name__}: {error}"[:4000]
        if _takes_error(self.logger.finish):
            self._call("finish", status, error=text)  # the finish line names it
        else:
            self._call("log_other", "error", text)
            self._call("finish", status)


def _takes_error(finish) -> bool:
    """Whether a logger's ``finish`` accepts the keyword ``error`` (the failure's text)."""
    import inspect

    try:
        params = inspect.signature(finish).parameters
    except (TypeError, ValueError):
        return False
    return "error" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


# -- public helpers -------------------------------------------------------------------


def scalar_value(value) -> float | None:
    """``value`` as one float when it is a number (Python/NumPy scalars, bools, 0-d or
    one-element arrays, a JAX scalar); else None (a string, a longer array, None, an odd
    object). Never raises: loggers use it to decide what is a scalar metric."""
    if isinstance(value, (bool, int, float)):
        return float(value)
    try:
        array = np.asarray(value)
    except Exception:  # noqa: BLE001 - a deleted buffer, an odd object: not a scalar
        return None
    if array.size == 1 and array.dtype.kind in "biuf":
        return float(array.reshape(()))
    return None


def _loggers_of(x) -> list:
    loggers = getattr(x, "loggers", None)
    if loggers is not None and hasattr(x, "experiment"):  # a handle
        if not loggers:
            raise ValueError(
                "jaxnitro: this handle has no logger yet (it is made when train() starts) or "
                "logging is off (logger=None)."
            )
        return list(loggers)
    return [x]


def _info_or_type(logger) -> dict:
    """``logger.info()`` when the logger defines it, else ``{"backend": <type name>}``; never raises."""
    info = getattr(logger, "info", None)
    try:
        return dict(info()) if callable(info) else {"backend": type(logger).__name__}
    except Exception as err:  # noqa: BLE001 - describing a broken logger must not fail
        return {"backend": type(logger).__name__, "info_error": repr(err)}


def logger_info(x):
    """The identifying parameters of a logger, or of a handle's loggers.

    For one logger: ``logger.info()`` when it defines it (the JSONL logger returns
    its path; a hosted tracker its URL and run key), else ``{"backend": <type name>}``.
    For a handle: that dict for its logger, or a list of them, one per logger, when
    the run has several (``logger=["jsonl", "tensorboard"]``).
    """
    loggers = _loggers_of(x)
    infos = [_info_or_type(logger) for logger in loggers]
    return infos[0] if len(infos) == 1 else infos


def backend(x):
    """The backend object behind a logger (or a handle's first logger): ``logger.backend`` if
    it wraps one, else the logger itself, whose own client methods stay callable."""
    logger = _loggers_of(x)[0]
    return getattr(logger, "backend", logger)
