"""Manual training: the ``train_step`` hook, dict models with one optimizer each.

The reference point: a ``train_step`` that does what the automatic step does (loss,
gradient, ``optimizers.update``) gives the automatic step's parameters, to the last
float32 bits XLA's different fusion of the two programs may round differently.
"""

from __future__ import annotations

from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxnitro as jn
from jaxnitro.events import run_scoped
from jaxnitro import Device, GraphConst
from tiny import N_FEATURES, Net, Tiny, TinyCore, make_arrays, tiny_data
from test_cache import traces_of


def leaves(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(leaves(a), leaves(b), strict=True))


def xent(logits, label):
    return -jnp.mean(jnp.sum(label * jax.nn.log_softmax(logits), -1))


@jn.experiment
class ManualTiny:
    """Tiny's fields, model and data, trained by a hand-written step: the automatic one's
    forward, loss, gradient and update, written out."""

    width: GraphConst[int] = 16
    smoothing: Device[float] = 0.0
    temperature: Device[float] = 1.0
    max_epochs: int = 2

    def build_data(self, dist):
        return tiny_data()

    def build_model(self, key):
        return Net(16, key)

    def learning_rate(self):
        return 1e-2

    def forward(self, model, state, *, x):
        return TinyCore.forward(self, model, state, x=x)

    def metrics(self, logits, *, label):
        return {"loss": (xent(logits, label), 1)}

    def train_step(self, model, optimizers, *, x, label):
        def loss_of(model):
            return TinyCore.loss(self, TinyCore.forward(self, model, None, x=x)[0], label=label)

        loss, grads = eqx.filter_value_and_grad(loss_of)(model)
        model, optimizers = optimizers.update(grads, model)
        return model, optimizers, {"loss": loss}


def test_a_hand_written_step_equals_the_automatic_step(tmp_path):
    auto = jn.train(Tiny(), run_dir=tmp_path, logger=None)
    manual = jn.train(ManualTiny(), run_dir=tmp_path, logger=None)
    assert manual.step == auto.step == 12
    # the first epoch is bitwise equal; later, the two programs' different fusions (the
    # automatic one also scales by 1/accum) may round a last bit differently
    for mine, theirs in zip(leaves(manual.params), leaves(auto.params), strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=0, atol=1e-7)
    assert [r["train_loss"] for r in manual.rows] == pytest.approx([r["train_loss"] for r in auto.rows], rel=1e-6)


# -- two models, two optimizers ----------------------------------------------------------------


def gan_data(n=64, batch=16):
    x, _, _ = make_arrays(n)
    return {
        "train": [{"x": x[i : i + batch]} for i in range(0, n, batch)],
        "val": [{"x": x[:batch]}],
    }


@jn.experiment
class TinyGan:
    """A tiny GAN: generator 2 -> 8 features, discriminator 8 -> 1 logit."""

    max_epochs: int = 2
    frozen: str = ""
    "A model whose learning rate is scheduled to 0 (its weights must not move)."

    def build_data(self, dist):
        return gan_data()

    def build_model(self, key):
        kg, kd = jax.random.split(key)
        return {
            "generator": eqx.nn.MLP(2, N_FEATURES, 8, 1, key=kg),
            "discriminator": eqx.nn.MLP(N_FEATURES, 1, 8, 1, key=kd),
        }

    def learning_rate(self):
        return 1e-2

    def schedules(self):
        if not self.frozen:
            return {}
        return {"opt": {self.frozen: {"learning_rate": lambda total: lambda step: 0.0}}}

    def forward(self, models, state, *, x, key):
        fake = jax.vmap(models["generator"])(jax.random.normal(key, (x.shape[0], 2)))
        d = jax.vmap(models["discriminator"])
        return (d(x)[:, 0], d(fake)[:, 0]), state

    def metrics(self, outputs, *, x):
        real, fake = outputs
        return {"d_acc": ((np.sum(real > 0) + np.sum(fake < 0)) / (2 * len(real)), 1)}

    def train_step(self, models, optimizers, *, x, key):
        g, d = models["generator"], models["discriminator"]
        z = jax.random.normal(key, (x.shape[0], 2))
        bce = optax.sigmoid_binary_cross_entropy

        def d_loss(d):
            real, fake = jax.vmap(d)(x)[:, 0], jax.vmap(d)(jax.vmap(g)(z))[:, 0]
            return bce(real, 1.0).mean() + bce(fake, 0.0).mean()

        dl, dg = eqx.filter_value_and_grad(d_loss)(d)
        d, optimizers = optimizers.update(dg, d, name="discriminator")
        gl, gg = eqx.filter_value_and_grad(lambda g: bce(jax.vmap(d)(jax.vmap(g)(z))[:, 0], 1.0).mean())(g)
        g, optimizers = optimizers.update(gg, g, name="generator")
        return {"generator": g, "discriminator": d}, optimizers, {"d_loss": dl, "g_loss": gl}


