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
  ``train_step``, ``accum > 1``, a stateful model, a group spanning two models).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import equinox as eqx
import jax
import jax.numpy as jnp

from .optim import OptimizerSpec, init_opt_state, set_hypers

__all__ = [
    "ModelOptimizers", "Optimizers", "split_optimizer", "check_manual_experiment", "check_step_result",
    "per_step_scalars",
]


@dataclass(frozen=True)
class ModelOptimizers:
    """One optimizer per model: ``names[i]`` (a model's key in the dict model, or None for a
    single model) is updated by ``txs[i]``, built from ``specs[i]`` (the run's
    :class:`~jaxnitro.optim.OptimizerSpec` restricted to that model's groups; its
    hyperparameter layout is the run's, so schedules reach every group)."""

    names: tuple
    specs: tuple
    txs: tuple

    @property
    def multi(self) -> bool:
        """Whether the model is a dict of named models (the states are then a dict too)."""
        return self.names != (None,)

    def init(self, params, anchor=None):
        """The rules' state: ``{name: state}`` for a dict model, the one state otherwise."""
        if not self.multi:
            return init_opt_state(self.specs[0], self.txs[0], params, anchor)
        return {
            n: init_opt_state(s, tx, params[n], None if anchor is None else anchor[n])
            for n, s, tx in zip(self.names, self.specs, self.txs)
        }


def split_optimizer(spec: OptimizerSpec, params) -> ModelOptimizers:
    """Split the run's optimizer ``spec`` by model (``params``: a dict of models' params, or one).

    Raises ``ValueError`` when a group (``param_group``) holds parameters of two models:
    each model has its own optimizer, so a group cannot span models.
    """
    single = dataclasses.replace(spec, ema_decay=None)  # the EMA is kept over all params, outside
    if not isinstance(params, dict):
        return ModelOptimizers((None,), (single,), (single.transformation(),))
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
    return ModelOptimizers(tuple(names), tuple(specs), tuple(txs))


class Optimizers:
    """The optimizers as ``train_step`` sees them (inside the trace).

    ``update(grads, model, name=...)`` returns ``(updated model, updated Optimizers)``;
    ``names`` lists the models that have an optimizer; ``optimizers[name]`` is a model's
    optimizer state. Immutable: return the last ``Optimizers`` from ``train_step``.
    """

    def __init__(self, spec: ModelOptimizers, states, hypers):
        self._spec = spec
        self._states = dict(states) if spec.multi else {None: states}
        self._hypers = hypers

    @property
    def names(self) -> tuple:
        return self._spec.names

    def __getitem__(self, name):
        return self._states[self._index(name)[0]]

    def _index(self, name):
        if not self._spec.multi:
            if name is not None:
                raise KeyError(
                    f"jaxnitro: optimizers.update(..., name={name!r}): the model is a single module, "
                    f"so it has one optimizer; call `optimizers.update(grads, model)` without `name`."
                )
            return None, 0
        if name not in self._spec.names:
            raise KeyError(
                f"jaxnitro: optimizers.update(..., name={name!r}): no optimizer of that name; the "
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
        state = set_hypers(self._states[key], spec, self._hypers)
        updates, state = tx.update(grads, state, params)
        new = copy.copy(self)
        new._states = {**self._states, key: state}
        return eqx.apply_updates(model, updates), new

    def states(self):
        """The rules' state in the layout :meth:`ModelOptimizers.init` made."""
        return dict(self._states) if self._spec.multi else self._states[None]


def check_manual_experiment(cls_name: str, hooks: dict, accum: int, model_state) -> None:
    """Setup refusals for an experiment defining ``train_step`` (each names the culprit and the fix)."""
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
    if model_state is not None:
        raise TypeError(
            f"jaxnitro: {cls_name} defines `train_step`, but `build_model` returned a model with "
            f"state (`eqx.nn.State`); `train_step` receives no state to thread through. Use "
            f"stateless layers (e.g. LayerNorm instead of BatchNorm), or train with `forward` and `loss`."
        )


def check_step_result(res, cls_name: str, p_def, opt: ModelOptimizers):
    """``(params, rules' state, scalars)`` from ``train_step``'s ``(models, optimizers, scalars)``.

    Raises ``TypeError`` naming what is wrong: not a 3-tuple, models of another structure,
    a second element that is not the ``Optimizers``, scalars that are not a non-empty dict
    of scalars.
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
    return params, optimizers.states(), tuple(scalars), jnp.stack(values)


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
