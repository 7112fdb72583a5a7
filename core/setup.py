"""Setup: an experiment and the handle's keywords in, typed state out.

:func:`build` runs the steps of ``Nitro(e, ...)`` in order and returns a
:class:`Built`: the experiment (with derived values merged), the resolved
:class:`~jaxnitro.Settings`, the wrapped data, the :class:`~jaxnitro.state.Plan`,
the :class:`~jaxnitro.state.TrainState` and the Device values. Every refusal is
raised here, at the earliest step that can know, naming the culprit and the fix.
Nothing compiles during setup.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import attrs
import equinox as eqx
import jax
import jax.numpy as jnp

from . import knobs as _knobs
from .book import schedule_horizon
from .batches import is_sized, batch_width, check_train_split, peek, unwrap, wrap_split
from .defaults import Defaults
from .distributed import check_batch_divides, check_n_devs, make_dist, split_for_process
from .hookcalls import emit
from .experiment import fields_of, is_experiment, to_device_value, traced_functions
from .knobs import Settings
from .logger import check_logger_knob
from .manual import check_manual_experiment, split_optimizer
from .optim import build_optimizer_spec, init_opt_state
from .plugin_manager import resolve_hooks
from .source_contract import bind_seed, is_addressable
from .precision import precision_policy
from .programs import ProgramSet, split_model
from .progress import SetupSteps
from .evaluation import check_eval_splits
from .routing import check_reserved_fields, route_of
from .schedules import bind_schedules, scheduled_rule_hypers
from .sharding import param_layout, sharding_policy
from .state import Plan, TrainState
from .stream_state import check_resume as check_stream_resume
from .weights import (
    check_ema_knob,
    check_tree_and_graph,
    derived_values,
    find_record,
    install_resume,
    install_weights,
    tree_diff,
    tree_diff_error,
    tree_listing,
)
from .weights import check_keywords as check_weight_keywords

__all__ = ["Built", "build", "TRACED_HOOKS"]

TRACED_HOOKS = ("forward", "loss", "train_metrics", "train_step", "metrics")
"""Hooks whose keyword-only parameters are routed batch fields."""


@dataclass(frozen=True)
class Built:
    """What setup produced for one handle (see the module docstring)."""

    experiment: object
    settings: Settings
    data: dict
    plan: Plan
    state: TrainState
    device_values: dict


def build(experiment, kwargs: dict, steps: SetupSteps) -> Built:
    """Run every setup step for ``experiment`` with the handle's ``kwargs``."""
    _check_call(experiment, kwargs)
    e = experiment
    emit("jaxnitro_check_experiment", experiment=e)
    hooks = resolve_hooks(e, Defaults())
    settings = _settings(e, kwargs, hooks)
    dist = make_dist(settings.n_devs, settings.mesh_shape)
    record = find_record(e, kwargs, settings.run_dir, settings.monitor)  # weights= / resume= checkpoints
    steps.to("building data")
    data, e, derived = _load_data(e, hooks, kwargs, steps, record, dist, settings.seed)
    if e is not experiment:  # derive (or the record) filled fields the monitor hook may read
        monitor = _monitor(e, hooks)
        settings = settings if monitor == settings.monitor else dataclasses.replace(settings, monitor=monitor)
    steps.to("checking splits")
    routes, width, batch_fields = _check_splits(hooks, data, settings)
    check_batch_divides(width if "train" in data else None, dist)
    steps.to("building model")
    state, initial, model = _build_model(e, hooks, dist, settings, kwargs.get("weights"), record)
    device_values = _device_values(e)
    metrics_on_device = _metrics_on_device(e, hooks, routes, dist)
    emit("jaxnitro_check_traced_code", experiment=e,
         functions=traced_functions(e, hooks, metrics_on_device, _train_metrics_on_host(e, hooks)))
    program_args = _program_args(e, hooks, routes, model.skeleton, state, settings)
    steps.to("building optimizer")
    anchor = None if kwargs.get("w0") == "weights" or state.params is initial else initial
    anchor_from = model.weights_from if kwargs.get("w0") == "weights" else "build_model"
    state, opt = _build_optimizer(e, hooks, model.layout, settings, data, state, anchor)
    spe = _steps_per_epoch(data, settings)
    resumed, weights_from = None, model.weights_from
    if record is not None and kwargs.get("weights") is None:  # resume=
        state, resumed, weights_from = install_resume(
            state, record, restore_optimizer=bool(kwargs.get("restore_optimizer", True)),
            steps_per_epoch=spe, accum=settings.accum,  # the job's batch width: each process reads its share
            width=width * getattr(dist, "process_count", 1) if "train" in data and width else None,
        )
    if "train" in data and record is not None and kwargs.get("weights") is None:  # resume=: the horizon rule
        schedule_horizon(settings, spe, opt.bindings, record.metadata)
    plan = Plan(
        hooks=hooks, routes=routes, width=width, batch_fields=batch_fields, metrics_on_device=metrics_on_device,
        skeleton=model.skeleton, programs=ProgramSet(**program_args, layout=opt.layout), opt_spec=opt.opt_spec,
        tx=opt.tx, bindings=opt.bindings, weights_from=weights_from, derived=derived,
        anchor_from=anchor_from, resumed=resumed, weights_meta=None if record is None else dict(record.metadata),
        dist=dist, layout=opt.layout,
    )
    check_eval_splits(e, plan, state, device_values, data, settings.monitor)
    if "train" in data and resumed is not None:  # a stream's saved iterator state fits only its source type
        train = unwrap(data["train"])
        check_stream_resume(train, is_addressable(train), resumed.data_position.get("stream_state"), record.path)
    state, device_values = _place_state(plan, state), dist.replicate(device_values)  # n_devs > 1: on the mesh
    return Built(e, settings, data, plan, state, device_values)


