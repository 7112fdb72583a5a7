"""A run's folder while the run writes it (issue 23 items 4-6).

* one writer per run folder: a second process resuming the same run is refused naming the
  owner, a lock left by a killed process is taken over with a warning, the lock goes at the
  run's end whatever the status;
* a checkpoint save that fails (a full disk, simulated by an ``OSError(ENOSPC)`` from the
  save) fails the run: the status and the log's finish line say ``failed`` and name the
  error and the checkpoints on disk, also when the last save fails;
* a run folder deleted mid-run ends the run ``failed`` naming what was lost, and nothing
  recreates it.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import jaxnitro as jn
from jaxnitro.checkpointers import orbax as plugin
from jaxnitro.events import run_scoped
from jaxnitro.plugins.run_folder.lock import LOCK_NAME, RunFolderInUse, RunFolderLost, hold_run_folder, lock_owner
from test_checkpoints import Ranked, step_dirs

SPE = 6  # optimizer steps per epoch of the tiny data


def lines(folder) -> list[dict]:
    return jn.read_jsonl(Path(folder) / "metrics.jsonl")


def only_run(root) -> Path:
    (name,) = os.listdir(root)
    return Path(root) / name


# -- 4: one writer per run folder ---------------------------------------------------------------------

HOLDER = """
import sys, time
from jaxnitro.plugins.run_folder.lock import hold_run_folder
lock = hold_run_folder(sys.argv[1])
print("held", flush=True)
sys.stdin.readline()
"""


def test_a_second_writer_is_refused_naming_the_owner_and_a_killed_owners_lock_is_taken_over(tmp_path):
    jn.train(Ranked(), run_dir=tmp_path, max_epochs=1, checkpointer=jn.Checkpointer())
    folder = only_run(tmp_path)
    assert not (folder / LOCK_NAME).exists()  # released at the run's end
    before = (folder / "metrics.jsonl").read_bytes(), step_dirs(folder)

    # another process (a job still running) holds the folder
    owner = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline().strip() == "held"
        with pytest.raises(RunFolderInUse) as info:  # refused as the handle is built (setup)
            jn.Nitro(Ranked(), run_dir=tmp_path, resume="auto", max_epochs=2)
        text = str(info.value)
        assert f"pid {owner.pid} on host {socket.gethostname()!r}" in text and str(folder) in text
        assert "resume=False" in text and LOCK_NAME in text  # the fixes
        # refused before writing anything: no run start, no log line, no save
        assert ((folder / "metrics.jsonl").read_bytes(), step_dirs(folder)) == before
        assert lock_owner(folder)["pid"] == owner.pid
    finally:
        owner.send_signal(signal.SIGKILL)  # a killed owner never releases its lock
        owner.wait()
    assert lock_owner(folder)["pid"] == owner.pid  # the file is still there: stale

    third = jn.Nitro(Ranked(), run_dir=tmp_path, resume="auto", max_epochs=2)
    with pytest.warns(RuntimeWarning, match=rf"had a lock left by pid {owner.pid} .* takes the folder over"):
        third.train()
    assert third.status == "done" and third.step == 2 * SPE
    assert not (folder / LOCK_NAME).exists()
    finishes = [x["status"] for x in lines(folder) if x["kind"] == "finish"]
    assert finishes == ["done", "done"]  # the first run's and the third's: nothing of the refused one


def test_the_lock_names_the_job_and_is_released_whatever_the_status(tmp_path):
    class Boom:
        @jn.hookimpl
        def jaxnitro_epoch_trained(self, run, epoch, step, stats):
            assert lock_owner(run.run_dir)["pid"] == os.getpid()  # held while the run writes
            raise ValueError("boom")

    with run_scoped([Boom()]), pytest.raises(ValueError, match="boom"):
        jn.train(Ranked(), run_dir=tmp_path, max_epochs=2, checkpointer=None)
    folder = only_run(tmp_path)
    assert not (folder / LOCK_NAME).exists()
    # held in this process (another train() writing it): refused too
    lock = hold_run_folder(str(folder))
    try:
        with pytest.raises(RunFolderInUse, match="this very process"):
            hold_run_folder(str(folder))
    finally:
        lock.release()
    assert not (folder / LOCK_NAME).exists()


def test_without_flock_the_record_decides(tmp_path, monkeypatch):
    """A file system that refuses ``flock`` (ENOLCK): a live pid of this host holds the folder,
    a dead one's lock is stale, another host's is refused."""
    from jaxnitro.plugins.run_folder import lock as run_lock

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(run_lock.fcntl, "flock", no_flock)
    lock_file = tmp_path / LOCK_NAME
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for owner, refused in [({"pid": os.getppid(), "host": socket.gethostname()}, "held by the live process"),
                           ({"pid": 1, "host": "elsewhere"}, "cannot lock files"),
                           ({"pid": dead.pid, "host": socket.gethostname()}, None)]:
        lock_file.write_text(json.dumps(owner))
        if refused:
            with pytest.raises(RunFolderInUse, match=refused):
                hold_run_folder(str(tmp_path))
            assert json.loads(lock_file.read_text()) == owner  # left as it was
        else:
            with pytest.warns(RuntimeWarning, match=rf"pid {dead.pid} is not alive on this host"):
                lock = hold_run_folder(str(tmp_path))
            assert lock_owner(tmp_path)["pid"] == os.getpid()
            lock.release()
            assert not lock_file.exists()


# -- 5: a failed save is a recorded status ------------------------------------------------------------


def enospc_at(steps):
    """A save that fails as on a full disk at the given steps (all when None)."""
    real = plugin._Saver.write

    def write(self, item):
        if steps is None or item.step in steps:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, item)

    return write


def test_a_full_disk_at_the_last_checkpoint_fails_the_run(tmp_path, monkeypatch):
    monkeypatch.setattr(plugin._Saver, "write", enospc_at({3 * SPE}))
    nitro = jn.Nitro(Ranked(), run_dir=tmp_path, max_epochs=3, checkpointer=jn.Checkpointer(keep=jn.Last(3)))
    with pytest.raises(RuntimeError) as info:
        nitro.train()
    folder = only_run(tmp_path)
    assert nitro.status == "failed"
    finish = lines(folder)[-1]
    assert finish["kind"] == "finish" and finish["status"] == "failed"
    text = str(info.value)
    assert f"checkpoint of step 18 under {folder / 'checkpoints'} failed" in text
    assert "No space left on device" in text and "steps [6, 12]" in text and str(folder / "checkpoints" / "12") in text
    assert "No space left on device" in finish["error"] and "steps [6, 12]" in finish["error"]
    assert step_dirs(folder) == ["6", "12"]  # what the message says is on disk
    assert not (folder / LOCK_NAME).exists()


def test_asynchronous_saves_that_fail_stop_the_run_at_the_next_epoch_end(tmp_path, monkeypatch):
    monkeypatch.setattr(plugin._Saver, "write", enospc_at(None))

    class SlowEpochs:  # longer than a failing write: the failure is known by the next epoch's end
        @jn.hookimpl
        def jaxnitro_epoch_trained(self, run, epoch, step, stats):
            time.sleep(0.3)

    nitro = jn.Nitro(Ranked(), run_dir=tmp_path, max_epochs=5, checkpointer=jn.Checkpointer())
    with run_scoped([SlowEpochs()]), pytest.raises(RuntimeError, match="no checkpoint of this run is on disk"):
        nitro.train()
    assert nitro.status == "failed" and nitro.step == 2 * SPE  # epoch 1's save failed: stopped at epoch 2's end
    finish = lines(only_run(tmp_path))[-1]
    assert finish["status"] == "failed" and "checkpoint of step 6" in finish["error"]


def test_a_failed_mid_epoch_save_stops_the_run_at_the_next_step_boundary(tmp_path, monkeypatch):
    monkeypatch.setattr(plugin._Saver, "write", enospc_at(None))

    class SlowBoundaries:  # longer than a failing write
        @jn.hookimpl
        def jaxnitro_step_boundary(self, run, step, epoch):
            time.sleep(0.3)

    nitro = jn.Nitro(Ranked(), run_dir=tmp_path, max_epochs=3, checkpointer=jn.Checkpointer(every_n_steps=2))
    with run_scoped([SlowBoundaries()]), pytest.raises(RuntimeError, match="checkpoint of step 2 .* No space left"):
        nitro.train()
    assert nitro.status == "failed" and nitro.step == 4  # the next boundary, mid-epoch
    assert lines(only_run(tmp_path))[-1]["status"] == "failed"


# -- 6: the run folder deleted mid-run ----------------------------------------------------------------


@pytest.mark.parametrize("validated", [True, False], ids=["val", "no-val"])
def test_a_run_folder_deleted_mid_run_fails_the_run_and_is_not_recreated(tmp_path, validated):
    class Delete:
        @jn.hookimpl
        def jaxnitro_epoch_trained(self, run, epoch, step, stats):
            if epoch == 2:
                shutil.rmtree(run.run_dir)

    data = None
    if not validated:
        from tiny import tiny_data

        data = {"train": tiny_data()["train"]}
    nitro = jn.Nitro(Ranked(), data=data, run_dir=tmp_path, max_epochs=4,
                     checkpointer=jn.Checkpointer(keep=jn.Last(4), asynchronous=False))
    with run_scoped([Delete()]), pytest.raises(RunFolderLost) as info:
        nitro.train()
    folder = str(nitro.run_dir)
    text = str(info.value)
    assert f"run folder {folder} is gone" in text
    assert "metrics.jsonl" in text
    if validated:  # epoch 1's checkpoint was written before epoch 2 ended (without val it may lag)
        assert "checkpoints/ (steps [6])" in text
    assert nitro.status == "failed" and nitro.step <= 3 * SPE
    assert not os.path.exists(folder)  # no checkpoint and no log recreated it
    assert os.listdir(tmp_path) == []


@pytest.mark.filterwarnings("ignore:jaxnitro. plugin .orbax. failed to finish")
def test_a_save_never_recreates_a_deleted_run_folder(tmp_path):
    """The checkpointer's own check (a save queued before the deletion, written after it)."""
    class Delete:
        @jn.hookimpl
        def jaxnitro_epoch_end(self, run, row):  # after the checkpointer queued epoch 1's save
            if row["epoch"] == 1:
                shutil.rmtree(run.run_dir)

    with run_scoped([Delete()]), pytest.raises((RunFolderLost, RuntimeError)):
        jn.train(Ranked(), run_dir=tmp_path, max_epochs=3, logger=None,
                 checkpointer=jn.Checkpointer(min_interval=3600))
    assert os.listdir(tmp_path) == []


def test_a_check_of_the_lock_does_not_refuse_a_run_taking_it(tmp_path):
    # `held` (a resume's check at setup) takes a shared flock for an instant; a run taking the
    # folder meanwhile (a stale lock file: its owner was killed) waits it out instead of being refused
    import fcntl
    import threading

    from jaxnitro.plugins.run_folder.lock import held

    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": 2**22 + 7, "host": socket.gethostname()}))
    assert held(tmp_path) is None  # a stale lock is not held
    fd = os.open(tmp_path / LOCK_NAME, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # as `held` does, for 20 ms
    threading.Timer(0.02, os.close, (fd,)).start()
    with pytest.warns(RuntimeWarning, match="takes the folder over"):
        lock = hold_run_folder(str(tmp_path))
    assert lock_owner(tmp_path)["pid"] == os.getpid()
    assert "it is locked by" in str(held(tmp_path))  # now held: the refusal train() would give
    lock.release()
