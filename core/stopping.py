"""Early stopping on the monitored metric."""

from __future__ import annotations

import math

import attrs

__all__ = ["EarlyStopping"]


@attrs.define
class EarlyStopping:
    """Stop when the monitored metric has not improved for ``patience`` validated epochs.

    An improvement is a value better than the best so far by more than
    ``min_delta`` in the monitor's direction (``"max"`` or ``"min"``). NaN
    never improves. Host-side: redefining ``should_stop`` on a subclass takes
    effect at the next epoch without compiling anything.
    """

    patience: int = 5
    min_delta: float = 0.0
    best: float | None = attrs.field(default=None, init=False)
    best_epoch: int | None = attrs.field(default=None, init=False)
    bad_epochs: int = attrs.field(default=0, init=False)

    def __attrs_post_init__(self):
        if self.patience < 1:
            raise ValueError(f"jaxnitro: EarlyStopping(patience={self.patience}) must be >= 1.")

    def reset(self) -> None:
        self.best, self.best_epoch, self.bad_epochs = None, None, 0

    def should_stop(self, epoch: int, value: float, mode: str) -> bool:
        """Record ``value`` for ``epoch``; return True when the run should stop now."""
        value = float(value)
        better = not math.isnan(value) and (
            self.best is None
            or (value > self.best + self.min_delta if mode == "max" else value < self.best - self.min_delta)
        )
        if better:
            self.best, self.best_epoch, self.bad_epochs = value, epoch, 0
            return False
        self.bad_epochs += 1
        return self.bad_epochs >= self.patience