class Lines:
    """Records the train lines the loop emits."""

    def __init__(self):
        self.names, self.rows = None, []

    @jn.hookimpl
    def jaxnitro_steps_read(self, run, stretch):
        self.names = stretch.names
        self.rows += [list(r) for r in stretch.rows]


@pytest.fixture(scope="module")
def gan(tmp_path_factory):
    lines = Lines()
    with run_scoped([lines]):
        n = jn.train(TinyGan(), run_dir=tmp_path_factory.mktemp("gan"))
    return n, lines


def test_each_model_is_a_group_with_its_own_optimizer(gan):
    n, _ = gan
    assert [g.name for g in n.plan.opt_spec.groups] == ["discriminator", "generator"]
    assert set(n.opt_state) == {"discriminator", "generator"}  # one optimizer state per model
    band = repr(n).split("parameter groups")[1]
    assert "optimizer (train_step)" in band and "name='generator'" in band and "name='discriminator'" in band


def test_returned_scalars_are_train_lines_and_history_columns(gan):
    n, lines = gan
    assert lines.names == ("d_loss", "g_loss") and len(lines.rows) == 8
    assert n.history().columns == ["epoch", "step", "train_d_loss", "train_g_loss", "d_acc"]
    first = n.rows[0]
    assert first["train_d_loss"] == pytest.approx(np.mean([r[0] for r in lines.rows[:4]]), rel=1e-6)
    assert first["train_g_loss"] == pytest.approx(np.mean([r[1] for r in lines.rows[:4]]), rel=1e-6)
    lines_on_disk = (Path(n.run_dir) / "metrics.jsonl").read_text()
    assert '"d_loss"' in lines_on_disk and '"g_loss"' in lines_on_disk


def test_a_scheduled_learning_rate_reaches_one_model_only(tmp_path):
    start = jn.Nitro(TinyGan(), run_dir=tmp_path, logger=None)
    n = jn.train(TinyGan(frozen="generator"), run_dir=tmp_path, logger=None)
    assert same(n.params["generator"], start.params["generator"])
    assert not same(n.params["discriminator"], start.params["discriminator"])


def test_a_rebuilt_handle_compiles_nothing(gan, tmp_path):
    before = traces_of(TinyGan)
    jn.train(TinyGan(), run_dir=tmp_path, logger=None)
    assert traces_of(TinyGan) == before and before["train_step"] == [1]


def test_steps_per_dispatch_is_bitwise_equal_to_one_step_a_dispatch(gan, tmp_path):
    n, lines = gan
    blocks = Lines()
    with run_scoped([blocks]):
        k3 = jn.train(TinyGan(), run_dir=tmp_path, logger=None, steps_per_dispatch=3)  # 4 steps/epoch: 3 + 1
    assert same(k3.params, n.params) and same(k3.opt_state, n.opt_state)
    assert blocks.rows == lines.rows and k3.rows == n.rows


def test_checkpoint_and_resume_continue_both_models_bitwise(gan, tmp_path):
    n, _ = gan
    keep = jn.Checkpointer(keep=(jn.Last(1),))
    jn.train(TinyGan(max_epochs=1), run_dir=tmp_path, logger=None, checkpointer=keep)
    resumed = jn.Nitro(TinyGan(), run_dir=tmp_path, resume="auto", logger=None, checkpointer=keep)
    assert resumed.step == 4
    resumed.train()
    assert same(resumed.params, n.params) and same(resumed.opt_state, n.opt_state)
    assert resumed.rows == n.rows[1:]


def test_ema_is_kept_over_every_model(tmp_path):
    n = jn.train(TinyGan(max_epochs=1), run_dir=tmp_path, logger=None, ema=jn.EMA(0.5))
    assert set(n.state.ema) == {"generator", "discriminator"}
    assert not same(n.state.ema, n.params)


# -- refusals -----------------------------------------------------------------------------------


