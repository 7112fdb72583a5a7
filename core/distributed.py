"""Scale-out: data parallelism over several devices and several processes, on JAX's own runtime.

One device → several devices: a 1-D :class:`jax.sharding.Mesh` with the axis
``"data"`` over ``n_devs`` devices. Params, model state, optimizer state (and the
EMA inside it), the run's key and the Device values are *replicated*
(``NamedSharding(mesh, P())``); every train batch is *sharded on its first
dimension* (``NamedSharding(mesh, P("data"))``). The compiled train step is the
same ``jax.jit`` program as on one device: XLA inserts the gradient all-reduce
from the shardings. Nothing here is hand-written communication.

One process → several processes (hosts): :func:`initialize` asks the
``jaxnitro_initialize_processes`` hook (and :func:`setup_devices` asks
``jaxnitro_setup_devices``), which the ``cluster`` plugin answers on
``jax.distributed.initialize`` (JAX's multi-controller runtime and its coordination
service). Each process reads its part of every batch (the ``dist`` handed to ``build_data``; ``jn.ArraySource`` splits itself), and the
global batch is assembled with ``jax.make_array_from_process_local_data``.
Evaluation runs on each process's own devices over its own rows; the metric
accumulators are then merged across processes (``process_allgather``) before
``finalize_metrics``, so every process reports, and early stopping decides on,
the same numbers.

With one device in one process (the default on a one-device machine) none of
this is active: batches go to the compiled programs exactly as before.
"""

from __future__ import annotations

import copy
import pickle
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .plugin_manager import disabled_note, first_result
from .routing import KEY_COUNT, KEY_DATA

__all__ = [
    "ProcessPart",
    "AXIS", "Dist", "setup_devices", "initialize", "make_dist", "check_n_devs", "HEARTBEAT_TIMEOUT_S",
]

AXIS = "data"
"""The mesh axis batches are sharded over."""

HEARTBEAT_TIMEOUT_S = 100
"""JAX's default coordination-service heartbeat timeout (seconds): when a process of a
multi-process job stops sending heartbeats for this long, the others fail with an error
naming it instead of waiting forever. :func:`initialize` takes ``heartbeat_timeout_s``."""

_FLAG = "--xla_force_host_platform_device_count"
_KEY_ENTRIES = (KEY_DATA, KEY_COUNT)  # the framework's per-batch key entries: never sharded


