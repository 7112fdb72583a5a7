"""Shared pytest setup: make ``tests/`` importable so tests can ``from tiny import Tiny, tiny_data``;
the ``disabled`` fixture."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


@pytest.fixture
def disabled(monkeypatch):
    """``disabled("name", ...)``: those plugins disabled (``JAXNITRO_DISABLE_PLUGINS``) for the
    rest of the test; the plugins are reloaded as they were afterwards."""
    import jaxnitro as jn

    def disable(*names):
        monkeypatch.setenv("JAXNITRO_DISABLE_PLUGINS", ",".join(names))
        jn.reload_plugins()

    yield disable
    monkeypatch.delenv("JAXNITRO_DISABLE_PLUGINS", raising=False)
    jn.reload_plugins()
