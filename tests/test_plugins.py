"""Plugin discovery through entry points (group ``jaxnitro``): the built-in plugins, a
third-party plugin package with real ``*.dist-info`` metadata found on ``sys.path`` and
then used, and disabling plugins by name with ``JAXNITRO_DISABLE_PLUGINS``."""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import textwrap
from pathlib import Path

import pytest

import jaxnitro as jn
from plugin_dist import write_distribution
from tiny import Tiny

PLUGIN_MODULE = "jaxnitro_memlog_testplugin"
PLUGIN_DIST = "jaxnitro-memlog"

PLUGIN_SOURCE = textwrap.dedent(
    '''
    """A third-party jaxnitro plugin: an in-memory logger, plus one experiment-hook default."""
    from jaxnitro import hookimpl

    RECORDS = []
    MADE = []


    class MemoryLogger:
        def __init__(self, run_dir, experiment):
            self.run_dir = run_dir
            self.experiment = experiment

        def log_params(self, params):
            RECORDS.append(("params", dict(params)))

        def log_other(self, key, value):
            RECORDS.append(("other", key))

        def log_metrics(self, metrics, *, step, epoch, context):
            RECORDS.append(("metrics", context, step, epoch, dict(metrics)))

        def finish(self, status):
            RECORDS.append(("finish", status))


    @hookimpl
    def jaxnitro_make_logger(name, run_dir, experiment):
        if name != "memory":
            return None
        logger = MemoryLogger(run_dir, experiment)
        MADE.append(logger)
        return logger


    class ForeignLoader:
        """A loader type jaxnitro knows nothing about (no len(), no batch dicts)."""

        def __init__(self, x, label, batch):
            self.x, self.label, self.batch = x, label, batch


    ADAPTED = []


    @hookimpl
    def jaxnitro_adapt_source(source, split):
        if not isinstance(source, ForeignLoader):
            return None
        ADAPTED.append(split)
        b = source.batch
        return [{"x": source.x[i:i + b], "label": source.label[i:i + b]}
                for i in range(0, len(source.x) - b + 1, b)]


    @hookimpl
    def finalize_metrics(self, acc, split):
        # an installed default for experiments that define no finalize_metrics
        return {**acc, "finalized_by": "memlog", "split_seen": split}


    @hookimpl
    def learning_rate(self):
        # experiments that define learning_rate themselves win over this
        return 123.0
    '''
)


@contextlib.contextmanager
def installed_plugin(tmp_path: Path, disable: str | None = None):
    """Put the third-party package on sys.path (optionally disabling plugins), reload plugins;
    undo everything and reload again on the way out."""
    site = tmp_path / "site"
    if not site.exists():
        write_distribution(site, module=PLUGIN_MODULE, source=PLUGIN_SOURCE, dist=PLUGIN_DIST, entry="memory")
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.syspath_prepend(str(site))
            if disable is None:
                mp.delenv("JAXNITRO_DISABLE_PLUGINS", raising=False)
            else:
                mp.setenv("JAXNITRO_DISABLE_PLUGINS", disable)
            jn.reload_plugins()
            yield
    finally:
        sys.modules.pop(PLUGIN_MODULE, None)
        importlib.invalidate_caches()
        jn.reload_plugins()


def names() -> list[str]:
    return [p.name for p in jn.plugins_info()]


@pytest.fixture(autouse=True)
def clean_plugins(monkeypatch):
    monkeypatch.delenv("JAXNITRO_DISABLE_PLUGINS", raising=False)
    jn.reload_plugins()
    yield
    monkeypatch.undo()
    jn.reload_plugins()


# -- built-in plugins ----------------------------------------------------------------------------


def test_builtin_plugins_are_listed_with_their_distribution():
    info = {p.name: p for p in jn.plugins_info()}
    assert {"jsonl", "progress"} <= set(info)
    assert info["jsonl"].distribution == "jaxnitro" and info["progress"].distribution == "jaxnitro"
    assert info["jsonl"].module == "jaxnitro.loggers.jsonl"
    assert info["progress"].module == "jaxnitro.plugins.progress"
    assert info["jsonl"].version == jn.__version__
    assert "jaxnitro_make_logger" in info["jsonl"].hooks
    assert "jaxnitro_make_progress_reporter" in info["progress"].hooks
    assert PLUGIN_MODULE not in sys.modules


# -- a third-party plugin ------------------------------------------------------------------------------


