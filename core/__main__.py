"""``python -m jaxnitro``: the ``jaxnitro`` command line.

The command line is a plugin (entry point ``cli`` in group ``jaxnitro``); this module
finds it through its entry point (``importlib.metadata``) rather than importing a
plugin folder, so an installed package can replace it by registering its own ``cli``
entry point, and the core stays free of plugin imports.
"""

from __future__ import annotations

import sys
from importlib.metadata import entry_points

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run the command line plugin's ``main(argv)``; its exit status (2, with a message, when
    no ``cli`` entry point is installed or ``JAXNITRO_DISABLE_PLUGINS`` names it)."""
    from .plugin_manager import DISABLE_ENV, _disabled_from_env

    if "cli" in _disabled_from_env():
        print(f"jaxnitro: the command line plugin `cli` is disabled by {DISABLE_ENV}; remove it from "
              f"that list to use the command line.", file=sys.stderr)
        return 2
    found = sorted(entry_points(group="jaxnitro", name="cli"), key=lambda ep: ep.value.startswith("jaxnitro."))
    if not found:
        print(
            "jaxnitro: no command line is installed (entry point `cli` in group `jaxnitro`); "
            "reinstall jaxnitro (`pip install jaxnitro`), which provides it.",
            file=sys.stderr,
        )
        return 2
    return found[0].load().main(argv)


if __name__ == "__main__":
    sys.exit(main())
