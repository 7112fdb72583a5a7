"""Manual training: an experiment that writes its own optimizer step (the ``train_step`` hook).

The experiment's ``train_step(self, models, optimizers, *, <batch fields>)`` is
traced inside the framework's train-step program in place of the automatic
forward/loss/gradient/update body; everything around it (compile cache, prefetch,
schedules, logging, divergence checks, validation, checkpoints, EMA) is unchanged.

* :class:`ModelOptimizers`: setup's split of the run's optimizer into one optimizer
  per model (a dict model's entries, or the one model), each an optax
  transformation over that model's groups (``plan.tx`` of a manual experiment).
* :class:`Optimizers`: what ``train_step`` receives: the optimizer states and the
  step's hyperparameter vector; ``update(grads, model, name=...)`` applies one
  model's optimizer and returns the updated model and a new ``Optimizers``.
* :func:`check_manual_experiment`: the setup refusals (``loss`` together with
  ``train_step``, ``accum > 1``, a group spanning two models).
* :func:`check_step_result`: the trace-time checks of what ``train_step`` returned,
  among them that every model was updated (or skipped) and the model state handed back.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import equinox as eqx
import jax
import jax.numpy as jnp

from .optim import OptimizerSpec, ema_params, ema_track, init_opt_state

__all__ = [
    "ModelOptimizers", "Optimizers", "split_optimizer", "check_manual_experiment", "check_step_result",
    "check_updates", "check_model_state", "per_step_scalars",
]


@dataclass(frozen=True)
class ModelOptimizers:
    """One optimizer per model: ``names[i]`` (a model's key in the dict model, or None for a
    single model) is updated by ``txs[i]``, built from ``specs[i]`` (the run's
    :class:`~jaxnitro.optim.OptimizerSpec` restricted to that model's groups; its
    hyperparameter layout is the run's, so schedules reach every group). ``ema_slot``: the EMA
    decay's slot in it (the EMA is kept over every model's params, around the step), or None."""

    names: tuple
    specs: tuple
    txs: tuple
    ema_slot: int | None = None

    @property
    def multi(self) -> bool:
        """Whether the model is a dict of named models (the states are then a dict too)."""
        return self.names != (None,)

    def init(self, params, anchor=None):
        """The run's optimizer state: the rules' state (``{name: state}`` for a dict model, the
        one state otherwise), with EMA on ``(rules, EmaState)`` as :func:`~jaxnitro.optim.ema_params` makes it."""
        rules = init_opt_state(self.specs[0], self.txs[0], params, anchor) if not self.multi else {
            n: init_opt_state(s, tx, params[n], None if anchor is None else anchor[n])
            for n, s, tx in zip(self.names, self.specs, self.txs)
        }
        return rules if self.ema_slot is None else (rules, ema_params(None).init(params))

    def stepped(self, state, rules, params, hypers):
        """The run's optimizer state after a step: the models' ``rules``, and the EMA (when on)
        moved toward the step's new ``params`` (the experiment's step returns params, not updates)."""
        return rules if self.ema_slot is None else (rules, ema_track(state[1], params, hypers[self.ema_slot]))


def split_optimizer(spec: OptimizerSpec, params) -> ModelOptimizers:
    """Split the run's optimizer ``spec`` by model (``params``: a dict of models' params, or one).

    Raises ``ValueError`` when a group (``param_group``) holds parameters of two models:
    each model has its own optimizer, so a group cannot span models.
    """
    single = dataclasses.replace(spec, ema_decay=None)  # the EMA is kept over all params, outside
    slot = spec.layout.ema_index if spec.ema else None
    if not isinstance(params, dict):
        return ModelOptimizers((None,), (single,), (single.transformation(),), slot)
    owner: dict[str, str] = {}
    names, specs, txs = [], [], []
    for name in params:
        groups = sorted(set(jax.tree_util.tree_leaves(spec.labels[name])))
        if not groups:
            continue  # a model without trainable arrays has nothing to optimize
        for g in groups:
            if g in owner:
                raise ValueError(
                    f"jaxnitro: parameter group `{g}` holds parameters of the models `{owner[g]}` and "
                    f"`{name}`; with `train_step` each model has its own optimizer, so a group "
                    f"cannot span two models. Make `param_group` return distinct names per model "
                    f"(e.g. prefix them with `keypath[0]`, the model's name)."
                )
            owner[g] = name
        sub = dataclasses.replace(
            single, groups=tuple(x for x in spec.groups if x.name in groups), labels=spec.labels[name]
        )
        names.append(name)
        specs.append(sub)
        txs.append(sub.transformation())
    return ModelOptimizers(tuple(names), tuple(specs), tuple(txs), slot)


class Optimizers:
    """The step context ``train_step`` receives (inside the trace): the optimizers and the model state.

    ``update(grads, model, name=...)`` returns ``(updated model, updated Optimizers)``;
    ``names`` lists the models that have an optimizer; ``optimizers[name]`` is a model's
    optimizer state. ``model_state`` is the model's ``eqx.nn.State`` (None for a stateless
    model) and ``with_model_state(state)`` hands the updated state back; ``skip(name)``
    declares a model deliberately left unchanged by this step. Immutable: return the last
    ``Optimizers`` from ``train_step``. The trace refuses a step that leaves a model without
    ``update`` (or ``skip``), returns a model as it received it, or, for a model with state,
    never calls ``with_model_state`` (:func:`check_step_result`).
    """

    def __init__(self, spec: ModelOptimizers, states, hypers, model_state=None):
        self._spec = spec
        self._states = dict(states) if spec.multi else {None: states}
        self._hypers = hypers
        self._model_state = model_state
        self._updated: frozenset = frozenset()  # models `update` was applied to, in this chain
        self._skipped: frozenset = frozenset()
        self._state_set = False
        self._log = {"updated": set(), "state_set": False}  # shared by every Optimizers of this step

    @property
    def names(self) -> tuple:
        return self._spec.names

    @property
    def model_state(self):
        """The model state (``eqx.nn.State``) as of this context: the one ``build_model`` made
        (or the last step left), or the one last passed to :meth:`with_model_state`; None for a
        stateless model. Thread it through the stateful layers' calls (``model(x, state)``)."""
        return self._model_state

    def __getitem__(self, name):
        return self._states[self._index(name)[0]]

    def _derived(self, **changes) -> "Optimizers":
        new = copy.copy(self)
        new.__dict__.update(changes)
        return new

    def _index(self, name, verb: str = "update(..., name={name!r})"):
        verb = verb.format(name=name)
        if not self._spec.multi:
            if name is not None:
                raise KeyError(
                    f"jaxnitro: optimizers.{verb}: the model is a single module, so it has one "
                    f"optimizer; call `optimizers.{verb.split('(')[0]}(...)` without `name`."
                )
            return None, 0
        if name not in self._spec.names:
            raise KeyError(
                f"jaxnitro: optimizers.{verb}: no optimizer of that name; the "
                f"models with an optimizer are {list(self._spec.names)} (the keys of the dict "
                f"`build_model` returned)."
            )
        return name, self._spec.names.index(name)

    def update(self, grads, model, name=None):
        """Apply model ``name``'s optimizer: clip ``grads`` (with ``gradient_clip_norm``), run
        its groups' rules with this step's learning rates and decays, apply to ``model``.

        ``grads`` has the structure of ``eqx.filter(model, eqx.is_inexact_array)`` (what
        ``eqx.filter_grad`` / ``eqx.filter_value_and_grad`` of ``model`` return). Returns
        ``(updated model, updated Optimizers)``. Raises ``KeyError`` for an unknown ``name``
        and ``TypeError`` when ``grads`` does not match ``model``.
        """
        key, i = self._index(name)
        spec, tx = self._spec.specs[i], self._spec.txs[i]
        params = eqx.filter(model, eqx.is_inexact_array)
        p_def, g_def = jax.tree_util.tree_structure(params), jax.tree_util.tree_structure(grads)
        if p_def != g_def:
            raise TypeError(
                f"jaxnitro: optimizers.update(grads, model{'' if name is None else f', name={name!r}'}): "
                f"`grads` does not have the structure of the model's trainable arrays. Take the "
                f"gradient with respect to that model, e.g. `eqx.filter_grad(loss_fn)(model, ...)`."
                f"\n  model's arrays: {p_def}\n  grads: {g_def}"
            )
        grads = spec.clip(grads, self._hypers)
        updates, state = tx.update(grads, self._states[key], params, hypers=self._hypers)
        self._log["updated"].add(key)
        new = self._derived(_states={**self._states, key: state}, _updated=self._updated | {key})
        return eqx.apply_updates(model, updates), new

    def with_model_state(self, state) -> "Optimizers":
        """A new ``Optimizers`` carrying ``state``, the model state after this step's forward
        passes (what the stateful layers returned: ``out, state = model(x, state)``); the
        framework stores it with the run (checkpoints, validation in inference mode).

        Raises ``TypeError`` when the model has no state or ``state`` is not an ``eqx.nn.State``.
        """
        if self._model_state is None:
            raise TypeError(
                "jaxnitro: optimizers.with_model_state(...): the model has no state (`build_model` "
                "returned no `eqx.nn.State`), so there is none to hand back. Drop the call, or "
                "return `eqx.nn.make_with_state(...)`'s `(model, state)` from `build_model`."
            )
        if not isinstance(state, eqx.nn.State):
            raise TypeError(
                f"jaxnitro: optimizers.with_model_state(...) takes the model's `eqx.nn.State` (the "
                f"second value a stateful layer returns, `out, state = model(x, state)`), got "
                f"{type(state).__name__}."
            )
        self._log["state_set"] = True
        return self._derived(_model_state=state, _state_set=True)

    def skip(self, name=None) -> "Optimizers":
        """A new ``Optimizers`` recording that model ``name`` is deliberately not updated by this
        step (a frozen teacher, a target network): its weights and optimizer state stay as
        they are, and the trace does not refuse the step for it. Raises ``KeyError`` for an
        unknown ``name``."""
        key, _ = self._index(name, "skip({name!r})")
        return self._derived(_skipped=self._skipped | {key})

    def states(self):
        """The rules' state in the layout :meth:`ModelOptimizers.init` made."""
        return dict(self._states) if self._spec.multi else self._states[None]


