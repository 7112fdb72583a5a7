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
import itertools
import math
import os
import time
import warnings

import jax
import numpy as np
import structlog

from .batches import batch_width, unwrap
from .evaluation import evaluate_split, logger_call, logger_verb, make_transfer
from .plugin_manager import first_result
from .prefetch import is_addressable
from .routing import KEY_COUNT, KEY_DATA
from .progress import Progress
from .schedules import StepValues
from .show import binding_report_text, params_for_logger

__all__ = ["run_training", "new_run_folder", "READ_EVERY"]

log = structlog.get_logger("jaxnitro")

READ_EVERY = 32
"""Optimizer steps between host reads of the per-step scalars (a divergence is seen within this)."""
MAX_PENDING = 4 * READ_EVERY
"""Unread steps after which the host reads even if the device is behind (bounds memory and the
divergence check's delay)."""


def new_run_folder(root: str) -> str:
    """Create and return a fresh ``root/<timestamp>-<n>`` folder; never reuses an existing one."""
    root = os.path.abspath(root)
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


def make_logger(nitro, run_dir: str):
    """Turn the resolved ``logger`` knob into a logger object (or None)."""
    spec = nitro.logger_spec
    if spec is None:
        return None
    if isinstance(spec, str):
        import pathlib

        made = first_result(
            "jaxnitro_make_logger", name=spec, run_dir=pathlib.Path(run_dir), experiment=nitro.experiment
        )
        if made is None:
            from .plugin_manager import plugins_info

            raise ValueError(
                f"jaxnitro: no plugin makes a logger named {spec!r}. Loaded plugins: "
                f"{[p.name for p in plugins_info()]}. Pass `logger=None` to disable logging, "
                f"'jsonl' for the default, or a logger object."
            )
        return made
    return spec


def run_training(nitro) -> None:
    """Run ``nitro``'s training; see :meth:`jaxnitro.Nitro.train`.

    The logger is finished with the run's status whatever happens: ``"done"``,
    ``"diverged"``, ``"interrupted"`` (Ctrl-C) or ``"failed"`` (an exception,
    which propagates). A logger error while finishing a run that already failed
    is reported as a warning, so it never hides the original exception.
    """
    nitro.status = "running"
    nitro.run_dir = new_run_folder(nitro.run_dir_root)
    status = "failed"
    progress = None
    try:
        nitro.logger = make_logger(nitro, nitro.run_dir)
        progress = Progress(nitro.max_epochs)
        logger_call(nitro, "log_params", params_for_logger(nitro))
        logger_call(nitro, "log_other", "binding_report", binding_report_text(nitro))
        status = _loop(nitro, progress)
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    finally:
        nitro.status = status
        if progress is not None:
            progress.close(nitro.epoch, status)
        if nitro.logger is not None:
            try:
                logger_call(nitro, "finish", status)
            except Exception as err:
                if status == "done":
                    raise
                log.warning("logger finish failed", status=status, error=repr(err))


def _loop(nitro, progress: Progress) -> str:
    return _Run(nitro, progress).run()


