"""The automatic training loop behind ``Nitro.train``.

Per optimizer step the host does: take the next staged batch, dispatch
``accum - 1`` accumulate programs and one train-step program, and append the
step's device-resident scalar vector (loss and ``train_metrics``) to a list.
A stretch of ``READ_EVERY`` steps is read once it has finished computing; only
then are its train lines logged, divergence checked and progress advanced. The
host never waits on the device inside an epoch, and a train-only run not even
between epochs, so dispatch runs ahead of compute as in a hand-written
``jax.jit`` loop.
"""

from __future__ import annotations

import datetime
import enum
import functools
import itertools
import math
import os
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import structlog

from .batches import batch_width, unwrap
from .blocks import ColumnBlocks
from .evaluation import _device_fields, evaluate_split, make_transfer, stages_on_device
from .events import RunContext, StepStretch, emit, emit_finish, run_scoped
from .interrupts import Terminated, deferring, immediate, stop_signals
from .interrupts import consume as consume_stop
from .interrupts import request as stop_request
from .logger import LoggerRelay, make_loggers
from .prefetch import is_addressable
from .prefetch.contract import accessors
from .progress import phase_start
from .routing import KEY_COUNT, KEY_DATA
from .schedules import StepValues
from .sources import release_sources

__all__ = ["run_training", "new_run_folder", "READ_EVERY"]

log = structlog.get_logger("jaxnitro")

READ_EVERY = 32
"""Optimizer steps between host reads of the per-step scalars (a divergence is seen within this)."""
MAX_PENDING = 4 * READ_EVERY
"""Unread steps after which the host reads even if the device is behind (bounds memory and the
divergence check's delay)."""
CPU_SHARDED_IN_FLIGHT = 16
"""The most optimizer steps queued ahead of the host in a run sharded over several CPU devices."""


def new_run_folder(root: str) -> str:
    """Create and return a fresh ``root/<timestamp>-<n>`` folder; never reuses an existing one.

    Raises ``OSError`` (its own subclass) naming the folder, the cause and the fix when
    ``root`` is a file or cannot be written.
    """
    root = os.path.abspath(root)
    try:
        return _new_folder(root)
    except OSError as err:
        cause = "it is a file, not a folder" if os.path.isfile(root) else (err.strerror or repr(err))
        raise type(err)(
            f"jaxnitro: cannot create a run folder under run_dir={root!r}: {cause}. Pass a "
            f"writable folder as `run_dir` (it is created if missing)."
        ) from err


