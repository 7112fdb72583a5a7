"""``jaxnitro.plugin``: everything a plugin imports (besides the public ``jaxnitro``).

A plugin, built-in or third-party, is a module (or an object) registered as an entry
point in group ``jaxnitro``; it implements hooks marked with :data:`hookimpl`. The
built-in plugins (``jaxnitro.plugins.*``, ``jaxnitro.loggers.*``,
``jaxnitro.checkpointers.*``) import only ``jaxnitro`` and this module; an
import-linter contract in pyproject.toml (``plugins-use-the-plugin-surface``) keeps it
so. See docs/plugins.md.

**Hooks.** :data:`hookimpl` marks an implementation; the specs, with their types, are
:class:`ExtensionSpec` (one answer each, ``firstresult``), :class:`LifecycleSpec` (every
plugin, at fixed points of a run) and the experiment hooks (:data:`EXPERIMENT_HOOKS`,
module-level functions of :mod:`jaxnitro.hookspecs`). Every extension and lifecycle hook
is called through pluggy, so ``tryfirst``, ``trylast`` and ``wrapper=True`` work.

**Shapes** (``typing.Protocol``, ``runtime_checkable``): :class:`Logger`,
:class:`Reporter`, :class:`Source`, :class:`IndexedSource`, :class:`StopPolicy`,
:class:`Checkpointer`, :class:`Exporter`, :class:`StatefulStream` (a stream that records and
restores its iterator state; :class:`PassStates` keeps its per-batch states), :class:`Prefetcher`
(a wrapped split, ``jaxnitro_make_prefetcher``'s answer), :class:`RunFolderHold` (what
``jaxnitro_hold_run_folder`` returns: a run's hold on its folder), :class:`PrecisionPolicy`
(``jaxnitro_precision_policy``'s answer: the casts and remat around ``forward``),
:class:`ShardingPolicy` (``jaxnitro_sharding_policy``'s answer: the mesh's shape and each
parameter's spec, laid out as a :class:`Layout` by :func:`param_layout`).

**Events.** :class:`RunContext` (the ``run`` lifecycle hooks get: ``run.nitro``,
``run.settings``, ``run.monitor``, ``run.request_stop(reason)``, and
``run.store(key)``, the per-run dict for a plugin's state, ``run.run_state``: a :class:`RunState`)
and :class:`StepStretch` (``jaxnitro_steps_read``). A history row (``jaxnitro_epoch_end``) is a
``dict``; :class:`SavedRun` (``run.run_state.snapshot()``) is what a checkpointer serializes.

**Knobs and answers.** :func:`owns_knob` says whether a plugin is the one that accepted a
run knob (``jaxnitro_accept_knob``) for this handle: only that plugin acts on it.
:func:`answers_for` lists which plugin answered each extension hook for a handle (its
setup and runs; ``print(nitro)`` shows them), :func:`answer_source` names one with its
distribution.

**Helpers** the built-in plugins share, each documented where it is defined:

* experiments: :func:`fields_of`, :func:`is_experiment`, :func:`call_method`,
  :func:`method_of`, :func:`summarize_value`, :func:`to_device_value`;
* run knobs: :data:`RUN_KNOBS`, :data:`KNOB_DEFAULTS`, :data:`HANDLE_KEYWORDS`,
  :data:`SCALAR_KNOBS`, :func:`resolve_knobs`, :func:`require_monitor_and_val`;
* the monitored metric: :func:`monitored_value`, :func:`check_monitored_value`, :func:`improves`,
  :func:`best_positions`;
* data: :func:`as_batch`, :func:`check_fields`, :func:`check_epoch`, :func:`aligned`,
  :class:`ProcessPart`, :func:`split_by_process`;
* loggers and progress: :func:`scalar_value`, :data:`LOGGER_VERBS`, :func:`identify_logger`,
  :func:`describe`, :func:`make_reporter`, :func:`current_note`;
* checkpoints: :class:`WeightsRecord`, :class:`NoCheckpointError`, :func:`incompatibility`,
  :func:`jsonable`, :func:`from_jsonable`, :func:`tree_listing`, :func:`ema_of`,
  :func:`rule_state_of`, :data:`HYPERS`;
* export: :class:`InferenceProgram` (what ``jaxnitro_export`` gets), :func:`pad_batch`;
* the persistent compilation cache: :data:`CACHE_ENV`;
* reading a split (what a prefetcher plugin builds on): :class:`SplitWrapper` (a base with
  the :class:`Prefetcher` members, reading serially; subclasses override ``_stream``),
  :class:`EpochStream`, :class:`NoPrefetch` (the core's fallback), the serial pass
  (:func:`host_items`, :func:`transferred`, :func:`serial`, :func:`skipped`;
  :func:`check_past_end` and :func:`batch_rows`: a full batch one past ``len()``), the source
  contract (:func:`is_addressable`, :func:`accessors`, :func:`adapted`, :func:`length_of`,
  :func:`describe_source`: how messages name a source) and its errors
  (:class:`PrefetchError`, :class:`SourceLengthError`, :func:`failure_error`);
* the memory preflight: :class:`FirstStep` and :class:`StepProgram` (what
  ``jaxnitro_preflight`` gets);
* program keys and parameter paths: :func:`stable_key`, :func:`keypath_of`.
"""

from __future__ import annotations

