"""Public names that plugins add to the ``jaxnitro`` namespace (``jn.EarlyStopping``).

The core never imports a plugin module, so a name a feature plugin defines
reaches ``jaxnitro`` through the ``jaxnitro_exports`` hook, looked up on first
attribute access (``jaxnitro.__getattr__``). A disabled plugin's names are
then simply absent, and the error says which plugins are disabled.
"""

from __future__ import annotations

from .plugin_manager import disabled_note, plugin_exports, plugin_manager

__all__ = ["lookup", "names", "forget"]

_table: tuple[object, dict[str, object]] | None = None
"""``(plugin manager, {name: object})``: built once per plugin manager, so that
``reload_plugins`` (a new manager) gets a new table without telling this module."""


def forget() -> None:
    """Drop the cached table (it is also rebuilt for each new plugin manager)."""
    global _table
    _table = None


def _build(reserved: set[str]) -> dict[str, object]:
    table: dict[str, object] = {}
    owner: dict[str, str] = {}
    for plugin, names in plugin_exports():
        for name, obj in names.items():
            if name in reserved:
                raise ImportError(
                    f"jaxnitro: plugin `{plugin}` exports `{name}`, a name the core defines; a plugin "
                    f"cannot replace it. Rename the export."
                )
            if name in table and table[name] is not obj:
                raise ImportError(
                    f"jaxnitro: plugins `{owner[name]}` and `{plugin}` both export `jaxnitro.{name}`; "
                    f"uninstall one, or disable it with JAXNITRO_DISABLE_PLUGINS."
                )
            table[name], owner[name] = obj, plugin
    return table


def names(reserved: set[str]) -> dict[str, object]:
    """``{name: object}`` exported by the loaded plugins (built once per plugin load)."""
    global _table
    pm = plugin_manager()
    if _table is None or _table[0] is not pm:
        _table = (pm, _build(reserved))
    return _table[1]


def lookup(name: str, reserved: set[str]):
    """The object plugins export as ``jaxnitro.<name>``; ``AttributeError`` if none does."""
    table = names(reserved)
    if name in table:
        return table[name]
    raise AttributeError(
        f"module 'jaxnitro' has no attribute {name!r}: neither the core nor a loaded plugin "
        f"exports it{disabled_note()}."
    )
