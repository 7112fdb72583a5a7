"""State is data (issue 19, item 1): what setup produces is frozen and made once; a verb that
needs another plan makes a new one and the handle keeps it; late facts do not write into it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import jaxnitro as jn
import jaxnitro.knobs as knobs
import jaxnitro.state as state
from tiny import fresh_tiny, tiny_data

QUIET = dict(logger=None)


def test_plan_and_settings_refuse_assignment(tmp_path):
    n = jn.Nitro(fresh_tiny("Frozen")(), run_dir=tmp_path, **QUIET)
    with pytest.raises(dataclasses.FrozenInstanceError):
        n.plan.width = 32
    with pytest.raises(dataclasses.FrozenInstanceError):
        n.plan.weights_from = "elsewhere"
    with pytest.raises(dataclasses.FrozenInstanceError):
        n.settings.accum = 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        n.settings.monitor = ("acc", "max")
    assert n.plan.width == 16 and n.settings.accum == 1 and n.plan.weights_from == "build_model (seed 0)"


def test_setup_makes_one_plan_and_one_settings(tmp_path, monkeypatch):
    made = {"Plan": 0, "Settings": 0}
    for cls in (state.Plan, knobs.Settings):
        init = cls.__init__

        def counted(self, *args, _init=init, _name=cls.__name__, **kwargs):
            made[_name] += 1
            _init(self, *args, **kwargs)

        monkeypatch.setattr(cls, "__init__", counted)
    n = jn.Nitro(fresh_tiny("MadeOnce")(), run_dir=tmp_path, **QUIET)
    assert made == {"Plan": 1, "Settings": 1}
    assert n.plan.opt_spec is not None and n.plan.layout is not None and n.plan.programs.layout is n.plan.layout


def test_training_keeps_the_plan_object_and_reads_the_memory_report_through_it(tmp_path):
    n = jn.Nitro(fresh_tiny("KeepsPlan")(), run_dir=tmp_path, **QUIET)
    plan, settings = n.plan, n.settings
    assert plan.memory is None
    n.train()
    # the memory preflight's report is kept with the programs it measured, not written into the plan
    assert n.plan is plan and n.settings is settings and n.status == "done"
    assert plan.memory is n.plan.programs.memory and plan.memory.needed > 0
    assert "memory per device" in str(n)


def test_the_first_prediction_makes_a_new_plan_with_the_same_programs(tmp_path):
    E = fresh_tiny("Bare")
    trained = jn.Nitro(E(), run_dir=tmp_path, **QUIET)
    bare = jn.Nitro(E(), run_dir=tmp_path, data={}, **QUIET)
    before = bare.plan
    assert before.width is None
    x = tiny_data()["val"][0]["x"]
    misses = jn.cache_stats().misses
    out = bare.predict({"x": x[:5]})
    after = bare.plan
    # a new plan, the old one untouched; every other field the same objects
    assert after is not before and before.width is None and after.width == 5
    assert after == dataclasses.replace(before, width=5)
    assert after.programs is before.programs and after.hooks is before.hooks and after.routes is before.routes
    np.testing.assert_allclose(out, trained.predict({"x": x[:5]}), rtol=1e-6)
    compiled = jn.cache_stats().misses - misses  # the forward at width 5 (bare) and 16 (trained)
    assert bare.predict({"x": x[:3]}).shape == (3, 4)  # padded to 5: the same program, the same plan
    assert bare.plan is after and jn.cache_stats().misses - misses == compiled
    with pytest.raises(ValueError, match="wider than the compiled batch width 5"):
        bare.predict({"x": x[:6]})
    assert bare.plan is after


def test_a_resumed_handle_has_its_resume_point_in_the_plan_it_was_built_with(tmp_path):
    E = fresh_tiny("Resumed", max_epochs=1)
    first = jn.train(E(), run_dir=tmp_path, checkpointer=jn.Checkpointer(), **QUIET)
    resumed = jn.Nitro(E(), run_dir=tmp_path, resume=True, max_epochs=2, **QUIET)
    plan = resumed.plan
    assert plan.resumed.step == first.step and plan.resumed.run_folder == first.run_dir
    assert plan.weights_meta["step"] == first.step and plan.weights_from.startswith("resumed from")
    resumed.train()
    assert resumed.plan is plan and resumed.step == 2 * first.step


def test_the_settings_hold_the_monitor_of_the_derived_experiment(tmp_path):
    # `derive` fills a field the monitor hook reads: the settings carry the answer after derive
    E = fresh_tiny(
        "WatchesDerived",
        derive=lambda self, data: {"width": 8},
        monitor=lambda self: ("loss", "min") if self.width == 8 else ("acc", "max"),
    )
    n = jn.Nitro(E(), run_dir=tmp_path, **QUIET)
    assert n.experiment.width == 8 and n.settings.monitor == ("loss", "min")


# -- functions below the handle take the narrow values they use (issue 19, item 1) -----------------


def test_evaluation_and_prediction_run_on_the_plan_state_and_device_values_without_a_handle(tmp_path):
    from jaxnitro.evaluation import FieldReference, evaluate_split, predict_batch

    n = jn.Nitro(fresh_tiny("Narrow")(), run_dir=tmp_path, **QUIET)
    metrics, plan = evaluate_split(n.experiment, n.plan, n.state, n.device_values, n.data["val"], "val")
    assert plan is n.plan and metrics == n.validate()  # the handle's verb is this call
    x = tiny_data()["val"][0]["x"]
    reference = FieldReference(n.data)
    assert reference.specs() == ({"x": ((8,), np.dtype("float32")), "label": ((4,), np.dtype("float32")),
                                  "y": ((), np.dtype("int32"))}, "the `train` split's batches")
    out, plan = predict_batch(n.plan, n.state, n.device_values, reference, {"x": x[:5]})
    assert plan is n.plan and out.shape == (5, 4)
    np.testing.assert_array_equal(out, n.predict({"x": x[:5]}))
    with pytest.raises(TypeError, match=r"prediction field `x` has dtype float64, but the `train` split's batches"):
        predict_batch(n.plan, n.state, n.device_values, reference, {"x": x[:5].astype(np.float64)})


def test_a_bare_handles_field_reference_is_its_first_predicted_batch(tmp_path):
    from jaxnitro.evaluation import FieldReference

    reference = FieldReference({})
    assert reference.specs() is None
    reference.check({"x": np.zeros((3, 2, 5), np.float32)})
    assert reference.specs() == ({"x": ((2, 5), np.dtype("float32"))}, "the first predicted batch")
    with pytest.raises(ValueError, match=r"shape \(2, 5\): one example without the batch dimension \(the first "
                                         r"predicted batch have `x` of shape \(batch, 2, 5\)\)"):
        reference.check({"x": np.zeros((2, 5), np.float32)})


# -- the data position: one typed object the loop owns ----------------------------------------------


class _Stream:
    """A stream without len(): three batches per pass."""

    def __iter__(self):
        return iter(tiny_data()["train"][:3])


def test_the_train_position_of_a_sized_split_is_its_step():
    from jaxnitro.batches import wrap_split
    from jaxnitro.position import TrainPosition

    pos = TrainPosition(wrap_split(tiny_data()["train"], "train"), accum=2)  # 6 batches: 3 steps an epoch
    assert (pos.sized, pos.addressable, pos.stateful, pos.steps_per_epoch) == (True, True, False, 3)
    assert pos.at(4, epoch=0) == {"epoch": 2, "steps_into_epoch": 1, "batches_into_epoch": 2, "epoch_complete": False}
    assert pos.at(6, epoch=0) == {"epoch": 2, "steps_into_epoch": 0, "batches_into_epoch": 0, "epoch_complete": True}
    assert pos.epoch_over(2, 6) and not pos.epoch_over(2, 5)


def test_the_train_position_of_a_stream_follows_its_passes():
    from jaxnitro.batches import wrap_split
    from jaxnitro.position import TrainPosition

    pos = TrainPosition(wrap_split(_Stream(), "train"), accum=1)
    assert (pos.sized, pos.addressable, pos.steps_per_epoch) == (False, False, None)
    assert pos.start(None, step=0, epoch=0, position=None) == (1, 0)  # no recorded position: the next epoch
    opened = []
    reader, restored = pos.open_pass(1, 0, 0, lambda index: opened.append(index) or "reader")
    assert (reader, restored, opened, pos.pass_open, pos.epoch_start) == ("reader", False, [0], (1, 0), {1: 0})
    assert pos.at(2, epoch=1) == {"epoch": 1, "steps_into_epoch": 2, "batches_into_epoch": 2, "epoch_complete": False}
    pos.stream_ended(1, 0, 3)
    assert pos.at(3, epoch=1) == {"epoch": 1, "steps_into_epoch": 0, "batches_into_epoch": 0, "epoch_complete": True}
    pos.open_pass(2, 0, 3, lambda index: None)
    with pytest.raises(ValueError, match="yielded no batch in epoch 2: an epoch is one pass over it"):
        pos.stream_ended(2, 0, 3)
