"""The MLflow logger plugin, read back with ``MlflowClient`` from a real SQLite tracking store:
every train step and loss equals metrics.jsonl, the validations, the params (long values cut with
a marker), the binding report artifact, and the run status (FINISHED, FAILED, KILLED); a configured
logger object on a shared store, reused across runs; odd values; the missing-extra message.

Making a SQLite store runs MLflow's schema migrations (1-2 s on 2 cores, ~5 s cold), so the
default store (in the run folder) is made once, and the other tests share a copy of it."""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("mlflow", reason="the MLflow logger needs mlflow-skinny (jaxnitro[mlflow])")
pytest.importorskip("sqlalchemy", reason="MLflow's SQLite store needs sqlalchemy (jaxnitro[mlflow])")
pytest.importorskip("alembic", reason="MLflow's SQLite store needs alembic (jaxnitro[mlflow])")
from mlflow.tracking import MlflowClient

# MLflow 3.17's SQLite store uses an SQLAlchemy loader option that SQLAlchemy 2.1 deprecates
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:mlflow.*")

import jaxnitro as jn
import jaxnitro.loggers.mlflow as mlflow_logger
from jaxnitro.loggers.jsonl import read_jsonl
from logger_plugin_support import fetch, free_port, fresh_copy, kill_after, plugin_module, server, stopping_after_first_epoch
from tiny import Tiny, tiny_data

DATA = tiny_data()  # 6 train batches, a val split: 2 epochs are steps 1..12, validations at 6 and 12


@pytest.fixture(autouse=True)
def plugin():
    with plugin_module(mlflow_logger, "mlflow") as module:
        yield module


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """Tiny trained 2 epochs with ``logger=["jsonl", "mlflow"]``, from an empty working folder."""
    root = tmp_path_factory.mktemp("default")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)  # nothing may land in the working folder (MLflow's ./mlruns default)
        with plugin_module(mlflow_logger, "mlflow"):
            n = jn.train(Tiny(max_epochs=2), data=DATA, run_dir=root / "runs", logger=["jsonl", "mlflow"])
    return root, n


@pytest.fixture(scope="module")
def store(default_run, tmp_path_factory) -> str:
    """A store shared by the tests that configure the logger: a copy of the default run's store,
    whose schema is already made (making one costs 1-5 s)."""
    _, n = default_run
    copy = tmp_path_factory.mktemp("shared") / "mlflow.db"
    shutil.copyfile(Path(n.run_dir).parent / "mlflow.db", copy)
    return "sqlite:///" + str(copy)


def history(client, run_id, key):
    return [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]


def read_artifact(client, run_id, path, dst) -> str:
    return Path(client.download_artifacts(run_id, path, str(dst))).read_text()


def test_a_default_run_reads_back_with_mlflowclient_as_the_jsonl_logger_wrote_it(default_run, tmp_path):
    root, n = default_run
    run_dir = Path(n.run_dir)
    lines = read_jsonl(run_dir / "metrics.jsonl", restore_nonfinite=True)
    assert sorted(p.name for p in root.iterdir()) == ["runs"]
    assert sorted(p.name for p in (root / "runs").iterdir()) == sorted(["mlflow.db", "mlartifacts", run_dir.name])

    client = MlflowClient(tracking_uri=f"sqlite:///{root}/runs/mlflow.db")  # one store at the run_dir's root
    (experiment,) = [e for e in client.search_experiments() if e.name == "Tiny"]
    (run,) = client.search_runs([experiment.experiment_id])
    backend = jn.backend(n.loggers[1])
    assert isinstance(backend, mlflow_logger.MLflowRun) and backend.run_id == run.info.run_id
    assert run.info.status == "FINISHED" and run.info.run_name == run_dir.name
    assert run.data.tags["jaxnitro.status"] == "done" and run.data.tags["jaxnitro.run_dir"] == str(run_dir)

    train = [(ln["step"], ln["loss"]) for ln in lines if ln["kind"] == "metrics" and ln["context"] == "train"]
    assert [s for s, _ in train] == list(range(1, 13))
    assert history(client, run.info.run_id, "train/loss") == train
    validate = [(ln["step"], ln["loss"]) for ln in lines if ln.get("context") == "validate"]
    assert history(client, run.info.run_id, "validate/loss") == validate == [(r["step"], r["loss"]) for r in n.rows]
    data = [(ln["step"], ln["data_wait_frac"]) for ln in lines if ln.get("context") == "data"]
    assert history(client, run.info.run_id, "data/data_wait_frac") == data

    params = next(ln["params"] for ln in lines if ln["kind"] == "params")
    assert run.data.params == {key: mlflow_logger.param_value(value) for key, value in params.items()}
    assert run.data.params["field/width"] == "16" and run.data.params["knob/n_devs"] == "None"

    report = next(ln["value"] for ln in lines if ln.get("key") == "binding_report")
    assert read_artifact(client, run.info.run_id, "binding_report.txt", tmp_path) == report
    assert Path(run.info.artifact_uri.removeprefix("file://")).is_relative_to(root / "runs" / "mlartifacts")
    assert json.loads((run_dir / "mlflow_run.json").read_text()) == {
        "tracking_uri": f"sqlite:///{root}/runs/mlflow.db", "experiment_id": experiment.experiment_id, "run_id": run.info.run_id,
    }


