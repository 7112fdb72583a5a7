"""Parameter sharding: where each parameter, and its optimizer state, lives on the mesh.

The rule is a plugin's, as PyTorch Lightning's strategies decide placement: setup asks
``jaxnitro_sharding_policy`` with the resolved ``sharding`` and ``mesh_shape`` knobs
(:func:`sharding_policy`); the answer, a :class:`~jaxnitro.plugin.ShardingPolicy`, checks
them and gives each parameter its ``PartitionSpec`` (:func:`param_layout`). The built-in
answer is the ``sharding`` plugin (``"replicated"``, ``"fsdp"``, the experiment's
``param_sharding`` rules, ``mesh_shape``). With no answer (the plugin disabled) every
parameter is replicated on the 1-D ``"data"`` mesh (:data:`REPLICATED`), and anything else
is refused, naming the plugin.

The core keeps what the programs and checkpoints use, all on ``jax.sharding`` (a ``Mesh``,
``NamedSharding``, ``PartitionSpec``; XLA inserts the collectives): a :class:`Layout`
holds the resolved shardings (one per parameter leaf, one per optimizer-state leaf) and
places trees on them; the train programs pin their outputs to it (:func:`constrain`:
``jax.lax.with_sharding_constraint``), so a step returns each array where it came from.
The optimizer state follows its parameter: an optimizer-state leaf whose key path ends with
a parameter's key path and that has the parameter's shape (Adam's moments, the EMA, an
L2-SP anchor) gets that parameter's sharding; every other leaf (step counts,
hyperparameters, factored statistics of another shape) is replicated.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .contracts import ShardingPolicy
from .plugin_manager import policy_answer

__all__ = ["DATA", "REPLICATED", "Layout", "sharding_policy", "param_layout", "constrain"]

DATA = "data"
"""The mesh axis batches are sharded over (and FSDP splits parameters over)."""


class Replicated(ShardingPolicy):
    """Every parameter whole on every device of the 1-D mesh (the Protocol's own bodies)."""


REPLICATED = Replicated()


def sharding_policy(sharding, mesh_shape, n_devs: int) -> ShardingPolicy:
    """The run's policy from the resolved ``sharding`` and ``mesh_shape`` knobs
    (:class:`~jaxnitro.knobs.ResolvedKnob`) for ``n_devs`` devices: the first
    ``jaxnitro_sharding_policy`` answer, which checks them; with none, :data:`REPLICATED`
    for ``"replicated"`` without a ``mesh_shape``, else a ``ValueError`` naming the knob and
    the ``sharding`` plugin."""
    policy = policy_answer("jaxnitro_sharding_policy", ShardingPolicy, "sharding",
                           ((sharding, sharding.value in (None, "replicated")), (mesh_shape, mesh_shape.value is None)),
                           "leave `sharding` at 'replicated' and `mesh_shape` at None",
                           sharding=sharding, mesh_shape=mesh_shape, n_devs=n_devs)
    return REPLICATED if policy is None else policy


def param_layout(policy: ShardingPolicy, e, hooks: dict, params, mesh: Mesh, multi_process: bool = False) -> "Layout":
    """The :class:`Layout` of ``params`` on ``mesh``: ``policy``'s specs, given each leaf's key
    path and the experiment's ``param_sharding`` hook (bound to ``e``; None when not defined)."""
    hook = hooks.get("param_sharding")
    rule = None if hook is None else functools.partial(hook.function, e)
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    paths = tuple(_keypath(path) for path, _ in flat)
    mode, specs = policy.specs(paths, [leaf for _, leaf in flat], mesh, rule, type(e).__name__)
    shapes = tuple(tuple(np.shape(leaf)) for _, leaf in flat)
    return Layout(mode, mesh, tuple(specs), paths, shapes, multi_process=multi_process)


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


def _put(x, sharding: NamedSharding, layout: Layout):
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
    if not layout.multi_process:
        return jax.device_put(x, sharding)
    if isinstance(x, jax.Array) and not x.is_fully_addressable:  # a global array elsewhere: reshard
        return jax.jit(lambda a: a, out_shardings=sharding)(x)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def constrain(leaves: list, shardings) -> list:
    """Inside a trace: ``leaves`` pinned to ``shardings`` (``with_sharding_constraint``); the
    leaves unchanged when ``shardings`` is None (nothing is split)."""
    if shardings is None:
        return list(leaves)
    return [jax.lax.with_sharding_constraint(x, s) for x, s in zip(leaves, shardings)]
