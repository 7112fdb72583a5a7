"""Automatic training end to end on the tiny experiment: loss, history, reproducibility,
gradient accumulation, divergence, early stopping, model state, logging and run folders."""

from __future__ import annotations

import os
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxnitro as jn
from jaxnitro.loggers.jsonl import read_jsonl
from tiny import N_CLASSES, N_FEATURES, Tiny, tiny_data


def lines_of(nitro, restore_nonfinite=False):
    return read_jsonl(os.path.join(nitro.run_dir, "metrics.jsonl"), restore_nonfinite=restore_nonfinite)


def train_lines(nitro):
    return [l for l in lines_of(nitro) if l["kind"] == "metrics" and l["context"] == "train"]


def leaves(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


@pytest.fixture(scope="module")
def run4(tmp_path_factory):
    """One 4-epoch run of Tiny shared by the read-only tests below."""
    return jn.train(Tiny(), run_dir=tmp_path_factory.mktemp("run4"), max_epochs=4)


# -- the basic run ---------------------------------------------------------------------------


def test_loss_decreases(run4):
    assert run4.status == "done" and run4.step == 24 and run4.epoch == 4
    train = [r["train_loss"] for r in run4.rows]
    val = [r["loss"] for r in run4.rows]
    assert all(np.isfinite(train)) and all(np.isfinite(val))
    assert train[-1] < train[0] - 0.1, train
    assert val[-1] < val[0] - 0.05, val
    assert all(b < a for a, b in zip(val, val[1:])), val


def test_history_has_one_row_per_epoch(run4):
    h = run4.history()
    assert len(h) == 4
    assert list(h.epoch) == [1, 2, 3, 4]
    assert list(h.step) == [6, 12, 18, 24]
    np.testing.assert_allclose(h.train_loss, [r["train_loss"] for r in run4.rows])
    assert h[-1]["epoch"] == 4
    # train_loss is the mean of the epoch's per-step losses as logged
    steps = train_lines(run4)
    for epoch in (1, 4):
        logged = [l["loss"] for l in steps if l["epoch"] == epoch]
        assert len(logged) == 6
        np.testing.assert_allclose(h[epoch:epoch].train_loss[0], np.mean(logged), rtol=1e-6)
    text = str(h)
    assert "epoch" in text and "train_loss" in text and "24" in text


def test_jsonl_lines_of_a_run(run4):
    lines = lines_of(run4)
    assert lines[0]["kind"] == "params"
    assert lines[0]["params"]["knob/max_epochs"] == 4
    assert [l["step"] for l in lines if l.get("context") == "train"] == list(range(1, 25))
    validate = [l for l in lines if l.get("context") == "validate"]
    assert [(l["epoch"], l["step"]) for l in validate] == [(1, 6), (2, 12), (3, 18), (4, 24)]
    np.testing.assert_allclose([l["loss"] for l in validate], [r["loss"] for r in run4.rows])
    assert lines[-1]["kind"] == "finish" and lines[-1]["status"] == "done"


def test_each_run_gets_its_own_folder(tmp_path):
    a = jn.train(Tiny(), run_dir=tmp_path, max_epochs=1)
    b = jn.train(Tiny(), run_dir=tmp_path, max_epochs=1)
    assert a.run_dir != b.run_dir
    for n in (a, b):
        assert os.path.dirname(n.run_dir) == str(tmp_path)
        assert lines_of(n)[0]["params"]["run_dir"] == n.run_dir
        last = lines_of(n)[-1]
        assert (last["kind"], last["status"]) == ("finish", "done")
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(n.run_dir) for n in (a, b))


def test_logger_none_writes_no_metrics_file(tmp_path):
    n = jn.train(Tiny(), run_dir=tmp_path, max_epochs=1, logger=None)
    assert n.status == "done" and len(n.history()) == 1
    assert os.path.isdir(n.run_dir)
    assert not os.path.exists(os.path.join(n.run_dir, "metrics.jsonl"))
    assert [p for _, _, files in os.walk(tmp_path) for p in files] == []


def test_log_every_n_steps_thins_train_lines(tmp_path):
    every1 = jn.train(Tiny(), run_dir=tmp_path / "a", max_epochs=2)
    every2 = jn.train(Tiny(), run_dir=tmp_path / "b", max_epochs=2, log_every_n_steps=2)
    one, two = train_lines(every1), train_lines(every2)
    assert len(one) == 12 and len(two) == 6
    assert [l["step"] for l in two] == [2, 4, 6, 8, 10, 12]
    # the same run, so the lines that are kept carry the same values
    np.testing.assert_allclose([l["loss"] for l in two], [l["loss"] for l in one[1::2]], rtol=1e-6)


