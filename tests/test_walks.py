"""How values travel (issue 19, items 1 and 6): the learning rate is read and checked once,
into the optimizer spec; the run's per-step inputs (hyperparameters and Device values) are one
object, kept beside the dispatcher that reads it; a train batch is staged by one function, and
crosses the prefetch plugin in one module; lifecycle events are emitted by the module that calls
every plugin through pluggy; the functions below the handle take the narrow values they use."""

from __future__ import annotations

import dataclasses
import itertools
import os

import threading

import numpy as np
import pytest

import jaxnitro as jn
from jaxnitro import dispatch, events, hookcalls, trainer
from jaxnitro import SourceLengthError
from jaxnitro.evaluation import make_transfer
from jaxnitro.first_step import TRAIN_HOOKS
from jaxnitro.events import run_scoped
from jaxnitro.knobs import require_monitor_and_val
from jaxnitro.plugin_manager import plugin_manager, reload_plugins
from jaxnitro.plugins.prefetch import PrefetchIterator, producers
from jaxnitro.routing import KEY_COUNT, KEY_DATA
from jaxnitro.dispatch import StepValues
from jaxnitro.serial_pass import check_past_end
from jaxnitro.state import Plan, ResumePoint
from jaxnitro.trainer import run_folder_of
from tiny import Tiny, fresh_tiny, tiny_data

QUIET = dict(logger=None)
DATA = tiny_data()


@pytest.fixture
def nitro(tmp_path):
    return jn.Nitro(Tiny(), data=DATA, run_dir=tmp_path, **QUIET)


def test_the_learning_rate_is_kept_once_in_the_optimizer_spec(nitro):
    assert "base_lr" not in {f.name for f in dataclasses.fields(Plan)}
    assert nitro.plan.opt_spec.base_lr == nitro.plan.base_lr == 1e-2  # Tiny's learning_rate()
    vector = nitro.plan.opt_spec.base
    slots = nitro.plan.opt_spec.layout.slots
    assert vector[slots.index(("default", "learning_rate"))] == np.float32(1e-2)


def test_the_step_values_are_the_runs_per_step_inputs(nitro):
    assert StepValues.__module__ == "jaxnitro.dispatch" and trainer.StepValues is dispatch.StepValues
    steps = StepValues(nitro.plan, nitro.device_values, 10, accum=4)
    assert float(steps.scale) == 0.25  # each micro-batch's weight
    assert steps.dev(3) is nitro.device_values  # held, not copied: nothing is scheduled
    assert float(np.asarray(steps.hypers(3))[0]) == pytest.approx(1e-2)
    nitro.set_device(temperature=0.5)  # written into the dict the step values hold
    assert float(steps.dev(0)["temperature"]) == 0.5
    block = steps.dev_block(0, 4)
    assert sorted(block) == sorted(nitro.device_values)
    assert block["temperature"].shape == (4,) and np.all(np.asarray(block["temperature"]) == 0.5)
    assert steps.dev_block(4, 4) is block  # the unscheduled values are tiled once per k


def test_a_train_batch_is_staged_by_one_function(nitro):
    batch = DATA["train"][0]
    transfer = make_transfer(nitro.plan, TRAIN_HOOKS, on_host=True, width=16,
                             counter=itertools.count(5), key=nitro.state.rng)
    out = transfer(batch)
    assert sorted(out) == sorted(["x", "label", KEY_DATA, KEY_COUNT])  # the routed fields, the keys
    assert int(out[KEY_COUNT]) == 5 and int(transfer(batch)[KEY_COUNT]) == 6
    assert isinstance(out["x"], np.ndarray)  # on_host: stacked into a block before it is sent
    with pytest.raises(ValueError, match=r"the `train` split yielded a batch of 3 rows; its batches have 16"):
        transfer({k: v[:3] for k, v in batch.items()})
    assert sorted(make_transfer(nitro.plan, TRAIN_HOOKS)(batch)) == ["label", "x"]


def test_run_folder_of_takes_the_resume_point_and_the_root(tmp_path):
    made = run_folder_of(None, None, str(tmp_path / "runs"), None)
    assert os.path.dirname(made) == str(tmp_path / "runs") and os.path.isdir(made)
    resumed = ResumePoint("ckpt", made, step=4, epoch=2, continue_folder=True)
    assert run_folder_of(resumed, None, str(tmp_path / "other"), None) == made
    branched = dataclasses.replace(resumed, continue_folder=False)
    assert os.path.dirname(run_folder_of(branched, None, str(tmp_path / "other"), None)) == str(tmp_path / "other")


