"""The plot plugin: each of the tutorial's selections renders to PNG (Agg, headless), and the
figure's axes, line data and best marker match the history."""

from __future__ import annotations

import os

import numpy as np
import pytest

matplotlib = pytest.importorskip("matplotlib", reason="plots need the optional matplotlib extra")

import jaxnitro as jn  # noqa: E402
from jaxnitro.loggers.jsonl import read_jsonl  # noqa: E402
from tiny import Tiny, tiny_data  # noqa: E402


@jn.experiment
class Judged(Tiny):
    def metrics(self, logits, *, y):
        return {"acc": (np.sum(logits.argmax(-1) == y), len(y)), "loss": (float(np.mean(logits**2)), 1)}

    def monitor(self):
        return ("acc", "max")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return jn.train(Judged(max_epochs=5), data=tiny_data(), run_dir=tmp_path_factory.mktemp("runs"))


def lines(axis):
    """``{label: (xdata, ydata)}`` of an axis's lines."""
    return {line.get_label(): (np.asarray(line.get_xdata(), float), np.asarray(line.get_ydata(), float))
            for line in axis.get_lines()}


def png(fig, tmp_path, name):
    path = tmp_path / f"{name}.png"
    fig.savefig(path)
    assert path.stat().st_size > 1000 and path.read_bytes()[:4] == b"\x89PNG"
    return path


def test_default_is_the_monitored_metric_with_the_best_epoch_starred(run, tmp_path):
    h = run.history()
    fig = h.plot()
    png(fig, tmp_path, "default")
    (axis,) = fig.axes
    drawn = lines(axis)
    x, y = drawn["acc"]
    assert np.array_equal(x, h.epoch) and np.allclose(y, h.acc)
    bx, by = drawn[f"best (epoch {h.best_epoch})"]
    assert (bx[0], by[0]) == (h.best_epoch, h.best["acc"])
    assert axis.get_ylabel() == "acc" and axis.get_xlabel() == "epoch"


def test_a_window_of_epochs(run, tmp_path):
    h = run.history()[2:4]
    fig = jn.plot(h)
    png(fig, tmp_path, "window")
    x, _ = lines(fig.axes[0])["acc"]
    assert list(x) == [2, 3, 4]


def test_two_selected_metrics_get_two_axes(run, tmp_path):
    h = run.history()
    fig = h["acc", "loss"].plot()
    png(fig, tmp_path, "two")
    assert [a.get_ylabel() for a in fig.axes] == ["acc", "loss"]
    assert np.allclose(lines(fig.axes[1])["loss"][1], h.loss)


def test_all_metrics(run, tmp_path):
    fig = run.history().plot(metrics="all")
    png(fig, tmp_path, "all")
    assert [a.get_ylabel() for a in fig.axes] == ["train_loss", "acc", "loss"]


def test_the_step_axis_overlays_the_per_step_train_lines(run, tmp_path):
    h = run.history()
    fig = h.plot(x="step", metrics="train_loss")
    png(fig, tmp_path, "steps")
    drawn = lines(fig.axes[0])
    log = [x for x in read_jsonl(os.path.join(run.run_dir, "metrics.jsonl")) if x.get("context") == "train"]
    sx, sy = drawn["loss (train, per step)"]
    assert list(sx) == [x["step"] for x in log] == list(range(1, 31))
    assert np.allclose(sy, [x["loss"] for x in log])
    ex, ey = drawn["train_loss (per epoch)"]
    assert list(ex) == list(h.step) and np.allclose(ey, h.train_loss)
    assert fig.axes[0].get_xlabel() == "step"


def test_draws_into_the_callers_axes(run, tmp_path):
    from matplotlib.figure import Figure

    outer = Figure()
    left, right = outer.subplots(1, 2)
    got = run.history().plot(ax=right)
    assert got is outer and lines(right) and not lines(left)
    png(outer, tmp_path, "into")
    with pytest.raises(ValueError, match="2 metric.*1 axes"):
        run.history()["acc", "loss"].plot(ax=right)


def test_jn_plot_takes_the_handle_as_the_tutorial_spells_it(run, tmp_path):
    """``jn.plot(nitro)`` draws ``nitro.history()`` (it raised ``TypeError: object of type
    'Nitro' has no len()``); keywords work as for a history."""
    fig = jn.plot(run)
    png(fig, tmp_path, "handle")
    drawn = lines(fig.axes[0])
    h = run.history()
    assert np.allclose(drawn["acc"][1], h.acc) and fig.axes[0].get_ylabel() == "acc"
    assert [a.get_ylabel() for a in jn.plot(run, metrics="all").axes] == [a.get_ylabel() for a in h.plot(metrics="all").axes]
    with pytest.raises(TypeError, match="got a list; give a history .* or a handle"):
        jn.plot([1, 2])


def test_bad_requests_are_named(run):
    with pytest.raises(KeyError, match="no scalar metric 'f1'.*plottable: train_loss, acc, loss"):
        run.history().plot(metrics="f1")
    with pytest.raises(ValueError, match="x='time'"):
        run.history().plot(x="time")


def test_without_the_plugin_the_plot_is_refused_by_name(run, monkeypatch):
    monkeypatch.setenv("JAXNITRO_DISABLE_PLUGINS", "plot")
    jn.reload_plugins()
    try:
        with pytest.raises(RuntimeError, match="no plugin plots histories.*`plot`.*disabled"):
            run.history().plot()
    finally:
        monkeypatch.delenv("JAXNITRO_DISABLE_PLUGINS")
        jn.reload_plugins()
