"""Plugin discovery and experiment-hook resolution, on pluggy's own machinery.

Extension and lifecycle plugins are entry points in group ``jaxnitro`` (the
built-in ones included, registered in jaxnitro's own pyproject.toml). They are
loaded once per process into one :class:`pluggy.PluginManager` by
``load_setuptools_entrypoints``; ``JAXNITRO_DISABLE_PLUGINS=name,other`` blocks
entry points by name (``set_blocked``); ``check_pending`` then refuses a
hook implementation whose name matches no hookspec (a typo), naming the plugin,
the misspelled hook and the closest real one. Distributions come from
``list_plugin_distinfo``.

Experiment hooks are resolved per handle by :func:`resolve_hooks`: the
experiment's own method wins, then an installed plugin's implementation (in
pluggy's call order), then the built-in default.

Every extension and lifecycle hook is called through pluggy (``pm.hook.<name>``), so
``tryfirst``, ``trylast`` and ``wrapper=True`` work for all of them;
:mod:`jaxnitro.hookcalls` records which plugin answered. The one exception is the
experiment hooks: the core calls the resolved implementation's function itself, because
their batch fields are routed as keyword-only arguments, which pluggy cannot pass (see
DESIGN.md, "pluggy 1.7"); a ``wrapper=True`` implementation of an experiment hook is
therefore never chosen.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import inspect
import os
from dataclasses import dataclass

import pluggy

from . import hookspecs
from .hookcalls import Answer, Manager, call, first_result, forget_answers, latest_answers, process_manager
from .hookspecs import EXPERIMENT_HOOKS, PROJECT

__all__ = [
    "PluginInfo",
    "ResolvedHook",
    "disabled_plugins",
    "first_result",
    "plugin_exports",
    "plugin_manager",
    "plugins_info",
    "resolve_hooks",
    "reload_plugins",
]

DISABLE_ENV = "JAXNITRO_DISABLE_PLUGINS"

_ALL_SPECS = (
    EXPERIMENT_HOOKS
    + hookspecs.EXTENSION_HOOKS
    + hookspecs.LIFECYCLE_HOOKS
)


@dataclass(frozen=True)
class PluginInfo:
    """One loaded plugin: its entry-point name, module, distribution and the hooks it implements."""

    name: str
    module: str
    distribution: str
    version: str
    hooks: tuple[str, ...]
    answered: tuple[str, ...] = ()
    """The extension-hook questions this plugin gave the latest answer to in this process, as
    ``"jaxnitro_make_logger(name='jsonl')"`` (pytest's ``--trace-config`` in spirit)."""


def _disabled_from_env() -> list[str]:
    raw = os.environ.get(DISABLE_ENV, "")
    return [n.strip() for n in raw.split(",") if n.strip()]


def new_manager() -> pluggy.PluginManager:
    """An empty manager that knows every jaxnitro hookspec."""
    pm = Manager(PROJECT)
    pm.add_hookspecs(hookspecs)  # the module-level experiment hooks
    pm.add_hookspecs(hookspecs.ExtensionSpec)
    pm.add_hookspecs(hookspecs.LifecycleSpec)
    return pm


def _failing_entry_point(pm: pluggy.PluginManager):
    """After ``load_setuptools_entrypoints`` raised: the first entry point that fails to load."""
    for ep in importlib.metadata.entry_points(group=PROJECT):
        if pm.get_plugin(ep.name) is not None or pm.is_blocked(ep.name):
            continue
        try:
            ep.load()
        except Exception:  # noqa: BLE001 - this is the one we are looking for
            return ep
    return None


def _check_pending(pm: pluggy.PluginManager) -> None:
    """``pm.check_pending()``, with the misspelled hook and the closest real one named."""
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as err:
        lines = []
        for name, caller in vars(pm.hook).items():
            if not isinstance(caller, pluggy.HookCaller) or caller.spec is not None:
                continue
            for impl in caller.get_hookimpls():
                if impl.optionalhook:
                    continue
                close = difflib.get_close_matches(name, _ALL_SPECS, n=1)
                hint = f"; did you mean `{close[0]}`?" if close else ""
                lines.append(f"plugin `{impl.plugin_name}` implements `{name}`, which is no jaxnitro hook{hint}")
        raise pluggy.PluginValidationError(
            err.plugin,
            "jaxnitro: " + "; ".join(lines or [str(err)]) + ". Rename the implementation to the hook it "
            "means (the hooks are listed in jaxnitro.hookspecs), or mark it "
            "`@hookimpl(optionalhook=True)` if it serves a hook another plugin defines.",
        ) from err


def _load() -> pluggy.PluginManager:
    pm = new_manager()
    for name in _disabled_from_env():
        pm.set_blocked(name)
    try:
        pm.load_setuptools_entrypoints(PROJECT)
    except Exception as err:
        ep = _failing_entry_point(pm)
        what = f"`{ep.name}` ({ep.value})" if ep is not None else "of group `jaxnitro`"
        name = ep.name if ep is not None else "<name>"
        raise ImportError(
            f"jaxnitro: plugin entry point {what} failed to load: {err}. Fix or uninstall the "
            f"package that provides it, or skip it with {DISABLE_ENV}={name}."
        ) from err
    _check_pending(pm)
    return pm


Manager.loader = _load
plugin_manager = process_manager  # the process-wide manager, loaded on first use by _load


def reload_plugins() -> pluggy.PluginManager:
    """Re-read entry points (after installing a plugin or changing ``JAXNITRO_DISABLE_PLUGINS``)."""
    _DIST_NAMES.clear()
    forget_answers()  # and the manager; the exports table (jaxnitro.exports) is rebuilt for the new one
    return plugin_manager()


_DIST_NAMES: dict[int, tuple[str, str]] = {}
"""``id(plugin) -> (project name, version)`` of the plugins loaded from entry points (the
plugin modules live as long as the plugin manager). Reading them parses each package's
metadata (~20 ms for the built-ins), which every ``Nitro`` setup would otherwise pay
again. Cleared by :func:`reload_plugins`."""


def _distributions(pm: pluggy.PluginManager) -> dict[int, tuple[str, str]]:
    """``id(plugin) -> (project name, version)`` of the plugins loaded from entry points."""
    out = {}
    for plugin, dist in pm.list_plugin_distinfo():
        if id(plugin) not in _DIST_NAMES:
            _DIST_NAMES[id(plugin)] = (dist.project_name, dist.version)
        out[id(plugin)] = _DIST_NAMES[id(plugin)]
    return out


def plugins_info() -> list[PluginInfo]:
    """The loaded plugins with their module, distribution and the hooks they implement."""
    pm = plugin_manager()
    dists = _distributions(pm)
    answered: dict[str, list[str]] = {}
    for answer in latest_answers():
        answered.setdefault(answer.plugin, []).append(f"{answer.hook}({answer.question})")
    out = []
    for name, plugin in pm.list_name_plugin():
        if plugin is None:  # blocked
            continue
        dist, version = dists.get(id(plugin), ("?", "?"))
        hooks = tuple(sorted(h.name for h in pm.get_hookcallers(plugin) or ()))
        out.append(PluginInfo(name, getattr(plugin, "__name__", repr(plugin)), dist, version, hooks,
                              tuple(answered.get(name, ()))))
    return out


def answer_source(answer: Answer) -> str:
    """``plugin <name> (<distribution> <version>)`` for an :class:`~jaxnitro.hookcalls.Answer`
    (as :class:`ResolvedHook` names a plugin's experiment hook); ``plugin <name>`` for a plugin
    registered by hand (no distribution)."""
    dist, version = _distributions(plugin_manager()).get(id(answer.plugin_object), ("?", "?"))
    return f"plugin {answer.plugin} ({dist} {version})" if dist != "?" else f"plugin {answer.plugin}"


def disabled_plugins() -> list[str]:
    """The entry-point names blocked in this process (``JAXNITRO_DISABLE_PLUGINS``)."""
    return [name for name, plugin in plugin_manager().list_name_plugin() if plugin is None]


def disabled_note() -> str:
    """`` (disabled: a, b)`` for error messages, or an empty string."""
    off = disabled_plugins()
    return f" (plugins disabled by {DISABLE_ENV}: {', '.join(off)})" if off else ""


def policy_answer(hook_name: str, protocol: type, plugin: str, defaults: tuple, instead: str, **kwargs):
    """A knob policy from extension hook ``hook_name`` (``jaxnitro_precision_policy``,
    ``jaxnitro_sharding_policy``), asked with ``kwargs`` (the resolved knobs): the first
    answer, which must be a ``protocol`` (``TypeError`` naming the hook and the Protocol
    otherwise). With no answer, None when every ``(knob, at_default)`` of ``defaults`` is at
    its default, else a ``ValueError`` naming that knob, the built-in ``plugin`` that answers
    the hook, the disabled plugins and the fix (``instead``: how to do without it)."""
    policy = first_result(hook_name, **kwargs)
    if policy is not None:
        if not isinstance(policy, protocol):
            raise TypeError(f"jaxnitro: `{hook_name}` answered {policy!r}, which is not a "
                            f"jaxnitro.plugin.{protocol.__name__} (its members: see that Protocol).")
        return policy
    for knob, at_default in defaults:
        if not at_default:
            raise ValueError(
                f"jaxnitro: run knob `{knob.name}` = {knob.value!r} ({knob.source}) needs the built-in "
                f"plugin `{plugin}` (entry point `{plugin}` in group `jaxnitro`, module "
                f"jaxnitro.plugins.{plugin}), and it is not loaded{disabled_note()}. Fix: re-enable it "
                f"(drop `{plugin}` from JAXNITRO_DISABLE_PLUGINS), install a plugin implementing "
                f"`{hook_name}`, or {instead}."
            )
    return None


def plugin_exports() -> list[tuple[str, dict]]:
    """``[(plugin name, {public name: object})]`` from every plugin's ``jaxnitro_exports``,
    called through pluggy (in its call order; each answer noted with its plugin's name, so
    that two plugins exporting one name can be named)."""
    _, frame = call(plugin_manager(), "jaxnitro_exports", {})
    return [(impl.plugin_name, dict(names)) for impl, names in frame.results if names]


# -- experiment hooks -------------------------------------------------------------------


@dataclass(frozen=True)
class ResolvedHook:
    """The implementation chosen for one experiment hook.

    ``function`` is called as ``function(experiment, *args, **routed_fields)``:
    every implementation receives the experiment (or its compile view) as
    ``self``. ``source`` says where it came from: ``"experiment"``,
    ``"plugin <name> (<distribution> <version>)"``, or ``"default"``.
    """

    name: str
    function: object
    source: str


def _unbound(fn):
    return getattr(fn, "__func__", fn)


def _spec_positionals(hook: str) -> tuple[str, ...]:
    spec = getattr(hookspecs, hook)
    params = inspect.signature(spec).parameters
    return tuple(p for p in params if p not in ("self", "batch"))


def _positional_names(function) -> tuple[str, ...]:
    return tuple(
        p.name
        for p in inspect.signature(function).parameters.values()
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    )


def takes_positionals(function, hook: str) -> int:
    """How many of ``hook``'s positional arguments (after ``self``) to pass ``function``: all
    of them, or fewer when it leaves out trailing optional ones
    (:data:`jaxnitro.hookspecs.OPTIONAL_POSITIONALS`: ``param_group(self, keypath)`` gets no
    ``leaf``). A ``*args`` parameter takes all."""
    expected = _spec_positionals(hook)
    params = inspect.signature(function).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return len(expected)
    return min(len(expected), max(len(_positional_names(function)) - 1, 0))


def _check_positionals(cls_name: str, hook: str, function) -> None:
    """An experiment's own hook method: the count of positional parameters must match the spec
    (trailing optional ones, :data:`~jaxnitro.hookspecs.OPTIONAL_POSITIONALS`, may be left out)."""
    expected = _spec_positionals(hook)
    optional = hookspecs.OPTIONAL_POSITIONALS.get(hook, ())
    positional = _positional_names(function)
    if not len(expected) - len(optional) + 1 <= len(positional) <= len(expected) + 1:
        batch = "batch" in inspect.signature(getattr(hookspecs, hook)).parameters
        shown = "".join(f"[, {a}]" if a in optional else f", {a}" for a in expected)
        raise TypeError(
            f"jaxnitro: hook `{hook}` of {cls_name} takes positional parameters {positional}, but "
            f"the contract is `{hook}(self{shown}"
            f"{', *, <batch fields>' if batch else ''})`: the experiment first (`self`), then "
            f"{len(expected)} positional parameter(s){' (the bracketed one optional)' if optional else ''}. "
            f"Batch fields are keyword-only parameters (after `*`)."
        )


def _own_method(e, hook: str):
    attr = inspect.getattr_static(type(e), hook, None)
    if attr is None:
        return None
    function = getattr(type(e), hook)
    return _unbound(function) if inspect.isroutine(function) else None


def resolve_hooks(e, defaults) -> dict[str, ResolvedHook]:
    """Resolve every experiment hook once: experiment > installed plugins > ``defaults``.

    Returns ``{hook name: ResolvedHook}`` for the hooks that have any
    implementation. Raises ``TypeError`` for an experiment method whose
    positional parameters do not fit the hook's contract.
    """
    pm = plugin_manager()
    dists = _distributions(pm)
    cls_name = type(e).__name__
    resolved: dict[str, ResolvedHook] = {}
    for hook in EXPERIMENT_HOOKS:
        own = _own_method(e, hook)
        if own is not None:
            _check_positionals(cls_name, hook, own)
            resolved[hook] = ResolvedHook(hook, own, "experiment")
            continue
        impls = [i for i in getattr(pm.hook, hook).get_hookimpls() if not (i.wrapper or i.hookwrapper)]
        if impls:
            chosen = impls[-1]  # the one pluggy would call first
            dist, version = dists.get(id(chosen.plugin), ("?", "?"))
            source = f"plugin {chosen.plugin_name} ({dist} {version})"
            resolved[hook] = ResolvedHook(hook, chosen.function, source)
        elif hasattr(defaults, hook):
            resolved[hook] = ResolvedHook(hook, _unbound(getattr(defaults, hook)), "default")
    return resolved
