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

Across processes, :func:`enable_persistent_cache` (or the ``compilation_cache`` run
knob, or the ``JAXNITRO_COMPILATION_CACHE`` environment variable) opts in to JAX's
on-disk compilation cache, through the ``compilation_cache`` plugin: a later process
still traces, but loads the compiled executables instead of compiling them.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import threading
import types
import weakref
from typing import Callable, NamedTuple

import jax

from .plugin_manager import disabled_note, first_result

__all__ = [
    "CacheStats",
    "cache_stats",
    "get_program",
    "clear_cache",
    "Program",
    "stable_key",
    "experiment_key",
    "traced_class_key",
    "type_key",
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
    signature traces and compiles once (one miss). ``compiler_options``: XLA options for
    its compiles (the training programs' under ``remat`` on a CPU:
    the precision policy's ``compiler_options()``).
    """

    def __init__(self, kind: str, fn: Callable, donate_argnums=(), meta: dict | None = None,
                 compiler_options: dict | None = None):
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

        self.jitted = jax.jit(traced, donate_argnums=donate_argnums, compiler_options=compiler_options)


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
    * another class by :func:`type_key`: by content when it is defined where it cannot be
      imported from (a notebook cell or script's ``__main__``, a function, ``exec``: a
      model class next to the experiment), else by identity;
    * a ``PyTreeDef`` (a model's or an optimizer state's structure) node by node, its node
      types by :func:`type_key` and its node data by :func:`stable_key`, so a model
      class defined again gives an equal structure;
    * other hashable objects by themselves; anything else by identity (a new
      object then means a new program, never a wrong one).
    """
    if isinstance(obj, type):
        if hasattr(obj, "__jaxnitro_fields__"):
            return class_key(obj)
        return type_key(obj)
    if isinstance(obj, jax.tree_util.PyTreeDef):
        return _treedef_key(obj)
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
    cells = tuple(
        _cell_key(name, c) for name, c in zip(fn.__code__.co_freevars, fn.__closure__ or ()) if _filled(c)
    )
    defaults = tuple(stable_key(d) for d in (fn.__defaults__ or ()))
    kwdefaults = tuple(sorted((k, stable_key(v)) for k, v in (fn.__kwdefaults__ or {}).items()))
    return ("function", fn.__module__, fn.__qualname__, fn.__code__, defaults, kwdefaults, cells,
            _globals_key(fn))


def _cell_key(name: str, cell):
    """A closure cell's key. A method's ``__class__`` cell (``super()``) holding an experiment
    class is keyed by the class's name and fields only (:func:`experiment_key`): the members
    a program can reach are keyed by the program (:func:`traced_class_key`), and keying the
    whole class here would make an edit of a host-only hook recompile it."""
    value = cell.cell_contents
    if name == "__class__" and isinstance(value, type) and hasattr(value, "__jaxnitro_fields__"):
        return ("class cell", experiment_key(value))
    return stable_key(value)


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


def _class_key(cls, skip: frozenset = frozenset()) -> tuple:
    parts = []
    for klass in cls.__mro__[:-1]:
        members = []
        for name, value in vars(klass).items():
            if name.startswith("__") and name.endswith("__") or name in skip:
                continue
            if isinstance(value, (types.MemberDescriptorType, types.GetSetDescriptorType)):
                continue
            members.append((name, _member_key(value)))
        kept = vars(klass).get("__jaxnitro_knob_methods__", {})
        members += [(f"knob method {n}", _member_key(v)) for n, v in kept.items() if n not in skip]
        parts.append((klass.__module__, klass.__qualname__, tuple(sorted(members, key=lambda m: m[0]))))
    return ("experiment class", tuple(parts), _fields_key(cls))


def _fields_key(cls) -> tuple:
    return tuple(
        (name, repr(info.marker), repr(info.inner_type)) for name, info in cls.__jaxnitro_fields__.items()
    )


def experiment_key(cls) -> tuple:
    """An experiment class's module, name and fields (name, marker, type): the first element of
    every program key (:mod:`jaxnitro.programs`); what the programs' code can reach of the
    class is keyed by :func:`traced_class_key`."""
    return ("experiment", cls.__module__, cls.__qualname__, _fields_key(cls))


_traced_keys: "weakref.WeakKeyDictionary[type, dict]" = weakref.WeakKeyDictionary()


def traced_class_key(cls, traced, host_names) -> tuple:
    """What a program traced from the functions ``traced`` can depend on of experiment class
    ``cls``: :func:`class_key` without the members named in ``host_names`` (the hooks and
    run-knob methods the framework calls on the host: ``metrics`` kept on the host,
    ``finalize_metrics``, ``build_data``, ``monitor``, ...) that the traced code does not
    name. So editing such a hook, or re-running a cell with it edited, compiles nothing,
    while any other member (a helper the code may call by a path no scan sees) still counts.

    Names are collected from the code of ``traced``, of the code nested in it, of the
    functions in its closures and of the functions of the same module its globals name,
    attribute names and string constants (``getattr(self, "name")``) alike. Computed once
    per class object and set of skipped names, like :func:`class_key`.
    """
    reached = set()
    for fn in traced:
        _reach(fn, reached, set())
    skip = frozenset(n for n in host_names if n not in reached)
    cached = _traced_keys.setdefault(cls, {})
    key = cached.get(skip)
    if key is None:
        key = _guarded(cls, lambda c: _class_key(c, skip))
        if not isinstance(key, tuple) or key[0] != "cycle":
            cached[skip] = key
    return key


def _reach(fn, names: set, seen: set) -> None:
    """Add to ``names`` every name ``fn``'s code can use (see :func:`traced_class_key`)."""
    if isinstance(fn, (staticmethod, classmethod)):
        fn = fn.__func__
    if isinstance(fn, functools.partial):
        fn = fn.func
    if not inspect.isfunction(fn) or id(fn) in seen:
        return
    seen.add(id(fn))
    names |= _names(fn.__code__) | _strings(fn.__code__)
    for cell in fn.__closure__ or ():
        if _filled(cell):
            _reach(cell.cell_contents, names, seen)
    g = fn.__globals__
    for name in _names(fn.__code__):
        value = g.get(name)
        if inspect.isfunction(value) and value.__globals__ is g:
            _reach(value, names, seen)


def _strings(code) -> set:
    out = {c for c in code.co_consts if isinstance(c, str) and c.isidentifier()}
    for const in code.co_consts:
        if inspect.iscode(const):
            out |= _strings(const)
    return out


_type_keys: "weakref.WeakKeyDictionary[type, object]" = weakref.WeakKeyDictionary()


def type_key(cls: type):
    """A class other than an experiment's: by identity when it is importable (its module,
    imported, names it by its qualified name): a library's class, or one of a module that a
    notebook imports; by content otherwise (``__main__``'s, a function's, one made by
    ``exec``, or one defined again since): its module, name, bases (by this function) and
    members (functions by code, other values by :func:`stable_key`), so an unchanged model
    class defined again in a re-run notebook cell gives an equal key."""
    if _importable(cls):
        return cls
    try:
        key = _type_keys.get(cls)
    except TypeError:  # not weak-referenceable
        return cls
    if key is None:
        key = _guarded(cls, _type_content)
        if not isinstance(key, tuple) or key[0] != "cycle":
            _type_keys[cls] = key
    return key


def _importable(cls: type) -> bool:
    module = cls.__module__
    if module == "__main__" or module not in sys.modules or "<locals>" in cls.__qualname__:
        return False
    obj = sys.modules[module]
    for part in cls.__qualname__.split("."):
        obj = getattr(obj, part, None)
    return obj is cls


_TYPE_SKIP = frozenset({"__dict__", "__weakref__", "__module__", "__qualname__", "__doc__", "_abc_impl",
                        "__abstractmethods__", "__parameters__", "__orig_bases__"})


def _type_content(cls: type) -> tuple:
    members = []
    for name, value in vars(cls).items():
        if name in _TYPE_SKIP or isinstance(value, (types.MemberDescriptorType, types.GetSetDescriptorType)):
            continue
        dunder = name.startswith("__") and name.endswith("__")
        if dunder and not (inspect.isfunction(value) or isinstance(value, (staticmethod, classmethod, property))):
            continue  # bookkeeping (dataclass fields, abstract sets): the structure is in the treedef
        members.append((name, _member_key(value)))
    bases = tuple(stable_key(b) for b in cls.__bases__)
    return ("class", cls.__module__, cls.__qualname__, bases, tuple(sorted(members, key=lambda m: m[0])))


def _treedef_key(treedef) -> tuple:
    """A ``PyTreeDef`` node by node: ``(node type, node data, children)``, ``"*"`` for a leaf."""
    data = treedef.node_data()
    if data is None:
        return "*"
    kind, aux = data
    return (stable_key(kind), _aux_key(aux), tuple(_treedef_key(c) for c in treedef.children()))


def _aux_key(aux):
    if isinstance(aux, (tuple, list)):
        return (type(aux).__name__, tuple(_aux_key(a) for a in aux))
    return stable_key(aux)


def _canonical(key):
    """``key`` with experiment classes and functions replaced by their :func:`stable_key`."""
    if isinstance(key, tuple):
        return tuple(_canonical(k) for k in key)
    if inspect.isfunction(key) or (isinstance(key, type) and hasattr(key, "__jaxnitro_fields__")):
        return stable_key(key)
    return key


def get_program(kind: str, key: tuple, build: Callable[[dict], Callable], donate_argnums=(),
                compiler_options: dict | None = None) -> Program:
    """Return the cached program for ``(kind, key)``, building it with ``build(meta)`` on first request.

    ``meta`` is a dict stored on the program that traced code may fill in
    (names of train metrics, metric modes) for every handle that shares it.

    A request served by an existing program counts one hit. Building only
    wraps the function; the compile (the miss) happens at the first call with
    a new argument signature. Experiment classes and functions in ``key`` are
    compared by content (:func:`stable_key`), so an unchanged class defined
    again reuses its programs. ``compiler_options`` (XLA options for this program's
    compiles, ``jax.jit(compiler_options=...)``) must be decided by what ``key`` holds.
    """
    global _hits
    full = (kind, _canonical(key))
    with _lock:
        program = _programs.get(full)
        if program is not None:
            _hits += 1
            return program
    meta: dict = {}
    program = Program(kind, build(meta), donate_argnums, meta, compiler_options)
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
        _traced_keys.clear()
        _type_keys.clear()
        _hits = 0
        _misses = 0


# -- JAX's persistent (on-disk) compilation cache: switched by a plugin ----------------

CACHE_ENV = "JAXNITRO_COMPILATION_CACHE"
"""Environment variable: a folder; when set, the persistent cache is on there from the moment
the plugins load (the ``compilation_cache`` plugin reads it)."""


def enable_persistent_cache(path: str | os.PathLike | None = None) -> str:
    """Opt in to a persistent compilation cache, so a later process skips XLA compilation.

    Asks the ``jaxnitro_persistent_cache`` hook; the built-in ``compilation_cache`` plugin
    switches JAX's on-disk cache on. ``path`` is the cache folder (created if missing);
    without it, the ``JAXNITRO_COMPILATION_CACHE`` environment variable, else
    ``~/.cache/jaxnitro/xla``. Every compiled program is written there, however small or
    quick to compile (JAX's defaults skip programs that compile in under a second, which is
    most programs on CPU). Returns the folder's absolute path. The ``compilation_cache`` run
    knob and the environment variable (read when the plugins load) do the same.

    The in-process cache (:func:`cache_stats`) is unaffected: a new process still traces
    each program once (a miss), but XLA loads the executable from disk instead of
    compiling it.

    The folder is trusted code: do not share it with users you do not trust.
    """
    folder = first_result("jaxnitro_persistent_cache", path=None if path is None else os.fspath(path))
    if folder is None:
        raise RuntimeError(
            f"jaxnitro: no plugin switches a persistent compilation cache on (hook "
            f"`jaxnitro_persistent_cache`){disabled_note()}. Enable the built-in `compilation_cache` "
            f"plugin, or install one that answers the hook."
        )
    return folder
