"""Schedules are evaluated in stretches as training reaches them: the work before the first
step does not grow with ``max_epochs`` (counted in schedule evaluations, never seconds), a
run that stops early never evaluates the steps it did not take, and the stretched values
are the values of the whole horizon (across stretch boundaries, past the horizon, for
blocks of ``steps_per_dispatch``, in the logged lines)."""

from __future__ import annotations

import contextlib

import jax
import jaxnitro as jn
import numpy as np
import optax
import pytest
from jaxnitro.loggers.jsonl import read_jsonl
from jaxnitro.plugin_manager import plugin_manager
from jaxnitro.schedules import BLOCK, PROBES, SLOW_BLOCK, ScheduleStream, materialize
from tiny import Tiny


class Counting:
    """Schedules that count the step values they are asked for: one untraceable (a Python
    ``if``: one call per step) and one array schedule (counts the steps of each call)."""

    def __init__(self):
        self.python_calls = self.array_steps = self.factories = 0

    def python(self, total):
        self.factories += 1

        def schedule(step):
            if not isinstance(step, int):
                raise TypeError("one step at a time")  # neither an array nor a tracer
            self.python_calls += 1
            return 1e-2 if step < total // 2 else 1e-3

        return schedule

    def array(self, total):
        self.factories += 1

        def schedule(steps):
            steps = np.asarray(steps)
            if steps.ndim != 1:
                raise TypeError("an array of steps")
            self.array_steps += len(steps)
            return 0.1 * (1 - steps / total)

        return schedule


class StopAfterFirstEpoch:
    @jn.hookimpl
    def jaxnitro_epoch_trained(self, run, epoch, step, stats):
        run.request_stop("test: one epoch is enough")


@contextlib.contextmanager
def stopping_after_one_epoch():
    pm, plugin = plugin_manager(), StopAfterFirstEpoch()
    pm.register(plugin, name="test-stop-after-one-epoch")
    try:
        yield
    finally:
        pm.unregister(plugin)


def run_one_epoch(tmp_path, max_epochs: int) -> Counting:
    c = Counting()
    with stopping_after_one_epoch():
        n = jn.train(
            Tiny(), run_dir=tmp_path / str(max_epochs), max_epochs=max_epochs, logger=None,
            schedules={"learning_rate": c.python, "smoothing": c.array},
        )
    assert n.step == 6 and n.status == "done"  # one epoch of 6 steps, whatever the horizon
    return c


def test_schedule_work_before_and_during_a_short_run_does_not_grow_with_max_epochs(tmp_path):
    # horizons of 6,000 and 6,000,000 steps; the run takes 6
    short, long = run_one_epoch(tmp_path, 1_000), run_one_epoch(tmp_path, 1_000_000)
    assert short.factories == long.factories == 2
    # the untraceable schedule: its first stretch plus the probes that decide whether it varies
    assert short.python_calls == long.python_calls == SLOW_BLOCK + PROBES
    # the array schedule: one call of one stretch plus probes (the failed tries count no steps)
    assert short.array_steps == long.array_steps == BLOCK + PROBES


def test_an_early_stopped_run_evaluates_only_the_stretches_it_reached(tmp_path):
    c = Counting()
    stream = ScheduleStream(c.python, 10_000, "opt/learning_rate")
    first = c.python_calls
    assert stream.mode == "per-step" and stream.block == SLOW_BLOCK and stream.evaluated == first
    stream.value(SLOW_BLOCK - 1)  # inside the first stretch: nothing new
    assert c.python_calls == first
    stream.value(5 * SLOW_BLOCK + 3)  # one more stretch, not the ones before it
    assert c.python_calls == first + SLOW_BLOCK == stream.evaluated


