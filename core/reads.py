"""Deferred reads of the per-step scalars, and the history rows they close.

Per optimizer step the device computes one float32 vector (``loss`` first, then
``train_metrics``, or what ``train_step`` returned); with ``accum`` > 1 one per
micro-batch; a ``train_block`` dispatch ``[k, accum, n]`` of them. They stay on the
device in ``pending`` until read, oldest first, so that the host never waits on the
device mid-epoch. A read emits the steps as a :class:`~jaxnitro.StepStretch`
(``jaxnitro_steps_read``, with the times of the read), checks divergence, and closes the
history rows whose last step it reached (a row's ``train_loss`` is the mean over its steps;
``jaxnitro_row_closed``).

In: the run (``run.run_state``: the live epoch), its record, the loop's ``accum``, the names of
the scalars (known once a train program is traced). Out: rows appended to ``record.rows``;
:meth:`StepReads.read` returns True on a non-finite loss (``record.diverged_at`` set).
"""

from __future__ import annotations

import collections
import math
import time

import numpy as np

from .events import StepStretch
from .hookcalls import emit

__all__ = ["StepReads", "step_scalars"]


class StepReads:
    """The unread steps of one ``train()``, and the rows they close.

    - ``pending``: dispatched steps' device scalars, oldest first (``pending[0]`` is step
      ``first_unread``);
    - ``epoch_ends``: ``(epoch, last step)`` of epochs whose steps were all dispatched,
      oldest first, dropped once read past (a read step's epoch is looked up here);
    - ``row_ends``: ``(epoch, step)`` of rows to close when their step is read;
    - ``values``: the read scalars of the steps after ``row_base`` (the last row's step),
      the open row's.
    - ``start``: the step the run continues from; ``manual``: ``train_step`` is the experiment's (every
      scalar checked); ``check``: ``check_divergence``; ``validated``: a ``val`` split (the loop emits epoch end)."""

    def __init__(self, run, record, accum: int, names, logged_sched: dict, *, start: int, manual: bool,
                 check: bool, validated: bool, read_every: int, max_pending: int):
        self.run, self.record, self.accum, self.names = run, record, accum, names
        self.logged_sched, self.manual, self.check, self.validated = logged_sched, manual, check, validated
        self.read_every, self.max_pending = read_every, max_pending
        self.pending: list = []
        self.first_unread = start + 1
        self.epoch_ends, self.row_ends = collections.deque(), collections.deque()  # (epoch, step) each
        self.values: list[list[float]] = []
        self.row_base = start
        self.diverged_names: tuple[str, ...] = ()
        self.t: float | None = None  # the last read, or the dispatch that found the device idle

    def clock(self) -> None:
        """The loop is about to dispatch: with nothing in flight the device was idle (a
        validation, an event), so the time the next read covers starts now."""
        if not self.pending:
            self.t = time.perf_counter()

    def read(self, wait: bool) -> bool:
        """Read finished steps; True on a non-finite loss.

        ``wait=False``: read the oldest ``read_every`` steps if they have finished
        (or, if the device is ``max_pending`` steps behind, wait for them): the host
        never blocks mid-epoch. ``wait=True``: read every pending step, processing each finished
        stretch while the device computes the rest, polling (a blocking read would keep busy a CPU
        core the computation needs) with sleeps of a tenth of the wait so far, 0.2 to 5 ms: a long
        wait (a large model's queued steps) wakes the host rarely."""
        if not wait:
            if not (_is_ready(self.pending[self.read_every - 1]) or len(self.pending) >= self.max_pending):
                return False
            return self._process(self.read_every)
        start = time.perf_counter()
        while self.pending:
            pending, done = self.pending, 0
            while done < len(pending) and _is_ready(pending[done]):
                done += 1
            if done == 0:
                time.sleep(min(max((time.perf_counter() - start) / 10, 0.0002), 0.005))
            elif self._process(done):
                return True
        return False

    def _process(self, n: int) -> bool:
        """Fetch the oldest ``n`` pending entries; emit them as a stretch; close the rows they
        end. True on a non-finite loss (the steps before it are still emitted)."""
        ready = self.pending[:n]
        del self.pending[:n]  # in place: the dispatcher appends to this same list
        values = step_scalars(ready, self.accum).tolist()
        now = time.perf_counter()
        since, self.t = self.t, now
        check, manual, names = self.check, self.manual, self.names()
        first, rows, epochs, closed, diverged = self.first_unread, [], [], [], False
        ends, live_epoch = self.epoch_ends, self.run.run_state.state.epoch  # past every ended epoch: the live one
        for row in values:
            s = self.first_unread
            while ends and ends[0][1] < s:
                ends.popleft()
            epoch = ends[0][0] if ends else live_epoch
            if check and not (all(map(math.isfinite, row)) if manual else math.isfinite(row[0])):
                self.record.diverged_at = (s, epoch)
                self.diverged_names = tuple(n for n, v in zip(names, row) if not math.isfinite(v))
                diverged = True
                break
            self.first_unread += 1
            self.values.append(row)
            rows.append(row)
            epochs.append(epoch)
            if self.row_ends and s == self.row_ends[0][1]:
                closed.append(self.close_row())
        if rows:
            stretch = StepStretch(first, names, rows, epochs, self.logged_sched, read_at=now, since=since,
                                  fetched=len(values))
            emit("jaxnitro_steps_read", run=self.run, stretch=stretch)
        for row in closed:
            self.row_closed(row)
        return diverged

    def train_columns(self) -> dict:
        """The open row's train columns from its read step scalars: ``train_loss`` (the mean
        loss); with ``train_step``, ``train_<name>`` for every scalar it returned."""
        values, names = self.values, self.names()
        if not self.manual:
            return {"train_loss": float(np.mean([v[0] for v in values])) if values else float("nan")}
        means = np.mean(np.asarray(values, np.float64), axis=0) if values else [float("nan")] * len(names)
        return {f"train_{n}": float(m) for n, m in zip(names, means)}

    def close_row(self) -> dict:
        """Append and return the oldest row to close, all of whose steps have been read."""
        epoch, last = self.row_ends.popleft()
        row = {"epoch": epoch, "step": last, **self.train_columns()}
        self.record.rows.append(row)
        self.closed, self.values, self.row_base = (self.values, self.row_base), [], last  # closed: for a reopen
        return row

    def resume_row(self, open_row: list, step: int) -> None:
        """A run resumed at ``step``: its checkpoint's open row (the read scalars of its steps so
        far, :attr:`jaxnitro.run_state.SavedRun.open_row`) is this run's open row."""
        self.values, self.row_base = [list(map(float, v)) for v in open_row], step - len(open_row)

    def open_row_at(self, step: int) -> list | None:
        """The open row's read scalars of its steps up to ``step``; None when not all are read."""
        n = step - self.row_base
        return self.values[:n] if 0 <= n <= len(self.values) else None

    def row_open_at(self, step: int) -> bool:
        """Whether the open row has steps and ends at ``step`` (all of them read)."""
        return bool(self.values) and self.row_base + len(self.values) == step

    def reopen(self) -> None:
        """The row just closed is taken back out of the rows and is the open row again."""
        self.record.rows.pop()
        self.values, self.row_base = self.closed

    def row_closed(self, row: dict) -> None:
        """``jaxnitro_row_closed`` for a row just closed (its steps emitted), then
        ``jaxnitro_epoch_end`` for a row without validation (a validated row gets it from the
        loop, once its metrics are in the row)."""
        emit("jaxnitro_row_closed", run=self.run, row=row)
        if not self.validated:
            emit("jaxnitro_epoch_end", run=self.run, row=row)


