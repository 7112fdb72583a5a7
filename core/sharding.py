"""Parameter sharding: where each parameter, and its optimizer state, lives on the mesh.

Three ways, all on ``jax.sharding`` (a ``Mesh``, ``NamedSharding``, ``PartitionSpec``); the
compiled programs are the same ``jax.jit`` programs, XLA inserts the collectives:

* ``sharding="replicated"`` (the default): every parameter whole on every device;
* ``sharding="fsdp"``: each parameter split along its largest dimension that divides by the
  size of the ``"data"`` axis (the first such dimension on a tie), over that axis; a leaf with
  no such dimension (a bias of 10 on 4 devices, a scalar) stays replicated. XLA gathers each
  parameter where a layer needs it and reduce-scatters its gradient;
* user rules: an experiment hook ``param_sharding(self, path, leaf)`` returning a
  ``jax.sharding.PartitionSpec`` over the mesh's axes (named by the ``mesh_shape`` run knob,
  e.g. ``{"data": 2, "model": 2}``), or ``None`` for the ``sharding`` knob's rule for that leaf.

The optimizer state follows its parameter: an optimizer-state leaf whose key path ends with a
parameter's key path and that has the parameter's shape (Adam's moments, the EMA, an L2-SP
anchor) gets that parameter's sharding; every other leaf (step counts, hyperparameters,
factored statistics of another shape) is replicated.

A :class:`Layout` holds the resolved shardings (one per parameter leaf, one per optimizer-state
leaf) and places trees on them; the train programs pin their outputs to it
(``jax.lax.with_sharding_constraint``), so a step returns each array where it came from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = [
    "SHARDINGS", "Layout", "check_sharding_knob", "check_mesh_shape", "fsdp_spec", "check_spec",
    "param_layout", "constrain",
]

SHARDINGS = ("replicated", "fsdp")
"""The values of the ``sharding`` run knob."""

DATA = "data"
"""The mesh axis batches are sharded over (and FSDP splits parameters over)."""


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


def _keypath(path) -> tuple:
    from .optim import keypath_of

    return keypath_of(path)


@dataclass(frozen=True)
class Layout:
    """The shardings of a handle's parameters and optimizer state on its mesh.

    * ``mode``: ``"replicated"``, ``"fsdp"`` or ``"rules"`` (``param_sharding`` answered a spec);
    * ``mesh``: the mesh (axes ``mesh.axis_names``);
    * ``specs``: one ``PartitionSpec`` per parameter leaf, in leaf order;
    * ``paths``: the parameters' key paths (tuples of str/int), in leaf order;
    * ``opt_specs``: one per optimizer-state leaf (None until :meth:`with_opt`).
    """

    mode: str
    mesh: Mesh
    specs: tuple
    paths: tuple
    shapes: tuple
    opt_specs: tuple | None = None
    multi_process: bool = False
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def sharded(self) -> bool:
        """Whether some parameter is split (not every spec is ``P()``)."""
        return any(len(tuple(s)) and any(e is not None for e in s) for s in self.specs)

    def _named(self, specs) -> tuple:
        return tuple(NamedSharding(self.mesh, s) for s in specs)

    @property
    def param_shardings(self) -> tuple:
        return self._named(self.specs)

    @property
    def opt_shardings(self) -> tuple | None:
        return None if self.opt_specs is None else self._named(self.opt_specs)

    def key(self) -> tuple:
        """What the train programs' key adds: ``()`` when nothing is split (the replicated
        programs are today's), else the mesh and every spec (hashable)."""
        if not self.sharded:
            return ()
        mesh = (self.mesh.axis_names, self.mesh.devices.shape, tuple(d.id for d in self.mesh.devices.flat))
        return ("layout", mesh, tuple(map(str, self.specs)), tuple(map(str, self.opt_specs or ())))

    def with_opt(self, opt_state) -> "Layout":
        """This layout with the optimizer state's specs: a leaf whose key path ends with a
        parameter's path and has its shape takes that parameter's spec; the rest ``P()``."""
        by_path = {p: (s, shape) for p, s, shape in zip(self.paths, self.specs, self.shapes)}
        longest = max((len(p) for p in self.paths), default=0)
        specs = []
        for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
            kp, spec = _keypath(path), P()
            for n in range(min(len(kp), longest), 0, -1):
                hit = by_path.get(kp[-n:])
                if hit is not None and tuple(np.shape(leaf)) == hit[1]:
                    spec = hit[0]
                    break
            specs.append(spec)
        return replace(self, opt_specs=tuple(specs), _cache={})

    # -- placing -------------------------------------------------------------------------------

    def place(self, tree, specs) -> object:
        """``tree``'s array leaves on ``NamedSharding(mesh, spec)`` (``specs`` in leaf order).
        In a multi-process job each process supplies its own shards of the (same) value."""
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        return jax.tree_util.tree_unflatten(treedef, [_put(x, s, self) for x, s in zip(leaves, self._named(specs))])

    def place_params(self, params):
        return self.place(params, self.specs)

    def place_opt(self, opt_state):
        return self.place(opt_state, self.opt_specs)

    def describe(self) -> str:
        """``params fsdp over 'data' (4 of 6 leaves split)`` or ``params replicated``."""
        split = sum(1 for s in self.specs if any(e is not None for e in s))
        if not split:
            return "params replicated"
        what = {"fsdp": f"fsdp over {DATA!r}", "rules": "split by param_sharding"}[self.mode]
        return f"params {what} ({split} of {len(self.specs)} leaves split), optimizer state follows"

    def listing(self) -> list[str]:
        """``.l1.weight (16, 8): PartitionSpec('data',)``, one line per split parameter."""
        return [f"{_path_text(p)} {tuple(sh)}: {s}" for p, sh, s in zip(self.paths, self.shapes, self.specs)
                if any(e is not None for e in s)]


