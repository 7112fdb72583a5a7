"""The orbax checkpointer, ``weights=`` from checkpoints, serving from a record, ``resume=``.

One 6-epoch run (module fixture) is read by most tests. Its experiment monitors the
validation loss with mode ``"max"``, so that the "best" epochs are the first ones and
differ from the last (Tiny's loss falls every epoch): ``keep=(Best(2), Last(1))`` then
keeps epochs 1, 2 and 6.
"""

from __future__ import annotations

import os
import shutil
import warnings

import attrs
import jax
import numpy as np
import pytest

import jaxnitro as jn
from jaxnitro import GraphConst
from jaxnitro.events import run_scoped
from tiny import N_FEATURES, Tiny, tiny_data

SPE = 6  # optimizer steps per epoch (96 rows / 16)


@jn.experiment
class Ranked(Tiny):
    """Tiny with a monitor, and a structural field that leaves the parameter tree alone."""

    activation: GraphConst[str] = "relu"
    "Structural (part of the compile key) without changing the parameter tree."
    class_counts: np.ndarray = jn.field(factory=lambda: np.zeros(4, np.int64))
    "Rows per class in the train split (derived; Host)."

    def derive(self, data):
        return {"class_counts": np.bincount(np.concatenate([b["y"] for b in data["train"]]), minlength=4)}

    def monitor(self):
        return ("loss", "max")


@jn.experiment
class Unrelated(Tiny):
    pass


def leaves(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(leaves(a), leaves(b), strict=True))


class Recorder:
    """Records the params (host copies) at the end of each epoch's steps."""

    def __init__(self):
        self.params = {}

    @jn.hookimpl
    def jaxnitro_epoch_trained(self, run, epoch, step, stats):
        self.params[epoch] = jax.tree_util.tree_map(np.asarray, run.nitro.state.params)


def train(e, **kw):
    rec = Recorder()
    with run_scoped([rec]):
        n = jn.train(e, **kw)
    return n, rec


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    n, rec = train(Ranked(), run_dir=root, max_epochs=6, checkpointer=jn.Checkpointer(keep=(jn.Best(2), jn.Last(1))))
    return n, rec, str(root)


def step_dirs(run_folder):
    return sorted(os.listdir(os.path.join(run_folder, "checkpoints")), key=lambda s: (len(s), s))


# -- saving ------------------------------------------------------------------------------


def test_keeps_the_union_of_best_and_last(ran):
    n, rec, root = ran
    assert n.status == "done" and n.step == 36
    losses = [r["loss"] for r in n.rows]
    assert losses == sorted(losses, reverse=True)  # so "max" ranks epochs 1 and 2 best
    assert step_dirs(n.run_dir) == ["6", "12", "36"]  # Best(2): epochs 1, 2; Last(1): epoch 6


def test_a_checkpoint_is_a_plain_orbax_checkpoint(ran):
    import orbax.checkpoint as ocp

    n, rec, root = ran
    mgr = ocp.CheckpointManager(os.path.join(n.run_dir, "checkpoints"))
    assert mgr.all_steps() == [6, 12, 36]
    got = mgr.restore(12, args=ocp.args.Composite(state=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore()))
    raw, meta = got["state"]["params"], got["meta"]
    assert sorted(got["state"]) == ["opt_state", "params"]
    np.testing.assert_array_equal(raw["l1"]["weight"], rec.params[2].l1.weight)
    np.testing.assert_array_equal(raw["l2"]["bias"], rec.params[2].l2.bias)
    assert meta["step"] == 12 and meta["epoch"] == 2 and meta["epoch_complete"] is True
    assert meta["experiment"]["qualname"] == "Ranked"
    assert meta["graph_const"] == {"width": 16, "activation": "relu"}
    assert meta["tree"]["params"][".l1.weight"] == [[16, N_FEATURES], "float32"]
    assert meta["metrics"]["loss"] == pytest.approx(n.rows[1]["loss"])
    assert meta["items"] == ["params", "opt_state"] and meta["monitor"] == ["loss", "max"]
    assert meta["data_position"] == {"epoch": 2, "steps_into_epoch": 0, "batches_into_epoch": 0}
    assert meta["rng"]["dtype"] == "uint32" and meta["seed"] == 0 and meta["end"] is None
    assert meta["derived"]["class_counts"]["__array__"] == n.experiment.class_counts.tolist()


