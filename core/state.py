"""The typed objects setup produces and the verbs read.

* :class:`TrainState`: what training changes (params, model state, optimizer
  state, step, epoch, the run's PRNG key), one pytree, replaced as a whole;
* :class:`Plan`: what setup resolved that shapes the programs (hooks, routing,
  batch width, programs, optimizer, schedule bindings);
* :class:`RunRecord`: what a run leaves behind (status, history rows, run
  folder, loggers).

The resolved run knobs are :class:`jaxnitro.Settings` (``knobs.py``); the
data is the handle's ``{split: source}``; Device values live in the handle's
``device_values`` (their one home: ``set_device`` writes there, programs
and the logger read there).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import jax

__all__ = ["TrainState", "Plan", "ResumePoint", "RunRecord"]


@dataclass(frozen=True)
class TrainState:
    """Params (``eqx.partition``'s array half), model state (``eqx.nn.State`` or None),
    optimizer state (None without a train split; ``(rules' state, EmaState)`` with
    ``ema=jn.EMA(...)``, and L2-SP anchors inside the rules' state), ``step`` (optimizer steps taken),
    ``epoch`` (epochs begun) and ``rng`` (the run's base key; hooks declaring ``key`` get
    ``fold_in(rng, micro-batch number)``).

    A pytree whose leaves are the arrays (``step`` and ``epoch`` are static). The
    compiled train programs take and return its array leaves as flat lists
    (:meth:`leaves`, :meth:`with_leaves`): a list of arrays goes through jit's C++
    argument path, while flattening an Equinox module costs Python time on every
    call. The loop publishes a new state at each cut (``RunState.publish``, ``run_state.py``).
    """

    params: Any
    model_state: Any
    opt_state: Any
    step: int
    epoch: int
    rng: Any

    def leaves(self) -> tuple[list, list, list]:
        """``(param leaves, model-state leaves, optimizer-state leaves)``."""
        leaves = jax.tree_util.tree_leaves
        return leaves(self.params), leaves(self.model_state), leaves(self.opt_state)

    def with_leaves(self, p, s, o, *, step: int, epoch: int) -> "TrainState":
        """A new state with these leaves (same structures as this one's) at ``step``/``epoch``."""
        structure = jax.tree_util.tree_structure
        unflatten = jax.tree_util.tree_unflatten
        return TrainState(
            params=unflatten(structure(self.params), p),
            model_state=unflatten(structure(self.model_state), s),
            opt_state=unflatten(structure(self.opt_state), o),
            step=step,
            epoch=epoch,
            rng=self.rng,
        )

    def replace(self, **changes) -> "TrainState":
        return dataclasses.replace(self, **changes)

    @property
    def ema(self):
        """The moving average of the params (``ema=jn.EMA(...)``; kept in the optimizer state), or None."""
        from .optim import ema_of

        return ema_of(self.opt_state)

    @property
    def eval_params(self):
        """The params validation, evaluation, prediction and ``nitro.model`` use: the EMA when on."""
        ema = self.ema
        return self.params if ema is None else ema


jax.tree_util.register_dataclass(
    TrainState, data_fields=["params", "model_state", "opt_state", "rng"], meta_fields=["step", "epoch"]
)


@dataclass(frozen=True)
class Plan:
    """What setup resolved that shapes the programs: frozen, built once by setup.

    A verb that needs another plan makes a new one (:meth:`replace`) and the handle keeps it
    (the first ``predict`` of a handle without data fixes ``width``: ``nitro.plan`` is then a
    new plan with the same programs). Assigning a field raises
    ``dataclasses.FrozenInstanceError``.

    - ``hooks``: ``{hook: ResolvedHook}`` (experiment > plugin > default);
    - ``routes``: ``{traced hook: Route}``, the batch fields each hook declares;
    - ``width``: the compiled batch width (the train batch; set by the first
      predict when the handle has no data);
    - ``batch_fields``: the train (or first) split's field names, or None;
    - ``metrics_on_device``: whether ``metrics`` is traced;
    - ``skeleton``: the model's non-trainable half (:class:`~jaxnitro.programs.ModelSkeleton`);
    - ``programs``: the handle's :class:`~jaxnitro.programs.ProgramSet`;
    - ``opt_spec``, ``tx``: the optimizer (None without a train split); ``base_lr`` (a
      property): the spec's base learning rate;
    - ``bindings``: where each schedule landed;
    - ``weights_from``: where the initial weights came from, in words;
    - ``derived``: what ``derive`` returned (or the record restored), ``{field: host value}``;
    - ``anchor_from``: what ``decay_anchor = "w0"`` groups decay toward, in words;
    - ``resumed``: for ``resume=``, where the run continues from (:class:`ResumePoint`), else None;
    - ``dist``: where the handle runs (:class:`~jaxnitro.distributed.Dist`: the data mesh over
      ``n_devs`` devices and the processes of the job);
    - ``weights_meta``: the checkpoint record's metadata (``step``, ``epoch``, ``metrics``, ...)
      when the weights came from a checkpoint (``weights=``, ``resume=``), else None;
    - ``layout``: where the params and the optimizer state live on the mesh
      (:class:`~jaxnitro.sharding.Layout`; ``sharding``, ``mesh_shape``, ``param_sharding``);
    - ``memory`` (read-only): the memory preflight's report, kept with the compiled programs
      (``programs.memory``) once a run or ``jn.memory_report`` compiled the train step, else None.
    """

    hooks: dict
    routes: dict
    width: int | None
    batch_fields: tuple[str, ...] | None
    metrics_on_device: bool = False
    skeleton: Any = None
    programs: Any = None
    opt_spec: Any = None
    tx: Any = None
    bindings: Any = None
    weights_from: str = ""
    derived: dict = field(default_factory=dict)
    anchor_from: str = "build_model"
    resumed: "ResumePoint | None" = None
    weights_meta: dict | None = None
    dist: Any = None
    layout: Any = None

    def replace(self, **changes) -> "Plan":
        """A new plan with ``changes`` (the programs, hooks and routes are shared, not copied)."""
        return dataclasses.replace(self, **changes)

    @property
    def base_lr(self) -> float | None:
        """The base learning rate (``learning_rate()``, checked), kept with the optimizer spec."""
        return None if self.opt_spec is None else self.opt_spec.base_lr

    @property
    def sharded_dist(self):
        """:attr:`dist` when it shards (several devices or processes), else None."""
        return self.dist if self.dist is not None and self.dist.sharded else None

    @property
    def memory(self):
        """The memory preflight's answer for these programs (``jaxnitro_preflight``; the
        ``memory_preflight`` plugin's ``MemoryReport``), or None."""
        return getattr(self.programs, "memory", None)


@dataclass(frozen=True)
class ResumePoint:
    """Where a resumed handle continues: the checkpoint, its run folder and position.

    ``continue_folder`` is True when no later checkpoint of its run could be continued
    from (later ones, if any, diverged): the run then continues that folder (its
    ``metrics.jsonl``, its checkpoints); otherwise (an earlier checkpoint, e.g.
    ``restore_best``) it branches into a new folder. ``data_position`` and ``open_row`` are
    the checkpoint's (as :class:`~jaxnitro.run_state.SavedRun` has them; ``open_row`` None or
    empty at a row's end): :meth:`~jaxnitro.run_state.RunState.start` puts them back.
    """

    path: str
    run_folder: str | None
    step: int
    epoch: int
    continue_folder: bool
    open_row: list | None = None
    data_position: dict | None = None


@dataclass
class RunRecord:
    """What a handle's run leaves behind.

    ``status``: ``"setup"``, ``"ready"``, ``"running"``, then ``"done"``,
    ``"diverged"``, ``"interrupted"``, ``"preempted"`` or ``"failed"``; ``stop_reason``: why a run
    ended before ``max_epochs``; ``rows``: one history row per epoch; ``run_dir``:
    the run's folder; ``loggers``: the run's loggers; ``diverged_at``:
    ``(step, epoch)`` of the first non-finite loss; ``problems``: what went wrong
    without ending the run (a logger's I/O error), as messages; ``throughput``: per row,
    ``{"epoch", "step", "steps_per_sec", ...}``, appended by the ``throughput`` plugin
    (:mod:`jaxnitro.plugins.throughput`; empty when it is disabled).
    """

    status: str = "setup"
    stop_reason: str | None = None
    rows: list = field(default_factory=list)
    run_dir: str | None = None
    loggers: list = field(default_factory=list)
    diverged_at: tuple[int, int] | None = None
    problems: list = field(default_factory=list)
    throughput: list = field(default_factory=list)  # per row: steps_per_sec, ... (the throughput plugin)