# -- the steps ------------------------------------------------------------------------


def _device_values(e) -> dict:
    """``{Device field: its value as a device array}`` (converted to the field's dtype)."""
    return {
        name: jnp.asarray(to_device_value(type(e).__name__, info, getattr(e, name)))
        for name, info in fields_of(e).items()
        if info.is_device
    }


def _steps_per_epoch(data: dict, settings: Settings) -> int | None:
    """Optimizer steps per epoch of the train split (None: no train split, or a stream without
    len()); refuses a stream that no ``max_steps`` bounds or that ``max_epochs`` would, and
    ``val_every_n_steps`` without a ``val`` split."""
    spe = len(data["train"]) // settings.accum if "train" in data and is_sized(data["train"]) else None
    stream = f"the `train` split is a stream without len() ({type(unwrap(data.get('train'))).__name__})"
    if "train" in data and spe is None and settings.max_steps is None:
        raise ValueError(
            f"jaxnitro: {stream}, so max_epochs cannot bound the run and nothing would end it. Pass "
            f"`max_steps=N` (the optimizer steps to take), or give the source a __len__ (grain, torch: "
            f"batches_per_epoch=N)."
        )
    if settings.val_every_n_steps is not None and "train" in data and "val" not in data:
        raise ValueError(
            f"jaxnitro: val_every_n_steps={settings.val_every_n_steps} "
            f"({settings.source('val_every_n_steps')}) validates the `val` split every that many steps, "
            f"but the data has no `val` split (splits: {sorted(data)}). Return one from build_data, "
            f"or drop val_every_n_steps (per-step train values are logged every log_every_n_steps)."
        )
    if "train" in data and spe is None and settings.max_epochs is not None:  # an explicit one: not ignored
        raise ValueError(
            f"jaxnitro: max_epochs={settings.max_epochs} ({settings.source('max_epochs')}) cannot bound "
            f"the run: {stream}, whose epochs' lengths are unknown until each ends, so the schedules "
            f"could not be planned over them. Pass max_epochs=None (max_steps={settings.max_steps} alone "
            f"bounds the run), or give the source a __len__ (grain, torch: batches_per_epoch=N)."
        )
    return spe


def _check_call(experiment, kwargs: dict) -> None:
    if not is_experiment(experiment) or isinstance(experiment, type):
        raise TypeError(
            f"jaxnitro: Nitro takes an experiment instance (a class decorated with "
            f"@jn.experiment, instantiated), got {experiment!r}."
        )
    _knobs.check_keywords(kwargs)
    check_weight_keywords(kwargs)


def _settings(e, kwargs: dict, hooks: dict) -> Settings:
    """The run knobs, checked and resolved, and the experiment's ``monitor``: one :class:`Settings`."""
    knobs = _knobs.resolve_knobs(e, kwargs)
    check_ema_knob(knobs["ema"].value, knobs["ema"].source)
    n_devs = check_n_devs(knobs["n_devs"].value, knobs["n_devs"].source)  # None: every device
    logger = check_logger_knob(knobs["logger"].value, knobs["logger"].source)
    policy = precision_policy(knobs["precision"], knobs["remat"])  # checks them
    placing = sharding_policy(knobs["sharding"], knobs["mesh_shape"], n_devs)  # checks them
    return _knobs.make_settings(knobs, logger=logger, monitor=_monitor(e, hooks), n_devs=n_devs,
                                precision_policy=policy, sharding_policy=placing)