def check_count(name: str, value, low: int = 1) -> int:
    """``value`` as an int if it is an integer >= ``low`` (not a bool); ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"jaxnitro: {name} must be an integer >= {low}, got {value!r}.")
    return int(value)


def _ask_cluster(hook: str, verb: str, **kwargs):
    """The first answer to ``hook``; ``RuntimeError`` naming the ``cluster`` plugin when none answers."""
    answer = first_result(hook, **kwargs)
    if answer is None:
        raise RuntimeError(
            f"jaxnitro: `{verb}` found no plugin that starts processes and devices: the built-in "
            f"plugin `cluster` (entry point `cluster` in group `jaxnitro`, module jaxnitro.plugins.cluster) "
            f"does, and it is not loaded{disabled_note()}. Fix: re-enable it (drop `cluster` from "
            f"JAXNITRO_DISABLE_PLUGINS), or install a plugin implementing `{hook}`."
        )
    return answer


def setup_devices(n_devs: int | None = None, backend: str | None = None) -> list:
    """Make ``n_devs`` devices available to this process; call it first in a script.

    ``jn.setup_devices(n_devs=4)`` gives a CPU-only process 4 CPU devices (it sets
    ``XLA_FLAGS=--xla_force_host_platform_device_count=4``, which XLA reads once, when
    JAX's backend starts); ``backend="cpu"`` (or ``"gpu"``, ``"tpu"``) also pins the
    platform (``jax_platforms``). On an accelerator the devices are the real ones and
    ``n_devs`` is checked against them. Returns the backend's local devices.

    Raises ``RuntimeError`` naming the reason when JAX's backend had already started
    with fewer devices (anything that touched a device before: ``jax.devices()``, an
    array, a jitted call): the flag can no longer take effect. The fix is to call
    ``setup_devices`` before any other JAX use, or to set ``XLA_FLAGS`` in the
    environment that launches Python. In a multi-process job, pass
    ``local_device_count`` to :func:`initialize` instead (it must run before the backend
    starts too). The ``jaxnitro_setup_devices`` hook answers (the ``cluster`` plugin).
    """
    return _ask_cluster("jaxnitro_setup_devices", "jn.setup_devices", n_devs=n_devs, backend=backend)


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_count: int | None = None,
    heartbeat_timeout_s: int = HEARTBEAT_TIMEOUT_S,
    cpu_collectives: str | None = "gloo",
    **kwargs,
) -> None:
    """Start (join) a multi-process job: ``jax.distributed.initialize`` plus what jaxnitro needs.

    Every process of the job calls it once, first, with the same
    ``coordinator_address`` (``"host:port"`` of process 0) and ``num_processes``, and its
    own ``process_id``; with all three left ``None``, JAX reads them from its cluster
    environment (Slurm, Open MPI, TPU pods, ... see ``jax.distributed.initialize``).

    * ``local_device_count``: on CPU, the number of CPU devices of this process (sets the
      host device count, as :func:`setup_devices` does);
    * ``heartbeat_timeout_s``: a process that sends no heartbeat for this long is declared
      dead; the others then fail with an error naming it rather than hanging (JAX's
      coordination service; default :data:`HEARTBEAT_TIMEOUT_S`);
    * ``cpu_collectives``: the CPU backend's cross-process collectives
      (``jax_cpu_collectives_implementation``; ``"gloo"``). Ignored on accelerators.
    * other keywords go to ``jax.distributed.initialize`` as they are.

    Raises ``ValueError`` for a ``coordinator_address`` that is not ``"host:port"`` (checked
    before JAX sees it: JAX fails on a missing port with a bare ``IndexError``), and
    ``RuntimeError`` (JAX's, with jaxnitro's note) when JAX's backend already started:
    initialize must come before any JAX use. The ``jaxnitro_initialize_processes`` hook
    answers (the ``cluster`` plugin).
    """
    _ask_cluster(
        "jaxnitro_initialize_processes", "jn.distributed.initialize", coordinator_address=coordinator_address,
        num_processes=num_processes, process_id=process_id, local_device_count=local_device_count,
        heartbeat_timeout_s=heartbeat_timeout_s, cpu_collectives=cpu_collectives, options=kwargs,
    )


def is_initialized() -> bool:
    """Whether this process joined a multi-process job (``jax.distributed.is_initialized``)."""
    return jax.distributed.is_initialized()


def check_n_devs(value, source: str) -> int:
    """The ``n_devs`` knob resolved: ``None`` is every device of the job; otherwise an int
    >= 1 that the job's devices allow, divisible by the number of processes (each process
    contributes ``n_devs / process_count`` of its devices)."""
    total, procs = jax.device_count(), jax.process_count()
    if value is None:
        return total
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(
            f"jaxnitro: run knob `n_devs` = {value!r} ({source}); it must be an integer >= 1 (the "
            f"number of devices to train on), or None for all {total}."
        )
    value = int(value)
    if value > total:
        platform = jax.devices()[0].platform
        fix = (
            f"call jn.setup_devices({value}) at the top of the script, before any other JAX use "
            f"(or launch with XLA_FLAGS={_FLAG}={value})"
            if platform == "cpu" and procs == 1
            else f"use n_devs <= {total}"
        )
        raise ValueError(
            f"jaxnitro: run knob `n_devs` = {value} ({source}), but this job has {total} {platform} "
            f"device(s) ({procs} process(es)). Fix: {fix}."
        )
    if value % procs:
        raise ValueError(
            f"jaxnitro: run knob `n_devs` = {value} ({source}) does not divide among the job's "
            f"{procs} processes; each process trains on the same number of its devices. Use a "
            f"multiple of {procs} (or None for all {total})."
        )
    return value


@dataclass(frozen=True, eq=False)
class Dist:
    """Where a handle runs: the data mesh over devices and processes.

    ``build_data(self, dist)`` receives it in a multi-process job (``None`` in one
    process): read ``process_index`` / ``process_count`` to load only this process's
    part of each batch (``jn.ArraySource`` does it itself).

    * ``process_index``, ``process_count``: this process and the job's size;
    * ``local_devices``: this process's devices in the mesh;
    * ``devices``: every device of the mesh, process by process;
    * ``mesh``: the 1-D ``Mesh`` (axis ``"data"``) the train step runs on;
    * ``local_mesh``: this process's devices (evaluation and prediction run here).
    """

    process_index: int
    process_count: int
    local_devices: tuple
    devices: tuple
    mesh: Mesh
    local_mesh: Mesh

    @property
    def n_devs(self) -> int:
        """Devices in the mesh (all processes)."""
        return len(self.devices)

    @property
    def local_n_devs(self) -> int:
        return len(self.local_devices)

    @property
    def data_size(self) -> int:
        """Devices along the ``"data"`` axis (the batch is split into this many slices): ``n_devs``
        on the 1-D mesh, less with a ``mesh_shape`` that has other axes."""
        return dict(zip(self.mesh.axis_names, self.mesh.devices.shape))[AXIS]

    @property
    def local_data_size(self) -> int:
        """This process's slices of the batch (``data_size / process_count``)."""
        return self.data_size // self.process_count

    @property
    def multi_process(self) -> bool:
        return self.process_count > 1

    @property
    def sharded(self) -> bool:
        """Whether arrays are placed by sharding (more than one device, or several processes);
        False on one device in one process, where everything runs as it always did."""
        return self.n_devs > 1 or self.multi_process

    @property
    def is_main(self) -> bool:
        """Process 0: the one that writes logs."""
        return self.process_index == 0

    # -- placing arrays ------------------------------------------------------------------------

    def replicated(self, local: bool = False) -> NamedSharding:
        return NamedSharding(self.local_mesh if local else self.mesh, P())

    def batch_sharding(self, local: bool = False, axis: int = 0) -> NamedSharding:
        return NamedSharding(self.local_mesh if local else self.mesh, P(*([None] * axis), AXIS))

    def replicate(self, tree):
        """Every array leaf of ``tree`` replicated over the mesh (same value on every device)."""
        if not self.sharded:
            return tree
        sharding = self.replicated()
        if not self.multi_process:
            return jax.device_put(tree, sharding)

        def put(x):  # every process holds the same value; each supplies it for its devices
            if isinstance(x, jax.Array) and not x.is_fully_addressable:
                return x
            return jax.make_array_from_process_local_data(sharding, np.asarray(x))

        return jax.tree_util.tree_map(put, tree)

    def put_batch(self, batch: dict, axis: int = 0) -> dict:
        """A batch (this process's rows) as global arrays sharded on dimension ``axis``.

        0-d fields and the framework's key entries (the run's key, already replicated, and
        the micro-batch counter) pass unchanged: they are the same on every process."""
        if not self.sharded:
            return batch
        sharding = self.batch_sharding(axis=axis)
        out = {}
        for f, v in batch.items():
            if f in _KEY_ENTRIES or np.ndim(v) == 0:
                out[f] = v
            elif self.multi_process:
                out[f] = jax.make_array_from_process_local_data(sharding, np.asarray(v))
            else:
                out[f] = jax.device_put(v, sharding)
        return out

    def put_local_batch(self, batch: dict) -> dict:
        """A batch sharded over this process's devices (evaluation, prediction)."""
        if not self.sharded:
            return batch
        sharding = self.batch_sharding(local=True)
        return {
            f: self.local(v) if f in _KEY_ENTRIES or np.ndim(v) == 0 else jax.device_put(v, sharding)
            for f, v in batch.items()
        }

    def local(self, tree):
        """Replicated global arrays as arrays on this process's devices only (the same buffers),
        for the per-process evaluation programs. The identity in one process."""
        if not self.multi_process:
            return tree
        sharding = self.replicated(local=True)
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        split = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array) and not x.is_fully_addressable
                 and not x.sharding.is_fully_replicated]
        if split:  # sharded params (sharding="fsdp", param_sharding): gathered whole, in one program
            whole = _gather(self.replicated())([leaves[i] for i in split])
            for i, x in zip(split, whole):
                leaves[i] = x

        def to_local(x):
            if not isinstance(x, jax.Array) or x.is_fully_addressable:
                return x
            shards = [s.data for s in x.addressable_shards]
            return jax.make_array_from_single_device_arrays(x.shape, sharding, shards)

        return jax.tree_util.tree_unflatten(treedef, [to_local(x) for x in leaves])

    def pad_width(self, n: int) -> int:
        """``n`` rounded up to a multiple of this process's device count."""
        k = self.local_n_devs
        return -(-n // k) * k

    # -- agreeing across processes ------------------------------------------------------------

    def allgather_objects(self, obj) -> list:
        """``[obj of process 0, obj of process 1, ...]`` (pickled through ``process_allgather``);
        ``[obj]`` in one process. Every process must call it at the same point."""
        if not self.multi_process:
            return [obj]
        from jax.experimental import multihost_utils

        data = np.frombuffer(pickle.dumps(obj), np.uint8)
        sizes = np.asarray(multihost_utils.process_allgather(np.int64(data.size))).reshape(-1)
        padded = np.zeros(int(sizes.max()), np.uint8)
        padded[: data.size] = data
        gathered = np.asarray(multihost_utils.process_allgather(padded))
        return [pickle.loads(gathered[i, : int(sizes[i])].tobytes()) for i in range(self.process_count)]

    def from_main(self, obj):
        """Process 0's ``obj`` on every process (e.g. the run folder it created)."""
        return self.allgather_objects(obj)[0] if self.multi_process else obj

    def describe(self) -> str:
        """``4 devices (cpu), 2 processes x 2; batch sharded on 'data'``."""
        platform = self.devices[0].platform
        if not self.sharded:
            return f"1 device ({platform}:{self.devices[0].id}), 1 process; not sharded"
        procs = (
            f"{self.process_count} processes x {self.local_n_devs} (this is process {self.process_index})"
            if self.multi_process
            else "1 process"
        )
        return f"{self.n_devs} devices ({platform}), {procs}; params replicated, batch sharded on {AXIS!r}"


_GATHERS: dict = {}


def _gather(sharding: NamedSharding):
    """A program that returns its leaves on ``sharding`` (replicated: each gathered whole),
    one per mesh; every process calls it at the same point (it is a collective)."""
    if sharding not in _GATHERS:
        _GATHERS[sharding] = jax.jit(lambda xs: xs, out_shardings=sharding)
    return _GATHERS[sharding]


def make_dist(n_devs: int, mesh_shape: dict | None = None) -> Dist:
    """The :class:`Dist` for ``n_devs`` devices of the job (checked by :func:`check_n_devs`):
    the first ``n_devs / process_count`` devices of every process, process by process, so
    process ``p`` holds rows ``[p * b, (p + 1) * b)`` of every global batch.

    ``mesh_shape`` (``{"data": 2, "model": 2}``, checked by
    the ``sharding`` plugin) reshapes those devices into a mesh with these
    axes, in this order (the last axis varies fastest, so a ``"model"`` axis after ``"data"``
    keeps its devices in one process when its size divides the local device count); None is
    the 1-D mesh ``{"data": n_devs}``."""
    procs, me = jax.process_count(), jax.process_index()
    per = n_devs // procs
    devices = tuple(d for p in range(procs) for d in sorted(jax.local_devices(process_index=p), key=lambda d: d.id)[:per])
    local = tuple(d for d in devices if d.process_index == me)
    names, shape = ((AXIS,), (len(devices),)) if mesh_shape is None else (tuple(mesh_shape), tuple(mesh_shape.values()))
    grid = np.array(devices, dtype=object).reshape(shape)
    local_shape = tuple(s if n != AXIS else s // procs for n, s in zip(names, shape))
    if mesh_shape is None or procs == 1:
        local_grid = np.array(local, dtype=object).reshape(local_shape)
    else:  # the devices of `grid` in this process, in their mesh order
        local_grid = grid[np.vectorize(lambda d: d.process_index == me)(grid)].reshape(local_shape)
    return Dist(
        process_index=me,
        process_count=procs,
        local_devices=local,
        devices=devices,
        mesh=Mesh(grid, names),
        local_mesh=Mesh(local_grid, names),
    )


def split_for_process(source, split: str, dist: Dist | None):
    """In a multi-process job, ``source``'s part for this process: a source with a
    ``for_process(process_index, process_count)`` method (``jn.ArraySource``) is asked for it;
    any other source is taken to yield this process's part already (``build_data`` reads
    ``dist`` for that). The source itself in one process."""
    if dist is None or not dist.multi_process:
        return source
    split_fn = getattr(source, "for_process", None)
    if callable(split_fn):
        return split_fn(dist.process_index, dist.process_count)
    return source


@dataclass(frozen=True)
class ProcessPart:
    """Process ``index`` of ``count``'s part of every batch of an index-addressable source.

    Every process draws the same epoch plan; of each batch of ``batch_size`` rows (positions
    ``i * batch_size`` on in the epoch's row order) process ``p`` reads the ``p``-th of
    ``count`` equal slices, ``size = batch_size // count`` rows, so the processes' parts put
    together are the one-process batch, row for row. A partial final batch is cut the same
    way: a process whose slice of it is empty has one batch fewer. Sources that split by
    process (``ArraySource``, ``TorchSource``, ``GrainSource``) share this arithmetic.
    """

    index: int
    count: int
    batch_size: int
    used: int
    """Rows an epoch reads (its batches' rows: ``drop_last`` leaves out the partial batch's)."""

    @classmethod
    def of(cls, index, count, batch_size: int, used: int, who: str) -> "ProcessPart":
        """Validate and make; ``ValueError`` (naming ``who``) for a bad index or count, or a
        ``batch_size`` that does not divide by ``count``."""
        p = check_count("process_index", index, 0)
        c = check_count("process_count", count, 1)
        if p >= c:
            raise ValueError(f"{who}: process_index {p} is not below process_count {c}")
        if batch_size % c:
            raise ValueError(
                f"{who}: batch_size={batch_size} does not divide among {c} processes (each reads an "
                f"equal part of every batch); use a multiple of {c}, e.g. {batch_size - batch_size % c or c}"
            )
        return cls(p, c, int(batch_size), int(used))

    @property
    def size(self) -> int:
        """Rows of a full part (``batch_size // count``)."""
        return self.batch_size // self.count

    def span(self, i: int) -> tuple[int, int]:
        """``(start, stop)`` of batch ``i``'s part, as positions in the epoch's row order."""
        start = i * self.batch_size + self.index * self.size
        return start, min(start + self.size, self.used)

    def batches(self, n_batches: int) -> int:
        """This process's batches of a source with ``n_batches`` batches an epoch."""
        return n_batches - (0 if self.span(n_batches - 1)[0] < self.used else 1)


def split_by_process(source, index, count, make_part, n_batches: int, who: str):
    """``source`` as process ``index`` of ``count`` reads it: the source itself when it already
    reads that part (or ``count`` is 1), else a shallow copy whose ``_part`` is the
    :class:`ProcessPart` ``make_part()`` returns (called only then: it may read a batch) and
    whose ``_len`` is its batches of ``n_batches``. The splitting shared by ``ArraySource``,
    ``TorchSource`` and ``GrainSource`` (``source._part``: a ``ProcessPart``, or None unsplit).

    Raises ``ValueError`` (naming ``who``) for a bad index or count, a source already split for
    another part, or a part with no batch.
    """
    p, c = check_count("process_index", index, 0), check_count("process_count", count, 1)
    if p >= c:
        raise ValueError(f"{who}: process_index {p} is not below process_count {c}")
    current = source._part
    if current is not None and current.count > 1:
        if (current.index, current.count) == (p, c):
            return source
        raise ValueError(
            f"{who}: this source already reads for process {current.index} of {current.count}; "
            f"split the original source instead"
        )
    if c == 1:
        return source
    part = make_part()
    mine = copy.copy(source)
    mine._part, mine._len = part, part.batches(n_batches)
    if mine._len == 0:
        raise ValueError(f"{who}: the data leaves process {p} of {c} no batch")
    return mine


def check_batch_divides(width: int | None, dist: Dist, where: str = "the `train` split's batches") -> None:
    """Refuse a train batch that does not divide among the devices (each device takes an equal
    slice of its first dimension)."""
    if width is None or not dist.sharded or width % dist.local_data_size == 0:
        return
    k, procs = dist.local_data_size, dist.process_count
    rows = f"{width} rows per process" if procs > 1 else f"{width} rows"
    lower, upper = (width // k) * k, -(-width // k) * k
    raise ValueError(
        f"jaxnitro: {where} have {rows}, which does not divide among the {k} devices "
        f"{'of each process ' if procs > 1 else ''}(n_devs={dist.n_devs}): data parallelism gives every "
        f"device an equal slice of the batch. Fix: a batch size that is a multiple of {k} "
        f"(e.g. {lower or upper} or {upper}{' per process' if procs > 1 else ''}), or n_devs that divides {width}."
    )
