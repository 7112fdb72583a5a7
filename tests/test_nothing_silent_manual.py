"""Manual training with nothing silent (issue 23, items 11 and 12).

* A ``train_step`` that leaves a model without an update (``optimizers.update`` never called
  for it, called on a chain it did not return, or the updated model discarded) is refused
  at the trace, naming the model and its groups; ``optimizers.skip(name)`` says it on purpose.
* A model with state (BatchNorm) trains with ``train_step``: the step context carries the
  state in (``optimizers.model_state``) and out (``optimizers.with_model_state``); the
  running statistics move, equal the automatic step's, and are checkpointed and resumed.
"""

from __future__ import annotations

import equinox as eqx
import jax
import numpy as np
import optax
import pytest

import jaxnitro as jn
from jaxnitro import Device, GraphConst
from tiny import TinyCore, tiny_data
from test_manual_training import ManualTiny, TinyGan, leaves, same, xent
from test_training import BatchNormed

# -- item 11: every model gets its update, or the trace refuses ------------------------------------


def manual(name, base=ManualTiny, **members):
    return jn.experiment(type(name, (base,), dict(members)))


def loss_and_grads(model, x, label):
    return eqx.filter_value_and_grad(lambda m: xent(jax.vmap(m)(x), label))(model)


def test_a_step_that_never_updates_is_refused_naming_the_model(tmp_path):
    def forgets(self, model, optimizers, *, x, label):
        loss, _ = loss_and_grads(model, x, label)
        return model, optimizers, {"loss": loss}

    with pytest.raises(ValueError, match=r"(?s)`train_step` of Forgets applies no update to the model \(group\(s\) "
                       r"\['default'\]\): `optimizers.update` was never called for it. Call `model, optimizers = "
                       r"optimizers.update\(grads, model\)`.*step count at 0.*optimizers.skip\(\)"):
        jn.train(manual("Forgets", train_step=forgets)(), run_dir=tmp_path, logger=None)


def test_returning_the_optimizers_it_was_given_is_refused(tmp_path):
    def stale_optimizers(self, model, optimizers, *, x, label):
        loss, grads = loss_and_grads(model, x, label)
        model, _ = optimizers.update(grads, model)
        return model, optimizers, {"loss": loss}

    with pytest.raises(ValueError, match=r"(?s)applies no update to the model .*was called for it, but the "
                       r"`Optimizers` returned is an earlier one"):
        jn.train(manual("StaleOptimizers", train_step=stale_optimizers)(), run_dir=tmp_path, logger=None)


def test_returning_the_models_it_was_given_is_refused(tmp_path):
    def stale_model(self, model, optimizers, *, x, label):
        loss, grads = loss_and_grads(model, x, label)
        _, optimizers = optimizers.update(grads, model)
        return model, optimizers, {"loss": loss}

    with pytest.raises(ValueError, match=r"returns the model \(group\(s\) \['default'\]\) exactly as it received it"):
        jn.train(manual("StaleModel", train_step=stale_model)(), run_dir=tmp_path, logger=None)


def gan_step(update_generator: str):
    """TinyGan's step; the generator is updated (``"update"``), forgotten (``"forget"``),
    skipped on purpose (``"skip"``) or updated but not returned (``"discard"``)."""

    def train_step(self, models, optimizers, *, x, key):
        g, d = models["generator"], models["discriminator"]
        z = jax.random.normal(key, (x.shape[0], 2))
        bce = optax.sigmoid_binary_cross_entropy
        dl, dg = eqx.filter_value_and_grad(
            lambda d: bce(jax.vmap(d)(x)[:, 0], 1.0).mean() + bce(jax.vmap(d)(jax.vmap(g)(z))[:, 0], 0.0).mean()
        )(d)
        d, optimizers = optimizers.update(dg, d, name="discriminator")
        new_g = g
        if update_generator in ("update", "discard"):
            gg = eqx.filter_grad(lambda g: bce(jax.vmap(d)(jax.vmap(g)(z))[:, 0], 1.0).mean())(g)
            new_g, optimizers = optimizers.update(gg, g, name="generator")
        elif update_generator == "skip":
            optimizers = optimizers.skip("generator")
        kept = g if update_generator == "discard" else new_g
        return {"generator": kept, "discriminator": d}, optimizers, {"d_loss": dl}

    return train_step


def test_a_dict_model_names_the_model_left_without_update(tmp_path):
    with pytest.raises(ValueError, match=r"(?s)applies no update to model `generator` \(group\(s\) \['generator'\]\): "
                       r"`optimizers.update` was never called.*`generator, optimizers = optimizers.update\(grads, "
                       r"generator, name='generator'\)`.*`optimizers = optimizers.skip\('generator'\)`"):
        jn.train(manual("GanForgets", TinyGan, train_step=gan_step("forget"))(), run_dir=tmp_path, logger=None)
    with pytest.raises(ValueError, match=r"returns model `generator` \(group\(s\) \['generator'\]\) exactly as it "
                       r"received it"):
        jn.train(manual("GanDiscards", TinyGan, train_step=gan_step("discard"))(), run_dir=tmp_path, logger=None)


def test_skip_leaves_a_model_unchanged_on_purpose(tmp_path):
    start = jn.Nitro(TinyGan(), run_dir=tmp_path, logger=None)
    n = jn.train(manual("GanSkips", TinyGan, train_step=gan_step("skip"))(max_epochs=1), run_dir=tmp_path, logger=None)
    assert n.status == "done" and n.step == 4
    assert same(n.params["generator"], start.params["generator"])
    assert same(n.opt_state["generator"], start.opt_state["generator"])  # its optimizer never stepped
    assert not same(n.params["discriminator"], start.params["discriminator"])
    with pytest.raises(KeyError, match=r"skip\('critic'\): no optimizer of that name"):
        jn.train(manual("GanSkipsTypo", TinyGan, train_step=lambda self, models, optimizers, *, x, key: (
            models, optimizers.skip("critic"), {"l": 0.0}))(), run_dir=tmp_path, logger=None)


