"""The orbax checkpointer: ``jn.Checkpointer``, ``jn.Best``, ``jn.Last``, ``jn.Average``.

Entry point ``orbax``. It

* exports :class:`Checkpointer`, :class:`Best`, :class:`Last` and :class:`Average`;
* accepts the ``checkpointer`` run knob (refusing ``Best`` without a ``monitor`` hook or a
  ``val`` split);
* saves a checkpoint at each epoch's end (``jaxnitro_epoch_end``) into
  ``<run folder>/checkpoints/<step>`` with an orbax ``CheckpointManager``, keeping the
  union of the ``keep`` policies, written by a worker thread paced by ``min_interval``; at
  an interrupted, preempted or diverged end it saves the state the run ended with, which
  never displaces an epoch-end checkpoint (but that of a stop at a row's end before its
  validation becomes, once the run resumed from it validates the row, the epoch-end checkpoint
  it stands for: its record is rewritten, not its arrays); a run's end (``jaxnitro_run_ending``:
  before any plugin's ``jaxnitro_run_finish``) writes what is held and waits for every save;
* fails the run when a save fails (a full disk): the error is raised on the loop's thread at
  the next epoch's end or step boundary after the worker thread met it, or at the run's end,
  whose status then is ``"failed"`` (the loggers' finish says so), naming the folder, the
  error and the checkpoints still on disk; a save never recreates a deleted run folder;
* answers ``jaxnitro_load_weights``: finds the checkpoint(s) a ``weights=`` / ``resume=``
  spec names and describes them as a :class:`jaxnitro.weights.WeightsRecord`; a checkpoint
  deleted while it is read is said to be that (a ``FileNotFoundError`` whose ``run_folder`` is
  the folder being written: the ``run_lock`` plugin turns it into ``jn.RunFolderInUse`` when a
  live run holds that folder), not corrupt.

A checkpoint serializes one :class:`jaxnitro.plugin.SavedRun` (``run.run_state.snapshot()``:
state, rows, data position, open row) as a plain orbax checkpoint (``docs/checkpoints.md``) with two items:
``state`` (``StandardSave`` of ``{"params", "model_state", "opt_state", "ema"}``, each key
present when the run has it; ``opt_state`` is the optimizer rules' state) and ``meta``
(``JsonSave``: experiment class, GraphConst values, the parameter tree, step, epoch, data
position, PRNG key, derived values, the epoch's metrics). Reading takes only the subtrees
it needs (orbax's partial restore): serving never reads the optimizer state. orbax writes a step into a temporary folder and renames it when
complete, so a save cut short by a killed process is never listed, let alone selected.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import logging
import math
import os
import re
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import attrs
import jax
import jax.numpy as jnp
import numpy as np

import jaxnitro
from jaxnitro.plugin import (
    NoCheckpointError,
    SavedRun,
    WeightsRecord,
    best_positions,
    ema_of,
    fields_of,
    from_jsonable,
    hookimpl,
    incompatibility,
    jsonable,
    owns_knob,
    require_monitor_and_val,
    rule_state_of,
    tree_listing,
)

__all__ = ["Checkpointer", "Best", "Last", "Average", "FORMAT"]

FORMAT = 1
"""Version of the ``meta`` record."""

CHECKPOINTS = "checkpoints"
"""The folder, inside a run folder, that holds its checkpoints."""

_RUN_NAME = re.compile(r"^(\d{8}-\d{6})-(\d+)$")
_TMP = ".orbax-checkpoint-tmp"
MAX_QUEUED = 2
"""Snapshots the checkpointer may hold (the one being written and those waiting for the worker
thread, each a device copy of the state) before an epoch's end waits for the oldest to start;
more when they fit in ``QUEUE_BYTES``."""
QUEUE_BYTES = 256 * 2**20
"""Device memory the waiting snapshots may take: a small state (the tutorial's is 1 MB) never
makes the loop wait for a save; the run's end waits for them all."""
WRITE_SHARE = 0.05
"""``Checkpointer(min_interval="auto")``: the most of a run's time its checkpoint writes take
(one orbax save costs ~30-60 ms of CPU whatever the state's size, more than a whole epoch of
a small model on a small data set). Counted in CPU time (see ``HELPER_CPU``), not wall time:
a write that waits for a busy core or for the disk takes nothing from the loop, and on busy
cores a write's wall time is many times its CPU time (measured: 2-4 s for ~0.1 s of CPU),
which paced by wall time held most checkpoints back in memory (no resume point on disk)
and left several to write while the run's end waited."""
HELPER_CPU = 4.0
"""The CPU time of one orbax save over its writer thread's own (``time.thread_time``):
orbax's and tensorstore's helper threads, which start and end within the save, take about
three times as much again (measured on the tutorial's state: 50 ms on the writer thread,
160 ms in the process, alone; in ``bench/checkpoint_steps.py`` ~40 ms on the writer thread
against ~145 ms more process CPU per save)."""
_EPOCH_END = "epoch_end"  # the orbax metric marking an epoch-end checkpoint (1.0) or a run's end (0.0)


def _ocp():
    """``orbax.checkpoint``, imported on first use (it takes about a second to import)."""
    import orbax.checkpoint as ocp

    return ocp


# -- the public objects ---------------------------------------------------------------------


def _count(kind: str):
    def check(instance, attribute, value):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            what = "best" if kind == "Best" else "latest"
            raise ValueError(
                f"jaxnitro: {kind}({value!r}) keeps the {what} n checkpoints; n must be an integer "
                f">= 1 (e.g. {kind}(3)). To keep none of that kind, leave {kind} out of `keep`."
            )

    return check


@attrs.frozen
class Best:
    """Keep the ``n`` checkpoints whose monitored metric (``monitor``) is best."""

    n: int = attrs.field(default=1, validator=_count("Best"))


@attrs.frozen
class Last:
    """Keep the ``n`` newest epoch-end checkpoints."""

    n: int = attrs.field(default=1, validator=_count("Last"))


def _of(instance, attribute, value):
    if not isinstance(value, (Best, Last)):
        raise TypeError(
            f"jaxnitro: Average({value!r}); average the checkpoints a policy selects: "
            f"jn.Average(jn.Last(10)) or jn.Average(jn.Best(3))."
        )


@attrs.frozen
class Average:
    """A uniform average of the parameters of the checkpoints ``of`` selects (``weights=`` only).

    ``("latest", jn.Average(jn.Last(10)))``, or ``jn.Average(jn.Best(3))`` (the latest run).
    Model state (e.g. batch-norm statistics) comes from the newest of them.
    """

    of: Best | Last = attrs.field(validator=_of)


def _keep(value):
    if isinstance(value, (Best, Last)):
        return (value,)
    return value if value is None else tuple(value)


def _check_keep(instance, attribute, value):
    if value is None:
        return
    bad = [k for k in value if not isinstance(k, (Best, Last))]
    if bad or not value:
        raise TypeError(
            f"jaxnitro: Checkpointer(keep={value!r}); `keep` is a tuple of policies, e.g. "
            f"(jn.Best(3), jn.Last(1)): the union of what each keeps is kept."
        )
    for kind in (Best, Last):
        if sum(isinstance(k, kind) for k in value) > 1:
            raise ValueError(
                f"jaxnitro: Checkpointer(keep={value!r}) has two {kind.__name__} policies; give one "
                f"(the larger n keeps both sets)."
            )


def _every(instance, attribute, value):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"jaxnitro: Checkpointer(every={value!r}); it must be an integer >= 1 (epochs).")


