"""Never lose a run: Ctrl-C and SIGTERM stop between optimizer steps and keep the model,
every failure leaves a final status, a run folder that cannot be made is named, a logger's
I/O failure is reported without ending training, and a diverged run has one row per epoch."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import jaxnitro as jn
from jaxnitro.loggers.jsonl import JSONLLogger, read_jsonl
from jaxnitro.plugin_manager import plugin_manager
from tiny import Tiny, batches, make_arrays, tiny_data

# 48 optimizer steps an epoch (batch 2): reads happen mid-epoch (every 32 steps)
SMALL = {"train": batches(*make_arrays(96), 2), "val": batches(*make_arrays(8, seed=1), 2)}


def _leaves(n):
    return jax.tree_util.tree_leaves((n.params, n.model_state, n.opt_state))


def test_ctrl_c_at_random_points_never_deletes_the_model(tmp_path):
    """50 trials, Ctrl-C (a real SIGINT to this process) at seeded random moments of train().

    The timer starts from the run's own start event, so every signal lands inside train().
    """
    rng = random.Random(1234)
    warm = jn.Nitro(Tiny(max_epochs=1), data=SMALL, run_dir=tmp_path, logger=None)
    warm.train()  # compile once; the trials below reuse the programs

    class CtrlCAfter:
        delay = 0.0
        timer = None

        @jn.hookimpl
        def jaxnitro_run_start(self, run):
            self.timer = threading.Timer(self.delay, os.kill, (os.getpid(), signal.SIGINT))
            self.timer.start()

    trigger = CtrlCAfter()
    pm = plugin_manager()
    pm.register(trigger, name="ctrl-c-after")
    try:
        for trial in range(50):
            n = jn.Nitro(Tiny(max_epochs=10_000), data=SMALL, run_dir=tmp_path, logger="jsonl")
            trigger.delay = rng.uniform(0.0, 0.15)
            with pytest.raises(KeyboardInterrupt):
                n.train()
            trigger.timer.join()
            assert n.status == "interrupted", trial
            assert not any(x.is_deleted() for x in _leaves(n)), f"trial {trial}: deleted arrays"
            # the log is finished and holds every step computed
            lines = read_jsonl(Path(n.run_dir) / "metrics.jsonl")
            assert lines[-1]["kind"] == "finish" and lines[-1]["status"] == "interrupted", trial
            steps = [x["step"] for x in lines if x.get("context") == "train"]
            assert steps == list(range(1, n.step + 1)), trial
    finally:
        pm.unregister(trigger)
    # the last handle is fully usable: validate, predict, and a new run from its weights
    assert np.isfinite(n.validate()["loss"])
    assert n.predict({"x": SMALL["val"][0]["x"]}).shape == (2, 4)
    again = jn.train(Tiny(max_epochs=1), data=SMALL, run_dir=tmp_path, logger=None, weights=n)
    assert again.status == "done"


def test_ctrl_c_during_setup_always_interrupts(tmp_path):
    @jn.experiment
    class SlowData(Tiny):
        def build_data(self, dist):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            return tiny_data()

    for _ in range(5):
        with pytest.raises(KeyboardInterrupt):
            jn.Nitro(SlowData(), run_dir=tmp_path, logger=None)


def test_a_swallowed_ctrl_c_in_a_hook_still_ends_setup(tmp_path):
    @jn.experiment
    class Swallows(Tiny):
        def build_data(self, dist):
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)
            except KeyboardInterrupt:
                pass  # a careless hook (or a callback) loses the exception
            return tiny_data()

    with pytest.raises(KeyboardInterrupt):
        jn.Nitro(Swallows(), run_dir=tmp_path, logger=None)
    assert jn.Nitro(Tiny(), data=tiny_data(), run_dir=tmp_path, logger=None).status == "ready"


RUNNER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    import jaxnitro as jn
    from tiny import Tiny, batches, make_arrays
    data = {{"train": batches(*make_arrays(96), 2)}}
    n = jn.Nitro(Tiny(max_epochs=100_000), data=data, run_dir={run_dir!r})
    print("ready", flush=True)
    n.train()
    """
)


@pytest.mark.slow  # a fresh process per signal (~3 s each)
@pytest.mark.parametrize(("sig", "status", "code"), [(signal.SIGTERM, "preempted", 143), (signal.SIGINT, "interrupted", None)])
def test_a_signal_to_a_training_process_leaves_a_finished_log(tmp_path, sig, status, code):
    script = RUNNER.format(tests=str(Path(__file__).parent), run_dir=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    deadline = time.monotonic() + 60
    log = None
    while time.monotonic() < deadline:  # wait until training is under way (train lines flushed)
        found = list(tmp_path.glob("*/metrics.jsonl"))
        if found and any('"train"' in line for line in found[0].read_text().splitlines()):
            log = found[0]
            break
        time.sleep(0.05)
    assert log is not None, "training never started"
    proc.send_signal(sig)
    rc = proc.wait(timeout=60)
    if code is not None:
        assert rc == code
    else:
        assert rc != 0
    lines = read_jsonl(log)
    assert lines[-1]["kind"] == "finish" and lines[-1]["status"] == status
    steps = [x["step"] for x in lines if x.get("context") == "train"]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) > 0


# -- failures leave a status and name the culprit ---------------------------------------------------


