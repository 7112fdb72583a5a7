"""Helpers shared by the logger plugin tests (console, TensorBoard, MLflow): a plugin module
registered for a test, a plugin stopping a run after its first epoch, a fresh copy of a module."""

from __future__ import annotations

import contextlib
import importlib.util
import sys

import jaxnitro as jn
from jaxnitro import exports
from jaxnitro.plugin_manager import plugin_manager


@contextlib.contextmanager
def plugin_module(module, name: str):
    """``module`` registered as the plugin ``name`` (its exports reachable through ``jn``)
    until the block ends; left alone when the entry point ``name`` already loaded it."""
    pm = plugin_manager()
    if pm.get_plugin(name) is not None:
        yield pm.get_plugin(name)
        return
    pm.register(module, name=name)
    exports.forget()
    try:
        yield module
    finally:
        pm.unregister(name=name)
        exports.forget()


class StopAfterFirstEpoch:
    """A plugin raising ``error`` at the end of epoch 1 (a ``KeyboardInterrupt`` is a Ctrl-C)."""

    def __init__(self, error: BaseException):
        self.error = error

    @jn.hookimpl
    def jaxnitro_epoch_end(self, run, row):
        if row["epoch"] == 1:
            raise self.error


@contextlib.contextmanager
def stopping_after_first_epoch(error: BaseException):
    """:class:`StopAfterFirstEpoch` registered until the block ends."""
    plugin = StopAfterFirstEpoch(error)
    pm = plugin_manager()
    pm.register(plugin, name="test-stop-after-first-epoch")
    try:
        yield plugin
    finally:
        pm.unregister(plugin)


def fresh_copy(module, monkeypatch):
    """A new, unregistered instance of ``module`` executed from its file, as a first import runs
    it (under another name, in ``sys.modules`` for the test only)."""
    spec = importlib.util.spec_from_file_location(module.__name__ + "_copy", module.__file__)
    copy = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, copy)
    spec.loader.exec_module(copy)
    return copy