def _place_state(plan: Plan, state: TrainState) -> TrainState:
    """The state on the mesh: params and optimizer state on their layout (``plan.layout``: FSDP,
    ``param_sharding``), the model state and the run's key replicated. With every parameter
    replicated, the whole state is replicated, as it always was."""
    dist, layout = plan.dist, plan.layout
    if layout is None or not layout.sharded:
        return dist.replicate(state)
    params = layout.place_params(state.params)
    opt_state = state.opt_state if state.opt_state is None else layout.place_opt(state.opt_state)
    model_state, rng = dist.replicate((state.model_state, state.rng))
    return state.replace(params=params, opt_state=opt_state, model_state=model_state, rng=rng)


def _load_data(e, hooks: dict, kwargs: dict, steps: SetupSteps, record=None, dist=None, seed: int = 0):
    """Take ``data=`` or call ``build_data`` (with ``dist`` in a multi-process job, else None);
    take each split's part for this process; wrap each split; hand each split's source the
    run's ``seed`` (``bind_seed``, when it defines it); run ``derive`` (or, with weights
    from a checkpoint ``record``, restore the values it derived). Returns ``(data, experiment
    with the derived values merged, the derived values)`` (host values)."""
    if kwargs.get("data") is not None:
        raw = kwargs["data"]
    else:
        if "build_data" not in hooks:
            raise TypeError(
                f"jaxnitro: {type(e).__name__} has no `build_data` hook and no `data=` was "
                f"given. Define `def build_data(self, dist) -> dict` returning the splits, or "
                f"pass `Nitro(e, data={{'train': ..., 'val': ...}})` (`data={{}}` to only predict)."
            )
        raw = hooks["build_data"].function(e, dist if dist is not None and dist.multi_process else None)
    if not isinstance(raw, Mapping):
        raise TypeError(f"jaxnitro: the data must be a dict {{split: source}}, got {type(raw).__name__}.")
    data = {str(s): wrap_split(split_for_process(src, str(s), dist), str(s)) for s, src in raw.items()}
    for src in data.values():  # an unseeded shuffling source draws its order from the run's seed
        bind_seed(unwrap(src), seed)
    if record is not None:  # the record's derived values, and `derive` is skipped
        derived = derived_values(e, record)
        return data, attrs.evolve(e, **derived), derived
    if "derive" not in hooks or not raw:
        return data, e, {}
    steps.to("deriving")
    # derive sees the user's sources, also when `data=` came from another handle
    derived = hooks["derive"].function(e, {s: unwrap(src) for s, src in data.items()}) or {}
    unknown = [n for n in derived if n not in fields_of(e)]
    if unknown:
        raise KeyError(
            f"jaxnitro: `derive` returned {unknown}, which are not fields of "
            f"{type(e).__name__}; declare them as fields (Device[...] for values traced "
            f"code reads) so derive can fill them in."
        )
    return data, attrs.evolve(e, **derived), dict(derived)


def _check_splits(hooks: dict, data: dict, settings: Settings) -> tuple[dict, int | None, tuple | None]:
    """Resolve routing; check the train split (or find the batch width from another split).
    Returns ``(routes, width, batch_fields)``."""
    routes = {h: route_of(h, hooks[h].function) for h in TRACED_HOOKS if h in hooks}
    width = batch_fields = None
    if "train" in data:
        width = check_train_split(data["train"], settings.accum)
        first = peek(data["train"])
        if first is not None:
            for h in ("forward", "loss", "train_metrics", "train_step"):
                if h in routes:
                    routes[h].check(first.keys())
            batch_fields = tuple(first.keys())
            check_reserved_fields(first.keys(), routes, "the `train` split's first batch")
        return routes, width, batch_fields
    for split, src in data.items():
        first = peek(src) if len(src) else None
        if first is not None:
            width = batch_width(first, f"`{split}` split's first batch")
            break
    return routes, width, batch_fields


@dataclass(frozen=True)
class _Model:
    """What building the model settles for the plan: its static half, the params' layout on
    the mesh (before the optimizer state joins it) and where the weights came from, in words."""

    skeleton: object
    layout: object
    weights_from: str