def test_require_monitor_and_val_takes_the_settings_and_the_split_names(tmp_path):
    plain = jn.Nitro(Tiny(), data=DATA, run_dir=tmp_path, **QUIET)
    with pytest.raises(ValueError, match=r"`early_stop` \(default\) stops, but Tiny has no `monitor` hook.*or drop it\."):
        require_monitor_and_val(plain.settings, ["train", "val"], "Tiny", "early_stop", "stops", "drop it")
    Monitors = fresh_tiny("Monitors", monitor=lambda self: ("loss", "min"))
    watched = jn.Nitro(Monitors(), data=DATA, run_dir=tmp_path, **QUIET)
    require_monitor_and_val(watched.settings, ["train", "val"], "Monitors", "early_stop", "stops", "drop it")
    with pytest.raises(ValueError, match=r"ranked on the `val` split's 'loss', but the data has no `val` split "
                                         r"\(splits: \['train'\]\)"):
        require_monitor_and_val(watched.settings, {"train": None}, "Monitors", "early_stop", "stops", "drop it")


def test_check_past_end_names_the_subject_it_is_given():
    batch = {"x": np.zeros((4, 2), np.float32)}
    with pytest.raises(SourceLengthError) as err:
        check_past_end(lambda i: batch, 3, 4, None, 0, subject="len(source)")
    assert str(err.value).startswith("len(source) is 3, but batch_at(3), one past its last batch, returned "
                                     "a full batch (4 rows")
    with pytest.raises(SourceLengthError, match=r"^jaxnitro: the `val` split's len\(\) is 3, but batch_at\(3\)"):
        check_past_end(lambda i: batch, 3, 4, "val", 0)


def test_lifecycle_events_are_emitted_by_the_module_that_calls_the_plugins(tmp_path):
    assert not hasattr(events, "emit") and not hasattr(events, "emit_finish")
    assert trainer.emit is hookcalls.emit and trainer.emit_finish is hookcalls.emit_finish
    assert hookcalls.process_manager() is plugin_manager()  # emit's manager is the loaded one
    seen = []

    class Ends:
        @jn.hookimpl
        def jaxnitro_epoch_end(self, run, row):
            seen.append((row["epoch"], row["step"]))

    nitro = jn.Nitro(Tiny(max_epochs=2), data=DATA, run_dir=tmp_path, **QUIET)
    with run_scoped([Ends()]):
        nitro.train()
    per_epoch = len(DATA["train"])
    assert seen == [(1, per_epoch), (2, 2 * per_epoch)]
    old = plugin_manager()
    try:
        assert reload_plugins() is hookcalls.process_manager() is not old  # reloaded: emit reaches the new one
    finally:
        reload_plugins()


def test_step_reads_take_the_record_and_the_run_not_the_handle(tmp_path):
    got = {}

    class Peek:
        @jn.hookimpl
        def jaxnitro_epoch_end(self, run, row):
            reads = run.run_state.reads
            got.update(nitro=hasattr(reads, "nitro"), record=reads.record is run.nitro.record,
                       flags=(reads.manual, reads.check, reads.validated), first=reads.first_unread)

    nitro = jn.Nitro(Tiny(max_epochs=1), data=DATA, run_dir=tmp_path, **QUIET)
    with run_scoped([Peek()]):
        nitro.train()
    assert got == dict(nitro=False, record=True, flags=(False, True, True), first=len(DATA["train"]) + 1)


def test_the_threaded_pass_is_one_generator_of_the_producers_module():
    batches = [{"x": np.full((2, 1), i, np.float32)} for i in range(6)]
    doubled = lambda b: {"x": b["x"] * 2}  # noqa: E731
    stream = PrefetchIterator(tuple(batches), workers=2, device_batches=1).epoch(0, doubled)
    assert stream._gen.gi_code is producers.Producers.stream.__code__
    assert not [t for t in threading.enumerate() if t.name.startswith("jaxnitro-prefetch")]  # nothing before next()
    assert [float(b["x"][0, 0]) for b in stream] == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
    serial = PrefetchIterator(tuple(batches), workers=0, device_batches=1).epoch(0, doubled)
    assert [float(b["x"][0, 0]) for b in serial] == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
