"""Public names that plugins add to the ``jaxnitro`` namespace (``jn.EarlyStopping``).

The core never imports a plugin module, so a name a feature plugin defines
reaches ``jaxnitro`` through the ``jaxnitro_exports`` hook, looked up on first
attribute access (``jaxnitro.__getattr__``). A disabled plugin's names are
then simply absent, and the error says which plugins are disabled.
"""

from __future__ import annotations

__all__ = ["lookup", "names", "forget"]

_table: dict[str, object] | None = None


def forget() -> None:
    """Drop the cached table (after ``reload_plugins``)."""
    global _table
    _table = None


def _build(reserved: set[str]) -> dict[str, object]:
    from .plugin_manager import plugin_exports

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
    if _table is None:
        _table = _build(reserved)
    return _table


def lookup(name: str, reserved: set[str]):
    """The object plugins export as ``jaxnitro.<name>``; ``AttributeError`` if none does."""
    table = names(reserved)
    if name in table:
        return table[name]
    from .plugin_manager import disabled_note

    raise AttributeError(
        f"module 'jaxnitro' has no attribute {name!r}: neither the core nor a loaded plugin "
        f"exports it{disabled_note()}."
    )
