"""Long runs: step budgets, validation and checkpoints every N steps, exact mid-epoch resume
after a SIGKILL, preemption by SIGTERM."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest

import jaxnitro as jn
from long_run_child import STEPS_PER_EPOCH, LongRun, keywords
from tiny import Tiny, tiny_data

HERE = Path(__file__).parent


def leaves(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def assert_same_state(a, b):
    assert a.step == b.step
    for x, y in zip(leaves(a.params), leaves(b.params), strict=True):
        np.testing.assert_array_equal(x, y)
    for x, y in zip(leaves(a.opt_state), leaves(b.opt_state), strict=True):
        np.testing.assert_array_equal(x, y)


def train_lines(folder: Path) -> dict:
    """``{step: train line}`` of a run folder's metrics.jsonl; asserts each step appears once."""
    lines = [r for r in jn.read_jsonl(folder / "metrics.jsonl") if r.get("kind") == "metrics" and r["context"] == "train"]
    steps = [r["step"] for r in lines]
    assert len(steps) == len(set(steps)), "a step was logged twice"
    return {r["step"]: {k: v for k, v in r.items() if k != "time"} for r in lines}


def child(run_dir: Path, at: int, opts: dict) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, str(HERE / "long_run_child.py"), str(run_dir), str(at), json.dumps(opts)],
                          env=env, capture_output=True, text=True, timeout=300, cwd=run_dir)


# -- in-process: budgets, rows, checkpoints, resume -------------------------------------------


def test_max_steps_ends_mid_epoch_with_a_validated_row(tmp_path):
    n = jn.train(Tiny(), run_dir=tmp_path, max_steps=9, logger=None)  # 6 steps an epoch
    assert n.step == 9 and n.status == "done"
    assert [(r["epoch"], r["step"]) for r in n.rows] == [(1, 6), (2, 9)]
    assert "loss" in n.rows[-1]  # the run's end is validated
    both = jn.train(Tiny(), run_dir=tmp_path, max_steps=100, max_epochs=3, logger=None)
    assert both.step == 18  # whichever comes first


def test_val_every_n_steps_gives_one_row_per_validation_keyed_by_step(tmp_path):
    n = jn.train(Tiny(), run_dir=tmp_path, max_steps=14, max_epochs=None, val_every_n_steps=4, logger="jsonl")
    assert [(r["epoch"], r["step"]) for r in n.rows] == [(1, 4), (2, 8), (2, 12), (3, 14)]
    assert all("loss" in r for r in n.rows)
    val = [r for r in jn.read_jsonl(Path(n.run_dir) / "metrics.jsonl") if r.get("context") == "validate"]
    assert [r["step"] for r in val] == [4, 8, 12, 14]
    lines = train_lines(Path(n.run_dir))
    # a row's train_loss is the mean of its steps' losses
    np.testing.assert_allclose(n.rows[1]["train_loss"], np.mean([lines[s]["loss"] for s in range(5, 9)]), rtol=1e-6)


def test_early_stopping_counts_validations(tmp_path):
    class Worse(Tiny):
        def monitor(self):
            return ("loss", "max")  # the loss falls: every validation after the first is worse

    n = jn.train(Worse(), run_dir=tmp_path, max_steps=60, max_epochs=None, val_every_n_steps=3, logger=None,
                 early_stop=jn.EarlyStopping(patience=2))
    assert n.step == 9 and len(n.rows) == 3


