"""Bad input: every refusal names the culprit AND says the fix (the issue's "Bad input" list).

Each test asserts on the message, not just the exception type.
"""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest

import jaxnitro as jn
from jaxnitro import GraphConst
from jaxnitro.loggers.jsonl import read_jsonl
from tiny import Tiny, batches, make_arrays, tiny_data


def message(excinfo) -> str:
    return str(excinfo.value)


# -- the train split -------------------------------------------------------------------------


def test_partial_train_batch(tmp_path):
    x, y, oh = make_arrays(100)
    data = {"train": batches(x, y, oh, 16, drop_last=False)}  # 6 x 16 + 4
    with pytest.raises(ValueError) as err:
        jn.Nitro(Tiny(), data=data, run_dir=tmp_path)
    msg = message(err)
    assert "`train` split ends with a partial batch (4 rows, the others have 16)" in msg  # culprit
    assert "drop_last=True" in msg and "drop the final batch" in msg  # fix


def test_train_batch_count_not_divisible_by_accum(tmp_path):
    with pytest.raises(ValueError) as err:
        jn.Nitro(Tiny(), run_dir=tmp_path, accum=4)
    msg = message(err)
    assert "`train` split has 6 batches, which does not divide by accum=4" in msg  # culprit
    assert "choose an `accum` that divides 6" in msg and "drop 2 more" in msg  # fix


def test_accum_that_divides_is_accepted(tmp_path):
    assert jn.Nitro(Tiny(), run_dir=tmp_path, accum=3, logger=None).settings.accum == 3


# -- routing -------------------------------------------------------------------------------------


def test_missing_batch_field_names_batch_fields_and_hook_fields(tmp_path):
    data = {"train": [{"x": b["x"], "y": b["y"]} for b in tiny_data()["train"]]}
    with pytest.raises(KeyError) as err:
        jn.Nitro(Tiny(), data=data, run_dir=tmp_path)
    msg = message(err)
    assert "hook `loss` requires batch field(s) ['label']" in msg  # the hook and its field
    assert "the batch has ['x', 'y']" in msg  # the batch's fields
    assert "yield a field of that name" in msg and "give the keyword a default" in msg  # fixes


def test_missing_field_in_a_predict_batch(tmp_path):
    n = jn.Nitro(Tiny(), run_dir=tmp_path, logger=None)
    with pytest.raises(KeyError) as err:
        n.predict({"img": np.zeros((2, 8), np.float32)})
    msg = message(err)
    assert "hook `forward` requires batch field(s) ['x']" in msg and "['img']" in msg


@jn.experiment
class Weighted(Tiny):
    def loss(self, logits, *, label, weight=None):
        base = Tiny.loss(self, logits, label=label)
        return base if weight is None else base * weight.mean()


def test_keyword_with_default_makes_a_field_optional_and_undeclared_fields_stay_on_host(tmp_path):
    # no `weight`: fine; an extra string field no hook declares is never transferred
    # (a device_put of a string array would fail)
    data = {"train": [{**b, "names": np.array(["row"] * 16)} for b in tiny_data()["train"]]}
    n = jn.train(Weighted(), data=data, run_dir=tmp_path, max_epochs=1, logger=None)
    assert n.status == "done"
    assert n.plan.routes["loss"].required == ("label",) and n.plan.routes["loss"].optional == ("weight",)
    # with `weight` present, the loss receives it
    doubled = {"train": [{**b, "weight": np.full(16, 2.0, np.float32)} for b in tiny_data()["train"]]}
    m = jn.Nitro(Weighted(), data=doubled, run_dir=tmp_path, max_epochs=1)
    assert m.plan.routes["loss"].select(doubled["train"][0]).keys() == {"label", "weight"}
    m.train()
    first = [l for l in read_jsonl(os.path.join(m.run_dir, "metrics.jsonl")) if l.get("context") == "train"][0]
    # same seed, same first batch, same initial weights: the first step's loss is exactly doubled
    plain = jn.train(Weighted(), data=data, run_dir=tmp_path, max_epochs=1)
    base = [l for l in read_jsonl(os.path.join(plain.run_dir, "metrics.jsonl")) if l.get("context") == "train"][0]
    assert first["step"] == base["step"] == 1
    np.testing.assert_allclose(first["loss"], 2.0 * base["loss"], rtol=1e-6)


