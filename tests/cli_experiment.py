"""The experiment the command-line tests train (``jaxnitro train tests/cli_experiment.py:CliTiny``).

Tiny's model and data with a test split, a monitor, a checkpointer (best and last)
and an attribute docstring on every field.
"""

from __future__ import annotations

import numpy as np

import jaxnitro as jn
from jaxnitro import Device, GraphConst

from tiny import Tiny, batches, make_arrays


@jn.experiment
class CliTiny(Tiny):
    width: GraphConst[int] = 16
    "Hidden width (structural)."
    smoothing: Device[float] = 0.0
    "Label smoothing (a traced input)."
    max_epochs: int = 2
    "Epoch budget."
    tag: str | None = None
    "A free-form label (Host)."
    weights_init: Device[np.ndarray] = jn.field(factory=lambda: np.ones(4, np.float32))
    "An array field: not settable from the command line."

    def build_data(self, dist):
        x, y, oh = make_arrays(96 + 40 + 24)
        return {
            "train": batches(x[:96], y[:96], oh[:96], 16),
            "val": batches(x[96:136], y[96:136], oh[96:136], 16, drop_last=False),
            "test": batches(x[136:], y[136:], oh[136:], 16, drop_last=False),
        }

    def metrics(self, logits, *, y):
        return {"acc": (np.sum(logits.argmax(-1) == y), len(y))}

    def monitor(self):
        return ("acc", "max")

    def checkpointer(self):
        return jn.Checkpointer(keep=(jn.Best(1), jn.Last(1)))


@jn.experiment
class CtrlCTiny(CliTiny):
    """CliTiny that sends itself ``signal_name`` (SIGINT: a real Ctrl-C; SIGTERM: a real
    preemption; through the signal handler) in its ``interrupt_at``-th ``finalize_metrics``
    call of the process."""

    max_epochs: int = 4
    "Epoch budget."
    interrupt_at: int = 2
    "The finalize_metrics call (1-based, counted per process) during which the signal arrives; 0: never."
    signal_name: str = "SIGINT"
    "The signal sent: SIGINT (Ctrl-C) or SIGTERM (a preemption)."

    def finalize_metrics(self, acc, split):
        import signal

        CtrlCTiny.validations += 1
        if split == "val" and CtrlCTiny.validations == self.interrupt_at:
            signal.raise_signal(getattr(signal, self.signal_name))
        return acc


CtrlCTiny.validations = 0
