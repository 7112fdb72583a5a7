"""A handle's changing state: one object (:class:`RunState`, ``nitro.run_state``) the training
loop owns during a run (plugins reach it as ``run.run_state``), and its frozen snapshot after
one step (:class:`SavedRun`), what a checkpoint serializes. :meth:`RunState.start` is the one
place a resumed run gets its checkpoint's data position and open row back.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from .state import TrainState

__all__ = ["RunState", "SavedRun"]


@dataclass(frozen=True)
class SavedRun:
    """The run after optimizer step ``state.step``: what a checkpoint serializes and a resume needs.

    - ``state``: the :class:`~jaxnitro.state.TrainState` at that step. The loop's published
      state's arrays are donated by its next step: a checkpointer that writes later copies
      them first (``run.run_state.snapshot(its_copy)``);
    - ``rows``: the history rows closed up to the step, oldest first (the run's own dicts);
    - ``data_position``: where the train split is after the step: ``epoch`` (the one the
      step belongs to), ``steps_into_epoch``, ``batches_into_epoch`` (micro-batches),
      ``epoch_complete`` and, mid-pass of a :class:`jaxnitro.plugin.StatefulStream`, ``stream_state``;
    - ``open_row``: the read per-step scalars (``[loss, *train_metrics]`` each) of the row
      still open at the step, ``[]`` when a row closed there, None when not all are read yet:
      a run resumed there averages that row over all of its steps.
    """

    state: TrainState
    rows: tuple = ()
    data_position: dict | None = None
    open_row: list | None = None

    @property
    def step(self) -> int:
        return int(self.state.step)

    @property
    def row(self) -> dict | None:
        """The history row that closed at this step, or None."""
        return self.rows[-1] if self.rows and self.rows[-1].get("step") == self.step else None


class RunState:
    """A handle's changing state, one object: ``state`` (the published :class:`~jaxnitro.state.TrainState`),
    ``record`` (its ``rows``: the history being built) and, from a ``train()``'s :meth:`begin`, the
    loop's ``position`` (:class:`~jaxnitro.position.TrainPosition`) and ``reads``
    (:class:`~jaxnitro.reads.StepReads`, which keeps the open row). The handle keeps it for its
    life (``nitro.state`` reads it); the loop owns it during a run. Nothing here runs per step."""

    def __init__(self, state: TrainState, record):
        self.state, self.record = state, record
        self.position = self.reads = None

    def begin(self, position, reads) -> "RunState":
        """A ``train()`` starts: the loop's data position and reads join the state."""
        self.position, self.reads = position, reads
        return self

    def publish(self, leaves, step: int) -> None:
        """Make the leaves of the last completed optimizer step the published state."""
        self.state = self.state.with_leaves(*leaves, step=step, epoch=self.state.epoch)

    def start(self, book, resumed) -> tuple[int, int]:
        """``(epoch, steps into it)`` where this ``train()`` starts. Resumed at this step (``resumed``:
        the plan's :class:`~jaxnitro.state.ResumePoint`), the checkpoint's open row and position come back."""
        step, position = self.state.step, None
        if resumed is not None and resumed.step == step:
            position = resumed.data_position
            if resumed.open_row and not self.record.rows:
                self.reads.resume_row(resumed.open_row, step)
        return self.position.start(book, step, self.state.epoch, position)

    def reopen(self) -> None:
        """The row just closed stays open: its validation was cut short (a stop during it), so a
        snapshot records its steps as the open row and a run resumed there validates it."""
        self.reads.reopen()

    def row_due(self, book, epoch_done: bool) -> bool:
        """Whether a row should have closed at the resumed step but is open (:meth:`reopen`, or a
        stop at a cut before it was handled): the loop closes and validates it first."""
        step = self.state.step
        return self.reads.row_open_at(step) and book.closes_row(step, epoch_done)

    def snapshot(self, state=None) -> SavedRun:
        """The run after ``state.step`` (``state``: the published state, or a copy of it that a
        checkpointer took at its step); made only when asked."""
        state = self.state if state is None else state
        step, rows = int(state.step), self.record.rows
        closed = rows[:bisect.bisect_right(rows, step, key=lambda row: row["step"])]  # rows are in step order
        return SavedRun(state, tuple(closed), self.position.at(step, self.state.epoch), self.reads.open_row_at(step))
