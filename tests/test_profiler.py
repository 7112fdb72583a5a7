"""The profiler plugin: ``profile=(start_step, n_steps)`` writes a jax.profiler trace of those steps.

The trace is read back as a user's viewer would: the Chrome-trace JSON that jax writes beside
the ``.xplane.pb`` (TensorBoard's profile plugin) and ``perfetto_trace.json.gz`` (Perfetto).
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os

import jax
import pytest
from tiny import Tiny, fresh_tiny, tiny_data

import jaxnitro as jn
from jaxnitro.plugin_manager import plugin_manager
from jaxnitro.plugins.profiler import trace_files

DATA = tiny_data()  # 6 train batches: 6 steps an epoch; Tiny trains 2 epochs = 12 steps


def trace_events(run_dir) -> list[dict]:
    """The events of the run's Chrome-trace JSON (``<host>.trace.json.gz``)."""
    files = [f for f in trace_files(run_dir) if f.endswith(".trace.json.gz")]
    assert len(files) == 1, trace_files(run_dir)
    with gzip.open(files[0]) as fh:
        return json.load(fh)["traceEvents"]


def annotated_steps(events) -> list[int]:
    """The step numbers of the ``train`` step annotations, in order."""
    marks = sorted((e["ts"], int(e["args"]["step_num"])) for e in events if e.get("name") == "train")
    return [step for _, step in marks]


def dispatches_outside_annotations(events, program: str) -> tuple[int, int]:
    """``(dispatches of ``program``, those outside every ``train`` annotation)``."""
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "train"]
    calls = [e["ts"] for e in events if e.get("name") == f"PjitFunction({program})"]
    return len(calls), sum(not any(a <= t <= b for a, b in spans) for t in calls)


def test_a_run_traces_exactly_the_window_and_names_its_steps(tmp_path):
    plain = jn.train(Tiny(), data=DATA, run_dir=tmp_path / "plain", logger=None)
    misses = jn.cache_stats()[1]
    n = jn.Nitro(Tiny(), data=DATA, run_dir=tmp_path / "profiled", logger=None, profile=(3, 2))
    assert any(line.split() == ["│", "profile", "│", "(3,", "2)", "│", "keyword", "│"] for line in str(n).splitlines())
    n.train()
    assert n.status == "done" and n.step == 12
    names = {os.path.basename(f) for f in trace_files(n.run_dir)}
    assert any(f.endswith(".xplane.pb") for f in names)  # TensorBoard's profile plugin reads it
    assert "perfetto_trace.json.gz" in names  # ui.perfetto.dev opens it
    assert all(f.startswith(os.path.join(n.run_dir, "profile", "plugins", "profile")) for f in trace_files(n.run_dir))
    events = trace_events(n.run_dir)
    assert annotated_steps(events) == [3, 4]
    calls, outside = dispatches_outside_annotations(events, "train_step")
    assert calls > 0 and outside == 0  # steps 3 and 4 were traced, and no other train step
    modules = {e["args"].get("hlo_module") for e in events if "hlo_module" in e.get("args", {})}
    assert "jit_train_step" in modules  # the device's work of those steps is in the trace
    # profiling changes nothing: the same losses, and nothing compiled again
    assert jn.cache_stats()[1] == misses
    assert [r["train_loss"] for r in n.history()[:]] == [r["train_loss"] for r in plain.history()[:]]


def test_a_block_of_steps_is_one_annotation_named_by_its_first_step(tmp_path):
    n = jn.train(Tiny(), data=DATA, run_dir=tmp_path, logger=None, profile=(3, 4), steps_per_dispatch=2)
    events = trace_events(n.run_dir)
    assert annotated_steps(events) == [3, 5]
    calls, outside = dispatches_outside_annotations(events, "train_block")
    assert calls > 0 and outside == 0


def test_a_window_from_the_first_step_starts_at_run_start(tmp_path):
    n = jn.train(Tiny(), data=DATA, run_dir=tmp_path, logger=None, profile=(1, 2), accum=2)
    events = trace_events(n.run_dir)
    assert annotated_steps(events) == [1, 2]
    for program in ("train_step", "accumulate"):  # each step's accumulate dispatch is inside its step
        calls, outside = dispatches_outside_annotations(events, program)
        assert calls > 0 and outside == 0


