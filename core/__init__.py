"""jaxnitro: describe a JAX experiment once; get a fast, reproducible, instrumented run.

The public API. See ``docs/`` and ``examples/mnist/mnist_tutorial.py``.

The names below are the core's. Feature plugins add their own through the
``jaxnitro_exports`` hook (``jn.EarlyStopping`` from the ``early_stopping``
plugin, ``jn.set_config_report`` from ``staleness``, ``jn.load_exported`` from
``export``, ``jn.PrefetchIterator`` and ``jn.check_batch_at`` from ``prefetch``); they
are looked up on first use, so a disabled plugin's names are simply absent.
"""

from __future__ import annotations

from . import distributed
from .cache import CacheStats, cache_stats, clear_cache, enable_persistent_cache
from .events import RunContext, StepStretch
from .distributed import Dist, setup_devices
from .experiment import compile_view, experiment, field
from .handle import Nitro, memory_report, train
from .history import MetricHistory
from .hookspecs import hookimpl, hookspec
from .interrupts import PREEMPTED_EXIT_CODE, Preempted, Terminated
from .knobs import Settings
from .logger import backend, logger_info
from .manual import Optimizers
from .markers import Device, GraphConst, Host, StrippedHost
from .plugin_manager import plugins_info, reload_plugins
from .source_errors import PrefetchError, SourceLengthError
from .split_wrapper import NoPrefetch
from . import sources as _sources  # noqa: F401 - installs the loader adapter the split wrappers use
from .weights import EMA
from .progress import progress_note, progress_reporter, with_progress_note

__version__ = "0.1.0"

__all__ = [
    "CacheStats",
    "Device",
    "Dist",
    "EMA",
    "GraphConst",
    "Host",
    "MetricHistory",
    "Nitro",
    "NoPrefetch",
    "Optimizers",
    "PREEMPTED_EXIT_CODE",
    "Preempted",
    "RunContext",
    "Settings",
    "StepStretch",
    "StrippedHost",
    "Terminated",
    "backend",
    "cache_stats",
    "clear_cache",
    "compile_view",
    "distributed",
    "enable_persistent_cache",
    "experiment",
    "field",
    "hookimpl",
    "hookspec",
    "logger_info",
    "memory_report",
    "plugins_info",
    "progress_note",
    "progress_reporter",
    "reload_plugins",
    "setup_devices",
    "train",
    "with_progress_note",
    "PrefetchError",
    "SourceLengthError",
]

_looking_up: set[str] = set()


def __getattr__(name: str):
    """A name a plugin exports (``jaxnitro_exports``), e.g. ``jn.EarlyStopping``."""
    if name.startswith("_") or name in _looking_up:  # dunders, and lookups while plugins load
        raise AttributeError(f"module 'jaxnitro' has no attribute {name!r}")
    from .exports import lookup

    _looking_up.add(name)
    try:
        return lookup(name, set(__all__))
    finally:
        _looking_up.discard(name)


def __dir__() -> list[str]:
    from .exports import names

    return sorted(set(globals()) | set(names(set(__all__))))