class _Run:
    """One ``train()``: the epoch loop, the per-step dispatch and the deferred reads.

    Per-step scalars stay on the device in ``pending`` (one float32 vector per
    optimizer step, oldest first) until read. An epoch's history row is
    appended when its last step has been read: at once when the epoch is
    validated (validation needs the epoch's final parameters anyway) or is the
    last, otherwise during the next epoch, so a train-only run never makes the
    device wait at an epoch boundary.
    """

    def __init__(self, nitro, progress: Progress):
        self.nitro, self.progress = nitro, progress
        train = nitro.data["train"]
        self.train = train
        self.accum = nitro.accum
        self.steps_per_epoch = len(train) // self.accum
        self.scheds = StepValues(nitro, max(nitro.max_epochs * self.steps_per_epoch, 1))
        progs = nitro.programs
        self.o_def = jax.tree_util.tree_structure(nitro.opt_state)
        self.accumulate = progs.accumulate().jitted if self.accum > 1 else None
        self.step_prog = progs.train_step(nitro.opt_spec, nitro.tx, self.o_def)
        self.scale = jax.device_put(np.float32(1.0 / self.accum))
        transfer = make_transfer(nitro, ("forward", "loss", "train_metrics"))
        if not is_addressable(unwrap(train)):
            transfer = _width_checked(transfer, nitro.width)  # setup could not see its last batch
        if any(nitro.routes[h].wants_key for h in ("forward", "loss", "train_metrics") if h in nitro.routes):
            transfer = _keyed(transfer, nitro.run_key, itertools.count(nitro.step * self.accum))
        self.transfer = transfer
        self.log = logger_verb(nitro, "log_metrics")
        self.logged_sched = self.scheds.logged if nitro.autolog_schedules else {}
        self.pending: list = []
        self.first_unread = nitro.step + 1  # the step number of pending[0]
        self.epoch_ends: list[tuple[int, int]] = []  # (epoch, its last step), rows not yet appended
        self.losses: list[float] = []  # read losses of the oldest epoch without a row
        if nitro.early_stop is not None and hasattr(nitro.early_stop, "reset"):
            nitro.early_stop.reset()

    # -- the loop ------------------------------------------------------------------------

    def run(self) -> str:
        nitro = self.nitro
        validate = "val" in nitro.data
        for epoch in range(nitro.epoch + 1, nitro.max_epochs + 1):
            nitro.epoch = epoch
            self.progress.phase_start(epoch, "train", "compiling train step" if self.step_prog.traces == 0 else None)
            if self.train_epoch(epoch) or (
                (validate or epoch == nitro.max_epochs) and self.read(wait=True)
            ):
                return self.diverged()
            if validate and self.validate(epoch):
                return "done"  # early stopping
            self.progress.advance(1.0)
        return "done"

    def train_epoch(self, epoch: int) -> bool:
        """Dispatch one epoch's steps; True if a read found a non-finite loss."""
        nitro, scheds, accumulate = self.nitro, self.scheds, self.accumulate
        step_fn, scale, dev = self.step_prog.jitted, self.scale, nitro.device_values
        leaves = jax.tree_util.tree_leaves
        params, mstate, opt_state = leaves(nitro.params), leaves(nitro.model_state), leaves(nitro.opt_state)
        acc, micro, step = None, 0, nitro.step
        epoch_start, wait, diverged = step, 0.0, False
        t_epoch = t0 = time.perf_counter()
        stream = self.train.epoch(epoch, self.transfer)
        try:
            for batch in stream:
                wait += time.perf_counter() - t0
                if micro < self.accum - 1:
                    acc, mstate = accumulate(params, mstate, scheds.dev(dev, step), batch, acc)
                    micro += 1
                else:
                    params, mstate, opt_state, aux = step_fn(
                        params, mstate, opt_state, scheds.dev(dev, step), batch, acc, scale, scheds.hypers(step)
                    )
                    acc, micro = None, 0
                    step += 1
                    self.pending.append(aux)
                    if len(self.pending) >= READ_EVERY:
                        diverged = self.read(wait=False)
                        self.progress.advance((step - epoch_start) / self.steps_per_epoch)
                        if diverged:
                            break
                t0 = time.perf_counter()
        finally:
            stream.close()
            self.publish(params, mstate, opt_state)
            nitro.step = step
        self.epoch_ends.append((epoch, step))
        if self.first_unread > step:  # its last step was already read during the epoch
            self._close_epoch()
        elapsed = time.perf_counter() - t_epoch
        logger_call(nitro, "log_metrics", {"data_wait_frac": wait / elapsed if elapsed else 0.0},
                    step=step, epoch=epoch, context="data")
        return diverged

    def publish(self, p, s, o) -> None:
        unflatten, progs = jax.tree_util.tree_unflatten, self.nitro.programs
        self.nitro.params = unflatten(progs.param_def, p)
        self.nitro.model_state = unflatten(progs.state_def, s)
        self.nitro.opt_state = unflatten(self.o_def, o)

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
            if not (self.pending[READ_EVERY - 1].is_ready() or len(self.pending) >= MAX_PENDING):
                return False
            return self._process(READ_EVERY)
        while self.pending:
            pending, done = self.pending, 0
            while done < len(pending) and pending[done].is_ready():
                done += 1
            if done == 0:
                time.sleep(0.0002)
            elif self._process(done):
                return True
        return False

    def _process(self, n: int) -> bool:
        """Fetch the oldest ``n`` pending vectors; log train lines; append finished epochs' rows."""
        nitro = self.nitro
        ready, self.pending = self.pending[:n], self.pending[n:]
        values = np.stack([np.asarray(a) for a in ready]).tolist()  # ~10x cheaper than device_get
        names = self.step_prog.meta.get("aux_names", ("loss",))
        log, log_every, check = self.log, nitro.log_every_n_steps, nitro.check_divergence
        for row in values:
            s = self.first_unread
            self.first_unread += 1
            epoch = self.epoch_ends[0][0] if self.epoch_ends else nitro.epoch
            loss = row[0]
            if check and not math.isfinite(loss):
                nitro.diverged_step, nitro.diverged_epoch = s, epoch
                return True
            self.losses.append(loss)
            if log is not None and s % log_every == 0:
                line = dict(zip(names, row))
                for key, table in self.logged_sched.items():
                    line[key] = float(table[min(s - 1, len(table) - 1)])
                log(line, step=s, epoch=epoch, context="train")
            if self.epoch_ends and s == self.epoch_ends[0][1]:
                self._close_epoch()
        return False

    def _close_epoch(self) -> None:
        """Append the history row of the oldest finished epoch whose steps have all been read."""
        epoch, last = self.epoch_ends.pop(0)
        self.nitro.rows.append({"epoch": epoch, "step": last, "train_loss": float(np.mean(self.losses))})
        self.losses = []

    # -- epoch end ----------------------------------------------------------------------------

    def diverged(self) -> str:
        nitro = self.nitro
        nitro.stop_reason = f"non-finite loss at step {nitro.diverged_step}"
        warnings.warn(
            f"jaxnitro: the loss became non-finite at step {nitro.diverged_step} (epoch "
            f"{nitro.diverged_epoch}); the run stopped with status 'diverged'. Lower the learning "
            f"rate, add gradient_clip_norm, or check the loss for log(0) / overflow.",
            RuntimeWarning,
            stacklevel=5,
        )
        train_loss = float(np.mean(self.losses)) if self.losses else float("nan")
        nitro.rows.append({"epoch": nitro.diverged_epoch, "step": nitro.diverged_step, "train_loss": train_loss})
        return "diverged"

    def validate(self, epoch: int) -> bool:
        """Validate the epoch, merge its metrics into its row; True if early stopping fires."""
        nitro = self.nitro
        forward_compiles = nitro.programs.forward().traces == 0
        self.progress.phase_start(epoch, "validate", "compiling forward" if forward_compiles else None)
        metrics = evaluate_split(nitro, "val", log_context="validate")
        nitro.rows[-1].update(metrics)
        if nitro.monitor is None:
            return False
        name, mode = nitro.monitor
        if name not in metrics:
            raise KeyError(
                f"jaxnitro: `monitor` names {name!r}, but the validation metrics are "
                f"{sorted(metrics)} (what finalize_metrics returned). Return it from "
                f"`finalize_metrics`/`metrics`, or monitor one of those."
            )
        early = nitro.early_stop
        if early is not None and early.should_stop(epoch, metrics[name], mode):
            nitro.stop_reason = f"early stopping: {name} did not improve for {getattr(early, 'patience', '?')} epochs"
            return True
        return False


def _keyed(transfer, key_data, counter):
    """Wrap ``transfer`` to add the run's base key and the micro-batch number (see ``key``)."""

    def keyed(batch):
        batch = transfer(batch)
        batch[KEY_DATA] = key_data
        batch[KEY_COUNT] = np.uint32(next(counter))
        return batch

    return keyed


def _width_checked(transfer, width: int):
    """Wrap ``transfer`` to refuse a train batch whose width differs (a partial final batch)."""

    def checked(batch):
        n = batch_width(batch, "train batch")
        if n != width:
            raise ValueError(
                f"jaxnitro: the `train` split yielded a batch of {n} rows; its batches have {width}. "
                f"The train split must drop its partial final batch (a partial batch would compile a "
                f"second train step and weight its rows differently). Fix: build the loader with "
                f"drop_last=True, or give the source batch_at/begin_epoch so setup can check it."
            )
        return transfer(batch)

    return checked
