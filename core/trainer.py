"""The automatic training loop behind ``Nitro.train``.

Per optimizer step the host does: take the next staged batch, dispatch
``accum - 1`` accumulate programs and one train-step program, and append the
step's device-resident scalar vector (loss and ``train_metrics``) to a short
list. Every ``READ_EVERY`` steps (and at each epoch's end) the list is fetched
in one go; only then are train lines logged, divergence checked and progress
advanced. The host therefore never waits on the device inside a stretch, and
dispatch runs ahead of compute as in a hand-written ``jax.jit`` loop.
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
from .schedules import materialize
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


class _Schedules:
    """Per-step values: the optimizer hyperparameter vector and scheduled Device fields."""

    def __init__(self, nitro, total: int):
        spec = nitro.opt_spec
        self.layout = spec.layout
        base = spec.base_vector(nitro.base_lr)
        self.constant = not nitro.bindings.opt
        self.logged: dict[str, np.ndarray] = {}
        if self.constant:
            self.vector = jax.device_put(base)
        else:
            table = np.tile(base, (total, 1))
            bare = {h: materialize(f, total, f"opt/{h}") for (g, h), f in nitro.bindings.opt.items() if g is None}
            for i, (group, hyper) in enumerate(self.layout.slots):
                gspec = next(x for x in spec.groups if x.name == group)
                values = None
                if (group, hyper) in nitro.bindings.opt:
                    values = materialize(nitro.bindings.opt[(group, hyper)], total, f"opt/{group}/{hyper}")
                elif hyper in bare:
                    values = bare[hyper]
                if values is not None:
                    table[:, i] = values * gspec.ratio if hyper == "learning_rate" else values
                    if values.min() != values.max():
                        self.logged[f"schedule/{group}/{hyper}"] = table[:, i]
            self.table = table
        self.device = {}
        for name, f in nitro.bindings.device.items():
            dtype = nitro.device_values[name].dtype
            values = materialize(f, total, f"device/{name}").astype(dtype)
            self.device[name] = values
            if values.min() != values.max():
                self.logged[f"schedule/{name}"] = values

    def hypers(self, step: int):
        return self.vector if self.constant else self.table[min(step, len(self.table) - 1)]

    def dev(self, base: dict, step: int) -> dict:
        if not self.device:
            return base
        out = dict(base)
        for name, values in self.device.items():
            out[name] = values[min(step, len(values) - 1)]
        return out


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
    train = nitro.data["train"]
    accum = nitro.accum
    steps_per_epoch = len(train) // accum
    total = max(nitro.max_epochs * steps_per_epoch, 1)
    scheds = _Schedules(nitro, total)
    progs = nitro.programs
    leaves, unflatten = jax.tree_util.tree_leaves, jax.tree_util.tree_unflatten
    p_def = progs.param_def
    s_def = progs.state_def
    o_def = jax.tree_util.tree_structure(nitro.opt_state)
    accumulate = progs.accumulate().jitted if accum > 1 else None
    step_prog = progs.train_step(nitro.opt_spec, nitro.tx, o_def)
    step_fn = step_prog.jitted
    scale = jax.device_put(np.float32(1.0 / accum))
    transfer = make_transfer(nitro, ("forward", "loss", "train_metrics"))
    if not is_addressable(unwrap(train)):
        transfer = _width_checked(transfer, nitro.width)  # setup could not see its last batch
    if any(nitro.routes[h].wants_key for h in ("forward", "loss", "train_metrics") if h in nitro.routes):
        transfer = _keyed(transfer, nitro.run_key, itertools.count(nitro.step * accum))
    dev = nitro.device_values
    early = nitro.early_stop
    if early is not None and hasattr(early, "reset"):
        early.reset()
    log_every = nitro.log_every_n_steps
    logged_sched = scheds.logged if nitro.autolog_schedules else {}

    def publish(p, s, o):
        nitro.params, nitro.model_state, nitro.opt_state = unflatten(p_def, p), unflatten(s_def, s), unflatten(o_def, o)

    for epoch in range(nitro.epoch + 1, nitro.max_epochs + 1):
        nitro.epoch = epoch
        first = step_prog.traces == 0
        progress.phase_start(epoch, "train", "compiling train step" if first else None)
        pending: list = []
        losses: list[float] = []
        wait = 0.0
        t_epoch = time.perf_counter()
        params, mstate, opt_state = leaves(nitro.params), leaves(nitro.model_state), leaves(nitro.opt_state)
        acc = None
        micro = 0
        step = epoch_start = nitro.step
        diverged = False
        stream = train.epoch(epoch, transfer)
        try:
            t0 = time.perf_counter()
            for batch in stream:
                wait += time.perf_counter() - t0
                if micro < accum - 1:
                    acc, mstate = accumulate(params, mstate, scheds.dev(dev, step), batch, acc)
                    micro += 1
                else:
                    params, mstate, opt_state, aux = step_fn(
                        params, mstate, opt_state, scheds.dev(dev, step), batch, acc, scale,
                        scheds.hypers(step),
                    )
                    acc, micro = None, 0
                    step += 1
                    pending.append(aux)
                    # Read a stretch of steps only once its last one has finished computing:
                    # waiting on the device here would make the host spin instead of
                    # dispatching (on a CPU backend it would take a core from the compute).
                    if len(pending) >= READ_EVERY and (
                        pending[READ_EVERY - 1].is_ready() or len(pending) >= MAX_PENDING
                    ):
                        ready, pending = pending[:READ_EVERY], pending[READ_EVERY:]
                        diverged = _drain(
                            nitro, ready, step - len(pending), epoch, losses, step_prog, log_every, logged_sched
                        )
                        progress.advance((step - epoch_start) / steps_per_epoch)
                        if diverged:
                            break
                t0 = time.perf_counter()
        finally:
            stream.close()
            publish(params, mstate, opt_state)
        nitro.step = step
        while pending and not diverged:
            # Process each finished stretch while the device computes the rest; poll with
            # short sleeps rather than a blocking read, which on a CPU backend would keep a
            # core busy that the computation we wait for needs.
            done = 0
            while done < len(pending) and pending[done].is_ready():
                done += 1
            if done == 0:
                time.sleep(0.0002)
                continue
            ready, pending = pending[:done], pending[done:]
            diverged = _drain(nitro, ready, step - len(pending), epoch, losses, step_prog, log_every, logged_sched)
        elapsed = time.perf_counter() - t_epoch
        logger_call(nitro, "log_metrics", {"data_wait_frac": wait / elapsed if elapsed else 0.0},
                    step=step, epoch=epoch, context="data")
        train_loss = float(np.mean(losses)) if losses else float("nan")
        if diverged:
            nitro.stop_reason = f"non-finite loss at step {nitro.diverged_step}"
            warnings.warn(
                f"jaxnitro: the loss became non-finite at step {nitro.diverged_step} (epoch {epoch}); "
                f"the run stopped with status 'diverged'. Lower the learning rate, add "
                f"gradient_clip_norm, or check the loss for log(0) / overflow.",
                RuntimeWarning,
                stacklevel=4,
            )
            nitro.rows.append({"epoch": epoch, "step": step, "train_loss": train_loss})
            return "diverged"
        row = {"epoch": epoch, "step": step, "train_loss": train_loss}
        stop = False
        if "val" in nitro.data:
            progress.phase_start(epoch, "validate", "compiling forward" if nitro.programs.forward().traces == 0 else None)
            metrics = evaluate_split(nitro, "val", log_context="validate")
            row.update(metrics)
            if nitro.monitor is not None:
                name, mode = nitro.monitor
                if name not in metrics:
                    raise KeyError(
                        f"jaxnitro: `monitor` names {name!r}, but the validation metrics are "
                        f"{sorted(metrics)} (what finalize_metrics returned). Return it from "
                        f"`finalize_metrics`/`metrics`, or monitor one of those."
                    )
                if early is not None and early.should_stop(epoch, metrics[name], mode):
                    stop = True
                    nitro.stop_reason = (
                        f"early stopping: {name} did not improve for {getattr(early, 'patience', '?')} epochs"
                    )
        nitro.rows.append(row)
        progress.advance(1.0)
        if stop:
            return "done"
    return "done"


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


def _drain(nitro, pending, step, epoch, losses, step_prog, log_every, logged_sched) -> bool:
    """Fetch pending per-step scalars, log train lines, and report divergence (True).

    ``pending`` holds the device vectors ``[loss, *train_metrics]`` of the steps
    ending at ``step``. ``np.asarray`` per array is ~10x cheaper than one
    ``jax.device_get`` of the list.
    """
    rows = np.stack([np.asarray(a) for a in pending]).tolist()
    names = step_prog.meta.get("aux_names", ("loss",))
    first_step = step - len(rows) + 1
    log = logger_verb(nitro, "log_metrics")
    check = nitro.check_divergence
    for i, row in enumerate(rows):
        s = first_step + i
        loss = row[0]
        if check and not math.isfinite(loss):
            nitro.diverged_step = s
            return True
        losses.append(loss)
        if log is not None and s % log_every == 0:
            line = dict(zip(names, row))
            for key, table in logged_sched.items():
                line[key] = float(table[min(s - 1, len(table) - 1)])
            log(line, step=s, epoch=epoch, context="train")
    return False
