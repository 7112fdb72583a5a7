"""The built-in progress reporters and the hook that picks one."""

from __future__ import annotations

import io
import sys
import time

import pytest

from jaxnitro.plugins.progress import (
    SilentReporter,
    TqdmReporter,
    auto_wants_bar,
    jaxnitro_make_progress_reporter,
)


class _FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_auto_under_captured_output_is_silent(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # what pytest's capture looks like
    assert isinstance(jaxnitro_make_progress_reporter(name="auto"), SilentReporter)


def test_auto_on_a_terminal_draws_unless_ci(monkeypatch):
    monkeypatch.setattr(sys, "stderr", _FakeTTY())
    monkeypatch.delenv("CI", raising=False)
    assert auto_wants_bar()
    assert isinstance(jaxnitro_make_progress_reporter(name="auto"), TqdmReporter)
    for value in ("true", "1", "yes"):
        monkeypatch.setenv("CI", value)
        assert isinstance(jaxnitro_make_progress_reporter(name="auto"), SilentReporter)
    monkeypatch.setenv("CI", "false")
    assert isinstance(jaxnitro_make_progress_reporter(name="auto"), TqdmReporter)


def test_names():
    assert isinstance(jaxnitro_make_progress_reporter(name="tqdm"), TqdmReporter)
    assert isinstance(jaxnitro_make_progress_reporter(name="silent"), SilentReporter)
    assert isinstance(jaxnitro_make_progress_reporter(name="none"), SilentReporter)
    for other in ("rich", "log", "", None):
        assert jaxnitro_make_progress_reporter(name=other) is None


def test_hook_through_pluggy():
    import pluggy

    import jaxnitro.plugins.progress as mod
    from jaxnitro.hookspecs import PROJECT, ExtensionSpec

    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(ExtensionSpec)
    pm.register(mod)
    assert isinstance(pm.hook.jaxnitro_make_progress_reporter(name="silent"), SilentReporter)
    assert pm.hook.jaxnitro_make_progress_reporter(name="other") is None


def test_tqdm_reporter_writes_labels_and_done():
    out = io.StringIO()
    r = TqdmReporter(file=out, mininterval=0.0)
    r.begin(3, "setup")
    r.update(0.0, "epoch 1/3: train [compiling gradient]")
    r.update(0.5, "epoch 1/3: train")
    r.update(1.0, "epoch 1/3: validate")
    r.update(2.25, "epoch 3/3: train")
    r.update(3.0, "epoch 3/3: train")
    r.close("done: 3/3 epochs")
    text = out.getvalue()
    assert "epoch 1/3: train [compiling gradient]" in text
    assert "epoch 1/3: validate" in text
    assert "2.25/3" in text
    final = text.rstrip("\n").split("\r")[-1]
    assert final.startswith("done: 3/3 epochs") and "100%" in final and "3.00/3" in final
    assert text.endswith("\n")


def test_a_step_budgeted_bar_counts_whole_steps():
    out = io.StringIO()
    r = TqdmReporter(file=out, mininterval=0.0)
    r.begin(20_000, "step 0/20,000: train", unit="step")
    r.update(7_425.0, "step 7,425/20,000: train")
    r.close("done: 20,000/20,000 steps")
    text = out.getvalue()
    assert "7,425/20,000 [" in text and "7425.00" not in text
    assert text.rstrip("\n").split("\r")[-1].startswith("done: 20,000/20,000 steps")


def test_label_change_draws_at_once_position_is_throttled():
    out = io.StringIO()
    r = TqdmReporter(file=out, mininterval=3600.0)
    r.begin(40, "epoch 1/40: train")
    before = out.getvalue()
    r.update(0.5, "epoch 1/40: train")  # same label, not due: no redraw
    assert out.getvalue() == before
    r.update(0.6, "epoch 1/40: validate [compiling metrics]")  # new phase: drawn now
    assert "epoch 1/40: validate [compiling metrics]" in out.getvalue()
    assert "0.60/40" in out.getvalue()
    r.close("done: 1/40 epochs")
    final = out.getvalue().rstrip("\n").split("\r")[-1]
    assert final.startswith("done: 1/40 epochs") and "0.60/40" in final  # not forced to 100%


def test_update_and_close_without_begin_are_harmless():
    r = TqdmReporter(file=io.StringIO())
    r.update(1.0, "x")
    r.close("done")


def test_begin_twice_closes_the_first_bar():
    out = io.StringIO()
    r = TqdmReporter(file=out, mininterval=0.0)
    r.begin(1, "setup [building data]")
    r.begin(5, "epoch 1/5: train")
    r.update(5.0, "epoch 5/5: train")
    r.close("done: 5/5 epochs")
    assert "setup [building data]" in out.getvalue() and "done: 5/5 epochs" in out.getvalue()


def test_update_cost_sanity():
    """10,000 updates (one per optimizer step) stay cheap; timing is printed, not asserted."""
    out = io.StringIO()
    r = TqdmReporter(file=out)
    r.begin(10, "epoch 1/10: train")
    n = 10_000
    t0 = time.perf_counter()
    for i in range(n):
        r.update(i / 1000.0, "epoch 1/10: train")
    dt = time.perf_counter() - t0
    r.close("done: 10/10 epochs")
    print(f"TqdmReporter.update: {dt / n * 1e6:.3f} us/call")
    assert "done: 10/10 epochs" in out.getvalue()

    s = SilentReporter()
    s.begin(10, "x")
    for i in range(n):
        s.update(i / 1000.0, "x")
    s.close("done")


@pytest.mark.parametrize("total", [0, None])
def test_unknown_total_does_not_crash(total):
    out = io.StringIO()
    r = TqdmReporter(file=out, mininterval=0.0)
    r.begin(total, "setup [building data]")
    r.update(0.0, "setup [deriving]")
    r.close("setup done")
    assert "setup done" in out.getvalue()