def _every_n_steps(instance, attribute, value):
    """``every_n_steps``: None (save at epoch ends) or an integer >= 1, and not given together
    with an ``every`` other than 1 (the epoch-end cadence it replaces): refused, naming both."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(
            f"jaxnitro: Checkpointer(every_n_steps={value!r}); it must be an integer >= 1 (optimizer "
            f"steps between checkpoints), or None to save at epoch ends."
        )
    if instance.every != 1:
        raise ValueError(
            f"jaxnitro: Checkpointer(every={instance.every!r}, every_n_steps={value!r}); every_n_steps "
            f"saves every {value} optimizer steps instead of at epoch ends, so `every` (epochs between "
            f"checkpoints) would be ignored. Give one of them: every_n_steps={value} alone, or "
            f"every={instance.every!r} alone."
        )


def _min_interval(instance, attribute, value):
    if value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) or not 0 <= value < math.inf:
        raise ValueError(
            f"jaxnitro: Checkpointer(min_interval={value!r}); give \"auto\" (writes take at most "
            f"{WRITE_SHARE:.0%} of the run's time), a number of seconds >= 0, or 0 to write every save at once."
        )
    if value > 0 and not instance.asynchronous:
        raise ValueError(
            f"jaxnitro: Checkpointer(min_interval={value!r}, asynchronous=False); a synchronous checkpointer "
            f"writes every save before the loop goes on. Drop min_interval, or keep asynchronous=True."
        )


@attrs.frozen
class Checkpointer:
    """Save a checkpoint at the end of every ``every``-th epoch (and the last), with orbax;
    or, with ``every_n_steps=N``, every N optimizer steps (mid-epoch too) and at the run's end,
    instead of at epoch ends (so ``every`` and ``every_n_steps`` together are refused).

    Every checkpoint is a resume point: ``resume="auto"`` continues from its step, with the
    data position, the PRNG key and the open history row it recorded.

    ``keep``: the policies whose union is kept, e.g. ``(jn.Best(3), jn.Last(1))``; None
    keeps ``(Best(1), Last(1))`` when the experiment has a ``monitor`` hook and a
    ``val`` split, ``(Last(1),)`` otherwise. ``asynchronous``: write on a worker thread
    (the run's end waits for the last write); False writes before the loop goes on.
    ``min_interval``: seconds from the end of one burst of writes to the start of the next;
    the epochs that end meanwhile are held as device snapshots (those ``keep`` would delete
    anyway are dropped) and written together when it has passed, or at the run's end.
    ``"auto"`` (the default) waits ``1 / WRITE_SHARE - 1`` times the CPU time the last
    burst took (its writer thread's, times ``HELPER_CPU``), so writing takes at most
    ``WRITE_SHARE`` of the run's time on the cores, however long it waits for them; ``0`` writes each
    save as soon as the worker is free. What a run keeps at its end is the same either way.
    """

    keep: tuple | None = attrs.field(default=None, converter=_keep, validator=_check_keep)
    every: int = attrs.field(default=1, validator=_every)
    asynchronous: bool = True
    min_interval: float | str = attrs.field(default="auto", validator=_min_interval)
    every_n_steps: int | None = attrs.field(default=None, validator=_every_n_steps, kw_only=True)

    def policies(self, monitor, validated: bool) -> tuple:
        if self.keep is not None:
            return self.keep
        return (Best(1), Last(1)) if monitor is not None and validated else (Last(1),)


# -- the hooks ----------------------------------------------------------------------------------


@hookimpl(trylast=True)
def jaxnitro_exports():
    return {"Checkpointer": Checkpointer, "Best": Best, "Last": Last, "Average": Average}


@hookimpl(trylast=True)
def jaxnitro_accept_knob(name, value, nitro):
    """Take the ``checkpointer`` knob: a :class:`Checkpointer`; ``Best`` needs a monitor and a ``val`` split."""
    if name != "checkpointer":
        return None
    source = nitro.settings.source("checkpointer")
    if not isinstance(value, Checkpointer):
        raise TypeError(
            f"jaxnitro: `checkpointer` = {value!r} ({source}); give jn.Checkpointer(keep=(jn.Best(3), "
            f"jn.Last(1))), or None to save no checkpoints."
        )
    if any(isinstance(k, Best) for k in value.keep or ()):
        require_monitor_and_val(nitro.settings, nitro.data, type(nitro.experiment).__name__, "checkpointer",
                                "keeps the Best checkpoints", "keep only jn.Last(n)")
    return True


def _saver(run):
    """The run's saver (in the run's store: it lives as long as the run), or None."""
    return run.store(__name__).get("saver")


def _mine(run):
    """The run's ``checkpointer`` value when this plugin accepted it (so applies it), else None."""
    ckpt = run.settings.checkpointer
    return ckpt if isinstance(ckpt, Checkpointer) and owns_knob(run, "checkpointer", __name__) else None


@hookimpl(trylast=True)
def jaxnitro_run_start(run):
    ckpt = _mine(run)
    if ckpt is not None:
        run.store(__name__)["saver"] = _Saver(run, ckpt)


@hookimpl(trylast=True)
def jaxnitro_step_period(run):
    ckpt = _mine(run)
    return ckpt.every_n_steps if ckpt is not None else None


@hookimpl(trylast=True)
def jaxnitro_step_boundary(run, step, epoch):
    saver = _saver(run)
    if saver is not None:
        saver.step_boundary(step)


@hookimpl(trylast=True)
def jaxnitro_epoch_trained(run, epoch, step, stats):
    saver = _saver(run)
    if saver is not None:
        saver.epoch_trained(epoch, step)


@hookimpl(trylast=True)
def jaxnitro_epoch_end(run, row):
    saver = _saver(run)
    if saver is not None:
        saver.epoch_end(row)


@hookimpl(trylast=True)  # before any run_finish: a save failing at the run's end fails the run
def jaxnitro_run_ending(run, status):
    saver = run.store(__name__).pop("saver", None)
    if saver is not None:
        saver.finish(status)


# -- saving ---------------------------------------------------------------------------------------


def _is_epoch_end(metrics) -> bool:
    return bool(metrics) and metrics.get(_EPOCH_END) == 1


@attrs.define
class _LastEpochEnds:
    """orbax preservation policy: the ``n`` newest epoch-end checkpoints."""

    n: int

    def should_preserve(self, checkpoints, *, context):
        ends = [i for i, c in enumerate(checkpoints) if _is_epoch_end(c.metrics)]
        keep = set(ends[-self.n :])
        return [i in keep for i in range(len(checkpoints))]


@attrs.define
class _NewestRunEnd:
    """orbax preservation policy: a run-end checkpoint (interrupted, diverged) while it is the newest."""

    def should_preserve(self, checkpoints, *, context):
        return [i == len(checkpoints) - 1 and not _is_epoch_end(c.metrics) for i, c in enumerate(checkpoints)]


@attrs.define
class _BestEpochEnds:
    """orbax preservation policy: the ``n`` epoch-end checkpoints whose monitored value is best,
    ranked by :func:`jaxnitro.history.best_positions` (the earliest of tied epochs first: the
    history's starred epoch is the one kept and loaded), not by orbax's ``BestN`` (which keeps
    the latest of a tie)."""

    name: str
    mode: str
    n: int

    def should_preserve(self, checkpoints, *, context):
        ends = [i for i, c in enumerate(checkpoints) if _is_epoch_end(c.metrics)]
        values = [checkpoints[i].metrics.get(self.name) for i in ends]
        keep = {ends[p] for p in best_positions(values, self.mode, self.n)}
        return [i in keep for i in range(len(checkpoints))]


@attrs.define
class _Known:
    """A policy's view of a checkpoint whose metrics orbax did not keep (see below)."""

    step: int
    metrics: dict | None
    time: object


@attrs.define
class _WithKnownMetrics:
    """orbax preservation policy: ``inner``, with the metrics of checkpoints saved by an
    earlier process filled in from their own records.

    orbax keeps the metrics given to ``save`` in memory only (it writes them to disk only
    for its legacy ``best_fn`` mode), so a resumed run reopening its folder would see its
    earlier checkpoints without metrics, and its first save would prune them all, better
    ones included. ``known`` maps those steps to the metrics their JSON record holds.
    """

    inner: object
    known: dict

    def should_preserve(self, checkpoints, *, context):
        filled = [
            c if c.metrics or c.step not in self.known else _Known(c.step, self.known[c.step], c.time)
            for c in checkpoints
        ]
        return self.inner.should_preserve(filled, context=context)


def _policy(policies, monitor, known: dict):
    return _WithKnownMetrics(_policy_of(policies, monitor), known)


def _policy_of(policies, monitor):
    parts = [_NewestRunEnd()]
    for p in policies:
        if isinstance(p, Last):
            parts.append(_LastEpochEnds(p.n))
        elif monitor is not None:
            parts.append(_BestEpochEnds(monitor[0], monitor[1], p.n))
    return _ocp().checkpoint_managers.AnyPreservationPolicy(parts)


def _recorded_metrics(directory: str, monitor) -> dict:
    """``{step: orbax metrics}`` rebuilt from the JSON records of the checkpoints already in
    ``directory`` (empty for a new run folder); an unreadable record is left out."""
    if not os.path.isdir(directory):
        return {}
    ocp = _ocp()
    options = ocp.CheckpointManagerOptions(read_only=True, create=False, save_interval_steps=0)
    with _quiet_absl("is read only"):
        reader = ocp.CheckpointManager(directory, options=options)
    records = {}
    for step in reader.all_steps():
        try:
            meta = reader.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception:  # noqa: BLE001 - a damaged record: orbax's own view stands
            continue
        if isinstance(meta, dict):
            records[step] = meta
    reader.close()
    known = {}
    for step, meta in _ranked_records(records).items():
        metrics = {_EPOCH_END: 1.0 if meta.get("end") is None else 0.0}
        value = (meta.get("metrics") or {}).get(monitor[0]) if monitor is not None else None
        if isinstance(value, (int, float)) and math.isfinite(float(value)):
            metrics[monitor[0]] = float(value)
        known[step] = metrics
    return known


def _ranked_records(records: dict) -> dict:
    """``records`` (``{step: JSON record}`` of one run folder's checkpoints), with each run-end
    checkpoint that a later run validated read as the epoch-end checkpoint it stands for.

    A stop at a row's end before its validation leaves a run-end checkpoint without metrics at
    that step; the run resumed from it validates the row first, on exactly those parameters,
    and normally rewrites that record (``_Saver._rank_run_end``). Where it could not (or a run
    of an older jaxnitro resumed there), the ``validated`` records of the folder's checkpoints
    (``[epoch, value, step]`` at every validation of the run and the runs it resumed from; a
    newer record wins) name that step: the checkpoint then reads as an epoch end whose metrics
    are that monitored value. A diverged checkpoint never does (its state is not a validated
    one), nor a record that has metrics or entries without a step (``[epoch, value]``)."""
    seen = {}
    for step in sorted(records):
        validated = records[step].get("validated") or {}
        for entry in validated.get("values") or ():
            if isinstance(entry, (list, tuple)) and len(entry) >= 3 and isinstance(entry[2], int):
                seen[entry[2]] = (validated.get("name"), entry[1])
    out = dict(records)
    for step, meta in records.items():
        if step in seen and _unranked_run_end(meta, step):
            name, value = seen[step]
            try:
                value = float(value)
            except (TypeError, ValueError):
                value = math.nan
            out[step] = dict(meta, end=None, validated_after=meta.get("end"),
                             metrics={name: value} if isinstance(name, str) and math.isfinite(value) else {})
    return out


@jax.jit
def _copy_leaves(leaves: list) -> list:
    return [jnp.copy(x) for x in leaves]  # a copy primitive: never the input buffer forwarded


def _copy(tree):
    """A device copy of ``tree`` that the next train step cannot donate: one compiled program
    over all leaves (each output on its input's sharding, also for a global array of a
    multi-process run). Dispatching it costs ~0.2 ms for the tutorial's 21-leaf state against
    ~0.8 ms for a batched ``device_put(..., may_alias=False)``; it compiles once per state
    structure (a per-leaf ``jnp.array(x, copy=True)`` compiled a program per leaf shape)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return jax.tree_util.tree_unflatten(treedef, _copy_leaves(leaves))


def _rng_record(rng) -> dict:
    if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
        rng = jax.random.key_data(rng)
    arr = np.asarray(rng)
    return {"data": arr.tolist(), "dtype": str(arr.dtype)}


@attrs.define(eq=False)
class _Pending:
    """A checkpoint on its way to disk; ``state`` is a device snapshot, released once written."""

    step: int
    state: object
    row: dict | None
    meta: dict
    end: str | None
    metrics: dict


class _Saver:
    """One run's checkpoints: the orbax manager, and a worker thread that feeds it.

    At an epoch's end the state is copied on the device (``_copy``, asynchronous: the next
    epoch's steps donate the published buffers, never this copy) and queued for one worker
    thread, which calls orbax's synchronous save (host transfer, write into a
    temporary folder, rename, deletion of what the policies no longer keep). That is the
    asynchrony: orbax's own asynchronous mode (``enable_async_checkpointing``) blocks its
    caller for the host transfer and directory setup (~10-20 ms here) and lets one save in
    flight, so called from the loop it would cost the loop more, and called from the
    worker it only adds threads (~5 ms more CPU per save). Queued checkpoints that the
    policies would delete right after writing are dropped unwritten (``_prune``). The
    worker writes in bursts paced by ``Checkpointer.min_interval`` (``_drain``): the
    checkpoints queued while it waits are held, and most of them dropped. The loop waits
    only when ``MAX_QUEUED`` snapshots are held (more for a state that fits
    ``QUEUE_BYTES``), and the worker then writes at once; the run's end (``finish``) writes
    and waits for every save.

    Without a ``val`` split the loop does not wait at epoch boundaries: epoch k's
    ``epoch_end`` can arrive after epoch k + 1 has started. Such an epoch's state is
    copied at ``epoch_trained``, when it is still the published one.
    """

    def __init__(self, run, ckpt: Checkpointer):
        self.run, self.ckpt = run, ckpt
        nitro = run.nitro
        self.validated = "val" in nitro.data
        self.monitor = run.monitor
        self.dir = os.path.join(os.path.abspath(run.run_dir), CHECKPOINTS)
        self.folder_id = _identity(run.run_dir)  # a save never recreates a deleted run folder
        ocp = _ocp()
        exists, dist = os.path.isdir(self.dir), nitro.plan.dist
        if dist is not None and dist.multi_process:  # every process takes the same orbax path
            exists = dist.from_main(exists)
        known = _recorded_metrics(self.dir, self.monitor) if exists else {}  # a continued run folder's
        self.policy = _policy(ckpt.policies(self.monitor, self.validated), self.monitor, known)
        single = not (dist is not None and dist.multi_process)
        options = ocp.CheckpointManagerOptions(
            preservation_policy=self.policy,
            enable_async_checkpointing=False,  # the worker thread is the asynchrony (fewer threads, less CPU)
            cleanup_tmp_directories=True,  # what a killed save left behind in a continued run folder
            create=True,
            # deleting what `keep` no longer selects (about half a save's wall time) on orbax's
            # deleter thread, after the newer checkpoint is complete: the next write starts at
            # once; `close` (the run's end) waits for it. One process only: several keep their
            # deletions in step with the saves.
            enable_background_delete=single,
        )
        self.mgr = ocp.CheckpointManager(self.dir, options=options)
        self.start_step = nitro.step
        self.saved = set(self.mgr.all_steps())
        self.snapshots: dict[int, object] = {}
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="jaxnitro-checkpoint")
        self.lock = threading.Condition()
        self.queue: list[_Pending] = []  # waiting for the worker thread, oldest first
        self.writing: _Pending | None = None  # the one the worker thread writes
        self.working = False  # a worker thread is running (waiting for the interval, or writing)
        self.finishing = False  # the run's end: write what is queued without waiting
        self.next_burst = 0.0  # time.monotonic() before which the worker does not start writing
        self.error: BaseException | None = None  # the first failed save, raised on the loop's thread
        self.error_step: int | None = None  # its step
        self.on_disk = {s: known.get(s) for s in self.saved}  # orbax's list: step -> its metrics
        self.coalesce = not getattr(nitro.plan.dist, "multi_process", False)  # see _prune
        self.written = self.dropped = 0
        size = sum(getattr(x, "nbytes", 0) for x in jax.tree_util.tree_leaves(nitro.state))
        self.max_held = max(MAX_QUEUED, QUEUE_BYTES // max(size, 1))
        self.static = self._static_meta()
        self.earlier = _earlier_validations(nitro.plan, self.monitor)

    def due(self, epoch: int) -> bool:
        """Whether epoch ``epoch``'s end is saved (never with ``every_n_steps``: steps decide)."""
        if self.ckpt.every_n_steps is not None:
            return False
        last = self.run.settings.max_epochs
        return epoch % self.ckpt.every == 0 or (last is not None and epoch >= last)

    def step_boundary(self, step: int) -> None:
        """``every_n_steps``: save the state after ``step`` when it is a multiple of N (its
        row's metrics go with it when a row closed there)."""
        self.raise_failed()  # at every step boundary: a failed save stops the run at the first one after it
        n = self.ckpt.every_n_steps
        if n is None or step % n:
            return
        run_state = self.run.run_state
        self.submit(run_state.snapshot(_copy(run_state.state)), end=None)

    def epoch_trained(self, epoch: int, step: int) -> None:
        self.raise_failed()  # every epoch's end, validated or not: a failed save stops the run there
        if not self.validated and self.due(epoch):
            self.snapshots[epoch] = _copy(self.run.run_state.state)

    def epoch_end(self, row: dict) -> None:
        self.raise_failed()
        if self._rank_run_end(row):
            return
        epoch, run_state = row["epoch"], self.run.run_state
        state = self.snapshots.pop(epoch, None)
        if state is None and run_state.state.step == row["step"]:
            state = _copy(run_state.state)
        if state is not None and self.due(epoch):
            self.submit(run_state.snapshot(state), end=None)

    def _saves_at(self, step: int, epoch: int) -> bool:
        """Whether an uninterrupted run saves at ``step`` (of ``epoch``): a multiple of
        ``every_n_steps``, or the end of an epoch :meth:`due` saves (known only with a len())."""
        n, spe = self.ckpt.every_n_steps, self.run.steps_per_epoch
        return step % n == 0 if n is not None else spe is not None and step % spe == 0 and self.due(epoch)

    def _rank_run_end(self, row: dict) -> bool:
        """A resumed run validated the row it resumed in (a stop at that row's end came before its
        validation): the checkpoint it resumed from, at that step, is an earlier run's run-end
        checkpoint holding exactly the validated parameters (nothing was trained since). Make it
        the epoch-end checkpoint it stands for, without writing its arrays again: its JSON record
        is replaced (atomically) by one with the row's metrics, no open row and this validation
        in ``validated``; then ``keep`` ranks it from now on, and what it no longer keeps is
        deleted as the uninterrupted run's save of that step would have. When the record cannot
        be written, ``keep`` ranks it all the same but deletes nothing before the next save
        (whose record names this validation: :func:`_ranked_records`). Whether it is ranked."""
        step, plan = row.get("step"), self.run.nitro.plan
        # the resumed run's first row, at the step it resumed from (on disk before it started: it saves nothing before)
        if not (plan.resumed is not None and step == self.start_step and step in self.on_disk
                and not _is_epoch_end(self.on_disk[step]) and _unranked_run_end(plan.weights_meta or {}, step)
                and self._saves_at(step, row["epoch"])):
            return False
        dist = plan.dist
        main = dist is None or not dist.multi_process or dist.is_main
        amended = self._amend_record(step, row) if main else None
        if dist is not None and dist.multi_process:  # every process ranks and deletes the same checkpoints
            amended = dist.from_main(amended)
        if amended is None:  # its record on disk is not such a one
            return False
        metrics = self._metrics(row, None)
        with self.lock:
            self.on_disk[step] = metrics
            self.policy.known[step] = metrics  # what orbax's policy sees of it at the next save
            idle = not self.working and self.writing is None and not self.queue
        if amended and idle:  # else the next save applies `keep` with it
            self._apply_keep()
        return True

    def _amend_record(self, step: int, row: dict) -> bool | None:
        """Replace the run-end record of ``step`` (written by an earlier run, no metrics) by the
        epoch-end record ``row`` gives it: written to a temporary file, then renamed over it, so
        a reader (or a kill) sees the one or the other. True when it did; False when writing
        failed (warned about); None when the record there is not such a one."""
        path = os.path.join(self.dir, str(step), "meta", "metadata")  # orbax's JsonSave file of item `meta`
        try:
            with open(path) as f:
                old = json.load(f)
            if not _unranked_run_end(old, step):
                return None
            now = self.run.run_state.snapshot()  # the run after the validation: the row closed
            new = dict(old, metrics=jsonable(dict(row), strict=False), end=None,
                       progress=dict(old.get("progress") or {}, open_row=now.open_row),
                       validated=self._validated(now.rows), validated_after=old["end"])
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                f.write(json.dumps(new))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            return True
        except (OSError, ValueError) as err:  # ValueError: an unreadable record
            warnings.warn(
                f"jaxnitro: the checkpoint {os.path.join(self.dir, str(step))} (saved as an earlier run ended, "
                f"before its row's validation, which this run did) could not be given that row's metrics: "
                f"{type(err).__name__}: {err}. This run's `keep` ranks it all the same, but nothing it no "
                f"longer keeps is deleted, and \"best\" (or a run reopening the folder) does not rank it, "
                f"until a newer checkpoint of this run is written (its record names this validation).",
                RuntimeWarning, stacklevel=2)
            return False

    def _apply_keep(self) -> None:
        """Delete the checkpoints on disk that ``keep`` no longer preserves (on the loop's thread,
        the worker idle): what orbax does after a save, here after a checkpoint was ranked."""
        listed = [_Known(s, m, None) for s, m in sorted(self.on_disk.items())]
        preserve = self.policy.should_preserve(listed, context=_ocp().checkpoint_managers.PreservationContext())
        for c, keep in zip(listed, preserve):
            if not keep:
                self.mgr.delete(c.step)
        steps = self.mgr.all_steps()
        with self.lock:
            self.on_disk = {s: self.on_disk.get(s) for s in steps}

    def finish(self, status: str) -> None:
        try:
            # no run state: the loop never started, nothing was trained
            saved = self.run.run_state.snapshot() if self.run.run_state is not None else None
            row = saved.row if saved is not None else None
            # this runs before the loggers finish: what they logged up to the step goes out first
            if status == "done" and row is not None and math.isfinite(row.get("train_loss", 0.0)):
                if saved.step not in self.saved:
                    _flush_loggers(self.run)
                self.submit(saved, end=None)  # the last epoch, when `every` skipped it
            elif status in ("interrupted", "preempted", "diverged") and saved is not None and saved.step > self.start_step:
                if saved.step not in self.saved:
                    _flush_loggers(self.run)
                self.submit(saved, end=status)
        finally:
            self.snapshots.clear()
            with self.lock:  # the run's end waits for every save
                self.finishing = True
                self.lock.notify_all()
                self.lock.wait_for(lambda: not self.working and self.writing is None)
            self.pool.shutdown(wait=True)
            try:
                self.raise_failed()
            finally:
                self.mgr.wait_until_finished()
                self._close()

    def _close(self) -> None:
        """Close the orbax manager: waits for its deleter thread; a deletion that failed there
        (the first stops the rest) fails the run, naming the folder and what is on disk."""
        try:
            self.mgr.close()
        except Exception as err:  # noqa: BLE001 - re-raised with what it means for the run
            raise RuntimeError(
                f"jaxnitro: deleting a checkpoint that `keep` no longer selects under {self.dir} failed: "
                f"{type(err).__name__}: {err}. The run stops as 'failed'; every checkpoint it wrote is "
                f"complete (the kept ones are steps {sorted(self.on_disk)}), and the folders of steps not "
                f"among them are left over. Fix the folder's permissions (or the disk), delete those "
                f"folders, and resume='auto' continues from the newest."
            ) from err

    def raise_failed(self) -> None:
        """Re-raise the first failed save (a full disk, a permission error, a deleted run
        folder) on the loop's thread, naming the folder, the step, the error and the
        checkpoints still on disk; the run then ends ``"failed"``."""
        with self.lock:
            err, step, self.error = self.error, self.error_step, None
            on_disk = sorted(self.on_disk)
        if err is None:
            return
        which = f"of step {step} " if step is not None else ""
        if on_disk:
            kept = (f"the checkpoints on disk are steps {on_disk} (the newest: {os.path.join(self.dir, str(on_disk[-1]))}; "
                    f"resume='auto' continues from it once the cause is fixed)")
        else:
            kept = "no checkpoint of this run is on disk (nothing to resume from)"
        fix = ("Keep the run folder while a run writes it; train again into a new one." if isinstance(err, _FolderGone)
               else "Free disk space (or fix the folder's permissions) and train again.")
        raise RuntimeError(
            f"jaxnitro: saving the checkpoint {which}under {self.dir} failed: {type(err).__name__}: {err}. "
            f"The run stops as 'failed'; {kept}. {fix}"
        ) from err

    def submit(self, saved, end) -> None:
        """Queue one checkpoint of ``saved`` (a :class:`SavedRun` whose state nobody donates) for
        the worker thread; a diverged ``end`` keeps no row and no open row (no resume point).

        The checkpoints the keep policies would delete as soon as the newer ones are written
        are dropped before they are written (see ``_prune``). The loop waits only when
        ``max_held`` snapshots are still held after that.
        """
        step = saved.step
        if step in self.saved:
            return
        self.saved.add(step)
        row = saved.row if end != "diverged" else None
        item = _Pending(step, saved.state, row, dict(self.static, **self._position(saved, row, end)), end,
                        self._metrics(row, end))
        with self.lock:
            self.queue.append(item)
            self._prune()
            if not self.queue:
                return
            # several processes: orbax's cross-process barriers must come in the same order as
            # the train steps' collectives on every process, so saves run on the loop's thread
            if not self.ckpt.asynchronous or not self.coalesce:
                self.writing = self.queue.pop()
            else:
                if not self.working:
                    self.working = True
                    self.pool.submit(self._drain)
                self.lock.notify_all()
                # saves slower than epochs: wait rather than hold more device copies
                self.lock.wait_for(lambda: (self.writing is not None) + len(self.queue) <= self.max_held)
                return
        self._write_one()  # on the loop's thread
        self.raise_failed()

    def _prune(self) -> None:
        """Drop the queued checkpoints that the keep policies would delete once the newer ones
        (queued or written) are on disk. Under ``self.lock``.

        orbax applies the preservation policy after every save, to every checkpoint; the
        policies are monotone (a checkpoint that one more newer checkpoint makes deletable
        stays deletable), so a queued checkpoint they do not preserve in the list of the
        checkpoints on disk, the one being written and the queued ones would be written
        and then deleted: when saves fall behind the epochs or wait for ``min_interval`` (or
        a worse epoch under ``Best(n)`` alone), it is not written at all. The one being
        written is never dropped. In a multi-process run every
        process must make the same saves, which timing would not guarantee: nothing is dropped.
        """
        if not self.queue or not self.coalesce:
            return
        listed = [_Known(s, m, None) for s, m in sorted(self.on_disk.items())]
        listed += [_Known(p.step, p.metrics, None) for p in ([self.writing] if self.writing else []) + self.queue]
        preserve = dict(zip((c.step for c in listed),
                            self.policy.should_preserve(listed, context=_ocp().checkpoint_managers.PreservationContext())))
        kept = [p for p in self.queue if preserve[p.step]]
        self.dropped += len(self.queue) - len(kept)
        self.queue = kept

    def _drain(self) -> None:
        """The worker thread: wait until ``next_burst`` (or the run's end, or a full queue), then
        write the checkpoints queued by then, oldest first; again until the queue is empty."""
        try:
            while True:
                with self.lock:
                    while self.queue and not self._burst_due():
                        self.lock.wait(timeout=max(self.next_burst - time.monotonic(), 0.001))
                    burst = len(self.queue)
                    if not burst:
                        self.working = False
                        self.lock.notify_all()
                        return
                started = time.thread_time()  # this thread's CPU: not the waits for a core or the disk
                for _ in range(burst):
                    with self.lock:
                        if not self.queue:  # pruned meanwhile
                            break
                        self.writing = self.queue.pop(0)
                    self._write_one()
                took = (time.thread_time() - started) * HELPER_CPU  # the burst's CPU, helper threads included
                gap = took * (1 / WRITE_SHARE - 1) if self.ckpt.min_interval == "auto" else self.ckpt.min_interval
                with self.lock:
                    self.next_burst = time.monotonic() + gap
        except BaseException as err:  # never leave the loop or the run's end waiting
            with self.lock:
                self.error, self.writing, self.queue, self.working = self.error or err, None, [], False
                self.lock.notify_all()
            raise

    def _burst_due(self) -> bool:
        """Under ``self.lock``: whether the worker writes now rather than waits for ``next_burst``."""
        return (self.finishing or time.monotonic() >= self.next_burst
                or len(self.queue) >= self.max_held)  # one more epoch's end would make the loop wait

    def _write_one(self) -> None:
        """Write ``self.writing``, then record, under the lock, what orbax kept and deleted."""
        item, error = self.writing, None
        try:
            self.write(item)
        except Exception as err:  # noqa: BLE001 - re-raised on the loop's thread
            error = err
        item.state = None  # the device copy goes now
        steps = self.mgr.all_steps()  # orbax's cached list: what it kept and deleted
        with self.lock:
            if self.error is None and error is not None:
                self.error, self.error_step = error, item.step
            metrics = {**self.on_disk, item.step: item.metrics}
            self.on_disk = {s: metrics.get(s) for s in steps}
            self.writing = None
            self.lock.notify_all()

    def _metrics(self, row, end) -> dict:
        """What orbax's preservation policies see of a checkpoint (saved in memory only)."""
        metrics = {_EPOCH_END: 1.0 if end is None else 0.0}
        if row is not None and self.monitor is not None:
            value = row.get(self.monitor[0])
            if isinstance(value, (int, float, np.number)) and math.isfinite(float(value)):
                metrics[self.monitor[0]] = float(value)
        return metrics

    def write(self, item: _Pending) -> None:
        """One orbax save: host copy, write into ``<step>.orbax-checkpoint-tmp``, rename, then
        orbax deletes what the policies no longer keep (all on the worker thread)."""
        state, meta = item.state, item.meta
        tree = {"params": state.params}
        if state.model_state is not None:
            tree["model_state"] = state.model_state
        if state.opt_state is not None:
            tree["opt_state"] = rule_state_of(state.opt_state)
            if ema_of(state.opt_state) is not None:
                tree["ema"] = ema_of(state.opt_state)
        meta["items"] = list(tree)
        if _identity(self.run.run_dir) != self.folder_id:
            there = "is gone" if not os.path.isdir(self.run.run_dir) else "was deleted and made again"
            raise _FolderGone(
                errno.ENOENT,
                f"the run folder {there} (deleted while the run was writing it); the checkpoint is not "
                f"written, so that a checkpoint never reappears without the rest of its run folder",
                self.run.run_dir,
            )
        if self.coalesce:  # one process holds every shard: host arrays cost orbax ~27% less CPU a save
            tree = jax.device_get(tree)  # (measured on the tutorial's state: 31 ms against 42 ms)
        # one pytree item and the JSON record (that item and the manager's own work: ~8 ms CPU)
        ocp = _ocp()
        args = ocp.args.Composite(state=ocp.args.StandardSave(tree), meta=ocp.args.JsonSave(meta))
        self.mgr.save(item.step, args=args, metrics=item.metrics, force=True)
        self.written += 1

    def _static_meta(self) -> dict:
        """The parts of the record every checkpoint of the run shares."""
        nitro = self.run.nitro
        e, state = nitro.experiment, nitro.state
        return {
            "format": FORMAT,
            "jaxnitro": jaxnitro.__version__,
            "experiment": {"module": type(e).__module__, "qualname": type(e).__qualname__},
            "graph_const": {
                n: jsonable(getattr(e, n), strict=False) for n, i in fields_of(e).items() if i.is_graph_const
            },
            "derived": {n: jsonable(v, strict=False) for n, v in (nitro.plan.derived or {}).items()},
            "tree": {
                "params": tree_listing(state.params),
                "model_state": tree_listing(state.model_state) if state.model_state is not None else None,
            },
            "steps_per_epoch": self.run.steps_per_epoch,
            "accum": nitro.settings.accum,
            # the train batch size of the whole job (each process reads its share): a resume must read the same
            "batch_width": nitro.plan.width * getattr(nitro.plan.dist, "process_count", 1) if nitro.plan.width else None,
            "seed": nitro.settings.seed,
            "rng": _rng_record(state.rng),
            "monitor": list(self.monitor) if self.monitor else None,
        }

    def _position(self, saved: SavedRun, row, end) -> dict:
        """The parts of the record that come from ``saved`` (the run after its step)."""
        step, position = saved.step, dict(saved.data_position)
        complete = position.pop("epoch_complete")
        epoch = position["epoch"] if complete else int(saved.state.epoch)
        return {
            "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "step": step,
            "epoch": epoch,
            "epoch_complete": complete,
            "data_position": position,
            "metrics": jsonable(dict(row), strict=False) if row is not None else None,
            "end": end,
            "progress": {"open_row": saved.open_row if end != "diverged" else None},
            "validated": self._validated(saved.rows),
            "horizon": self.run.horizon,  # the steps the schedules were planned over
        }

    def _validated(self, rows) -> dict | None:
        """The monitored metric at every validation up to the step, oldest first (those before a
        resume point from its checkpoint): ``{"name", "values": [[epoch, value, step], ...]}``, what
        a stop policy replays when a run resumes here; None without a ``monitor``."""
        if self.monitor is None:
            return None
        name = self.monitor[0]
        values = [[r["epoch"], _json_number(r[name]), r["step"]] for r in rows if name in r]
        return {"name": name, "values": self.earlier + values}


