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

import contextlib
import itertools
import os
import time
import warnings

import jax
import numpy as np
import structlog

from .batches import unwrap
from .blocks import ColumnBlocks
from .book import make_book, schedule_horizon
from .dispatch import AutoProbe, ColumnReader, Dispatcher, Outcome, StepValues, StreamReader
from .evaluation import _device_fields, evaluate_split, make_transfer, stages_on_device
from .events import RunContext, run_scoped
from .hookcalls import emit, emit_finish
from .history import check_monitored_in
from .interrupts import JobStop, Preempted, deferring, immediate, stop_signals
from .interrupts import consume as consume_stop
from .interrupts import request as stop_request
from .logger import check_loggers, make_loggers
from .first_step import FirstStep, first_step, preflight
from .plugin_manager import disabled_note, first_result, plugin_manager
from .source_contract import accessors, is_addressable
from .progress import phase_start
from .reads import StepReads, step_scalars
from .routing import KEY_DATA
from .position import TrainPosition
from .sources import release_sources

__all__ = ["run_training", "new_run_folder", "hold_run_folder", "READ_EVERY", "step_scalars"]

log = structlog.get_logger("jaxnitro")

READ_EVERY = 32
"""Optimizer steps between host reads of the per-step scalars (a divergence is seen within this)."""
MAX_PENDING = 4 * READ_EVERY
"""Unread steps after which the host reads even if the device is behind (bounds memory and the
divergence check's delay)."""
CPU_SHARDED_IN_FLIGHT = 16
"""The most optimizer steps queued ahead of the host in a run sharded over several CPU devices."""
AGREE_EVERY = 32
"""A multi-process job: the most optimizer steps between two agreements on a stop (a SIGTERM
to one host is honoured by every process within this, at the same step)."""


def new_run_folder(root: str, experiment=None) -> str:
    """Create and return a fresh run folder under ``root``, named by the
    ``jaxnitro_new_run_folder`` hook (built in: ``root/<timestamp>-<n>``); never an existing one.

    Raises ``OSError`` (its own subclass) naming the folder, the cause and the fix when
    ``root`` is a file or cannot be written, and ``RuntimeError`` when no plugin answers the
    hook or the answer is no folder.
    """
    root = os.path.abspath(root)
    try:
        folder = first_result("jaxnitro_new_run_folder", root=root, experiment=experiment)
    except OSError as err:
        cause = "it is a file, not a folder" if os.path.isfile(root) else (err.strerror or repr(err))
        raise type(err)(
            f"jaxnitro: cannot create a run folder under run_dir={root!r}: {cause}. Pass a "
            f"writable folder as `run_dir` (it is created if missing)."
        ) from err
    if folder is None:
        raise RuntimeError(
            f"jaxnitro: no plugin names the run folder (hook `jaxnitro_new_run_folder`){disabled_note()}. "
            f"Enable the built-in `run_folder` plugin, or install one that answers the hook."
        )
    if not os.path.isdir(folder):
        raise RuntimeError(
            f"jaxnitro: the `jaxnitro_new_run_folder` hook answered {folder!r}, which is no folder. The "
            f"plugin that answers it must create the folder and return its path."
        )
    return os.path.abspath(os.fspath(folder))