def test_a_resumed_run_stops_early_where_the_uninterrupted_run_did(tmp_path):
    class Worse(Tiny):
        def monitor(self):
            return ("loss", "max")  # the loss falls: every validation after the first is worse

    ckpt = jn.Checkpointer(every_n_steps=3, keep=jn.Last(1), asynchronous=False)
    kw = dict(max_epochs=None, val_every_n_steps=3, logger=None, checkpointer=ckpt,
              early_stop=jn.EarlyStopping(patience=3))
    straight = jn.train(Worse(), run_dir=tmp_path / "a", max_steps=60, **kw)
    assert straight.step == 12  # best at 3, then 6, 9, 12 worse: patience counts validations, not epochs
    assert straight.stop_reason == "early stopping: loss did not improve for 3 validations (one every 3 steps)"
    cut = jn.train(Worse(), run_dir=tmp_path / "b", max_steps=9, **kw)  # two worse validations so far
    resumed = jn.Nitro(Worse(), run_dir=tmp_path / "b", resume="auto", max_steps=60, **kw)
    resumed.train()
    assert resumed.step == 12 and [r["step"] for r in resumed.rows] == [12], "the patience went on counting"
    assert resumed.rows[0] == straight.rows[-1] and cut.stop_reason is None
    assert_same_state(resumed, straight)
    # the finished run, resumed: it had stopped early, so nothing is trained, and it says so
    with pytest.warns(RuntimeWarning, match=r"had already stopped early at step 12 \(loss did not improve for 3 "
                                            r"validations \(one every 3 steps\)\).*early_stop=None"):
        again = jn.Nitro(Worse(), run_dir=tmp_path / "a", resume="auto", max_steps=60, **kw).train()
    assert again.step == 12 and again.rows == [] and again.status == "done"
    assert "before the resume point" in again.stop_reason
    longer = jn.Nitro(Worse(), run_dir=tmp_path / "a", resume="auto", max_steps=18,
                      **dict(kw, early_stop=jn.EarlyStopping(patience=5))).train()
    assert [r["step"] for r in longer.rows] == [15, 18]  # a larger patience trains on


def test_early_stopping_warns_when_a_checkpoint_does_not_record_the_earlier_validations(tmp_path, monkeypatch):
    from jaxnitro.checkpointers import orbax as saver

    class Monitored(Tiny):
        def monitor(self):
            return ("loss", "min")

    kw = dict(max_epochs=None, val_every_n_steps=3, logger=None, early_stop=jn.EarlyStopping(patience=3),
              checkpointer=jn.Checkpointer(every_n_steps=3, keep=jn.Last(1), asynchronous=False))
    monkeypatch.setattr(saver._Saver, "_validated", lambda self, rows: None)  # as a checkpoint from before the record
    jn.train(Monitored(), run_dir=tmp_path, max_steps=6, **kw)
    monkeypatch.undo()
    resumed = jn.Nitro(Monitored(), run_dir=tmp_path, resume="auto", max_steps=9, **kw)
    with pytest.warns(RuntimeWarning, match=r"does not record 'loss' at the validations before it.*patience starts again"):
        resumed.train()
    assert resumed.step == 9


def test_a_record_from_before_the_steps_were_kept_still_replays(tmp_path, monkeypatch):
    from jaxnitro.checkpointers import orbax as saver

    class Worse(Tiny):
        def monitor(self):
            return ("loss", "max")

    full = saver._Saver._validated
    monkeypatch.setattr(saver._Saver, "_validated",  # as a checkpoint written before 26cc19b: [epoch, value]
                        lambda self, rows: {**full(self, rows), "values": [v[:2] for v in full(self, rows)["values"]]})
    kw = dict(max_epochs=None, val_every_n_steps=3, logger=None, early_stop=jn.EarlyStopping(patience=3),
              checkpointer=jn.Checkpointer(every_n_steps=3, keep=jn.Last(1), asynchronous=False))
    jn.train(Worse(), run_dir=tmp_path, max_steps=9, **kw)
    monkeypatch.undo()
    resumed = jn.Nitro(Worse(), run_dir=tmp_path, resume="auto", max_steps=60, **kw).train()
    assert resumed.step == 12 and [r["step"] for r in resumed.rows] == [12]  # the count went on


class _CtrlCWhileValidating:
    """A val split that presses Ctrl-C (SIGINT to this process) as its ``at``-th batch is read."""

    def __init__(self, batches, at=None):
        self.batches, self.at, self.reads = batches, at, 0

    def __len__(self):
        return len(self.batches)

    def __getitem__(self, i):
        self.reads += 1
        if self.reads == self.at:
            os.kill(os.getpid(), signal.SIGINT)
        return self.batches[i]