def _unranked_run_end(meta, step: int) -> bool:
    """Whether ``meta`` is the record of a run-end checkpoint at ``step`` whose row was not
    validated (no metrics): a stop at its end, not a diverged run."""
    return (isinstance(meta, dict) and meta.get("step") == step and meta.get("end") not in (None, "diverged")
            and meta.get("metrics") is None)


def _json_number(value):
    """A monitored value for JSON: a float, or its name when not finite ("nan", "inf", "-inf");
    ``float()`` reads either back."""
    value = float(value)
    return value if math.isfinite(value) else str(value)


def _earlier_validations(plan, monitor) -> list:
    """The ``validated`` values recorded by the checkpoint a run resumed from, when it monitored
    the same metric; else none."""
    record = (plan.weights_meta or {}).get("validated") if plan.resumed is not None else None
    if not record or monitor is None or record.get("name") != monitor[0]:
        return []
    return [list(v) for v in record["values"]]


class _FolderGone(FileNotFoundError):
    """A save refused because the run folder was deleted while the run wrote it."""


def _identity(folder):
    """``(device, inode)`` of ``folder``, or None when it does not exist."""
    try:
        st = os.stat(folder)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def _flush_loggers(run) -> None:
    """Push the run's loggers' buffered lines out (their optional ``flush`` verb); a logger that
    fails here has already been reported, or will be at its ``finish``."""
    for logger in getattr(run, "loggers", None) or ():
        flush = getattr(logger, "flush", None)
        if callable(flush):
            try:
                flush()
            except Exception:  # noqa: BLE001 - never in the way of the run's last checkpoint
                pass