# -- Host fields in traced code ------------------------------------------------------------------


@jn.experiment
class UsesHost(Tiny):
    margin: float = 0.1
    "Unmarked, so Host: traced code may not read it."

    def loss(self, logits, *, label):
        return Tiny.loss(self, logits, label=label) + self.margin


def test_host_field_used_in_traced_code(tmp_path):
    n = jn.Nitro(UsesHost(), run_dir=tmp_path)
    with pytest.raises(TypeError) as err:
        n.train()
    msg = message(err)
    assert "Host field `margin` of UsesHost was used inside traced code" in msg  # culprit
    assert "mark the field `Device[...]`" in msg and "`GraphConst[...]`" in msg  # fix
    assert n.status == "failed"
    last = read_jsonl(os.path.join(n.run_dir, "metrics.jsonl"))[-1]
    assert (last["kind"], last["status"]) == ("finish", "failed")


# -- experiment fields ---------------------------------------------------------------------------


def test_graph_const_seed():
    with pytest.raises(TypeError) as err:

        @jn.experiment
        class Seeded:
            seed: GraphConst[int] = 0

    msg = message(err)
    assert "field `seed` of Seeded is marked GraphConst" in msg  # culprit
    assert "Remove the marker" in msg and "unmarked (Host) `seed`" in msg  # fix


def test_unhashable_graph_const_value():
    @jn.experiment
    class Layers:
        sizes: GraphConst[tuple] = (4,)

    with pytest.raises(TypeError) as err:
        Layers(sizes=[4, 4])
    msg = message(err)
    assert "GraphConst field `sizes` of Layers has an unhashable value of type list" in msg  # culprit
    assert "use a tuple instead of a list" in msg and "`Device[...]`" in msg  # fix
    with pytest.raises(TypeError) as err:
        Layers(sizes={"a": 1})
    assert "unhashable value of type dict" in message(err) and "hashable value (tuple" in message(err)


# -- verbs ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def handle(tmp_path_factory):
    return jn.Nitro(Tiny(), run_dir=tmp_path_factory.mktemp("errors"), logger=None)


def test_predict_bare_array(handle):
    with pytest.raises(TypeError) as err:
        handle.predict(np.zeros((3, 8), np.float32))
    msg = message(err)
    assert "`predict` takes a batch dict" in msg and "not a bare ndarray" in msg  # culprit
    assert "nitro.predict({'x': ...})" in msg and "fields `forward` declares: ['x']" in msg  # fix
    with pytest.raises(TypeError, match=r"not a bare ArrayImpl"):
        handle.predict(jax.numpy.zeros((3, 8)))


def test_predict_batch_wider_than_compiled(handle):
    with pytest.raises(ValueError) as err:
        handle.predict({"x": np.zeros((20, 8), np.float32)})
    msg = message(err)
    assert "the prediction batch has 20 rows, wider than the compiled batch width 16" in msg  # culprit
    assert "batches of at most 16 rows" in msg and "nitro.predict(batches)" in msg  # fix


def test_unknown_split(handle):
    with pytest.raises(KeyError) as err:
        handle.evaluate("test")
    msg = message(err)
    assert "no split 'test'" in msg and "['train', 'val']" in msg  # culprit and the known ones
    assert "Return it from `build_data` (or pass it in `data=`)" in msg  # fix


@jn.experiment
class BadMetrics(Tiny):
    entry: str = "mode"
    "Which malformed entry `metrics` returns (Host: read on the host only)."

    def metrics(self, logits, *, y):
        hits = np.sum(np.argmax(logits, -1) == y)
        if self.entry == "mode":
            return {"acc": (hits, "mean")}
        return {"acc": hits}


def test_unknown_metric_mode(tmp_path):
    n = jn.Nitro(BadMetrics(), run_dir=tmp_path, logger=None)
    with pytest.raises(ValueError) as err:
        n.validate()
    msg = message(err)
    assert "metric `acc` has unknown mode 'mean'" in msg  # culprit
    assert "'sum', 'max', 'min', 'concat'" in msg and "a count" in msg  # the fix: the known modes