# -- item 12: a model with state, threaded through the step context --------------------------------


def bn_apply(model, state, x):
    return jax.vmap(model, in_axes=(0, None), out_axes=(0, None), axis_name="batch")(x, state)


@jn.experiment
class ManualBatchNormed:
    """BatchNormed (Tiny's fields, data and loss with a BatchNorm model, trained by the
    automatic step), trained by a hand-written step."""

    width: GraphConst[int] = 16
    smoothing: Device[float] = 0.0
    temperature: Device[float] = 1.0
    max_epochs: int = 2

    def build_data(self, dist):
        return tiny_data()

    def build_model(self, key):
        return BatchNormed.build_model(self, key)

    def learning_rate(self):
        return 1e-2

    def forward(self, model, state, *, x):
        return bn_apply(model, state, x)

    def metrics(self, logits, *, label):
        return {"loss": (xent(logits, label), 1)}

    def train_step(self, model, optimizers, *, x, label):
        def loss_of(model, state):
            logits, state = bn_apply(model, state, x)
            return TinyCore.loss(self, logits, label=label), state

        (loss, state), grads = eqx.filter_value_and_grad(loss_of, has_aux=True)(model, optimizers.model_state)
        model, optimizers = optimizers.update(grads, model)
        return model, optimizers.with_model_state(state), {"loss": loss}


def test_a_batchnorm_model_trains_with_train_step_like_the_automatic_step(tmp_path):
    auto = jn.train(BatchNormed(), run_dir=tmp_path, logger=None, max_epochs=1)
    start = jn.Nitro(ManualBatchNormed(), run_dir=tmp_path, logger=None)
    n = jn.train(ManualBatchNormed(), run_dir=tmp_path, logger=None, max_epochs=1)
    assert n.status == "done" and n.step == auto.step == 6
    # the running mean, variance and counter moved, and equal the automatic step's
    assert all(not np.array_equal(a, b) for a, b in zip(leaves(n.model_state), leaves(start.model_state), strict=True))
    for mine, theirs in zip(leaves((n.params, n.model_state)), leaves((auto.params, auto.model_state)), strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=0, atol=1e-6)
    assert [r["train_loss"] for r in n.rows] == pytest.approx([r["train_loss"] for r in auto.rows], rel=1e-5)
    # validation runs in inference mode on the trained running statistics
    x = tiny_data()["val"][0]["x"]
    want = bn_apply(eqx.nn.inference_mode(n.model), n.model_state, x)[0]
    np.testing.assert_allclose(n.predict({"x": x}), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_the_model_state_is_checkpointed_and_resumed_bitwise(tmp_path):
    keep = jn.Checkpointer(keep=(jn.Last(1),))
    # (the straight run takes 3 steps a dispatch: the state is the scan's carry too)
    straight = jn.train(ManualBatchNormed(), run_dir=tmp_path / "straight", logger=None, checkpointer=None,
                        steps_per_dispatch=3)
    first = jn.train(ManualBatchNormed(max_epochs=1), run_dir=tmp_path / "split", logger=None, checkpointer=keep)
    resumed = jn.Nitro(ManualBatchNormed(), run_dir=tmp_path / "split", resume="auto", logger=None, checkpointer=keep)
    assert resumed.step == 6 and same(resumed.model_state, first.model_state)  # restored from the checkpoint
    resumed.train()
    assert same(resumed.model_state, straight.model_state) and same(resumed.params, straight.params)


def test_an_automatic_batchnorm_run_resumes(tmp_path):
    """The same restore path, without train_step: a BatchNorm model's params hold leafless
    ``StateIndex`` nodes, which orbax's partial restore could not walk (IndexError, reported
    as a corrupt checkpoint)."""
    keep = jn.Checkpointer(keep=(jn.Last(1),))
    first = jn.train(BatchNormed(max_epochs=1), run_dir=tmp_path, logger=None, checkpointer=keep)
    resumed = jn.Nitro(BatchNormed(), run_dir=tmp_path, resume="auto", logger=None, checkpointer=keep)
    assert resumed.step == 6 and same(resumed.model_state, first.model_state) and same(resumed.params, first.params)


def test_a_stateful_step_that_drops_the_state_is_refused(tmp_path):
    def drops_state(self, model, optimizers, *, x, label):
        def loss_of(model):
            logits, _ = bn_apply(model, optimizers.model_state, x)
            return xent(logits, label)

        loss, grads = eqx.filter_value_and_grad(loss_of)(model)
        model, optimizers = optimizers.update(grads, model)
        return model, optimizers, {"loss": loss}

    with pytest.raises(ValueError, match=r"(?s)`train_step` of DropsState does not hand back the model state.*"
                       r"running statistics.*optimizers = optimizers.with_model_state\(state\)"):
        jn.train(manual("DropsState", ManualBatchNormed, train_step=drops_state)(), run_dir=tmp_path, logger=None)

    def stateless_with_state(self, model, optimizers, *, x, label):
        return model, optimizers.with_model_state(eqx.nn.State(model)), {"loss": 0.0}

    with pytest.raises(TypeError, match=r"with_model_state\(...\): the model has no state"):
        jn.train(manual("NoState", train_step=stateless_with_state)(), run_dir=tmp_path, logger=None)