# -- reading --------------------------------------------------------------------------------------


@contextlib.contextmanager
def _quiet_absl(text: str):
    """Drop absl log records containing ``text`` for the duration of the block."""

    def keep(record: logging.LogRecord) -> bool:
        return text not in record.getMessage()

    log = logging.getLogger("absl")
    log.addFilter(keep)
    try:
        yield
    finally:
        log.removeFilter(keep)


class _RunFolder:
    """The finished checkpoints of one run folder, read with a read-only orbax manager."""

    def __init__(self, path: Path):
        self.path = path
        self.ckpt_dir = path / CHECKPOINTS
        self._mgr = None
        self._meta: dict[int, dict] = {}
        self._ranked: dict[int, dict] | None = None

    @property
    def mgr(self):
        if self._mgr is None:
            ocp = _ocp()
            options = ocp.CheckpointManagerOptions(read_only=True, create=False, save_interval_steps=0)
            with _quiet_absl("is read only"):  # reading is what we mean: orbax need not warn about it
                self._mgr = ocp.CheckpointManager(str(self.ckpt_dir.resolve()), options=options)
        return self._mgr

    @property
    def steps(self) -> list[int]:
        if not self.ckpt_dir.is_dir():
            return []
        return sorted(self.mgr.all_steps())

    def step_path(self, step: int) -> str:
        return str(self.ckpt_dir.resolve() / str(step))

    def _read_meta(self, step: int) -> dict:
        if step not in self._meta:
            ocp = _ocp()
            got = self.mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
            meta = got["meta"]
            if not isinstance(meta, dict) or "step" not in meta:
                raise ValueError("its `meta` item is not a jaxnitro record")
            self._meta[step] = meta
        return self._meta[step]

    def meta(self, step: int) -> dict:
        try:
            return self._read_meta(step)
        except Exception as err:  # noqa: BLE001 - any read failure: the checkpoint is damaged, or gone
            raise _unreadable(self, step, err) from err

    def ranked(self, step: int) -> dict:
        """``meta(step)`` as ``keep`` ranks it: a run-end checkpoint a later run validated reads as
        the epoch-end checkpoint it stands for (:func:`_ranked_records`)."""
        if self._ranked is None:
            self._ranked = _ranked_records({s: self._meta[s] for s in self.readable_steps()})
        return self._ranked[step] if step in self._ranked else self.meta(step)

    def readable_steps(self, skip: int | None = None) -> list[int]:
        out = []
        for s in self.steps:
            if s == skip:
                continue
            try:
                self._read_meta(s)
                out.append(s)
            except Exception:  # noqa: BLE001
                pass
        return out


