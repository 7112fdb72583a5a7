"""Metrics reduced over whole splits (every mode, host and device residency, never any
padding), finalize_metrics, the default metric, and the verbs validate / evaluate / predict."""

from __future__ import annotations

import os

import equinox as eqx
import jax
import numpy as np
import pytest

import jaxnitro as jn
from jaxnitro.loggers.jsonl import read_jsonl
from tiny import N_CLASSES, Tiny, tiny_data

DATA = tiny_data()  # val: 40 rows = batches of 16, 16 and a partial 8
VAL_X = np.concatenate([b["x"] for b in DATA["val"]])
VAL_Y = np.concatenate([b["y"] for b in DATA["val"]])
VAL_ONEHOT = np.concatenate([b["label"] for b in DATA["val"]])
SEEN: list[tuple[int, int, int]] = []  # (outputs rows, x rows, y rows) per host `metrics` call


def stats(logits, x, y):
    """Every metric mode, written with array methods so NumPy and traced JAX both run it."""
    onehot = (y[:, None] == np.arange(N_CLASSES)[None, :]).astype(x.dtype)
    return {
        "x0_mean": (x[:, 0].sum(), x.shape[0]),  # count: summed, divided once
        "x0_by_class": (x[:, 0] @ onehot, onehot.sum(0)),  # an array of counts
        "acc": ((logits.argmax(-1) == y).sum(), y.shape[0]),
        "y_sum": (y.sum(), "sum"),
        "x_max": (x.max(0), "max"),
        "x_min": (x.min(0), "min"),
        "y_all": (y, "concat"),
        "logits": (logits, "concat"),
    }


@jn.experiment
class Stats(Tiny):
    residency: str = "host"
    "Where `metrics` runs (Host: changing it compiles nothing)."
    finalize: bool = False
    "Whether finalize_metrics reshapes the result (Host)."

    def metrics(self, logits, *, x, y):
        if not isinstance(self.residency, jn.StrippedHost):  # a host call (traced code sees a sentinel)
            assert isinstance(logits, np.ndarray) and isinstance(x, np.ndarray), "host metrics get host arrays"
            assert logits.shape[0] == x.shape[0] == y.shape[0], "outputs and fields sliced alike"
            SEEN.append((logits.shape[0], x.shape[0], y.shape[0]))
        return stats(logits, x, y)

    def metrics_residency(self, hook):
        return self.residency if hook == "metrics" else "device"

    def finalize_metrics(self, acc, split):
        if not self.finalize:
            return acc
        return {"acc": acc["acc"], "spread": float(np.max(acc["x_max"] - acc["x_min"])), "n": len(acc["y_all"])}


def expected_stats():
    per_class = np.array([VAL_X[VAL_Y == c, 0].mean() for c in range(N_CLASSES)])
    return {
        "x0_mean": VAL_X[:, 0].mean(),
        "x0_by_class": per_class,
        "y_sum": VAL_Y.sum(),
        "x_max": VAL_X.max(0),
        "x_min": VAL_X.min(0),
        "y_all": VAL_Y,
    }


def forward_numpy(nitro, x):
    """The handle's forward computed directly (Tiny: vmap(model)(x) / temperature)."""
    model = eqx.nn.inference_mode(nitro.model)
    return np.asarray(jax.vmap(model)(x)) / nitro.experiment.temperature


@pytest.fixture(scope="module")
def host_stats(tmp_path_factory):
    return jn.Nitro(Stats(), run_dir=tmp_path_factory.mktemp("stats"), logger=None)


# -- metric modes ---------------------------------------------------------------------------


def test_every_mode_reduces_over_the_whole_split_exactly(host_stats):
    SEEN.clear()
    got = host_stats.validate()
    exp = expected_stats()
    assert set(got) == {"x0_mean", "x0_by_class", "acc", "y_sum", "x_max", "x_min", "y_all", "logits"}
    np.testing.assert_allclose(got["x0_mean"], exp["x0_mean"], rtol=1e-6)
    np.testing.assert_allclose(got["x0_by_class"], exp["x0_by_class"], rtol=1e-6)
    assert got["y_sum"] == exp["y_sum"]
    np.testing.assert_array_equal(got["x_max"], exp["x_max"])
    np.testing.assert_array_equal(got["x_min"], exp["x_min"])
    np.testing.assert_array_equal(got["y_all"], exp["y_all"])
    logits = forward_numpy(host_stats, VAL_X)
    assert got["logits"].shape == (40, N_CLASSES)
    np.testing.assert_allclose(got["logits"], logits, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["acc"], np.mean(logits.argmax(-1) == VAL_Y))


def test_metrics_never_sees_padding(host_stats):
    SEEN.clear()
    host_stats.validate()
    assert SEEN == [(16, 16, 16), (16, 16, 16), (8, 8, 8)], "the partial final batch arrives sliced"
    assert sum(rows for rows, _, _ in SEEN) == len(VAL_Y) == 40


def test_device_residency_gives_the_same_values(host_stats, tmp_path):
    dev = jn.Nitro(Stats(residency="device"), run_dir=tmp_path, logger=None)
    assert dev.plan.metrics_on_device and not host_stats.plan.metrics_on_device
    SEEN.clear()
    on_device = dev.validate()
    assert SEEN == [], "device metrics run traced, not as a host hook"
    on_host = host_stats.validate()
    assert set(on_device) == set(on_host)
    for k in on_host:
        np.testing.assert_allclose(on_device[k], on_host[k], rtol=1e-5, atol=1e-6, err_msg=k)
    np.testing.assert_array_equal(on_device["y_all"], VAL_Y)  # 40 rows: padding never counted
    assert on_device["y_sum"] == VAL_Y.sum()