# -- reproducibility --------------------------------------------------------------------------


def test_same_seed_is_bitwise_reproducible_and_another_seed_differs(tmp_path):
    a = jn.train(Tiny(), run_dir=tmp_path, max_epochs=1, seed=3, logger=None)
    b = jn.train(Tiny(), run_dir=tmp_path, max_epochs=1, seed=3, logger=None)
    c = jn.train(Tiny(), run_dir=tmp_path, max_epochs=1, seed=4, logger=None)
    la, lb, lc = leaves(a.params), leaves(b.params), leaves(c.params)
    assert len(la) == 4
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(x, y)
    assert a.rows == b.rows
    assert any(not np.array_equal(x, z) for x, z in zip(la, lc))
    assert a.rows[0]["train_loss"] != c.rows[0]["train_loss"]


# -- gradient accumulation ----------------------------------------------------------------------


def test_accum_2_halves_the_optimizer_steps(tmp_path):
    n = jn.train(Tiny(), run_dir=tmp_path, max_epochs=2, accum=2)
    assert n.step == 6, "6 batches per epoch / accum 2 = 3 optimizer steps per epoch"
    assert [r["step"] for r in n.rows] == [3, 6]
    assert [l["step"] for l in train_lines(n)] == [1, 2, 3, 4, 5, 6]