def test_metric_entry_that_is_not_a_pair(tmp_path):
    n = jn.Nitro(BadMetrics(entry="bare"), run_dir=tmp_path, logger=None)
    with pytest.raises(TypeError) as err:
        n.validate()
    msg = message(err)
    assert "metric `acc` is int64, not a (value, mode) pair" in msg
    assert "{'acc': (value, count)}" in msg


# -- Nitro keywords ----------------------------------------------------------------------------------


def test_unknown_keyword_with_close_match(tmp_path):
    with pytest.raises(TypeError) as err:
        jn.Nitro(Tiny(), run_dir=tmp_path, max_epoch=3)
    msg = message(err)
    assert "unknown keyword `max_epoch` to Nitro" in msg  # culprit
    assert "Did you mean `max_epochs`?" in msg and "Run knobs: seed, run_dir" in msg  # fix
    with pytest.raises(TypeError) as err:
        jn.train(Tiny(), run_dir=tmp_path, learning_rate=0.1)
    msg = message(err)
    assert "unknown keyword `learning_rate`" in msg and "methods on the experiment" in msg


# -- forward's return value -----------------------------------------------------------------------------


@jn.experiment
class BadForward(Tiny):
    variant: GraphConst[str] = "bare"
    "How `forward` gets its return value wrong."

    def forward(self, model, state, *, x):
        logits = jax.vmap(model)(x)
        if self.variant == "bare":
            return logits
        if self.variant == "triple":
            return logits, state, logits
        return logits, logits


@pytest.mark.parametrize(
    "variant, culprit",
    [
        ("bare", "returned a single array of shape (16, 4); it must return `(outputs, state)`"),
        ("triple", "returned a tuple of 3; it must return `(outputs, state)`"),
        ("pair", "returned `(outputs, an array of shape (16, 4))`; the second element must be the model state"),
    ],
)
def test_forward_not_returning_outputs_and_state(tmp_path, variant, culprit):
    n = jn.Nitro(BadForward(variant=variant), run_dir=tmp_path, logger=None)
    with pytest.raises(TypeError) as err:
        n.predict({"x": np.zeros((3, 8), np.float32)})
    msg = message(err)
    assert "`forward` of BadForward" in msg and culprit in msg
    assert "`state`" in msg or "return (a, b), state" in msg  # the fix


def test_forward_not_returning_a_pair_fails_training(tmp_path):
    n = jn.Nitro(BadForward(), run_dir=tmp_path)
    with pytest.raises(TypeError, match=r"`forward` of BadForward returned a single array.*\(outputs, state\)"):
        n.train()
    assert n.status == "failed"


def test_batch_field_taken_positionally_is_refused_at_setup(tmp_path):
    @jn.experiment
    class Positional(Tiny):
        def loss(self, logits, label):
            return Tiny.loss(self, logits, label=label)

    with pytest.raises(TypeError) as err:
        jn.Nitro(Positional(), run_dir=tmp_path)
    msg = message(err)
    assert "hook `loss` of Positional takes positional parameters ('self', 'logits', 'label')" in msg
    assert "`loss(self, outputs, *, <batch fields>)`" in msg and "keyword-only parameters (after `*`)" in msg


def test_partial_final_batch_of_a_plain_iterable_train_split_is_refused(tmp_path):
    """A generator-backed source can't be inspected at setup; the first epoch refuses the batch."""
    from tiny import tiny_data

    full = tiny_data()["train"]
    partial = [dict(full[0]), {k: v[:5] for k, v in full[1].items()}]

    class Iterable:  # len() and iteration only: not index-addressable
        def __len__(self):
            return len(partial)

        def __iter__(self):
            return iter(partial)

    n = jn.Nitro(Tiny(), data={"train": Iterable()}, run_dir=tmp_path, logger=None)
    with pytest.raises(Exception, match=r"(?s)5 rows.*have 16.*drop its partial final batch.*drop_last=True"):
        n.train()
    assert n.status == "failed"
