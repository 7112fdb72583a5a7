"""The persistent compilation cache switch (entry point ``compilation_cache``).

JAX can keep compiled executables on disk, so a later process loads them instead of
compiling again. This plugin switches that on, three ways:

* ``jn.enable_persistent_cache(path=None)`` (the core asks ``jaxnitro_persistent_cache``;
  this plugin answers, ``trylast``);
* the ``compilation_cache`` run knob: a folder (``str`` / ``os.PathLike``) or ``True`` (the
  default folder); accepted here (``jaxnitro_accept_knob``) and switched on at once, at
  setup, before any program of the handle compiles;
* the ``JAXNITRO_COMPILATION_CACHE`` environment variable (a folder): read when the plugins
  load (the first handle built, ``jn.plugins_info()``, ``jn.enable_persistent_cache``).

The default folder is ``$JAXNITRO_COMPILATION_CACHE``, else ``~/.cache/jaxnitro/xla``. The
switch is process-wide (``jax.config``): every program compiled after it is written there,
however small or quick to compile (JAX's defaults skip programs that compile in under a
second, which is most programs on CPU). The in-process cache (``jn.cache_stats()``) is the
core's and unaffected: a new process still traces each program once (a miss), but XLA loads
the executable from disk. The folder is trusted code: do not share it with users you do not
trust.
"""

from __future__ import annotations

import os

import jax

from jaxnitro.plugin import CACHE_ENV, hookimpl

__all__ = ["enable", "default_folder", "KNOB"]

KNOB = "compilation_cache"
"""The run knob this plugin owns."""


def default_folder() -> str:
    """``$JAXNITRO_COMPILATION_CACHE``, else ``~/.cache/jaxnitro/xla`` (not yet expanded)."""
    return os.environ.get(CACHE_ENV) or os.path.join("~", ".cache", "jaxnitro", "xla")


def enable(path: str | os.PathLike | None = None) -> str:
    """Switch JAX's persistent compilation cache on at ``path`` (created if missing; without it,
    :func:`default_folder`); return the folder's absolute path."""
    if path is None:
        path = default_folder()
    folder = os.path.abspath(os.path.expanduser(os.fspath(path)))
    os.makedirs(folder, exist_ok=True)
    from jax.experimental.compilation_cache import compilation_cache as _cc  # JAX's own, loaded when used

    if jax.config.jax_compilation_cache_dir != folder:
        _cc.reset_cache()  # a cache JAX already opened keeps its folder until reset
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return folder


@hookimpl(trylast=True)
def jaxnitro_persistent_cache(path):
    return enable(path)


@hookimpl(trylast=True)
def jaxnitro_accept_knob(name, value, nitro):
    """Take the ``compilation_cache`` knob: a folder or ``True``; switch the cache on there."""
    if name != KNOB:
        return None
    if value is True:
        enable()
    elif isinstance(value, (str, os.PathLike)) and os.fspath(value):
        enable(value)
    else:
        raise ValueError(
            f"jaxnitro: run knob `{KNOB}` = {value!r} ({nitro.settings.source(KNOB)}) is not a folder: pass "
            f"the folder for JAX's persistent compilation cache (`{KNOB}=\"~/.cache/jaxnitro/xla\"`), "
            f"True for the default folder, or None to leave the cache off."
        )
    return True


if os.environ.get(CACHE_ENV):  # JAXNITRO_COMPILATION_CACHE=<folder>: on as soon as the plugins load
    enable(os.environ[CACHE_ENV])
