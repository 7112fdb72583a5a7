"""The step dispatcher: optimizer steps from a batch reader into the compiled train programs,
with their per-step inputs (:class:`StepValues`: hyperparameters, Device values, the scale).

One path for every ``steps_per_dispatch``: a *segment* of steps (from the event book: it
ends where something is due) is dispatched as blocks of ``k`` steps (the ``train_block``
program, one ``lax.scan``) while at least ``k`` steps remain, and as single steps
(``accum - 1`` accumulate programs and one train-step program) for the rest. With
``k = 1`` every step is a single step. Each dispatch appends its device-resident scalars
to ``pending``; the host never waits on the device here.

Readers hand out what a dispatch consumes: :class:`StreamReader` over a split's epoch
stream (blocks stacked on the host), :class:`ColumnReader` over a column source's rows
(blocks gathered inside the program, see :mod:`jaxnitro.blocks`). Both start at any batch
of an epoch, which is what a mid-epoch resume needs.
"""

from __future__ import annotations

import collections
import enum
import functools
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np

from .schedules import BLOCK, ScheduleLog, ScheduleStream

__all__ = ["AutoProbe", "DISPATCH_BOUND", "Outcome", "Dispatcher", "StepValues", "StreamReader", "ColumnReader"]


DISPATCH_BOUND = 0.1
"""``steps_per_dispatch="auto"``: the longest one dispatch may take, in seconds (Ctrl-C,
SIGTERM and the progress bar are seen between dispatches)."""
MAX_AUTO_K = 64
"""The most steps ``"auto"`` puts in one dispatch."""


class AutoProbe:
    """Measures a run's step time at ``k = 1`` and chooses ``steps_per_dispatch`` for ``"auto"``.

    Two marks after the run's first step: ``first`` (the compile is over by then) and
    ``last``; at each the loop drains the device, and the wall time between them over the
    steps between is the time of one step, dispatch and compute together. ``k`` is chosen by
    :func:`choose_k` from that time and ``period``, the run's recurring segment length (the
    event book's :meth:`~jaxnitro.book.EventBook.period`).
    """

    WARMUP, SPAN = 8, 32

    def __init__(self, start: int, period: int | None = None):
        self.first, self.last = start + self.WARMUP, start + self.WARMUP + self.SPAN
        self.period = period
        self.t_first, self.seconds = None, float("nan")

    def next_mark(self, step: int) -> int:
        """The next mark after ``step`` (a cut for the loop)."""
        return self.first if step < self.first else self.last

    def due(self, step: int) -> bool:
        return step in (self.first, self.last)

    def mark(self, step: int, now: float | None = None) -> int | None:
        """Note the time at a mark (the device drained); at the last, return the chosen ``k``."""
        now = time.perf_counter() if now is None else now
        if step == self.first:
            self.t_first = now
            return None
        self.seconds = (now - self.t_first) / self.SPAN
        return choose_k(self.seconds, self.period)


