"""The lifecycle hooks and the plugin rules: a plugin sees a run's events in order (done,
diverged, interrupted); every built-in feature can be disabled by name, leaving the core
working and refusing what needs the missing plugin by name; a typo'd hook implementation
fails at load, naming the plugin, the hook and the closest real one."""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import textwrap

import numpy as np
import pluggy
import pytest

import jaxnitro as jn
from jaxnitro.plugin_manager import plugin_manager
from plugin_dist import write_distribution
from tiny import Tiny, batches, make_arrays, tiny_data

DATA = tiny_data()  # 6 train batches of 16, 2 val batches


class Recorder:
    """A plugin object recording every lifecycle event of the runs it sees."""

    def __init__(self):
        self.events = []

    @jn.hookimpl
    def jaxnitro_run_start(self, run):
        self.events.append(("start", os.path.isdir(run.run_dir), run.settings.max_epochs))

    @jn.hookimpl
    def jaxnitro_phase_start(self, run, epoch, phase, detail):
        self.events.append(("phase", epoch, phase))

    @jn.hookimpl
    def jaxnitro_steps_read(self, run, stretch):
        steps = [s for s, _, _ in stretch.lines()]
        self.events.append(("steps", steps, sorted(set(stretch.epochs))))

    @jn.hookimpl
    def jaxnitro_epoch_trained(self, run, epoch, step, stats):
        self.events.append(("trained", epoch, step, 0.0 <= stats["data_wait_frac"] <= 1.0))

    @jn.hookimpl
    def jaxnitro_split_evaluated(self, run, split, metrics, context):
        self.events.append(("evaluated", split, context, "loss" in metrics))

    @jn.hookimpl
    def jaxnitro_epoch_end(self, run, row):
        self.events.append(("epoch_end", row["epoch"], row["step"], "loss" in row))

    @jn.hookimpl
    def jaxnitro_run_finish(self, run, status):
        self.events.append(("finish", status))

    @jn.hookimpl
    def jaxnitro_before_verb(self, nitro, verb):
        self.events.append(("verb", verb))

    def kinds(self):
        return [e[0] for e in self.events]

    def steps(self):
        return [s for e in self.events if e[0] == "steps" for s in e[1]]


@contextlib.contextmanager
def registered(plugin):
    pm = plugin_manager()
    pm.register(plugin, name="test-recorder")
    try:
        yield plugin
    finally:
        pm.unregister(plugin)


def test_a_plugin_sees_a_runs_events_in_order(tmp_path):
    with registered(Recorder()) as rec:
        n = jn.train(Tiny(max_epochs=3), data=DATA, run_dir=tmp_path, logger=None)
    assert n.status == "done" and n.step == 18
    assert rec.events[0] == ("verb", "train")
    assert rec.events[1] == ("start", True, 3)
    assert rec.events[-1] == ("finish", "done")
    # every step read exactly once, in order; per epoch: train phase, its steps, trained,
    # validate phase, the evaluation, then the epoch's end with the validation metrics in it
    assert rec.steps() == list(range(1, 19))
    per_epoch = []
    for e in rec.events:
        if e[0] in ("phase", "trained", "evaluated", "epoch_end"):
            per_epoch.append(e)
    assert per_epoch == [
        ("phase", 1, "train"),  # preparing: schedules, programs, streams
        ("phase", 1, "train"), ("trained", 1, 6, True), ("phase", 1, "validate"),
        ("evaluated", "val", "validate", True), ("epoch_end", 1, 6, True),
        ("phase", 2, "train"), ("trained", 2, 12, True), ("phase", 2, "validate"),
        ("evaluated", "val", "validate", True), ("epoch_end", 2, 12, True),
        ("phase", 3, "train"), ("trained", 3, 18, True), ("phase", 3, "validate"),
        ("evaluated", "val", "validate", True), ("epoch_end", 3, 18, True),
    ]
    # a stretch's steps are read before the epoch that holds them ends
    kinds = rec.kinds()
    last_steps = max(i for i, k in enumerate(kinds) if k == "steps")
    assert last_steps < kinds.index("finish")


