"""Where each parameter lives on the mesh (entry point ``sharding``): the ``sharding`` and ``mesh_shape`` run knobs.

The sharding plugin, as PyTorch Lightning's strategies decide placement: setup asks
``jaxnitro_sharding_policy`` with the resolved knobs; this plugin answers (``trylast``)
with a :class:`Rules` policy (a :class:`jaxnitro.plugin.ShardingPolicy`), refusing a bad
value naming the knob, its source and the fix. Three ways, all on ``jax.sharding``; the
compiled programs are the same ``jax.jit`` programs, XLA inserts the collectives:

* ``sharding="replicated"`` (the default): every parameter whole on every device;
* ``sharding="fsdp"``: each parameter split along its largest dimension that divides by the
  size of the ``"data"`` axis (the first such dimension on a tie), over that axis; a leaf with
  no such dimension (a bias of 10 on 4 devices, a scalar) stays replicated. XLA gathers each
  parameter where a layer needs it and reduce-scatters its gradient (:func:`fsdp_spec`);
* user rules: an experiment hook ``param_sharding(self, path, leaf)`` returning a
  ``jax.sharding.PartitionSpec`` over the mesh's axes (named by the ``mesh_shape`` run knob,
  e.g. ``{"data": 2, "model": 2}``), or ``None`` for the ``sharding`` knob's rule for that
  leaf (each answer checked by :func:`check_spec`).

The core keeps the resolved :class:`~jaxnitro.plugin.Layout` (the optimizer state follows
its parameter) and places the state on it. Disabled
(``JAXNITRO_DISABLE_PLUGINS=sharding``), every parameter is replicated, and any other
``sharding``, a ``mesh_shape`` or a ``param_sharding`` hook is refused, naming this plugin.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxnitro.plugin import DATA, ShardingPolicy, hookimpl
from jaxnitro.plugin import param_layout as layout_of

__all__ = ["SHARDINGS", "Rules", "check_sharding_knob", "check_mesh_shape", "check_spec", "fsdp_spec", "param_layout"]

SHARDINGS = ("replicated", "fsdp")
"""The values of the ``sharding`` run knob."""


def check_sharding_knob(value, source: str) -> str:
    """The ``sharding`` knob: ``"replicated"`` or ``"fsdp"``; ``ValueError`` naming it otherwise."""
    if value is None:
        return "replicated"
    if not isinstance(value, str) or value not in SHARDINGS:
        raise ValueError(
            f"jaxnitro: run knob `sharding` = {value!r} ({source}); give \"replicated\" (every "
            f"parameter whole on every device, the default) or \"fsdp\" (each parameter and its "
            f"optimizer state split over the 'data' axis). For your own rules (tensor parallelism), "
            f"define the experiment hook `param_sharding(self, path, leaf)` returning a "
            f"jax.sharding.PartitionSpec, over axes named by `mesh_shape`."
        )
    return value


def check_mesh_shape(value, source: str, n_devs: int) -> dict | None:
    """The ``mesh_shape`` knob: None (a 1-D mesh ``{"data": n_devs}``) or ``{axis: size}``, sizes
    integers >= 1 whose product is ``n_devs``, one axis named ``"data"`` (batches are sharded
    over it). ``ValueError`` naming the knob, what is wrong and the fix otherwise."""
    if value is None:
        return None
    example = f'{{"data": {max(n_devs // 2, 1)}, "model": {2 if n_devs % 2 == 0 and n_devs > 1 else 1}}}'

    def refuse(problem: str):
        raise ValueError(
            f"jaxnitro: run knob `mesh_shape` = {value!r} ({source}); {problem} It names the mesh's "
            f"axes and their sizes, e.g. mesh_shape={example} for {n_devs} devices (batches are sharded "
            f"over \"data\"; `param_sharding` specs name the others)."
        )

    if not isinstance(value, dict) or not value:
        refuse("it must be a non-empty dict {axis name: size}.")
    for name, size in value.items():
        if not isinstance(name, str) or not name:
            refuse(f"the axis name {name!r} is not a non-empty string.")
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
            refuse(f"the size of axis {name!r} is {size!r}, not an integer >= 1.")
    if DATA not in value:
        refuse('it has no axis "data", the axis batches are sharded over (give it size 1 for pure model parallelism).')
    total = math.prod(int(s) for s in value.values())
    if total != n_devs:
        refuse(f"its sizes multiply to {total}, but the run trains on n_devs={n_devs} devices; the sizes "
               f"must multiply to {n_devs} (or set n_devs={total}).")
    return {str(k): int(v) for k, v in value.items()}


def fsdp_spec(shape: tuple, n: int) -> P:
    """The FSDP spec of a leaf of ``shape`` over a ``"data"`` axis of size ``n``: split along the
    largest dimension divisible by ``n`` (the first on a tie); ``P()`` when none is or ``n`` is 1."""
    if n <= 1:
        return P()
    best = None
    for d, size in enumerate(shape):
        if size % n == 0 and size >= n and (best is None or size > shape[best]):
            best = d
    if best is None:
        return P()
    return P(*([None] * best), DATA)


def _path_text(path: tuple) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path) or "<root>"


def check_spec(spec, path: tuple, shape: tuple, mesh: Mesh, cls_name: str) -> P:
    """``spec`` if it is a ``PartitionSpec`` that fits a leaf of ``shape`` on ``mesh``: no more
    entries than dimensions, every axis one of the mesh's and used once, each dimension divisible
    by the product of its axes' sizes. ``TypeError``/``ValueError`` naming the parameter's path,
    the spec and the fix otherwise."""
    where = f"`param_sharding` of {cls_name} returned {spec!r} for the parameter {_path_text(path)} (shape {tuple(shape)})"
    axes = dict(zip(mesh.axis_names, mesh.devices.shape))
    if not isinstance(spec, P):
        raise TypeError(
            f"jaxnitro: {where}; it must return a jax.sharding.PartitionSpec (e.g. "
            f"PartitionSpec(None, 'model') to split the second dimension over 'model') or None for "
            f"the `sharding` knob's rule."
        )
    if len(spec) > len(shape):
        raise ValueError(
            f"jaxnitro: {where}: the spec has {len(spec)} entries but the parameter has {len(shape)} "
            f"dimension(s). Give at most one entry per dimension (None leaves a dimension whole)."
        )
    seen = set()
    for d, entry in enumerate(spec):
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        for a in names:
            if a not in axes:
                raise ValueError(
                    f"jaxnitro: {where}: the axis {a!r} is not an axis of the mesh (axes: "
                    f"{axes}). Use one of {sorted(axes)}, or name it in the `mesh_shape` run knob "
                    f"(e.g. mesh_shape={{'data': ..., {a!r}: ...}})."
                )
            if a in seen:
                raise ValueError(
                    f"jaxnitro: {where}: the axis {a!r} is used for two dimensions; a mesh axis "
                    f"splits at most one dimension of a parameter."
                )
            seen.add(a)
        k = math.prod(axes[a] for a in names)
        if shape[d] % k:
            raise ValueError(
                f"jaxnitro: {where}: dimension {d} has size {shape[d]}, which does not divide "
                f"among the {k} devices of {names if len(names) > 1 else names[0]!r}. Split a "
                f"dimension whose size is a multiple of {k}, leave this one whole (None), or "
                f"return None for this parameter."
            )
    return spec


def _check_mesh_processes(mesh_shape, n_devs: int, source: str) -> None:
    """In a multi-process job, the axes other than "data" must stay inside one process (each
    process feeds its own rows along "data"): their sizes' product divides the devices per process."""
    procs = jax.process_count()
    if mesh_shape is None or procs == 1:
        return
    inner = n_devs // mesh_shape["data"]
    if (n_devs // procs) % inner:
        raise ValueError(
            f"jaxnitro: run knob `mesh_shape` = {mesh_shape!r} ({source}): its axes other than \"data\" "
            f"span {inner} devices, more than (or not dividing) the {n_devs // procs} devices of each of the "
            f"{procs} processes; each process feeds its own rows along \"data\". Make \"data\" a multiple "
            f"of {procs} (the other axes' product dividing {n_devs // procs})."
        )


class Rules(ShardingPolicy):
    """The policy of the ``sharding`` knob (``mode``: ``"replicated"`` or ``"fsdp"``) on a mesh
    of ``mesh_shape`` (None: 1-D over ``"data"``), with the experiment's ``param_sharding``
    answers first."""

    def __init__(self, mode: str = "replicated", mesh_shape: dict | None = None):
        self.mode, self.mesh_shape = mode, mesh_shape

    def specs(self, paths, leaves, mesh: Mesh, rule, cls_name: str) -> tuple[str, tuple]:
        """Each leaf's spec: ``rule``'s answer (checked), else FSDP's or ``P()``; the mode is
        ``"rules"`` when ``rule`` answered for some leaf."""
        n = dict(zip(mesh.axis_names, mesh.devices.shape)).get(DATA, 1)
        specs, ruled = [], False
        for path, leaf in zip(paths, leaves):
            shape = tuple(np.shape(leaf))
            spec = rule(path, leaf) if rule is not None else None
            if spec is not None:
                spec, ruled = check_spec(spec, path, shape, mesh, cls_name), True
            elif self.mode == "fsdp":
                spec = fsdp_spec(shape, n)
            else:
                spec = P()
            specs.append(spec)
        return ("rules" if ruled else self.mode), tuple(specs)


def param_layout(e, hooks: dict, params, mesh: Mesh, mode: str, multi_process: bool = False):
    """The :class:`~jaxnitro.plugin.Layout` of ``params`` on ``mesh`` under ``Rules(mode)``
    (the experiment's ``param_sharding`` from ``hooks``, as setup lays out a handle)."""
    return layout_of(Rules(mode), e, hooks, params, mesh, multi_process)


@hookimpl(trylast=True)
def jaxnitro_sharding_policy(sharding, mesh_shape, n_devs):
    """The run's :class:`Rules` from the resolved ``sharding`` and ``mesh_shape`` knobs, checked."""
    mode = check_sharding_knob(sharding.value, sharding.source)
    shape = check_mesh_shape(mesh_shape.value, mesh_shape.source, n_devs)
    _check_mesh_processes(shape, n_devs, mesh_shape.source)
    return Rules(mode, shape)
