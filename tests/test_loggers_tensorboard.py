"""The TensorBoard logger plugin, read back with TensorBoard's own reader (EventAccumulator):
every train step and loss equals metrics.jsonl, the validations, the parameters (HParams session
and text), the binding report, and the final status (text and HParams session end) of a done, a
failed and an interrupted run; odd values do not crash it; the plugin loads without tensorboardX."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("tensorboardX", reason="the TensorBoard logger needs tensorboardX (jaxnitro[tensorboard])")
event_accumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator",
    reason="reading event files back needs tensorboard (jaxnitro[test])",
)
from tensorboard.plugins.hparams import plugin_data_pb2

import jaxnitro as jn
import jaxnitro.loggers.tensorboard as tensorboard_logger
from jaxnitro.loggers.jsonl import read_jsonl
from logger_plugin_support import fetch, free_port, fresh_copy, kill_after, plugin_module, server, stopping_after_first_epoch
from tiny import Tiny, tiny_data

DATA = tiny_data()  # 6 train batches, a val split: 2 epochs are steps 1..12, validations at 6 and 12


@pytest.fixture(autouse=True)
def plugin():
    with plugin_module(tensorboard_logger, "tensorboard") as module:
        yield module


def read_events(folder):
    acc = event_accumulator.EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0, "histograms": 0})
    acc.Reload()
    return acc


def scalars(acc, tag):
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def texts(acc, tag):
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(f"{tag}/text_summary")]


def hparams_data(acc, which):
    data = plugin_data_pb2.HParamsPluginData()
    data.ParseFromString(acc.PluginTagToContent("hparams")[f"_hparams_/{which}"])
    return data


def session_status(acc) -> str:
    from tensorboard.plugins.hparams import api_pb2

    return api_pb2.Status.Name(hparams_data(acc, "session_end_info").session_end_info.status)


def f32(x) -> float:
    return float(np.float32(x))  # TensorBoard stores scalars as float32


def test_every_value_of_a_run_reads_back_as_the_jsonl_logger_wrote_it(tmp_path):
    n = jn.train(Tiny(max_epochs=2), data=DATA, run_dir=tmp_path, logger=["jsonl", "tensorboard"])
    lines = read_jsonl(Path(n.run_dir) / "metrics.jsonl", restore_nonfinite=True)
    acc = read_events(n.run_dir)

    train = [(ln["step"], f32(ln["loss"])) for ln in lines if ln["kind"] == "metrics" and ln["context"] == "train"]
    assert [s for s, _ in train] == list(range(1, 13))
    assert scalars(acc, "train/loss") == train
    validate = [(ln["step"], f32(ln["loss"])) for ln in lines if ln.get("context") == "validate"]
    assert scalars(acc, "validate/loss") == validate == [(r["step"], f32(r["loss"])) for r in n.rows]
    data = [(ln["step"], f32(ln["data_wait_frac"])) for ln in lines if ln.get("context") == "data"]
    assert scalars(acc, "data/data_wait_frac") == data and [s for s, _ in data] == [6, 12]

    # params: the HParams session holds every non-None value with its type, the text every key
    params = next(ln["params"] for ln in lines if ln["kind"] == "params")
    session = hparams_data(acc, "session_start_info").session_start_info.hparams
    for key, value in params.items():
        if value is None:
            assert key not in session
        elif isinstance(value, bool):
            assert session[key].bool_value is value
        elif isinstance(value, (int, float)):
            assert session[key].number_value == value
        else:
            assert session[key].string_value == value
    (step, table), = texts(acc, "params")
    assert step == 0 and all(f"| {key} |" in table for key in params)

    report = next(ln["value"] for ln in lines if ln.get("key") == "binding_report")
    (_, text), = texts(acc, "binding_report")
    assert [line[4:] for line in text.split("\n")] == report.split("\n")  # a Markdown code block
    assert texts(acc, "status") == [(12, "done")] and session_status(acc) == "STATUS_SUCCESS"
    logger = n.loggers[1]
    assert logger.finished and jn.backend(logger) is None  # no SummaryWriter was asked for
    assert logger.path.parent == Path(n.run_dir) and logger.path.name.endswith(".jaxnitro")


def test_the_backend_is_a_summarywriter_on_the_run_folder_closed_at_finish(tmp_path):
    logger = tensorboard_logger.TensorBoardLogger(tmp_path)
    assert logger.backend is None  # before the first verb
    logger.log_params({"run_dir": str(tmp_path)})
    writer = logger.backend
    assert writer is logger.backend and Path(writer.logdir) == tmp_path
    writer.add_scalar("extra/weight_norm", 3.5, 2)
    logger.finish("done")
    assert logger.backend is writer and writer.file_writer is None  # closed by finish
    assert scalars(read_events(tmp_path), "extra/weight_norm") == [(2, 3.5)]


@pytest.mark.parametrize(
    ("error", "status", "session"),
    [(RuntimeError("boom after epoch 1"), "failed", "STATUS_FAILURE"), (KeyboardInterrupt(), "interrupted", "STATUS_FAILURE")],
)
def test_a_failed_or_interrupted_run_ends_with_its_status(tmp_path, error, status, session):
    n = jn.Nitro(Tiny(max_epochs=2), data=DATA, run_dir=tmp_path, logger="tensorboard")
    with stopping_after_first_epoch(error), pytest.raises(type(error)):
        n.train()
    assert n.status == status
    acc = read_events(n.run_dir)
    assert [s for s, _ in scalars(acc, "train/loss")] == list(range(1, 7))
    assert texts(acc, "status") == [(6, status)] and session_status(acc) == session


def test_a_preempted_and_resumed_run_has_a_status_per_train_call_the_last_one_its_own(tmp_path):
    # as metrics.jsonl keeps a finish line per train(): TensorBoard's reader does not purge text
    # summaries at a restart, so the preempted run's status stays; the docs read the last one
    kw = dict(data=DATA, run_dir=tmp_path, logger="tensorboard",
              checkpointer=jn.Checkpointer(keep=jn.Last(1), asynchronous=False))
    n = jn.Nitro(Tiny(max_epochs=2), **kw)
    with stopping_after_first_epoch(jn.Preempted()), pytest.raises(jn.Preempted):
        n.train()
    assert texts(read_events(n.run_dir), "status") == [(6, "preempted")]
    resumed = jn.Nitro(Tiny(max_epochs=2), resume="auto", **kw)
    assert resumed.step == 6
    resumed.train()
    acc = read_events(resumed.run_dir)
    assert texts(acc, "status") == [(6, "preempted"), (12, "done")]
    assert acc.Tensors("status/text_summary")[-1].tensor_proto.string_val == [b"done"]  # the docs' idiom
    assert [s for s, _ in scalars(acc, "train/loss")] == list(range(1, 13))


def test_a_configured_logger_object_writes_each_run_into_its_own_folder(tmp_path):
    logger = jn.TensorBoardLogger(flush_secs=1)  # no folder given: each run's own, from its params
    assert isinstance(logger, tensorboard_logger.TensorBoardLogger)
    first = jn.train(Tiny(max_epochs=1), data=DATA, run_dir=tmp_path, logger=logger)
    second = jn.train(Tiny(max_epochs=1), data=DATA, run_dir=tmp_path, logger=logger)  # reused: a new writer
    assert first.run_dir != second.run_dir
    for n in (first, second):
        acc = read_events(n.run_dir)
        assert [s for s, _ in scalars(acc, "train/loss")] == list(range(1, 7))
        assert texts(acc, "status") == [(6, "done")]
    assert logger.info() == {"backend": "tensorboard", "log_dir": str(second.run_dir)}

    fixed = tensorboard_logger.TensorBoardLogger(tmp_path / "fixed")
    n = jn.train(Tiny(max_epochs=1), data=DATA, run_dir=tmp_path / "runs", logger=fixed)
    assert [s for s, _ in scalars(read_events(tmp_path / "fixed"), "train/loss")] == list(range(1, 7))
    assert not list(Path(n.run_dir).glob("events.out.tfevents.*"))


def test_odd_and_non_finite_values_do_not_crash_it(tmp_path):
    logger = tensorboard_logger.TensorBoardLogger(tmp_path)
    logger.log_params({"run_dir": str(tmp_path), "none": None, "list": [1, 2], "nan": math.nan})
    logger.log_other("notes", {"a": [1, 2]})
    logger.log_metrics(
        {"nan": math.nan, "inf": -math.inf, "jax": jnp.float32(2.5), "one": np.ones((1, 1)), "vec": np.array([1.0, np.nan, 3.0]),
         "word": "text", "none": None, "obj": object()},
        step=3, epoch=1, context="validate",
    )
    logger.finish("diverged")
    with pytest.raises(RuntimeError, match="is finished"):
        logger.log_metrics({"loss": 1.0}, step=4, epoch=1, context="train")

    acc = read_events(tmp_path)
    (step, value), = scalars(acc, "validate/nan")
    assert step == 3 and math.isnan(value)
    assert scalars(acc, "validate/inf") == [(3, -math.inf)]
    assert scalars(acc, "validate/jax") == [(3, 2.5)] and scalars(acc, "validate/one") == [(3, 1.0)]
    (hist,) = acc.Histograms("validate/vec")
    assert (hist.step, hist.histogram_value.num, hist.histogram_value.sum) == (3, 2, 4.0)  # the finite values
    assert texts(acc, "validate/word") == [(3, "text")]
    assert texts(acc, "validate/obj")[0][1].startswith("<object object")
    assert texts(acc, "notes")[0][1].startswith("    {")
    assert session_status(acc) == "STATUS_FAILURE"


def test_the_hook_answers_its_names_only_and_names_the_missing_extra(tmp_path, monkeypatch):
    make = tensorboard_logger.jaxnitro_make_logger
    assert isinstance(make(name="TensorBoard", run_dir=tmp_path, experiment=None), tensorboard_logger.TensorBoardLogger)
    assert isinstance(make(name="tb", run_dir=tmp_path, experiment=None), tensorboard_logger.TensorBoardLogger)
    assert make(name="jsonl", run_dir=tmp_path, experiment=None) is None

    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # as if not installed
    copy = fresh_copy(tensorboard_logger, monkeypatch)  # the plugin module itself still imports
    with pytest.raises(ImportError, match=r"jaxnitro\[tensorboard\]"):
        copy.jaxnitro_make_logger(name="tensorboard", run_dir=tmp_path, experiment=None)



# -- a kill, a resume, the viewer ------------------------------------------------------------------


@pytest.mark.slow  # a fresh training process (~10 s on 2 cores)
@pytest.mark.parametrize("when", ["validate@1", "finish"])
def test_a_validation_and_the_finish_are_on_disk_when_logged(tmp_path, when):
    kill_after(tmp_path, "tensorboard", when)  # SIGKILLed right after the loggers got the line
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    acc = read_events(folder)
    if when == "validate@1":
        assert [s for s, _ in scalars(acc, "validate/loss")] == [6]
        assert [s for s, _ in scalars(acc, "train/loss")] == list(range(1, 7))
    else:
        assert [s for s, _ in scalars(acc, "validate/loss")] == [6, 12]
        assert texts(acc, "status") == [(12, "done")] and session_status(acc) == "STATUS_SUCCESS"


@pytest.mark.slow  # a fresh training process, a resume and the tensorboard server (~30 s)
def test_a_killed_and_resumed_run_shows_each_step_once_in_tensorboard(tmp_path):
    kill_after(tmp_path, "tensorboard", "validate@2", max_epochs=3)  # logged to step 12, checkpoint 6
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    killed = read_events(folder)
    assert [s for s, _ in scalars(killed, "validate/loss")] == [6, 12]

    resumed = jn.Nitro(Tiny(max_epochs=3), data=DATA, run_dir=tmp_path, resume="auto", logger="tensorboard",
                       checkpointer=jn.Checkpointer(keep=jn.Last(2), asynchronous=False))
    assert resumed.plan.resumed.step == 6
    resumed.train()
    assert resumed.run_dir == str(folder) and len(list(folder.glob("events.out.tfevents.*"))) == 2
    acc = read_events(folder)
    train = scalars(acc, "train/loss")
    assert [s for s, _ in train] == list(range(1, 19))  # 7..12 logged again, once
    assert train[:12] == scalars(killed, "train/loss")  # the resumed run logged what the killed one did
    assert [s for s, _ in scalars(acc, "validate/loss")] == [6, 12, 18]
    assert texts(acc, "status") == [(18, "done")]

    # the docs' command, as a user runs it: the run is listed, its steps shown once
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    command = [str(Path(sys.executable).parent / "tensorboard"), "--logdir", str(tmp_path), "--host", "127.0.0.1", "--port", str(port)]
    with server(command, f"{base}/data/runs"):
        import time

        def shown():
            runs = fetch(f"{base}/data/runs")
            if runs != [folder.name]:
                return runs, []
            return runs, [step for _, step, _ in fetch(f"{base}/data/plugin/scalars/scalars?run={folder.name}&tag=train/loss")]

        deadline = time.monotonic() + 60
        while shown()[1] != list(range(1, 19)) and time.monotonic() < deadline:
            time.sleep(0.5)  # the server's first load of the folder
        assert shown() == ([folder.name], list(range(1, 19)))
