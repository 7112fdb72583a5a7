"""A stop at a history row's end before that row's validation (SIGTERM, Ctrl-C, ``max_time``)
writes a run-end checkpoint at that step and leaves the row open; the resumed run validates the
row first. That checkpoint holds exactly the validated parameters, so from then on it is the
epoch-end checkpoint the uninterrupted run wrote there: ``keep``'s ``Best`` ranks it, ``"best"``
and ``restore_best`` select it, also after the folder is opened again."""

from __future__ import annotations

import json
import types
from pathlib import Path

import jax
import numpy as np
import pytest

import jaxnitro as jn
from jaxnitro.checkpointers import orbax as orbax_checkpointer
from tiny import Tiny

KEEP = (jn.Best(1), jn.Last(1))


@jn.experiment
class FallingLoss(Tiny):
    """The val loss falls every epoch: the newest validated row is the best one."""

    def monitor(self):
        return ("loss", "min")


@jn.experiment
class FirstIsBest(Tiny):
    """Ranked by the val loss, highest first: the val loss falls, so epoch 1 is the best one."""

    def monitor(self):
        return ("loss", "max")


@jn.experiment
class AllTie(Tiny):
    """A monitored metric that is the same every epoch: the earliest epoch is the best one."""

    def metrics(self, logits, *, y):
        return {"score": (float(len(y)), len(y))}  # 1.0 whatever the weights

    def monitor(self):
        return ("score", "max")


class _StopBeforeValidation:
    """Requests a preemption as epoch ``at``'s last step is trained: honoured at that row's end,
    before its validation (the row stays open)."""

    def __init__(self, at: int):
        self.at = at

    @jn.hookimpl
    def jaxnitro_epoch_trained(self, run, epoch, step, stats):
        if epoch == self.at:
            from jaxnitro.interrupts import request

            request.status = "preempted"


def _kw(max_epochs):
    return dict(max_epochs=max_epochs, logger=None, checkpointer=jn.Checkpointer(keep=KEEP, asynchronous=False))


def _folder(root: Path) -> Path:
    (run,) = [p for p in root.iterdir() if p.is_dir() and p.name[0] == "2"]
    return run


def _kept(root: Path) -> list[int]:
    return sorted(int(p.name) for p in (_folder(root) / "checkpoints").iterdir() if p.name.isdigit())


def _record(root: Path, step: int) -> dict:
    return json.loads((_folder(root) / "checkpoints" / str(step) / "meta" / "metadata").read_text())


def _best(cls, root: Path):
    return jn.Nitro(cls(), data={}, weights=(str(_folder(root)), "best"), run_dir=root, logger=None)


