"""The JSONL logger: every verb round-trips, non-finite values stay portable, flush rules hold."""

from __future__ import annotations

import gc
import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from jaxnitro.loggers.jsonl import JSONLLogger, jaxnitro_make_logger, read_jsonl


def _disk_lines(path: Path) -> list[dict]:
    """What another process would see right now (no help from our buffers)."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def test_round_trip_every_verb(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    lg = JSONLLogger(path)
    lg.log_params(
        {
            "width": 128,
            "lr": np.float32(1e-3),
            "n": np.int64(7),
            "flag": np.bool_(True),
            "shape": (28, 28),
            "weights": np.arange(6, dtype=np.float32).reshape(2, 3),
            "path": Path("/data/mnist"),
            "obj": object(),
            "fn": math.sqrt,
            "nested": {"a": [1, 2], 3: "int key"},
        }
    )
    lg.log_other("binding_report", "data: train 550 batches")
    lg.log_other("groups", {"encoder": {"rate": 1e-3}})
    lg.log_metrics({"loss": np.float32(0.5), "schedule/learning_rate": 1e-3}, step=1, epoch=1, context="train")
    lg.log_metrics({"acc": 0.9, "confusion": np.eye(2, dtype=np.int32)}, step=550, epoch=1, context="validate")
    lg.finish("completed")

    lines = read_jsonl(path)
    assert [ln["kind"] for ln in lines] == ["params", "other", "other", "metrics", "metrics", "finish"]
    assert _disk_lines(path) == lines  # strict JSON: the stdlib parser reads it back

    p = lines[0]["params"]
    assert p["width"] == 128 and isinstance(p["width"], int)
    assert p["lr"] == pytest.approx(1e-3) and isinstance(p["lr"], float)
    assert p["n"] == 7 and p["flag"] is True
    assert p["shape"] == [28, 28]
    assert p["weights"] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    assert p["path"] == "/data/mnist"
    assert isinstance(p["obj"], str) and p["obj"].startswith("<object object")
    assert p["fn"] == "math.sqrt"
    assert p["nested"] == {"a": [1, 2], "3": "int key"}

    assert lines[1] == {"kind": "other", "key": "binding_report", "value": "data: train 550 batches"}
    assert lines[2]["value"] == {"encoder": {"rate": 1e-3}}

    train = lines[3]
    assert list(train)[:5] == ["kind", "context", "step", "epoch", "time"]
    assert (train["context"], train["step"], train["epoch"]) == ("train", 1, 1)
    assert isinstance(train["time"], float) and train["time"] > 1.6e9
    assert train["loss"] == 0.5 and train["schedule/learning_rate"] == 1e-3

    val = lines[4]
    assert val["context"] == "validate" and val["acc"] == 0.9
    assert val["confusion"] == [[1, 0], [0, 1]]

    assert lines[5]["status"] == "completed" and lines[5]["time"] >= train["time"]
    assert lg.info() == {"backend": "jsonl", "path": str(path)}
    assert lg.finished


def test_nonfinite_written_as_strings(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lg = JSONLLogger(path)
    lg.log_metrics(
        {
            "loss": float("nan"),
            "grad_norm": np.float32("inf"),
            "lo": np.float64("-inf"),
            "vec": np.array([1.0, np.nan, -np.inf]),
            "ok": 2.5,
        },
        step=3,
        epoch=1,
        context="train",
    )
    lg.log_params({"eps": float("inf"), "k": np.array([np.nan])})
    lg.finish("diverged")

    raw = path.read_text()
    assert "NaN" not in raw and "Infinity" not in raw
    m, params, _ = read_jsonl(path)
    assert (m["loss"], m["grad_norm"], m["lo"]) == ("nan", "inf", "-inf")
    assert m["vec"] == [1.0, "nan", "-inf"] and m["ok"] == 2.5
    assert m["step"] == 3 and m["context"] == "train"
    assert params["params"] == {"eps": "inf", "k": ["nan"]}

    restored = read_jsonl(path, restore_nonfinite=True)[0]
    assert math.isnan(restored["loss"]) and restored["grad_norm"] == math.inf and restored["lo"] == -math.inf
    assert restored["vec"][0] == 1.0 and math.isnan(restored["vec"][1]) and restored["vec"][2] == -math.inf
    assert restored["context"] == "train"


def test_odd_values_never_crash(tmp_path):
    class BadRepr:
        def __repr__(self):
            raise RuntimeError("no repr")

    cyclic: list = []
    cyclic.append(cyclic)
    lg = JSONLLogger(tmp_path / "m.jsonl")
    lg.log_params({"bad": BadRepr(), "cyc": cyclic, (1, 2): "tuple key", "c": 1 + 2j, "s": {3}, "b": b"x"})
    lg.log_other("weird", BadRepr())
    lg.finish("completed")
    p, o, _ = read_jsonl(tmp_path / "m.jsonl")
    assert p["params"]["bad"].startswith("<unrepresentable ") and p["params"]["bad"].endswith("BadRepr>")
    assert p["params"]["(1, 2)"] == "tuple key"
    assert p["params"]["c"] == "(1+2j)" and p["params"]["s"] == [3]
    assert isinstance(p["params"]["cyc"], list)
    assert o["value"] == p["params"]["bad"]


def test_metric_named_like_a_header_field_raises(tmp_path):
    lg = JSONLLogger(tmp_path / "m.jsonl")
    with pytest.raises(ValueError, match=r"\['step'\].*rename"):
        lg.log_metrics({"step": 1.0}, step=1, epoch=1, context="train")
    lg.finish("failed")


def test_non_train_lines_reach_disk_before_finish(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lg = JSONLLogger(path, flush_interval=3600.0)
    lg.log_params({"a": 1})
    assert [ln["kind"] for ln in _disk_lines(path)] == ["params"]
    lg.log_other("k", "v")
    assert len(_disk_lines(path)) == 2

    # Train lines wait in the buffer (within the flush interval) ...
    for s in range(1, 11):
        lg.log_metrics({"loss": 1.0 / s}, step=s, epoch=1, context="train")
    assert len(_disk_lines(path)) == 2
    # ... and go out with the next non-train line, in order.
    lg.log_metrics({"acc": 0.5}, step=10, epoch=1, context="validate")
    on_disk = _disk_lines(path)
    assert [ln.get("step") for ln in on_disk[2:]] == list(range(1, 11)) + [10]
    assert on_disk[-1]["context"] == "validate"

    lg.log_metrics({"loss": 0.01}, step=11, epoch=2, context="train")
    lg.flush()
    assert _disk_lines(path)[-1]["step"] == 11
    lg.finish("completed")


def test_train_lines_flush_after_the_interval(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lg = JSONLLogger(path, flush_interval=0.0)
    lg.log_metrics({"loss": 1.0}, step=1, epoch=1, context="train")
    assert _disk_lines(path)[-1]["step"] == 1
    lg.finish("completed")


def test_verb_after_finish_raises(tmp_path):
    lg = JSONLLogger(tmp_path / "metrics.jsonl")
    lg.finish("completed")
    for call in (
        lambda: lg.log_params({"a": 1}),
        lambda: lg.log_other("k", "v"),
        lambda: lg.log_metrics({"loss": 1.0}, step=1, epoch=1, context="train"),
        lambda: lg.finish("completed"),
    ):
        with pytest.raises(RuntimeError, match="is finished"):
            call()
    assert lg.info()["backend"] == "jsonl"  # queries still work
    lg.flush()  # a no-op, not an error
    assert [ln["kind"] for ln in read_jsonl(tmp_path / "metrics.jsonl")] == ["finish"]


def test_garbage_collected_logger_is_flushed(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lg = JSONLLogger(path, flush_interval=3600.0)
    lg.log_metrics({"loss": 1.0}, step=1, epoch=1, context="train")
    del lg
    gc.collect()
    assert _disk_lines(path)[-1]["step"] == 1


def test_exit_without_finish_flushes(tmp_path):
    path = tmp_path / "metrics.jsonl"
    script = textwrap.dedent(
        f"""
        from jaxnitro.loggers.jsonl import JSONLLogger
        lg = JSONLLogger({str(path)!r}, flush_interval=3600.0)
        for s in range(100):
            lg.log_metrics({{"loss": 1.0}}, step=s, epoch=1, context="train")
        raise SystemExit(3)
        """
    )
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert res.returncode == 3, res.stderr
    lines = read_jsonl(path)
    assert len(lines) == 100 and all(ln["kind"] == "metrics" for ln in lines)  # no finish line


def test_read_jsonl_tolerates_a_torn_last_line_only(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "params", "params": {}}\n{"kind": "metr')
    assert read_jsonl(path) == [{"kind": "params", "params": {}}]
    path.write_text('{"kind": "params", "params": {}}\n{"kind": "metr\n{"kind": "finish"}\n')
    with pytest.raises(ValueError, match="line 2"):
        read_jsonl(path)


def test_appends_rather_than_truncates(tmp_path):
    path = tmp_path / "metrics.jsonl"
    JSONLLogger(path).finish("first")
    JSONLLogger(path).finish("second")
    assert [ln["status"] for ln in read_jsonl(path)] == ["first", "second"]


def test_hookimpl(tmp_path):
    for name in ("jsonl", "json", "JSONL"):
        lg = jaxnitro_make_logger(name=name, run_dir=tmp_path / name, experiment=None)
        assert isinstance(lg, JSONLLogger)
        assert lg.path == tmp_path / name / "metrics.jsonl"
        lg.finish("completed")
    for other in ("tensorboard", "mlflow", "", None, 3):
        assert jaxnitro_make_logger(name=other, run_dir=tmp_path, experiment=None) is None
    assert not (tmp_path / "metrics.jsonl").exists()


def test_hookimpl_through_pluggy(tmp_path):
    import pluggy

    import jaxnitro.loggers.jsonl as mod
    from jaxnitro.hookspecs import PROJECT, ExtensionSpec

    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(ExtensionSpec)
    pm.register(mod)
    lg = pm.hook.jaxnitro_make_logger(name="jsonl", run_dir=tmp_path, experiment=None)
    assert isinstance(lg, JSONLLogger)
    lg.finish("completed")
    assert pm.hook.jaxnitro_make_logger(name="console", run_dir=tmp_path, experiment=None) is None


def test_train_line_is_cheap_enough_to_call_per_step(tmp_path):
    lg = JSONLLogger(tmp_path / "metrics.jsonl")
    for s in range(20_000):
        lg.log_metrics({"loss": np.float32(0.25), "schedule/learning_rate": 1e-3}, step=s, epoch=1, context="train")
    lg.finish("completed")
    assert len(read_jsonl(tmp_path / "metrics.jsonl")) == 20_001