@pytest.mark.parametrize("at, knobs", [
    (5, dict(max_epochs=4)),  # in epoch 2's validation (3 val batches each)
    (11, dict(max_epochs=None, max_steps=20, val_every_n_steps=4)),  # mid-epoch 3, at step 16
])
def test_a_run_stopped_while_validating_resumes_with_that_validation(tmp_path, at, knobs):
    class Monitored(Tiny):
        def monitor(self):
            return ("loss", "min")

    def data(at=None):
        return dict(tiny_data(), val=_CtrlCWhileValidating(tiny_data()["val"], at))

    every = {"every_n_steps": 4} if "val_every_n_steps" in knobs else {}
    kw = dict(knobs, logger="jsonl", checkpointer=jn.Checkpointer(keep=jn.Last(1), asynchronous=False, **every))
    straight = jn.train(Monitored(), data=data(), run_dir=tmp_path / "a", **kw)
    with pytest.raises(KeyboardInterrupt):
        jn.train(Monitored(), data=data(at), run_dir=tmp_path / "b", **kw)
    resumed = jn.Nitro(Monitored(), data=data(), run_dir=tmp_path / "b", resume="auto", **kw)
    assert resumed.plan.resumed.open_row, "the row whose validation was cut short is still open"
    resumed.train()
    assert resumed.rows == straight.rows[-len(resumed.rows):] and resumed.rows[0]["step"] == resumed.plan.resumed.step
    assert_same_state(resumed, straight)

    def logged(run):
        lines = jn.read_jsonl(next(Path(run).glob("2*/metrics.jsonl")))
        return [{k: v for k, v in x.items() if k != "time"} for x in lines if x.get("context") in ("train", "validate")]

    assert logged(tmp_path / "b") == logged(tmp_path / "a"), "every train and validation line once, as uninterrupted"
    data_lines = [[x["step"] for x in jn.read_jsonl(next(Path(run).glob("2*/metrics.jsonl"))) if x.get("context") == "data"]
                  for run in (tmp_path / "a", tmp_path / "b")]
    assert data_lines[0] == data_lines[1], "an epoch's data line once"


def test_a_run_stopped_at_a_cut_before_its_validation_resumes_with_it(tmp_path):
    """SIGTERM (deferred while training) honoured at epoch 2's end, after its last step, before
    its validation: the row stays open and the resumed run validates it first."""
    from jaxnitro.interrupts import request
    from jaxnitro.plugin_manager import plugin_manager

    class Monitored(Tiny):
        def monitor(self):
            return ("loss", "min")

    class PreemptAtEpochEnd:
        @jn.hookimpl
        def jaxnitro_epoch_trained(self, run, epoch, step, stats):
            if epoch == 2:
                request.status = "preempted"

    kw = dict(max_epochs=4, logger="jsonl", checkpointer=jn.Checkpointer(keep=jn.Last(1), asynchronous=False))
    straight = jn.train(Monitored(), run_dir=tmp_path / "a", **kw)
    plugin_manager().register(PreemptAtEpochEnd(), name="preempt-at-epoch-end")
    try:
        with pytest.raises(jn.Preempted):
            jn.train(Monitored(), run_dir=tmp_path / "b", **kw)
    finally:
        plugin_manager().unregister(name="preempt-at-epoch-end")
    resumed = jn.Nitro(Monitored(), run_dir=tmp_path / "b", resume="auto", **kw)
    assert resumed.step == 12 and len(resumed.plan.resumed.open_row) == 6
    resumed.train()
    assert resumed.rows == straight.rows[1:], "epoch 2's row, validated, then 3 and 4"
    assert_same_state(resumed, straight)
    validated = [[x["epoch"] for x in jn.read_jsonl(next(Path(run).glob("2*/metrics.jsonl"))) if x.get("context") == "validate"]
                 for run in (tmp_path / "a", tmp_path / "b")]
    assert validated == [[1, 2, 3, 4]] * 2


def test_resuming_a_finished_run_trains_nothing_and_says_so(tmp_path):
    ckpt = jn.Checkpointer(keep=jn.Last(1), asynchronous=False)
    done = jn.train(Tiny(), run_dir=tmp_path, max_epochs=2, logger=None, checkpointer=ckpt)
    with pytest.warns(RuntimeWarning, match=r"nothing to train: this handle resumed at step 12, which is already "
                                            r"the run's budget \(12 optimizer steps\).*larger max_epochs or max_steps"):
        again = jn.Nitro(Tiny(), run_dir=tmp_path, resume="auto", max_epochs=2, logger=None, checkpointer=ckpt).train()
    assert again.status == "done" and again.step == done.step == 12 and again.rows == []
    assert_same_state(again, done)