@pytest.mark.parametrize(
    "factory",
    [
        lambda total: (lambda s: 1e-2 * np.cos(np.asarray(s) / total)),  # NumPy: an array call
        lambda total: optax.cosine_onecycle_schedule(total, 5e-3),  # a jitted vmap
        lambda total: (lambda s: 1e-3 * (1 + (int(s) % 7))),  # one call per step
    ],
    ids=["array", "vmap", "per-step"],
)
def test_stretched_values_equal_the_whole_horizon(factory, request):
    mode = request.node.callspec.id
    total = 2 * BLOCK + 37
    stream = ScheduleStream(factory, total, "opt/learning_rate")
    schedule = factory(total)
    # what one call over the whole horizon gives, the way the stream evaluates
    if stream.mode == "array":
        expected = np.asarray(schedule(np.arange(total)), np.float32)
    elif stream.mode == "vmap":
        expected = np.asarray(jax.jit(jax.vmap(schedule))(np.arange(total, dtype=np.int32)), np.float32)
    else:
        expected = np.asarray([float(schedule(s)) for s in range(total)], np.float32)
    one_by_one = np.asarray([float(schedule(s)) for s in range(0, total, 97)], np.float32)
    np.testing.assert_allclose(expected[::97], one_by_one, rtol=1e-4)
    # out of order, across stretch boundaries, and past the horizon (the last value)
    for step in (total - 1, 0, BLOCK, BLOCK - 1, SLOW_BLOCK, 3 * SLOW_BLOCK + 1):
        np.testing.assert_allclose(stream.value(step), expected[step], rtol=0)
    assert stream.value(total + 100) == stream.value(total - 1)
    np.testing.assert_allclose(stream.values(BLOCK - 5, BLOCK + 5), expected[BLOCK - 5 : BLOCK + 5], rtol=0)
    np.testing.assert_allclose(stream.values(0, total), expected, rtol=0)
    np.testing.assert_allclose(materialize(factory, total, "opt/learning_rate"), expected, rtol=0)
    assert stream.varies and stream.mode == mode


def test_a_constant_schedule_does_not_vary_and_a_late_change_is_seen_by_the_probes():
    assert not ScheduleStream(lambda total: lambda s: 1e-3, 50_000, "opt/learning_rate").varies
    late = ScheduleStream(lambda total: optax.piecewise_constant_schedule(1e-3, {40_000: 0.1}), 50_000, "x")
    assert late.varies and late.evaluated == BLOCK + PROBES


def test_a_bad_value_in_a_later_stretch_is_refused_when_that_stretch_is_reached():
    factory = lambda total: lambda s: np.where(np.asarray(s) == 3000, np.nan, 1e-3)
    stream = ScheduleStream(factory, 10_000, "opt/learning_rate")  # no probe lands on 3000
    assert stream.value(2 * BLOCK - 1) == np.float32(1e-3)  # the stretch before 3000's
    with pytest.raises(ValueError, match=r"schedule `opt/learning_rate` gives nan at step 3000 \(of 10000 steps"):
        stream.value(3000)


def test_logged_values_and_k_blocks_across_a_stretch_boundary(tmp_path, monkeypatch):
    # stretches of 4 steps: the run's 12 steps span three, and k=5 blocks straddle them
    from jaxnitro import schedules

    monkeypatch.setattr(schedules, "BLOCK", 4)
    sched = {
        "learning_rate": lambda total: optax.linear_schedule(1e-2, 1e-3, total),
        "smoothing": lambda total: (lambda s: 0.01 * (int(s) % 5)),  # one call per step
    }
    kw = {"max_epochs": 2, "schedules": sched, "steps_per_dispatch": 5}
    n = jn.train(Tiny(), run_dir=tmp_path / "k5", **kw)
    monkeypatch.setattr(schedules, "BLOCK", 1024)
    whole = jn.train(Tiny(), run_dir=tmp_path / "k1", max_epochs=2, schedules=sched)
    lines = [l for l in read_jsonl(f"{n.run_dir}/metrics.jsonl") if l.get("context") == "train"]
    assert [l["step"] for l in lines] == list(range(1, 13))
    lr = np.asarray(jax.jit(jax.vmap(optax.linear_schedule(1e-2, 1e-3, 12)))(np.arange(12)), np.float32)
    for line in lines:
        s = line["step"] - 1
        assert line["schedule/default/learning_rate"] == float(lr[s])
        assert line["schedule/smoothing"] == float(np.float32(0.01 * (s % 5)))
    for a, b in zip(jax.tree_util.tree_leaves(n.params), jax.tree_util.tree_leaves(whole.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
