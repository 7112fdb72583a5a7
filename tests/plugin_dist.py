"""Test helpers: a plugin distribution written as ``pip install`` leaves one, put on ``sys.path``.

``write_distribution`` writes a module plus its ``*.dist-info`` (METADATA and an
``entry_points.txt`` in group ``jaxnitro``); ``installed`` puts a folder first on
``sys.path`` and reloads the plugins, and undoes both (dropping the module) on the way out.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from pathlib import Path

import jaxnitro as jn


def write_distribution(site: Path, *, module: str, source: str, dist: str, entry: str, version: str = "0.1") -> Path:
    """Write ``module``.py and ``<dist>-<version>.dist-info`` registering ``entry = module``."""
    site.mkdir(parents=True, exist_ok=True)
    (site / f"{module}.py").write_text(source)
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[jaxnitro]\n{entry} = {module}\n")
    (info / "top_level.txt").write_text(module + "\n")
    return site


@contextlib.contextmanager
def installed(site: Path, module: str):
    """``site`` first on ``sys.path`` and the plugins reloaded; on the way out ``site``
    leaves ``sys.path``, ``module`` (and its submodules) leave ``sys.modules``, and the
    plugins are reloaded again."""
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    try:
        jn.reload_plugins()
        yield
    finally:
        while str(site) in sys.path:
            sys.path.remove(str(site))
        for name in [m for m in sys.modules if m == module or m.startswith(module + ".")]:
            del sys.modules[name]
        importlib.invalidate_caches()
        jn.reload_plugins()


@contextlib.contextmanager
def installed_plugin(site: Path, *, module: str, source: str, dist: str, entry: str, version: str = "0.1"):
    """A third-party plugin ``module`` written as an installed distribution under ``site``,
    found through its entry point, imported and yielded; uninstalled on the way out."""
    write_distribution(site, module=module, source=source, dist=dist, entry=entry, version=version)
    with installed(site, module):
        yield importlib.import_module(module)


def trains_the_same_without(plugin: str, disabled, run_dir, check=lambda without, with_plugin: None):
    """Train ``Tiny`` for one epoch, then again with ``plugin`` disabled (``disabled``: the
    conftest fixture); ``check(without, with_plugin)`` sees the second handle (and the first)
    before the second trains. Asserts both
    runs' params bitwise equal (the same programs) and returns the second handle."""
    import jax
    import numpy as np

    from tiny import Tiny, tiny_data

    with_plugin = jn.Nitro(Tiny(max_epochs=1), data=tiny_data(), run_dir=run_dir, logger=None).train()
    disabled(plugin)
    without = jn.Nitro(Tiny(max_epochs=1), data=tiny_data(), run_dir=run_dir, logger=None)
    check(without, with_plugin)
    without.train()
    for a, b in zip(jax.tree_util.tree_leaves(with_plugin.params), jax.tree_util.tree_leaves(without.params)):
        np.testing.assert_array_equal(a, b)
    return without
