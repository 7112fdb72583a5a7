"""jaxnitro: describe a JAX experiment once; get a fast, reproducible, instrumented run.

The public API. See ``docs/`` and ``examples/mnist/mnist_tutorial.py``.
"""

from __future__ import annotations

from .cache import CacheStats, _enable_from_env, cache_stats, clear_cache, enable_persistent_cache
from .experiment import compile_view, experiment, field
from .handle import Nitro, train
from .history import MetricHistory
from .logger_helpers import backend, logger_info
from .hookspecs import hookimpl, hookspec
from .markers import Device, GraphConst, Host, StrippedHost
from .plugin_manager import plugins_info, reload_plugins
from .prefetch import NoPrefetch, PrefetchIterator, check_batch_at
from .progress import progress_note, progress_reporter, with_progress_note
from .staleness import set_config_report
from .stopping import EarlyStopping

__version__ = "0.1.0"

_enable_from_env()  # JAXNITRO_COMPILATION_CACHE=<folder>: opt in to JAX's persistent compilation cache

__all__ = [
    "CacheStats",
    "Device",
    "EarlyStopping",
    "GraphConst",
    "Host",
    "MetricHistory",
    "Nitro",
    "NoPrefetch",
    "PrefetchIterator",
    "StrippedHost",
    "backend",
    "cache_stats",
    "check_batch_at",
    "clear_cache",
    "compile_view",
    "enable_persistent_cache",
    "experiment",
    "field",
    "hookimpl",
    "hookspec",
    "logger_info",
    "plugins_info",
    "progress_note",
    "progress_reporter",
    "reload_plugins",
    "set_config_report",
    "train",
    "with_progress_note",
]