def test_a_train_only_run_ends_each_epoch_once(tmp_path):
    with registered(Recorder()) as rec:
        jn.train(Tiny(max_epochs=3), data={"train": DATA["train"]}, run_dir=tmp_path, logger=None)
    ends = [e for e in rec.events if e[0] == "epoch_end"]
    assert ends == [("epoch_end", 1, 6, False), ("epoch_end", 2, 12, False), ("epoch_end", 3, 18, False)]
    assert rec.steps() == list(range(1, 19)) and rec.events[-1] == ("finish", "done")


def test_a_diverged_run_ends_with_its_status_and_the_steps_before(tmp_path):
    x, y, onehot = make_arrays(96)
    x = x.copy()
    x[64:] = np.nan  # batches 5 and 6 of every epoch are NaN: step 5 diverges
    data = {"train": batches(x, y, onehot, 16), "val": DATA["val"]}
    with registered(Recorder()) as rec, pytest.warns(RuntimeWarning, match="non-finite at step 5"):
        n = jn.train(Tiny(max_epochs=3), data=data, run_dir=tmp_path, logger=None)
    assert n.status == "diverged" and "step 5" in n.stop_reason
    assert rec.steps() == [1, 2, 3, 4]  # the steps before the first non-finite loss are still seen
    assert rec.events[-1] == ("finish", "diverged")
    assert "evaluated" not in rec.kinds()


def test_an_interrupted_run_finishes_with_interrupted(tmp_path):
    class Interrupter(Recorder):
        @jn.hookimpl
        def jaxnitro_epoch_end(self, run, row):
            super().jaxnitro_epoch_end(run, row)
            if row["epoch"] == 2:
                raise KeyboardInterrupt

    n = jn.Nitro(Tiny(max_epochs=3), data=DATA, run_dir=tmp_path, logger=None)
    with registered(Interrupter()) as rec, pytest.raises(KeyboardInterrupt):
        n.train()
    assert n.status == "interrupted"
    assert [e[1] for e in rec.events if e[0] == "epoch_end"] == [1, 2]
    assert rec.events[-1] == ("finish", "interrupted")
    # the handle keeps its trained state: it evaluates after the interrupt
    assert n.step == 12 and np.isfinite(n.validate()["loss"])


def test_a_plugin_stops_the_run_through_the_context(tmp_path):
    class StopAtTwo:
        @jn.hookimpl
        def jaxnitro_epoch_end(self, run, row):
            if row["epoch"] == 2:
                run.request_stop("enough at two")

    with registered(StopAtTwo()):
        n = jn.train(Tiny(max_epochs=5), data=DATA, run_dir=tmp_path, logger=None)
    assert n.status == "done" and n.epoch == 2 and n.stop_reason == "enough at two"


# -- disabling built-ins -------------------------------------------------------------------------


@pytest.fixture
def disable(monkeypatch):
    """``disable("name")`` blocks a plugin by name for the test; plugins reload after."""

    def block(name: str):
        monkeypatch.setenv("JAXNITRO_DISABLE_PLUGINS", name)
        jn.reload_plugins()
        assert name not in [p.name for p in jn.plugins_info()]

    yield block
    monkeypatch.delenv("JAXNITRO_DISABLE_PLUGINS", raising=False)
    jn.reload_plugins()


BUILTINS = (
    "jsonl", "progress", "early_stopping", "history_table", "report", "staleness", "plot",
    "console", "tensorboard", "mlflow", "array_source", "grain_loader", "torch_loader", "orbax",
    "sweep", "optuna",
    "cli", "profiler",
)


def test_every_builtin_is_an_entry_point_of_this_distribution():
    info = {p.name: p for p in jn.plugins_info()}
    assert set(BUILTINS) <= set(info)
    assert {info[b].distribution for b in BUILTINS} == {"jaxnitro"}


@pytest.mark.parametrize("name", BUILTINS)
def test_the_core_trains_with_any_builtin_disabled(name, disable, tmp_path):
    disable(name)
    n = jn.train(Tiny(max_epochs=2), data=DATA, run_dir=tmp_path)
    assert n.status == "done" and n.step == 12 and len(n.history()) == 2
    assert os.path.exists(os.path.join(n.run_dir, "metrics.jsonl")) == (name != "jsonl")


