"""The console logger plugin, read from captured standard output: one line per epoch and per
validation whose numbers equal metrics.jsonl and the history, a start and an end line with the
status (done, interrupted), the lines of a run without validation, the events a structlog logger
of the application receives, and odd values."""

from __future__ import annotations

import io
import math
import re
from pathlib import Path

import numpy as np
import pytest
import structlog

import jaxnitro as jn
import jaxnitro.loggers.console as console_logger
from jaxnitro.loggers.jsonl import read_jsonl
from logger_plugin_support import plugin_module, stopping_after_first_epoch
from tiny import Tiny, tiny_data

DATA = tiny_data()  # 6 train batches, a val split: 2 epochs are steps 1..12, validations at 6 and 12
LINE = re.compile(r"^\d\d:\d\d:\d\d (?P<event>.+?) {2,}(?P<fields>\S.*)$")


@pytest.fixture(autouse=True)
def plugin():
    with plugin_module(console_logger, "console") as module:
        yield module


def parse(out: str) -> list[tuple[str, dict]]:
    """``(event, {key: text})`` per printed line."""
    lines = []
    for line in out.strip().split("\n"):
        match = LINE.match(line)
        assert match, f"not a console line: {line!r}"
        fields = dict(item.split("=", 1) for item in match["fields"].split(" "))
        lines.append((match["event"], fields))
    return lines


def train_lines(path) -> list[dict]:
    return [ln for ln in read_jsonl(path, restore_nonfinite=True) if ln["kind"] == "metrics" and ln["context"] == "train"]


def test_a_run_prints_one_line_per_epoch_and_validation_matching_the_history(tmp_path, capsys):
    n = jn.train(Tiny(max_epochs=2), data=DATA, run_dir=tmp_path, logger=["jsonl", "console"])
    lines = parse(capsys.readouterr().out)
    assert [event for event, _ in lines] == [
        "run start", "epoch 1/2 train", "epoch 1/2 validate", "epoch 2/2 train", "epoch 2/2 validate", "run done",
    ]
    assert lines[0][1] == {"experiment": "Tiny", "n_params": "212", "run_dir": str(n.run_dir)}
    steps = train_lines(Path(n.run_dir) / "metrics.jsonl")
    assert [ln["step"] for ln in steps] == list(range(1, 13))
    for epoch, row in enumerate(n.rows, start=1):
        (_, train), (_, validate) = lines[2 * epoch - 1 : 2 * epoch + 1]
        losses = [ln["loss"] for ln in steps if ln["epoch"] == epoch]
        assert train["step"] == validate["step"] == str(row["step"]) == str(6 * epoch)
        assert train["loss"] == f"{np.mean(losses):.5g}" == f"{row['train_loss']:.5g}"
        assert re.fullmatch(r"\d+\.\d%", train["data_wait"])
        assert validate == {"step": str(row["step"]), "loss": f"{row['loss']:.5g}"}
    assert lines[-1][1]["epochs"] == "2" and lines[-1][1]["steps"] == "12"


def test_an_interrupted_run_ends_with_its_status(tmp_path, capsys):
    n = jn.Nitro(Tiny(max_epochs=2), data=DATA, run_dir=tmp_path, logger="console")
    with stopping_after_first_epoch(KeyboardInterrupt()), pytest.raises(KeyboardInterrupt):
        n.train()
    lines = parse(capsys.readouterr().out)
    assert [event for event, _ in lines] == ["run start", "epoch 1/2 train", "epoch 1/2 validate", "run interrupted"]
    assert lines[-1][1]["steps"] == "6"


def test_without_validation_each_epoch_still_gets_one_line_in_order(tmp_path):
    stream = io.StringIO()
    logger = jn.ConsoleLogger(stream, digits=8)  # a configured object, printing to a stream of mine
    n = jn.train(Tiny(max_epochs=3), data={"train": DATA["train"]}, run_dir=tmp_path, logger=["jsonl", logger])
    lines = parse(stream.getvalue())
    assert [event for event, _ in lines] == ["run start", "epoch 1/3 train", "epoch 2/3 train", "epoch 3/3 train", "run done"]
    for (_, fields), row in zip(lines[1:4], n.rows):
        assert fields["step"] == str(row["step"]) and fields["loss"] == f"{row['train_loss']:.8g}"