@pytest.mark.parametrize(
    ("error", "status", "mlflow_status"),
    [(RuntimeError("boom after epoch 1"), "failed", "FAILED"), (KeyboardInterrupt(), "interrupted", "KILLED")],
)
def test_a_failed_or_interrupted_run_ends_failed_or_killed(tmp_path, store, error, status, mlflow_status):
    logger = jn.MLflowLogger(tracking_uri=store, experiment_name="stops")
    n = jn.Nitro(Tiny(max_epochs=2), data=DATA, run_dir=tmp_path, logger=logger)
    with stopping_after_first_epoch(error), pytest.raises(type(error)):
        n.train()
    assert n.status == status
    run = jn.backend(n).run  # the handle's first logger
    assert (run.info.status, run.data.tags["jaxnitro.status"]) == (mlflow_status, status)
    assert [s for s, _ in history(jn.backend(n).client, run.info.run_id, "train/loss")] == list(range(1, 7))


def test_a_configured_logger_object_on_a_shared_store_makes_a_run_per_training(tmp_path, store):
    logger = mlflow_logger.MLflowLogger(tracking_uri=store, experiment_name="sweep", tags={"sweep": "a"})
    runs = []
    for smoothing in (0.0, 0.1):
        n = jn.train(Tiny(max_epochs=1, smoothing=smoothing), data=DATA, run_dir=tmp_path, logger=logger)  # reused
        runs.append((n, jn.backend(logger).run))
    (first, one), (second, two) = runs
    assert one.info.run_id != two.info.run_id and one.info.experiment_id == two.info.experiment_id
    assert [r.info.run_name for r in (one, two)] == [Path(first.run_dir).name, Path(second.run_dir).name]
    assert [r.data.params["field/smoothing"] for r in (one, two)] == ["0.0", str(float(np.float32(0.1)))]  # as run
    assert all(r.info.status == "FINISHED" and r.data.tags["sweep"] == "a" for r in (one, two))
    database = Path(store.removeprefix("sqlite:///"))
    assert Path(one.info.artifact_uri.removeprefix("file://")).is_relative_to(database.parent / "mlartifacts")
    assert logger.info() == {
        "backend": "mlflow", "tracking_uri": store, "experiment_id": two.info.experiment_id, "run_id": two.info.run_id,
    }


def test_long_params_odd_names_and_values_do_not_crash_it(tmp_path, store):
    logger = mlflow_logger.MLflowLogger(tracking_uri=store, experiment_name="odd values")
    with pytest.raises(RuntimeError, match="no MLflow run yet"):
        _ = logger.backend
    long = "x" * 7000
    logger.log_params({"long": long, "odd key@1//x": 1, "none": None, "flag": True, "list": [1, "a"]})
    logger.log_metrics(
        {"nan": math.nan, "jax": jnp.float32(2.5), "one": np.ones((1, 1)), "vec": np.ones(3), "word": "text", "none": None},
        step=3, epoch=1, context="validate",
    )
    logger.log_other("notes", {"a": [1, 2]})
    logger.finish("terminated")
    with pytest.raises(RuntimeError, match="is finished"):
        logger.log_metrics({"loss": 1.0}, step=4, epoch=1, context="train")

    b = logger.backend
    run = b.run
    assert run.info.status == "KILLED"
    value = run.data.params["long"]
    assert value == "x" * 5984 + "...[+1016 chars]" and len(value) == mlflow_logger.MAX_PARAM_LENGTH
    assert {k: run.data.params[k] for k in ("odd key_1/x", "none", "flag", "list")} == {
        "odd key_1/x": "1", "none": "None", "flag": "true", "list": '[1, "a"]',
    }
    assert math.isnan(run.data.metrics["validate/nan"])
    assert {k: v for k, v in run.data.metrics.items() if k != "validate/nan"} == {"validate/jax": 2.5, "validate/one": 1.0}
    assert read_artifact(b.client, b.run_id, "notes.txt", tmp_path) == '{\n "a": [\n  1,\n  2\n ]\n}'


