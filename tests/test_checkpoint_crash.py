"""Crash safety: a training process killed with SIGKILL mid-epoch or mid-save leaves only
complete checkpoints to resume from, and the resumed run ends bitwise equal to an
uninterrupted one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import jaxnitro as jn
from crash_child import Crashed, checkpointer, data

HERE = Path(__file__).parent


def leaves(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


@pytest.mark.slow  # two fresh processes (~4 s each)
@pytest.mark.parametrize("how", ["mid-epoch", "mid-save", "mid-save-steps"])
def test_a_killed_run_resumes_to_the_same_result(tmp_path, how):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(HERE / "crash_child.py"), str(tmp_path), how], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    names = os.listdir(folder / "checkpoints")
    complete = sorted(int(n) for n in names if n.isdigit())
    assert complete and max(complete) <= 12, names  # epoch 3 never finished
    if how.startswith("mid-save"):  # the cut-short save (the second, or a later one when it was dropped)
        first = 4 if how == "mid-save-steps" else 6  # the save in flight at the kill left the previous one newest
        assert complete == [first], names
        assert any(n.endswith(".orbax-checkpoint-tmp") and not n.startswith(f"{first}.") for n in names), names
    resumed = jn.Nitro(Crashed(), data=data(), run_dir=tmp_path, resume="auto", max_epochs=4,
                       checkpointer=checkpointer(how))
    assert resumed.step == max(complete) and resumed.plan.resumed.path.endswith(f"/{max(complete)}")
    resumed.train()
    straight = jn.train(Crashed(), data=data(), run_dir=tmp_path / "straight", max_epochs=4, logger=None)
    assert resumed.step == straight.step == 24
    for a, b in zip(leaves(resumed.params), leaves(straight.params), strict=True):
        np.testing.assert_array_equal(a, b)
    assert resumed.rows == straight.rows[-len(resumed.rows):]
