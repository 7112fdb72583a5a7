"""State is data (issue 19, item 1): the run's changing state is one object the loop owns
(``run.run_state``), and a checkpoint serializes its snapshot (``jaxnitro.plugin.SavedRun``):
the built-in orbax checkpointer and a third-party one get the same object, and a mid-epoch
resume from it is bitwise the uninterrupted run."""

from __future__ import annotations

import dataclasses
import os
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest

import jaxnitro as jn
import jaxnitro.plugin as P
from jaxnitro.plugin_manager import plugin_manager
from plugin_dist import installed_plugin
from test_long_runs import assert_same_state, leaves, train_lines
from tiny import Tiny

# accum=2 over Tiny's 6 batches: 3 optimizer steps an epoch, 4 epochs (12 steps)
KW = dict(accum=2, max_epochs=4)

THIRD_PARTY = textwrap.dedent(
    '''
    """A third-party checkpointer: keeps the run's snapshot every `every` steps, in memory."""
    import dataclasses

    import jax

    from jaxnitro.plugin import hookimpl, owns_knob

    SAVED = []


    class Snapshots:
        def __init__(self, every):
            self.every = every


    @hookimpl
    def jaxnitro_accept_knob(name, value, nitro):
        return True if name == "checkpointer" and isinstance(value, Snapshots) else None


    @hookimpl
    def jaxnitro_step_period(run):
        return run.settings.checkpointer.every if owns_knob(run, "checkpointer", __name__) else None


    @hookimpl
    def jaxnitro_step_boundary(run, step, epoch):
        if owns_knob(run, "checkpointer", __name__):
            saved = run.run_state.snapshot()
            # its own host copy: the loop's next step donates the published arrays
            SAVED.append(dataclasses.replace(saved, state=jax.device_get(saved.state)))
    '''
)


@pytest.fixture
def third_party(tmp_path):
    with installed_plugin(tmp_path / "site", module="jaxnitro_runstate_testplugin", source=THIRD_PARTY,
                          dist="jaxnitro-runstate-test", entry="runstate_test") as plugin:
        yield plugin


def test_a_third_party_checkpointer_gets_the_run_state_at_mid_epoch_steps(tmp_path, third_party):
    n = jn.train(Tiny(), run_dir=tmp_path, logger="jsonl", checkpointer=third_party.Snapshots(every=5), **KW)
    assert n.step == 12 and not os.path.exists(os.path.join(n.run_dir, "checkpoints"))  # orbax left it alone
    first, second = third_party.SAVED
    assert isinstance(first, P.SavedRun) and isinstance(second, P.SavedRun)
    # step 5: epoch 2's second step (4 of its micro-batches read), epoch 1's row closed
    assert (first.step, first.state.step, first.state.epoch) == (5, 5, 2)
    assert first.data_position == {"epoch": 2, "steps_into_epoch": 2, "batches_into_epoch": 4, "epoch_complete": False}
    assert [r["step"] for r in first.rows] == [3] and first.row is None
    assert first.rows[0] == n.rows[0]
    # the open row: steps 4 and 5's read scalars ([loss] each), the losses the steps logged
    lines = train_lines(Path(n.run_dir))
    assert first.open_row == [[lines[4]["loss"]], [lines[5]["loss"]]]
    # step 10: epoch 4's first step, three rows closed, one step in the open row
    assert (second.step, second.state.epoch) == (10, 4)
    assert second.data_position == {"epoch": 4, "steps_into_epoch": 1, "batches_into_epoch": 2, "epoch_complete": False}
    assert [r["step"] for r in second.rows] == [3, 6, 9] and second.open_row == [[lines[10]["loss"]]]
    # the row epoch 2 closed averages the open row's steps and the one after it
    np.testing.assert_allclose(n.rows[1]["train_loss"], np.mean([lines[s]["loss"] for s in (4, 5, 6)]), rtol=1e-6)


def test_the_snapshot_is_what_orbax_writes_and_a_mid_epoch_resume_from_it_is_bitwise_the_straight_run(tmp_path):
    straight = jn.train(Tiny(), run_dir=tmp_path / "a", logger=None, **KW)
    ckpt = jn.Checkpointer(every_n_steps=5, asynchronous=False)
    taken = []

    class CutAtFive:
        @jn.hookimpl
        def jaxnitro_step_boundary(self, run, step, epoch):
            saved = run.run_state.snapshot()
            taken.append(dataclasses.replace(saved, state=jax.device_get(saved.state)))
            run.request_stop("cut at step 5")

    plugin_manager().register(CutAtFive(), name="cut-at-five")
    try:
        first = jn.train(Tiny(), run_dir=tmp_path / "b", logger=None, checkpointer=ckpt, **KW)
    finally:
        plugin_manager().unregister(name="cut-at-five")
    (saved,) = taken
    assert first.step == saved.step == 5 and first.stop_reason == "cut at step 5"
    assert len(saved.rows) == 1 and len(saved.open_row) == 2

    resumed = jn.Nitro(Tiny(), run_dir=tmp_path / "b", resume="auto", logger=None, checkpointer=ckpt, **KW)
    meta = resumed.plan.weights_meta  # the record orbax wrote from the snapshot (format unchanged)
    assert (meta["step"], meta["epoch"], meta["epoch_complete"], meta["metrics"]) == (5, 2, False, None)
    assert meta["data_position"] == {"epoch": 2, "steps_into_epoch": 2, "batches_into_epoch": 4}
    assert meta["progress"]["open_row"] == saved.open_row
    # what the resume puts back is the snapshot's position and open row, and its state
    point = resumed.plan.resumed
    assert (point.data_position, point.open_row) == (saved.data_position, saved.open_row)
    assert (resumed.step, resumed.epoch) == (saved.step, saved.state.epoch)
    for a, b in zip(leaves(resumed.params), leaves(saved.state.params), strict=True):
        np.testing.assert_array_equal(a, b)
    resumed.train()
    assert_same_state(resumed, straight)
    # epoch 2's row averages steps 4-6 across the cut: the rows are the straight run's
    assert resumed.rows == straight.rows[1:]


def test_the_handle_keeps_one_run_state_that_training_changes(tmp_path):
    """The state lives in the handle's one RunState: `nitro.state` reads it, the loop publishes
    into it (no copy kept anywhere else), and the same object serves every later train()."""
    from tiny import tiny_data

    n = jn.Nitro(Tiny(), data=tiny_data(), run_dir=tmp_path, logger=None, **KW)
    run_state = n.run_state
    assert run_state.state is n.state and run_state.record is n.record and run_state.position is None
    n.train()
    assert n.run_state is run_state and run_state.state is n.state and n.state.step == 12
    saved = run_state.snapshot()
    assert saved.step == 12 and saved.rows == tuple(n.rows) and len(saved.rows) == 4
    assert saved.data_position["epoch"] == 4 and saved.data_position["epoch_complete"] and saved.open_row == []
    n.state = n.state.replace(epoch=9)  # what the loop does as an epoch begins
    assert run_state.state.epoch == 9 == n.epoch
