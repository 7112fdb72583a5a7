"""Calls into plugins, all through pluggy, with a record of which plugin answered.

Lifecycle events: :func:`emit` (one hook, every plugin) and :func:`emit_finish` (every plugin,
even if one fails), on the process's manager (:func:`process_manager`).
Every hook call goes through ``pm.hook.<name>(...)``, so pluggy's ``tryfirst``,
``trylast``, ``wrapper=True`` and ``hookwrapper=True`` work for every hook. What pluggy
does not say is *who* answered a ``firstresult`` hook, nor which plugin returned each
item of a collected hook, nor does it go on to the next implementation when one
raises. The :class:`Manager` adds those without calling implementations itself: when
a plugin is registered, each of its (non-wrapper) implementations of an *observed*
hook (:func:`observed_hook`: every ``firstresult`` extension hook, ``jaxnitro_exports`` and
``jaxnitro_run_finish``) is wrapped so that, inside a :func:`call`, it notes its result
(and, for a call made with ``guard=True``, catches its exception and notes that
instead, so pluggy goes on to the next plugin). Outside a :func:`call` the wrapped
function behaves exactly as the plugin's own.

:func:`first_result` records each answer to a ``firstresult`` hook as an
:class:`Answer`: process-wide (the latest per question, :func:`latest_answers`, shown by
``jn.plugins_info()``) and for the handle being set up or run (:func:`recording`,
:func:`answers_for`, shown by ``print(nitro)``; :func:`knob_owner` reads which plugin
accepted a run knob).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pluggy
import structlog

if TYPE_CHECKING:
    from .events import RunContext

__all__ = [
    "Answer",
    "Manager",
    "OBSERVED",
    "answers_for",
    "call",
    "emit",
    "emit_finish",
    "first_result",
    "forget_answers",
    "knob_owner",
    "latest_answers",
    "observed_hook",
    "process_manager",
    "recording",
]

log = structlog.get_logger("jaxnitro")

QUESTION_ARGS = {
    "jaxnitro_make_logger": "name",
    "jaxnitro_adapt_source": "split",
    "jaxnitro_make_progress_reporter": "name",
    "jaxnitro_accept_knob": "name",
    "jaxnitro_render_history": "format",
    "jaxnitro_describe": "format",
    "jaxnitro_load_weights": "purpose",
    "jaxnitro_make_prefetcher": "split",
}
"""The argument that tells one question of a ``firstresult`` hook from another (the logger's
name, the knob's name, ...); a hook not listed asks one question."""

OBSERVED = frozenset({
    "jaxnitro_make_logger", "jaxnitro_default_logger", "jaxnitro_adapt_source",
    "jaxnitro_make_progress_reporter", "jaxnitro_accept_knob", "jaxnitro_render_history",
    "jaxnitro_describe", "jaxnitro_plot", "jaxnitro_load_weights", "jaxnitro_exports",
    "jaxnitro_run_ending", "jaxnitro_run_finish",
    "jaxnitro_export",
    "jaxnitro_new_run_folder", "jaxnitro_persistent_cache",
    "jaxnitro_hold_run_folder",
    "jaxnitro_preflight",
})
"""The hooks whose implementations note their results (and, in a guarded call, their errors),
besides every ``firstresult`` extension hook (:func:`observed_hook`), listed or not."""


def observed_hook(caller) -> bool:
    """Whether the implementations of hook ``caller`` (a pluggy ``HookCaller``) note their
    results: one in :data:`OBSERVED`, or any ``firstresult`` extension hook (a ``jaxnitro_``
    name), so that a hook added to the specs is recorded without being listed here."""
    if caller.name in OBSERVED:
        return True
    spec = caller.spec
    return caller.name.startswith("jaxnitro_") and spec is not None and bool(spec.opts.get("firstresult"))


@dataclass(frozen=True)
class Answer:
    """Which plugin answered one question of a ``firstresult`` hook.

    ``hook``: the hook's name; ``question``: what was asked (``"name='jsonl'"``, or ``""``
    for a hook that asks one thing); ``plugin``: the answering plugin's registered name
    (its entry-point name); ``module``: its module (or type) name; ``wrapped_by``: the
    names of ``wrapper=True`` plugins that replaced the answer, if any; ``plugin_object``:
    the plugin itself (a module, or the registered object)."""

    hook: str
    question: str
    plugin: str
    module: str
    wrapped_by: tuple[str, ...] = ()
    plugin_object: Any = field(default=None, repr=False, compare=False)

    def line(self) -> str:
        """``jaxnitro_make_logger(name='jsonl') -> jsonl`` as the reports show it."""
        asked = f"{self.hook}({self.question})"
        wrapped = f" (replaced by wrapper {', '.join(self.wrapped_by)})" if self.wrapped_by else ""
        return f"{asked} -> {self.plugin}{wrapped}"


class _Frame:
    """One :func:`call` in progress: the results and errors its implementations noted."""

    __slots__ = ("hook", "guard", "results", "errors")

    def __init__(self, hook: str, guard: bool):
        self.hook, self.guard = hook, guard
        self.results: list[tuple[Any, Any]] = []  # (HookImpl, result), in call order
        self.errors: list[tuple[str, Exception]] = []  # (plugin name, exception), in call order


_local = threading.local()


def _frames() -> list[_Frame]:
    frames = getattr(_local, "frames", None)
    if frames is None:
        frames = _local.frames = []
    return frames


def _observed(impl, hook: str):
    """``impl.function`` noting its result (or, in a guarded call, its exception) in the
    innermost :func:`call` of ``hook`` on this thread; unchanged behaviour elsewhere."""
    function = impl.function

    @functools.wraps(function)
    def observed(*args, **kwargs):
        frames = _frames()
        frame = frames[-1] if frames and frames[-1].hook == hook else None
        if frame is None:
            return function(*args, **kwargs)
        if frame.guard:
            try:
                result = function(*args, **kwargs)
            except Exception as err:  # noqa: BLE001 - a guarded call goes on to the next plugin
                frame.errors.append((impl.plugin_name, err))
                return None
        else:
            result = function(*args, **kwargs)
        if result is not None:
            frame.results.append((impl, result))
        return result

    return observed


class Manager(pluggy.PluginManager):
    """pluggy's manager; registering a plugin wraps its implementations of the observed hooks."""

    loader = None  # () -> Manager: the discovery (jaxnitro.plugin_manager._load)
    process = None  # the process-wide manager (process_manager)

    def register(self, plugin, name: str | None = None) -> str | None:
        registered = super().register(plugin, name)
        if registered is None:
            return None
        for caller in self.get_hookcallers(plugin) or ():
            if not observed_hook(caller):
                continue
            for impl in caller.get_hookimpls():
                if impl.plugin is plugin and not (impl.wrapper or impl.hookwrapper):
                    impl.function = _observed(impl, caller.name)  # HookImpl's slot; pluggy reads it per call
        return registered


def call(pm: pluggy.PluginManager, hook: str, kwargs: dict, *, guard: bool = False) -> tuple[Any, _Frame]:
    """``pm.hook.<hook>(**kwargs)`` and what its implementations noted.

    With ``guard=True`` an implementation that raises ``Exception`` is noted in
    ``frame.errors`` and pluggy goes on to the next one (wrappers see the call end
    normally); :data:`OBSERVED` hooks only. A wrapper that raises is noted too (named by the
    wrappers of the hook); what it wraps then ran only if it raised after its ``yield``."""
    frame = _Frame(hook, guard)
    frames = _frames()
    frames.append(frame)
    caller = getattr(pm.hook, hook)
    try:
        result = caller(**kwargs)
    except Exception as err:  # a wrapper raised (implementations are guarded themselves)
        if not guard:
            raise
        wrappers = [i.plugin_name for i in caller.get_hookimpls() if i.wrapper or i.hookwrapper]
        frame.errors.append((" or ".join(wrappers) or "?", err))
        result = None
    finally:
        frames.remove(frame)
    return result, frame


def process_manager() -> Manager:
    """The process-wide manager of entry-point plugins, made on first use by ``Manager.loader``
    (the discovery, which :mod:`jaxnitro.plugin_manager` sets there when imported)."""
    if Manager.process is None:
        Manager.process = Manager.loader()
    return Manager.process


def emit(hook: str, **kwargs) -> None:
    """Call lifecycle hook ``hook`` on every plugin (pluggy's order); exceptions propagate."""
    getattr(process_manager().hook, hook)(**kwargs)


def emit_finish(run: RunContext, status: str) -> None:
    """``jaxnitro_run_ending``, then ``jaxnitro_run_finish``, on every plugin, through pluggy,
    each implementation called even if another raised.

    Guarded calls (:func:`call`; wrappers, ``tryfirst``/``trylast`` as for any hook): an
    implementation that raises is noted and skipped, and the next one runs.

    ``jaxnitro_run_ending`` is where a plugin's last work that can fail is done (the
    checkpointer's final saves). With status ``"done"`` an error there fails the run:
    ``jaxnitro_run_finish`` then gets status ``"failed"`` (so the loggers' finish line says
    so) and ``run.error`` is that error. The first error of either call is raised after all
    were called when the run was ``"done"``; with any other status the run already has its
    own outcome (or exception), so errors are reported as warnings and never hide it.
    """
    pm = process_manager()
    _, ending = call(pm, "jaxnitro_run_ending", {"run": run, "status": status}, guard=True)
    errors = list(ending.errors)
    final = status
    if status == "done" and errors:
        final, run.error = "failed", errors[0][1]
    _, finish = call(pm, "jaxnitro_run_finish", {"run": run, "status": final}, guard=True)
    errors += finish.errors
    for i, (name, err) in enumerate(errors):
        if status == "done" and i == 0:
            continue  # raised below, once every other error is reported
        log.warning("plugin failed to finish the run", plugin=name, status=final, error=repr(err))
        warnings.warn(f"jaxnitro: plugin `{name}` failed to finish the run ({final}): {err!r}", RuntimeWarning)
    if status == "done" and errors:
        raise errors[0][1]


# -- who answered ----------------------------------------------------------------------

_latest: dict[tuple[str, str], Answer] = {}
_by_handle: "weakref.WeakKeyDictionary[Any, dict[tuple[str, str], Answer]]" = weakref.WeakKeyDictionary()
_recording: contextvars.ContextVar[dict | None] = contextvars.ContextVar("jaxnitro_answers", default=None)


def _question(hook: str, kwargs: dict) -> str:
    arg = QUESTION_ARGS.get(hook)
    return "" if arg is None else f"{arg}={kwargs.get(arg)!r}"


def _module_of(plugin) -> str:
    return getattr(plugin, "__name__", None) or type(plugin).__module__ + "." + type(plugin).__qualname__


def first_result(hook_name: str, **kwargs):
    """Call extension hook ``hook_name`` (a ``firstresult`` hook) through pluggy on the process's
    manager; record who answered; return the answer, or None."""
    pm = process_manager()
    result, frame = call(pm, hook_name, kwargs)
    if result is None:
        return None
    impl = frame.results[0][0] if frame.results else None
    wrapped = () if impl is not None and frame.results[0][1] is result else tuple(
        i.plugin_name for i in getattr(pm.hook, hook_name).get_hookimpls() if i.wrapper or i.hookwrapper
    )
    plugin = impl.plugin if impl is not None else None
    answer = Answer(
        hook_name, _question(hook_name, kwargs),
        impl.plugin_name if impl is not None else (wrapped[0] if wrapped else "?"),
        _module_of(plugin) if plugin is not None else "?", wrapped, plugin,
    )
    _latest[(answer.hook, answer.question)] = answer
    current = _recording.get()
    if current is not None:
        current[(answer.hook, answer.question)] = answer
    return result


@contextlib.contextmanager
def recording(handle):
    """Record the answers given inside the block as ``handle``'s (its setup, its run)."""
    answers = _by_handle.setdefault(handle, {})
    token = _recording.set(answers)
    try:
        yield answers
    finally:
        _recording.reset(token)


def answers_for(handle) -> list[Answer]:
    """The answers recorded for ``handle`` (its setup and runs), in the order first asked."""
    return list(_by_handle.get(handle, {}).values())


def latest_answers() -> list[Answer]:
    """The latest answer to each question asked in this process."""
    return list(_latest.values())


def forget_answers() -> None:
    """Drop the process-wide manager and record: the plugins are reloaded on next use."""
    Manager.process = None
    _latest.clear()


def knob_owner(where, knob: str):
    """The plugin (module or object) whose ``jaxnitro_accept_knob`` took run knob ``knob`` for
    the handle ``where`` (a handle, or a run: ``run.nitro``), or None."""
    handle = getattr(where, "nitro", where)
    answer = _by_handle.get(handle, {}).get(("jaxnitro_accept_knob", f"name={knob!r}"))
    return None if answer is None else answer.plugin_object