def hold_run_folder(folder: str, dist=None):
    """The run's hold on ``folder`` from the ``jaxnitro_hold_run_folder`` hook (built in: the
    ``run_lock`` plugin's lock), taken before anything is written into it; on every process of
    a job. The hook's refusal (``jn.RunFolderInUse``) propagates. With no answer, None and one
    ``RuntimeWarning`` (on process 0): the run trains into the folder unlocked and unguarded.
    Raises ``TypeError`` naming the hook for an answer without ``release``."""
    hold = first_result("jaxnitro_hold_run_folder", folder=folder, dist=dist)
    if hold is None:
        if dist is None or dist.is_main:
            log.warning("run folder unlocked", folder=folder)
            warnings.warn(
                f"jaxnitro: no plugin holds the run folder {folder} (hook `jaxnitro_hold_run_folder`)"
                f"{disabled_note()}, so this run writes it unlocked: another run writing the same "
                f"folder (a second resume=\"auto\" of a run still running) is not refused, and the "
                f"folder deleted mid-run is not noticed. Enable the built-in `run_lock` plugin, or "
                f"install one that answers the hook.",
                RuntimeWarning, stacklevel=4,
            )
        return None
    if not callable(getattr(hold, "release", None)):
        raise TypeError(
            f"jaxnitro: the `jaxnitro_hold_run_folder` hook answered {hold!r}, which has no "
            f"`release(status)` method. The plugin that answers it must return a hold the core can "
            f"release at the run's end (see jaxnitro.plugin.RunFolderHold), or None."
        )
    return hold


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
    run finishes as ``"interrupted"`` / ``"preempted"``, and then
    ``KeyboardInterrupt`` / :class:`jaxnitro.Preempted` propagates. Whatever
    fails, the handle keeps a final status.
    """
    record = nitro.record
    status = hold = None  # status: set by the run itself, or from the exception that ended it
    with stop_signals():
        try:
            record.status = "running"
            dist = nitro.plan.dist
            record.run_dir = run_folder_of(nitro.plan.resumed, dist, nitro.settings.run_dir, nitro.experiment)
            hold = hold_run_folder(record.run_dir, dist)  # before anything is written into it
            run = RunContext(nitro, record.run_dir)
            logger = nitro.settings.logger if dist is None or dist.is_main else None  # process 0 logs
            record.loggers = run.loggers = make_loggers(logger, record.run_dir, nitro.experiment)
            check_loggers(run.loggers)  # a missing verb fails before the run starts, not mid-run
            with run_scoped([] if hold is None else [hold]):  # the hold's hooks see this run only
                try:
                    emit("jaxnitro_run_start", run=run)
                    status = _Run(nitro, run).run()
                except BaseException as exc:
                    status, run.error = _status_of(exc), exc
                    raise
                finally:
                    record.status = status
                    emit_finish(run, status)
        except BaseException as exc:  # also a Ctrl-C before the run's own try, or a failed finish
            status = _status_of(exc) if status in (None, "done") else status
            if isinstance(exc, (KeyboardInterrupt, Preempted)):
                consume_stop()
            raise
        finally:
            record.status = status
            if hold is not None:
                hold.release(status)  # whatever the status; a killed process's lock is stale by construction
            release_sources(nitro.data)  # once per run end; a released source reopens when read again


def run_folder_of(resumed, dist, run_dir: str, experiment) -> str:
    """The run's folder: with ``resumed`` (``plan.resumed``: ``resume=`` from a checkpoint whose
    run can continue), that run's folder (its metrics.jsonl and checkpoints go on); otherwise a
    new one under ``run_dir`` (:func:`new_run_folder`), made by process 0 of a multi-process
    ``dist`` and shared with the others."""
    if resumed is not None and resumed.continue_folder and resumed.run_folder and os.path.isdir(resumed.run_folder):
        return resumed.run_folder
    if dist is not None and dist.multi_process:  # one folder for the job: process 0 makes it
        return dist.from_main(new_run_folder(run_dir, experiment) if dist.is_main else None)
    return new_run_folder(run_dir, experiment)


def _status_of(exc: BaseException) -> str:
    """The status of a run that ``exc`` ended."""
    if isinstance(exc, Preempted):
        return "preempted"
    return "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"


TRAIN_HOOKS = ("forward", "loss", "train_metrics", "train_step")
"""The traced hooks of the train-step programs: their fields are transferred for training."""


class _Run:
    """One ``train()``: a short driver over the event book, the dispatcher and the reads.

    Per epoch it opens a reader at the run's data position, dispatches segments of steps
    up to each step the :class:`~jaxnitro.book.EventBook` marks (an epoch's end, a
    validation, a plugin's boundary, the run's end) and handles what is due there
    (:meth:`at_cut`). Per-step scalars are read in :class:`~jaxnitro.reads.StepReads`; a
    row is appended when its last step has been read: at once when it is validated
    (validation needs that step's parameters anyway) or is the run's last, otherwise
    later, so a train-only run never makes the device wait at an epoch boundary. ``run_state``: what it changes.
    """

    def __init__(self, nitro, run: RunContext):
        self.nitro, self.run_ctx = nitro, run
        phase_start(run, nitro.epoch + 1, "train", "preparing")  # schedules, programs, streams
        self.train = nitro.data["train"]
        self.accum = accum = nitro.settings.accum
        self.position = TrainPosition(self.train, accum)  # where the data is: epochs, passes, a stream's state
        self.steps_per_epoch = self.position.steps_per_epoch
        periods = [p for p in plugin_manager().hook.jaxnitro_step_period(run=run) if p is not None]
        self.book = make_book(nitro.settings, self.steps_per_epoch, periods)
        resumed_meta = nitro.plan.weights_meta if nitro.plan.resumed is not None else None
        run.horizon = schedule_horizon(nitro.settings, self.steps_per_epoch, nitro.plan.bindings, resumed_meta)
        self.scheds = StepValues(nitro.plan, nitro.device_values, max(run.horizon, 1), accum)
        self.validated = "val" in nitro.data
        dist = nitro.plan.sharded_dist
        self.dist = dist  # n_devs > 1 or several processes: the data mesh (batches sharded on it)
        # several processes: every cut is read before the next segment starts, so that what
        # the epoch's end does across processes (checkpoint barriers) happens at the same point
        self.lockstep = dist is not None and dist.multi_process
        self.k, self.probe = nitro.settings.steps_per_dispatch, None
        if self.k == "auto":
            self.k, self.probe = self._auto_k(dist)
        self.dispatcher, self.transfer, self.columns = self._dispatcher(dist)
        read_every, max_pending = READ_EVERY, MAX_PENDING  # in pending entries
        if self.k > 1:
            read_every, max_pending = max(1, READ_EVERY // self.k), max(2, MAX_PENDING // self.k)
        if dist is not None and jax.default_backend() == "cpu":
            # XLA's CPU collectives (several host devices) abort the process when one device's
            # thread misses an all-reduce rendezvous for 40 s, which happens when many sharded
            # steps are queued on 2 cores (measured on the tutorial's MLP at batch 400 on 4
            # devices: 64 steps in flight aborts, 32 completes): keep at most 16 in flight
            read_every = min(read_every, max(1, CPU_SHARDED_IN_FLIGHT // (2 * self.k)))
            max_pending = min(max_pending, max(2, CPU_SHARDED_IN_FLIGHT // self.k))
        logged = self.scheds.logged if nitro.settings.autolog_schedules else {}
        self.reads = StepReads(run, nitro.record, accum, self._aux_names, logged, start=nitro.step,
                               manual="train_step" in nitro.plan.hooks, check=nitro.settings.check_divergence,
                               validated=self.validated, read_every=read_every, max_pending=max_pending)
        run.run_state = self.run_state = nitro.run_state.begin(self.position, self.reads)  # the loop owns it now
        self.deadline = None if nitro.settings.max_time is None else time.monotonic() + nitro.settings.max_time

    def _block_program(self):
        plan = self.nitro.plan
        return plan.programs.train_block(plan.opt_spec, plan.tx, jax.tree_util.tree_structure(self.nitro.opt_state))

    def _auto_k(self, dist) -> tuple[int, "AutoProbe | None"]:
        """``steps_per_dispatch="auto"``: ``(k, probe)``. The ``k`` an earlier run of the same
        programs chose (kept with the block program), else 1 and a probe that measures the step time
        and chooses (:class:`~jaxnitro.dispatch.AutoProbe`) if steps are left after its last mark (else
        the next run would compile the block). No columns (blocks stacked on the host) or sharded: 1."""
        if dist is not None or not callable(getattr(unwrap(self.train), "columns", None)):
            return 1, None
        chosen = self._block_program().meta.get("auto_k")
        if chosen is not None:
            self.run_ctx.chosen_k = chosen
            return chosen, None
        probe = AutoProbe(self.nitro.step, self.book.period())
        return 1, (probe if probe.last < self.book.total else None)

    def _dispatcher(self, dist):
        """The :class:`Dispatcher`, the train split's transfer and its columns (or None)."""
        nitro, k, accum = self.nitro, self.k, self.accum
        progs, plan = nitro.plan.programs, nitro.plan
        o_def = jax.tree_util.tree_structure(nitro.opt_state)
        self.step_prog = progs.train_step(plan.opt_spec, plan.tx, o_def)
        self.block_prog = self._block_program() if k > 1 else None
        keyed_run = any(plan.routes[h].wants_key for h in TRAIN_HOOKS if h in plan.routes)
        fields, source, extra, columns = _device_fields(plan.routes, TRAIN_HOOKS), unwrap(self.train), {}, None
        if self.probe is not None:  # "auto": read by row numbers from the start, to switch to blocks
            columns = ColumnBlocks.of(source, fields, 1, accum, keyed_run, False)
            if columns is None:
                self.probe = None
        on_host = k > 1 or self.probe is not None  # batches stay on the host until a block of k * accum is sent at once
        if on_host:
            if keyed_run:
                extra = {KEY_DATA: nitro.state.rng}
            if columns is None:
                columns = ColumnBlocks.of(source, fields, k, accum, keyed_run, dist is not None)
        transfer = make_transfer(
            plan, TRAIN_HOOKS, on_host=on_host,
            width=None if isinstance(source, (list, tuple)) else plan.width,  # setup read every batch of a list
            counter=itertools.count(nitro.step * accum) if keyed_run else None,
            key=None if extra else nitro.state.rng,
        )
        dispatcher = Dispatcher(
            k=k, accum=accum, step_fn=self.step_prog.jitted,
            accumulate=progs.accumulate().jitted if accum > 1 else None,
            block_fn=self.block_prog.jitted if self.block_prog else None, scheds=self.scheds,
            extra=extra, columns=columns.device if columns is not None else None,
        )
        return dispatcher, transfer, columns

    def _reader(self, epoch: int, index: int, step: int):
        """A reader of ``epoch`` from its batch ``index`` on (micro-batch numbers from ``step``)."""
        if self.columns is not None:  # row numbers; gathered in the program; no host stream
            return ColumnReader(self.columns, epoch, index, step * self.accum, self.dispatcher.extra)
        stream = self.train.epoch(epoch, self.transfer, start=index)
        if self.k == 1:
            return StreamReader(stream, 1, self.accum)
        put = jax.device_put if stages_on_device() else None
        one = None  # the single steps' batches: numpy, or sharded on the mesh
        if self.dist is not None:  # a block's batch dimension is its third: [k, accum, batch, ...]
            put, one = (lambda b: self.dist.put_batch(b, axis=2)), self.dist.put_batch
        return StreamReader(stream, self.k, self.accum, put, one, self.dispatcher.extra)

    # -- the loop ------------------------------------------------------------------------

    def run(self) -> str:
        """The epochs; returns the status. Signals are deferred except while validating
        (nothing is in flight then): a stop is honoured between dispatches and at the
        cuts, by :meth:`stop`."""
        with deferring() as local:
            # several processes act on the job's stop, agreed at the same steps (AGREE_EVERY)
            stop = JobStop(local, self.dist.allgather_objects, AGREE_EVERY) if self.lockstep else local
            nitro, book = self.nitro, self.book
            epoch, into = self.run_state.start(book, nitro.plan.resumed)
            if nitro.plan.resumed is not None and self.run_state.row_due(book, into == 0):  # a cut-short validation
                self.at_cut(epoch - 1 if into == 0 else epoch, nitro.step, into == 0, stop)
            elif nitro.step >= book.total and nitro.plan.resumed is not None:
                warnings.warn(f"jaxnitro: nothing to train: this handle resumed at step {nitro.step:,}, which is already "
                              f"the run's budget ({book.total:,} optimizer steps). To train it longer, resume with a larger "
                              f"max_epochs or max_steps.", RuntimeWarning, stacklevel=4)
            while nitro.step < book.total and self.run_ctx.stop_reason is None:  # a run_start hook may stop it
                nitro.state = nitro.state.replace(epoch=epoch)
                prog = self.block_prog or self.step_prog
                phase_start(self.run_ctx, epoch, "train", "compiling train step" if prog.traces == 0 else None)
                if nitro.plan.programs.memory is None:  # the memory preflight (a plugin) compiles the first step
                    nitro.plan.programs.memory = preflight(nitro, self.first_step)
                outcome = self.train_epoch(epoch, into, stop)
                if outcome is Outcome.STOPPED or stop.status is not None:
                    self.stop()
                if outcome is Outcome.DIVERGED:
                    return self.diverged()
                if outcome is Outcome.EARLY:
                    break
                epoch, into = epoch + 1, 0
            nitro.record.stop_reason = self.run_ctx.stop_reason
            return "done"

    def first_step(self) -> FirstStep:
        """The run's first optimizer step as the dispatcher will run it (for the memory preflight)."""
        nitro = self.nitro
        return first_step(nitro.plan, nitro.settings, nitro.state, nitro.device_values, self.train,
                          self.scheds)

    def train_epoch(self, epoch: int, into: int, stop) -> Outcome:
        """Dispatch ``epoch`` from its step ``into`` (0, or a resumed run's position) to its
        end or the run's, segment by segment, handling each cut; the state of the last
        completed step is published whatever happens."""
        nitro, book, dispatcher, reads = self.nitro, self.book, self.dispatcher, self.reads
        step, last = nitro.step, book.epoch_last(epoch)
        leaves = nitro.state.leaves()
        dispatcher.wait, t_epoch = 0.0, time.perf_counter()
        # handled: the last cut inside the epoch whose work is done; resumed mid-epoch at a cut,
        # the run that saved the checkpoint there did it
        cut_here = into and (book.closes_row(step, False) or book.boundary(step))
        outcome, handled = Outcome.COMPLETE, step if cut_here else None
        reader, restored = self.position.open_pass(epoch, into, step, lambda index: self._reader(epoch, index, step))
        try:
            while step < last and outcome is Outcome.COMPLETE:
                due = book.next_cut(step, last)  # where something the book knows is due
                cut = due if self.probe is None else min(due, self.probe.next_mark(step))
                dispatcher.annotate = self.run_ctx.step_annotation  # None unless a plugin is profiling
                reads.clock()
                leaves, step, outcome = dispatcher.run(
                    reader, leaves, step, cut, stop, reads.pending, reads.read_every, self._read_or_stop,
                )
                self.run_state.publish(leaves, step)
                if outcome is Outcome.COMPLETE and self.probe is not None and self.probe.due(step):
                    outcome = self._probe_at(step, reader)
                if outcome is Outcome.COMPLETE and step == due < last:  # a cut inside the epoch
                    outcome, handled = self.at_cut(epoch, step, False, stop), step
            epoch_done = outcome is Outcome.EXHAUSTED or self.position.epoch_over(epoch, step)
            if outcome is Outcome.COMPLETE and epoch_done and not restored:
                reader.drain()  # (a restored pass is shorter than len(): the check does not apply)
        finally:
            reader.close()
            self.run_state.publish(leaves, step)
        if outcome is Outcome.EXHAUSTED:  # a stream ended: its epoch is over
            self.position.stream_ended(epoch, into, step)
            outcome = Outcome.COMPLETE
        if outcome is not Outcome.COMPLETE:
            return outcome  # no row for a partial epoch; its steps are still read and logged
        elapsed = time.perf_counter() - t_epoch
        stats = {"data_wait_frac": dispatcher.wait / elapsed if elapsed else 0.0}
        # a stream's end is seen one read after its last step: when that step was a cut already,
        # its row, validation and boundary are done; only the epoch's end is left
        return self.at_cut(epoch, step, epoch_done, stop, stats, again=handled == step)

    def _probe_at(self, step: int, reader) -> Outcome:
        """``steps_per_dispatch="auto"``: a probe mark. Every step so far is read (the device
        drained), the time noted; at the last mark ``k`` is chosen, kept with the block program
        (later runs of the same programs start with it), and the rest of the run dispatched
        ``k`` steps at a time."""
        if self.reads.read(wait=True):
            return Outcome.DIVERGED
        probe = self.probe
        k = probe.mark(step)
        if k is None:
            return Outcome.COMPLETE
        self.probe = None
        self.block_prog = self._block_program()
        self.block_prog.meta["auto_k"] = k
        if k > 1:
            self.k = k
            self.columns.k = k
            reader.size = k * self.accum
            self.dispatcher.use_blocks(k, self.block_prog.jitted)
            self.reads.read_every, self.reads.max_pending = max(1, READ_EVERY // k), max(2, MAX_PENDING // k)
        self.run_ctx.chosen_k = k  # what "auto" chose, with the step time it measured
        self.run_ctx.step_seconds = probe.seconds
        return Outcome.COMPLETE

    def at_cut(self, epoch: int, step: int, epoch_done: bool, stop, stats=None, again: bool = False) -> Outcome:
        """What is due after ``step``: the epoch's end (``jaxnitro_epoch_trained``), a row's
        end (validated when the run validates), a plugin's boundary, a stop, ``max_time``."""
        book, reads, nitro = self.book, self.reads, self.nitro
        if self.lockstep:  # every process reaches this cut: the job's stop is agreed here
            self._past_deadline()
            stop.agree(step)
        # again: this step's cut inside the epoch was handled (a stream's end seen one read later):
        # what it did (a row's end, a boundary) is not done twice; the epoch's end is still due
        closes = book.closes_row(step, epoch_done) and not (again and book.closes_row(step, False))
        if epoch_done:
            reads.epoch_ends.append((epoch, step))
        if closes:
            reads.row_ends.append((epoch, step))
            if reads.first_unread > step:  # its last step was already read
                reads.row_closed(reads.close_row())
        if epoch_done:
            emit("jaxnitro_epoch_trained", run=self.run_ctx, epoch=epoch, step=step, stats=stats or {})
        validate, boundary = closes and self.validated, book.boundary(step) and not again
        if (validate or boundary or step >= book.total or self.lockstep) and reads.read(wait=True):
            return Outcome.DIVERGED
        if stop.status is not None:
            if validate:  # the row closed unvalidated: it stays open, and a run resumed here validates it
                self.run_state.reopen()
            self.stop()
        if validate:  # a signal stops a validation at once, but not one process's of a job (agreed at the next cut)
            with immediate() if not self.lockstep else contextlib.nullcontext():
                self.validate(epoch)
            emit("jaxnitro_epoch_end", run=self.run_ctx, row=nitro.rows[-1])
        if boundary:
            emit("jaxnitro_step_boundary", run=self.run_ctx, step=step, epoch=epoch)
        if stop.status is not None or (not self.lockstep and self._past_deadline()):
            self.stop()
        return Outcome.EARLY if self.run_ctx.stop_reason is not None else Outcome.COMPLETE

    def _read_or_stop(self, wait: bool) -> bool:
        """The dispatcher's periodic read; also where ``max_time`` is checked between cuts."""
        self._past_deadline()
        return self.reads.read(wait)

    def _past_deadline(self) -> bool:
        """Whether ``max_time`` has passed; if so, request the stop a preemption makes."""
        if self.deadline is None or time.monotonic() < self.deadline:
            return False
        stop_request.status = stop_request.status or "preempted"
        if self.nitro.record.stop_reason is None:
            self.run_ctx.time_limit_reached = True
        return True

    def stop(self) -> None:
        """A stop was requested: read and emit every step already computed, then raise."""
        if self.reads.read(wait=True):
            self.diverged()
        why = "max_time reached" if self.run_ctx.time_limit_reached else stop_request.status
        self.nitro.record.stop_reason = f"{why} at step {self.nitro.step}"
        raise stop_request.exception()

    def _aux_names(self) -> tuple[str, ...]:
        """The names of a step's scalars (``loss`` and ``train_metrics``, or what ``train_step``
        returned), known once a train program has been traced."""
        names = self.step_prog.meta.get("aux_names") or (
            self.block_prog.meta.get("aux_names") if self.block_prog else None
        )
        return tuple(names or ("loss",))

    # -- the run's end ------------------------------------------------------------------------

    def diverged(self) -> str:
        """Record the divergence (warning, stop reason, a last row); return ``"diverged"``."""
        record = self.nitro.record
        step, epoch = record.diverged_at
        manual = "train_step" in self.nitro.plan.hooks
        what = (
            f"train_step's scalar(s) {', '.join(map(repr, self.reads.diverged_names))}"
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
        record.rows.append({"epoch": epoch, "step": step, **self.reads.train_columns()})
        return "diverged"

    def _nonfinite_input(self, step: int, epoch: int) -> str | None:
        """After a divergence: which routed float field of step ``step``'s micro-batches holds
        NaN/inf, when the train source can be read again by index (else None). Runs only after
        a divergence, so it costs normal training nothing."""
        source = unwrap(self.train)
        if not is_addressable(source):
            return None
        first = self.position.epoch_start.get(epoch, 0) + 1
        batch_at, begin_epoch = accessors(source)
        begin_epoch(epoch)
        routes = self.nitro.plan.routes
        fields = {f for h in TRAIN_HOOKS if h in routes for f in routes[h].fields}
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
        """Validate, emit the split's metrics and merge them into the row just closed."""
        nitro = self.nitro
        forward_compiles = nitro.plan.programs.forward().traces == 0
        phase_start(self.run_ctx, epoch, "validate", "compiling forward" if forward_compiles else None)
        try:
            metrics, nitro.plan = evaluate_split(nitro.experiment, nitro.plan, nitro.state, nitro.device_values,
                                                 nitro.data["val"], "val")
        except BaseException:  # a stop (Ctrl-C is immediate here) or an error: not validated, the row stays open
            self.run_state.reopen()
            raise
        emit("jaxnitro_split_evaluated", run=self.run_ctx, split="val", metrics=metrics, context="validate")
        nitro.record.rows[-1].update(metrics)
        if nitro.settings.monitor is not None:  # present and one number, before a plugin reads the row
            check_monitored_in(metrics, nitro.settings.monitor[0])
