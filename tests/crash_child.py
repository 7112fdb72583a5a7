"""A training process that kills itself with SIGKILL (used by test_checkpoint_crash.py).

``python crash_child.py <run_dir> mid-epoch|mid-save|mid-save-steps`` trains :class:`Crashed` for 4 epochs
with the checkpointer on, and dies (no cleanup, no finish) either while reading the 4th
batch of epoch 3 (once a checkpoint is complete), or in the middle of the first save after epoch 1's (while orbax writes its
record into the checkpoint's temporary folder; with ``Last(1)`` a save that falls behind the
epochs is dropped for a newer one, so which epoch that is depends on timing); ``mid-save-steps``
is ``mid-save`` with checkpoints every 4 optimizer steps, dying in the first save after step 4's. The class lives here so that the test process and the child agree on it.
"""

from __future__ import annotations

import glob
import os
import signal
import sys
import time

import jaxnitro as jn
from tiny import Tiny, tiny_data

KEEP = (1,)  # jn.Last(1): every epoch's save replaces the previous one


@jn.experiment
class Crashed(Tiny):
    def monitor(self):
        return ("loss", "min")


class KillingSource:
    """The train split, index-addressable; SIGKILLs the process at (epoch, batch) ``at``."""

    def __init__(self, batches, at=None, run_dir=None):
        self.batches, self.at, self.epoch, self.run_dir = batches, at, 0, run_dir

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        return (self.batch_at(i) for i in range(len(self)))

    def begin_epoch(self, epoch):
        self.epoch = epoch

    def batch_at(self, i):
        if self.at == (self.epoch, i):
            self._wait_for_a_checkpoint()
            os.kill(os.getpid(), signal.SIGKILL)
        if self.at is not None:
            time.sleep(0.03)  # epochs long enough for the previous epoch's save to complete
        return self.batches[i]


    def _wait_for_a_checkpoint(self, timeout: float = 60.0) -> None:
        """Until one checkpoint is complete (a step folder, not orbax's temporary one): on
        loaded cores the first save can still be in flight this far into epoch 3, and the
        test is about a kill mid-epoch after a save, not about how fast a save is."""
        deadline = time.monotonic() + timeout
        while self.run_dir is not None and time.monotonic() < deadline:
            folders = glob.glob(os.path.join(self.run_dir, "*", "checkpoints", "*"))
            if any(os.path.basename(f).isdigit() for f in folders):
                return
            time.sleep(0.01)


def data(at=None, run_dir=None):
    d = tiny_data()
    return {"train": KillingSource(d["train"], at, run_dir), "val": d["val"]}


def checkpointer(how: str = ""):
    """Every epoch; ``mid-save-steps``: every 4 optimizer steps (6 an epoch: mid-epoch ones too)."""
    if how == "mid-save-steps":
        return jn.Checkpointer(every_n_steps=4, keep=jn.Last(*KEEP))
    return jn.Checkpointer(keep=jn.Last(*KEEP))


def main(run_dir: str, how: str) -> None:
    at = (3, 3) if how == "mid-epoch" else None  # the 4th batch of epoch 3
    first = 4 if how == "mid-save-steps" else 6
    if how.startswith("mid-save"):
        import orbax.checkpoint as ocp

        save = ocp.JsonCheckpointHandler.async_save

        async def die_while_saving(self, directory, item=None, args=None):
            if args is not None and args.item.get("step") != first:  # the second save's record, in its temporary folder
                os.kill(os.getpid(), signal.SIGKILL)
            return await save(self, directory, item, args)

        ocp.JsonCheckpointHandler.async_save = die_while_saving
    jn.train(Crashed(), data=data(at, run_dir), run_dir=run_dir, max_epochs=4, checkpointer=checkpointer(how))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
