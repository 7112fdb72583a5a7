"""The `jaxnitro` command line (plugins/cli): help, refusals, the YAML round trip, the four
commands, Ctrl-C and preemption (SIGTERM, max_time); in-process through main(argv), and as a
real process (the console script, a SIGTERM)."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

import jaxnitro as jn
from cli_experiment import CliTiny, CtrlCTiny
from jaxnitro.experiment import fields_of
from jaxnitro.knobs import RUN_KNOBS
from jaxnitro.plugins.cli import main

HERE = Path(__file__).resolve().parent
SPEC = f"{HERE / 'cli_experiment.py'}:CliTiny"


def run_cli(capsys, *argv):
    """``(exit status, stdout, stderr)`` of ``jaxnitro ARGV`` run in this process."""
    rc = main(list(argv), prog_words=["jaxnitro"])
    out, err = capsys.readouterr()
    return rc, out, err


def flat(text: str) -> str:
    return " ".join(text.split())


def test_help_lists_each_field_with_marker_type_default_doc_and_every_run_knob(capsys):
    rc, out, _ = run_cli(capsys, "train", SPEC, "--help")
    assert rc == 0
    text = flat(out)
    assert "--width WIDTH [GraphConst] Hidden width (structural). (type: int, default: 16)" in text
    assert "--smoothing SMOOTHING [Device] Label smoothing (a traced input). (type: float, default: 0.0)" in text
    assert "--tag TAG [Host] A free-form label (Host). (type: str | null, default: null)" in text
    assert ("Also the `max_epochs` run knob (null: the knob is None, the field keeps its default). "
            "(type: int | null, default: 2)") in text
    assert "Not settable here (they keep their defaults): weights_init (Device ndarray)" in text
    fields = set(fields_of(CliTiny))
    for knob in RUN_KNOBS:  # every knob the core defines, whatever the list is today
        assert f"--{knob} " in out, knob
        if knob not in fields:
            assert f"--{knob} {knob.upper()} [run knob] default:" in text or f"--{knob} {{true,false}} [run knob]" in text
    assert "[run knob] default: Checkpointer(keep=(Best(n=1), Last(n=1))" in text  # the experiment's method
    assert "(method checkpointer())" in text


def test_a_bad_value_is_refused_naming_the_field_and_its_type(capsys):
    rc, out, err = run_cli(capsys, "train", SPEC, "--width", "abc")
    assert rc == 2 and out == ""
    assert "bad value for field `width` of CliTiny (GraphConst[int])" in err and "abc" in err
    rc, _, err = run_cli(capsys, "train", SPEC, "--accum", "two")
    assert rc == 2 and "run knob `accum`" in err
    rc, _, err = run_cli(capsys, "train", f"{HERE / 'cli_experiment.py'}:Nope")
    assert rc == 2 and "has no 'Nope'" in err and "CliTiny" in err
    rc, _, err = run_cli(capsys, "train", "--width", "8")
    assert rc == 2 and "name the experiment class" in err


def test_print_config_writes_the_yaml_that_config_reads_back(capsys, tmp_path):
    rc, first, _ = run_cli(capsys, "train", SPEC, "--width", "8", "--smoothing", "0.1", "--tag", "a b",
                           "--seed", "3", "--logger", "console", "--run_dir", str(tmp_path), "--print_config")
    assert rc == 0
    cfg = yaml.safe_load(first)
    assert cfg["experiment"] == SPEC
    assert (cfg["width"], cfg["smoothing"], cfg["tag"], cfg["max_epochs"]) == (8, 0.1, "a b", 2)
    assert (cfg["seed"], cfg["logger"], cfg["run_dir"], cfg["accum"]) == (3, "console", str(tmp_path), 1)
    assert "checkpointer" not in cfg  # an object from the experiment's method: left to the method
    assert "weights_init" not in cfg and "resume" not in cfg
    path = tmp_path / "run.yaml"
    path.write_text(first)
    rc, again, _ = run_cli(capsys, "train", "--config", str(path), "--print_config")  # class from the file
    assert rc == 0 and again == first
    rc, changed, _ = run_cli(capsys, "train", "--config", str(path), "--width", "32", "--print_config")
    assert yaml.safe_load(changed) == {**cfg, "width": 32}  # later options override the file


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One run of ``jaxnitro train`` (3 epochs, best and last checkpoints)."""
    run_dir = tmp_path_factory.mktemp("cli_runs")
    rc = main(["train", SPEC, "--width", "8", "--max_epochs", "3", "--run_dir", str(run_dir)], prog_words=["jaxnitro"])
    assert rc == 0
    (run,) = [p for p in run_dir.iterdir() if p.is_dir()]
    return run_dir, run


