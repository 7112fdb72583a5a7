"""Issue 23, items 14-18, 22, 24-26: cases that passed silently, crashed raw, or were missing."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxnitro as jn
from jaxnitro import Device, GraphConst
from jaxnitro.plugins.cluster import check_coordinator_address
from tiny import N_CLASSES, Tiny, TinyCore, fresh_tiny, tiny_data

QUIET = dict(logger=None)


def msg(excinfo) -> str:
    return " ".join(str(excinfo.value).split())


# -- 14: the coordinator address ------------------------------------------------------------------


@pytest.mark.parametrize(
    "address, problem, fix",
    [
        ("127.0.0.1", "has no port", '"127.0.0.1:1234"'),
        ("127.0.0.1:", "has the port ''", '"10.0.0.1:1234"'),
        ("node0:99999", "has the port '99999', not a number in 1..65535", '"10.0.0.1:1234"'),
        (":1234", "has no host", '"10.0.0.1:1234"'),
    ],
)
def test_initialize_refuses_an_address_without_host_or_port(address, problem, fix):
    # JAX itself fails on "127.0.0.1" with a bare IndexError; nothing reaches JAX here
    with pytest.raises(ValueError) as err:
        jn.distributed.initialize(address, num_processes=2, process_id=0)
    text = msg(err)
    assert f"coordinator_address={address!r}): the address {problem}" in text
    assert '"host:port"' in text and f"jn.distributed.initialize({fix}" in text
    assert not jax.distributed.is_initialized()


@pytest.mark.parametrize("address", ["127.0.0.1:1234", "node-0.cluster:8476", "[::1]:1234"])
def test_a_host_port_address_is_accepted(address):
    assert check_coordinator_address(address) == address


# -- 15: non-finite Device values; a clip norm that zeroes every update ------------------------------


@pytest.fixture(scope="module")
def handle(tmp_path_factory):
    return jn.Nitro(Tiny(max_epochs=0), run_dir=tmp_path_factory.mktemp("runs"), **QUIET)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -np.inf])
def test_set_device_refuses_a_non_finite_value(handle, value):
    before = handle.device_value("temperature")
    with pytest.raises(ValueError) as err:
        handle.set_device(temperature=value)
    assert "set_device cannot write `temperature`: the value is not finite" in msg(err)
    assert "Pass a finite number" in msg(err)
    assert handle.device_value("temperature") == before


def test_a_non_finite_device_field_is_refused_at_construction():
    with pytest.raises(ValueError) as err:
        Tiny(smoothing=float("nan"))
    assert "Device field `smoothing` of Tiny is not finite: it is NaN" in msg(err)


@jn.experiment
class Masked(TinyCore):
    mask: Device[np.ndarray] = jn.field(factory=lambda: np.array([0.0, -np.inf, 0.0, 0.0], np.float32))
    "An additive logit mask: -inf entries are a real use."


def test_a_device_array_may_hold_inf_but_not_nan():
    assert np.isneginf(Masked().mask[1])
    with pytest.raises(ValueError) as err:
        Masked(mask=np.array([0.0, np.nan, 0.0, 0.0], np.float32))
    assert "Device field `mask` of Masked is not finite: it holds NaN (1 of 4 entries)" in msg(err)


@pytest.mark.parametrize("clip", [1e-30, 1e-9])
def test_a_clip_norm_so_small_it_zeroes_updates_is_refused(tmp_path, clip):
    with pytest.raises(ValueError) as err:
        jn.Nitro(Tiny(), run_dir=tmp_path, gradient_clip_norm=clip, **QUIET)
    text = msg(err)
    assert f"run knob `gradient_clip_norm` = {clip!r} (keyword)" in text
    assert "below 1e-08" in text and "0 (or None) for no clipping" in text


def test_a_small_but_usable_clip_norm_is_accepted(tmp_path):
    assert jn.Nitro(Tiny(), run_dir=tmp_path, gradient_clip_norm=1e-8, **QUIET).settings.gradient_clip_norm == 1e-8


# -- 22: GraphConst arrays, keyed by content ----------------------------------------------------------


@jn.experiment
class Tabled(Tiny):
    table: GraphConst[np.ndarray] = jn.field(factory=lambda: np.arange(N_CLASSES, dtype=np.float32))
    "A constant per-class offset, baked into the graph."

    def forward(self, model, state, *, x):
        return jax.vmap(model)(x) + jnp.asarray(self.table), state


def test_a_graph_const_array_is_accepted_and_keyed_by_content(tmp_path):
    run = dict(run_dir=tmp_path, max_epochs=1, **QUIET)
    first = jn.train(Tabled(), **run)
    before = jn.cache_stats()
    same = jn.train(Tabled(table=np.arange(N_CLASSES, dtype=np.float32)), **run)  # a new, equal array
    assert jn.cache_stats().misses == before.misses
    np.testing.assert_array_equal(jax.tree_util.tree_leaves(same.params)[0], jax.tree_util.tree_leaves(first.params)[0])
    other = jn.Nitro(Tabled(table=np.zeros(N_CLASSES, np.float32)), **run)
    batch = {"x": tiny_data()["val"][0]["x"]}
    out_first, out_other = first.predict(batch), other.predict(batch)
    assert jn.cache_stats().misses > before.misses  # other content: another program
    assert not np.allclose(out_first, out_other)
    # the experiment is a pytree whose treedef hashes and compares by the array's content
    assert jax.tree_util.tree_structure(Tabled()) == jax.tree_util.tree_structure(Tabled())
    assert hash(jax.tree_util.tree_structure(Tabled())) == hash(jax.tree_util.tree_structure(Tabled()))
    assert jax.tree_util.tree_structure(Tabled()) != jax.tree_util.tree_structure(Tabled(table=np.zeros(4, np.float32)))


def test_a_graph_const_of_objects_is_still_refused():
    with pytest.raises(TypeError) as err:
        Tabled(table=np.array([object()]))
    assert "GraphConst field `table` of Tabled is an array of dtype object" in msg(err)
    with pytest.raises(TypeError) as err:
        Tabled(table=[1, 2])
    assert "use a tuple instead of a list" in msg(err)


# -- 24: device-resident metrics with a monitor --------------------------------------------------


def test_device_metrics_with_a_monitor_pass_setup_and_train(tmp_path):
    """docs/metrics.md's ScoredOnDevice plus a `monitor`: setup's check of the first val batch
    used to fill the counts with zeros ("a total count of 0") and choked on a string mode."""

    @jn.experiment
    class OnDevice(Tiny):
        def metrics(self, logits, *, y):
            hit = logits.argmax(-1) == y
            return {
                "acc": (jnp.sum(hit), y.shape[0]),
                "hits": (jnp.sum(hit), "sum"),
                "worst": (jnp.min(logits), "min"),
            }

        def metrics_residency(self, hook):
            return "device"

        def monitor(self):
            return ("acc", "max")

    n = jn.train(OnDevice(), max_epochs=1, run_dir=tmp_path, **QUIET)
    res = n.validate()
    assert set(res) == {"acc", "hits", "worst"}
    assert res["acc"] == pytest.approx(res["hits"] / 40)  # 40 real val rows


def test_host_metrics_with_an_output_derived_count_pass_setup(tmp_path):
    """A host `metrics` whose count comes from the outputs sees zeros at setup's check: the
    check no longer refuses the count it made up."""

    @jn.experiment
    class Confident(Tiny):
        def metrics(self, logits, *, y):
            sure = np.max(logits, -1) > 0
            return {"sure_acc": (np.sum((logits.argmax(-1) == y) & sure), np.sum(sure))}

        def monitor(self):
            return ("sure_acc", "max")

    n = jn.Nitro(Confident(), run_dir=tmp_path, **QUIET)
    assert n.settings.monitor == ("sure_acc", "max")


# -- 25: param_group may take the leaf ---------------------------------------------------------------


def test_param_group_may_take_the_leaf_to_decay_only_matrices(tmp_path):
    seen = []

    @jn.experiment
    class MatricesDecay(Tiny):
        def param_group(self, keypath, leaf):
            seen.append((keypath, leaf.shape))
            return "decay" if leaf.ndim >= 2 else "no_decay"

        def weight_decay(self, group):
            return 0.1 if group == "decay" else 0.0

    n = jn.Nitro(MatricesDecay(), run_dir=tmp_path, **QUIET)
    groups = {g.name: g for g in n.plan.opt_spec.groups}
    assert set(groups) == {"decay", "no_decay"}
    assert groups["decay"].n_params == 8 * 16 + 16 * 4 and groups["no_decay"].n_params == 16 + 4
    assert groups["decay"].weight_decay == 0.1 and groups["no_decay"].weight_decay == 0.0
    assert sorted(seen) == [(("l1", "bias"), (16,)), (("l1", "weight"), (16, 8)),
                            (("l2", "bias"), (4,)), (("l2", "weight"), (4, 16))]


def test_param_group_with_the_keypath_only_still_works(tmp_path):
    @jn.experiment
    class ByPath(Tiny):
        def param_group(self, path):
            return "first" if path[0] == "l1" else "second"

    n = jn.Nitro(ByPath(), run_dir=tmp_path, **QUIET)
    assert {g.name: g.n_params for g in n.plan.opt_spec.groups} == {"first": 8 * 16 + 16, "second": 16 * 4 + 4}


def test_param_group_with_too_many_parameters_names_the_contract(tmp_path):
    @jn.experiment
    class TooMany(Tiny):
        def param_group(self, keypath, leaf, extra):
            return "default"

    with pytest.raises(TypeError) as err:
        jn.Nitro(TooMany(), run_dir=tmp_path, **QUIET)
    assert "the contract is `param_group(self, keypath[, leaf])`" in msg(err)


# -- 26: the per-step PRNG key, reproduced outside jaxnitro from the documented rule ----------------


def _documented_keys(seed: int):
    """docs/hooks-and-routing.md, "How the keys derive from seed", written out with jax.random only."""
    model_key, base = jax.random.split(jax.random.PRNGKey(seed))
    train_key = lambda n: jax.random.fold_in(base, np.uint32(n))  # noqa: E731 - micro-batch n of the run
    eval_key = jax.random.fold_in(base, np.uint32(0))
    return model_key, train_key, eval_key


def test_the_keys_follow_the_documented_rule(tmp_path):
    from jaxnitro.loggers.jsonl import read_jsonl

    built = []

    @jn.experiment
    class Keyed(Tiny):
        def build_model(self, key):
            built.append(np.asarray(jax.random.key_data(key)))
            return super().build_model(key)

        def forward(self, model, state, *, x, key):
            draw = jnp.full((x.shape[0],), jax.random.uniform(key))
            return (jax.vmap(model)(x), draw), state

        def loss(self, outputs, *, label):
            return super().loss(outputs[0], label=label)

        def train_metrics(self, outputs, *, key):
            return {"forward_draw": outputs[1][0], "own_draw": jax.random.uniform(key)}

    seed = 7
    n = jn.train(Keyed(), seed=seed, run_dir=tmp_path, max_epochs=1)  # 6 batches: 6 steps at accum=1
    model_key, train_key, eval_key = _documented_keys(seed)
    np.testing.assert_array_equal(built[0], np.asarray(model_key))
    lines = [ln for ln in read_jsonl(f"{n.run_dir}/metrics.jsonl") if ln.get("context") == "train"]
    assert [ln["step"] for ln in lines] == [1, 2, 3, 4, 5, 6]
    for ln in lines:  # step s (from 1) is micro-batch s - 1; forward and train_metrics share the key
        want = float(jax.random.uniform(train_key(ln["step"] - 1)))
        assert ln["forward_draw"] == want and ln["own_draw"] == want
    _, draw = n.predict({"x": tiny_data()["val"][0]["x"]})
    assert np.all(draw == np.float32(jax.random.uniform(eval_key)))

    # accum=2: step s (from 0) runs micro-batches 2s and 2s + 1; the logged value is their mean
    a = jn.train(Keyed(), seed=seed, accum=2, run_dir=tmp_path, max_epochs=1)
    lines = [ln for ln in read_jsonl(f"{a.run_dir}/metrics.jsonl") if ln.get("context") == "train"]
    for ln in lines:
        s = ln["step"] - 1
        mean = (float(jax.random.uniform(train_key(2 * s))) + float(jax.random.uniform(train_key(2 * s + 1)))) / 2
        assert ln["own_draw"] == pytest.approx(mean, rel=1e-6)


# -- 16: schedules bind by the rule's own hyperparameter names ---------------------------------------


def _train_lines(n):
    from jaxnitro.loggers.jsonl import read_jsonl

    return [ln for ln in read_jsonl(f"{n.run_dir}/metrics.jsonl") if ln.get("context") == "train"]


def test_adam_b1_is_schedulable_and_reaches_the_optimizer(tmp_path):
    import optax

    Adam = fresh_tiny("Adam", optimizer=lambda self, group: optax.adam)
    n = jn.train(Adam(max_epochs=1), run_dir=tmp_path, schedules={"b1": lambda total: optax.linear_schedule(0.5, 0.9, total)})
    lines = _train_lines(n)
    assert [round(ln["schedule/default/b1"], 6) for ln in lines] == [round(0.5 + 0.4 * s / 6, 6) for s in range(6)]
    assert float(n.opt_state.hyperparams["b1"]) == pytest.approx(0.5 + 0.4 * 5 / 6)
    # a constant b1 schedule of Adam's default trains exactly like the unscheduled rule
    plain = jn.train(Adam(max_epochs=1), run_dir=tmp_path, **QUIET)
    const = jn.train(Adam(max_epochs=1), run_dir=tmp_path, schedules={"b1": lambda total: lambda step: 0.9}, **QUIET)
    for a, b in zip(jax.tree_util.tree_leaves(plain.params), jax.tree_util.tree_leaves(const.params)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    # a new b1 schedule compiles nothing
    before = jn.cache_stats().misses
    jn.train(Adam(max_epochs=1), run_dir=tmp_path, schedules={"b1": lambda total: lambda step: 0.8}, **QUIET)
    assert jn.cache_stats().misses == before


def test_sgd_momentum_is_schedulable(tmp_path):
    import optax

    SGD = fresh_tiny("SGDm", optimizer=lambda self, group: optax.sgd)
    Heavy = fresh_tiny("Heavy", optimizer=lambda self, group: lambda lr: optax.sgd(lr, momentum=0.9))
    plain = jn.train(SGD(max_epochs=1), run_dir=tmp_path, **QUIET)
    heavy = jn.train(Heavy(max_epochs=1), run_dir=tmp_path, **QUIET)
    scheduled = jn.train(SGD(max_epochs=1), run_dir=tmp_path, schedules={"opt": {"momentum": lambda total: lambda step: 0.9}}, **QUIET)
    leaf = lambda n: jax.tree_util.tree_leaves(n.params)[0]  # noqa: E731
    np.testing.assert_allclose(leaf(scheduled), leaf(heavy), rtol=1e-6, atol=1e-7)
    assert not np.allclose(leaf(scheduled), leaf(plain))


def test_unknown_schedule_keys_list_the_rules_hyperparameters(tmp_path):
    import optax

    SGD = fresh_tiny("SGDk", optimizer=lambda self, group: optax.sgd)
    with pytest.raises(KeyError) as err:
        jn.Nitro(SGD(), run_dir=tmp_path, schedules={"b1": lambda total: lambda step: 0.9}, **QUIET)
    assert "unknown schedule key `b1`" in msg(err)
    assert "by the rule's own name (learning_rate, weight_decay, momentum)" in msg(err)


def test_a_bare_rule_key_needs_the_hyperparameter_in_every_group(tmp_path):
    import optax

    Mixed = fresh_tiny(
        "Mixed",
        param_group=lambda self, keypath: "encoder" if keypath[0] == "l1" else "head",
        optimizer=lambda self, group: optax.adam if group == "encoder" else optax.sgd,
    )
    with pytest.raises(KeyError) as err:
        jn.Nitro(Mixed(), run_dir=tmp_path, schedules={"b1": lambda total: lambda step: 0.9}, **QUIET)
    assert "the rule of group(s) `head` has no hyperparameter `b1`" in msg(err)
    assert "{'opt': {'encoder': {'b1': ...}}}" in msg(err)
    with pytest.raises(KeyError) as err:
        jn.Nitro(Mixed(), run_dir=tmp_path, schedules={"opt": {"head": {"b1": lambda total: lambda step: 0.9}}}, **QUIET)
    assert "unknown optimizer hyperparameter `b1` for group `head`; schedulable for its rule: learning_rate, weight_decay, momentum" in msg(err)
    n = jn.train(Mixed(max_epochs=1), run_dir=tmp_path, schedules={"opt": {"encoder": {"b1": lambda total: optax.linear_schedule(0.5, 0.9, total)}}})
    keys = {k for ln in _train_lines(n) for k in ln if k.startswith("schedule/")}
    assert keys == {"schedule/encoder/b1"}


# -- 17: a group's decoupled decay is autologged next to its rate -------------------------------------


def test_a_groups_decoupled_decay_is_logged_when_it_varies(tmp_path):
    import optax

    Decayed = fresh_tiny(
        "Decayed",
        param_group=lambda self, keypath: "encoder" if keypath[0] == "l1" else "default",
        weight_decay=lambda self, group: 1e-2 if group == "encoder" else 0.0,
    )
    n = jn.train(Decayed(max_epochs=1), run_dir=tmp_path, schedules={"learning_rate": lambda total: optax.linear_schedule(1e-2, 1e-3, total)})
    lines = _train_lines(n)
    assert list(k for k in lines[0] if k.startswith("schedule/")) == [
        "schedule/default/learning_rate", "schedule/encoder/learning_rate", "schedule/encoder/weight_decay",
    ]  # the default group has no decay: nothing to log
    for ln in lines:  # the decay as applied: rate x decay
        assert ln["schedule/encoder/weight_decay"] == float(np.float32(ln["schedule/encoder/learning_rate"]) * np.float32(1e-2))
    # a constant rate: the decay does not vary, nothing is logged
    still = jn.train(Decayed(max_epochs=1), run_dir=tmp_path)
    assert not any(k.startswith("schedule/") for ln in _train_lines(still) for k in ln)
    # a scheduled decay under a constant rate varies too
    wd = jn.train(Decayed(max_epochs=1), run_dir=tmp_path, schedules={"opt": {"encoder": {"weight_decay": lambda total: optax.linear_schedule(1e-2, 0.0, total)}}})
    lines = _train_lines(wd)
    assert [k for k in lines[0] if k.startswith("schedule/")] == ["schedule/encoder/weight_decay"]
    assert lines[0]["schedule/encoder/weight_decay"] == float(np.float32(1e-2) * np.float32(1e-2))


# -- 18: host-resident train_metrics --------------------------------------------------------------------


def _top_hit(logits, y, xp):
    return {"acc": xp.mean(xp.argmax(logits, -1) == y), "margin": xp.mean(xp.max(logits, -1) - xp.min(logits, -1))}


@pytest.mark.parametrize(
    "knobs",
    [{}, pytest.param({"accum": 2}, marks=pytest.mark.slow), pytest.param({"steps_per_dispatch": 3}, marks=pytest.mark.slow)],
)
def test_host_train_metrics_log_what_device_train_metrics_log(tmp_path, knobs):
    seen = []

    def on_host(self, logits, *, y):
        seen.append((type(logits), type(y)))
        order = np.argsort(logits, axis=-1, kind="stable")  # ordinary NumPy
        assert order.shape == logits.shape
        return _top_hit(logits, y, np)

    OnHost = fresh_tiny("OnHost", train_metrics=on_host, metrics_residency=lambda self, hook: "host")
    OnDevice = fresh_tiny("OnDevice", train_metrics=lambda self, logits, *, y: _top_hit(logits, y, jnp))
    host = jn.train(OnHost(max_epochs=1), run_dir=tmp_path, **knobs)
    dev = jn.train(OnDevice(max_epochs=1), run_dir=tmp_path, **knobs)
    assert set(seen) == {(np.ndarray, np.ndarray)}
    h, d = _train_lines(host), _train_lines(dev)
    assert len(h) == len(d) == 6 // knobs.get("accum", 1)
    for a, b in zip(h, d):
        assert a["step"] == b["step"] and a["loss"] == b["loss"]
        assert a["acc"] == pytest.approx(b["acc"], abs=1e-7) and a["margin"] == pytest.approx(b["margin"], rel=1e-6)


def test_host_train_metrics_refusals(tmp_path):
    host = dict(metrics_residency=lambda self, hook: "host")
    NotScalar = fresh_tiny("NotScalar", train_metrics=lambda self, logits, *, y: {"per_row": logits.max(-1)}, **host)
    with pytest.raises(TypeError) as err:
        jn.train(NotScalar(max_epochs=1), run_dir=tmp_path, **QUIET)
    assert "train metric `per_row` of NotScalar is an array of shape (16,)" in msg(err)

    def keyed(self, logits, *, key):
        return {"k": 0.0}

    WithKey = fresh_tiny("WithKey", train_metrics=keyed, **host)
    with pytest.raises(TypeError) as err:
        jn.Nitro(WithKey(), run_dir=tmp_path, **QUIET)
    assert "`train_metrics` declares the keyword `key`, but it runs on the host" in msg(err)


def test_a_graph_const_array_is_recorded_and_checked_by_a_checkpoint(tmp_path):
    n = jn.train(Tabled(), run_dir=tmp_path, max_epochs=1, checkpointer=jn.Checkpointer(keep=(jn.Last(1),)), **QUIET)
    again = jn.Nitro(Tabled(), weights=(n.run_dir, "last"), run_dir=tmp_path, **QUIET)
    assert again.plan.weights_from.startswith("checkpoint step 6")
    with pytest.raises(ValueError) as err:
        jn.Nitro(Tabled(table=np.zeros(N_CLASSES, np.float32)), weights=(n.run_dir, "last"), run_dir=tmp_path, **QUIET)
    assert "was saved with other GraphConst values" in msg(err) and "table: this experiment array([0., 0., 0., 0.]" in msg(err)
