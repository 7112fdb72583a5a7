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

What each logger is told, and when (the fan-out of the lifecycle events to the run's
loggers, flushing, a failing logger's isolation) is the ``logger_relay`` plugin's
(:mod:`jaxnitro.plugins.logger_relay`); the core only makes the run's logger objects
(:func:`make_loggers`, checked by :func:`check_loggers`) and hands them to it on
:attr:`jaxnitro.RunContext.loggers`.
"""

from __future__ import annotations

import pathlib

import numpy as np

from .contracts import LOGGER_VERBS, Logger
from .knob_table import DEFAULT_LOGGER
from .plugin_manager import disabled_note, first_result, plugin_manager, plugins_info

__all__ = [
    "DEFAULT_LOGGER",
    "LOGGER_VERBS",
    "backend",
    "check_logger_knob",
    "check_loggers",
    "identify_logger",
    "logger_info",
    "make_loggers",
    "scalar_value",
]

# LOGGER_VERBS (the required verbs) and the Logger protocol live in jaxnitro.contracts; the
# knob's default, DEFAULT_LOGGER, in jaxnitro.knob_table.


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


def check_loggers(loggers: list) -> None:
    """Refuse, before the run starts, a logger lacking one of :data:`LOGGER_VERBS`
    (``AttributeError`` naming the verb, see :func:`verb_of`)."""
    for logger in loggers:
        for verb in LOGGER_VERBS:
            verb_of(logger, verb)


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


def identify_logger(logger) -> dict:
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
    infos = [identify_logger(logger) for logger in loggers]
    return infos[0] if len(infos) == 1 else infos


def backend(x):
    """The backend object behind a logger (or a handle's first logger): ``logger.backend`` if
    it wraps one, else the logger itself, whose own client methods stay callable."""
    logger = _loggers_of(x)[0]
    return getattr(logger, "backend", logger)