def _unreadable(folder: _RunFolder, step: int, err: Exception) -> Exception:
    """The error for a checkpoint that could not be read (``err``): :class:`_Vanished` when its
    folder is gone (deleted while it was read), :class:`_Corrupt` when it is still there."""
    if not os.path.isdir(folder.step_path(step)):
        return _Vanished(folder, step, err)
    return _Corrupt(folder, step, err)


class _Vanished(FileNotFoundError):
    """A checkpoint deleted while it was being read: another process is writing its run folder
    (a run still training into it, whose ``keep`` removed that step). Not corrupt, and not a
    :class:`NoCheckpointError` (``resume="auto"`` must not start fresh over it). ``run_folder``
    is that folder (the ``run_lock`` plugin names the run holding it)."""

    def __init__(self, folder: _RunFolder, step: int, err: Exception):
        self.folder, self.step, self.err = folder, step, err
        self.run_folder = str(folder.path.resolve())
        super().__init__(
            f"jaxnitro: the checkpoint {folder.step_path(step)} was deleted while being read "
            f"({type(err).__name__}: {str(err)[:200]}): another process is writing this run folder, "
            f"and its checkpointer's `keep` removed that step; the checkpoint is not corrupt. "
            f"Wait for that run to end (or stop it) and try again, or name a checkpoint of a run "
            f"nobody is writing; nothing was changed on disk."
        )