def test_param_values_and_names_are_made_acceptable():
    assert mlflow_logger.param_value("a" * 10, limit=10) == "a" * 10
    assert mlflow_logger.param_value("a" * 50, limit=40) == "a" * 26 + "...[+24 chars]"
    assert mlflow_logger.param_value("a" * 11, limit=10) == "a" * 10  # no room for the marker
    assert mlflow_logger.mlflow_name("/a//b/./c/../d:e") == "a/b/c/d_e"
    assert mlflow_logger.mlflow_name("") == "_" and len(mlflow_logger.mlflow_name("k" * 300)) == 250


def test_the_hook_answers_its_name_only_and_names_the_missing_extra(tmp_path, monkeypatch):
    make = mlflow_logger.jaxnitro_make_logger
    assert isinstance(make(name="MLflow", run_dir=tmp_path, experiment=None), mlflow_logger.MLflowLogger)
    assert make(name="jsonl", run_dir=tmp_path, experiment=None) is None

    monkeypatch.setitem(sys.modules, "alembic", None)  # as if the SQLite store's packages were missing
    copy = fresh_copy(mlflow_logger, monkeypatch)  # the plugin module itself imports without them
    with pytest.raises(ImportError, match=r"`alembic`.*jaxnitro\[mlflow\]"):
        copy.jaxnitro_make_logger(name="mlflow", run_dir=tmp_path, experiment=None)
    assert isinstance(copy.MLflowLogger("http://localhost:5000"), copy.MLflowLogger)  # a server needs neither


def test_a_store_out_of_reach_is_reported_and_training_goes_on(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    logger = mlflow_logger.MLflowLogger("http://127.0.0.1:9")  # nothing listens on port 9
    with pytest.warns(RuntimeWarning, match=r"MLflowLogger .*failed in `log_params`.*tracking store 'http://127.0.0.1:9'"):
        n = jn.train(Tiny(max_epochs=1), data=DATA, run_dir=tmp_path, logger=["jsonl", logger])
    assert n.status == "done" and n.step == 6
    assert len(n.record.problems) == 1 and "MLflowLogger" in n.record.problems[0]
    with pytest.raises(mlflow_logger.MLflowStoreError) as caught:
        mlflow_logger.MLflowLogger("http://127.0.0.1:9").log_params({})
    assert isinstance(caught.value, OSError) and caught.value.__cause__ is not None


def test_a_resumed_run_folder_reopens_its_mlflow_run(tmp_path, store):
    """resume(step): the run folder's MLflow run (mlflow_run.json) is reopened, RUNNING again; steps
    it holds are skipped per key; a param whose value changed goes to a jaxnitro.resume/ tag."""
    folder = tmp_path / "20260101-000000-1"
    first = mlflow_logger.MLflowLogger(tracking_uri=store, experiment_name="resumes", run_dir=folder)
    first.log_params({"run_dir": str(folder), "knob/max_epochs": 2})
    for step in (1, 2, 3):
        first.log_metrics({"loss": step / 10}, step=step, epoch=1, context="train")
    first.log_metrics({"loss": 0.5}, step=2, epoch=1, context="validate")
    run_id = jn.backend(first).run_id  # killed here: never finished, RUNNING
    assert json.loads((folder / "mlflow_run.json").read_text())["run_id"] == run_id

    again = mlflow_logger.MLflowLogger(tracking_uri=store, experiment_name="resumes", run_dir=folder)
    again.resume(2)  # the checkpoint is at step 2; step 3 was logged past it
    again.log_params({"run_dir": str(folder), "knob/max_epochs": 4, "new": "x"})
    b = jn.backend(again)
    assert b.run_id == run_id and b.run.info.status == "RUNNING"
    for step in (3, 4):
        again.log_metrics({"loss": step}, step=step, epoch=2, context="train")
    again.log_metrics({"loss": 0.25}, step=4, epoch=2, context="validate")
    again.finish("done")

    run = b.run
    assert run.info.status == "FINISHED" and run.data.tags["jaxnitro.resumed_from"] == "2"
    assert history(b.client, run_id, "train/loss") == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 4.0)]  # step 3 kept once
    assert history(b.client, run_id, "validate/loss") == [(2, 0.5), (4, 0.25)]
    assert run.data.params["knob/max_epochs"] == "2" and run.data.params["new"] == "x"
    assert run.data.tags["jaxnitro.resume/knob/max_epochs"] == "4"
    assert len(b.client.search_runs([run.info.experiment_id])) == 1

    other = mlflow_logger.MLflowLogger(tracking_uri=store, experiment_name="resumes", run_dir=tmp_path / "other")
    other.resume(2)  # a folder without mlflow_run.json: a new MLflow run
    other.log_params({})
    assert jn.backend(other).run_id != run_id