def choose_k(step_seconds: float, period: int | None = None) -> int:
    """The ``k`` for a measured step time (see :class:`AutoProbe`).

    The largest power of two with ``k`` steps in at most :data:`DISPATCH_BOUND` seconds, at
    most :data:`MAX_AUTO_K`; below 4 a block program is not worth its compile, and ``k`` is 1.
    With ``period`` (the steps between the run's recurring cuts: an epoch, a validation, a
    checkpoint), the largest divisor of it between half that power of two and the most steps
    the bound allows wins instead: every segment is then whole blocks, with no remainder
    dispatched one step at a time (550 steps an epoch: 55 rather than 64, whose 38 leftover
    steps ran one dispatch each). Either way the results are bitwise those of ``k = 1``.
    """
    k = 1
    while k * 2 <= MAX_AUTO_K and k * 2 * step_seconds <= DISPATCH_BOUND:
        k *= 2
    if k < 4:
        return 1
    if period:
        fits = MAX_AUTO_K if step_seconds <= 0 else min(MAX_AUTO_K, int(DISPATCH_BOUND / step_seconds))
        for d in range(fits, max(k // 2, 4) - 1, -1):
            if period % d == 0:
                return d
    return k


class Outcome(enum.Enum):
    """How a segment's dispatch (or an event after it) ended."""

    COMPLETE = "complete"
    STOPPED = "stopped"  # Ctrl-C / SIGTERM / max_time, honoured between dispatches
    DIVERGED = "diverged"  # a read found a non-finite loss
    EXHAUSTED = "exhausted"  # a stream without len() ended: its epoch is over
    EARLY = "early"  # a plugin asked the run to stop (early stopping)


class ShortBlock(Exception):
    """A stream ended inside a block; the reader holds its batches for single steps."""


class StreamReader:
    """Batches of one epoch stream: ``one()`` a micro-batch, ``block()`` ``k * accum`` of them
    stacked on the host as ``{field: [k, accum, batch, ...]}`` (then ``put_block``).

    ``put_one`` (a sharded run: place the batch on the mesh) and ``extra`` (entries every
    single batch gets, e.g. the base key of a keyed ``k > 1`` run) apply to single batches
    of a ``k > 1`` run; a ``k = 1`` run's stream is already staged by its transfer.
    ``StopIteration`` from the stream propagates (a stream without ``len()`` ended).
    """

    def __init__(self, stream, k: int, accum: int, put_block=None, put_one=None, extra=None):
        self.stream, self.size, self.k, self.accum = stream, k * accum, k, accum
        self.put_block, self.put_one, self.extra = put_block, put_one, extra or {}
        self.held: collections.deque = collections.deque()  # a short block's batches, taken singly
        self.short = False  # the stream ended inside a block: the rest runs as single steps
        self.one = stream.__next__ if k == 1 and put_one is None and not self.extra else self._one

    def _one(self) -> dict:
        batch = self.held.popleft() if self.held else next(self.stream)
        if self.put_one is not None:
            batch = self.put_one(batch)
        return {**batch, **self.extra} if self.extra else batch

    def block(self) -> dict:
        group = list(itertools.islice(self.stream, self.size))
        if len(group) < self.size:  # a stream ended: its last batches are taken one step at a time
            self.held.extend(group)
            self.short = True
            raise ShortBlock
        shape = (self.k, self.accum)
        block = {f: np.stack([b[f] for b in group]).reshape(shape + group[0][f].shape) for f in group[0]}
        return block if self.put_block is None else self.put_block(block)

    def drain(self) -> None:
        """At the epoch's end: read the stream to its end, so that a source yielding more
        batches than its ``len()`` is refused (the stream raises), as a loop over it would."""
        next(self.stream, None)

    def close(self) -> None:
        self.stream.close()


class ColumnReader:
    """Blocks and single batches of one epoch of a column source, by row numbers
    (:class:`~jaxnitro.blocks.ColumnBlocks`), from batch ``index`` on; micro-batch numbers
    (``key``) count from ``count``."""

    short = False  # a column source has a len(): its blocks never run past the epoch

    def __init__(self, columns, epoch: int, index: int, count: int, extra=None):
        self.columns, self.epoch, self.index, self.count = columns, epoch, index, count
        self.size, self.extra = columns.k * columns.accum, extra or {}

    def block(self) -> dict:
        block = self.columns.block(self.epoch, self.index, self.count)
        self.index += self.size
        self.count += self.size
        return block

    def one(self) -> dict:
        batch = self.columns.batch(self.epoch, self.index, self.count)
        self.index += 1
        self.count += 1
        return {**batch, **self.extra} if self.extra else batch

    def drain(self) -> None:
        pass

    def close(self) -> None:
        pass


class Dispatcher:
    """Dispatches segments of optimizer steps through the train programs.

    In: the one-step program (``step_fn``), the accumulate program (``accum`` > 1), the
    block program and its per-run inputs (``k`` > 1) and the run's per-step inputs (``scheds``,
    a :class:`StepValues`). :meth:`run` takes the flat state leaves and returns the new ones;
    it never blocks on the device.
    """

    def __init__(self, *, k, accum, step_fn, accumulate, block_fn, scheds, extra=None, columns=None):
        self.k, self.accum = k, accum
        self.step_fn, self.accumulate, self.block_fn = step_fn, accumulate, block_fn
        self.scheds = scheds
        self.extra, self.columns = extra or {}, columns or {}
        self.wait = 0.0  # seconds spent waiting for batches

    def use_blocks(self, k: int, block_fn) -> None:
        """From now on dispatch ``k`` steps at a time through ``block_fn`` (``"auto"`` chose ``k``)."""
        self.k, self.block_fn = k, block_fn

    annotate = None
    """None, or ``step -> context manager`` (set by the loop per segment while a plugin
    profiles, :attr:`jaxnitro.RunContext.step_annotation`): each dispatch of :meth:`run` (a
    block of ``k`` steps, or one step with its accumulate programs) runs inside
    ``annotate(its first step)``. Unset, :meth:`run` costs one attribute check a segment."""

    def run(self, reader, leaves, step: int, cut: int, stop, pending: list, read_every: int, read):
        """Dispatch steps ``step + 1 .. cut`` from ``reader``: ``(leaves, step reached, Outcome)``.

        Stops early, after the dispatch in flight, when ``stop.seen(step)`` (a stop requested;
        for a multi-process job, agreed by every process)
        (``STOPPED``), when ``read(False)`` (called once ``read_every`` entries are
        pending) reports a non-finite loss (``DIVERGED``), or when the reader's stream ends
        (``EXHAUSTED``; a partly read step is dropped).
        """
        if self.annotate is not None:
            return self._run_annotated(reader, leaves, step, cut, stop, pending, read_every, read)
        p, s, o = leaves
        k, accum, scheds = self.k, self.accum, self.scheds
        scale = scheds.scale
        step_fn, accumulate, clock = self.step_fn, self.accumulate, time.perf_counter
        outcome = Outcome.COMPLETE
        try:
            while step < cut:
                if k > 1 and cut - step >= k and not reader.short:
                    t0 = clock()
                    try:
                        block = reader.block()
                    except ShortBlock:
                        continue
                    finally:
                        self.wait += clock() - t0
                    p, s, o, aux = self.block_fn(
                        p, s, o, {}, scheds.dev_block(step, k), self.extra, self.columns,
                        block, scale, scheds.hypers_block(step, k),
                    )
                    step += k
                else:
                    acc, micros = None, []
                    for _ in range(accum - 1):
                        t0 = clock()
                        batch = reader.one()
                        self.wait += clock() - t0
                        (acc, aux), s = accumulate(p, s, scheds.dev(step), batch, acc)
                        micros.append(aux)
                    t0 = clock()
                    batch = reader.one()
                    self.wait += clock() - t0
                    p, s, o, aux = step_fn(p, s, o, scheds.dev(step), batch, acc, scale, scheds.hypers(step))
                    if micros:
                        aux = (*micros, aux)
                    step += 1
                pending.append(aux)
                if stop.seen(step):
                    outcome = Outcome.STOPPED
                    break
                if len(pending) >= read_every and read(False):
                    outcome = Outcome.DIVERGED
                    break
        except StopIteration:
            outcome = Outcome.EXHAUSTED
        return (p, s, o), step, outcome

    def _run_annotated(self, reader, leaves, step, cut, stop, pending, read_every, read):
        """:meth:`run`, one dispatch at a time, each inside ``annotate(its first step)``."""
        annotate, self.annotate, outcome = self.annotate, None, Outcome.COMPLETE
        try:
            while step < cut and outcome is Outcome.COMPLETE:
                end = step + (self.k if self.k > 1 and cut - step >= self.k and not reader.short else 1)
                with annotate(step + 1):
                    leaves, step, outcome = self.run(reader, leaves, step, end, stop, pending, read_every, read)
        finally:
            self.annotate = annotate
        return leaves, step, outcome


class StepValues:
    """The per-step inputs of a run: the optimizer hyperparameter vector and scheduled Device fields.

    Built once per ``train()`` for a horizon of ``total`` optimizer steps. Each
    bound schedule's factory is called here, with ``total``, and its first
    stretch is evaluated (see :class:`~jaxnitro.schedules.ScheduleStream`); later stretches are
    evaluated when a step first needs them, so the work before the first step
    does not depend on ``total`` and a run that stops early never evaluates the
    steps it did not take. Steps are counted from 0; a step past the horizon
    gets the last step's values.

    * ``scale``: ``1 / accum``, the weight of each micro-batch's gradient;
    * ``hypers(step)``: one float32 vector (a device constant when no optimizer
      value is scheduled, on every device of a sharded ``plan.dist``); ``hypers_block(step, k)``: ``[k, n]``;
    * ``dev(step)``: ``device_values`` (the handle's dict, held: ``nitro.set_device`` writes
      there) with the scheduled fields replaced; ``dev_block(step, k)``: ``{field: [k, ...]}``;
      ``device``: the scheduled fields' streams by name;
    * ``logged``: ``schedule/<group>/<hyper>`` and ``schedule/<field>`` mapped to a
      :class:`~jaxnitro.schedules.ScheduleLog` for each schedule that varies;
    * ``evaluated``: the schedule step values computed so far, all schedules together.
    """

    def __init__(self, plan, device_values: dict, total: int, accum: int = 1):
        spec, dist = plan.opt_spec, plan.sharded_dist
        self.total = total = max(int(total), 1)
        self.layout = spec.layout
        self.base = spec.base
        self.values = device_values
        place = jax.device_put if dist is None else (lambda x: dist.replicate(jax.device_put(x)))  # once, not per step
        self.scale = place(np.float32(1.0 / accum))
        bindings = plan.bindings
        self.constant = not bindings.opt
        self.logged: dict[str, ScheduleLog] = {}
        self.streams: list[ScheduleStream] = []
        self.slots: list[tuple[int, ScheduleStream, float]] = []  # (column, stream, multiplier)
        if self.constant:
            self.vector = place(self.base)
        else:
            bare = {
                h: self._stream(f, f"opt/{h}") for (g, h), f in bindings.opt.items() if g is None
            }
            for i, (group, hyper) in enumerate(self.layout.slots):
                gspec = next(x for x in spec.groups if x.name == group)
                if (group, hyper) in bindings.opt:
                    stream = self._stream(bindings.opt[(group, hyper)], f"opt/{group}/{hyper}")
                elif hyper in bare:
                    stream = bare[hyper]
                else:
                    continue
                self.slots.append((i, stream, gspec.ratio if hyper == "learning_rate" else 1.0))
                if stream.varies and hyper != "weight_decay":
                    self.logged[f"schedule/{group}/{hyper}"] = ScheduleLog(
                        lambda s, i=i: float(self.hypers(s)[i]), total
                    )
                    if hyper == "learning_rate":
                        self._log_decay(gspec, i, bindings, varying_rate=True)
                elif hyper == "weight_decay" and stream.varies:
                    self._log_decay(gspec, i - 1, bindings, varying_rate=False)
        self.device: dict[str, ScheduleStream] = {}
        self.dtypes: dict[str, np.dtype] = {}
        for name, f in bindings.device.items():
            stream = self.device[name] = self._stream(f, f"device/{name}")
            self.dtypes[name] = np.dtype(device_values[name].dtype)
            if stream.varies:
                self.logged[f"schedule/{name}"] = ScheduleLog(
                    lambda s, name=name: float(self._dev_row(name, s)), total
                )
        # one table per stretch of `block` steps: [block, n] hyperparameters, [block] per field
        self.block = min((s.block for s in self.streams), default=BLOCK)
        self._hyper_tables: dict[int, np.ndarray] = {}
        self._dev_tables: dict[tuple[str, int], np.ndarray] = {}
        self._tiled: dict[int, tuple] = {}  # k -> (the unscheduled Device values, k copies of each)

    def _log_decay(self, gspec, lr_slot: int, bindings, varying_rate: bool) -> None:
        """Log ``schedule/<group>/weight_decay``: the decoupled decay as applied at each step,
        ``learning_rate * weight_decay`` (the fraction of each weight the step removes), which
        varies when either does. A group without decay (0, unscheduled) logs none.

        ``lr_slot`` is the group's learning-rate slot (its decay's is the next one)."""
        name = f"schedule/{gspec.name}/weight_decay"
        wd_scheduled = (gspec.name, "weight_decay") in bindings.opt or (None, "weight_decay") in bindings.opt
        if name in self.logged or (varying_rate and not wd_scheduled and gspec.weight_decay == 0):
            return
        self.logged[name] = ScheduleLog(
            lambda s: float(np.float32(self.hypers(s)[lr_slot]) * np.float32(self.hypers(s)[lr_slot + 1])),
            self.total,
        )

    def _stream(self, factory, name: str) -> ScheduleStream:
        stream = ScheduleStream(factory, self.total, name)
        self.streams.append(stream)
        return stream

    @property
    def evaluated(self) -> int:
        return sum(s.evaluated for s in self.streams)

    def _stretch(self, b: int) -> tuple[int, int]:
        start = b * self.block
        return start, min(start + self.block, self.total)

    def _hyper_table(self, b: int) -> np.ndarray:
        table = self._hyper_tables.get(b)
        if table is None:
            start, stop = self._stretch(b)
            table = np.tile(self.base, (stop - start, 1))
            for i, stream, mult in self.slots:
                values = stream.values(start, stop)
                table[:, i] = values * mult if mult != 1.0 else values
            self._hyper_tables[b] = table
        return table

    def _dev_table(self, name: str, b: int) -> np.ndarray:
        table = self._dev_tables.get((name, b))
        if table is None:
            start, stop = self._stretch(b)
            table = self._dev_tables[(name, b)] = self.device[name].values(start, stop).astype(self.dtypes[name])
        return table

    def _dev_row(self, name: str, step: int):
        b, i = divmod(min(step, self.total - 1), self.block)
        return self._dev_table(name, b)[i]

    def hypers(self, step: int):
        """The hyperparameter vector of ``step``."""
        if self.constant:
            return self.vector
        b, i = divmod(min(step, self.total - 1), self.block)
        table = self._hyper_tables.get(b)
        return (table if table is not None else self._hyper_table(b))[i]

    def hypers_block(self, step: int, k: int):
        """``[k, n]``: the hyperparameter vectors of steps ``step .. step + k - 1``."""
        if self.constant:
            blocks = self.__dict__.setdefault("_blocks", {})
            if k not in blocks:
                blocks[k] = jax.device_put(np.tile(np.asarray(self.vector), (k, 1)))
            return blocks[k]
        b, i = divmod(min(step, self.total - 1), self.block)
        table = self._hyper_table(b)
        if i + k <= len(table):
            return table[i : i + k]
        return np.stack([self.hypers(s) for s in range(step, step + k)])

    def dev_block(self, step: int, k: int) -> dict:
        """Every Device value of steps ``step .. step + k - 1``, ``{name: [k, ...]}``, the fixed
        ones tiled per ``k`` (again after a ``set_device``): a per-step (scanned) input, as XLA may
        hoist a loop-invariant one out of the loop and round differently from the one-step program."""
        fixed, cached = {n: v for n, v in self.values.items() if n not in self.device}, self._tiled.get(k)
        if cached is None or any(cached[0].get(n) is not v for n, v in fixed.items()):
            cached = self._tiled[k] = (fixed, _tiled(fixed, k))
        tiled = cached[1]
        if not self.device:
            return tiled
        out = dict(tiled)
        for name in self.device:
            b, i = divmod(min(step, self.total - 1), self.block)
            table = self._dev_table(name, b)
            if i + k <= len(table):
                out[name] = table[i : i + k]
            else:
                out[name] = np.asarray([self._dev_row(name, s) for s in range(step, step + k)], self.dtypes[name])
        return out

    def dev(self, step: int) -> dict:
        """The Device values of ``step``: the run's, each scheduled field replaced by its value there."""
        if not self.device:
            return self.values
        out = dict(self.values)
        for name in self.device:
            out[name] = self._dev_row(name, step)
        return out


@functools.partial(jax.jit, static_argnums=1)
def _tiled(values: dict, k: int) -> dict:
    """Each value with a leading axis of ``k`` copies (compiled: also for arrays spanning the
    processes of a multi-process job, which eager operations refuse)."""
    return {n: jnp.broadcast_to(v, (k,) + v.shape) for n, v in values.items()}
