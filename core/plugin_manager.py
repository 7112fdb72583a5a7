"""Plugin discovery and hook resolution.

Extension plugins are found through entry points in group ``jaxnitro`` (the
built-in ones included, registered in jaxnitro's own pyproject.toml) and loaded
once per process into a global :class:`pluggy.PluginManager`. Set
``JAXNITRO_DISABLE_PLUGINS=name,other`` to skip entry points by name.

Experiment hooks are resolved per handle by :func:`resolve_hooks`: the
experiment's own method wins, then an installed plugin's implementation, then
the built-in default.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import os
from dataclasses import dataclass

import pluggy

from . import hookspecs
from .hookspecs import EXPERIMENT_HOOKS, PROJECT

__all__ = [
    "ExperimentPluginManager",
    "PluginInfo",
    "plugin_manager",
    "plugins_info",
    "resolve_hooks",
    "reload_plugins",
]

_EXTENSION_HOOKS = tuple(n for n in vars(hookspecs.ExtensionSpec) if not n.startswith("_"))


class ExperimentPluginManager(pluggy.PluginManager):
    """A PluginManager that accepts undecorated methods named like a hookspec.

    An experiment class implements ``loss``, ``forward`` ... as plain methods;
    this manager treats every routine whose name is a known hook as an
    implementation, so no decorator is needed.
    """

    def parse_hookimpl_opts(self, plugin, name):
        opts = super().parse_hookimpl_opts(plugin, name)
        if opts is None and (name in EXPERIMENT_HOOKS or name in _EXTENSION_HOOKS):
            try:
                method = getattr(plugin, name)
            except Exception:
                return None
            if inspect.isroutine(method):
                return {}
        return opts

    def _verify_hook(self, hook, hookimpl):
        """Experiment hooks may name their positional parameters freely; the count must match.

        ``def loss(self, logits, *, label)`` implements ``loss(outputs, batch)``:
        the core passes positionals by position and batch fields by keyword.
        Every implementation is called with the experiment first (see
        :func:`resolve_hooks`), so the count is taken on the unbound function:
        a method's ``self``, or the first parameter of a plugin module's function,
        receives the experiment.
        """
        if hook.name not in EXPERIMENT_HOOKS or hook.spec is None:
            return super()._verify_hook(hook, hookimpl)
        expected = tuple(a for a in hook.spec.argnames if a != "batch")
        function = _unbound(hookimpl.function)
        positional = tuple(
            p.name
            for p in inspect.signature(function).parameters.values()
            if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        )
        if len(positional) != len(expected) + 1:
            raise TypeError(
                f"jaxnitro: hook `{hook.name}` of {hookimpl.plugin_name} takes positional "
                f"parameters {positional}, but the contract is "
                f"`{hook.name}(self{''.join(', ' + a for a in expected)}"
                f"{', *, <batch fields>' if 'batch' in hook.spec.argnames else ''})`: the experiment "
                f"first (`self`, also for a plugin module's function), then {len(expected)} "
                f"positional parameter(s). Batch fields are keyword-only parameters (after `*`)."
            )


@dataclass(frozen=True)
class PluginInfo:
    """One loaded plugin: its entry-point name, module and distribution."""

    name: str
    module: str
    distribution: str
    version: str
    hooks: tuple[str, ...]


_GLOBAL: ExperimentPluginManager | None = None
_INFO: list[PluginInfo] = []


def _disabled() -> set[str]:
    raw = os.environ.get("JAXNITRO_DISABLE_PLUGINS", "")
    return {n.strip() for n in raw.split(",") if n.strip()}


def _load() -> ExperimentPluginManager:
    pm = ExperimentPluginManager(PROJECT)
    pm.add_hookspecs(hookspecs.ExperimentSpec)
    pm.add_hookspecs(hookspecs.ExtensionSpec)
    disabled = _disabled()
    _INFO.clear()
    seen: set[str] = set()
    for ep in importlib.metadata.entry_points(group=PROJECT):
        if ep.name in disabled or ep.name in seen:
            continue
        seen.add(ep.name)
        try:
            plugin = ep.load()
        except Exception as err:
            raise ImportError(
                f"jaxnitro: plugin entry point `{ep.name}` ({ep.value}) failed to import: {err}. "
                f"Fix or uninstall the package that provides it, or skip it with "
                f"JAXNITRO_DISABLE_PLUGINS={ep.name}."
            ) from err
        pm.register(plugin, name=ep.name)
        dist = getattr(ep, "dist", None)
        hooks = tuple(
            sorted(h.name for h in pm.get_hookcallers(plugin) or ())
        )
        _INFO.append(
            PluginInfo(
                ep.name,
                getattr(plugin, "__name__", ep.value),
                dist.metadata["Name"] if dist is not None else "?",
                dist.version if dist is not None else "?",
                hooks,
            )
        )
    return pm


def plugin_manager() -> ExperimentPluginManager:
    """The process-wide manager of extension plugins, loaded on first use."""
    global _GLOBAL
    if _GLOBAL is None:
        _GLOBAL = _load()
    return _GLOBAL


def reload_plugins() -> ExperimentPluginManager:
    """Re-read entry points (after installing a plugin or changing ``JAXNITRO_DISABLE_PLUGINS``)."""
    global _GLOBAL
    _GLOBAL = None
    return plugin_manager()


def plugins_info() -> list[PluginInfo]:
    """List the loaded extension plugins with their module, distribution and hooks."""
    plugin_manager()
    return list(_INFO)


def first_result(hook_name: str, **kwargs):
    """Call extension hook ``hook_name`` (a firstresult hook) and return its answer or None."""
    return getattr(plugin_manager().hook, hook_name)(**kwargs)


@dataclass(frozen=True)
class ResolvedHook:
    """The implementation chosen for one experiment hook.

    ``function`` is called as ``function(experiment, *args, **routed_fields)``:
    every implementation receives the experiment (or its compile view) as
    ``self``. ``source`` says where it came from: ``"experiment"``, a plugin
    name, or ``"default"``.
    """

    name: str
    function: object
    source: str


def _unbound(fn):
    return getattr(fn, "__func__", fn)


def resolve_hooks(e, defaults) -> dict[str, ResolvedHook]:
    """Resolve every experiment hook once: experiment > installed plugins > ``defaults``.

    Returns ``{hook name: ResolvedHook}`` for the hooks that have any
    implementation.
    """
    pm = ExperimentPluginManager(PROJECT)
    pm.add_hookspecs(hookspecs.ExperimentSpec)
    pm.register(defaults, name="jaxnitro-defaults")
    for name, plugin in plugin_manager().list_name_plugin():
        if plugin is not None:
            pm.register(plugin, name=name)
    pm.register(e, name=f"experiment:{type(e).__name__}")
    resolved: dict[str, ResolvedHook] = {}
    for hook in EXPERIMENT_HOOKS:
        impls = getattr(pm.hook, hook).get_hookimpls()
        if not impls:
            continue
        by_plugin = {id(i.plugin): i for i in impls}
        if id(e) in by_plugin:
            chosen, source = by_plugin[id(e)], "experiment"
        else:
            others = [i for i in impls if i.plugin is not defaults]
            chosen = others[-1] if others else by_plugin[id(defaults)]
            source = chosen.plugin_name if others else "default"
        if chosen.plugin is e:
            function = getattr(type(e), hook)
        else:
            function = _unbound(chosen.function)
        resolved[hook] = ResolvedHook(hook, function, source)
    return resolved