def check_manual_experiment(cls_name: str, hooks: dict, accum: int) -> None:
    """Setup refusals for an experiment defining ``train_step`` (each names the culprit and the fix).

    A model with state is accepted: the step context threads it (``Optimizers.model_state``,
    ``Optimizers.with_model_state``)."""
    if "loss" in hooks:
        raise TypeError(
            f"jaxnitro: {cls_name} defines both `train_step` and `loss`. With `train_step` the "
            f"experiment computes its own losses and gradients, so `loss` would never be used for "
            f"training. Remove `loss` (compute it inside `train_step` and return it among the "
            f"scalars), and report validation figures from `metrics`."
        )
    if accum != 1:
        raise ValueError(
            f"jaxnitro: {cls_name} defines `train_step` and runs with accum={accum}; gradient "
            f"accumulation is the automatic step's, and a `train_step` takes its optimizer steps "
            f"itself. Use accum=1 (accumulate inside `train_step` if you need it)."
        )


def check_step_result(res, cls_name: str, p_def, opt: ModelOptimizers, given, s_def=None):
    """``(params, rules' state, scalar names, scalars, model state)`` from ``train_step``'s
    ``(models, optimizers, scalars)``; ``given`` is the trainable-array tree ``train_step``
    received, ``s_def`` the model state's structure (None or a tree without leaves:
    stateless).

    Raises ``TypeError`` naming what is wrong: not a 3-tuple, models of another structure,
    a second element that is not the ``Optimizers``, scalars that are not a non-empty dict
    of scalars; and ``ValueError`` naming the model (and its groups) when no update reached
    it (:func:`check_updates`) or, for a model with state, the state was not handed back.
    """
    if not (isinstance(res, tuple) and len(res) == 3):
        what = f"a tuple of {len(res)}" if isinstance(res, tuple) else type(res).__name__
        raise TypeError(
            f"jaxnitro: `train_step` of {cls_name} returned {what}; it must return "
            f"`(models, optimizers, scalars)`: the updated models, the `Optimizers` that the last "
            f"`optimizers.update(...)` returned, and a dict {{name: scalar}} to log."
        )
    models, optimizers, scalars = res
    if not isinstance(optimizers, Optimizers):
        raise TypeError(
            f"jaxnitro: `train_step` of {cls_name} returned {type(optimizers).__name__} as its "
            f"second element; return the `Optimizers` that `optimizers.update(...)` returned."
        )
    params = eqx.filter(models, eqx.is_inexact_array)
    if jax.tree_util.tree_structure(params) != p_def:
        raise TypeError(
            f"jaxnitro: `train_step` of {cls_name} returned models whose trainable arrays differ in "
            f"structure from those `build_model` made; return the models it received, updated "
            f"(same dict keys, same layers).\n  expected: {p_def}\n  returned: "
            f"{jax.tree_util.tree_structure(params)}"
        )
    if not isinstance(scalars, dict) or not scalars:
        raise TypeError(
            f"jaxnitro: `train_step` of {cls_name} returned {scalars!r} as its scalars; return a "
            f"non-empty dict {{name: scalar}} (e.g. {{'d_loss': d_loss, 'g_loss': g_loss}}), logged "
            f"as train lines."
        )
    values = per_step_scalars(
        scalars, f"`train_step` of {cls_name} returned scalar", "the logged values are per-step scalars"
    )
    check_updates(optimizers, opt, cls_name, given, params)
    model_state = check_model_state(optimizers, cls_name, s_def)
    return params, optimizers.states(), tuple(scalars), jnp.stack(values), model_state


