"""``ema=`` is one optax transformation (:func:`jaxnitro.optim.ema_params`) ending the optimizer
chain: its state holds the moving average, and the train step has no EMA code of its own."""

from __future__ import annotations

import dataclasses
import inspect

import equinox as eqx
import jax
import numpy as np
import optax
import pytest

import jaxnitro as jn
from jaxnitro.optim import EmaState, ema_of, ema_params, rule_state_of
from jaxnitro.programs import ProgramSet
from jaxnitro.state import TrainState

from tiny import Tiny, tiny_data

jn.progress_reporter(None)


@jn.experiment
class Sgd(Tiny):
    def optimizer(self, group):
        return optax.sgd


def leaves(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def test_ema_params_in_a_plain_optax_loop_gives_the_ema_of_an_ema_run(tmp_path):
    data = {"train": tiny_data()["train"][:3]}  # 3 steps an epoch, no shuffling (a list of batches)
    n = jn.Nitro(Sgd(), data=data, run_dir=tmp_path, max_epochs=2, ema=jn.EMA(0.9), logger=None)
    params = jax.tree_util.tree_map(np.asarray, n.params)
    n.train()
    e, static = n.experiment, n.plan.skeleton.static

    def loss(params, batch):
        logits, _ = e.forward(eqx.combine(params, static), None, x=batch["x"])
        return e.loss(logits, label=batch["label"])

    tx = optax.chain(optax.sgd(1e-2), ema_params(0.9))  # a plain optax chain, a hand-written loop

    @jax.jit
    def step(params, opt_state, batch):
        updates, opt_state = tx.update(jax.grad(loss)(params, batch), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state = tx.init(params)
    for _ in range(2):
        for batch in data["train"]:
            params, opt_state = step(params, opt_state, batch)
    # the same numbers up to the last bit of the gradients (another program computes them:
    # XLA rounds them differently); the EMA itself is bitwise the old train step's (test_checkpoints)
    for got, want in zip(leaves(ema_of(opt_state)), leaves(n.state.ema), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    for got, want in zip(leaves(params), leaves(n.params), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert not np.allclose(leaves(n.state.ema)[0], leaves(n.params)[0])  # an average, not the params


def test_the_transform_moves_the_average_toward_the_updated_params():
    p0 = {"w": np.array([1.0, -2.0], np.float32)}
    ema = ema_params(0.75)
    state = ema.init(p0)
    updates = {"w": np.array([3.0, 2.0], np.float32)}
    out, state = ema.update(updates, state, p0)
    assert out is updates  # the updates pass through
    np.testing.assert_array_equal(ema_of(state)["w"], np.float32([1.0, -2.0]) + np.float32(0.25) * np.float32([3.0, 2.0]))
    with pytest.raises(ValueError, match="needs the params"):
        ema.update(updates, state)


def test_the_ema_lives_in_the_optimizer_state_not_beside_it(tmp_path):
    data = {"train": tiny_data()["train"][:2]}
    n = jn.Nitro(Tiny(), data=data, run_dir=tmp_path, ema=jn.EMA(0.5))
    plain = jn.Nitro(Tiny(), data=data, run_dir=tmp_path)
    # the run's state has no EMA field: the average is the last state of the optimizer's chain
    assert [f.name for f in dataclasses.fields(TrainState)] == ["params", "model_state", "opt_state", "step", "epoch", "rng"]
    rules, kept = n.state.opt_state
    assert isinstance(kept, EmaState) and n.state.ema is kept.params_ema and rule_state_of(n.state.opt_state) is rules
    assert isinstance(n.plan.tx.init(n.params)[1], EmaState)  # the transformation itself makes it
    assert jax.tree_util.tree_structure(rules) == jax.tree_util.tree_structure(plain.state.opt_state)
    assert ema_of(plain.state.opt_state) is None and plain.state.eval_params is plain.state.params
    # ... so the step program has no EMA branch: it hands the hyperparameters to the chain
    body = inspect.getsource(ProgramSet._train_step_fn).lower()
    assert "ema" not in body and "tx.update(grads, opt_state, params, hypers=hypers)" in body
