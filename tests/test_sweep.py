"""``jn.sweep``: one run per grid point, on one set of compiled programs."""

from __future__ import annotations

import os

import optax
import pytest
from tiny import Tiny, fresh_tiny, tiny_data

import jaxnitro as jn

DATA = tiny_data()


def monitored(name="SweptTiny"):
    """A Tiny with no compiled programs yet, monitoring the val loss."""
    return fresh_tiny(name, monitor=lambda self: ("loss", "min"))


def test_a_grid_runs_every_point_and_only_the_first_compiles(tmp_path):
    e = monitored()()
    before = jn.cache_stats().misses
    res = jn.sweep(e, {"smoothing": [0.0, 0.2], "learning_rate": [3e-3, 1e-2]},
                   max_epochs=2, run_dir=tmp_path, logger=None)
    assert len(res) == 4
    assert [(r["smoothing"], r["learning_rate"]) for r in res] == [
        (0.0, 3e-3), (0.0, 1e-2), (0.2, 3e-3), (0.2, 1e-2)]  # the last key varies fastest
    assert res[0]["compiles"] > 0, "a fresh class compiles its programs at the first point"
    assert [r["compiles"] for r in res[1:]] == [0, 0, 0]
    assert jn.cache_stats().misses - before == res[0]["compiles"]
    for r in res:
        assert r["status"] == "done" and r["epochs"] == 2 and r["steps"] == 12
        assert os.path.isdir(r["run_dir"]) and os.path.dirname(r["run_dir"]) == str(tmp_path)
        assert r["best_loss"] <= r["loss"] and r["best_epoch"] in (1, 2)
    assert len({r["run_dir"] for r in res}) == 4
    assert len({r["loss"] for r in res}) == 4, "every point trains differently"
    assert len({r["train_loss"] for r in res}) == 4
    assert res.monitor == ("loss", "min") and res.data is not None  # the data was built once
    best = res.best()
    assert best["best_loss"] == min(r["best_loss"] for r in res)


def test_a_swept_learning_rate_is_the_base_rate_the_hook_gives(tmp_path):
    # Tiny's learning_rate hook says 1e-2: the point learning_rate=1e-2 is the same run
    plain = jn.train(Tiny(), data=DATA, run_dir=tmp_path, logger=None)
    (row,) = jn.sweep(Tiny(), [{"learning_rate": 1e-2}], data=DATA, run_dir=tmp_path, logger=None)
    assert row["train_loss"] == plain.rows[-1]["train_loss"]
    (other,) = jn.sweep(Tiny(), [{"learning_rate": 1e-3}], data=DATA, run_dir=tmp_path, logger=None)
    assert other["train_loss"] != plain.rows[-1]["train_loss"] and other["compiles"] == 0


def test_a_list_of_points_with_schedules_seeds_and_a_table(tmp_path):
    e = Tiny()
    cosine = lambda total: optax.cosine_decay_schedule(1e-2, total)  # noqa: E731
    points = [
        {"smoothing": 0.1, "seed": 0},
        {"smoothing": 0.1, "seed": 1},
        {"smoothing": lambda total: lambda step: 0.1, "learning_rate": cosine},  # schedules
    ]
    jn.sweep(e, points[:1], data=DATA, max_epochs=1, run_dir=tmp_path, logger=None)  # warm
    res = jn.sweep(e, points, data=DATA, max_epochs=1, run_dir=tmp_path, logger=None)
    assert [r["compiles"] for r in res] == [0, 0, 0]
    assert res[0]["train_loss"] != res[1]["train_loss"], "another seed, another run"
    assert res.monitor is None and "best_epoch" in res[0]
    df = res.to_pandas()
    assert list(df.columns[:3]) == ["smoothing", "seed", "learning_rate"]
    assert len(df) == 3 and set(df["status"]) == {"done"}
    text = str(res)
    assert text.splitlines()[0].split()[:3] == ["smoothing", "seed", "learning_rate"]
    assert len(text.splitlines()) == 4


def test_a_graph_const_field_is_refused_naming_it_before_anything_runs(tmp_path):
    with pytest.raises(ValueError, match=r"cannot sweep `width`: it is a GraphConst field of Tiny.*recompile"):
        jn.sweep(Tiny(), {"smoothing": [0.0, 0.1], "width": [8, 16]}, run_dir=tmp_path)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "grid, error, match",
    [
        ({"smoothin": [0.1]}, KeyError, r"`smoothin` is not a field of Tiny.*Device fields of Tiny: smoothing, temperature"),
        ({"accum": [1, 2]}, ValueError, r"run knob `accum`: it is a trace-time constant"),
        ({"smoothing": 0.1}, TypeError, r"grid key `smoothing` is 0.1; each key .* takes a list"),
        ({"smoothing": []}, ValueError, r"`smoothing` has no values"),
        ([0.1, 0.2], TypeError, r"point 0 is 0.1; a list grid holds dicts"),
        ({"smoothing": [0.0, "big"]}, TypeError, r"Device field `smoothing` of Tiny"),
        ({"learning_rate": [1e-3, -1.0]}, ValueError, r"`learning_rate` = -1.0; give a finite number >= 0"),
        ({"data": [None]}, ValueError, r"`data`: it is a handle keyword"),
    ],
)
def test_bad_grids_are_refused_before_the_first_point_trains(grid, error, match, tmp_path):
    with pytest.raises(error, match=match):
        jn.sweep(Tiny(), grid, data=DATA, run_dir=tmp_path)
    assert os.listdir(tmp_path) == []


def test_a_value_a_schedule_would_overwrite_is_refused(tmp_path):
    sched = {"smoothing": lambda total: lambda step: 0.1, "learning_rate": lambda total: lambda step: 1e-3}
    with pytest.raises(ValueError, match=r"Device field `smoothing`.*scheduled \(the schedules keyword\)"):
        jn.sweep(Tiny(), {"smoothing": [0.0, 0.1]}, data=DATA, schedules=sched, run_dir=tmp_path)
    with pytest.raises(ValueError, match=r"replace the schedule learning_rate .* by a constant.*schedules=\{\}"):
        jn.sweep(Tiny(), {"learning_rate": [1e-3]}, data=DATA, schedules=sched, run_dir=tmp_path)
    assert os.listdir(tmp_path) == []


def test_a_diverging_point_is_a_row_and_the_sweep_goes_on(tmp_path):
    res = jn.sweep(Tiny(), {"learning_rate": [1e30, 1e-2]}, data=DATA, run_dir=tmp_path, logger=None)
    assert [r["status"] for r in res] == ["diverged", "done"]
    assert res[0]["stop_reason"].startswith("non-finite loss at step") and res[1]["epochs"] == 2