def test_checkpoints_every_n_steps_keep_best_and_last_and_resume_mid_epoch(tmp_path):
    ckpt = jn.Checkpointer(every_n_steps=4, keep=(jn.Best(1), jn.Last(2)), asynchronous=False)

    class Monitored(Tiny):
        def monitor(self):
            return ("loss", "min")

    kw = dict(max_epochs=None, val_every_n_steps=4, logger=None)
    straight = jn.train(Monitored(), run_dir=tmp_path / "a", max_steps=14, **kw)
    first = jn.train(Monitored(), run_dir=tmp_path / "b", max_steps=10, checkpointer=ckpt, **kw)
    steps = sorted(int(p.name) for p in (Path(first.run_dir) / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == [8, 10]  # saved at 4 and 8, and at the run's end (10); Last(2) (the loss falls: Best(1) is 10)
    resumed = jn.Nitro(Monitored(), run_dir=tmp_path / "b", resume="auto", max_steps=14, checkpointer=ckpt, **kw)
    assert resumed.step == 10 and resumed.epoch == 2  # mid-epoch 2 (6 steps an epoch)
    resumed.train()
    assert_same_state(resumed, straight)
    # the first run's last row ended at its last step (10): the longer run's next row holds
    # steps 11-12, validated as the uninterrupted run's at 12
    assert [r["step"] for r in resumed.rows] == [12, 14]
    assert resumed.rows[0]["loss"] == straight.rows[2]["loss"] and resumed.rows[1] == straight.rows[3]


def test_a_preempted_run_checkpoints_and_resumes_exactly(tmp_path):
    ckpt = jn.Checkpointer(keep=jn.Last(1), asynchronous=False)
    straight = jn.train(Tiny(), run_dir=tmp_path / "a", max_epochs=3, logger=None)
    data = {"train": _PreemptingSource(tiny_data()["train"], at=(2, 3)), "val": tiny_data()["val"]}
    with pytest.raises(jn.Preempted) as info:
        jn.train(Tiny(), data=data, run_dir=tmp_path / "b", max_epochs=3, checkpointer=ckpt, logger="jsonl")
    assert info.value.code == jn.PREEMPTED_EXIT_CODE == 143
    (folder,) = (tmp_path / "b").iterdir()
    finish = [r for r in jn.read_jsonl(folder / "metrics.jsonl") if r.get("kind") == "finish"]
    assert finish[-1]["status"] == "preempted"
    resumed = jn.Nitro(Tiny(), run_dir=tmp_path / "b", resume="auto", max_epochs=3, checkpointer=ckpt, logger=None)
    # mid-epoch 2: batch 3 is read (staged one ahead) as step 9 takes batch 2; step 9 completes
    assert resumed.step == 9
    assert len(resumed.plan.resumed.open_row) == resumed.step - 6  # the open row: epoch 2's steps so far
    resumed.train()
    assert_same_state(resumed, straight)
    assert resumed.rows == straight.rows[-len(resumed.rows):]  # epoch 2's row averages steps 7-12


class _PreemptingSource:
    """Tiny's train batches, index-addressable; requests a preemption (as SIGTERM does) when
    batch ``at = (epoch, index)`` is read. Read in the consumer's thread (no producers read
    ahead), one batch staged ahead of the step that takes it."""

    prefetch_workers = 0

    def __init__(self, batches, at):
        self.batches, self.at, self.epoch = batches, at, 0

    def __len__(self):
        return len(self.batches)

    def begin_epoch(self, epoch):
        self.epoch = epoch

    def batch_at(self, i):
        from jaxnitro.interrupts import request

        if (self.epoch, i) == self.at:
            request.status = "preempted"
        return self.batches[i]


def test_max_time_preempts(tmp_path):
    with pytest.raises(jn.Preempted):
        jn.train(Tiny(), run_dir=tmp_path, max_epochs=100000, max_time=0.5, logger=None)


@pytest.mark.parametrize(("value", "seconds"), [
    ("23:30:00", 84600.0), ("1-00:00:10", 86410.0), ("05:00", 300.0), (90, 90.0),
    # Slurm's other --time forms, read as Slurm reads them (they were read as seconds: "1-12" was a day and 12 s)
    ("1-12", 129600.0), ("1-12:30", 131400.0), ("2-0:0:5", 172805.0)])
def test_max_time_forms(value, seconds):
    from jaxnitro.knobs import max_time_seconds

    assert max_time_seconds(value) == seconds


@pytest.mark.parametrize("value", ["soon", "1:70:00", "1-2:3:4:5", "-00:00:01", "1h", "0:00", -5, 0, float("nan")])
def test_a_bad_max_time_is_refused_naming_the_forms(tmp_path, value):
    with pytest.raises(ValueError, match=r"max_time.*\"M:S\", \"H:M:S\", \"D-H\", \"D-H:M\", \"D-H:M:S\""):
        jn.Nitro(Tiny(), run_dir=tmp_path, max_time=value, logger=None)


def test_a_max_time_of_bare_minutes_is_refused_as_ambiguous(tmp_path):
    # Slurm reads "90" as minutes; a number is seconds: it was read as 90 s, silently
    with pytest.raises(ValueError, match=r"`max_time` = '90' \(keyword\) is ambiguous: Slurm reads it as 90 minutes, "
                                         r"a number is seconds\. Give 5400 \(seconds\) or \"1:30:00\" for minutes"):
        jn.Nitro(Tiny(), run_dir=tmp_path, max_time="90", logger=None)


@pytest.mark.parametrize("name", ["max_steps", "val_every_n_steps"])
def test_bad_step_knobs_are_refused(tmp_path, name):
    with pytest.raises(ValueError, match=name):
        jn.Nitro(Tiny(), run_dir=tmp_path, logger=None, **{name: 0})


def test_val_every_n_steps_without_a_val_split_is_refused(tmp_path):
    # it trained, closing rows of train_loss alone every N steps, and validated nothing
    with pytest.raises(ValueError, match=r"val_every_n_steps=4 \(keyword\) validates the `val` split every that many "
                                         r"steps, but the data has no `val` split \(splits: \['train'\]\)"):
        jn.Nitro(Tiny(), data={"train": tiny_data()["train"]}, run_dir=tmp_path, logger=None, max_steps=8,
                 val_every_n_steps=4)


# -- SIGKILL mid-run, resume, bitwise --------------------------------------------------------


CASES = {
    "k1": {},
    "k1-3-workers": {"workers": 3},
    "k4-accum2": {"k": 4, "accum": 2},
    "grain-stream": {"stream": "grain"},  # one epoch of 600 batches, resumed from grain's iterator state
}


@pytest.mark.slow  # a child process per case (~6 s each)
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_sigkilled_run_resumes_bitwise(tmp_path, case):
    opts = CASES[case]
    at = random.Random(case).randint(250, 450)
    killed = tmp_path / "killed"
    killed.mkdir()
    proc = child(killed, at, opts)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    resumed = jn.Nitro(LongRun(), run_dir=killed, resume="auto", logger="jsonl", **keywords(opts))
    # saves are paced (min_interval="auto": writes take <= 5% of the run), so the newest one on
    # disk may be older than the last one due
    assert resumed.step == at // 100 * 100
    if opts.get("stream"):  # the checkpoint holds the stream's iterator state after its last trained batch
        saved = resumed.plan.weights_meta["data_position"]["stream_state"]
        assert saved["state"]["batches"] == resumed.step
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        resumed.train()
    assert not [w for w in record if "from its start again" in str(w.message)]  # nothing read again
    straight = jn.train(LongRun(), run_dir=tmp_path / "straight", logger="jsonl", **keywords(opts))
    assert straight.step == resumed.step == 600
    assert_same_state(resumed, straight)
    assert resumed.rows == straight.rows[-len(resumed.rows):]
    assert [r["step"] for r in straight.rows] == [100, 200, 300, 400, 500, 600]
    (folder,) = [p for p in killed.iterdir() if p.is_dir()]
    (ref,) = [p for p in (tmp_path / "straight").iterdir() if p.is_dir()]
    assert train_lines(folder) == train_lines(ref)  # every logged train value, each step once


@pytest.mark.slow
def test_sigterm_preempts_with_exit_code_143_and_requeue_continues(tmp_path):
    opts = {"sigterm": True}
    proc = child(tmp_path, 333, opts)
    assert proc.returncode == 143, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    finish = [r for r in jn.read_jsonl(folder / "metrics.jsonl") if r.get("kind") == "finish"]
    assert finish[-1]["status"] == "preempted"
    requeued = child(tmp_path, 0, {**opts, "resume": True})
    assert requeued.returncode == 0, requeued.stderr[-3000:]
    assert [p for p in tmp_path.iterdir() if p.is_dir()] == [folder]  # the same run, continued
    finish = [r for r in jn.read_jsonl(folder / "metrics.jsonl") if r.get("kind") == "finish"]
    assert [f["status"] for f in finish] == ["preempted", "done"]
    assert sorted(train_lines(folder)) == list(range(1, 601))


# -- the horizon rule ----------------------------------------------------------------------------


def test_a_longer_resumed_run_must_say_which_horizon_its_schedules_follow(tmp_path):
    import optax

    sched = {"learning_rate": lambda total: optax.linear_schedule(1e-2, 0.0, total)}
    kw = dict(run_dir=tmp_path, schedules=sched, checkpointer=jn.Checkpointer(keep=jn.Last(1), asynchronous=False),
              logger=None)
    first = jn.train(Tiny(), max_epochs=2, **kw)
    with pytest.raises(ValueError, match=r'planned over 12 optimizer steps, but it plans 24.*schedule_horizon="saved"'):
        jn.Nitro(Tiny(), resume="auto", max_epochs=4, **kw)
    same = jn.Nitro(Tiny(), resume="auto", max_epochs=2, **kw)  # the same horizon: nothing to decide
    assert same.step == first.step == 12

    def rates(nitro):
        got = {}

        class Rates:
            @jn.hookimpl
            def jaxnitro_steps_read(self, run, stretch):
                for step, _, line in stretch.lines():
                    got[step] = line["schedule/default/learning_rate"]

        from jaxnitro.plugin_manager import plugin_manager

        plugin_manager().register(Rates(), name="rates")
        try:
            nitro.train()
        finally:
            plugin_manager().unregister(name="rates")
        return got

    saved = rates(jn.Nitro(Tiny(), resume="auto", max_epochs=4, schedule_horizon="saved", **kw))
    # the original 12-step curve's last value (its step 12), held: no jump at the seam
    assert saved[13] == saved[24] == pytest.approx(1e-2 / 12)
    # that job again, finished, without the knob: nothing to train, nothing to decide (it was refused)
    with pytest.warns(RuntimeWarning, match="nothing to train"):
        assert jn.Nitro(Tiny(), resume="auto", max_epochs=4, **kw).train().step == 24
    kw["run_dir"] = tmp_path / "again"
    jn.train(Tiny(), max_epochs=2, **kw)
    new = rates(jn.Nitro(Tiny(), resume="auto", max_epochs=4, schedule_horizon="new", **kw))
    assert new[13] == pytest.approx(1e-2 * (1 - 12 / 24))  # re-planned over 24 steps


def test_a_plugin_sees_the_steps_it_asked_for(tmp_path):
    seen = []

    class Marks:
        @jn.hookimpl
        def jaxnitro_step_period(self, run):
            return (3, 7)

        @jn.hookimpl
        def jaxnitro_step_boundary(self, run, step, epoch):
            seen.append((step, epoch, run.nitro.step))

    from jaxnitro.plugin_manager import plugin_manager

    plugin_manager().register(Marks(), name="marks")
    try:
        jn.train(Tiny(), run_dir=tmp_path, logger=None, steps_per_dispatch=4)
    finally:
        plugin_manager().unregister(name="marks")
    assert seen == [(3, 1, 3), (7, 2, 7)]  # the state there is that step's (blocks cut to reach it)


# -- streams without len() ---------------------------------------------------------------------


class _Stream:
    """Tiny's train batches as a stream: iterable again for every epoch, no len(), no batch_at."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)


def _stream_data():
    d = tiny_data()
    return {"train": _Stream(d["train"]), "val": d["val"]}


@pytest.mark.parametrize("k", [1, 4])
def test_a_stream_trains_by_steps_like_the_same_batches_with_len(tmp_path, k):
    kw = dict(run_dir=tmp_path, max_steps=15, max_epochs=None, logger=None, steps_per_dispatch=k)
    sized = jn.train(Tiny(), **kw)  # 6 batches an epoch
    streamed = jn.train(Tiny(), data=_stream_data(), **kw)
    assert streamed.step == sized.step == 15
    assert_same_state(streamed, sized)
    assert [(r["epoch"], r["step"]) for r in streamed.rows] == [(1, 6), (2, 12), (3, 15)]
    assert streamed.rows == sized.rows


def test_a_stream_without_max_steps_is_refused_naming_the_fix(tmp_path):
    with pytest.raises(ValueError, match=r"stream without len\(\).*max_steps=N"):
        jn.Nitro(Tiny(), data=_stream_data(), run_dir=tmp_path, logger=None)
    # an explicit max_epochs beside max_steps was silently ignored (the run went on for max_steps)
    with pytest.raises(ValueError, match=r"max_epochs=1 \(keyword\) cannot bound the run: the `train` split is a "
                                         r"stream without len\(\) \(_Stream\).*Pass max_epochs=None \(max_steps=50"):
        jn.Nitro(Tiny(), data=_stream_data(), run_dir=tmp_path, logger=None, max_steps=50, max_epochs=1)


def test_a_one_shot_generator_is_refused_and_an_empty_epoch_too(tmp_path):
    d = tiny_data()
    # it said "a data source must have len() ... Define __len__ on it", which a generator cannot
    with pytest.raises(TypeError, match=r"^jaxnitro: .*generator.* is an iterator, read once: its second epoch would be "
                                        r"empty\. A stream without len\(\) \(in a run bounded by max_steps\) must be "
                                        r"an iterable whose __iter__ starts a new pass"):
        jn.train(Tiny(), data={"train": (b for b in d["train"])}, run_dir=tmp_path, max_steps=20, logger=None)

    class Once:  # iterable, but its second pass is empty
        def __init__(self):
            self.passes = 0

        def __iter__(self):
            self.passes += 1
            return iter(d["train"] if self.passes <= 2 else [])  # setup reads the first pass

    with pytest.raises(ValueError, match=r"yielded no batch in epoch \d.*read\s+again"):
        jn.train(Tiny(), data={"train": Once()}, run_dir=tmp_path, max_steps=20, max_epochs=None, logger=None)


def test_a_stream_resumes_mid_epoch_by_reading_again_with_a_warning(tmp_path):
    ckpt = jn.Checkpointer(keep=jn.Last(1), asynchronous=False)
    kw = dict(max_steps=15, max_epochs=None, checkpointer=ckpt, logger=None)
    straight = jn.train(Tiny(), data=_stream_data(), run_dir=tmp_path / "a", **kw)
    stopping = _stream_data()
    stopping["train"] = _PreemptingStream(stopping["train"].batches, at=9)
    with pytest.raises(jn.Preempted):
        jn.train(Tiny(), data=stopping, run_dir=tmp_path / "b", **kw)
    resumed = jn.Nitro(Tiny(), data=_stream_data(), run_dir=tmp_path / "b", resume="auto", **kw)
    assert 6 < resumed.step < 12
    with pytest.warns(UserWarning, match=r"reads epoch 2 from its start again and drops its first \d+ batches"):
        resumed.train()
    assert_same_state(resumed, straight)
    assert resumed.rows == straight.rows[-len(resumed.rows):]
    # the same stream resumed with another accum or batch size: refused (it skipped the wrong
    # number of batches, silently: a stream has no steps per epoch to compare)
    with pytest.raises(ValueError, match=r"saved by a run with accum of 1; this handle has 2\..*same batches"):
        jn.Nitro(Tiny(), data=_stream_data(), run_dir=tmp_path / "b", resume="auto", **dict(kw, accum=2))
    halves = {"train": _Stream(tiny_data(batch=8)["train"]), "val": tiny_data()["val"]}
    with pytest.raises(ValueError, match=r"with a train batch size of 16; this handle has 8\..*resume with a train "
                                         r"batch size of 16, or use `weights=`"):
        jn.Nitro(Tiny(), data=halves, run_dir=tmp_path / "b", resume="auto", **kw)


def test_a_sized_source_resumed_with_other_steps_per_epoch_is_refused(tmp_path):
    kw = dict(run_dir=tmp_path, logger=None, checkpointer=jn.Checkpointer(keep=jn.Last(1), asynchronous=False))
    jn.train(Tiny(), max_epochs=1, **kw)
    with pytest.raises(ValueError, match=r"saved by a run with optimizer steps per epoch \(the train split and `accum`\) "
                                         r"of 6; this handle has 3\..*or use `weights=`"):
        jn.Nitro(Tiny(), resume="auto", accum=2, **kw)


class _PreemptingStream(_Stream):
    """A stream that requests a preemption when its ``at``-th batch overall is read."""

    def __init__(self, batches, at):
        super().__init__(batches)
        self.at, self.read = at, 0

    def __iter__(self):
        from jaxnitro.interrupts import request

        for b in self.batches:
            self.read += 1
            if self.read == self.at:
                request.status = "preempted"
            yield b


# -- steps_per_dispatch="auto" -----------------------------------------------------------------


def test_auto_chooses_k_from_the_step_time():
    from jaxnitro.dispatch import DISPATCH_BOUND, choose_k

    assert choose_k(0.0005) == 64  # 64 steps in 32 ms
    assert choose_k(0.004) == 16  # 16 x 4 ms = 64 ms <= 100 ms; 32 would take 128
    assert choose_k(0.03) == 1  # 2 steps fit: not worth a block program
    assert choose_k(DISPATCH_BOUND) == 1


def test_auto_prefers_a_k_that_divides_the_recurring_segment():
    """A k that divides the steps between cuts leaves no remainder to dispatch one step at a
    time; it is chosen from between half the power of two and what the bound allows."""
    from jaxnitro.book import EventBook
    from jaxnitro.dispatch import choose_k

    assert choose_k(0.0005, 550) == 55  # not 64: 8 blocks + 38 single steps an epoch
    assert choose_k(0.0005, 1000) == 50 and choose_k(0.0005, 128) == 64
    assert choose_k(0.0005, 997) == 64  # a prime: no divisor in 32..64, the power of two
    assert choose_k(0.004, 550) == 25  # 25 x 4 ms is the 100 ms bound, 16 is the power of two
    assert choose_k(0.03, 550) == 1
    assert EventBook(550, 5500).period() == 550
    assert EventBook(550, 5500, val_every=200, periods=(1000,)).period() == 50
    assert EventBook(None, 600).period() is None and EventBook(None, 600, periods=(100,)).period() == 100


def test_auto_is_bitwise_equal_to_one_step_a_dispatch_and_keeps_its_choice(tmp_path):
    from long_run_child import data

    kw = dict(run_dir=tmp_path, max_steps=150, max_epochs=None, val_every_n_steps=50, logger=None)
    ref = jn.train(LongRun(), data=data(), steps_per_dispatch=1, **kw)
    auto = jn.train(LongRun(), data=data(), steps_per_dispatch="auto", **kw)
    assert_same_state(auto, ref)
    assert auto.rows == ref.rows
    plan = auto.plan
    chosen = plan.programs.train_block(plan.opt_spec, plan.tx, jax.tree_util.tree_structure(auto.opt_state)).meta["auto_k"]
    assert isinstance(chosen, int) and chosen >= 1
    again = jn.train(LongRun(), data=data(), steps_per_dispatch="auto", **kw)  # starts at the kept k
    assert_same_state(again, ref)


def test_auto_does_not_probe_a_run_whose_last_step_would_end_the_probe(tmp_path):
    """The probe's last mark is 40 steps after the start: a 40-step run would choose k at its
    last step, and the next run of the same programs would compile the block program (a study's
    second trial, say). Such a run is dispatched one step at a time and chooses nothing."""
    from long_run_child import data

    class Short(LongRun):  # programs of its own: the compile cache shares them between handles
        pass

    kw = dict(run_dir=tmp_path, max_steps=40, max_epochs=None, logger=None)
    first = jn.train(Short(), data=data(), steps_per_dispatch="auto", **kw)
    plan = first.plan
    block = plan.programs.train_block(plan.opt_spec, plan.tx, jax.tree_util.tree_structure(first.opt_state))
    assert "auto_k" not in block.meta and block.traces == 0
    again = jn.train(Short(), data=data(), steps_per_dispatch="auto", **kw)
    assert block.traces == 0
    assert_same_state(again, first)


def test_a_bad_steps_per_dispatch_names_auto(tmp_path):
    with pytest.raises(ValueError, match=r'steps_per_dispatch.*or "auto"'):
        jn.Nitro(Tiny(), run_dir=tmp_path, steps_per_dispatch="fast", logger=None)
