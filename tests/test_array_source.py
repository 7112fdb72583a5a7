"""``jn.ArraySource`` (plugin ``array_source``): batches from arrays in memory or memory-mapped.

Index-addressable with a per-epoch permutation from ``(seed, epoch)``; ``check_batch_at``
passes; training is bitwise equal at 1 and 3 producer threads; a memory-mapped field is
read batch by batch.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jaxnitro as jn
import jaxnitro.exports
from jaxnitro.plugins import array_source as mod
from tiny import Tiny, make_arrays


def fields(n=100, seed=0):
    x, y, oh = make_arrays(n, seed)
    return {"x": x, "label": oh, "y": y}


def test_exported_as_jn_array_source():
    assert jn.ArraySource is mod.ArraySource
    assert "ArraySource" in dir(jn)


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
def test_check_batch_at_passes(shuffle, drop_last):
    src = jn.ArraySource(fields(100), batch_size=16, shuffle=shuffle, drop_last=drop_last)
    assert len(src) == (6 if drop_last else 7)
    for epoch in (0, 1, 5):
        jn.check_batch_at(src, epoch=epoch)
    src.begin_epoch(1)
    last = src.batch_at(len(src) - 1)
    assert len(last["x"]) == (16 if drop_last else 4)
    with pytest.raises(IndexError, match="batch 7 out of range"):
        src.batch_at(7)


def rows_read(src, epoch):
    src.begin_epoch(epoch)
    return np.concatenate([src.batch_at(i)["y_row"] for i in range(len(src))])


def test_permutation_per_epoch_and_reproducible():
    f = {"y_row": np.arange(100), "x": np.zeros((100, 3), np.float32)}
    a = jn.ArraySource(f, batch_size=10, shuffle=True, drop_last=True, seed=7)
    b = jn.ArraySource(f, batch_size=10, shuffle=True, drop_last=True, seed=7)
    e1, e2 = rows_read(a, 1), rows_read(a, 2)
    assert sorted(e1) == list(range(100)) and not np.array_equal(e1, e2)  # a new order each epoch
    assert np.array_equal(rows_read(b, 1), e1) and np.array_equal(rows_read(b, 2), e2)  # same across runs
    assert not np.array_equal(rows_read(jn.ArraySource(f, batch_size=10, shuffle=True, seed=8), 1), e1)
    assert np.array_equal(a.order(1), e1)
    # each batch's rows ascending (a forward read), the batch composition the permutation's
    perm = np.random.default_rng((7, 1)).permutation(100).reshape(10, 10)
    assert np.array_equal(e1.reshape(10, 10), np.sort(perm, axis=1))
    assert a.epoch == 2


def test_default_seed_is_the_documented_constant():
    f = {"y_row": np.arange(50)}
    src = jn.ArraySource(f, batch_size=5, shuffle=True)
    assert src.seed == mod.DEFAULT_SEED == 0
    assert np.array_equal(rows_read(src, 3), rows_read(jn.ArraySource(f, batch_size=5, shuffle=True, seed=0), 3))


def test_unshuffled_reads_slices_and_keeps_partial_batch():
    f = fields(40)
    src = jn.ArraySource(f, batch_size=16)
    assert src.prefetch_workers == 0
    b = src.batch_at(2)
    assert np.array_equal(b["x"], f["x"][32:40]) and np.shares_memory(b["x"], f["x"])  # a view
    assert [len(b["y"]) for b in src] == [16, 16, 8]


def test_memory_mapped_fields_stream_batch_by_batch(tmp_path):
    f = fields(100)
    for k, a in f.items():
        np.save(tmp_path / f"{k}.npy", a)
    mm = {k: np.load(tmp_path / f"{k}.npy", mmap_mode="r") for k in f}
    disk = jn.ArraySource(mm, batch_size=16, shuffle=True, drop_last=True, seed=3)
    ram = jn.ArraySource(f, batch_size=16, shuffle=True, drop_last=True, seed=3)
    assert disk.mapped == ("x", "label", "y") and not hasattr(disk, "prefetch_workers")
    assert "mmap" in repr(disk)
    jn.check_batch_at(disk, epoch=2)
    for epoch in (1, 2):
        disk.begin_epoch(epoch), ram.begin_epoch(epoch)
        for i in range(len(disk)):
            got = disk.batch_at(i)
            assert all(type(v) is np.ndarray and not mod._is_mapped(v) for v in got.values())
            for k in f:
                assert np.array_equal(got[k], ram.batch_at(i)[k])
    # unshuffled: a copied slice, not a view of the file
    plain = jn.ArraySource(mm, batch_size=16)
    assert not mod._is_mapped(plain.batch_at(1)["x"])
    assert np.array_equal(plain.batch_at(1)["x"], f["x"][16:32])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(fields={}), "non-empty dict"),
        (dict(fields={"x": np.zeros((4, 2)), "y": np.zeros(3)}), "field 'y' has 3 rows but field 'x' has 4"),
        (dict(fields={"x": np.float32(1.0)}), "field 'x' is a scalar"),
        (dict(batch_size=0), "batch_size must be an int >= 1"),
        (dict(seed=-1), "seed must be an int >= 0"),
        (dict(batch_size=200, drop_last=True), "make no batch"),
    ],
)
def test_refusals_name_the_problem(kwargs, match):
    args = dict(fields=fields(100), batch_size=10)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        jn.ArraySource(args.pop("fields"), **args)


def test_flags_must_be_booleans():
    with pytest.raises(TypeError, match="shuffle and drop_last must be True or False"):
        jn.ArraySource(fields(100), 10, shuffle=1)


def train_params(tmp_path, workers, name):
    x, y, oh = make_arrays(136)
    train = jn.ArraySource({"x": x[:96], "label": oh[:96], "y": y[:96]}, 16, shuffle=True, drop_last=True, seed=5)
    val = jn.ArraySource({"x": x[96:], "label": oh[96:], "y": y[96:]}, 16)
    data = {"train": jn.PrefetchIterator(train, workers=workers), "val": jn.PrefetchIterator(val, workers=workers)}
    n = jn.train(Tiny(max_epochs=3), data=data, logger=None, run_dir=str(tmp_path / name), seed=11)
    assert n.data["train"].info()["workers"] == workers
    return [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(n.params)]


def test_training_bitwise_equal_at_1_and_3_workers(tmp_path):
    one, three = train_params(tmp_path, 1, "one"), train_params(tmp_path, 3, "three")
    assert len(one) == len(three) and all(np.array_equal(a, b) for a, b in zip(one, three))


def test_default_wrapping_produces_in_the_consumer_thread(tmp_path):
    """Built from build_data, an in-memory ArraySource runs synchronously (prefetch_workers = 0)."""
    x, _, oh = make_arrays(96)

    class Arrays(Tiny):
        def build_data(self, dist):
            return {"train": jn.ArraySource({"x": x, "label": oh}, 16, shuffle=True, drop_last=True)}

    n = jn.Nitro(jn.experiment(Arrays)(), logger=None, run_dir=str(tmp_path))
    assert n.data["train"].info()["path"] == "synchronous"


def test_columns_are_aligned_once_and_used_in_place_on_the_cpu():
    """``columns()`` gives C-contiguous, 64-byte aligned arrays (copied on the first call when
    they are not, then kept, and batches read the same arrays); the CPU backend's device
    array of such a column is the host buffer itself: a run after the first copies nothing."""
    from jaxnitro.blocks import ALIGN, ColumnBlocks, aligned

    if jax.default_backend() != "cpu":
        pytest.skip("the fields are aligned for the CPU backend only (an accelerator copies them anyway)")

    f = fields(64)
    src = jn.ArraySource({"x": f["x"][:, ::2], "y": f["y"]}, batch_size=8, shuffle=True, drop_last=True, seed=1)
    before = src.batch_at(3)
    first = src.columns()
    assert all(a.flags.c_contiguous and a.ctypes.data % ALIGN == 0 for a in first.values())
    np.testing.assert_array_equal(first["x"], f["x"][:, ::2])  # a copy of the strided field, same values
    second = src.columns()
    assert all(second[k] is first[k] for k in first)  # copied once
    np.testing.assert_array_equal(src.batch_at(3)["x"], before["x"])
    assert aligned(first["x"]) is first["x"]
    blocks = ColumnBlocks.of(src, ["x", "y"], k=2, accum=1, keyed=False, sharded=False)
    assert blocks.device["x"].unsafe_buffer_pointer() == first["x"].ctypes.data