def test_a_run_dir_that_is_a_file_is_named_and_the_status_is_failed(tmp_path):
    blocker = tmp_path / "runs"
    blocker.write_text("not a folder")
    n = jn.Nitro(Tiny(), data=tiny_data(), run_dir=blocker)
    with pytest.raises(OSError) as err:
        n.train()
    assert f"run_dir={str(blocker)!r}: it is a file, not a folder" in str(err.value)
    assert "Pass a writable folder as `run_dir`" in str(err.value)
    assert n.status == "failed"
    n2 = jn.Nitro(Tiny(), data=tiny_data(), run_dir=blocker / "below")
    with pytest.raises(OSError, match="cannot create a run folder"):
        n2.train()
    assert n2.status == "failed"


def test_a_logger_io_failure_is_reported_and_training_goes_on(tmp_path):
    """JSONL to /dev/full: every flush fails with ENOSPC, as on a full disk."""
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    full = JSONLLogger("/dev/full")
    with pytest.warns(RuntimeWarning, match=r"logger JSONLLogger .*/dev/full.* failed in `log_params`"):
        n = jn.train(Tiny(max_epochs=2), data=tiny_data(), run_dir=tmp_path, logger=[full, "jsonl"])
    assert n.status == "done" and n.step == 12
    assert len(n.record.problems) == 1 and "No space left on device" in n.record.problems[0]
    # the other logger got the whole run, and the state is usable
    lines = read_jsonl(Path(n.run_dir) / "metrics.jsonl")
    assert lines[-1] == {**lines[-1], "kind": "finish", "status": "done"}
    assert len([x for x in lines if x.get("context") == "train"]) == 12
    assert np.isfinite(n.validate()["loss"])


def test_a_failing_logger_is_reported_and_does_not_stop_the_others_or_the_run(tmp_path):
    class Broken:
        def log_params(self, params):
            pass

        def log_other(self, key, value):
            pass

        def log_metrics(self, metrics, *, step, epoch, context):
            raise ValueError("bug in the logger")

        def finish(self, status):
            self.status = status

    broken = Broken()
    with pytest.warns(RuntimeWarning, match=r"logger Broken \(\{'backend': 'Broken'\}\) failed in `log_metrics`: "
                      r"ValueError: bug in the logger\. .*training and the other loggers go on"):
        n = jn.train(Tiny(max_epochs=2), data=tiny_data(), run_dir=tmp_path, logger=[broken, "jsonl"])
    assert n.status == "done" and not hasattr(broken, "status")  # dropped: not even finished
    assert len(n.record.problems) == 1 and "Fix the logger" in n.record.problems[0]
    lines = read_jsonl(Path(n.run_dir) / "metrics.jsonl")
    assert len([x for x in lines if x.get("context") == "train"]) == 12 and lines[-1]["status"] == "done"
    assert jn.logger_info(n) == [{"backend": "Broken"}, {"backend": "jsonl", "path": str(Path(n.run_dir) / "metrics.jsonl")}]


# -- divergence -------------------------------------------------------------------------------------


DIVERGE = textwrap.dedent(
    """
    import json, sys, warnings
    import jax
    jax.config.update("jax_cpu_enable_async_dispatch", False)  # before the backend starts
    sys.path.insert(0, {tests!r})
    import numpy as np
    import jaxnitro as jn
    from tiny import Tiny, batches, make_arrays
    warnings.simplefilter("ignore")
    out = []
    for validated in (True, False):
        for nan_batch in (30, 31, 32, 47):
            x, y, onehot = make_arrays(96)
            x = x.copy()
            x[2 * nan_batch : 2 * nan_batch + 2] = np.nan
            data = {{"train": batches(x, y, onehot, 2)}}
            if validated:
                data["val"] = batches(*make_arrays(8, seed=1), 2)
            n = jn.train(Tiny(max_epochs=3), data=data, run_dir={run_dir!r}, logger=None)
            len(n.history())  # raised "epochs must increase" on a duplicate row
            out.append([validated, nan_batch, n.status, [r["epoch"] for r in n.rows],
                        n.rows[-1]["step"], list(n.record.diverged_at)])
    print(json.dumps(out))
    """
)


@pytest.mark.slow  # a fresh process, for synchronous dispatch
def test_a_diverged_run_has_one_row_per_epoch(tmp_path):
    """With synchronous dispatch, a divergence at the last step of a read stretch (step 32)
    used to close the epoch's row and then add it again (two rows for epoch 1)."""
    script = DIVERGE.format(tests=str(Path(__file__).parent), run_dir=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    for validated, nan_batch, status, epochs, last_step, diverged_at in json.loads(done.stdout):
        assert status == "diverged" and epochs == [1], (validated, nan_batch, epochs)
        assert last_step == nan_batch + 1 and diverged_at == [nan_batch + 1, 1]


def test_a_divergence_from_nan_inputs_names_the_batch_and_field(tmp_path):
    x, y, onehot = make_arrays(96)
    x = x.copy()
    x[2 * 20, 3] = np.nan  # batch 20 of epoch 1 (batch size 2): step 21
    data = {"train": batches(x, y, onehot, 2)}
    with pytest.warns(RuntimeWarning, match=r"non-finite at step 21 .*The data is the cause: batch 20 of "
                      r"epoch 1 of the `train` split has 1 non-finite value\(s\) in field `x`"):
        n = jn.train(Tiny(max_epochs=2), data=data, run_dir=tmp_path, logger=None)
    assert n.status == "diverged" and "field `x`" in n.stop_reason