def _new_folder(root: str) -> str:
    os.makedirs(root, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    n = 1
    while True:
        path = os.path.join(root, f"{stamp}-{n}")
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            n += 1


def run_training(nitro) -> None:
    """Run ``nitro``'s training; see :meth:`jaxnitro.Nitro.train`.

    Emits the lifecycle events (run start, stretches read, epochs trained,
    splits evaluated, epoch ends, run finish) that loggers, progress, early
    stopping and other plugins subscribe to. ``jaxnitro_run_finish`` is called
    with the run's status whatever happens: ``"done"``, ``"diverged"``,
    ``"interrupted"`` (Ctrl-C) or ``"failed"`` (an exception, which
    propagates); a plugin failing to finish a run that already failed is
    reported as a warning, so it never hides the original exception.

    Ctrl-C and SIGTERM stop the loop after the optimizer step in flight: the
    steps already computed are read and logged, the state is published, the
    run finishes as ``"interrupted"`` / ``"terminated"``, and then
    ``KeyboardInterrupt`` / :class:`jaxnitro.Terminated` propagates. Whatever
    fails, the handle keeps a final status.
    """
    record = nitro.record
    status = None  # set by the run itself, or from the exception that ended it
    with stop_signals():
        try:
            record.status = "running"
            record.run_dir = run_folder_of(nitro)
            run = RunContext(nitro, record.run_dir)
            dist = nitro.plan.dist
            logger = nitro.settings.logger if dist is None or dist.is_main else None  # process 0 logs
            record.loggers = run.loggers = make_loggers(logger, record.run_dir, nitro.experiment)
            with run_scoped([LoggerRelay(logger, run) for logger in run.loggers]):
                try:
                    emit("jaxnitro_run_start", run=run)
                    status = _Run(nitro, run).run()
                except BaseException as exc:
                    status = _status_of(exc)
                    raise
                finally:
                    record.status = status
                    emit_finish(run, status)
        except BaseException as exc:
            status = status or _status_of(exc)  # also a Ctrl-C before the run's own try
            if isinstance(exc, (KeyboardInterrupt, Terminated)):
                consume_stop()
            raise
        finally:
            record.status = status
            release_sources(nitro.data)  # once per run end; a released source reopens when read again


def run_folder_of(nitro) -> str:
    """The run's folder: with ``resume=`` from a checkpoint its run can continue from, that
    run's folder (its metrics.jsonl and checkpoints go on); otherwise a new one."""
    resumed = nitro.plan.resumed
    if resumed is not None and resumed.continue_folder and resumed.run_folder and os.path.isdir(resumed.run_folder):
        return resumed.run_folder
    dist = nitro.plan.dist
    if dist is not None and dist.multi_process:  # one folder for the job: process 0 makes it
        return dist.from_main(new_run_folder(nitro.settings.run_dir) if dist.is_main else None)
    return new_run_folder(nitro.settings.run_dir)


def _status_of(exc: BaseException) -> str:
    """The status of a run that ``exc`` ended."""
    if isinstance(exc, Terminated):
        return "terminated"
    return "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"


TRAIN_HOOKS = ("forward", "loss", "train_metrics", "train_step")
"""The traced hooks of the train-step programs: their fields are transferred for training."""


class Outcome(enum.Enum):
    """How an epoch's dispatch ended."""

    COMPLETE = "complete"
    STOPPED = "stopped"  # Ctrl-C / SIGTERM, honoured between optimizer steps
    DIVERGED = "diverged"  # a read found a non-finite loss


class _Run:
    """One ``train()``: the epoch loop, the per-step dispatch and the deferred reads.

    Per-step scalars stay on the device in ``pending`` until read, oldest first: per
    optimizer step one float32 vector, or with ``accum`` > 1 a tuple of one per
    micro-batch; per ``train_block`` dispatch one ``[k, accum, n]`` array (see
    :func:`step_scalars`). An epoch's history row is
    appended when its last step has been read: at once when the epoch is
    validated (validation needs the epoch's final parameters anyway) or is the
    last, otherwise during the next epoch, so a train-only run never makes the
    device wait at an epoch boundary.
    """

    def __init__(self, nitro, run: RunContext):
        self.nitro, self.run_ctx = nitro, run
        phase_start(run, nitro.epoch + 1, "train", "preparing")  # schedules, programs, streams
        train = nitro.data["train"]
        self.train = train
        self.accum = nitro.settings.accum
        self.steps_per_epoch = len(train) // self.accum
        self.scheds = StepValues(nitro, max(nitro.settings.max_epochs * self.steps_per_epoch, 1))
        progs = nitro.plan.programs
        self.accumulate = progs.accumulate().jitted if self.accum > 1 else None
        o_def = jax.tree_util.tree_structure(nitro.opt_state)
        self.step_prog = progs.train_step(nitro.plan.opt_spec, nitro.plan.tx, o_def)
        self.scale = jax.device_put(np.float32(1.0 / self.accum))
        dist = nitro.plan.dist if nitro.plan.dist is not None and nitro.plan.dist.sharded else None
        self.dist = dist  # n_devs > 1 or several processes: the data mesh (batches sharded on it)
        if dist is not None:
            self.scale = dist.replicate(self.scale)
            if self.scheds.constant:  # the one hyperparameter vector: on every device once, not per step
                self.scheds.vector = dist.replicate(self.scheds.vector)
        # several processes: every epoch's end is read before the next epoch starts, so that what
        # the epoch's end does across processes (checkpoint barriers) happens at the same point
        self.lockstep = dist is not None and dist.multi_process
        # steps_per_dispatch: k optimizer steps per dispatch (one lax.scan program); batches
        # then stay on the host until a block of k * accum is stacked and sent at once
        self.k = nitro.settings.steps_per_dispatch
        self.read_every, self.max_pending = READ_EVERY, MAX_PENDING  # in pending entries
        self.block_prog, self.extra = None, {}
        hooks = TRAIN_HOOKS
        keyed = any(nitro.plan.routes[h].wants_key for h in hooks if h in nitro.plan.routes)
        self.columns = None  # k > 1 on a column source: blocks gathered on the device
        if self.k > 1:
            self.block_prog = progs.train_block(nitro.plan.opt_spec, nitro.plan.tx, o_def)
            self.read_every = max(1, READ_EVERY // self.k)
            self.max_pending = max(2, MAX_PENDING // self.k)
            fields = _device_fields(nitro, hooks)
            transfer = lambda batch: {f: batch[f] for f in fields if f in batch}  # noqa: E731
            if keyed:
                self.extra = {KEY_DATA: nitro.state.rng}
            self.columns = ColumnBlocks.of(unwrap(train), fields, self.k, self.accum, keyed, dist is not None)
        else:
            transfer = make_transfer(nitro, hooks)
        if not isinstance(unwrap(train), (list, tuple)):  # setup read every batch of a list only
            transfer = _width_checked(transfer, nitro.plan.width)
        if keyed:
            counter = itertools.count(nitro.step * self.accum)
            transfer = _keyed(transfer, nitro.state.rng, counter) if self.k == 1 else _counted(transfer, counter)
        self.transfer = transfer
        if dist is not None and jax.default_backend() == "cpu":
            # XLA's CPU collectives (several host devices) abort the process when one device's
            # thread misses an all-reduce rendezvous for 40 s, which happens when many sharded
            # steps are queued on 2 cores (measured on the tutorial's MLP at batch 400 on 4
            # devices: 64 steps in flight aborts, 32 completes): keep at most 16 in flight
            self.read_every = min(self.read_every, max(1, CPU_SHARDED_IN_FLIGHT // (2 * self.k)))
            self.max_pending = min(self.max_pending, max(2, CPU_SHARDED_IN_FLIGHT // self.k))
        self.logged_sched = self.scheds.logged if nitro.settings.autolog_schedules else {}
        self.pending: list = []
        self.first_unread = nitro.step + 1  # the step number of pending[0]
        self.epoch_ends: list[tuple[int, int]] = []  # (epoch, its last step), rows not yet appended
        self.epoch_first_step: dict[int, int] = {}  # epoch -> its first step (to re-read a batch)
        self.epoch_values: list[list[float]] = []  # read step scalars of the oldest epoch without a row

    # -- the loop ------------------------------------------------------------------------

    def run(self) -> str:
        """The epochs; returns the status. Signals are deferred except while validating
        (nothing is in flight then): a stop is honoured between optimizer steps and at the
        phase boundaries, by :meth:`stop`."""
        with deferring() as stop:
            return self._epochs(stop)

    def _epochs(self, stop) -> str:
        nitro = self.nitro
        validate = "val" in nitro.data
        last = nitro.settings.max_epochs
        for epoch in range(nitro.epoch + 1, last + 1):
            nitro.state = nitro.state.replace(epoch=epoch)
            prog = self.block_prog or self.step_prog
            phase_start(self.run_ctx, epoch, "train", "compiling train step" if prog.traces == 0 else None)
            outcome = self.train_epoch(epoch, stop) if self.k == 1 else self.train_epoch_blocks(epoch, stop)
            if outcome is Outcome.STOPPED or stop.status is not None:
                self.stop()
            if outcome is Outcome.DIVERGED or ((validate or epoch == last or self.lockstep) and self.read(wait=True)):
                return self.diverged()
            if stop.status is not None:
                self.stop()
            if validate:
                with immediate():
                    self.validate(epoch)
                emit("jaxnitro_epoch_end", run=self.run_ctx, row=nitro.rows[-1])
            if stop.status is not None:
                self.stop()
            if self.run_ctx.stop_reason is not None:
                nitro.record.stop_reason = self.run_ctx.stop_reason
                return "done"
        return "done"

    def stop(self) -> None:
        """A stop was requested: read and emit every step already computed, then raise."""
        if self.read(wait=True):
            self.diverged()
        self.nitro.record.stop_reason = f"{stop_request.status} at step {self.nitro.step}"
        raise stop_request.exception()

    def train_epoch(self, epoch: int, stop) -> "Outcome":
        """Dispatch one epoch's steps (fewer when ``stop`` is requested or a read diverges).

        Signals are deferred (see :meth:`run`): a Ctrl-C is honoured after the optimizer
        step in flight, never inside a call that donated its buffers. The leaves of the
        last completed step are published whatever happens.
        """
        nitro, scheds, accumulate = self.nitro, self.scheds, self.accumulate
        step_fn, scale, dev = self.step_prog.jitted, self.scale, nitro.device_values
        params, mstate, opt_state = nitro.state.leaves()
        acc, micro, step, micros = None, 0, nitro.step, []
        self.epoch_first_step[epoch] = step + 1
        wait, outcome = 0.0, Outcome.COMPLETE
        t_epoch = t0 = time.perf_counter()
        stream = self.train.epoch(epoch, self.transfer)
        try:
            for batch in stream:
                wait += time.perf_counter() - t0
                if micro < self.accum - 1:
                    (acc, aux), mstate = accumulate(params, mstate, scheds.dev(dev, step), batch, acc)
                    micros.append(aux)
                    micro += 1
                else:
                    params, mstate, opt_state, aux = step_fn(
                        params, mstate, opt_state, scheds.dev(dev, step), batch, acc, scale, scheds.hypers(step)
                    )
                    acc, micro = None, 0
                    step += 1
                    self.pending.append((*micros, aux) if micros else aux)
                    micros = []
                    if stop.status is not None:
                        outcome = Outcome.STOPPED
                        break
                    if len(self.pending) >= READ_EVERY and self.read(wait=False):
                        outcome = Outcome.DIVERGED
                        break
                t0 = time.perf_counter()
        finally:
            stream.close()
            self.publish(params, mstate, opt_state, step)
        return self._end_epoch(epoch, step, outcome, wait, t_epoch)

    def _end_epoch(self, epoch: int, step: int, outcome: "Outcome", wait: float, t_epoch: float) -> "Outcome":
        if outcome is Outcome.STOPPED:
            return outcome  # no row for a partial epoch; its steps are still read and logged
        self.epoch_ends.append((epoch, step))
        if self.first_unread > step:  # its last step was already read during the epoch
            self._emit_unvalidated_end(self._close_epoch())
        elapsed = time.perf_counter() - t_epoch
        stats = {"data_wait_frac": wait / elapsed if elapsed else 0.0}
        emit("jaxnitro_epoch_trained", run=self.run_ctx, epoch=epoch, step=step, stats=stats)
        return outcome

    def train_epoch_blocks(self, epoch: int, stop) -> "Outcome":
        """:meth:`train_epoch` for ``steps_per_dispatch`` = k > 1: each dispatch runs k
        optimizer steps (the ``train_block`` program) on k * accum batches stacked on the
        host, and appends their ``[k, n]`` scalars to ``pending``. The last
        ``steps_per_epoch % k`` steps run with the one-step programs. A stop is honoured
        between dispatches."""
        nitro, scheds, accumulate, k = self.nitro, self.scheds, self.accumulate, self.k
        step_fn, block_fn, scale = self.step_prog.jitted, self.block_prog.jitted, self.scale
        dev = nitro.device_values
        # every Device value enters the block per step, as a scanned input like the scheduled
        # ones: a value closed over by the loop is loop-invariant to XLA, which may then
        # reassociate arithmetic with it (hoisting it out of the loop) and round differently
        # from the one-step program; a per-step input keeps the step's arithmetic as it is
        tiled = _tiled({n: v for n, v in dev.items() if n not in scheds.device}, k)
        extra, accum = self.extra, self.accum
        put = jax.device_put if stages_on_device() else None
        one = None  # the remainder's single batches: numpy, or sharded on the mesh
        if self.dist is not None:  # a block's batch dimension is its third: [k, accum, batch, ...]
            put, one = (lambda b: self.dist.put_batch(b, axis=2)), self.dist.put_batch
        params, mstate, opt_state = nitro.state.leaves()
        step = nitro.step
        self.epoch_first_step[epoch] = step + 1
        wait, outcome = 0.0, Outcome.COMPLETE
        t_epoch = time.perf_counter()
        columns = self.columns.device if self.columns is not None else {}
        if self.columns is not None:  # row numbers; gathered in the program; no host stream
            stream, group = None, []
            blocks = self._device_blocks(epoch, step, group)
        else:
            stream, group = self.train.epoch(epoch, self.transfer), []
            blocks = self._host_blocks(stream, put, group)
        try:
            while outcome is Outcome.COMPLETE:
                t0 = time.perf_counter()
                block = next(blocks, None)
                wait += time.perf_counter() - t0
                if block is None:
                    break
                params, mstate, opt_state, aux = block_fn(
                    params, mstate, opt_state, {}, {**tiled, **scheds.dev_block(step, k)}, extra, columns, block,
                    scale, scheds.hypers_block(step, k),
                )
                step += k
                self.pending.append(aux)
                if stop.status is not None:
                    outcome = Outcome.STOPPED
                elif len(self.pending) >= self.read_every and self.read(wait=False):
                    outcome = Outcome.DIVERGED
            acc, micro, micros = None, 0, []
            for batch in group if outcome is Outcome.COMPLETE else ():  # the remainder, one step a dispatch
                if one is not None:
                    batch = one(batch)
                if extra:
                    batch = {**batch, **extra}
                if micro < accum - 1:
                    (acc, aux), mstate = accumulate(params, mstate, scheds.dev(dev, step), batch, acc)
                    micros.append(aux)
                    micro += 1
                    continue
                params, mstate, opt_state, aux = step_fn(
                    params, mstate, opt_state, scheds.dev(dev, step), batch, acc, scale, scheds.hypers(step)
                )
                acc, micro = None, 0
                step += 1
                self.pending.append((*micros, aux) if micros else aux)
                micros = []
                if stop.status is not None:
                    outcome = Outcome.STOPPED
                    break
                if len(self.pending) >= self.read_every and self.read(wait=False):
                    outcome = Outcome.DIVERGED
                    break
        finally:
            if stream is not None:
                stream.close()
            self.publish(params, mstate, opt_state, step)
        return self._end_epoch(epoch, step, outcome, wait, t_epoch)

    def _host_blocks(self, stream, put, remainder: list):
        """Blocks of ``k * accum`` batches read from ``stream`` and stacked on the host
        (``{field: [k, accum, batch, ...]}``, then ``put``); a last short group of batches is
        left in ``remainder`` for the one-step programs."""
        k, accum = self.k, self.accum
        while True:
            group = list(itertools.islice(stream, k * accum))
            if len(group) < k * accum:
                remainder.extend(group)
                return
            block = {f: np.stack([b[f] for b in group]).reshape((k, accum) + group[0][f].shape) for f in group[0]}
            yield block if put is None else put(block)

    def _device_blocks(self, epoch: int, step: int, remainder: list):
        """:meth:`_host_blocks` for a column source (:class:`~jaxnitro.blocks.ColumnBlocks`):
        each block gathered on the device from its row numbers; the remainder's batches
        gathered on the host. Micro-batch numbers (``key``) count from ``step * accum``."""
        columns, size = self.columns, self.k * self.accum
        n_blocks = self.steps_per_epoch // self.k
        count = step * self.accum
        for b in range(n_blocks):
            yield columns.block(epoch, b, count + b * size)
        for i in range(n_blocks * size, self.steps_per_epoch * self.accum):
            remainder.append(columns.batch(epoch, i, count + i))

    def publish(self, p, s, o, step: int) -> None:
        """Make the leaves of the last completed optimizer step the handle's state."""
        nitro = self.nitro
        nitro.state = nitro.state.with_leaves(p, s, o, step=step, epoch=nitro.epoch)

    # -- reading per-step scalars -----------------------------------------------------------

    def read(self, wait: bool) -> bool:
        """Read finished steps; True on a non-finite loss.

        ``wait=False``: read the oldest ``READ_EVERY`` steps if they have finished
        (or, if the device is ``MAX_PENDING`` steps behind, wait for them): the host
        never blocks mid-epoch. ``wait=True``: read every pending step, processing
        each finished stretch while the device computes the rest, and polling with
        short sleeps rather than a blocking read, which on a CPU backend would keep
        busy a core the computation needs.
        """
        if not wait:
            if not (_is_ready(self.pending[self.read_every - 1]) or len(self.pending) >= self.max_pending):
                return False
            return self._process(self.read_every)
        while self.pending:
            pending, done = self.pending, 0
            while done < len(pending) and _is_ready(pending[done]):
                done += 1
            if done == 0:
                time.sleep(0.0002)
            elif self._process(done):
                return True
        return False

    def _process(self, n: int) -> bool:
        """Fetch the oldest ``n`` pending vectors; emit them as a stretch; append finished
        epochs' rows. True on a non-finite loss (the steps before it are still emitted)."""
        nitro = self.nitro
        ready, self.pending = self.pending[:n], self.pending[n:]
        values = step_scalars(ready, self.accum).tolist()
        check = nitro.settings.check_divergence
        names = self._aux_names()
        # the automatic step checks its loss; a train_step's every returned scalar
        manual = "train_step" in nitro.plan.hooks
        first, rows, epochs, closed, diverged = self.first_unread, [], [], [], False
        for row in values:
            s = self.first_unread
            epoch = self.epoch_ends[0][0] if self.epoch_ends else nitro.epoch
            if check and not (all(map(math.isfinite, row)) if manual else math.isfinite(row[0])):
                nitro.record.diverged_at = (s, epoch)
                self.diverged_names = tuple(n for n, v in zip(names, row) if not math.isfinite(v))
                diverged = True
                break
            self.first_unread += 1
            self.epoch_values.append(row)
            rows.append(row)
            epochs.append(epoch)
            if self.epoch_ends and s == self.epoch_ends[0][1]:
                closed.append(self._close_epoch())
        if rows:
            stretch = StepStretch(first, names, rows, epochs, self.logged_sched)
            emit("jaxnitro_steps_read", run=self.run_ctx, stretch=stretch)
        for row in closed:
            self._emit_unvalidated_end(row)
        return diverged

    def _aux_names(self) -> tuple[str, ...]:
        """The names of a step's scalars (``loss`` and ``train_metrics``, or what ``train_step``
        returned), known once a train program has been traced."""
        names = self.step_prog.meta.get("aux_names") or (
            self.block_prog.meta.get("aux_names") if self.block_prog else None
        )
        return tuple(names or ("loss",))

    def _train_columns(self) -> dict:
        """The epoch's train columns from the read step scalars: ``train_loss`` (the mean loss);
        with ``train_step``, ``train_<name>`` for every scalar it returned (``loss`` included)."""
        values, names = self.epoch_values, self._aux_names()
        if "train_step" not in self.nitro.plan.hooks:
            return {"train_loss": float(np.mean([v[0] for v in values])) if values else float("nan")}
        means = np.mean(np.asarray(values, np.float64), axis=0) if values else [float("nan")] * len(names)
        return {f"train_{n}": float(m) for n, m in zip(names, means)}

    def _close_epoch(self) -> dict:
        """Append and return the history row of the oldest finished epoch whose steps have all
        been read."""
        epoch, last = self.epoch_ends.pop(0)
        row = {"epoch": epoch, "step": last, **self._train_columns()}
        self.nitro.record.rows.append(row)
        self.epoch_values = []
        return row

    def _emit_unvalidated_end(self, row: dict) -> None:
        """``jaxnitro_epoch_end`` for an epoch without validation (a validated epoch gets it
        from :meth:`run`, once its metrics are in the row)."""
        if "val" not in self.nitro.data:
            emit("jaxnitro_epoch_end", run=self.run_ctx, row=row)

    # -- epoch end ----------------------------------------------------------------------------

    def diverged(self) -> str:
        """Record the divergence (warning, stop reason, a last row); return ``"diverged"``."""
        record = self.nitro.record
        step, epoch = record.diverged_at
        manual = "train_step" in self.nitro.plan.hooks
        what = (
            f"train_step's scalar(s) {', '.join(map(repr, getattr(self, 'diverged_names', ())))}"
            if manual else "the loss"
        )
        record.stop_reason = f"non-finite {'scalar' if manual else 'loss'} at step {step}"
        bad_input = self._nonfinite_input(step, epoch)
        if bad_input is not None:
            record.stop_reason += f" ({bad_input})"
            advice = f"The data is the cause: {bad_input}. Fix the data (drop or impute those rows)."
        else:
            advice = "Lower the learning rate, add gradient_clip_norm, or check the loss for log(0) / overflow."
        warnings.warn(
            f"jaxnitro: {what} became non-finite at step {step} (epoch {epoch}); the run stopped "
            f"with status 'diverged'. {advice}",
            RuntimeWarning,
            stacklevel=5,
        )
        record.rows.append({"epoch": epoch, "step": step, **self._train_columns()})
        return "diverged"

    def _nonfinite_input(self, step: int, epoch: int) -> str | None:
        """After a divergence: which routed float field of step ``step``'s micro-batches holds
        NaN/inf, when the train source can be read again by index (else None). Runs only after
        a divergence, so it costs normal training nothing."""
        source = unwrap(self.train)
        first = self.epoch_first_step.get(epoch)
        if first is None or not is_addressable(source):
            return None
        batch_at, begin_epoch = accessors(source)
        begin_epoch(epoch)
        hooks = TRAIN_HOOKS
        fields = {f for h in hooks if h in self.nitro.plan.routes for f in self.nitro.plan.routes[h].fields}
        for index in range((step - first) * self.accum, (step - first + 1) * self.accum):
            batch = batch_at(index)
            for name in sorted(fields & set(batch)):
                value = np.asarray(batch[name])
                if value.dtype.kind == "f" and not np.isfinite(value).all():
                    bad = int(value.size - np.isfinite(value).sum())
                    return (
                        f"batch {index} of epoch {epoch} of the `train` split has {bad} non-finite "
                        f"value(s) in field `{name}`"
                    )
        return None

    def validate(self, epoch: int) -> None:
        """Validate the epoch, emit the split's metrics and merge them into the epoch's row."""
        nitro = self.nitro
        forward_compiles = nitro.plan.programs.forward().traces == 0
        phase_start(self.run_ctx, epoch, "validate", "compiling forward" if forward_compiles else None)
        metrics = evaluate_split(nitro, "val")
        emit("jaxnitro_split_evaluated", run=self.run_ctx, split="val", metrics=metrics, context="validate")
        nitro.record.rows[-1].update(metrics)
        monitor = nitro.settings.monitor
        if monitor is not None and monitor[0] not in metrics:
            raise KeyError(
                f"jaxnitro: `monitor` names {monitor[0]!r}, but the validation metrics are "
                f"{sorted(metrics)} (what finalize_metrics returned). Return it from "
                f"`finalize_metrics`/`metrics`, or monitor one of those."
            )


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


@functools.partial(jax.jit, static_argnums=1)
def _tiled(values: dict, k: int) -> dict:
    """Each value with a leading axis of ``k`` copies (compiled: also for arrays spanning the
    processes of a multi-process job, which eager operations refuse)."""
    return {n: jnp.broadcast_to(v, (k,) + v.shape) for n, v in values.items()}


def _keyed(transfer, key_data, counter):
    """Wrap ``transfer`` to add the run's base key and the micro-batch number (see ``key``)."""

    def keyed(batch):
        batch = transfer(batch)
        batch[KEY_DATA] = key_data
        batch[KEY_COUNT] = np.uint32(next(counter))
        return batch

    return keyed


def _counted(transfer, counter):
    """:func:`_keyed` for ``steps_per_dispatch`` > 1: the micro-batch number only (a block
    carries the base key once)."""

    def keyed(batch):
        batch = transfer(batch)
        batch[KEY_COUNT] = np.uint32(next(counter))
        return batch

    return keyed


def _width_checked(transfer, width: int):
    """Wrap ``transfer`` to refuse a train batch of another width (a short batch anywhere, a
    partial final one, an empty one) or one that is not a dict of arrays.

    Setup reads every batch of a list; other sources are checked here, as each batch is
    staged: a length per field in the common case (well under a microsecond), the full
    check (:func:`jaxnitro.batches.batch_width`, naming the problem) only when one differs.
    """

    def checked(batch):
        try:
            same = all(len(v) == width for v in batch.values())
        except TypeError:  # a field without len(), or not a dict at all
            same = False
        if not same:
            n = batch_width(batch, "train batch")
            if n != width:
                raise ValueError(
                    f"jaxnitro: the `train` split yielded a batch of {n} rows; its batches have "
                    f"{width}. Every train batch must have that width: the train split must drop its "
                    f"partial final batch, and have no short batch anywhere (it would compile a "
                    f"second train step and weight its rows differently). Fix: build the loader "
                    f"with drop_last=True and equal batch sizes."
                )
        return transfer(batch)

    return checked
