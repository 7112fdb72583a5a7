"""The module-level compile cache, shared by every handle in the process.

Programs are ``jax.jit`` functions keyed by what changes the graph (hook
code, GraphConst values, model structure, routing; for the train step also the
optimizer rules and groups and whether gradients are clipped; see
:mod:`jaxnitro.programs`). Device values, seeds, run folders, epoch budgets,
schedules, ``1/accum``, the clip threshold, loggers and early stopping never
enter a key: they are program inputs or host state.

``cache_stats()`` is the witness: ``misses`` counts traces (each trace is
one XLA compilation), ``hits`` counts the programs a handle found already in
the cache (each handle asks once per program), ``entries`` the compiled
programs held.

Across processes, :func:`enable_persistent_cache` (or the
``JAXNITRO_COMPILATION_CACHE`` environment variable) opts in to JAX's
on-disk compilation cache: a later process still traces, but loads the
compiled executables instead of compiling them.
"""

from __future__ import annotations

import functools
import inspect
import os
import threading
from typing import Callable, NamedTuple

import jax

__all__ = [
    "CacheStats",
    "cache_stats",
    "get_program",
    "clear_cache",
    "Program",
    "stable_key",
    "enable_persistent_cache",
    "CACHE_ENV",
]


class CacheStats(NamedTuple):
    """``(hits, misses, entries)`` of the module-level compile cache."""

    hits: int
    misses: int
    entries: int


_lock = threading.Lock()
_programs: dict[tuple, "Program"] = {}
_hits = 0
_misses = 0


class Program:
    """One cached program: a ``jax.jit`` function plus its trace bookkeeping.

    ``kind`` names it (``"train_step"``, ``"accumulate"``, ``"forward"``,
    ``"metrics"``). Call ``program.jitted(*args)``: a call whose argument
    shapes/dtypes were seen before runs the compiled executable, a new
    signature traces and compiles once (one miss).
    """

    def __init__(self, kind: str, fn: Callable, donate_argnums=(), meta: dict | None = None):
        self.kind = kind
        self.traces = 0
        self.meta = meta if meta is not None else {}

        @functools.wraps(fn)
        def traced(*args):
            global _misses
            with _lock:
                self.traces += 1
                _misses += 1
            return fn(*args)

        self.jitted = jax.jit(traced, donate_argnums=donate_argnums)


def stable_key(obj):
    """A hashable key for ``obj`` that is equal for equivalent objects across handles.

    * arrays (a non-trainable array inside a model) are keyed by shape, dtype
      and a hash of their bytes: they are baked into the program as constants;
    * plain functions (a ``lambda`` returned from ``optimizer()``, say) by their
      code, defaults and closure values, so a new but identical lambda does not
      recompile; ``functools.partial`` by its function and arguments;
    * other hashable objects by themselves; anything else by identity (a new
      object then means a new program, never a wrong one).
    """
    if hasattr(obj, "shape") and hasattr(obj, "dtype") and not isinstance(obj, type):
        import hashlib

        import numpy as np

        arr = np.asarray(obj)
        return ("array", arr.shape, str(arr.dtype), hashlib.sha1(arr.tobytes()).hexdigest())
    if isinstance(obj, functools.partial):
        return ("partial", stable_key(obj.func), tuple(stable_key(a) for a in obj.args),
                tuple(sorted((k, stable_key(v)) for k, v in obj.keywords.items())))
    if inspect.isfunction(obj):
        cells = tuple(stable_key(c.cell_contents) for c in (obj.__closure__ or ()))
        defaults = tuple(stable_key(d) for d in (obj.__defaults__ or ()))
        return ("function", obj.__module__, obj.__qualname__, obj.__code__, defaults, cells)
    try:
        hash(obj)
        return obj
    except TypeError:
        return ("unhashable", id(obj))


def get_program(kind: str, key: tuple, build: Callable[[dict], Callable], donate_argnums=()) -> Program:
    """Return the cached program for ``(kind, key)``, building it with ``build(meta)`` on first request.

    ``meta`` is a dict stored on the program that traced code may fill in
    (names of train metrics, metric modes) for every handle that shares it.

    A request served by an existing program counts one hit. Building only
    wraps the function; the compile (the miss) happens at the first call with
    a new argument signature.
    """
    global _hits
    full = (kind, key)
    with _lock:
        program = _programs.get(full)
        if program is not None:
            _hits += 1
            return program
    meta: dict = {}
    program = Program(kind, build(meta), donate_argnums, meta)
    with _lock:
        return _programs.setdefault(full, program)


def cache_stats() -> CacheStats:
    """Return ``CacheStats(hits, misses, entries)`` of the process's compile cache.

    ``misses`` counts compilations, ``entries`` the compiled programs held
    (one per traced signature), ``hits`` the program requests that reused a
    compiled program.
    """
    with _lock:
        entries = sum(p.traces for p in _programs.values())
        return CacheStats(_hits, _misses, entries)


def clear_cache() -> None:
    """Drop every cached program (their compiled executables are freed with them)."""
    global _hits, _misses
    with _lock:
        _programs.clear()
        _hits = 0
        _misses = 0


# -- JAX's persistent (on-disk) compilation cache ----------------------------------

CACHE_ENV = "JAXNITRO_COMPILATION_CACHE"
"""Environment variable: a folder; when set, ``import jaxnitro`` enables the persistent cache there."""


def enable_persistent_cache(path: str | os.PathLike | None = None) -> str:
    """Opt in to JAX's persistent compilation cache, so a later process skips XLA compilation.

    ``path`` is the cache folder (created if missing); without it, the
    ``JAXNITRO_COMPILATION_CACHE`` environment variable, else
    ``~/.cache/jaxnitro/xla``. Every compiled program is written there,
    however small or quick to compile (JAX's defaults skip programs that
    compile in under a second, which is most programs on CPU). Returns the
    folder's absolute path.

    The in-process cache (:func:`cache_stats`) is unaffected: a new process
    still traces each program once (a miss), but XLA loads the executable
    from disk instead of compiling it. Setting ``JAXNITRO_COMPILATION_CACHE``
    before ``import jaxnitro`` is the same as calling this at import.

    The folder is trusted code: do not share it with users you do not trust.
    """
    if path is None:
        path = os.environ.get(CACHE_ENV) or os.path.join("~", ".cache", "jaxnitro", "xla")
    folder = os.path.abspath(os.path.expanduser(os.fspath(path)))
    os.makedirs(folder, exist_ok=True)
    from jax.experimental.compilation_cache import compilation_cache as _cc

    if jax.config.jax_compilation_cache_dir != folder:
        _cc.reset_cache()  # a cache JAX already opened keeps its folder until reset
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return folder


def _enable_from_env() -> None:
    if os.environ.get(CACHE_ENV):
        enable_persistent_cache(os.environ[CACHE_ENV])