class _Fail:
    @jn.hookimpl
    def jaxnitro_epoch_end(self, run, row):
        raise RuntimeError("boom at the end of epoch 1")


class _StopNow:
    def should_stop(self, epoch, value, mode):
        return True


@contextlib.contextmanager
def failing_epoch_end():
    pm = plugin_manager()
    pm.register(_Fail(), name="test-profiler-fail")
    try:
        yield
    finally:
        pm.unregister(name="test-profiler-fail")


@pytest.mark.parametrize("ending", ["early stop", "failed"])
def test_a_run_ending_inside_the_window_still_writes_and_stops_the_trace(ending, tmp_path):
    Monitored = fresh_tiny("Monitored", monitor=lambda self: ("loss", "min"))
    if ending == "early stop":
        n = jn.train(Monitored(), data=DATA, run_dir=tmp_path, logger=None, profile=(3, 8), early_stop=_StopNow())
        assert n.status == "done" and n.step == 6 and "early stopping" in n.stop_reason
    else:
        n = jn.Nitro(Monitored(), data=DATA, run_dir=tmp_path, logger=None, profile=(3, 8))
        with failing_epoch_end(), pytest.raises(RuntimeError, match="boom"):
            n.train()
        assert n.status == "failed" and n.step == 6
    assert annotated_steps(trace_events(n.run_dir)) == [3, 4, 5, 6]  # the window's steps the run took
    jax.profiler.start_trace(str(tmp_path / "after"))  # the trace was stopped: a new one can start
    jax.profiler.stop_trace()


@pytest.mark.parametrize(
    "value, error, says",
    [
        ("3,2", TypeError, "give `profile=(start_step, n_steps)`"),
        ((3,), TypeError, "give `profile=(start_step, n_steps)`"),
        (5, TypeError, "give `profile=(start_step, n_steps)`"),
        ((3.0, 2), TypeError, "must be whole numbers"),
        ((True, 2), TypeError, "must be whole numbers"),
        ((0, 2), ValueError, "start_step must be >= 1 (optimizer steps count from 1)"),
        ((3, 0), ValueError, "n_steps >= 1"),
        ((11, 5), ValueError, "traces steps 11..15, but the run ends at step 12 (max_steps, or max_epochs x "
                              "steps per epoch), so the trace would miss steps. Choose a window inside "
                              "steps 1..12, e.g. `profile=(8, 5)`, or train longer."),
    ],
)
def test_bad_profile_values_are_refused_naming_the_knob_and_the_fix(value, error, says, tmp_path):
    with pytest.raises(error) as err:
        jn.Nitro(Tiny(), data=DATA, run_dir=tmp_path, profile=value)
    assert f"run knob `profile` = {value!r} (keyword)" in str(err.value)
    assert says in str(err.value)
    assert os.listdir(tmp_path) == []  # refused when the handle is built: no run folder


def test_list_form_is_accepted_as_a_config_file_writes_it(tmp_path):
    n = jn.train(Tiny(max_epochs=1), data=DATA, run_dir=tmp_path, logger=None, profile=[2, 1])
    assert annotated_steps(trace_events(n.run_dir)) == [2]


