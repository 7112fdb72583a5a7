"""Where the train split is during a run: the loop's data position, one typed object.

A :class:`TrainPosition` is made by the training loop for each ``train()`` and owned by
it. It knows the train split's kind (sized or a stream, index-addressable, a stream that
saves its iterator state: :mod:`jaxnitro.stream_state`) and records, as the loop goes,
where each epoch started, where a stream's epochs ended, where the current pass opened and
the saved iterator state a resumed pass continues from. From these it answers where a
``train()`` starts (:meth:`TrainPosition.start`) and what a checkpoint records as
``data_position`` (:meth:`TrainPosition.at`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from .batches import is_sized, unwrap
from .source_contract import is_addressable
from .stream_state import capture, is_stateful, restore

__all__ = ["TrainPosition"]


class TrainPosition:
    """The train split ``train`` (wrapped) read in micro-batches of ``accum`` per optimizer step.

    * ``sized``: the split has ``len()`` (a stream ends its epochs when it ends);
      ``steps_per_epoch``: ``len(train) // accum``, else None; ``addressable``,
      ``stateful``: an index-addressable source, a stream that restores its iterator state;
    * ``epoch_start``: ``{epoch: the step before its first}``; ``stream_ends``: ``{step:
      epoch}`` where a stream's epoch ended; ``pass_open``: ``(epoch, step)`` where the
      current pass opened; ``restored``: ``(epoch, saved state)`` that epoch's pass
      continues from (a resumed stream), until the pass opens.
    """

    def __init__(self, train, accum: int):
        self.train, self.accum = train, accum
        self.sized = is_sized(train)
        self.addressable = is_addressable(unwrap(train))
        # a stream that records and restores its iterator state (a checkpoint holds it)
        self.stateful = is_stateful(unwrap(train), self.addressable)
        self.steps_per_epoch = len(train) // accum if self.sized else None
        self.pass_open: tuple[int, int] | None = None
        self.restored: tuple[int, Any] | None = None
        self.epoch_start: dict[int, int] = {}
        self.stream_ends: dict[int, int] = {}

    def start(self, book, step: int, epoch: int, position: dict | None) -> tuple[int, int]:
        """``(epoch, steps into it)`` where a ``train()`` at ``step`` (the handle's ``epoch``)
        starts: from the step for a source with ``len()`` (``book.position``); for a stream, from
        ``position`` (a resumed checkpoint's ``SavedRun.data_position``, or None), else the next
        epoch. Mid-epoch, a stream that saved its iterator state is restored to it
        (:meth:`_continue_stream`); any other stream's first batches are read again and
        dropped, with a warning."""
        if self.sized:
            epoch, into = book.position(step)
        else:
            if not position or "epoch" not in position:
                return epoch + 1, 0
            epoch, into = int(position["epoch"]), int(position.get("batches_into_epoch", 0)) // self.accum
            if position.get("epoch_complete"):
                return epoch + 1, 0
        if into and position is not None and not self.addressable:
            self._continue_stream(epoch, into, position.get("stream_state"), step)
        return epoch, into

    def _continue_stream(self, epoch: int, into: int, saved, step: int) -> None:
        """Resuming ``into`` steps into ``epoch`` of a stream: keep its ``saved`` iterator state
        for the pass, or (none saved, or the source cannot restore one) warn that the epoch is
        read again from its start and its first batches dropped."""
        if saved is not None and self.stateful:  # setup refused a state of another source type
            self.restored = (epoch, saved)  # handed to the source as the epoch's pass opens
            return
        batches = into * self.accum
        why = ("its checkpoint holds no iterator state (an older checkpoint, or the source gave none)"
               if self.stateful else
               "it restores no iterator state (no iterator_state/restore_iterator)")
        warnings.warn(
            f"jaxnitro: the `train` split is a stream without batch_at/begin_epoch and {why}, so "
            f"resuming at step {step} reads epoch {epoch} from its start again and drops its first "
            f"{batches} batches before training goes on (the time of reading them, no training). "
            f"An index-addressable source (batch_at/begin_epoch) starts there at once, and a stream "
            f"with iterator_state/restore_iterator (jn.GrainStream, jn.TorchStream over a stateful "
            f"loader) continues from its saved state.",
            UserWarning, stacklevel=6,
        )

    def open_pass(self, epoch: int, into: int, step: int, reader_at: Callable[[int], Any]):
        """``(reader, restored)``: ``epoch``'s pass from its step ``into`` at run step ``step``
        (``reader_at(batch index)`` opens the reader), and whether the pass continues a
        stream's saved state (restored here, just before the pass opens: nothing else may
        start a pass in between)."""
        self.epoch_start[epoch] = step - into
        restored = self.restored is not None and self.restored[0] == epoch
        if restored:
            restore(unwrap(self.train), self.restored[1], step)
        self.restored = None
        reader = reader_at(0 if restored else into * self.accum)
        self.pass_open = (epoch, step)
        return reader, restored

    def epoch_over(self, epoch: int, step: int) -> bool:
        """Whether a sized split's ``epoch`` ends at ``step``."""
        return self.sized and step == epoch * self.steps_per_epoch

    def stream_ended(self, epoch: int, into: int, step: int) -> None:
        """The train stream ended at ``step``: ``epoch`` is over. Refuses a pass that yielded no
        batch (a one-shot generator read a second time)."""
        self.stream_ends[step] = epoch
        if into == 0 and step == self.epoch_start[epoch]:
            raise ValueError(
                f"jaxnitro: the `train` split (a stream without len()) yielded no batch in epoch "
                f"{epoch}: an epoch is one pass over it, so it must be an iterable that can be read "
                f"again (a grain IterDataset, a DataLoader, a class whose __iter__ starts a new "
                f"pass), not a one-shot generator."
            )

    def at(self, step: int, epoch: int) -> dict:
        """Where the data is after ``step`` (``epoch``: the handle's, for a stream before any
        pass): ``{"epoch", "steps_into_epoch", "batches_into_epoch", "epoch_complete"}`` and,
        mid-pass of a stateful stream, ``"stream_state"`` (what a checkpoint records; the epoch
        is the one ``step`` belongs to)."""
        if self.sized:
            spe = self.steps_per_epoch
            complete = step % spe == 0
            epoch = step // spe if complete else step // spe + 1
            into = 0 if complete else step % spe
        elif step in self.stream_ends:  # a stream's epoch ended at this step
            epoch, into, complete = self.stream_ends[step], 0, True
        else:
            epoch = max((e for e, first in self.epoch_start.items() if first < step), default=epoch)
            into = step - self.epoch_start.get(epoch, step)
            complete = False
        position = {"epoch": epoch, "steps_into_epoch": into, "batches_into_epoch": into * self.accum,
                    "epoch_complete": complete}
        if self.stateful and not complete and self.pass_open is not None:
            pass_epoch, opened = self.pass_open
            if pass_epoch == epoch and step >= opened:  # the pass in progress (or just closed)
                state = capture(unwrap(self.train), (step - opened) * self.accum)
                if state is not None:
                    position["stream_state"] = state
        return position