class _Corrupt(ValueError):
    def __init__(self, folder: _RunFolder, step: int, err: Exception):
        self.folder, self.step, self.err = folder, step, err
        others = folder.readable_steps(skip=step)
        hint = (
            f" The newest complete checkpoint of that run is {folder.step_path(others[-1])}."
            if others
            else " That run has no other complete checkpoint."
        )
        super().__init__(
            f"jaxnitro: the checkpoint {folder.step_path(step)} is corrupt or incomplete and cannot be "
            f"read ({type(err).__name__}: {str(err)[:300]}).{hint} Name a complete one (a path, or "
            f"(run, step)); nothing was changed on disk."
        )


def _run_key(path: Path):
    m = _RUN_NAME.match(path.name)
    return (m.group(1), int(m.group(2))) if m else None


def _runs(run_dir) -> list[Path]:
    """Run folders under ``run_dir`` that hold checkpoints, newest first."""
    root = Path(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _run_key(p) and (p / CHECKPOINTS).is_dir()]
    return sorted(found, key=_run_key, reverse=True)


def _inventory(run_dir) -> str:
    root = Path(run_dir).resolve()
    if not root.is_dir():
        return f"run_dir {str(root)!r} does not exist"
    lines = []
    for p in sorted((p for p in root.iterdir() if p.is_dir()), key=lambda p: p.name)[-12:]:
        steps = _RunFolder(p).steps if (p / CHECKPOINTS).is_dir() else []
        lines.append(f"  {p.name}: " + (f"checkpoints at steps {steps}" if steps else "no checkpoints"))
    return f"run_dir {str(root)!r} holds:\n" + ("\n".join(lines) if lines else "  nothing")


def _not_found(what: str, run_dir) -> NoCheckpointError:
    """The refusal of a spec that names nothing on disk: ``what`` (kept as the error's ``what``),
    what ``run_dir`` holds, and the forms a spec takes."""
    err = NoCheckpointError(
        f"jaxnitro: {what}. {_inventory(run_dir)}\nName a checkpoint folder (…/checkpoints/<step>), a "
        f"run folder, or a pair such as ('latest', 'best'), ('<run folder name>', <step>)."
    )
    err.what = what
    return err