def test_train_writes_the_run_and_its_config(trained, capsys):
    run_dir, run = trained
    lines = jn.read_jsonl(run / "metrics.jsonl")
    assert lines[-1] == {**lines[-1], "kind": "finish", "status": "done"}
    assert max(line.get("epoch", 0) for line in lines) == 3
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert (cfg["width"], cfg["max_epochs"], cfg["run_dir"]) == (8, 3, str(run_dir))


def test_evaluate_and_predict_a_checkpoint(trained, capsys, tmp_path):
    run_dir, run = trained
    config = str(run / "config.yaml")
    rc, out, _ = run_cli(capsys, "evaluate", "--config", config, "--weights", f"{run}:best",
                         "--output", str(tmp_path / "m.json"))
    best = jn.Nitro(CliTiny(width=8), weights=(str(run), "best"))
    expected = best.evaluate("test")["acc"]
    assert rc == 0 and f"test of {run}:best (checkpoint of step" in out and f"acc {expected:.4f}" in out
    assert json.loads((tmp_path / "m.json").read_text())["acc"] == pytest.approx(expected)

    x = np.random.default_rng(1).normal(size=(5, 8)).astype(np.float32)
    np.savez(tmp_path / "in.npz", x=x)
    rc, out, _ = run_cli(capsys, "predict", SPEC, "--width", "8", "--weights", "latest:best", "--run_dir", str(run_dir),
                         "--input", str(tmp_path / "in.npz"), "--output", str(tmp_path / "out.npz"))
    assert rc == 0 and "predicted 5 rows" in out
    with np.load(tmp_path / "out.npz") as got:
        np.testing.assert_allclose(got["outputs"], best.predict({"x": x}), rtol=1e-6)


def test_runs_lists_status_epochs_steps_best_and_checkpoints(trained, capsys):
    run_dir, run = trained
    rc, out, _ = run_cli(capsys, "runs", str(run_dir))
    assert rc == 0
    header, rule, row = out.splitlines()[1:4]
    assert header.split() == ["run", "experiment", "status", "epochs", "steps", "best", "checkpoints"]
    best = max((line for line in jn.read_jsonl(run / "metrics.jsonl") if line.get("context") == "validate"),
               key=lambda line: line["acc"])
    assert row.split()[:5] == [run.name, "CliTiny", "done", "3/3", "18"]
    assert f"acc {best['acc']:.4g} (epoch {best['epoch']}, max)" in row
    kept = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    assert kept[-1] == 18 and row.endswith(f"{len(kept)} (last step 18)")