# -- two runs in one run_dir, the second killed and resumed; the MLflow UI on their store ------------


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory):
    """A run_dir with two runs of Tiny (3 epochs, 18 steps): the first done, the second SIGKILLed
    right after its epoch-2 validation (logged to step 12, newest checkpoint at step 6) and
    resumed with ``resume="auto"``. Returns the run_dir, the two handles and the second run's
    MLflow run id, as its folder recorded it before the kill."""
    root = tmp_path_factory.mktemp("two_runs")
    keep = jn.Checkpointer(keep=jn.Last(2), asynchronous=False)
    with plugin_module(mlflow_logger, "mlflow"):
        first = jn.train(Tiny(max_epochs=3), data=DATA, run_dir=root, logger=["jsonl", "mlflow"], checkpointer=keep)
        kill_after(root, "jsonl,mlflow", "validate@2", max_epochs=3)
        (folder,) = [p for p in root.iterdir() if p.is_dir() and p.name not in (Path(first.run_dir).name, "mlartifacts")]
        run_id = json.loads((folder / "mlflow_run.json").read_text())["run_id"]
        client = MlflowClient(tracking_uri=f"sqlite:///{root}/mlflow.db")
        killed = client.get_run(run_id)
        assert killed.info.status == "RUNNING" and [s for s, _ in history(client, run_id, "validate/loss")] == [6, 12]
        second = jn.Nitro(Tiny(max_epochs=3), data=DATA, run_dir=root, resume="auto", logger=["jsonl", "mlflow"], checkpointer=keep)
        assert second.plan.resumed.step == 6 and second.plan.resumed.run_folder == str(folder)
        second.train()
    return root, first, second, run_id


@pytest.mark.slow  # a fresh training process and three runs (~30 s on 2 cores)
def test_two_runs_and_a_killed_resumed_one_are_two_mlflow_runs_with_each_step_once(killed_and_resumed):
    root, first, second, run_id = killed_and_resumed
    client = MlflowClient(tracking_uri=f"sqlite:///{root}/mlflow.db")  # the run_dir's one store
    experiment = client.get_experiment_by_name("Tiny")
    runs = {r.info.run_name: r for r in client.search_runs([experiment.experiment_id])}
    assert sorted(runs) == sorted([Path(first.run_dir).name, Path(second.run_dir).name])  # exactly two
    resumed = runs[Path(second.run_dir).name]
    assert resumed.info.run_id == run_id  # continued, not a new MLflow run
    assert all(r.info.status == "FINISHED" and r.data.tags["jaxnitro.status"] == "done" for r in runs.values())
    assert resumed.data.tags["jaxnitro.resumed_from"] == "6"
    for r in runs.values():
        assert [s for s, _ in history(client, r.info.run_id, "train/loss")] == list(range(1, 19))  # each once
        assert [s for s, _ in history(client, r.info.run_id, "validate/loss")] == [6, 12, 18]
        assert [s for s, _ in history(client, r.info.run_id, "data/data_wait_frac")] == [6, 12, 18]
    lines = read_jsonl(Path(second.run_dir) / "metrics.jsonl", restore_nonfinite=True)
    train = [(ln["step"], ln["loss"]) for ln in lines if ln.get("context") == "train"]
    assert [s for s, _ in train] == list(range(1, 19))
    assert history(client, run_id, "train/loss") == train  # MLflow holds what metrics.jsonl holds


@pytest.mark.slow  # the MLflow server takes 10-40 s to start on 2 cores
def test_the_docs_mlflow_ui_command_serves_the_page_and_the_runs(killed_and_resumed):
    root, first, second, run_id = killed_and_resumed
    pytest.importorskip("flask", reason="mlflow ui needs the full mlflow (jaxnitro[mlflow-ui])")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    mlflow_cli = str(Path(sys.executable).parent / "mlflow")
    command = [mlflow_cli, "ui", "--backend-store-uri", f"sqlite:///{root}/mlflow.db", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    with server(command, base + "/"):
        import urllib.request

        with urllib.request.urlopen(base + "/", timeout=30) as page:
            html = page.read().decode()
        assert "<!doctype html>" in html.lower() and "static-files" in html  # the UI's own page
        experiment = fetch(f"{base}/api/2.0/mlflow/experiments/get-by-name?experiment_name=Tiny")["experiment"]
        found = fetch(f"{base}/api/2.0/mlflow/runs/search", {"experiment_ids": [experiment["experiment_id"]]})["runs"]
        assert sorted(r["info"]["run_name"] for r in found) == sorted([Path(first.run_dir).name, Path(second.run_dir).name])
        assert run_id in [r["info"]["run_id"] for r in found]
        assert {r["info"]["status"] for r in found} == {"FINISHED"}
