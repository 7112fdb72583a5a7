"""The event book: what is due at which optimizer step of a run.

The loop dispatches optimizer steps in *segments* that end where something is due, so
that validation, checkpoints and the run's end see the state of exactly that step:

* an epoch's end (every ``steps_per_epoch`` steps, when the train split has a length);
* a validation (``val_every_n_steps``), which also closes a history row;
* a plugin's boundary (``jaxnitro_step_period``: e.g. ``Checkpointer(every_n_steps=N)``);
* the run's last step (``max_steps``, or ``max_epochs`` x ``steps_per_epoch``).

In: the run's settings and the train split's steps per epoch (None for a stream with no
``len()``). Out: a frozen :class:`EventBook` whose methods answer, for a step, the next
cut and what is due there. Nothing here reads data or touches the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["EventBook", "make_book", "schedule_horizon"]


@dataclass(frozen=True)
class EventBook:
    """Where a run's segments end and what each end does.

    - ``steps_per_epoch``: optimizer steps in one epoch, or None (a stream: an epoch ends
      when the source does);
    - ``total``: the run's last step number (``math.inf`` is never a value: a stream
      without ``max_steps`` is refused at setup);
    - ``val_every``: ``val_every_n_steps`` (rows close at validations), or None (rows close
      at epoch ends, validated when there is a ``val`` split);
    - ``periods``: the step periods plugins asked to see (``jaxnitro_step_period``);
    - ``marks``: single steps plugins asked to see (an answer that is a collection of steps).
    """

    steps_per_epoch: int | None
    total: int
    val_every: int | None = None
    periods: tuple[int, ...] = ()
    marks: frozenset = frozenset()

    @property
    def by_steps(self) -> bool:
        """Rows close at validations every ``val_every`` steps rather than at epoch ends."""
        return self.val_every is not None

    def position(self, step: int) -> tuple[int, int]:
        """``(epoch, steps into it)`` of the step after ``step`` (epochs count from 1): where a
        run that has taken ``step`` optimizer steps continues. Sized sources only."""
        spe = self.steps_per_epoch
        return step // spe + 1, step % spe

    def epoch_last(self, epoch: int) -> int:
        """The last step of ``epoch`` within the run (``total`` when the run ends first)."""
        if self.steps_per_epoch is None:
            return self.total
        return min(epoch * self.steps_per_epoch, self.total)

    def next_cut(self, step: int, last: int) -> int:
        """The first step after ``step`` at which something is due, at most ``last`` (the
        epoch's last step, or the run's)."""
        cut = last
        for period in ((self.val_every,) if self.val_every else ()) + self.periods:
            cut = min(cut, (step // period + 1) * period)
        for mark in self.marks:
            if step < mark < cut:
                cut = mark
        return cut

    def period(self) -> int | None:
        """The steps between the run's recurring cuts: the greatest common divisor of the
        epoch's length, ``val_every`` and the plugins' periods (single ``marks`` and the run's
        end aside); None when nothing recurs (a stream with no periods). A segment that starts
        at a multiple of it is a multiple of it."""
        recurring = [p for p in (self.steps_per_epoch, self.val_every, *self.periods) if p]
        return math.gcd(*recurring) if recurring else None

    def closes_row(self, step: int, epoch_done: bool) -> bool:
        """Whether a history row ends at ``step``: an epoch's end (or the run's) when rows
        follow epochs; a validation (every ``val_every`` steps, and the run's end) otherwise."""
        if step >= self.total:
            return True
        if self.by_steps:
            return step % self.val_every == 0
        return epoch_done

    def boundary(self, step: int) -> bool:
        """Whether a plugin asked to see ``step`` (``jaxnitro_step_boundary`` is emitted)."""
        return step in self.marks or any(step % p == 0 for p in self.periods)


def make_book(settings, steps_per_epoch: int | None, periods=()) -> EventBook:
    """The book of a run with these settings, from the train split's ``steps_per_epoch``.

    ``periods`` are the plugins' answers to ``jaxnitro_step_period``: each an int N (every N
    steps) or a collection of step numbers (those steps once).

    ``total`` is the smaller of ``max_steps`` and ``max_epochs * steps_per_epoch`` (either
    may be absent, not both for a stream: setup refuses that). ``ValueError`` if neither
    bounds the run.
    """
    bounds = []
    if settings.max_steps is not None:
        bounds.append(settings.max_steps)
    if settings.max_epochs is not None and steps_per_epoch is not None:
        bounds.append(settings.max_epochs * steps_per_epoch)
    if not bounds:
        raise ValueError(
            "jaxnitro: the train split has no len(), so max_epochs cannot bound the run; pass "
            "`max_steps=N` (the optimizer steps to take)."
        )
    total = int(min(bounds))
    ints, marks = set(), set()
    for answer in periods:
        if answer is None:
            continue
        if isinstance(answer, (int, float)) and not isinstance(answer, bool):
            if not math.isfinite(answer) or int(answer) != answer or answer < 1:
                raise ValueError(f"jaxnitro: a plugin asked for a step period of {answer!r}; it must be an integer >= 1.")
            ints.add(int(answer))
        else:
            marks.update(int(s) for s in answer if 0 < int(s) <= total)
    return EventBook(steps_per_epoch, total, settings.val_every_n_steps, tuple(sorted(ints)), frozenset(marks))


def schedule_horizon(settings, steps_per_epoch: int | None, bindings, resumed_meta: dict | None) -> int:
    """The optimizer steps a run's schedules are planned over (each factory gets it).

    A fresh run: the run's own total (``max_steps``, or ``max_epochs`` x ``steps_per_epoch``).
    A resumed run whose checkpoint recorded another horizon (the run was made longer or
    shorter) and that has schedules: ``schedule_horizon="saved"`` keeps the recorded one (the
    curves continue; past their end they hold their last value), ``"new"`` re-plans over this
    run's total (the values jump at the seam); without either, ``ValueError`` naming both.
    """
    total = make_book(settings, steps_per_epoch).total
    saved, step = (resumed_meta or {}).get("horizon"), (resumed_meta or {}).get("step")
    if saved is None or int(saved) == total or not bindings or int(step or 0) >= total:  # the last: nothing to train
        return total
    if settings.schedule_horizon == "saved":
        return int(saved)
    if settings.schedule_horizon == "new":
        return total
    raise ValueError(
        f"jaxnitro: this run resumes at step {step} a run whose schedules were planned over {int(saved)} "
        f"optimizer steps, but it plans {total} (its max_epochs / max_steps are not those the curves "
        f"were planned with). Re-planning them would "
        f"move every schedule's value at the seam. Say which: `schedule_horizon=\"saved\"` continues the "
        f"original curves (past step {int(saved)} they hold their last value), `schedule_horizon=\"new\"` "
        f"re-plans them over {total} steps."
    )