def test_third_party_plugin_is_discovered_and_used(tmp_path):
    with installed_plugin(tmp_path):
        info = {p.name: p for p in jn.plugins_info()}
        assert {"jsonl", "progress", "memory"} <= set(info)
        mine = info["memory"]
        assert (mine.distribution, mine.version, mine.module) == (PLUGIN_DIST, "0.1", PLUGIN_MODULE)
        assert set(mine.hooks) == {
            "jaxnitro_make_logger", "jaxnitro_adapt_source", "finalize_metrics", "learning_rate"
        }

        plugin = sys.modules[PLUGIN_MODULE]
        n = jn.train(Tiny(), logger="memory", run_dir=tmp_path / "runs", max_epochs=2)
        assert n.status == "done"

        # the logger the plugin made received the whole run
        assert len(plugin.MADE) == 1 and n.logger is plugin.MADE[0]
        assert plugin.MADE[0].run_dir == Path(n.run_dir)
        records = plugin.RECORDS
        assert records[0][0] == "params" and records[0][1]["experiment"] == "Tiny"
        train = [r for r in records if r[0] == "metrics" and r[1] == "train"]
        assert [r[2] for r in train] == list(range(1, 13))
        validate = [r for r in records if r[0] == "metrics" and r[1] == "validate"]
        assert [(r[2], r[3]) for r in validate] == [(6, 1), (12, 2)]
        assert records[-1] == ("finish", "done")
        assert not os.path.exists(os.path.join(n.run_dir, "metrics.jsonl")), "jsonl was not asked for"

        # its experiment-hook default is used where the experiment has none ...
        assert n.hooks["finalize_metrics"].source == "plugin memory (jaxnitro-memlog 0.1)"
        assert validate[0][4]["finalized_by"] == "memlog" and validate[0][4]["split_seen"] == "val"
        assert n.history()[-1]["finalized_by"] == "memlog"
        # ... and the experiment's own method wins over it
        assert n.hooks["learning_rate"].source == "experiment" and n.plan.base_lr == 1e-2

        # other logger names still resolve to the built-in plugin
        j = jn.train(Tiny(), run_dir=tmp_path / "runs", max_epochs=1)
        assert os.path.exists(os.path.join(j.run_dir, "metrics.jsonl"))
        assert len(plugin.MADE) == 1

    # uninstalled: gone after reload
    assert "memory" not in names() and PLUGIN_MODULE not in sys.modules
    with pytest.raises(ValueError, match=r"no plugin makes a logger named 'memory'"):
        jn.train(Tiny(), logger="memory", run_dir=tmp_path / "runs", max_epochs=1)
    n = jn.Nitro(Tiny(), run_dir=tmp_path / "runs", logger=None)
    assert n.hooks["finalize_metrics"].source == "default"


def test_disabling_the_third_party_plugin_by_name(tmp_path):
    with installed_plugin(tmp_path, disable="memory"):
        assert "memory" not in names() and {"jsonl", "progress"} <= set(names())
        assert PLUGIN_MODULE not in sys.modules, "a disabled plugin is not even imported"
        with pytest.raises(ValueError) as err:
            jn.train(Tiny(), logger="memory", run_dir=tmp_path / "runs", max_epochs=1)
        msg = str(err.value)
        assert "logger 'memory' (keyword) comes from the plugin `memory`, which is disabled" in msg
        assert "JAXNITRO_DISABLE_PLUGINS: memory" in msg and "logger=None" in msg
        assert jn.Nitro(Tiny(), run_dir=tmp_path, logger=None).hooks["finalize_metrics"].source == "default"
    with installed_plugin(tmp_path, disable=" progress , memory "):
        assert "memory" not in names() and "progress" not in names() and "jsonl" in names()


def test_disabling_a_builtin_plugin(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXNITRO_DISABLE_PLUGINS", "jsonl")
    jn.reload_plugins()
    assert "jsonl" not in names() and "progress" in names()
    # the core still trains: no plugin names a default logger, so the run logs nothing
    n = jn.train(Tiny(), run_dir=tmp_path, max_epochs=1)
    assert n.status == "done" and n.settings.logger is None and n.loggers == []
    assert not os.path.exists(os.path.join(n.run_dir, "metrics.jsonl"))
    # asking for it by name is refused at setup, naming the disabled plugin
    with pytest.raises(ValueError, match=r"logger 'jsonl' \(keyword\) comes from the plugin `jsonl`, which is disabled"):
        jn.Nitro(Tiny(), run_dir=tmp_path, logger="jsonl")
    monkeypatch.delenv("JAXNITRO_DISABLE_PLUGINS")
    jn.reload_plugins()
    assert "jsonl" in names()


def test_a_plugin_adapts_a_foreign_loader_type(tmp_path):
    from tiny import make_arrays

    with installed_plugin(tmp_path):
        plugin = sys.modules[PLUGIN_MODULE]
        x, _, onehot = make_arrays(64)
        n = jn.train(Tiny(max_epochs=1), data={"train": plugin.ForeignLoader(x, onehot, 16)},
                     run_dir=tmp_path / "runs", logger=None)
        assert plugin.ADAPTED == ["train"]
        assert len(n.data["train"]) == 4 and n.step == 4 and n.status == "done"