def manual(name="M", **members):
    return jn.experiment(type(name, (ManualTiny,), dict(members)))


def test_train_step_with_loss_is_refused_naming_both():
    both = manual("Both", loss=lambda self, logits, *, label: xent(logits, label))
    with pytest.raises(TypeError, match=r"Both defines both `train_step` and `loss`"):
        jn.Nitro(both(), logger=None)


def test_accum_is_refused_and_a_stateful_model_accepted():
    with pytest.raises(ValueError, match=r"defines `train_step` and runs with accum=2.*Use accum=1"):
        jn.Nitro(ManualTiny(), logger=None, accum=2)

    def stateful(self, key):
        return eqx.nn.make_with_state(eqx.nn.BatchNorm)(N_FEATURES, "batch", mode="batch")

    # the step context threads the state (tests/test_nothing_silent_manual.py trains one)
    n = jn.Nitro(manual("Stateful", build_model=stateful)(), logger=None)
    assert isinstance(n.model_state, eqx.nn.State)


def test_a_group_spanning_two_models_is_refused():
    spanning = jn.experiment(type("Spanning", (TinyGan,), {"param_group": lambda self, keypath: "all"}))
    with pytest.raises(ValueError, match=r"group `all` holds parameters of the models `discriminator` and `generator`"):
        jn.Nitro(spanning(), logger=None)


def test_bad_results_and_names_are_refused_at_the_first_step(tmp_path):
    def no_scalars(self, model, optimizers, *, x, label):
        return model, optimizers, {}

    def named(self, model, optimizers, *, x, label):
        grads = eqx.filter_grad(lambda m: xent(jax.vmap(m)(x), label))(model)
        return (*optimizers.update(grads, model, name="generator"), {"loss": 0.0})

    def two(self, model, optimizers, *, x, label):
        return model, optimizers

    def vector(self, model, optimizers, *, x, label):
        return model, optimizers, {"rows": x[:, 0]}

    for step, message in [
        (no_scalars, r"returned \{\} as its scalars; return a non-empty dict"),
        (named, r"name='generator'\): the model is a single module"),
        (two, r"returned a tuple of 2; it must return `\(models, optimizers, scalars\)`"),
        (vector, r"returned scalar `rows` has shape \(16,\); the logged values are per-step scalars"),
    ]:
        with pytest.raises((TypeError, KeyError), match=message):
            jn.train(manual(step.__name__, train_step=step)(), run_dir=tmp_path, logger=None)


def test_a_non_finite_scalar_stops_the_run_naming_it(tmp_path):
    def exploding(self, model, optimizers, *, x, label):
        loss, grads = eqx.filter_value_and_grad(lambda m: xent(jax.vmap(m)(x), label))(model)
        model, optimizers = optimizers.update(grads, model)
        return model, optimizers, {"loss": loss, "ratio": jnp.log(loss - loss)}  # log(0) = -inf

    with pytest.warns(RuntimeWarning, match=r"train_step's scalar\(s\) 'ratio' became non-finite at step 1"):
        n = jn.train(manual("Exploding", train_step=exploding)(), run_dir=tmp_path, logger=None)
    assert n.status == "diverged" and n.record.stop_reason == "non-finite scalar at step 1"


def test_a_dict_model_with_forward_and_loss_gets_a_group_per_model(tmp_path):
    @jn.experiment
    class TwoPart:
        max_epochs: int = 1

        def build_data(self, dist):
            return tiny_data()

        def build_model(self, key):
            k1, k2 = jax.random.split(key)
            return {"encoder": eqx.nn.Linear(N_FEATURES, 8, key=k1), "head": eqx.nn.Linear(8, 4, key=k2)}

        def learning_rate_ratio(self, group):
            return 0.0 if group == "encoder" else 1.0  # a frozen encoder

        def forward(self, models, state, *, x):
            return jax.vmap(lambda v: models["head"](jax.nn.relu(models["encoder"](v))))(x), state

        def loss(self, logits, *, label):
            return xent(logits, label)

    start = jn.Nitro(TwoPart(), run_dir=tmp_path, logger=None)
    n = jn.train(TwoPart(), run_dir=tmp_path, logger=None)
    assert [g.name for g in n.plan.opt_spec.groups] == ["encoder", "head"]
    assert same(n.params["encoder"], start.params["encoder"])
    assert not same(n.params["head"], start.params["head"])