def _short(spec) -> str:
    text = repr(spec)
    return text if len(text) <= 80 else text[:77] + "..."


def _parse(spec, run_dir, purpose):
    """``(run folder path, which)`` with ``which`` one of "last", "best", "resume", a step, an Average;
    or ``(None, step path)`` for a checkpoint folder."""
    if isinstance(spec, Average):
        return _latest(run_dir, spec), spec
    if isinstance(spec, (str, os.PathLike)):
        text = os.fspath(spec)
        path = Path(text)
        if text == "latest" and not path.exists():  # the newest run's newest checkpoint
            return _latest(run_dir, spec), "resume" if purpose == "resume" else "last"
        if not path.exists() and not path.is_absolute() and len(path.parts) == 1:
            path = Path(run_dir) / text  # a run folder's name
        if _TMP in path.name:
            return None, path
        if not path.exists():
            raise _not_found(f"`{purpose}={_short(spec)}` does not exist", run_dir)
        if (path / CHECKPOINTS).is_dir():
            return path, "resume" if purpose == "resume" else "last"
        if path.name == CHECKPOINTS:
            return path.parent, "resume" if purpose == "resume" else "last"
        return None, path
    if isinstance(spec, tuple) and len(spec) == 2:
        run, which = spec
        if run == "latest":
            folder = _latest(run_dir, spec)
        elif isinstance(run, (str, os.PathLike)):
            folder = Path(os.fspath(run))
            if not folder.exists() and len(folder.parts) == 1:
                folder = Path(run_dir) / folder
            if not (folder / CHECKPOINTS).is_dir():
                raise _not_found(f"run {os.fspath(run)!r} of `{purpose}={_short(spec)}` has no checkpoints", run_dir)
        else:
            raise TypeError(
                f"jaxnitro: `{purpose}={_short(spec)}`: the first element names the run: 'latest', a run "
                f"folder name, or a path."
            )
        if isinstance(which, bool) or not (which in ("best", "last") or isinstance(which, (int, np.integer, Average))):
            raise TypeError(
                f"jaxnitro: `{purpose}={_short(spec)}`: the second element names the checkpoint: 'best', "
                f"'last', a step number, or jn.Average(jn.Last(n)) / jn.Average(jn.Best(n))."
            )
        return folder, which
    raise TypeError(
        f"jaxnitro: `{purpose}={_short(spec)}` is not a checkpoint spec. Give a checkpoint path, a run "
        f"folder, a pair such as ('latest', 'best'), ('latest', 'last'), ('latest', <step>), "
        f"('latest', jn.Average(jn.Last(10))), or another Nitro to warm-start from."
    )


def _latest(run_dir, spec) -> Path:
    runs = [p for p in _runs(run_dir) if _RunFolder(p).steps]
    if not runs:
        raise _not_found(f"no run under run_dir has a checkpoint (looked for `{_short(spec)}`)", run_dir)
    return runs[0]


def _checkpoint_folder(path: Path, run_dir):
    """``(run folder, step)`` of an explicit checkpoint folder; refuses an incomplete one."""
    ckpt_dir = path.parent
    folder = _RunFolder(ckpt_dir.parent)
    if _TMP in path.name or not path.name.isdigit() or int(path.name) not in folder.steps:
        complete = folder.readable_steps() if ckpt_dir.is_dir() else []
        hint = (
            f" The newest complete checkpoint there is {folder.step_path(complete[-1])}."
            if complete
            else f" {_inventory(run_dir)}"
        )
        raise ValueError(
            f"jaxnitro: {str(path)!r} is not a complete checkpoint (a save cut short leaves a folder named "
            f"'<step>{_TMP}-…'; a complete one is named by its step and listed by orbax).{hint}"
        )
    return folder, int(path.name)


def _value(meta, name):
    metrics = from_jsonable(meta.get("metrics") or {})
    v = metrics.get(name)
    return float(v) if isinstance(v, (int, float, np.number)) and math.isfinite(float(v)) else None


def _select(folder: _RunFolder, which, monitor, purpose, spec, run_dir) -> list[int]:
    """The steps ``which`` selects in ``folder`` (several for an average), oldest first."""
    steps = folder.steps
    if not steps:
        raise _not_found(f"run {folder.path.name!r} has no complete checkpoint", run_dir)
    if isinstance(which, (int, np.integer)):
        if int(which) not in steps:
            raise _not_found(f"run {folder.path.name!r} has no checkpoint at step {int(which)} (it has {steps})", run_dir)
        return [int(which)]
    if which in ("last", "resume"):
        for s in reversed(steps):
            meta = folder.meta(s)
            if meta.get("end") == "diverged":
                continue
            return [s]
        raise _not_found(f"run {folder.path.name!r} has no checkpoint to {'resume' if which == 'resume' else 'load'} "
                         f"(only diverged ones)", run_dir)
    policy = which.of if isinstance(which, Average) else which
    if isinstance(policy, Last):
        ends = [s for s in steps if folder.ranked(s).get("end") is None]
        chosen = ends[-policy.n :]
    else:
        n = policy.n if isinstance(policy, Best) else 1
        name, mode = _monitor_of(folder, steps, monitor, spec)
        scored = [(v, s) for s in steps
                  if folder.ranked(s).get("end") is None and (v := _value(folder.ranked(s), name)) is not None]
        if not scored:
            recorded = sorted({k for s in steps for k in (folder.meta(s).get("metrics") or {})} - {"epoch", "step"})
            raise ValueError(
                f"jaxnitro: `{purpose}={_short(spec)}` ranks by {name!r} ({mode}), but no checkpoint of run "
                f"{folder.path.name!r} recorded it (its checkpoints recorded {recorded or 'no metrics'}: a "
                f"run without a `val` split records only train_loss). Name a checkpoint with "
                f"('latest', 'last') or a step, or train with a `val` split that reports {name!r}."
            )
        # the history's rule of "best" (the earliest of tied epochs first), in step order
        chosen = sorted(scored[p][1] for p in best_positions([v for v, _ in scored], mode, n))
    if not chosen:
        raise ValueError(
            f"jaxnitro: `{purpose}={_short(spec)}` selects no checkpoint in run {folder.path.name!r} (it "
            f"has {len(steps)}, none at an epoch's end): an average needs at least one."
        )
    return chosen


def _monitor_of(folder, steps, monitor, spec):
    if monitor is not None:
        return monitor
    for s in reversed(steps):
        saved = folder.meta(s).get("monitor")
        if saved:
            return tuple(saved)
    raise ValueError(
        f"jaxnitro: {_short(spec)} asks for the best checkpoint, but neither the experiment (no `monitor` "
        f"hook) nor the checkpoints say which metric ranks them. Define `monitor`, or name a checkpoint "
        f"with ('latest', 'last') or a step."
    )


def _describe(folder: _RunFolder, steps, which, meta, monitor) -> str:
    step = steps[-1]
    epoch = meta.get("epoch")
    where = f"run {folder.path.name} ({folder.path.parent})"
    if len(steps) > 1 or isinstance(which, Average):
        policy = which.of if isinstance(which, Average) else which
        label = f"Last({policy.n})" if isinstance(policy, Last) else f"Best({policy.n})"
        epochs = [folder.meta(s).get("epoch") for s in steps]
        return f"average of {len(steps)} checkpoints ({label}: epochs {epochs}) of {where}"
    what = f"checkpoint step {step} (epoch {epoch}"
    if which == "best" and monitor is not None:
        what += f", best {monitor[0]}={_value(folder.ranked(step), monitor[0]):.6g}"
    elif meta.get("end"):
        what += f", saved as the run ended {meta['end']}"
    return what + f") of {where}"


def _without_empty_nodes(tree):
    """``tree`` with every leafless custom node (an ``eqx.nn.StateIndex`` in a partitioned
    model's params: BatchNorm's, whose init is a leafless sentinel) replaced by None: orbax's
    partial restore cannot walk a node that flattens to no children (IndexError). The leaves,
    and their order, are unchanged."""
    def empty(x):
        return (x is not None and not isinstance(x, (dict, list, tuple))
                and not jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(x))
                and not jax.tree_util.tree_leaves(x))

    return jax.tree_util.tree_map(lambda x: None if empty(x) else x, tree, is_leaf=empty)


