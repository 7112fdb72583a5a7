"""The module-level compile cache, shared by every handle in the process.

Programs are ``jax.jit`` functions keyed by what changes the graph (the
experiment class's content, hook code, GraphConst values, model structure, routing; for the train step also the
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
import types
import weakref
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


_keying = threading.local()  # ids of the objects whose key is being computed (cycles)


def stable_key(obj):
    """A hashable key for ``obj`` that is equal for equivalent objects across handles.

    * arrays (a non-trainable array inside a model) are keyed by shape, dtype
      and a hash of their bytes: they are baked into the program as constants;
    * plain functions (a ``lambda`` returned from ``optimizer()``, say) by their
      code, defaults, closure values and the values of the module globals their
      code names, so a new but identical lambda does not recompile, and a changed
      global constant does; ``functools.partial`` by its function and arguments;
    * an experiment class by its content (:func:`class_key`): its name, the code
      and values of its members and its bases', and its fields, so the same class
      defined again (a notebook cell re-run) finds its programs in the cache;
    * other hashable objects by themselves; anything else by identity (a new
      object then means a new program, never a wrong one).
    """
    if isinstance(obj, type):
        if hasattr(obj, "__jaxnitro_fields__"):
            return class_key(obj)
        return obj
    if hasattr(obj, "shape") and hasattr(obj, "dtype"):
        import hashlib

        import numpy as np

        arr = np.asarray(obj)
        return ("array", arr.shape, str(arr.dtype), hashlib.sha1(arr.tobytes()).hexdigest())
    if isinstance(obj, functools.partial):
        return ("partial", stable_key(obj.func), tuple(stable_key(a) for a in obj.args),
                tuple(sorted((k, stable_key(v)) for k, v in obj.keywords.items())))
    if inspect.isfunction(obj):
        return _guarded(obj, _function_key)
    try:
        hash(obj)
        return obj
    except TypeError:
        return ("unhashable", id(obj))


def _guarded(obj, make):
    """``make(obj)``, or a reference to ``obj`` by name when its key is already being made
    (a method whose ``__class__`` cell is its class, a recursive function)."""
    active = _keying.__dict__.setdefault("active", set())
    if id(obj) in active:
        return ("cycle", getattr(obj, "__module__", None), getattr(obj, "__qualname__", None))
    active.add(id(obj))
    try:
        return make(obj)
    finally:
        active.discard(id(obj))


def _function_key(fn) -> tuple:
    cells = tuple(stable_key(c.cell_contents) for c in (fn.__closure__ or ()) if _filled(c))
    defaults = tuple(stable_key(d) for d in (fn.__defaults__ or ()))
    kwdefaults = tuple(sorted((k, stable_key(v)) for k, v in (fn.__kwdefaults__ or {}).items()))
    return ("function", fn.__module__, fn.__qualname__, fn.__code__, defaults, kwdefaults, cells,
            _globals_key(fn))


def _filled(cell) -> bool:
    try:
        cell.cell_contents
        return True
    except ValueError:  # an empty cell
        return False


def _names(code) -> set:
    names = set(code.co_names)
    for const in code.co_consts:
        if inspect.iscode(const):
            names |= _names(const)
    return names


def _globals_key(fn) -> tuple:
    """The values of the module globals ``fn``'s code names: a function of the same module by
    its content, a module by its name, anything else by :func:`stable_key`."""
    g = fn.__globals__
    out = []
    for name in sorted(_names(fn.__code__)):
        if name not in g:
            continue
        value = g[name]
        if inspect.ismodule(value):
            key = ("module", value.__name__)
        elif inspect.isfunction(value) and value.__globals__ is not g:
            key = value  # another module's function: by identity (library code is not redefined)
        else:
            key = stable_key(value)
        out.append((name, key))
    return tuple(out)


def _member_key(value):
    if isinstance(value, (staticmethod, classmethod)):
        return (type(value).__name__, stable_key(value.__func__))
    if isinstance(value, property):
        return ("property", stable_key(value.fget), stable_key(value.fset), stable_key(value.fdel))
    return stable_key(value)


_class_keys: "weakref.WeakKeyDictionary[type, tuple]" = weakref.WeakKeyDictionary()


def class_key(cls) -> tuple:
    """The content of experiment class ``cls``: for it and each base (``object`` aside), its
    module, name and members (methods by code, other attributes by :func:`stable_key`; attrs'
    dunders and slots left out), and its fields (name, marker, type). Two classes made from the
    same source, with the same bases, have equal keys.

    Computed once per class object, when its first program is requested: a class whose
    methods are monkeypatched afterwards keeps its key, so a handle built before keeps finding
    the programs it was built with (the hooks compiled into a program are keyed separately).
    """
    key = _class_keys.get(cls)
    if key is None:
        key = _guarded(cls, _class_key)
        if not isinstance(key, tuple) or key[0] != "cycle":
            _class_keys[cls] = key
    return key


def _class_key(cls) -> tuple:
    parts = []
    for klass in cls.__mro__[:-1]:
        members = []
        for name, value in vars(klass).items():
            if name.startswith("__") and name.endswith("__"):
                continue
            if isinstance(value, (types.MemberDescriptorType, types.GetSetDescriptorType)):
                continue
            members.append((name, _member_key(value)))
        kept = vars(klass).get("__jaxnitro_knob_methods__", {})
        members += [(f"knob method {n}", _member_key(v)) for n, v in kept.items()]
        parts.append((klass.__module__, klass.__qualname__, tuple(sorted(members, key=lambda m: m[0]))))
    fields = tuple(
        (name, repr(info.marker), repr(info.inner_type)) for name, info in cls.__jaxnitro_fields__.items()
    )
    return ("experiment class", tuple(parts), fields)


def _canonical(key):
    """``key`` with experiment classes and functions replaced by their :func:`stable_key`."""
    if isinstance(key, tuple):
        return tuple(_canonical(k) for k in key)
    if inspect.isfunction(key) or (isinstance(key, type) and hasattr(key, "__jaxnitro_fields__")):
        return stable_key(key)
    return key


def get_program(kind: str, key: tuple, build: Callable[[dict], Callable], donate_argnums=()) -> Program:
    """Return the cached program for ``(kind, key)``, building it with ``build(meta)`` on first request.

    ``meta`` is a dict stored on the program that traced code may fill in
    (names of train metrics, metric modes) for every handle that shares it.

    A request served by an existing program counts one hit. Building only
    wraps the function; the compile (the miss) happens at the first call with
    a new argument signature. Experiment classes and functions in ``key`` are
    compared by content (:func:`stable_key`), so an unchanged class defined
    again reuses its programs.
    """
    global _hits
    full = (kind, _canonical(key))
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
        _class_keys.clear()
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