def _model_words(opt: ModelOptimizers, key) -> tuple[str, str, str]:
    """``(what, how to update it, how to skip it)`` for model ``key`` in the refusals."""
    groups = [g.name for g in opt.specs[opt.names.index(key)].groups]
    if key is None:
        return f"the model (group(s) {groups})", "`model, optimizers = optimizers.update(grads, model)`", \
            "`optimizers = optimizers.skip()`"
    return (
        f"model `{key}` (group(s) {groups})",
        f"`{key}, optimizers = optimizers.update(grads, {key}, name={key!r})`",
        f"`optimizers = optimizers.skip({key!r})`",
    )


def check_updates(optimizers: Optimizers, opt: ModelOptimizers, cls_name: str, given, returned) -> None:
    """Refuse (``ValueError``) a traced step after which a model with an optimizer was neither
    updated nor skipped in the returned ``Optimizers`` (``update`` never called for it, or
    called on a chain the step did not return, e.g. returning the ``optimizers`` it received),
    or whose returned trainable arrays are all the very arrays the step received (the model
    returned as given, its update discarded): the run would end ``done`` with that model's
    weights unchanged or its optimizer's step count stuck at 0. Names the model, its groups and the fix.
    """
    for key in opt.names:
        if key in optimizers._skipped:
            continue
        what, how, skip = _model_words(opt, key)
        if key not in optimizers._updated:
            if key in optimizers._log["updated"]:
                why = (
                    f"`optimizers.update` was called for it, but the `Optimizers` returned is an "
                    f"earlier one (e.g. the one `train_step` received), so that update's optimizer "
                    f"state is lost. Return the `Optimizers` the last `update` returned."
                )
            else:
                why = f"`optimizers.update` was never called for it. Call {how} and return the `Optimizers` it returned."
            raise ValueError(
                f"jaxnitro: `train_step` of {cls_name} applies no update to {what}: {why} Without it "
                f"the run would end with that model's weights unchanged and its optimizer's step "
                f"count at 0. A model meant to stay fixed in this step: {skip}."
            )
        mine = jax.tree_util.tree_leaves(given if key is None else given[key])
        theirs = jax.tree_util.tree_leaves(returned if key is None else returned[key])
        if mine and all(a is b for a, b in zip(mine, theirs, strict=True)):
            raise ValueError(
                f"jaxnitro: `train_step` of {cls_name} returns {what} exactly as it received it: "
                f"`optimizers.update` was applied to it, but the updated model it returned was not "
                f"put in the returned models, so its weights would never change. Return the model "
                f"from {how} (e.g. `{{..., {key!r}: {key}}}`)." if key is not None else
                f"jaxnitro: `train_step` of {cls_name} returns {what} exactly as it received it: "
                f"`optimizers.update` was applied, but the updated model it returned is not the one "
                f"returned, so the weights would never change. Return the model from {how}."
            )