# -- weights= ----------------------------------------------------------------------------


def test_weights_latest_best_restores_the_best_epoch(ran):
    n, rec, root = ran
    best = jn.Nitro(Ranked(), run_dir=root, weights=("latest", "best"))
    assert same(best.params, rec.params[1])  # the highest loss: epoch 1
    assert best.step == 0 and best.epoch == 0 and best.opt_state is not None  # a fresh optimizer
    assert "weights: checkpoint step 6 (epoch 1, best loss=" in repr(best)
    assert same(jn.Nitro(Ranked(), run_dir=root, weights=("latest", "last")).params, rec.params[6])
    assert same(jn.Nitro(Ranked(), run_dir=root, weights=("latest", 12)).params, rec.params[2])
    by_path = jn.Nitro(Ranked(), run_dir=root, weights=os.path.join(n.run_dir, "checkpoints", "12"))
    assert same(by_path.params, rec.params[2])
    by_name = jn.Nitro(Ranked(), run_dir=root, weights=(os.path.basename(n.run_dir), "last"))
    assert same(by_name.params, rec.params[6])


def test_a_record_restores_the_derived_values_and_skips_derive(ran, monkeypatch):
    n, rec, root = ran

    def derive(self, data):
        raise AssertionError("derive ran")

    monkeypatch.setattr(Ranked, "derive", derive)
    loaded = jn.Nitro(Ranked(), run_dir=root, weights=("latest", "last"))  # build_data runs, derive not
    np.testing.assert_array_equal(loaded.experiment.class_counts, n.experiment.class_counts)
    assert loaded.experiment.class_counts.sum() == 96 and loaded.plan.derived.keys() == {"class_counts"}
    # print(nitro) says which: derive ran for the trained handle, was skipped for the loaded one
    assert "derive: ran (experiment): class_counts=array([" in str(n)
    assert "derive: not run (weights from a checkpoint); its saved values restored: class_counts=array([" in str(loaded)