def _put(x, sharding: NamedSharding, layout: Layout):
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
    if not layout.multi_process:
        return jax.device_put(x, sharding)
    if isinstance(x, jax.Array) and not x.is_fully_addressable:  # a global array elsewhere: reshard
        return jax.jit(lambda a: a, out_shardings=sharding)(x)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def param_layout(e, hooks: dict, params, mesh: Mesh, mode: str, multi_process: bool = False) -> Layout:
    """The :class:`Layout` of ``params`` on ``mesh``: the experiment's ``param_sharding`` answer
    for each leaf (checked by :func:`check_spec`), else the ``mode`` knob's rule (``"fsdp"``:
    :func:`fsdp_spec` over the ``"data"`` axis; ``"replicated"``: ``P()``)."""
    hook = hooks.get("param_sharding")
    cls_name = type(e).__name__
    n = dict(zip(mesh.axis_names, mesh.devices.shape)).get(DATA, 1)
    specs, paths, shapes, ruled = [], [], [], False
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        kp, shape = _keypath(path), tuple(np.shape(leaf))
        spec = hook.function(e, kp, leaf) if hook is not None else None
        if spec is not None:
            spec, ruled = check_spec(spec, kp, shape, mesh, cls_name), True
        elif mode == "fsdp":
            spec = fsdp_spec(shape, n)
        else:
            spec = P()
        specs.append(spec)
        paths.append(kp)
        shapes.append(shape)
    return Layout("rules" if ruled else mode, mesh, tuple(specs), tuple(paths), tuple(shapes), multi_process=multi_process)


def constrain(leaves: list, shardings) -> list:
    """Inside a trace: ``leaves`` pinned to ``shardings`` (``with_sharding_constraint``); the
    leaves unchanged when ``shardings`` is None (nothing is split)."""
    if shardings is None:
        return list(leaves)
    return [jax.lax.with_sharding_constraint(x, s) for x, s in zip(leaves, shardings)]
