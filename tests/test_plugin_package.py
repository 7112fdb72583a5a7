"""Third-party plugin packages, installed for real.

* ``examples/plugin_package`` (distribution ``jaxnitro-example-plugins``) is
  pip-installed into a temporary target once per module, put on ``sys.path``,
  and used: ``logger="csv"`` writes ``metrics.csv`` read back with pandas, and
  splits given as its ``ArrayLoader`` are adapted by its ``jaxnitro_adapt_source``.
* A distribution written as ``*.dist-info`` on ``sys.path`` answers the logger
  name ``"jsonl"`` and the progress reporter ``"auto"`` (not ``trylast``): it
  replaces the built-ins while installed, and the built-ins are back after it
  is removed.

Every test removes what it put on ``sys.path`` and reloads the plugins on the
way out, so other tests see only the built-in plugins.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import jaxnitro as jn
from plugin_dist import installed, write_distribution
from tiny import Tiny, make_arrays, tiny_data

PACKAGE_SRC = Path(__file__).resolve().parents[1] / "examples" / "plugin_package"
DIST = "jaxnitro-example-plugins"
MODULE = "jaxnitro_example_plugins"


# -- installing and removing ----------------------------------------------------------------


def _builds_wheels_offline() -> bool:
    """Whether this interpreter's setuptools builds a wheel with nothing fetched.

    setuptools >= 70.1 ships ``bdist_wheel``; an older one (3.11's venv has 65.5)
    needs the ``wheel`` package next to it.
    """
    if importlib.util.find_spec("wheel") is not None:
        return True
    try:
        import setuptools
    except ImportError:
        return False
    version = tuple(int(p) for p in re.findall(r"\d+", setuptools.__version__)[:2])
    return version >= (70, 1)


@pytest.fixture(scope="module")
def example_site(tmp_path_factory) -> Path:
    """``pip install --no-deps --target <tmp> examples/plugin_package``, once per module.

    Installed from a copy of the package, so the build leaves nothing in the
    checkout. Without network: ``--no-build-isolation`` with the interpreter's
    own setuptools, when it can build a wheel (see :func:`_builds_wheels_offline`);
    otherwise pip's isolated build, which fetches setuptools from the configured index.
    """
    root = tmp_path_factory.mktemp("example_plugins")
    src, site = root / "src", root / "site"
    shutil.copytree(PACKAGE_SRC, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check", "-q"]
    if _builds_wheels_offline():
        cmd.append("--no-build-isolation")
    cmd += ["--target", str(site), str(src)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}"
    assert (site / MODULE / "__init__.py").is_file()
    assert list(site.glob("jaxnitro_example_plugins-0.1.0.dist-info/entry_points.txt"))
    return site


@pytest.fixture(autouse=True)
def builtin_plugins_only(monkeypatch):
    monkeypatch.delenv("JAXNITRO_DISABLE_PLUGINS", raising=False)
    jn.reload_plugins()
    yield
    monkeypatch.undo()
    jn.reload_plugins()


def plugin_names() -> list[str]:
    return [p.name for p in jn.plugins_info()]


def history_rows(nitro) -> list[dict]:
    history = nitro.history
    return list((history() if callable(history) else history).rows)


# -- the example package --------------------------------------------------------------------


def test_example_package_is_listed_with_its_distribution(example_site):
    with installed(example_site, MODULE):
        info = {p.name: p for p in jn.plugins_info()}
        assert {"jsonl", "progress", "csv", "array_loader"} <= set(info)
        csv_, loader = info["csv"], info["array_loader"]
        assert (csv_.distribution, csv_.version, csv_.module) == (DIST, "0.1.0", f"{MODULE}.csv_logger")
        assert (loader.distribution, loader.version, loader.module) == (DIST, "0.1.0", f"{MODULE}.array_loader")
        assert set(csv_.hooks) == {"jaxnitro_make_logger"}
        assert set(loader.hooks) == {"jaxnitro_adapt_source"}
        assert info["jsonl"].distribution == "jaxnitro"
        # the pip-installed copy is the one loaded, not the source folder
        assert Path(sys.modules[MODULE].__file__).is_relative_to(example_site)
    assert "csv" not in plugin_names() and "array_loader" not in plugin_names()
    assert MODULE not in sys.modules


def test_tiny_trains_with_the_csv_logger_and_array_loaders(example_site, tmp_path):
    x, y, onehot = make_arrays(96 + 40)
    with installed(example_site, MODULE):
        from jaxnitro_example_plugins import ArrayLoader

        def loader(rows, **kw):
            return ArrayLoader({"x": x[rows], "label": onehot[rows], "y": y[rows]}, 16, **kw)

        data = {"train": loader(slice(0, 96), seed=3), "val": loader(slice(96, 136))}
        n = jn.train(Tiny(), data=data, logger="csv", run_dir=tmp_path / "runs", max_epochs=2)
        assert n.status == "done" and n.step == 12

        # the adapter made the splits: train drops nothing (96 = 6 x 16), val keeps its partial batch
        assert type(n.data["train"].source).__name__ == "ArraySource"
        assert (len(n.data["train"]), len(n.data["val"])) == (6, 3)
        assert n.data["train"].source.shuffle and not n.data["val"].source.shuffle

    run_dir = Path(n.run_dir)
    assert not (run_dir / "metrics.jsonl").exists(), "only the csv logger was asked for"
    df = pd.read_csv(run_dir / "metrics.csv")
    assert list(df.columns[:4]) == ["context", "step", "epoch", "time"] and "loss" in df.columns
    assert df["time"].is_monotonic_increasing and (df["time"] > 1e9).all()

    train = df[df.context == "train"]
    assert train.step.tolist() == list(range(1, 13))
    assert train.epoch.tolist() == [1] * 6 + [2] * 6
    assert np.isfinite(train.loss).all() and (train.loss > 0).all()

    val = df[df.context == "validate"]
    assert list(zip(val.step, val.epoch)) == [(6, 1), (12, 2)]
    assert np.isfinite(val.loss).all()
    # the logged values are the run's values
    rows = history_rows(n)
    assert [r["epoch"] for r in rows] == [1, 2]
    np.testing.assert_allclose(val.loss, [r["loss"] for r in rows], rtol=1e-6)
    np.testing.assert_allclose(train.groupby("epoch").loss.mean(), [r["train_loss"] for r in rows], rtol=1e-5)

    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "done" and record["params"]["experiment"] == "Tiny"


def test_array_loader_sources_keep_the_source_contract(example_site):
    x, y, onehot = make_arrays(40)
    with installed(example_site, MODULE):
        from jaxnitro_example_plugins import ArrayLoader, array_loader

        loader = ArrayLoader({"x": x, "label": onehot}, 16, seed=1)
        train, val = loader.source("train"), loader.source("val")
        jn.check_batch_at(train, epoch=1)
        jn.check_batch_at(val, epoch=1)
        assert (len(train), len(val)) == (2, 3)  # 40 rows: train drops 8, val keeps them

        # train: a new permutation each epoch, the same one for the same epoch
        train.begin_epoch(1)
        first = np.concatenate([train.batch_at(i)["x"] for i in range(2)])
        train.begin_epoch(2)
        second = train.batch_at(0)["x"]
        train.begin_epoch(1)
        np.testing.assert_array_equal(train.batch_at(0)["x"], first[:16])
        assert not np.array_equal(second, first[:16])
        assert len({row.tobytes() for row in first}) == 32  # no row twice in an epoch

        # val: in order, the partial batch last; iteration gives the same batches
        val.begin_epoch(7)
        np.testing.assert_array_equal(val.batch_at(0)["x"], x[:16])
        assert val.batch_at(2)["x"].shape == (8, 8)
        np.testing.assert_array_equal(np.concatenate([b["label"] for b in val]), onehot)

        # the hook answers for ArrayLoader only
        assert array_loader.jaxnitro_adapt_source(source=[{"x": x}], split="train") is None
        assert type(array_loader.jaxnitro_adapt_source(source=loader, split="test")).__name__ == "ArraySource"

        with pytest.raises(ValueError, match="disagree on the number of rows"):
            ArrayLoader({"x": x, "label": onehot[:10]}, 16)
        with pytest.raises(ValueError, match="batch_size must be a positive int"):
            ArrayLoader({"x": x}, 0)
        with pytest.raises(ValueError, match="make no batch"):
            ArrayLoader({"x": x}, 64).source("train")


def test_csv_logger_widens_its_header_and_writes_odd_values(example_site, tmp_path):
    with installed(example_site, MODULE):
        from jaxnitro_example_plugins import CSVLogger

        log = CSVLogger(tmp_path / "run")
        log.log_params({"lr": 0.1, "path": tmp_path, "inf": float("inf")})
        log.log_metrics({"loss": np.float32(2.5)}, step=1, epoch=1, context="train")
        log.log_metrics({"loss": float("nan"), "acc": np.array(0.75), "cm": np.eye(2)}, step=1, epoch=1,
                        context="validate")
        log.log_metrics({"loss": float("inf")}, step=2, epoch=2, context="train")
        with pytest.raises(ValueError, match="collide"):
            log.log_metrics({"step": 1}, step=3, epoch=2, context="train")
        log.finish("done")
        with pytest.raises(RuntimeError, match="finished"):
            log.log_metrics({"loss": 1.0}, step=3, epoch=2, context="train")
        assert log.info() == {"backend": "csv", "path": str(tmp_path / "run" / "metrics.csv")}

    df = pd.read_csv(tmp_path / "run" / "metrics.csv")
    assert list(df.columns) == ["context", "step", "epoch", "time", "loss", "acc", "cm"]
    assert df.context.tolist() == ["train", "validate", "train"]
    assert df.loss[0] == 2.5 and np.isnan(df.loss[1]) and df.loss[2] == np.inf
    assert df.acc[1] == 0.75 and np.isnan(df.acc[0]) and json.loads(df.cm[1]) == [[1.0, 0.0], [0.0, 1.0]]
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record == {"params": {"lr": 0.1, "path": str(tmp_path), "inf": "inf"}, "other": {}, "status": "done"}


# -- replacing the built-in jsonl logger and "auto" progress reporter -----------------------

SWAP_MODULE = "jaxnitro_swap_testplugin"
SWAP_DIST = "jaxnitro-swap"

SWAP_SOURCE = textwrap.dedent(
    '''
    """A third-party plugin answering the names the built-ins answer (plain hookimpl, not trylast)."""
    from jaxnitro import hookimpl

    RECORDS = []
    LOGGERS = []
    REPORTERS = []


    class ListLogger:
        def __init__(self, run_dir):
            self.run_dir = run_dir

        def log_params(self, params):
            RECORDS.append(("params", dict(params)))

        def log_other(self, key, value):
            RECORDS.append(("other", key))

        def log_metrics(self, metrics, *, step, epoch, context):
            RECORDS.append(("metrics", context, step, epoch, dict(metrics)))

        def finish(self, status):
            RECORDS.append(("finish", status))


    class CallReporter:
        def __init__(self):
            self.calls = []

        def begin(self, total, label):
            self.calls.append(("begin", total, label))

        def update(self, position, label):
            self.calls.append(("update", position, label))

        def close(self, label):
            self.calls.append(("close", label))


    @hookimpl
    def jaxnitro_make_logger(name, run_dir, experiment):
        if name != "jsonl":
            return None
        logger = ListLogger(run_dir)
        LOGGERS.append(logger)
        return logger


    @hookimpl
    def jaxnitro_make_progress_reporter(name):
        if name != "auto":
            return None
        reporter = CallReporter()
        REPORTERS.append(reporter)
        return reporter
    '''
)


def test_an_installed_plugin_replaces_the_builtin_logger_and_reporter_until_removed(tmp_path):
    site = tmp_path / "site"
    write_distribution(site, module=SWAP_MODULE, source=SWAP_SOURCE, dist=SWAP_DIST, entry="swap")
    previous = jn.progress_reporter("auto")  # the default setting, whatever ran before
    try:
        with installed(site, SWAP_MODULE):
            info = {p.name: p for p in jn.plugins_info()}
            assert info["swap"].distribution == SWAP_DIST and "jsonl" in info and "progress" in info
            plugin = sys.modules[SWAP_MODULE]

            n = jn.Nitro(Tiny(), data=tiny_data(), run_dir=tmp_path / "runs")  # default logger and progress
            n.train()
            assert n.status == "done"

            # its logger got the run, and the built-in wrote nothing
            assert len(plugin.LOGGERS) == 1 and Path(plugin.LOGGERS[0].run_dir) == Path(n.run_dir)
            records = plugin.RECORDS
            train = [r for r in records if r[0] == "metrics" and r[1] == "train"]
            validate = [r for r in records if r[0] == "metrics" and r[1] == "validate"]
            assert [r[2] for r in train] == list(range(1, 13)) and all(np.isfinite(r[4]["loss"]) for r in train)
            assert [(r[2], r[3]) for r in validate] == [(6, 1), (12, 2)]
            assert records[0][0] == "params" and records[-1] == ("finish", "done")
            assert not (Path(n.run_dir) / "metrics.jsonl").exists()

            # its reporter drew the run: begin(2 epochs), updates up to 2.0, close
            reporters = plugin.REPORTERS
            runs = [r for r in reporters if r.calls and r.calls[0][:2] == ("begin", 2)]
            assert runs, [r.calls for r in reporters]
            calls = runs[-1].calls
            positions = [c[1] for c in calls if c[0] == "update"]
            assert positions and max(positions) == pytest.approx(2.0)
            assert calls[-1][0] == "close"
            seen = (len(records), len(reporters))

        # removed: the built-ins answer again
        assert "swap" not in plugin_names() and SWAP_MODULE not in sys.modules
        m = jn.Nitro(Tiny(), data=tiny_data(), run_dir=tmp_path / "runs")
        m.train()
        assert m.status == "done" and Path(m.run_dir) != Path(n.run_dir)
        lines = [json.loads(s) for s in (Path(m.run_dir) / "metrics.jsonl").read_text().splitlines()]
        assert [ln["step"] for ln in lines if ln.get("context") == "train"] == list(range(1, 13))
        assert lines[-1]["kind"] == "finish" and lines[-1]["status"] == "done"
        assert (len(records), len(reporters)) == seen, "the removed plugin was not called again"
    finally:
        jn.progress_reporter(previous)
