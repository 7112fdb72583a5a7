"""A training process that SIGKILLs itself right after a logger line (used by the logger tests).

``python kill_after_child.py <run_dir> <logger> validate@E|finish [max_epochs]`` trains
:class:`Tiny` (6 steps an epoch) with ``logger=<logger>`` (``jsonl,tensorboard`` for several)
and the checkpointer on (``Last(2)``, each epoch's end), and dies (no cleanup, no flush, no
finish of its own) either right after the loggers got epoch ``E``'s validation line (before
that epoch's checkpoint: the newest checkpoint is epoch ``E - 1``'s, older than the last
logged line), or right after they finished the run. ``max_epochs`` defaults to 2.
"""

from __future__ import annotations

import os
import signal
import sys

import jaxnitro as jn
from tiny import Tiny, tiny_data


class KillAfter:
    """Kills the process once the run's loggers got the line ``when``. Registered before the run,
    so it is called after the run's logger relays (pluggy calls the newest plugin first)."""

    def __init__(self, when: str):
        self.when = when

    @jn.hookimpl
    def jaxnitro_split_evaluated(self, run, split, metrics, context):
        if self.when == f"validate@{run.nitro.epoch}":
            os.kill(os.getpid(), signal.SIGKILL)

    @jn.hookimpl
    def jaxnitro_run_finish(self, run, status):
        if self.when == "finish":
            os.kill(os.getpid(), signal.SIGKILL)


def main(run_dir: str, logger: str, when: str, max_epochs: int = 2) -> None:
    from jaxnitro.plugin_manager import plugin_manager

    plugin_manager().register(KillAfter(when), name="kill-after")
    loggers = logger.split(",")
    jn.train(Tiny(max_epochs=max_epochs), data=tiny_data(), run_dir=run_dir, logger=loggers if len(loggers) > 1 else loggers[0],
             checkpointer=jn.Checkpointer(keep=jn.Last(2), asynchronous=False))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], *(int(a) for a in sys.argv[4:]))
