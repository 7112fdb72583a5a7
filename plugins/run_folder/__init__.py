"""Run-folder naming: ``<run_dir>/<YYYYmmdd-HHMMSS>-<n>`` (entry point ``run_folder``).

Answers ``jaxnitro_new_run_folder`` (``trylast``: an installed plugin naming folders its own
way wins). The folder is named by the local time the run starts, to the second, and a
counter from 1; a name already taken (two runs in one second, two processes at once) moves
to the next counter, because ``os.mkdir`` fails on an existing folder, so no folder is ever
reused. The checkpointer's ``("latest", ...)`` and ``resume="auto"`` sort run folders by this
name.

The package also holds :mod:`jaxnitro.plugins.run_folder.lock`, the lock a run holds on its
folder (entry point ``run_lock``, answering ``jaxnitro_hold_run_folder``): a plugin of its own,
which this module does not import, so that naming and locking are disabled apart.
"""

from __future__ import annotations

import datetime
import os

from jaxnitro.plugin import hookimpl

__all__ = ["new_folder"]


def new_folder(root: str) -> str:
    """Create ``root`` if missing and a fresh ``root/<timestamp>-<n>`` folder in it; return its path."""
    os.makedirs(root, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    n = 1
    while True:
        path = os.path.join(root, f"{stamp}-{n}")
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            n += 1


@hookimpl(trylast=True)
def jaxnitro_new_run_folder(root, experiment):
    return new_folder(root)
