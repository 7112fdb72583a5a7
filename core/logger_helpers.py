"""Helpers over logger objects (the framework defines no logger base class).

A logger is any object with the verbs the framework calls: ``log_params``,
``log_other``, ``log_metrics(metrics, *, step, epoch, context)`` and
``finish(status)``. Optional: ``info()`` (identifying parameters) and a
``backend`` attribute (the wrapped tracker object, for wrappers).
"""

from __future__ import annotations

__all__ = ["logger_info", "backend"]


def _logger_of(x):
    from .handle import Nitro

    if isinstance(x, Nitro):
        if x.logger is None:
            raise ValueError(
                "jaxnitro: this handle has no logger yet (it is made when train() starts) or "
                "logging is off (logger=None)."
            )
        return x.logger
    return x


def logger_info(x) -> dict:
    """The identifying parameters of a logger, or of a handle's logger.

    ``logger.info()`` when the logger defines it (the JSONL logger returns its
    path; a hosted tracker its URL and run key), else ``{"backend": <type name>}``.
    """
    logger = _logger_of(x)
    info = getattr(logger, "info", None)
    return dict(info()) if callable(info) else {"backend": type(logger).__name__}


def backend(x):
    """The backend object behind a logger (or a handle's logger): ``logger.backend`` if it
    wraps one, else the logger itself, whose own client methods stay callable."""
    logger = _logger_of(x)
    return getattr(logger, "backend", logger)