def test_accum_2_equals_one_batch_of_twice_the_width(tmp_path):
    """Two micro-batches of 16 with accum=2 take the same step as one batch of 32."""
    micro = jn.train(Tiny(), data=tiny_data(batch=16), run_dir=tmp_path, max_epochs=1, accum=2, logger=None)
    whole = jn.train(Tiny(), data=tiny_data(batch=32), run_dir=tmp_path, max_epochs=1, accum=1, logger=None)
    assert micro.step == whole.step == 3
    for x, y in zip(leaves(micro.params), leaves(whole.params)):
        np.testing.assert_allclose(x, y, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(micro.rows[0]["train_loss"], whole.rows[0]["train_loss"], rtol=1e-5)
    # and both moved away from the initial weights
    init = jn.Nitro(Tiny(), data=tiny_data(batch=32), run_dir=tmp_path, logger=None)
    assert any(not np.allclose(x, y) for x, y in zip(leaves(init.params), leaves(whole.params)))


# -- divergence ---------------------------------------------------------------------------------------


def test_nan_loss_after_some_steps_stops_with_status_diverged(tmp_path):
    # the temperature drops to 0 from the 9th optimizer step on: logits / 0, the loss becomes NaN
    # there (a NaN schedule value is refused at train start, so the poison is a finite 0)
    poison = {"temperature": lambda total: lambda s: np.where(np.asarray(s) < 8, 1.0, 0.0)}
    with pytest.warns(RuntimeWarning, match=r"non-finite at step 9 \(epoch 2\).*'diverged'"):
        n = jn.train(Tiny(), run_dir=tmp_path, max_epochs=5, schedules=poison)
    assert n.status == "diverged"
    assert n.epoch == 2 and "step 9" in n.stop_reason
    assert [l["step"] for l in train_lines(n)] == list(range(1, 9))
    lines = lines_of(n)
    assert lines[-1]["kind"] == "finish" and lines[-1]["status"] == "diverged"
    assert [l["epoch"] for l in lines if l.get("context") == "validate"] == [1]


def test_huge_learning_rate_diverges(tmp_path):
    boom = {"learning_rate": lambda total: lambda s: 1e6}
    with pytest.warns(RuntimeWarning, match="non-finite"):
        n = jn.train(Tiny(), run_dir=tmp_path, max_epochs=3, schedules=boom)
    assert n.status == "diverged"
    assert lines_of(n)[-1]["status"] == "diverged"
    assert n.step <= 18


def test_check_divergence_false_keeps_running(tmp_path):
    poison = {"temperature": lambda total: lambda s: np.where(np.asarray(s) < 8, 1.0, 0.0)}
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        n = jn.train(Tiny(), run_dir=tmp_path, max_epochs=2, schedules=poison, check_divergence=False,
                     logger=None)
    assert n.status == "done" and n.step == 12
    assert np.isnan(n.rows[-1]["train_loss"])


# -- early stopping and monitor -------------------------------------------------------------------------


@jn.experiment
class Monitored(Tiny):
    """Tiny with a monitor whose best epoch is the first one, and train metrics."""

    def monitor(self):
        # val loss falls every epoch, so "max" makes epoch 1 the best and nothing improves on it
        return ("loss", "max")

    def train_metrics(self, logits, *, y):
        return {"batch_acc": jnp.mean(jnp.argmax(logits, -1) == y), "logit_mag": jnp.mean(jnp.abs(logits))}


def test_early_stopping_stops_before_max_epochs_and_stars_best_epoch(tmp_path):
    n = jn.train(Monitored(), run_dir=tmp_path, max_epochs=10, early_stop=jn.EarlyStopping(patience=2))
    assert n.status == "done"
    assert n.epoch == 3 and len(n.rows) == 3, "epoch 1 best, epochs 2 and 3 no better: stop"
    assert "early stopping" in n.stop_reason and "loss" in n.stop_reason
    h = n.history()
    assert len(h) == 3
    text = str(h)
    starred = [line for line in text.splitlines() if line.rstrip("│ ").endswith("*")]
    assert len(starred) == 1, text
    assert starred[0].strip("│ ").split()[0] == "1", text
    assert "best loss (max)" in text
    assert [l["epoch"] for l in lines_of(n) if l.get("context") == "validate"] == [1, 2, 3]


def test_without_early_stop_monitor_runs_every_epoch(tmp_path):
    n = jn.train(Monitored(), run_dir=tmp_path, max_epochs=3, logger=None)
    assert n.epoch == 3 and n.stop_reason is None


def test_train_metrics_appear_in_train_lines(tmp_path):
    n = jn.train(Monitored(), run_dir=tmp_path, max_epochs=1)
    lines = train_lines(n)
    assert len(lines) == 6
    for l in lines:
        assert set(l) >= {"loss", "batch_acc", "logit_mag", "step", "epoch"}
        assert 0.0 <= l["batch_acc"] <= 1.0 and l["logit_mag"] > 0
        assert l["batch_acc"] * 16 == pytest.approx(round(l["batch_acc"] * 16))  # k/16 correct
    # they are per-step diagnostics, not validation metrics
    assert "batch_acc" not in n.rows[0]


# -- model state (BatchNorm) ---------------------------------------------------------------------------


class BNNet(eqx.Module):
    l1: eqx.nn.Linear
    bn: eqx.nn.BatchNorm
    l2: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.l1 = eqx.nn.Linear(N_FEATURES, 16, key=k1)
        self.bn = eqx.nn.BatchNorm(16, axis_name="batch", momentum=0.5, mode="batch")
        self.l2 = eqx.nn.Linear(16, N_CLASSES, key=k2)

    def __call__(self, x, state):
        h, state = self.bn(self.l1(x), state)
        return self.l2(jax.nn.relu(h)), state


@jn.experiment
class BatchNormed(Tiny):
    def build_model(self, key):
        return eqx.nn.make_with_state(BNNet)(key)

    def forward(self, model, state, *, x):
        return jax.vmap(model, in_axes=(0, None), out_axes=(0, None), axis_name="batch")(x, state)


def test_batchnorm_state_trains_and_evaluation_uses_inference_mode(tmp_path):
    n = jn.Nitro(BatchNormed(), run_dir=tmp_path, max_epochs=2)
    assert isinstance(n.model_state, eqx.nn.State)
    before = leaves(n.model_state)
    n.train()
    assert n.status == "done"
    assert n.rows[-1]["train_loss"] < n.rows[0]["train_loss"]
    after = leaves(n.model_state)
    assert len(before) == len(after) == 3
    changed = [not np.array_equal(a, b) for a, b in zip(before, after)]
    assert all(changed), "running mean, running variance and the step counter all move in training"

    # evaluation does not touch the state (inference mode uses the running statistics)
    n.validate()
    n.evaluate("val")
    for a, b in zip(after, leaves(n.model_state)):
        np.testing.assert_array_equal(a, b)

    # inference mode: a row's prediction does not depend on what else is in the batch
    x = tiny_data()["val"][0]["x"]
    full = n.predict({"x": x})
    np.testing.assert_array_equal(n.predict({"x": x}), full)
    np.testing.assert_allclose(n.predict({"x": x[:3]}), full[:3], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(n.predict({"x": x[::-1].copy()}), full[::-1], rtol=1e-6, atol=1e-6)

    # and it is the model in inference mode with the trained running statistics
    model = eqx.nn.inference_mode(n.model)
    manual = jax.vmap(model, in_axes=(0, None), out_axes=(0, None), axis_name="batch")(x, n.model_state)[0]
    np.testing.assert_allclose(full, np.asarray(manual), rtol=1e-5, atol=1e-5)

    # whereas training mode normalises with the batch's own statistics
    train_mode = eqx.nn.inference_mode(model, value=False)
    batch_stat = jax.vmap(train_mode, in_axes=(0, None), out_axes=(0, None), axis_name="batch")(x[:3], n.model_state)[0]
    assert not np.allclose(np.asarray(batch_stat), full[:3], atol=1e-3)


def test_gradient_clip_norm_bounds_the_update_by_global_norm(tmp_path):
    """With SGD at rate 1 the update IS the clipped gradient: its global norm equals the threshold."""
    import optax

    @jn.experiment
    class SGD(Tiny):
        def optimizer(self, group):
            return optax.sgd

        def learning_rate(self):
            return 1.0

    data = {"train": tiny_data()["train"][:1]}
    start = jn.Nitro(SGD(max_epochs=0), data=data, run_dir=tmp_path, logger=None)
    for clip in (1e-3, 2e-3):
        n = jn.train(SGD(max_epochs=1), data=data, run_dir=tmp_path, logger=None, gradient_clip_norm=clip)
        delta = [a - b for a, b in zip(leaves(n.params), leaves(start.params))]
        norm = float(np.sqrt(sum(np.sum(np.square(d)) for d in delta)))
        assert norm == pytest.approx(clip, rel=1e-3)


def test_warm_start_from_another_handle(tmp_path):
    n = jn.train(Tiny(max_epochs=1), run_dir=tmp_path, logger=None)
    warm = jn.Nitro(Tiny(smoothing=0.1), weights=n, run_dir=tmp_path, logger=None)
    assert all(np.array_equal(a, b) for a, b in zip(leaves(warm.params), leaves(n.params)))
    assert warm.step == 0 and warm.epoch == 0
    assert "warm start" in repr(warm)
    warm.train()
    assert not all(np.array_equal(a, b) for a, b in zip(leaves(warm.params), leaves(n.params)))

    with pytest.raises(ValueError, match=r"(?s)different tree.*\.l1\.weight: this model \(32, 8\), weights \(16, 8\).*same structure"):
        jn.Nitro(Tiny(width=32), weights=n, run_dir=tmp_path, logger=None)


def test_no_train_split_allocates_no_optimizer_state(tmp_path):
    n = jn.Nitro(Tiny(), data={}, run_dir=tmp_path, logger=None)
    assert n.opt_state is None and n.plan.opt_spec is None
    out = n.predict({"x": np.ones((3, N_FEATURES), np.float32)})
    assert out.shape == (3, N_CLASSES) and isinstance(out, np.ndarray)
    with pytest.raises(ValueError, match="no `train` split"):
        n.train()


class DropNet(eqx.Module):
    lin: eqx.nn.Linear
    drop: eqx.nn.Dropout

    def __init__(self, key):
        self.lin = eqx.nn.Linear(N_FEATURES, N_CLASSES, key=key)
        self.drop = eqx.nn.Dropout(0.5)

    def __call__(self, x, key):
        return self.lin(self.drop(x, key=key))


@jn.experiment
class WithDropout(Tiny):
    def build_model(self, key):
        return DropNet(key)

    def forward(self, model, state, *, x, key):
        keys = jax.random.split(key, x.shape[0])
        return jax.vmap(model)(x, keys), state

    def train_metrics(self, logits, *, key):
        return {"key_word": jax.random.key_data(key)[-1].astype(jnp.float32)}  # a word of the key


def test_hooks_declaring_key_get_a_fresh_prng_key_per_micro_batch(tmp_path):
    """`key` is supplied by the framework (not a batch field): distinct per micro-batch,
    reproducible per seed, fixed in evaluation/prediction (inference mode ignores dropout)."""
    a = jn.train(WithDropout(max_epochs=2), run_dir=tmp_path, accum=2)
    words = [line["key_word"] for line in train_lines(a)]
    assert len(words) == 6 and len(set(words)) == 6  # one fresh key per optimizer step's last micro-batch
    b = jn.train(WithDropout(max_epochs=2), run_dir=tmp_path, accum=2)
    assert all(np.array_equal(p, q) for p, q in zip(leaves(a.params), leaves(b.params)))  # same seed
    c = jn.train(WithDropout(max_epochs=2), run_dir=tmp_path, accum=2, seed=1)
    assert [line["key_word"] for line in train_lines(c)] != words  # another seed, other keys
    x = tiny_data()["val"][0]["x"]
    np.testing.assert_array_equal(a.predict({"x": x}), a.predict({"x": x}))  # inference: deterministic
    assert "key (PRNG key from the framework)" in repr(a)
    assert "key" not in a.plan.batch_fields  # it was never a batch field


def test_logger_info_and_backend(tmp_path):
    n = jn.train(Tiny(max_epochs=1), run_dir=tmp_path)
    info = jn.logger_info(n)
    assert info["backend"] == "jsonl" and info["path"] == os.path.join(n.run_dir, "metrics.jsonl")
    assert jn.backend(n) is n.logger

    class Wrapper:
        backend = object()

    assert jn.backend(Wrapper()) is Wrapper.backend
    assert jn.logger_info(Wrapper()) == {"backend": "Wrapper"}
    with pytest.raises(ValueError, match="logger=None"):
        jn.logger_info(jn.Nitro(Tiny(), run_dir=tmp_path, logger=None))


@pytest.mark.parametrize("read_every", [32, 4, 1])
def test_train_only_rows_are_complete_and_match_the_train_lines(tmp_path, monkeypatch, read_every):
    """Without a val split, epoch rows are appended as their steps are read (possibly during
    the next epoch); every epoch still gets exactly its row, with its own steps' mean loss.
    Small read stretches make reads cross epoch boundaries mid-epoch."""
    import jaxnitro.trainer as trainer

    monkeypatch.setattr(trainer, "READ_EVERY", read_every)
    monkeypatch.setattr(trainer, "MAX_PENDING", 4 * read_every)
    n = jn.train(Tiny(max_epochs=3), data={"train": tiny_data()["train"]}, run_dir=tmp_path)
    rows = n.history().rows
    assert [(r["epoch"], r["step"]) for r in rows] == [(1, 6), (2, 12), (3, 18)]
    lines = train_lines(n)
    assert [line["step"] for line in lines] == list(range(1, 19))
    for r in rows:
        losses = [line["loss"] for line in lines if line["epoch"] == r["epoch"]]
        assert len(losses) == 6 and r["train_loss"] == pytest.approx(np.mean(losses))


def test_a_fixed_seed_is_bitwise_reproducible_at_any_worker_count(tmp_path):
    """Ordered delivery: the same seed gives the same parameters with 0, 1 or 3 producers."""
    from tiny import make_arrays

    class Shuffled:  # an index-addressable source with a per-epoch shuffle
        def __init__(self):
            self.x, _, self.y = make_arrays(96)
            self.order = np.arange(96)

        def __len__(self):
            return 6

        def begin_epoch(self, epoch):
            self.order = np.random.default_rng(epoch).permutation(96)

        def batch_at(self, i):
            idx = self.order[i * 16 : (i + 1) * 16]
            return {"x": self.x[idx], "label": self.y[idx]}

    results = []
    for workers in (0, 1, 3):
        data = {"train": jn.PrefetchIterator(Shuffled(), workers=workers)}
        n = jn.train(Tiny(max_epochs=3), data=data, run_dir=tmp_path, logger=None)
        results.append(leaves(n.params))
    for other in results[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(results[0], other))


def test_ctrl_c_finishes_the_log_as_interrupted_and_keeps_the_finished_epochs(tmp_path):
    @jn.experiment
    class Interrupted(Tiny):
        def finalize_metrics(self, acc, split):
            if len(self.calls) == 1:  # Ctrl-C during the second validation
                raise KeyboardInterrupt
            self.calls.append(split)
            return acc

        calls: list = jn.field(factory=list)

    n = jn.Nitro(Interrupted(max_epochs=3), run_dir=tmp_path)
    with pytest.raises(KeyboardInterrupt):
        n.train()
    assert n.status == "interrupted"
    lines = lines_of(n)
    assert (lines[-1]["kind"], lines[-1]["status"]) == ("finish", "interrupted")
    assert [line["epoch"] for line in lines if line.get("context") == "validate"] == [1]
    assert [r["epoch"] for r in n.history().rows][:1] == [1]