def test_an_application_logger_receives_the_events_with_numbers(tmp_path):
    captured = structlog.testing.CapturingLogger()
    app_logger = structlog.wrap_logger(captured, processors=[], wrapper_class=structlog.BoundLogger)
    n = jn.train(Tiny(max_epochs=2), data=DATA, run_dir=tmp_path, logger=["jsonl", jn.ConsoleLogger(logger=app_logger)])
    steps = train_lines(Path(n.run_dir) / "metrics.jsonl")
    events = [(call.kwargs.pop("event"), call.kwargs) for call in captured.calls]  # no renderer: the dict
    assert [event for event, _ in events][1:5] == ["epoch 1/2 train", "epoch 1/2 validate", "epoch 2/2 train", "epoch 2/2 validate"]
    for epoch, row in enumerate(n.rows, start=1):
        train, validate = events[2 * epoch - 1][1], events[2 * epoch][1]
        assert train["loss"] == pytest.approx(np.mean([ln["loss"] for ln in steps if ln["epoch"] == epoch]), rel=1e-12)
        assert train["step"] == 6 * epoch and validate == {"step": 6 * epoch, "loss": row["loss"]}
    assert events[-1][0] == "run done" and events[-1][1]["steps"] == 12


def test_odd_values_names_and_schedules_print_without_crashing():
    stream = io.StringIO()
    logger = console_logger.ConsoleLogger(stream, colors=False, report=True)
    logger.log_params({"knob/max_epochs": 1, "experiment": "X"})
    logger.log_other("binding_report", "the report")
    logger.log_metrics({"loss": math.nan, "schedule/lr": 0.5, "event": 1.0, "step": 2}, step=1, epoch=1, context="train")
    logger.log_metrics({"loss": 1.0, "schedule/lr": 0.25, "event": 3.0, "step": 4}, step=2, epoch=1, context="train")
    logger.log_metrics({"acc": np.float32(0.5), "vec": np.ones(2), "inf": math.inf, "word": "w"}, step=2, epoch=1, context="test")
    logger.finish("diverged")
    out = stream.getvalue()
    assert "binding_report" in out and "the report" in out
    train = next(line for line in out.split("\n") if "epoch 1/1 train" in line)
    assert "step=2 loss=nan schedule/lr=0.25 event_=2 step_=3" in train  # means; a schedule's last value
    tested = next(line for line in out.split("\n") if "epoch 1/1 test" in line)
    assert "acc=0.5" in tested and "vec='array([1., 1.])'" in tested and "inf=inf" in tested and "word=w" in tested
    assert "run diverged" in out


def test_the_hook_answers_its_name_only(tmp_path):
    make = console_logger.jaxnitro_make_logger
    assert isinstance(make(name="Console", run_dir=tmp_path, experiment=None), console_logger.ConsoleLogger)
    assert make(name="jsonl", run_dir=tmp_path, experiment=None) is None


def test_a_run_resumed_mid_epoch_says_from_which_step_its_first_epoch_line_averages(tmp_path, capsys):
    # the line averaged the steps after the resume point as if they were the whole epoch's
    kw = dict(data=DATA, run_dir=tmp_path, logger=["jsonl", "console"], max_steps=12, max_epochs=None,
              checkpointer=jn.Checkpointer(every_n_steps=3, keep=jn.Last(1), asynchronous=False))
    straight = jn.train(Tiny(), **dict(kw, run_dir=tmp_path / "a"))
    cut = jn.train(Tiny(), **dict(kw, run_dir=tmp_path / "b", max_steps=9))  # a run stopped at step 9
    capsys.readouterr()
    resumed = jn.Nitro(Tiny(), resume="auto", **dict(kw, run_dir=tmp_path / "b"))
    assert cut.step == resumed.step == 9
    resumed.train()
    lines = dict(parse(capsys.readouterr().out))
    assert lines["epoch 2 train"]["from_step"] == "10" and lines["epoch 2 train"]["step"] == "12"
    steps = train_lines(Path(resumed.run_dir) / "metrics.jsonl")
    assert lines["epoch 2 train"]["loss"] == f"{np.mean([ln['loss'] for ln in steps if ln['step'] > 9]):.5g}"
    assert straight.step == 12