def test_average_of_checkpoints(ran):
    n, rec, root = ran
    avg = jn.Nitro(Ranked(), run_dir=root, weights=jn.Average(jn.Best(2)))
    expected = jax.tree_util.tree_map(lambda a, b: (a + b) / 2, rec.params[1], rec.params[2])
    for got, want in zip(leaves(avg.params), leaves(expected), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    assert "average of 2 checkpoints (Best(2): epochs [1, 2])" in avg.plan.weights_from
    assert same(jn.Nitro(Ranked(), run_dir=root, weights=("latest", jn.Average(jn.Last(1)))).params, rec.params[6])


def test_serving_from_a_record_allocates_no_optimizer_state(ran):
    n, rec, root = ran
    before = sum(x.nbytes for x in jax.live_arrays())
    serving = jn.Nitro(Ranked(), run_dir=root, weights=("latest", "best"), data={})
    grown = sum(x.nbytes for x in jax.live_arrays()) - before
    param_bytes = sum(x.nbytes for x in leaves(serving.params))
    assert serving.opt_state is None and serving.plan.width is None
    assert grown < 1.5 * param_bytes + 1024, (grown, param_bytes)  # params, rng, Device values: no Adam moments
    x = tiny_data()["val"][0]["x"]
    out = serving.predict({"x": x[:5]})  # the first batch sets the width
    assert out.shape == (5, 4) and serving.plan.width == 5
    assert serving.predict({"x": x[:3]}).shape == (3, 4)  # padded to 5, sliced back
    with pytest.raises(ValueError, match="wider than the compiled batch width 5"):
        serving.predict({"x": x[:6]})
    trained = jn.Nitro(Ranked(), run_dir=root, weights=("latest", "best"))
    np.testing.assert_allclose(out, trained.predict({"x": x[:5]}), rtol=1e-6)


# -- bad input ----------------------------------------------------------------------------


def test_a_missing_path_lists_what_run_dir_holds(ran):
    n, rec, root = ran
    with pytest.raises(FileNotFoundError) as err:
        jn.Nitro(Ranked(), run_dir=root, weights=os.path.join(root, "nope", "checkpoints", "7"))
    msg = str(err.value)
    assert "does not exist" in msg and os.path.basename(n.run_dir) in msg and "[6, 12, 36]" in msg


# orbax's reader leaves tensorstore callbacks aimed at its closed event loop when a read fails
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_corrupt_and_partial_checkpoints_are_refused(ran, tmp_path):
    n, rec, root = ran
    copy = tmp_path / "runs"
    shutil.copytree(n.run_dir, copy / os.path.basename(n.run_dir))
    ckpts = copy / os.path.basename(n.run_dir) / "checkpoints"
    # a save cut short: orbax's temporary folder, which is never listed
    shutil.copytree(ckpts / "36", ckpts / "42.orbax-checkpoint-tmp-1234")
    assert same(jn.Nitro(Ranked(), run_dir=copy, weights=("latest", "last")).params, rec.params[6])
    with pytest.raises(ValueError, match=r"is not a complete checkpoint.*newest complete checkpoint there is .*/36"):
        jn.Nitro(Ranked(), run_dir=copy, weights=str(ckpts / "42.orbax-checkpoint-tmp-1234"))
    # a damaged one: its arrays cannot be read
    for f in (ckpts / "36" / "state").rglob("*"):
        if f.is_file() and "manifest" in f.name:
            f.write_bytes(b"garbage")
    listing = sorted(str(p) for p in ckpts.rglob("*"))
    with pytest.raises(ValueError, match=r"checkpoints/36 is corrupt or incomplete.*newest complete checkpoint of that run is .*/12"):
        jn.Nitro(Ranked(), run_dir=copy, weights=("latest", "last"))
    assert sorted(str(p) for p in ckpts.rglob("*")) == listing  # nothing on disk changed


def test_a_tree_mismatch_shows_the_diff(ran):
    n, rec, root = ran
    with pytest.raises(ValueError) as err:
        jn.Nitro(Ranked(width=32), run_dir=root, weights=("latest", "best"))
    msg = str(err.value)
    assert ".l1.weight: this model (32, 8), weights (16, 8)" in msg and ".l2.weight: this model (4, 32), weights (4, 16)" in msg
    assert "width: this experiment 32, checkpoint 16" in msg


def test_other_class_or_graph_const_is_refused(ran):
    n, rec, root = ran
    with pytest.raises(ValueError, match=r"saved by experiment class `test_checkpoints.Ranked`, not `test_checkpoints.Unrelated`"):
        jn.Nitro(Unrelated(), run_dir=root, weights=("latest", "last"))
    with pytest.raises(ValueError, match=r"other GraphConst values.*activation: this experiment 'tanh', checkpoint 'relu'"):
        jn.Nitro(Ranked(activation="tanh"), run_dir=root, weights=("latest", "last"))


def test_weights_with_resume_is_refused_naming_both(ran):
    n, rec, root = ran
    with pytest.raises(ValueError, match=r"`weights=\('latest', 'best'\)` and `resume='auto'` were both given"):
        jn.Nitro(Ranked(), run_dir=root, weights=("latest", "best"), resume="auto")


def test_bad_policies_and_knobs(tmp_path):
    for bad, match in ((lambda: jn.Best(0), r"Best\(0\).*n must be an integer >= 1"),
                       (lambda: jn.Last(-1), r"Last\(-1\).*n must be an integer >= 1"),
                       (lambda: jn.Checkpointer(every=0), r"every=0"),
                       (lambda: jn.Checkpointer(min_interval=-1), r"min_interval=-1\).*\"auto\".*seconds >= 0"),
                       (lambda: jn.Checkpointer(min_interval="fast"), r"min_interval='fast'"),
                       (lambda: jn.Checkpointer(min_interval=5, asynchronous=False),
                        r"min_interval=5, asynchronous=False\).*Drop min_interval")):
        with pytest.raises(ValueError, match=match):
            bad()
    with pytest.raises(TypeError, match="`keep` is a tuple of policies"):
        jn.Checkpointer(keep=())
    with pytest.raises(TypeError, match="jn.Average"):
        jn.Average(3)
    with pytest.raises(ValueError, match="`monitor` hook"):
        jn.Nitro(Tiny(), run_dir=tmp_path, checkpointer=jn.Checkpointer(keep=jn.Best(1)))
    with pytest.raises(TypeError, match=r"`checkpointer` = 'yes' \(keyword\)"):
        jn.Nitro(Tiny(), run_dir=tmp_path, checkpointer="yes")
    with pytest.raises(ValueError, match="restore_best=True` refines `resume`"):
        jn.Nitro(Tiny(), run_dir=tmp_path, restore_best=True)
    with pytest.raises(ValueError, match="w0='weights'.*no `weights=`"):
        jn.Nitro(Tiny(), run_dir=tmp_path, w0="weights")


def test_every_with_every_n_steps_is_refused_naming_both():
    """every_n_steps saves instead of at epoch ends: an `every` given with it would be ignored."""
    for every in (2, 3):
        with pytest.raises(ValueError, match=rf"^jaxnitro: Checkpointer\(every={every}, every_n_steps=5\); .*"
                                             rf"`every` .* would be ignored\. Give one of them: every_n_steps=5 "
                                             rf"alone, or every={every} alone\."):
            jn.Checkpointer(every=every, every_n_steps=5)
    # either alone is taken, and the default `every` goes with every_n_steps (evolve keeps it so)
    assert jn.Checkpointer(every_n_steps=5).every == 1 and jn.Checkpointer(every=2).every_n_steps is None
    assert attrs.evolve(jn.Checkpointer(keep=jn.Last(2)), every_n_steps=3).every_n_steps == 3
    with pytest.raises(ValueError, match=r"every=2, every_n_steps=3"):
        attrs.evolve(jn.Checkpointer(every=2), every_n_steps=3)


def test_best_without_a_recorded_metric_and_an_empty_average(tmp_path):
    data = {"train": tiny_data()["train"]}  # no val split: only train_loss is recorded
    jn.train(Ranked(), data=data, run_dir=tmp_path, max_epochs=1, checkpointer=jn.Checkpointer(), logger=None)
    with pytest.raises(ValueError, match=r"ranks by 'loss' \(max\), but no checkpoint of run .* recorded it"):
        jn.Nitro(Ranked(), run_dir=tmp_path, weights=("latest", "best"))

    class Stop:
        @jn.hookimpl
        def jaxnitro_epoch_trained(self, run, epoch, step, stats):
            raise KeyboardInterrupt  # before the epoch's end: the checkpointer saves the run's end

    empty = tmp_path / "interrupted"
    with run_scoped([Stop()]), pytest.raises(KeyboardInterrupt):
        jn.train(Ranked(), run_dir=empty, max_epochs=3, checkpointer=jn.Checkpointer(), logger=None)
    (folder,) = os.listdir(empty)
    assert step_dirs(empty / folder) == ["6"]
    with pytest.raises(ValueError, match="selects no checkpoint.*an average needs at least one"):
        jn.Nitro(Ranked(), run_dir=empty, weights=jn.Average(jn.Last(3)))
    # that checkpoint (an epoch's end, interrupted before validation) is one a run can continue from
    resumed = jn.Nitro(Ranked(), run_dir=empty, resume="auto", logger=None)
    assert (resumed.step, resumed.epoch) == (6, 1)
    assert "checkpoint step 6 (epoch 1, saved as the run ended interrupted)" in resumed.plan.weights_from


def test_no_checkpoint_plugin_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXNITRO_DISABLE_PLUGINS", "orbax")
    jn.reload_plugins()
    try:
        with pytest.raises(ValueError, match=r"no loaded plugin reads checkpoints.*orbax.*disabled by JAXNITRO_DISABLE_PLUGINS: orbax"):
            jn.Nitro(Tiny(), run_dir=tmp_path, weights=("latest", "best"))
    finally:
        monkeypatch.delenv("JAXNITRO_DISABLE_PLUGINS")
        jn.reload_plugins()


# -- resume -------------------------------------------------------------------------------


def test_resume_continues_bitwise(ran, tmp_path):
    straight, _, _ = ran
    first = jn.train(Ranked(), run_dir=tmp_path, max_epochs=3, checkpointer=jn.Checkpointer(keep=jn.Last(1)))
    resumed = jn.Nitro(Ranked(), run_dir=tmp_path, resume="auto", max_epochs=6,
                       checkpointer=jn.Checkpointer(keep=jn.Last(1)))
    assert (resumed.step, resumed.epoch) == (18, 3)
    assert resumed.plan.resumed.run_folder == first.run_dir and resumed.plan.resumed.continue_folder
    assert "resumed from checkpoint step 18 (epoch 3)" in repr(resumed)
    resumed.train()
    assert same(resumed.params, straight.params) and same(resumed.opt_state, straight.opt_state)
    assert resumed.rows == straight.rows[3:]


def test_resume_variants(ran, tmp_path):
    _, rec, root = ran
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fresh = jn.Nitro(Ranked(), run_dir=tmp_path, resume="auto")
    assert fresh.step == 0 and any("found no checkpoint to continue" in str(w.message) for w in caught)
    best = jn.Nitro(Ranked(), run_dir=root, resume="auto", restore_best=True)
    assert (best.step, best.epoch) == (6, 1) and same(best.params, rec.params[1])
    assert not best.plan.resumed.continue_folder  # an earlier checkpoint: the run branches
    fresh_opt = jn.Nitro(Ranked(), run_dir=root, resume="auto", restore_optimizer=False)
    assert fresh_opt.step == 36 and same(fresh_opt.params, rec.params[6])
    assert int(jax.tree_util.tree_leaves(fresh_opt.opt_state)[0]) == 0  # a fresh optimizer count
    assert "fresh optimizer state" in fresh_opt.plan.weights_from


# -- L2-SP ---------------------------------------------------------------------------------


@jn.experiment
class Decayed(Tiny):
    """A zero gradient and a strong decay: only the decoupled decay moves the params."""

    anchored: tuple = ("encoder",)
    "The groups whose decay pulls toward w0 (Host)."

    def loss(self, logits, *, label):
        return 0.0 * logits.sum()

    def weight_decay(self, group):
        return 50.0  # x lr 1e-2: each step pulls half way to the anchor

    def param_group(self, keypath):
        return "encoder" if keypath[0] == "l1" else "head"

    def decay_anchor(self, group):
        return "w0" if group in self.anchored else ("zero" if group != "bad" else "w1")


TRAIN_ONLY = {"train": tiny_data()["train"]}  # no validation: nothing but the train step compiles


def test_decay_anchor_w0_pulls_toward_the_initial_weights(tmp_path):
    init = jax.tree_util.tree_map(np.asarray, jn.Nitro(Decayed(), data=TRAIN_ONLY, run_dir=tmp_path).params)
    n = jn.train(Decayed(), data=TRAIN_ONLY, run_dir=tmp_path, max_epochs=1, logger=None)
    np.testing.assert_array_equal(n.params.l1.weight, init.l1.weight)  # at its anchor: nothing moves
    np.testing.assert_allclose(n.params.l2.weight, init.l2.weight * 0.5**SPE, rtol=1e-5)  # toward zero
    groups = repr(n)
    assert "w0 (build_model)" in groups and "zero" in groups


def test_w0_weights_anchors_to_the_transferred_weights(tmp_path):
    e = Decayed(anchored=("encoder", "head"))
    donor = jn.Nitro(Tiny(), seed=1, data=TRAIN_ONLY, run_dir=tmp_path, logger=None)
    init = jn.Nitro(e, data=TRAIN_ONLY, run_dir=tmp_path, logger=None).params
    theirs = jax.tree_util.tree_map(np.asarray, donor.params)
    anchored = jn.train(e, data=TRAIN_ONLY, run_dir=tmp_path, max_epochs=1, logger=None, weights=donor, w0="weights")
    assert same(anchored.params, theirs)
    assert "w0 (warm start from a Tiny handle" in repr(anchored)
    pulled = jn.train(e, data=TRAIN_ONLY, run_dir=tmp_path, max_epochs=1, logger=None, weights=donor)
    expected = jax.tree_util.tree_map(lambda t, i: i + (t - i) * 0.5**SPE, theirs, init)
    for got, want in zip(leaves(pulled.params), leaves(expected), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_a_bad_decay_anchor_names_the_group(tmp_path):
    @jn.experiment
    class BadAnchor(Decayed):
        def param_group(self, keypath):
            return "bad"

    with pytest.raises(ValueError, match=r"`decay_anchor` returned 'w1' for group `bad`"):
        jn.Nitro(BadAnchor(anchored=()), data=TRAIN_ONLY, run_dir=tmp_path)


# -- EMA ---------------------------------------------------------------------------------------


def test_ema_is_updated_in_the_train_step_and_checkpointed(tmp_path):
    from jaxnitro.weights import EMA

    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        EMA(decay=1.5)
    with pytest.raises(ValueError, match=r"run knob `ema` = 'yes'"):
        jn.Nitro(Tiny(), run_dir=tmp_path, ema="yes")
    data = {"train": tiny_data()["train"][:1]}  # one step per epoch, no validation
    start = jn.Nitro(Ranked(), data=data, run_dir=tmp_path, ema=EMA(decay=0.5))
    init = jax.tree_util.tree_map(np.asarray, start.params)
    n, rec = train(Ranked(), data=data, run_dir=tmp_path, max_epochs=4, ema=EMA(decay=0.5),
                   checkpointer=jn.Checkpointer(keep=jn.Last(1)))
    ema = init
    for epoch in range(1, 5):
        ema = jax.tree_util.tree_map(lambda e, p: e + 0.5 * (p - e), ema, rec.params[epoch])
    for got, want in zip(leaves(n.state.ema), leaves(ema), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    assert "EMA of the params (decay 0.5)" in repr(n)
    # the checkpoint holds it: weights= takes the EMA weights, resume restores both
    loaded = jn.Nitro(Ranked(), data=data, run_dir=tmp_path, weights=("latest", "last"))
    assert same(loaded.params, n.state.ema) and "its EMA weights" in loaded.plan.weights_from
    resumed = jn.Nitro(Ranked(), data=data, run_dir=tmp_path, resume="auto", ema=EMA(decay=0.5))
    assert same(resumed.params, n.params) and same(resumed.state.ema, n.state.ema)
    # `ema` turned off (or on) at the resume: refused as the optimizer change it is (the average was
    # dropped, or restarted, silently); restore_optimizer=False takes a fresh optimizer state
    with pytest.raises(ValueError, match=r"saved with an EMA of the parameters and this handle has none: `ema` "
                                         r"changed since.*restore_optimizer=False"):
        jn.Nitro(Ranked(), data=data, run_dir=tmp_path, resume="auto")
    assert jn.Nitro(Ranked(), data=data, run_dir=tmp_path, resume="auto", restore_optimizer=False).step == 4
    plain = tmp_path / "plain"
    jn.train(Ranked(), data=data, run_dir=plain, max_epochs=1, checkpointer=jn.Checkpointer(keep=jn.Last(1)))
    with pytest.raises(ValueError, match=r"saved without an EMA of the parameters and this handle has one"):
        jn.Nitro(Ranked(), data=data, run_dir=plain, resume="auto", ema=EMA(decay=0.5))
    # another decay is an input of the same program: nothing compiles
    jn.train(Ranked(), data=data, run_dir=tmp_path, max_epochs=1, ema=EMA(decay=0.9), logger=None)
    misses = jn.cache_stats().misses
    jn.train(Ranked(), data=data, run_dir=tmp_path, max_epochs=1, ema=EMA(decay=0.99), logger=None)
    assert jn.cache_stats().misses == misses


# -- with the loop and handle changes this plugin asks for (enabled once they land) -----------

from jaxnitro import trainer as _trainer  # noqa: E402

_LOOP_CHANGE = pytest.mark.skipif(
    not hasattr(_trainer, "run_folder_of"),
    reason="needs trainer.run_folder_of (a resumed run continues its folder) and "
    "history(resumed_from=...) in the handle",
)
_EVAL_CHANGE = pytest.mark.skipif(
    "EMA" not in jn.__all__, reason="needs jn.EMA and evaluation/predict/nitro.model on state.eval_params"
)


@_LOOP_CHANGE
def test_resume_continues_the_run_folder_log_and_history(ran, tmp_path):
    from jaxnitro.loggers.jsonl import read_jsonl

    straight, _, _ = ran
    first = jn.train(Ranked(), run_dir=tmp_path, max_epochs=3, checkpointer=jn.Checkpointer(keep=jn.Last(1)))
    resumed = jn.train(Ranked(), run_dir=tmp_path, resume="auto", max_epochs=6,
                       checkpointer=jn.Checkpointer(keep=jn.Last(1)))
    assert resumed.run_dir == first.run_dir and os.listdir(tmp_path) == [os.path.basename(first.run_dir)]
    assert same(resumed.params, straight.params)
    lines = read_jsonl(os.path.join(first.run_dir, "metrics.jsonl"))
    assert [x["step"] for x in lines if x.get("context") == "train"] == list(range(1, 37))
    assert step_dirs(first.run_dir) == ["36"]
    h = resumed.history()
    assert h.resumed_from == 3 and list(h.epoch) == [4, 5, 6] and "resumed from epoch 3" in str(h)


@_EVAL_CHANGE
def test_validation_predict_and_model_use_the_ema(tmp_path):
    import equinox as eqx

    data = tiny_data()
    n = jn.train(Ranked(), data=data, run_dir=tmp_path, max_epochs=2, ema=jn.EMA(decay=0.9), logger=None)
    assert same(eqx.partition(n.model, eqx.is_inexact_array)[0], n.state.ema)
    x = data["val"][0]["x"]
    np.testing.assert_allclose(n.predict({"x": x}), jax.vmap(n.model)(x), rtol=1e-5)
    raw = jn.Nitro(Ranked(), data=data, run_dir=tmp_path, weights=n)  # a warm start takes the raw params
    assert not np.allclose(n.predict({"x": x}), raw.predict({"x": x}))
    assert n.rows[-1]["loss"] == n.validate()["loss"]


def test_a_resumed_run_keeps_its_earlier_best_checkpoints(tmp_path):
    """Checkpoints saved by the earlier process keep their rank: the resumed run's saves
    prune by the whole run's metrics (orbax itself keeps metrics in memory only)."""
    keep = jn.Checkpointer(keep=(jn.Best(2), jn.Last(1)))
    first = jn.train(Ranked(), run_dir=tmp_path, max_epochs=4, checkpointer=keep, logger=None)
    by_step = {r["step"]: r["loss"] for r in first.rows}
    resumed = jn.train(Ranked(), run_dir=tmp_path, resume="auto", max_epochs=6, checkpointer=keep, logger=None)
    by_step.update({r["step"]: r["loss"] for r in resumed.rows})
    best_two = sorted(by_step, key=by_step.get, reverse=True)[:2]  # monitor ("loss", "max")
    assert sorted(int(s) for s in step_dirs(first.run_dir)) == sorted(set(best_two) | {36})