def test_ctrl_c_prints_the_command_that_continues_and_exits_130(capsys, tmp_path):
    spec = f"{HERE / 'cli_experiment.py'}:CtrlCTiny"
    argv = ["train", spec, "--width", "8", "--run_dir", str(tmp_path)]
    CtrlCTiny.validations = 0
    rc, _, err = run_cli(capsys, *argv)
    assert rc == 130
    (line,) = [ln for ln in err.splitlines() if ln.startswith("interrupted")]
    assert line.startswith("interrupted at step ") and "Traceback" not in err
    command = line.split("continue with: ", 1)[1]
    assert command == f"jaxnitro train {spec} --width 8 --run_dir {tmp_path} --resume"
    rc, out, _ = run_cli(capsys, *command.split()[1:])  # the printed command, as given
    assert rc == 0 and "resumed from checkpoint" in out and "done: epoch 4/4" in out
    (run,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert jn.read_jsonl(run / "metrics.jsonl")[-1]["status"] == "done"


def test_the_console_script_runs():
    script = Path(sys.executable).parent / "jaxnitro"
    done = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout and all(c in done.stdout for c in ("train", "evaluate", "predict", "runs"))


def test_python_m_jaxnitro_finds_the_cli_through_its_entry_point(capsys, monkeypatch):
    from jaxnitro.__main__ import main as module_main

    assert module_main(["runs", "--help"]) == 0
    assert "usage:" in capsys.readouterr().out
    monkeypatch.setenv("JAXNITRO_DISABLE_PLUGINS", "cli")
    assert module_main(["--help"]) == 2
    assert "command line plugin `cli` is disabled by JAXNITRO_DISABLE_PLUGINS" in capsys.readouterr().err


def test_max_epochs_null_leaves_a_step_budget_alone_and_remat_takes_a_policy_name(capsys, tmp_path):
    """A typed ``max_epochs`` field can still be switched off as a knob: ``--max_epochs null
    --max_steps 9`` trains 9 steps (3 epochs of 6 would be 18, the field's 2 epochs 12), the
    YAML round trip keeps it; ``--remat`` takes a policy name as well as a bool."""
    from jaxnitro.plugins.cli.arguments import build_parser, parse

    spec = build_parser(CliTiny, prog="jaxnitro train")
    inv = parse(spec, ["--max_epochs", "null", "--max_steps", "9", "--remat", "dots_saveable"])
    assert inv.experiment.max_epochs == 2 and inv.knobs["max_epochs"] is None
    assert inv.knobs["max_steps"] == 9 and inv.knobs["remat"] == "dots_saveable"
    assert parse(spec, ["--remat", "true"]).knobs["remat"] is True
    run_dir = tmp_path / "runs"
    rc = main(["train", SPEC, "--max_epochs", "null", "--max_steps", "9", "--run_dir", str(run_dir)],
              prog_words=["jaxnitro"])
    out, _ = capsys.readouterr()
    assert rc == 0, out
    assert "done: step 9/9, epoch 2" in out  # the budget the run had, not `epoch 2/None`
    (run,) = [p for p in run_dir.iterdir() if p.is_dir()]
    steps = [line["step"] for line in jn.read_jsonl(run / "metrics.jsonl") if line.get("context") == "train"]
    assert max(steps) == 9
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert cfg["max_epochs"] is None and cfg["max_steps"] == 9
    rc, again, _ = run_cli(capsys, "train", "--config", str(run / "config.yaml"), "--print_config")
    assert rc == 0 and yaml.safe_load(again)["max_epochs"] is None


def test_sigterm_prints_preempted_and_the_command_that_continues_and_exits_143(tmp_path):
    """A real SIGTERM to a real ``python -m jaxnitro train`` process: one line on stderr saying
    it was preempted by SIGTERM, the step, and the command that continues it; exit status 143."""
    spec = f"{HERE / 'cli_experiment.py'}:CtrlCTiny"
    argv = ["train", spec, "--width", "8", "--signal_name", "SIGTERM", "--run_dir", str(tmp_path)]
    done = subprocess.run([sys.executable, "-m", "jaxnitro", *argv], capture_output=True, text=True, timeout=300)
    assert done.returncode == 143, done.stderr[-3000:]
    (line,) = [ln for ln in done.stderr.splitlines() if ln.startswith("preempted")]
    assert line.startswith("preempted (SIGTERM) at step ") and "Traceback" not in done.stderr
    assert line.split("continue with: ", 1)[1] == shlex.join(
        [sys.executable, "-m", "jaxnitro", *argv, "--resume"])
    (run,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert jn.read_jsonl(run / "metrics.jsonl")[-1]["status"] == "preempted"


def test_max_time_prints_preempted_and_the_printed_command_continues(capsys, tmp_path):
    argv = ["train", SPEC, "--width", "8", "--max_epochs", "100000", "--max_time", "2", "--run_dir", str(tmp_path)]
    rc, _, err = run_cli(capsys, *argv)
    assert rc == 143
    (line,) = [ln for ln in err.splitlines() if ln.startswith("preempted")]
    assert line.startswith("preempted (max_time reached) at step ") and ", epoch " in line
    command = line.split("continue with: ", 1)[1]
    assert command == f"jaxnitro train {SPEC} {' '.join(argv[2:])} --resume"
    rc, out, err = run_cli(capsys, *command.split()[1:])  # the printed command, as given
    assert rc == 143 and "resumed from checkpoint" in out and "preempted (max_time reached)" in err


def test_ctrl_c_with_checkpointer_null_prints_a_command_that_keeps_checkpoints(capsys, tmp_path):
    spec = f"{HERE / 'cli_experiment.py'}:CtrlCTiny"
    CtrlCTiny.validations = 0
    rc, _, err = run_cli(capsys, "train", spec, "--checkpointer", "null", "--width", "8", "--run_dir", str(tmp_path))
    assert rc == 130
    (line,) = [ln for ln in err.splitlines() if ln.startswith("interrupted")]
    assert "no checkpoint to continue from (`--checkpointer null` turned the experiment's checkpointer off)" in line
    command = line.split("run again without it: ", 1)[1]
    assert command == f"jaxnitro train {spec} --width 8 --run_dir {tmp_path}"  # no --checkpointer null, no --resume
    rc, out, _ = run_cli(capsys, *command.split()[1:])
    assert rc == 0 and "checkpoints/)" in out
    assert any((p / "checkpoints").is_dir() for p in tmp_path.iterdir())


def test_an_experiment_without_a_checkpointer_is_told_what_to_add():
    from types import SimpleNamespace

    from jaxnitro.plugins.cli import interrupt_line
    from tiny import Tiny

    nitro = SimpleNamespace(experiment=Tiny(), status="interrupted", step=3, epoch=1, stop_reason=None,
                            settings=SimpleNamespace(checkpointer=None, max_epochs=2, max_steps=None))
    line = interrupt_line(nitro, ["jaxnitro"], ["train", "m:Tiny", "--checkpointer", "null"])
    assert line == ("interrupted at step 3, epoch 1/2; no checkpoint to continue from (the run's checkpointer "
                    "is None: give the experiment a `checkpointer()` method returning jn.Checkpointer(...)); "
                    "run again with: jaxnitro train m:Tiny --checkpointer null")
    line = interrupt_line(nitro, ["jaxnitro"], ["train", "m:Tiny"], preempted=True)
    assert line.startswith("preempted (SIGTERM) at step 3, epoch 1/2; no checkpoint")


def test_an_unknown_split_is_printed_without_quotes(trained, capsys):
    run_dir, run = trained
    rc, out, err = run_cli(capsys, "evaluate", SPEC, "--width", "8", "--weights", f"{run}:best", "--split", "nosuch")
    assert rc == 2 and out == ""
    assert err.startswith("jaxnitro evaluate: error: jaxnitro: no split 'nosuch'; this handle's data has ")
    assert '"' not in err


def test_a_refused_knob_is_named_as_its_option(capsys, tmp_path):
    rc, _, err = run_cli(capsys, "train", SPEC, "--max_epochs", "null", "--run_dir", str(tmp_path))
    assert rc == 2 and "run knob `--max_epochs null`; it must be an integer >= 0" in err
    assert "(keyword)" not in err and "= None" not in err
    rc, _, err = run_cli(capsys, "train", SPEC, "--max_steps=0", "--run_dir", str(tmp_path))
    assert rc == 2 and "run knob `--max_steps 0`; it must be an integer >= 1" in err
    config = tmp_path / "run.yaml"
    config.write_text(f"experiment: {SPEC}\naccum: 0\n")
    rc, _, err = run_cli(capsys, "train", "--config", str(config), "--run_dir", str(tmp_path))
    assert rc == 2 and f"run knob `accum` = 0 (--config {config}); it must be an integer >= 1" in err


def test_train_validated_every_n_steps_reports_the_best_step(capsys, tmp_path):
    # two validations in one epoch made `nitro.history()` raise after training: a traceback, rc 1
    rc, out, err = run_cli(capsys, "train", SPEC, "--max_epochs", "2", "--val_every_n_steps", "4", "--run_dir", str(tmp_path))
    assert rc == 0, err
    assert "done: epoch 2/2, 12 optimizer steps" in out
    assert "best: step " in out and "(epoch " in out  # a step, then its epoch
