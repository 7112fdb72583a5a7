"""What ``resume=`` / ``weights=`` say when there is nothing (or no longer anything) to read.

* a resume of a run another process is still writing is refused when the handle is built,
  with ``jn.RunFolderInUse`` and the message ``train()`` gives, before any array is read;
* a checkpoint deleted while it is read (the live run's ``keep`` removed it) is said to be
  that, not "corrupt";
* ``resume=("latest", <step>)`` with a step the run lacks names the run and its steps;
* ``resume="auto"`` with nothing to continue warns one plain sentence naming ``run_dir``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import jaxnitro as jn
from jaxnitro.checkpointers import orbax as plugin
from jaxnitro.plugin import NoCheckpointError
from jaxnitro.plugins.run_folder.lock import RunFolderInUse, hold_run_folder
from test_checkpoints import Ranked

HOLDER = """
import sys
from jaxnitro.plugins.run_folder.lock import hold_run_folder
lock = hold_run_folder(sys.argv[1])
print("held", flush=True)
sys.stdin.readline()
"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A finished run keeping its two epoch-end checkpoints (steps 6 and 12)."""
    root = tmp_path_factory.mktemp("runs")
    n = jn.train(Ranked(), run_dir=root, max_epochs=2, checkpointer=jn.Checkpointer(keep=jn.Last(2)))
    return Path(n.run_dir)


def copy_of(run: Path, tmp_path: Path) -> Path:
    """A copy of the run folder ``run`` under ``tmp_path / "runs"``; its path."""
    folder = tmp_path / "runs" / run.name
    shutil.copytree(run, folder)
    return folder.resolve()


def counting_restores(monkeypatch, before=None) -> list:
    """Count (in the returned list) every array read of a checkpoint; ``before(step_path)`` runs
    just before each one."""
    reads, real = [], plugin._restore_fn

    def restore_fn(folder, steps):
        restore = real(folder, steps)

        def counted(wanted):
            reads.append(steps[-1])
            if before is not None:
                before(folder.step_path(steps[-1]))
            return restore(wanted)

        return counted

    monkeypatch.setattr(plugin, "_restore_fn", restore_fn)
    return reads


def test_resuming_a_run_another_process_writes_is_refused_at_setup_as_train_would(trained, tmp_path, monkeypatch):
    folder = copy_of(trained, tmp_path)
    root = folder.parent
    reads = counting_restores(monkeypatch)
    owner = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline().strip() == "held"
        with pytest.raises(RunFolderInUse) as at_train:  # what train() says: it takes the lock
            hold_run_folder(str(folder))
        expected = str(at_train.value)
        assert f"pid {owner.pid} on host" in expected
        # every resume that would continue the folder: refused as the handle is built
        specs = ("auto", "latest", ("latest", "last"), (str(folder), 12), str(folder), str(folder / "checkpoints/12"))
        for spec in specs:
            with pytest.raises(jn.RunFolderInUse) as info:
                jn.Nitro(Ranked(), run_dir=root, resume=spec)
            assert str(info.value) == expected, spec
        assert reads == []  # before any array of a checkpoint was read
        # reading it without writing it is not refused: weights=, or a resume that branches
        assert jn.Nitro(Ranked(), run_dir=root, weights=("latest", "last")).plan.weights_meta["step"] == 12
        branch = jn.Nitro(Ranked(), run_dir=root, resume=(str(folder), 6))
        assert branch.step == 6 and not branch.plan.resumed.continue_folder

        # a checkpoint deleted under the search of a held folder: in use too, not "corrupt"
        real = plugin._RunFolder._read_meta

        def vanishing(self, step):
            shutil.rmtree(self.step_path(step), ignore_errors=True)
            return real(self, step)

        monkeypatch.setattr(plugin._RunFolder, "_read_meta", vanishing)
        with pytest.raises(jn.RunFolderInUse) as info:
            jn.Nitro(Ranked(), run_dir=root, resume="auto")
        assert str(info.value) == expected
        monkeypatch.setattr(plugin._RunFolder, "_read_meta", real)
    finally:
        owner.send_signal(signal.SIGKILL)  # a killed owner's lock file stays: stale, not held
        owner.wait()
    resumed = jn.Nitro(Ranked(), run_dir=root, resume="auto")  # train() takes the stale lock over
    assert resumed.step == 6 and resumed.plan.resumed.continue_folder


def test_a_checkpoint_deleted_while_being_read_is_said_so_not_corrupt(trained, tmp_path, monkeypatch):
    folder = copy_of(trained, tmp_path)
    counting_restores(monkeypatch, before=lambda path: shutil.rmtree(path))  # another run's `keep`
    for kw in (dict(weights=(str(folder), "last")), dict(resume=(str(folder), 6))):
        with pytest.raises(FileNotFoundError) as info:
            jn.Nitro(Ranked(), run_dir=folder.parent, **kw)
        msg = str(info.value)
        step = 12 if "weights" in kw else 6
        assert msg.startswith(f"jaxnitro: the checkpoint {folder}/checkpoints/{step} was deleted while being read ")
        assert "another process is writing this run folder" in msg and "not corrupt" in msg
        assert "corrupt or incomplete" not in msg and "restore_optimizer" not in msg
        assert not isinstance(info.value, NoCheckpointError)


def test_resume_latest_with_a_step_the_run_lacks_names_the_run_and_its_steps(trained):
    for kw in (dict(resume=("latest", 99999)), dict(weights=("latest", 99999))):
        with pytest.raises(NoCheckpointError, match=rf"^jaxnitro: run '{trained.name}' has no checkpoint at step "
                                                    rf"99999 \(it has \[6, 12\]\)\."):
            jn.Nitro(Ranked(), run_dir=trained.parent, **kw)


def auto_warnings(run_dir) -> list[str]:
    """The warnings of building a ``resume="auto"`` handle over ``run_dir`` (it starts fresh)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert jn.Nitro(Ranked(), run_dir=run_dir, resume="auto").step == 0
    return [str(w.message) for w in caught if "resume='auto'" in str(w.message)]


def test_resume_auto_with_nothing_to_continue_warns_one_plain_sentence(tmp_path):
    def sentence(clause):
        return f"jaxnitro: resume='auto' found no checkpoint to continue ({clause}); starting a fresh run."

    missing, empty, bare = tmp_path / "missing", tmp_path / "empty", tmp_path / "bare"
    empty.mkdir()
    jn.train(Ranked(), run_dir=bare, max_epochs=1, checkpointer=None)  # a run folder, no checkpoints
    assert auto_warnings(missing) == [sentence(f"run_dir {str(missing.resolve())!r} does not exist")]
    assert auto_warnings(empty) == [sentence(f"run_dir {str(empty.resolve())!r} holds no run folder")]
    assert auto_warnings(bare) == [sentence(f"run_dir {str(bare.resolve())!r} holds no checkpoint of this "
                                            f"experiment: 1 run folder without checkpoints")]
    assert not os.listdir(empty)  # building the handle wrote nothing


def test_resume_auto_restore_best_with_nothing_to_continue_warns_without_the_naming_advice(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert jn.Nitro(Ranked(), run_dir=tmp_path, resume="auto", restore_best=True).step == 0
    (text,) = [str(w.message) for w in caught if "resume='auto'" in str(w.message)]
    assert text.startswith("jaxnitro: resume='auto' found no checkpoint to continue (no run under run_dir has a checkpoint")
    assert text.count("jaxnitro:") == 1 and "Name a checkpoint folder" not in text