def _is_ready(entry) -> bool:
    """Whether a ``pending`` entry has been computed (a step's tuple: its last micro-batch's,
    which the train step computes after the others)."""
    return (entry[-1] if isinstance(entry, tuple) else entry).is_ready()


def step_scalars(entries: list, accum: int) -> np.ndarray:
    """``[steps, n]`` float32: each optimizer step's scalars, averaged over its micro-batches
    on the host, from ``pending`` entries (a step's ``[n]`` vector, a step's tuple of
    ``accum`` ``[n]`` vectors, or a block's ``[k, accum, n]``).

    The average is ``(a_1 + ... + a_accum) * float32(1 / accum)`` in float32, the same
    arithmetic whichever programs computed the micro-batches, so that ``steps_per_dispatch``
    never changes a logged value (inside one loop body XLA rounded a device-side average
    differently from separate programs: one ulp, on some models)."""
    if accum == 1 and all(not isinstance(e, tuple) and e.ndim == 1 for e in entries):
        return np.stack([np.asarray(e) for e in entries])  # one step a dispatch: ~10x cheaper than device_get
    parts = []
    for e in entries:
        a = np.stack([np.asarray(x) for x in e]) if isinstance(e, tuple) else np.asarray(e)
        parts.append(a.reshape((-1, accum, a.shape[-1])))
    micro = np.concatenate(parts)
    total = micro[:, 0]
    for i in range(1, accum):
        total = total + micro[:, i]
    return total * np.float32(1.0 / accum) if accum > 1 else total
