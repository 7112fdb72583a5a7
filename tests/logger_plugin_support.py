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


# -- a child process killed after a logger line, and a viewer started as a user starts it ----------


def kill_after(run_dir, logger: str, when: str, max_epochs: int = 2) -> None:
    """Run ``kill_after_child.py`` (see there) and check that it died by SIGKILL."""
    import os
    import signal
    import subprocess
    from pathlib import Path

    here = Path(__file__).parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, str(here / "kill_after_child.py"), str(run_dir), logger, when, str(max_epochs)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(command: list, url: str, timeout: float = 240.0):
    """Start ``command`` (a viewer: ``mlflow ui``, ``tensorboard``) in its own process group and
    yield once ``url`` answers 200; stop the whole group at the end (SIGTERM, then SIGKILL)."""
    import os
    import signal
    import subprocess
    import tempfile
    import time
    import urllib.request

    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(url, timeout=5) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                raise AssertionError(f"{command[0]} did not answer {url}: {log.read().decode()[-3000:]}")
            time.sleep(0.5)
        yield proc
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=20)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        log.close()


def fetch(url: str, body: dict | None = None):
    """``url``'s JSON answer (a POST of ``body`` as JSON when given)."""
    import json
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.loads(answer.read())