@dataclass(frozen=True)
class _Optimizer:
    """What building the optimizer settles for the plan (each None without a train split,
    except ``bindings``; ``layout`` then is the model's)."""

    opt_spec: object
    tx: object
    bindings: object
    layout: object


def _build_model(e, hooks: dict, dist, settings: Settings, weights, record=None) -> tuple[TrainState, object, _Model]:
    """Call ``build_model`` with a key from the seed; partition it once; warm-start or install a
    checkpoint record's weights if asked (a resume installs its state after the optimizer).
    Returns ``(state, build_model's params, the model's part of the plan)``."""
    for hook in ("build_model", "forward"):
        if hook not in hooks:
            raise TypeError(
                f"jaxnitro: {type(e).__name__} has no `{hook}` hook; define it as a method "
                f"(see jaxnitro.hookspecs.{hook})."
            )
    model_key, run_key = jax.random.split(jax.random.PRNGKey(settings.seed))
    built = hooks["build_model"].function(e, model_key)
    # (model, eqx.nn.State) from eqx.nn.make_with_state; anything else is the model itself
    # (a tuple of modules is a valid model).
    if isinstance(built, tuple) and len(built) == 2 and isinstance(built[1], eqx.nn.State):
        model, model_state = built
    else:
        model, model_state = built, None
    params, skeleton = split_model(model)
    layout = param_layout(settings.sharding_policy, e, hooks, params, dist.mesh, dist.multi_process)
    if layout.sharded:  # placed now: restored weights land on their shards
        params = layout.place_params(params)
    state = TrainState(params=params, model_state=model_state, opt_state=None, step=0, epoch=0, rng=run_key)
    weights_from = "build_model (seed %d)" % settings.seed
    initial = state.params
    if record is not None:
        check_tree_and_graph(e, state.params, record, "weights" if weights is not None else "resume")
        if weights is not None:
            state, weights_from = install_weights(state, record)
    elif weights is not None:
        state, weights_from = _warm_start(state, weights)
    return state, initial, _Model(skeleton, layout, weights_from)


def _warm_start(state: TrainState, other) -> tuple[TrainState, str]:
    """``weights=`` another handle: a copy of its params (and model state); returns
    ``(state, where the weights came from)``."""
    theirs_state = other.state
    diff = tree_diff(tree_listing(state.params), tree_listing(theirs_state.params))
    if diff:
        raise tree_diff_error(
            diff,
            "Warm-start from a handle whose model has the same structure (same GraphConst "
            "fields such as the width), or build this one without `weights=`.",
        )
    copy = lambda tree: jax.tree_util.tree_map(jnp.copy, tree)  # noqa: E731
    model_state = state.model_state if theirs_state.model_state is None else copy(theirs_state.model_state)
    weights_from = f"warm start from a {type(other.experiment).__name__} handle (step {theirs_state.step})"
    return state.replace(params=copy(theirs_state.params), model_state=model_state), weights_from


def _metrics_on_device(e, hooks: dict, routes: dict, dist) -> bool:
    """Check ``metrics_residency``'s answers; True when ``metrics`` is traced."""
    residency = hooks["metrics_residency"].function
    for hook in ("metrics", "train_metrics"):
        where = residency(e, hook)
        if where not in ("device", "host"):
            raise ValueError(
                f"jaxnitro: metrics_residency({hook!r}) returned {where!r}; expected 'device' or 'host'."
            )
    if _train_metrics_on_host(e, hooks) and dist is not None and dist.multi_process:
        raise ValueError(
            f"jaxnitro: metrics_residency('train_metrics') is 'host', but this is a multi-process job "
            f"({dist.process_count} processes): a host-resident train_metrics would run on one "
            f"process over rows that live on all of them. Return 'device' for train_metrics (it "
            f"is traced and reduced across processes with the step), or compute it per process "
            f"from `metrics` on the `val` split."
        )
    if "train_metrics" in routes and routes["train_metrics"].wants_key and _train_metrics_on_host(e, hooks):
        raise TypeError(
            "jaxnitro: `train_metrics` declares the keyword `key`, but it runs on the host (its "
            "metrics_residency is 'host'); a PRNG key is supplied to traced hooks only. Drop "
            "`key` from `train_metrics`, or make it device-resident (metrics_residency -> 'device')."
        )
    on_device = "metrics" in hooks and residency(e, "metrics") == "device"
    if "metrics" in routes and routes["metrics"].wants_key and not on_device:
        raise TypeError(
            "jaxnitro: `metrics` declares the keyword `key`, but it runs on the host (its "
            "metrics_residency is 'host'); a PRNG key is supplied to traced hooks only. Drop "
            "`key` from `metrics`, or make it device-resident (metrics_residency -> 'device')."
        )
    return on_device


