"""A resumed run continues its metrics.jsonl: a torn last line (a kill mid-write) is repaired, the
lines the interrupted run logged past the resumed checkpoint are replaced by the resumed run's,
so each step's lines appear once, and ``jn.read_jsonl`` reads the whole file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jaxnitro as jn
from jaxnitro.loggers.jsonl import JSONLLogger, continue_jsonl, read_jsonl
from tiny import Tiny, tiny_data


def metrics(step, context="train", **values):
    return {"kind": "metrics", "context": context, "step": step, "epoch": 1, "time": 0.0, **values}


def write(path: Path, lines: list, torn: str = "") -> None:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines) + torn)


def test_a_torn_line_is_cut_and_the_steps_past_the_checkpoint_are_dropped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    earlier = [{"kind": "params", "params": {"run": 1}}, metrics(9)]  # an earlier run's lines: untouched
    run = [
        {"kind": "params", "params": {"run": 2}}, {"kind": "other", "key": "k", "value": "v"},
        metrics(4, "data"), *(metrics(s, loss=s / 10) for s in range(1, 5)), metrics(4, "validate"),
        metrics(8, "data"), *(metrics(s) for s in range(5, 7)),
        {"kind": "finish", "status": "interrupted", "time": 1.0},
    ]
    write(path, earlier + run, torn='{"kind": "metrics", "context": "train", "step": 7, "lo')
    assert continue_jsonl(path, 4) == (3, "cut")  # data 8, train 5 and 6
    assert read_jsonl(path) == earlier + run[:8] + run[-1:]

    write(path, run[:4], torn=json.dumps(metrics(3)))  # a whole object whose newline was lost
    assert continue_jsonl(path, 4) == (0, "terminated")
    assert path.read_text().endswith('"step": 3, "epoch": 1, "time": 0.0}\n') and len(read_jsonl(path)) == 5
    assert continue_jsonl(path, 1) == (2, None) and read_jsonl(path) == run[:2] + [metrics(1, loss=0.1)]  # data 4, train 3
    assert continue_jsonl(tmp_path / "missing.jsonl", 1) == (0, None)


def test_the_logger_continues_the_file_and_marks_the_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write(path, [{"kind": "params", "params": {}}, metrics(1), metrics(2)], torn='{"kind": "met')
    logger = JSONLLogger(path)
    logger.resume(1)
    logger.log_params({"again": True})
    logger.log_metrics({"loss": 0.5}, step=2, epoch=1, context="train")
    logger.finish("done")
    lines = read_jsonl(path)
    assert [ln["kind"] for ln in lines] == ["params", "metrics", "resume", "params", "metrics", "finish"]
    assert {k: lines[2][k] for k in ("step", "dropped", "repaired")} == {"step": 1, "dropped": 1, "repaired": "cut"}
    assert [ln["step"] for ln in lines if ln["kind"] == "metrics"] == [1, 2] and lines[4]["loss"] == 0.5


class Recorder:
    """A logger object with the optional verbs: records which verb came when."""

    def __init__(self):
        self.calls = []

    def resume(self, step):
        self.calls.append(("resume", step))

    def flush(self):
        self.calls.append(("flush",))

    def log_params(self, params):
        self.calls.append(("log_params",))

    def log_other(self, key, value):
        pass

    def log_metrics(self, metrics, *, step, epoch, context):
        pass

    def finish(self, status):
        self.calls.append(("finish", status))


def test_a_resumed_run_appends_each_step_once_after_a_torn_line(tmp_path):
    """A run whose last checkpoint (step 6) is older than its last logged line (step 12), killed
    while writing a line: the resume drops steps 7..12 and the torn line, and logs them again."""
    keep = jn.Checkpointer(keep=jn.Last(2), asynchronous=False)
    fresh = Recorder()
    n = jn.train(Tiny(max_epochs=2), data=tiny_data(), run_dir=tmp_path, checkpointer=keep, logger=["jsonl", fresh])
    assert fresh.calls == [("log_params",), ("flush",), ("flush",), ("finish", "done")]  # no resume: a new folder
    folder, path = Path(n.run_dir), Path(n.run_dir) / "metrics.jsonl"
    before = read_jsonl(path)
    shutil.rmtree(folder / "checkpoints" / "12")  # the kill came before epoch 2's checkpoint
    lines = path.read_text().splitlines()
    assert json.loads(lines[-1])["kind"] == "finish"
    path.write_text("\n".join(lines[:-1]) + "\n" + '{"kind": "metrics", "context": "train", "step": 13, "lo')

    recorder = Recorder()
    resumed = jn.Nitro(Tiny(max_epochs=2), data=tiny_data(), run_dir=tmp_path, resume="auto", checkpointer=keep,
                       logger=["jsonl", recorder])
    assert (resumed.plan.resumed.step, resumed.plan.resumed.run_folder) == (6, str(folder))
    resumed.train()
    assert recorder.calls == [("resume", 6), ("log_params",), ("flush",), ("finish", "done")]  # resume comes first
    assert resumed.run_dir == str(folder)
    after = read_jsonl(path)  # the whole file parses
    (mark,) = [ln for ln in after if ln["kind"] == "resume"]
    # dropped: steps 7..12's train lines, epoch 2's data, validate and throughput lines
    assert {k: mark[k] for k in ("step", "dropped", "repaired")} == {"step": 6, "dropped": 9, "repaired": "cut"}

    def by_context(lines, context):
        return [(ln["step"], ln.get("loss")) for ln in lines if ln.get("context") == context]

    train = by_context(after, "train")
    assert [s for s, _ in train] == list(range(1, 13))  # each step once
    assert train == by_context(before, "train")  # the resumed run logged what the first one did
    assert by_context(after, "validate") == by_context(before, "validate") and [s for s, _ in by_context(after, "validate")] == [6, 12]
    assert [s for s, _ in by_context(after, "data")] == [6, 12]
    assert [s for s, _ in by_context(after, "throughput")] == [6, 12]
    assert [ln["status"] for ln in after if ln["kind"] == "finish"] == ["done"]