def test_a_disabled_profiler_refuses_the_knob(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXNITRO_DISABLE_PLUGINS", "profiler")
    jn.reload_plugins()
    try:
        with pytest.raises(ValueError, match=r"run knob `profile` is set \(keyword\) but no loaded plugin acts on it"):
            jn.Nitro(Tiny(), data=DATA, run_dir=tmp_path, profile=(3, 2))
    finally:
        monkeypatch.delenv("JAXNITRO_DISABLE_PLUGINS")
        jn.reload_plugins()


def _fetch_json(url: str):
    """``url``'s JSON answer; the profile plugin gzips its answers whatever the request says."""
    import urllib.request

    with urllib.request.urlopen(url, timeout=60) as answer:
        body = answer.read()
        if answer.headers.get("Content-Encoding") == "gzip" or body[:2] == b"\x1f\x8b":
            body = gzip.decompress(body)
    return json.loads(body)


@pytest.mark.slow
def test_tensorboards_profile_plugin_shows_the_named_steps(tmp_path):
    """The docs' command, `tensorboard --logdir <run folder>/profile`, with the profile plugin
    (jaxnitro[profile]): the run is listed and its trace viewer names the steps."""
    pytest.importorskip("tensorboard_plugin_profile", reason="the viewer is jaxnitro[profile]")
    import sys
    from pathlib import Path

    from logger_plugin_support import free_port, server

    n = jn.train(Tiny(), data=DATA, run_dir=tmp_path, logger=None, profile=(3, 2))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    command = [str(Path(sys.executable).parent / "tensorboard"), "--logdir", os.path.join(n.run_dir, "profile"),
               "--host", "127.0.0.1", "--port", str(port)]
    with server(command, f"{base}/data/plugins_listing"):
        assert _fetch_json(f"{base}/data/plugins_listing")["profile"]["enabled"]
        (session,) = _fetch_json(f"{base}/data/plugin/profile/runs")
        assert "trace_viewer@" in _fetch_json(f"{base}/data/plugin/profile/run_tools?run={session}")
        (host,) = _fetch_json(f"{base}/data/plugin/profile/hosts?run={session}&tag=trace_viewer@")
        trace = _fetch_json(f"{base}/data/plugin/profile/data?run={session}&tag=trace_viewer@&host={host['hostname']}")
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"train 3", "train 4"} <= names and "train 5" not in names and "train 2" not in names


def test_a_resumed_run_traces_a_window_after_its_step_and_refuses_one_before(tmp_path):
    first = jn.train(Tiny(max_epochs=1), data=DATA, run_dir=tmp_path, logger=None,
                     checkpointer=jn.Checkpointer(keep=(jn.Last(1),)))
    assert first.step == 6
    with pytest.raises(ValueError) as err:
        jn.Nitro(Tiny(), data=DATA, run_dir=tmp_path, logger=None, resume="auto", profile=(5, 2))
    assert ("run knob `profile` = (5, 2) (keyword) traces steps 5..6, but this handle starts at step 6 "
            "(it resumes a run that took steps 1..6). Choose a start_step after 6, e.g. `profile=(7, 2)`.") in str(err.value)
    n = jn.train(Tiny(), data=DATA, run_dir=tmp_path, logger=None, resume="auto", profile=(7, 2))
    assert n.step == 12 and annotated_steps(trace_events(n.run_dir)) == [7, 8]  # from the resumed run's first step


def test_a_trace_already_running_is_named_when_the_window_starts(tmp_path):
    jax.profiler.start_trace(str(tmp_path / "mine"))
    try:
        n = jn.Nitro(Tiny(), data=DATA, run_dir=tmp_path / "runs", logger=None, profile=(3, 2))
        with pytest.raises(RuntimeError, match=r"run knob `profile` = \(3, 2\) cannot start its trace: .*stop the "
                                               r"other trace \(jax.profiler.stop_trace\(\)\) before train\(\)"):
            n.train()
        assert n.status == "failed" and n.step == 2
    finally:
        jax.profiler.stop_trace()


class _Stream:
    """Tiny's train batches as a stream: iterable again for every epoch, no len()."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)


def test_a_stream_bounded_by_max_steps_is_profiled_and_its_end_checked(tmp_path):
    data = {"train": _Stream(DATA["train"]), "val": DATA["val"]}
    kw = dict(data=data, run_dir=tmp_path, logger=None, max_steps=10, max_epochs=None)
    with pytest.raises(ValueError, match=r"traces steps 9\.\.13, but the run ends at step 10 .* `profile=\(6, 5\)`"):
        jn.Nitro(Tiny(), profile=(9, 5), **kw)
    n = jn.train(Tiny(), profile=(6, 3), **kw)  # across the first pass's end (step 6)
    events = trace_events(n.run_dir)
    # step 7 is tried first in the pass that ends (a short span: reading finds the stream's end),
    # then dispatched in the next pass
    assert n.step == 10 and annotated_steps(events) == [6, 7, 7, 8]
    calls, outside = dispatches_outside_annotations(events, "train_step")
    assert calls > 0 and outside == 0