def _train_metrics_on_host(e, hooks: dict) -> bool:
    """Whether ``train_metrics`` runs on the host (``metrics_residency`` = ``"host"``): the
    training step then hands each micro-batch's outputs to it through a host callback."""
    return "train_metrics" in hooks and hooks["metrics_residency"].function(e, "train_metrics") == "host"


def _program_args(e, hooks: dict, routes: dict, skeleton, state: TrainState, settings: Settings) -> dict:
    """The :class:`ProgramSet`'s arguments but the layout (checked here; the set is made with
    the plan, once the optimizer state's layout is known)."""
    infos = fields_of(e)
    return dict(
        cls=type(e),
        hooks=hooks,
        routes=routes,
        graph_values={n: getattr(e, n) for n, i in infos.items() if i.is_graph_const},
        host_fields=tuple(n for n, i in infos.items() if i.is_host),
        skeleton=skeleton,
        param_def=jax.tree_util.tree_structure(state.params),
        state_def=jax.tree_util.tree_structure(state.model_state),
        train_metrics_on_host=_train_metrics_on_host(e, hooks),
        precision=settings.precision_policy.for_params(e, hooks, state.params),  # refuses train_step
    )


def _build_optimizer(e, hooks: dict, layout, settings: Settings, data: dict, state: TrainState,
                     anchor=None) -> tuple[TrainState, _Optimizer]:
    """Groups, rules and optimizer state (only with a train split); bind the schedules.
    Returns the state with its optimizer state and the optimizer's part of the plan (``layout``:
    the model's, with the optimizer state following its parameters).

    ``anchor``: the weights ``decay_anchor = "w0"`` groups decay toward when they are not
    the current params (``build_model``'s, after ``weights=`` without ``w0="weights"``)."""
    opt_spec = tx = None
    manual = "train_step" in hooks
    if manual:
        check_manual_experiment(type(e).__name__, hooks, settings.accum)
    if "train" in data:
        if "loss" not in hooks and not manual:
            raise TypeError(
                f"jaxnitro: {type(e).__name__} has a `train` split but no `loss` hook; define "
                f"`def loss(self, outputs, *, <batch fields>) -> scalar` (or write the whole step "
                f"in a `train_step` hook)."
            )
        ema_decay = check_ema_knob(settings.ema, settings.source("ema"))
        opt_spec = build_optimizer_spec(e, hooks, state.params, settings.gradient_clip_norm, ema_decay)
        # schedules bind first: a scheduled rule hyperparameter (Adam's b1) is injected
        schedulable = {g.name: g.schedulable for g in opt_spec.groups}
        bindings = bind_schedules(settings.schedules, _device_fields(e), schedulable)
        opt_spec = opt_spec.with_scheduled(scheduled_rule_hypers(bindings, schedulable))
        if manual:  # one optimizer per model, applied by the experiment's train_step
            tx = split_optimizer(opt_spec, state.params)
            opt_state = tx.init(state.params, anchor)
        else:
            tx = opt_spec.transformation()
            opt_state = init_opt_state(opt_spec, tx, state.params, anchor)
        layout = layout.with_opt(opt_state)  # the optimizer state follows its parameter
        if layout.sharded:
            opt_state = layout.place_opt(opt_state)
        state = state.replace(opt_state=opt_state)
    else:
        bindings = bind_schedules(settings.schedules, _device_fields(e), ())
    return state, _Optimizer(opt_spec, tx, bindings, layout)  # the train programs pin outputs to layout


def _device_fields(e) -> dict:
    return {n: i for n, i in fields_of(e).items() if i.is_device}


def _monitor(e, hooks: dict):
    if "monitor" not in hooks:
        return None
    m = hooks["monitor"].function(e)
    if not (isinstance(m, tuple) and len(m) == 2 and m[1] in ("max", "min") and isinstance(m[0], str)):
        raise ValueError(
            f"jaxnitro: `monitor` returned {m!r}; it must return (metric name, 'max' | 'min'), "
            f"e.g. ('macro_recall', 'max')."
        )
    return m