def test_disabled_early_stopping_refuses_its_knob_and_its_name(disable, tmp_path):
    early = jn.EarlyStopping(patience=2)  # taken before the plugin is blocked
    disable("early_stopping")
    with pytest.raises(ValueError) as err:
        jn.Nitro(Tiny(), data=DATA, run_dir=tmp_path, early_stop=early)
    msg = str(err.value)
    assert "run knob `early_stop` is set (keyword) but no loaded plugin acts on it" in msg
    assert "disabled by JAXNITRO_DISABLE_PLUGINS: early_stopping" in msg and "early_stop=None" in msg
    with pytest.raises(AttributeError, match="no attribute 'EarlyStopping'.*disabled.*early_stopping"):
        jn.EarlyStopping


def test_disabled_jsonl_refuses_the_name(disable, tmp_path):
    disable("jsonl")
    with pytest.raises(ValueError, match=r"logger 'jsonl' \(keyword\) comes from the plugin `jsonl`, which is disabled"):
        jn.Nitro(Tiny(), data=DATA, run_dir=tmp_path, logger="jsonl")


def test_disabled_progress_refuses_its_reporter_names(disable):
    disable("progress")
    with pytest.raises(ValueError, match="no plugin provides a progress reporter named 'tqdm'.*progress"):
        jn.progress_reporter("tqdm")


def test_disabled_history_table_refuses_the_table(disable, tmp_path):
    n = jn.train(Tiny(max_epochs=1), data=DATA, run_dir=tmp_path, logger=None)
    disable("history_table")
    h = n.history()
    with pytest.raises(RuntimeError, match="history_table"):
        h.table()
    assert "1 epochs" in str(h) or "1 epoch" in str(h)


def test_disabled_report_falls_back_to_a_summary(disable, tmp_path):
    disable("report")
    n = jn.Nitro(Tiny(), data=DATA, run_dir=tmp_path, logger=None)
    assert repr(n) == "Nitro(Tiny)  status: ready"
    assert repr(Tiny()).startswith("Tiny(")


def test_disabled_staleness_reports_nothing(disable, tmp_path, capsys):
    disable("staleness")
    n = jn.Nitro(Tiny(), data=DATA, run_dir=tmp_path, logger=None)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Tiny, "loss", lambda self, logits, *, label: 0.0 * logits.sum())
        n.validate()
    assert capsys.readouterr().err == ""
    with pytest.raises(AttributeError, match="set_config_report"):
        jn.set_config_report


# -- a typo'd hook implementation -----------------------------------------------------------------


TYPO_MODULE = "jaxnitro_typo_testplugin"


def test_a_typod_hook_implementation_fails_at_load_naming_it(tmp_path, monkeypatch):
    source = textwrap.dedent(
        """
        from jaxnitro import hookimpl

        @hookimpl
        def jaxnitro_make_loger(name, run_dir, experiment):
            return None
        """
    )
    site = write_distribution(tmp_path / "site", module=TYPO_MODULE, source=source, dist="jaxnitro-typo", entry="typo")
    monkeypatch.syspath_prepend(str(site))
    try:
        with pytest.raises(pluggy.PluginValidationError) as err:
            jn.reload_plugins()
        msg = str(err.value)
        assert "plugin `typo` implements `jaxnitro_make_loger`, which is no jaxnitro hook" in msg
        assert "did you mean `jaxnitro_make_logger`?" in msg
        # disabled by name, it is not even imported, and everything else loads
        sys.modules.pop(TYPO_MODULE, None)
        monkeypatch.setenv("JAXNITRO_DISABLE_PLUGINS", "typo")
        jn.reload_plugins()
        assert TYPO_MODULE not in sys.modules and "jsonl" in [p.name for p in jn.plugins_info()]
    finally:
        monkeypatch.delenv("JAXNITRO_DISABLE_PLUGINS", raising=False)
        sys.path.remove(str(site))
        sys.modules.pop(TYPO_MODULE, None)
        importlib.invalidate_caches()
        jn.reload_plugins()