def _restore_fn(folder: _RunFolder, steps: list[int]):
    def read(step, wanted):
        ocp = _ocp()
        wanted = dict(wanted)
        restore = ocp.args.PyTreeRestore(  # only the subtrees asked for: no optimizer state to serve
            item=wanted, restore_args=ocp.checkpoint_utils.construct_restore_args(wanted), partial_restore=True
        )
        try:
            got = folder.mgr.restore(step, args=ocp.args.Composite(state=restore))["state"]
        except Exception as err:  # noqa: BLE001
            raise _unreadable(folder, step, err) from err
        return {item: jax.tree_util.tree_map(jnp.asarray, got[item]) for item in wanted}

    def restore(wanted):
        """``wanted``'s items read (averaged over ``steps``), each rebuilt in ``wanted``'s
        structure: orbax reads the trees without their leafless nodes (:func:`_without_empty_nodes`)."""
        got = read_all({k: _without_empty_nodes(v) for k, v in wanted.items()})
        return {
            k: jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(v), jax.tree_util.tree_leaves(got[k]))
            for k, v in wanted.items() if k in got
        }

    def read_all(wanted):
        newest = read(steps[-1], wanted)
        if len(steps) == 1:
            return newest
        averaged = dict(newest)
        for item in ("params", "ema"):
            if item not in wanted:
                continue
            trees = [newest[item]] + [read(s, {item: wanted[item]})[item] for s in steps[:-1]]
            averaged[item] = jax.tree_util.tree_map(  # on the host: no program per leaf shape
                lambda *xs: jnp.asarray(np.mean([np.asarray(x, np.float64) for x in xs], axis=0).astype(xs[0].dtype)),
                *trees,
            )
        return averaged

    return restore


@hookimpl(trylast=True)
def jaxnitro_load_weights(spec, run_dir, experiment, monitor, purpose):
    """Find the checkpoint(s) ``spec`` names under ``run_dir``; describe them as a WeightsRecord."""
    folder, steps, which, notes = _find(spec, run_dir, experiment, monitor, purpose)
    if isinstance(which, Average) and len(steps) < which.of.n:
        notes.append(_fewer_note(spec, purpose, which, folder, steps))
    meta = folder.meta(steps[-1])
    items = tuple(i for i in meta.get("items", ("params",)) if i != "meta")
    if len(steps) > 1:  # the average's items must be in every checkpoint
        for s in steps[:-1]:
            items = tuple(i for i in items if i in folder.meta(s).get("items", ()))
    # a run continues its folder unless a later checkpoint it could have continued from exists
    # (a diverged one is a dead end that the continued run supersedes)
    later = [s for s in folder.steps if s > steps[-1]]
    continues = all(folder.meta(s).get("end") == "diverged" for s in later)
    return WeightsRecord(
        source=_describe(folder, steps, which, meta, monitor),
        path=folder.step_path(steps[-1]),
        run_folder=str(folder.path.resolve()),
        metadata=meta,
        items=items,
        restore=_restore_fn(folder, steps),
        newest_in_run=continues,
        notes=tuple(notes),
    )


def _find(spec, run_dir, experiment, monitor, purpose):
    """``(folder, steps, which, notes)``: the :class:`_RunFolder` and the steps (oldest first)
    ``spec`` selects, ``which`` as :func:`_parse` reads it, and the warnings to give."""
    if purpose == "resume" and isinstance(spec, str) and spec == "auto":
        folder, steps, notes = _newest_compatible(run_dir, "resume", experiment, monitor, purpose, spec)
        return folder, steps, "resume", notes
    folder_path, which = _parse(spec, run_dir, purpose)
    if folder_path is None:  # an explicit checkpoint folder
        folder, step = _checkpoint_folder(Path(which), run_dir)
        return folder, [step], "path", []
    if purpose == "resume" and (spec == "latest" or (isinstance(spec, tuple) and spec[0] == "latest")):
        folder, steps, notes = _newest_compatible(run_dir, which, experiment, monitor, purpose, spec)
        return folder, steps, which, notes
    folder = _RunFolder(folder_path)
    return folder, _select(folder, which, monitor, purpose, spec, run_dir), which, []


def _newest_compatible(run_dir, which, experiment, monitor, purpose, spec):
    """``(folder, steps, notes)``: the newest run that ``experiment`` can continue (same experiment
    class, same GraphConst values: :func:`jaxnitro.weights.incompatibility`) and has a checkpoint
    ``which`` selects; ``notes`` names the newer runs passed over as another experiment's.

    With none, :class:`NoCheckpointError`: for ``"auto"`` the clause the core's warning quotes
    (:func:`_nothing_to_continue`); when no run was passed over as another experiment's, the
    newest run's own refusal (say "run X has no checkpoint at step N (it has [...])");
    otherwise one naming both what the runs lack and the runs passed over."""
    skipped, missing = [], []
    for path in _runs(run_dir):
        folder = _RunFolder(path)
        if not folder.steps:  # an empty checkpoints folder: a run folder without checkpoints
            continue
        try:
            steps = _select(folder, which, monitor, purpose, spec, run_dir)
        except NoCheckpointError as err:
            missing.append(err)
            continue
        why = incompatibility(experiment, folder.meta(steps[-1]))
        if why is None:
            notes = [] if not skipped else [
                f"jaxnitro: `resume={_short(spec)}` continues run {path.name}, the newest run of this experiment; "
                f"it passed over newer runs that belong to another experiment: {'; '.join(skipped)}. To "
                f"continue one of those, build the handle with its experiment class and GraphConst values."
            ]
            return folder, steps, notes
        skipped.append(f"{path.name} ({why})")
    if spec == "auto":
        raise _nothing_to_continue(run_dir, skipped, missing)
    if missing and not skipped:
        raise missing[0]
    lacking = "".join(f"; {getattr(m, 'what', m)}" for m in missing)
    passed = f"; the runs there belong to other experiments: {'; '.join(skipped)}" if skipped else ""
    what = f"no run under run_dir has a checkpoint of this experiment to continue from{lacking}{passed}"
    raise _not_found(what, run_dir)


def _nothing_to_continue(run_dir, skipped: list[str], missing: list) -> NoCheckpointError:
    """``resume="auto"`` with nothing to continue. The core quotes the error in its warning
    ("resume='auto' found no checkpoint to continue (<this>); starting a fresh run."), so its
    text is that clause (no prefix, no advice on naming a checkpoint): what ``run_dir`` is or
    holds, and briefly why none of its run folders is one to continue."""
    root = Path(run_dir).resolve()
    if not root.is_dir():
        return NoCheckpointError(f"run_dir {str(root)!r} does not exist")
    runs = [p for p in root.iterdir() if p.is_dir() and _run_key(p)]
    if not runs:
        return NoCheckpointError(f"run_dir {str(root)!r} holds no run folder")
    bare = sum(1 for p in runs if not _RunFolder(p).steps)
    parts = [f"{bare} run folder{'s' if bare > 1 else ''} without checkpoints"] if bare else []
    parts += [getattr(m, "what", str(m)) for m in missing]
    if skipped:
        parts.append(f"runs that belong to other experiments: {'; '.join(skipped)}")
    return NoCheckpointError(f"run_dir {str(root)!r} holds no checkpoint of this experiment: {'; '.join(parts)}")


def _fewer_note(spec, purpose, which, folder, steps) -> str:
    """The warning of an average of fewer checkpoints than ``which`` asks for."""
    n, kind = which.of.n, type(which.of).__name__
    epochs = [folder.meta(s).get("epoch") for s in steps]
    return (
        f"jaxnitro: `{purpose}={_short(spec)}` asks for an average of {n} checkpoints, but run "
        f"{folder.path.name} has only {len(steps)} to choose from (epochs {epochs}; its checkpointer kept "
        f"no more): averaging those {len(steps)}. To average {n}, train with a checkpointer that keeps "
        f"them (`jn.Checkpointer(keep=(jn.{kind}({n}), ...))`); to mean {len(steps)}, ask for "
        f"`jn.Average(jn.{kind}({len(steps)}))`."
    )