def test_finalize_metrics_output_replaces_acc_everywhere(tmp_path):
    n = jn.train(Stats(finalize=True), run_dir=tmp_path, max_epochs=2)
    exp = expected_stats()
    spread = float(np.max(exp["x_max"] - exp["x_min"]))
    result = n.validate()
    assert set(result) == {"acc", "spread", "n"}
    assert result["n"] == 40 and result["spread"] == pytest.approx(spread)
    h = n.history()
    assert set(h.columns) == {"epoch", "step", "train_loss", "acc", "spread", "n"}
    assert list(h.n) == [40, 40]
    np.testing.assert_allclose(h.spread, [spread, spread])
    assert h.acc[-1] == pytest.approx(result["acc"])
    lines = read_jsonl(os.path.join(n.run_dir, "metrics.jsonl"))
    validate = [l for l in lines if l.get("context") == "validate"]
    assert len(validate) == 2
    for l in validate:
        assert set(l) == {"kind", "context", "step", "epoch", "time", "acc", "spread", "n"}
        assert l["n"] == 40


# -- the default metric -----------------------------------------------------------------------------


def test_default_metric_is_loss_with_count_one(tmp_path):
    n = jn.Nitro(Tiny(), run_dir=tmp_path, logger=None)
    assert "metrics" not in n.hooks
    got = n.validate()
    assert set(got) == {"loss"}
    losses = []
    for b in DATA["val"]:
        logits = forward_numpy(n, b["x"])
        logp = logits - np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1, keepdims=True)) - logits.max(-1, keepdims=True)
        losses.append(-np.mean(np.sum(b["label"] * logp, -1)))
    # a mean over the 3 batches (count 1 each), not over the 40 rows
    assert got["loss"] == pytest.approx(np.mean(losses), rel=1e-5)
    row_mean = (16 * losses[0] + 16 * losses[1] + 8 * losses[2]) / 40
    assert abs(np.mean(losses) - row_mean) > 1e-4, "the data must tell the two apart"


# -- validate / evaluate ------------------------------------------------------------------------------


def test_validate_and_evaluate(host_stats, tmp_path):
    data = {**DATA, "test": DATA["val"][:2]}
    n = jn.Nitro(Stats(), data=data, run_dir=tmp_path, logger=None)
    val = n.validate()
    again = n.evaluate("val")
    assert set(val) == set(again)
    for k in val:
        np.testing.assert_array_equal(val[k], again[k])
    test = n.evaluate()  # the default split is "test"
    np.testing.assert_array_equal(test["y_all"], VAL_Y[:32])
    train = n.evaluate("train")
    np.testing.assert_array_equal(train["y_all"], np.concatenate([b["y"] for b in DATA["train"]]))


def test_unknown_split_names_the_known_ones(host_stats):
    with pytest.raises(KeyError) as err:
        host_stats.evaluate("tset")
    msg = str(err.value)
    assert "no split 'tset'" in msg and "['train', 'val']" in msg and "build_data" in msg


# -- predict ----------------------------------------------------------------------------------------------


def test_predict_dict_pads_and_slices_to_host_numpy(host_stats):
    assert host_stats.plan.width == 16
    x = VAL_X[:5]
    out = host_stats.predict({"x": x, "y": VAL_Y[:5], "unused": np.zeros((5, 3))})
    assert type(out) is np.ndarray and out.shape == (5, N_CLASSES)
    np.testing.assert_allclose(out, forward_numpy(host_stats, x), rtol=1e-5, atol=1e-6)
    full = host_stats.predict({"x": VAL_X[:16]})
    assert type(full) is np.ndarray and full.shape == (16, N_CLASSES)
    np.testing.assert_allclose(out, full[:5], rtol=1e-6, atol=1e-6)


def test_predict_iterable_is_lazy(host_stats):
    produced = []

    def batches():
        for i in range(3):
            produced.append(i)
            yield {"x": VAL_X[i * 5 : (i + 1) * 5]}

    it = host_stats.predict(batches())
    assert produced == [], "nothing is read before the first output is asked for"
    first = next(it)
    assert produced == [0]
    assert type(first) is np.ndarray and first.shape == (5, N_CLASSES)
    rest = list(it)
    assert produced == [0, 1, 2] and len(rest) == 2
    np.testing.assert_allclose(np.concatenate([first, *rest]), forward_numpy(host_stats, VAL_X[:15]), rtol=1e-5, atol=1e-6)
    # a list works as well and also gives an iterator, not a list
    outs = host_stats.predict([{"x": VAL_X[:2]}, {"x": VAL_X[2:9]}])
    assert iter(outs) is outs
    assert [o.shape for o in outs] == [(2, N_CLASSES), (7, N_CLASSES)]


def test_predict_bare_array_is_a_type_error_showing_the_call(host_stats):
    with pytest.raises(TypeError) as err:
        host_stats.predict(VAL_X[:4])
    msg = str(err.value)
    assert "not a bare ndarray" in msg and "nitro.predict({'x': ...})" in msg


def test_predict_wider_than_compiled_width_is_an_error(host_stats):
    with pytest.raises(ValueError) as err:
        host_stats.predict({"x": np.zeros((17, 8), np.float32)})
    msg = str(err.value)
    assert "17 rows" in msg and "compiled batch width 16" in msg and "at most 16 rows" in msg