def check_model_state(optimizers: Optimizers, cls_name: str, s_def):
    """The model state the step hands back: ``optimizers.model_state`` after
    ``with_model_state``. For a stateful model (``s_def`` with leaves), refuses
    (``ValueError``) a step that never called ``with_model_state`` on the returned chain, and
    (``TypeError``) a state of another structure than ``build_model``'s."""
    if s_def is None or s_def.num_leaves == 0:
        return optimizers.model_state
    if not optimizers._state_set:
        lost = " It was called, but on an `Optimizers` the step did not return." if optimizers._log["state_set"] else ""
        raise ValueError(
            f"jaxnitro: `train_step` of {cls_name} does not hand back the model state: the model "
            f"has state (`eqx.nn.State`, e.g. BatchNorm's running statistics), which would then "
            f"never change.{lost} Fix: run the stateful layers with `optimizers.model_state` "
            f"(`out, state = model(x, state)`), then `optimizers = optimizers.with_model_state(state)`, "
            f"and return that `Optimizers`."
        )
    state = optimizers.model_state
    got = jax.tree_util.tree_structure(state)
    if got != s_def:
        raise TypeError(
            f"jaxnitro: `train_step` of {cls_name} handed back (`with_model_state`) a model state whose "
            f"structure differs from the one `build_model` made; pass the state the stateful layers "
            f"returned, starting from `optimizers.model_state`.\n  expected: {s_def}\n  returned: {got}"
        )
    return state


def per_step_scalars(scalars: dict, what: str, why: str) -> list:
    """The float32 scalars of ``scalars`` (a train step's logged values), in order.

    Raises ``TypeError`` naming the entry when one is not a scalar: "{what} `name` has
    shape ...; {why}. Reduce it (e.g. `.mean()`)".
    """
    values = []
    for k, v in scalars.items():
        v = jnp.asarray(v)
        if v.shape != ():
            raise TypeError(f"jaxnitro: {what} `{k}` has shape {v.shape}; {why}. Reduce it (e.g. `.mean()`).")
        values.append(v.astype(jnp.float32))
    return values