def _same_params(a, b) -> None:
    for x, y in zip(jax.tree_util.tree_leaves(a.params), jax.tree_util.tree_leaves(b.params), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _straight_and_stopped(tmp_path, cls, cut: int, max_epochs: int):
    """The uninterrupted run (``tmp_path/a``), and the same run stopped at epoch ``cut``'s end before
    its validation (``tmp_path/b``), not yet resumed: the handle and the stop step."""
    from jaxnitro.plugin_manager import plugin_manager

    straight = jn.train(cls(), run_dir=tmp_path / "a", **_kw(max_epochs))
    plugin_manager().register(_StopBeforeValidation(cut), name="stop-before-validation")
    try:
        with pytest.raises(jn.Preempted):
            jn.train(cls(), run_dir=tmp_path / "b", **_kw(max_epochs))
    finally:
        plugin_manager().unregister(name="stop-before-validation")
    stop = straight.rows[cut - 1]["step"]
    record = _record(tmp_path / "b", stop)
    assert record["end"] == "preempted" and record["metrics"] is None and record["progress"]["open_row"]
    return straight, stop


def test_a_stop_before_the_last_rows_validation_keeps_and_loads_the_uninterrupted_runs_best(tmp_path):
    """The trial's repro: the last row is the best and the stop came before its validation. The
    resumed run validates it and trains nothing more: it keeps what the uninterrupted run kept
    (the run-end checkpoint, now ranked, displaces the earlier best) and "best" loads it."""
    straight, stop = _straight_and_stopped(tmp_path, FallingLoss, cut=3, max_epochs=3)
    losses = [r["loss"] for r in straight.rows]
    assert losses == sorted(losses, reverse=True) and stop == 18  # the last row is the best
    resumed = jn.Nitro(FallingLoss(), run_dir=tmp_path / "b", resume="auto", **_kw(3)).train()
    assert resumed.rows == straight.rows[2:]
    assert _kept(tmp_path / "b") == _kept(tmp_path / "a") == [18]
    a, b = _best(FallingLoss, tmp_path / "a"), _best(FallingLoss, tmp_path / "b")
    assert a.plan.weights_meta["step"] == b.plan.weights_meta["step"] == 18
    assert f"best loss={straight.rows[-1]['loss']:.6g}" in b.plan.weights_from
    _same_params(a, b)
    latest = jn.Nitro(FallingLoss(), data={}, weights=("latest", "best"), run_dir=tmp_path / "b", logger=None)
    assert latest.plan.weights_meta["step"] == 18
    # its record is now the uninterrupted run's epoch-end record at that step
    amended, plain = _record(tmp_path / "b", 18), _record(tmp_path / "a", 18)
    assert amended["validated_after"] == "preempted"
    for key in ("step", "epoch", "epoch_complete", "data_position", "metrics", "end", "progress", "validated", "items"):
        assert amended[key] == plain[key], key


def test_the_stopped_rows_checkpoint_stays_the_best_through_later_epochs_and_another_resume(tmp_path):
    """The best row is the one cut before its validation, and later epochs follow: the resumed
    run's Best(1) keeps that checkpoint as the uninterrupted run's does, "best" and
    restore_best load it, and a run that opens the folder again (another resume) ranks it."""
    straight, stop = _straight_and_stopped(tmp_path, FirstIsBest, cut=1, max_epochs=3)
    losses = [r["loss"] for r in straight.rows]
    assert losses == sorted(losses, reverse=True) and stop == 6  # the val loss falls: epoch 1 ranks first
    resumed = jn.Nitro(FirstIsBest(), run_dir=tmp_path / "b", resume="auto", **_kw(3)).train()
    assert resumed.rows == straight.rows
    assert _kept(tmp_path / "b") == _kept(tmp_path / "a") == [6, 18]
    a, b = _best(FirstIsBest, tmp_path / "a"), _best(FirstIsBest, tmp_path / "b")
    assert a.plan.weights_meta["step"] == b.plan.weights_meta["step"] == 6
    _same_params(a, b)
    best = jn.Nitro(FirstIsBest(), run_dir=tmp_path / "b", resume="auto", restore_best=True, logger=None)
    assert best.step == 6 and best.plan.weights_meta["end"] is None
    # another resume of both folders, one epoch longer: the folder is opened again
    for root in (tmp_path / "a", tmp_path / "b"):
        jn.Nitro(FirstIsBest(), run_dir=root, resume="auto", **_kw(4)).train()
    assert _kept(tmp_path / "b") == _kept(tmp_path / "a") == [6, 24]
    a, b = _best(FirstIsBest, tmp_path / "a"), _best(FirstIsBest, tmp_path / "b")
    assert a.plan.weights_meta["step"] == b.plan.weights_meta["step"] == 6
    _same_params(a, b)


def test_a_stopped_row_that_ties_the_later_ones_is_the_best_as_the_earliest_of_the_tie(tmp_path):
    """Every epoch ties: the earliest is the best (the history's rule), here the one whose
    validation came after the resume."""
    straight, stop = _straight_and_stopped(tmp_path, AllTie, cut=1, max_epochs=3)
    assert [r["score"] for r in straight.rows] == [1.0] * 3 and straight.history().best_epoch == 1
    resumed = jn.Nitro(AllTie(), run_dir=tmp_path / "b", resume="auto", **_kw(3)).train()
    assert resumed.history().best_epoch == 1
    assert _kept(tmp_path / "b") == _kept(tmp_path / "a") == [6, 18]
    a, b = _best(AllTie, tmp_path / "a"), _best(AllTie, tmp_path / "b")
    assert a.plan.weights_meta["step"] == b.plan.weights_meta["step"] == 6
    _same_params(a, b)


def test_a_record_that_cannot_be_rewritten_is_ranked_from_the_newer_checkpoints_records(tmp_path, monkeypatch):
    """When the stopped row's record cannot be rewritten (a full disk), the run says so; its
    `keep` ranks the checkpoint all the same, and the newer checkpoints' `validated` records
    name that validation: "best" and a run opening the folder again rank it from them."""
    straight, stop = _straight_and_stopped(tmp_path, FirstIsBest, cut=1, max_epochs=3)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(orbax_checkpointer, "json", types.SimpleNamespace(load=json.load, dumps=full_disk),
                        raising=False)
    with pytest.warns(RuntimeWarning, match=r"could not be given that row's metrics: OSError.*No space left"):
        jn.Nitro(FirstIsBest(), run_dir=tmp_path / "b", resume="auto", **_kw(3)).train()
    monkeypatch.undo()
    assert _record(tmp_path / "b", 6)["end"] == "preempted"  # not rewritten
    assert [v[2] for v in _record(tmp_path / "b", 18)["validated"]["values"]] == [6, 12, 18]
    assert _kept(tmp_path / "b") == _kept(tmp_path / "a") == [6, 18]
    a, b = _best(FirstIsBest, tmp_path / "a"), _best(FirstIsBest, tmp_path / "b")
    assert a.plan.weights_meta["step"] == b.plan.weights_meta["step"] == 6
    _same_params(a, b)
    for root in (tmp_path / "a", tmp_path / "b"):
        jn.Nitro(FirstIsBest(), run_dir=root, resume="auto", **_kw(4)).train()
    assert _kept(tmp_path / "b") == _kept(tmp_path / "a") == [6, 24]
    assert _best(FirstIsBest, tmp_path / "b").plan.weights_meta["step"] == 6


def test_only_a_stopped_rows_run_end_checkpoint_is_ranked_from_later_records():
    """What the newer records rank: a run-end checkpoint without metrics at a validated step
    (the newest record's value; the earliest of a tie stays first by step order); never a
    diverged one, one whose record has metrics, or one named only by old ``[epoch, value]``
    entries."""
    validated = {"name": "loss", "values": [[1, 0.5, 6], [2, 0.25, 12], [3, "nan", 18], [4, 0.1]]}
    records = {
        6: {"step": 6, "end": "preempted", "metrics": None},
        12: {"step": 12, "end": "diverged", "metrics": None},
        18: {"step": 18, "end": "interrupted", "metrics": None},
        24: {"step": 24, "end": "preempted", "metrics": None},  # only an [epoch, value] entry
        30: {"step": 30, "end": None, "metrics": {"loss": 0.1}, "validated": validated},
    }
    ranked = orbax_checkpointer._ranked_records(records)
    assert ranked[6]["end"] is None and ranked[6]["metrics"] == {"loss": 0.5}
    assert ranked[6]["validated_after"] == "preempted"
    assert ranked[12] == records[12]  # diverged: never ranked
    assert ranked[18]["end"] is None and ranked[18]["metrics"] == {}  # validated, but no finite value
    assert ranked[24] == records[24] and ranked[30] == records[30]


def test_a_stop_at_a_validation_between_checkpoint_steps_keeps_the_uninterrupted_runs_checkpoints(tmp_path):
    # every_n_steps=6, a validation every 4 steps: a stop at step 8's validation writes a run-end
    # checkpoint at 8, which the uninterrupted run never saved: it must not be ranked (it displaced
    # a kept one, and "best" loaded it)
    import os
    import signal

    from jaxnitro.plugin_manager import plugin_manager

    class TermAt8:
        sent = False

        @jn.hookimpl
        def jaxnitro_steps_read(self, run, stretch):
            if not self.sent and stretch.first_step + len(stretch) - 1 >= 8:
                self.sent = True
                os.kill(os.getpid(), signal.SIGTERM)

    def kw():
        return dict(max_steps=24, max_epochs=None, val_every_n_steps=4, logger=None, steps_per_dispatch=1,
                    checkpointer=jn.Checkpointer(every_n_steps=6, keep=(jn.Best(2), jn.Last(1)), asynchronous=False))

    straight = jn.train(FirstIsBest(), run_dir=tmp_path / "a", **kw())
    plugin_manager().register(TermAt8(), name="term-at-8")
    try:
        with pytest.raises(jn.Preempted):
            jn.train(FirstIsBest(), run_dir=tmp_path / "b", **kw())
    finally:
        plugin_manager().unregister(name="term-at-8")
    assert 8 in _kept(tmp_path / "b")  # the stop's run-end checkpoint
    resumed = jn.Nitro(FirstIsBest(), run_dir=tmp_path / "b", resume="auto", **kw()).train()
    assert resumed.rows == straight.rows[-len(resumed.rows):]
    assert _kept(tmp_path / "b") == _kept(tmp_path / "a")
    assert _best(FirstIsBest, tmp_path / "b").plan.weights_meta["step"] == _best(FirstIsBest, tmp_path / "a").plan.weights_meta["step"]