import sys

from .batches import pad_batch
from .blocks import aligned
from .cache import CACHE_ENV, stable_key
from .contracts import (
    LOGGER_VERBS,
    REPORTER_METHODS,
    Batch,
    Checkpointer,
    Exporter,
    IndexedSource,
    Logger,
    PREFETCHER_MEMBERS,
    PrecisionPolicy,
    Prefetcher,
    Reporter,
    RunFolderHold,
    ShardingPolicy,
    Source,
    StatefulStream,
    StopPolicy,
)
from .describe import describe, summarize_value
from .distributed import ProcessPart, check_count, split_by_process
from .events import RunContext, StepStretch
from .run_state import RunState, SavedRun
from .first_step import FirstStep, StepProgram
from .experiment import call_method, fields_of, is_experiment, method_of, to_device_value
from .hookcalls import Answer, answers_for, knob_owner
from .plugin_manager import answer_source
from .history import best_positions, check_monitored_value, improves, monitored_value
from .inference import InferenceProgram
from .hookspecs import EXPERIMENT_HOOKS, ExtensionSpec, LifecycleSpec, hookimpl, hookspec
from .knobs import HANDLE_KEYWORDS, KNOB_DEFAULTS, RUN_KNOBS, SCALAR_KNOBS, require_monitor_and_val, resolve_knobs
from .logger import identify_logger, scalar_value
from .optim import HYPERS, ema_of, keypath_of, rule_state_of
from .sharding import DATA, Layout, param_layout
from .serial_pass import batch_rows, check_past_end, host_items, serial, skipped, transferred
from .source_contract import accessors, adapted, check_epoch, is_addressable, length_of
from .source_contract import describe as describe_source
from .source_errors import PrefetchError, SourceLengthError, failure_error
from .split_wrapper import EpochStream, NoPrefetch, SplitWrapper
from .progress import current_note, make_reporter
from .sources import as_batch, check_fields
from .stream_state import PassStates
from .weights import NoCheckpointError, WeightsRecord, from_jsonable, incompatibility, jsonable, tree_listing

__all__ = [
    # hooks
    "hookimpl", "hookspec", "ExtensionSpec", "LifecycleSpec", "EXPERIMENT_HOOKS",
    # shapes
    "Batch", "Logger", "LOGGER_VERBS", "Reporter", "REPORTER_METHODS", "Source", "IndexedSource",
    "StopPolicy", "Checkpointer", "Exporter", "StatefulStream", "PassStates", "Prefetcher",
    "PREFETCHER_MEMBERS", "RunFolderHold", "PrecisionPolicy", "ShardingPolicy",
    # events and who answered
    "RunContext", "StepStretch", "Answer", "answers_for", "answer_source", "knob_owner", "owns_knob",
    "RunState", "SavedRun",
    # experiments and knobs
    "fields_of", "is_experiment", "call_method", "method_of", "summarize_value", "to_device_value",
    "RUN_KNOBS", "KNOB_DEFAULTS", "HANDLE_KEYWORDS", "SCALAR_KNOBS", "resolve_knobs",
    "require_monitor_and_val",
    # the monitored metric
    "check_monitored_value", "monitored_value", "improves", "best_positions",
    # data
    "as_batch", "check_fields", "check_epoch", "aligned", "ProcessPart", "split_by_process", "check_count",
    # loggers and progress
    "scalar_value", "make_reporter", "current_note", "identify_logger", "describe",
    # checkpoints
    "WeightsRecord", "NoCheckpointError", "incompatibility", "jsonable", "from_jsonable",
    "tree_listing", "ema_of", "rule_state_of", "HYPERS",
    # export
    "InferenceProgram", "pad_batch",
    # the persistent compilation cache
    "CACHE_ENV",
    # reading a split (the prefetch plugin builds on these)
    "SplitWrapper", "EpochStream", "NoPrefetch", "host_items", "serial", "skipped", "transferred",
    "batch_rows", "check_past_end",
    "accessors", "adapted", "describe_source", "is_addressable", "length_of",
    "PrefetchError", "SourceLengthError", "failure_error",
    # the memory preflight
    "FirstStep", "StepProgram",
    # program keys and parameter paths (the precision plugin's)
    "stable_key", "keypath_of",
    # where parameters live on the mesh (the sharding plugin's)
    "DATA", "Layout", "param_layout",
]


def owns_knob(where, knob: str, plugin) -> bool:
    """Whether ``plugin`` accepted run knob ``knob`` for this handle (and so is the one to act on it).

    ``where`` is a run (:class:`RunContext`) or a handle; ``plugin`` is the plugin itself
    or, for a module plugin, its module name (pass ``__name__``). At setup, the core asks
    ``jaxnitro_accept_knob`` for every plugin knob that is set and records which plugin
    answered first (pluggy's order: an installed plugin before a ``trylast`` built-in); a
    plugin that acts on a knob another plugin accepted would apply a value it never
    checked. ``early_stop=MyPolicy()`` accepted by a third-party plugin is therefore left
    alone by the built-in early stopping, and ``checkpointer=`` by the orbax checkpointer.
    """
    owner = knob_owner(where, knob)
    if owner is None:
        return False
    if isinstance(plugin, str):
        return owner is sys.modules.get(plugin) or getattr(owner, "__name__", None) == plugin
    return owner is plugin
