"""The grain adapter (plugin ``grain_loader``): ``jn.GrainSource`` and ``jn.GrainStream``.

A batched ``grain.MapDataset`` becomes index-addressable (several ordered producers, bitwise
reproducible); an ``IterDataset`` / ``DataLoader`` is iterated by one producer and says so.
Skipped, with the reason, when grain is not installed (``pip install jaxnitro[grain]``).
"""

from __future__ import annotations

import importlib.util
import sys

import jax
import numpy as np
import pytest

import jaxnitro as jn
import jaxnitro.exports
from jaxnitro.batches import wrap_split
from jaxnitro.plugin_manager import plugin_manager
from jaxnitro.plugins import grain_loader as mod
from tiny import Tiny, assert_parts_make_the_batches, make_arrays, tiny_data

NAME = "grain_loader"


@pytest.fixture
def grain():
    return pytest.importorskip("grain", reason="grain is not installed (pip install jaxnitro[grain])")


class Rows:
    """A grain random-access source: one dict record per row."""

    def __init__(self, n=96, seed=0):
        self.x, self.y, self.oh = make_arrays(n, seed)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"x": self.x[i], "label": self.oh[i], "y": self.y[i], "row": np.int64(i)}


def pipeline(grain, n=96, seed=3, batch=16, drop=True):
    ds = grain.MapDataset.source(Rows(n)).seed(seed).shuffle()
    ds = ds.random_map(lambda r, rng: {**r, "noise": rng.normal(size=2).astype(np.float32)})
    return ds.map(lambda r: {**r, "x": r["x"] * 2}).batch(batch, drop_remainder=drop)


def rows_of(src, epoch):
    src.begin_epoch(epoch)
    return np.concatenate([src.batch_at(i)["row"] for i in range(len(src))])


def test_exports(grain):
    assert jn.GrainSource is mod.GrainSource and jn.GrainStream is mod.GrainStream


def test_map_dataset_becomes_index_addressable(grain):
    ds = pipeline(grain)
    wrapped = wrap_split(ds, "train")
    assert isinstance(wrapped.source, mod.GrainSource)
    assert wrapped.addressable and wrapped.info()["path"].startswith("batch_at")
    assert len(wrapped) == 6
    for epoch in (0, 1, 3):
        jn.check_batch_at(wrapped.source, epoch=epoch)


def test_batch_reads_equal_grains_own_reads(grain):
    """The batched read (one _getitems per batch) gives exactly ds[e * len + i]."""
    ds = pipeline(grain, n=90, drop=False)  # a partial final batch too
    src = mod.GrainSource(ds)
    assert mod._batched_read(ds) is not None
    for epoch in (0, 2):
        src.begin_epoch(epoch)
        for i in range(len(src)):
            got, want = src.batch_at(i), ds[epoch * len(ds) + i]
            assert set(got) == set(want)
            assert all(np.array_equal(got[k], want[k]) for k in want)
    # a pipeline that does not end in .batch is read with ds[index]
    mapped = ds.map(lambda b: {**b, "extra": b["y"] + 1})
    assert mod._batched_read(mapped) is None
    other = mod.GrainSource(mapped)
    other.begin_epoch(2)
    assert np.array_equal(other.batch_at(1)["row"], mapped[2 * len(mapped) + 1]["row"])


def test_each_epoch_reshuffled_and_reproducible(grain):
    a, b = mod.GrainSource(pipeline(grain)), mod.GrainSource(pipeline(grain))
    e1, e2 = rows_of(a, 1), rows_of(a, 2)
    assert sorted(e1) == list(range(96)) and not np.array_equal(e1, e2)
    assert np.array_equal(rows_of(b, 1), e1) and np.array_equal(rows_of(b, 2), e2)
    assert not np.array_equal(rows_of(mod.GrainSource(pipeline(grain, seed=4)), 1), e1)
    assert [len(bt["y"]) for bt in a] == [16] * 6  # iteration: the current epoch (2)
    assert np.array_equal(np.concatenate([bt["row"] for bt in a]), e2)


def train_params(tmp_path, grain, workers, name):
    val = grain.MapDataset.source(Rows(40, seed=1)).batch(16)
    data = {
        "train": jn.PrefetchIterator(mod.GrainSource(pipeline(grain)), workers=workers),
        "val": jn.PrefetchIterator(mod.GrainSource(val), workers=workers),
    }
    n = jn.train(Tiny(max_epochs=3), data=data, logger=None, run_dir=str(tmp_path / name), seed=2)
    assert n.data["train"].info()["workers"] == workers
    return [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(n.params)]


def test_training_bitwise_equal_at_1_and_3_workers(tmp_path, grain):
    one, three = train_params(tmp_path, grain, 1, "one"), train_params(tmp_path, grain, 3, "three")
    assert all(np.array_equal(a, b) for a, b in zip(one, three))


def test_records_are_refused_naming_batch(grain):
    records = grain.MapDataset.source(Rows()).seed(0).shuffle()
    with pytest.raises(TypeError, match=r"split `train` is a grain.MapDataset of single records.*\.batch\("):
        wrap_split(records, "train")
    with pytest.raises(TypeError, match="batch_size"):
        mod.GrainSource(records)
    src = mod.GrainSource(records, batch_size=16, drop_last=True, workers=2)
    assert len(src) == 6 and src.prefetch_workers == 2
    jn.check_batch_at(src, epoch=1)


def test_tuple_elements_need_fields(grain):
    ds = grain.MapDataset.source(Rows()).map(lambda r: (r["x"], r["label"])).batch(16)
    with pytest.raises(TypeError, match=r"tuple of 2, not a dict.*fields=\('x', 'label'\)"):
        mod.GrainSource(ds).batch_at(0)
    src = mod.GrainSource(ds, fields=("x", "label"))
    assert sorted(src.batch_at(0)) == ["label", "x"]
    with pytest.raises(ValueError, match="2 parts but fields"):
        mod.GrainSource(ds, fields=("x",)).batch_at(0)


def test_endless_map_dataset_refused(grain):
    with pytest.raises(ValueError, match="endless"):
        mod.GrainSource(grain.MapDataset.source(Rows()).batch(16).repeat())


def test_iter_dataset_is_iterated_by_one_producer(tmp_path, grain):
    it = grain.MapDataset.source(Rows()).to_iter_dataset().batch(16, drop_remainder=True)
    wrapped = wrap_split(it, "train")
    src = wrapped.source
    assert isinstance(src, mod.GrainStream) and not wrapped.addressable
    assert wrapped.info()["path"] == "iterate, 1 producer" and len(src) == 6
    assert "not index-addressable, 1 producer" in src.prefetch_note
    rows = [b["row"] for b in src]
    assert np.array_equal(np.concatenate(rows), np.arange(96))
    assert np.array_equal(np.concatenate([b["row"] for b in src]), np.arange(96))  # a fresh pass
    n = jn.train(Tiny(max_epochs=1), data={"train": it}, logger=None, run_dir=str(tmp_path))
    assert n.state.step == 6


def test_iter_length_inferred_only_when_certain(grain):
    base = grain.MapDataset.source(Rows(90))
    assert len(mod.GrainStream(base.to_iter_dataset().batch(16))) == 6
    assert len(mod.GrainStream(base.to_iter_dataset().map(lambda r: r).batch(16, drop_remainder=True))) == 5
    filtered = base.filter(lambda r: r["y"] > 0).to_iter_dataset().batch(16)
    # not certain: a stream without len() (a run bounded by max_steps trains it), no refusal
    wrapped = wrap_split(filtered, "train")
    assert isinstance(wrapped.source, mod.GrainStream) and not wrapped.sized and not wrapped.addressable
    with pytest.raises(TypeError, match=r"stream without len\(\).*max_steps.*batches_per_epoch=N"):
        len(wrapped.source)
    assert repr(wrapped.source) == "GrainStream(IterDataset, a stream without len(): each epoch one pass of grain's iterator)"
    assert "no len(): each epoch is a pass of a fresh iterator" in wrapped.source.prefetch_note
    whole = [len(b["y"]) for b in wrapped.source]  # the whole pass, partial last batch too
    assert sum(whole) == sum(int(Rows(90)[i]["y"]) > 0 for i in range(90)) and whole[:-1] == [16] * (len(whole) - 1)
    src = mod.GrainStream(filtered, batches_per_epoch=2)
    assert len(src) == 2 and len(list(src)) == 2  # the first 2 batches of each pass


def test_data_loader(grain):
    loader = grain.DataLoader(
        data_source=Rows(),
        sampler=grain.samplers.IndexSampler(96, shuffle=True, seed=0, num_epochs=1,
                                            shard_options=grain.sharding.NoSharding()),
        operations=[grain.transforms.Batch(16, drop_remainder=True)],
        worker_count=0,
    )
    src = wrap_split(loader, "train").source
    assert isinstance(src, mod.GrainStream) and len(src) == 6 and src.kind == "DataLoader"
    first = np.concatenate([b["row"] for b in src])
    assert sorted(first) == list(range(96)) and np.array_equal(np.concatenate([b["row"] for b in src]), first)
    endless = grain.DataLoader(
        data_source=Rows(), sampler=grain.samplers.IndexSampler(96, shard_options=grain.sharding.NoSharding()),
        operations=[grain.transforms.Batch(16)], worker_count=0,
    )
    with pytest.raises(TypeError, match="stream without len.*batches_per_epoch"):  # endless: no len()
        len(mod.GrainStream(endless))
    assert len(list(mod.GrainStream(endless, batches_per_epoch=8))) == 8


KEEP_ROWS = 85  # of Rows(96): a filter keeps these, 5 full batches of 16 a pass


def keep(r) -> bool:
    return bool(r["y"] != 0 or r["x"][1] > 0)


def filtered_pipeline(grain, where: str):
    """A grain IterDataset whose batches per pass the pipeline does not make certain: a
    filter of records (5 batches a pass) or of whole batches (as many as it keeps)."""
    ds = grain.MapDataset.source(Rows()).to_iter_dataset()
    if where == "records":
        ds = ds.filter(keep)
    ds = ds.map(lambda r: {k: r[k] for k in ("x", "label", "y")}).batch(16, drop_remainder=True)
    return ds.filter(lambda b: b["y"][0] != 1) if where == "batches" else ds


@pytest.mark.parametrize("where", ["records", "batches"])
def test_a_filtered_iter_dataset_trains_by_steps_like_the_same_batches(tmp_path, grain, where):
    """It was refused even with max_steps ("has no len() ... batches_per_epoch=N"), though a
    plain stream of the same batches trains: now a stream without len(), each pass an epoch."""
    from test_long_runs import _Stream, assert_same_state

    same = list(filtered_pipeline(grain, where))  # the batches one pass yields
    assert 1 < len(same) < 6 and (where != "records" or len(same) == KEEP_ROWS // 16)
    val = grain.MapDataset.source(Rows(40, seed=1)).map(lambda r: {k: r[k] for k in ("x", "label", "y")}).batch(16)
    kw = dict(max_steps=12, max_epochs=None, logger=None, seed=2)

    def run(train, name):
        return jn.train(Tiny(), data={"train": train, "val": val}, run_dir=str(tmp_path / name), **kw)

    runs = {
        "bare": run(filtered_pipeline(grain, where), "bare"),
        "wrapped": run(jn.GrainStream(filtered_pipeline(grain, where)), "wrapped"),
        "stream": run(_Stream(same), "stream"),
    }
    listed = run(same, "list")  # the same batches with a len()
    n = len(same)
    want = [(e, e * n) for e in range(1, 12 // n + 1)] + ([(12 // n + 1, 12)] if 12 % n else [])
    assert [(r["epoch"], r["step"]) for r in listed.rows] == want and len(want) > 2
    assert not runs["bare"].data["train"].sized and isinstance(runs["bare"].data["train"].source, mod.GrainStream)
    for name, got in runs.items():
        assert got.step == 12, name
        assert got.rows == listed.rows, name
        assert_same_state(got, listed)


def test_a_filtered_iter_dataset_without_max_steps_is_refused_naming_max_steps(tmp_path, grain):
    data = {"train": filtered_pipeline(grain, "records")}
    # Tiny's max_epochs (2) cannot bound a stream: setup names max_steps, not grain's length
    with pytest.raises(ValueError, match=r"the `train` split is a stream without len\(\) \(GrainStream\).*"
                                         r"Pass `max_steps=N`"):
        jn.Nitro(Tiny(), data=data, run_dir=tmp_path, logger=None)
    with pytest.raises(ValueError, match=r"max_epochs=2 .*cannot bound the run: the `train` split is a stream "
                                         r"without len\(\) \(GrainStream\).*batches_per_epoch=N"):
        jn.Nitro(Tiny(), data=data, run_dir=tmp_path, logger=None, max_steps=12)
    # batches_per_epoch gives it a len(): epochs bound the run again
    sized = jn.GrainStream(filtered_pipeline(grain, "records"), batches_per_epoch=5)
    assert jn.train(Tiny(), data={"train": sized}, run_dir=tmp_path, logger=None).step == 10


def test_a_filtered_iter_dataset_resumes_mid_epoch_from_its_iterator_state(tmp_path, grain):
    """Stopped mid-epoch 2 (a checkpoint every 4 steps, preempted) and resumed with
    resume="auto": bitwise the uninterrupted run, grain's iterator state restored (nothing
    read again, no warning)."""
    from test_stream_state import Records, no_reread_warning, stop_resume_compare

    records = {}

    def make(at):
        records[at] = Records(at)
        serial = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)  # records read in order
        train = grain.MapDataset.source(records[at]).to_iter_dataset(serial).filter(keep).batch(16, drop_remainder=True)
        return {"train": train, "val": tiny_data()["val"]}

    def reads_from_here(data):  # setup read the first batch (its width): count the run's reads only
        records[0].read.clear()

    kept = [i for i in range(96) if keep(Records()[i])]
    assert len(kept) == KEEP_ROWS  # Records' rows are Rows(96)'s: 5 batches a pass
    # preempted while epoch 2's third batch is read (setup read ~18 records, epoch 1 all 96)
    _, resumed, data, record = stop_resume_compare(tmp_path, make, at=18 + 96 + 40, before_train=reads_from_here)
    assert not resumed.data["train"].sized
    start = resumed.plan.resumed.step
    assert 5 < start < 10, start  # mid-epoch 2
    saved = resumed.plan.weights_meta["data_position"]["stream_state"]
    assert saved["source"] == "jaxnitro.plugins.grain_loader.GrainStream"
    nxt = kept[(start - 5) * 16 - 1] + 1  # after the last trained batch's last kept record
    assert saved["state"] == {"batches": start - 5, "iterator": {"next_index": nxt}}
    no_reread_warning(record)
    assert records[0].read[: 96 - nxt] == list(range(nxt, 96))  # nothing read again


def test_not_ours_returns_none(grain):
    assert mod.jaxnitro_adapt_source(source=[{"x": np.zeros(2)}], split="train") is None


def test_module_loads_and_answers_none_without_grain(monkeypatch):
    """With grain absent the module imports, registers and adapts nothing."""
    monkeypatch.setitem(sys.modules, "grain", None)  # `import grain` now raises ImportError
    spec = importlib.util.spec_from_file_location("grain_loader_without_grain", mod.__file__)
    fresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fresh)
    pm = plugin_manager()
    pm.register(fresh, name="grain_loader_without_grain")
    try:
        assert fresh.jaxnitro_adapt_source(source=object(), split="train") is None
        with pytest.raises(ImportError, match=r"jaxnitro\[grain\]"):
            fresh.GrainSource(object())
    finally:
        pm.unregister(name="grain_loader_without_grain")


@pytest.mark.parametrize("n,drop", [(96, True), (90, False)])
def test_for_process_parts_make_the_whole_batch(grain, n, drop):
    """Of each batch, process p keeps the p-th half: the halves put together are the batch; a
    last batch of 10 rows (90 = 5 x 16 + 10) gives process 1 rows 8..9, not a batch fewer;
    a partial batch of under 8 rows would."""
    whole = mod.GrainSource(pipeline(grain, n=n, drop=drop))
    parts = [whole.for_process(p, 2) for p in range(2)]
    assert [len(q) for q in parts] == [6, 6]
    assert_parts_make_the_batches(whole, parts, "row", epochs=(0, 2))
    assert "process=1 of 2" in repr(parts[1]) and parts[0].for_process(0, 2) is parts[0]
    short = mod.GrainSource(pipeline(grain, n=84, drop=False))  # last batch: 4 rows, all process 0's
    assert [len(short.for_process(p, 2)) for p in range(2)] == [6, 5]
    with pytest.raises(ValueError, match=r"GrainSource: batch_size=16 does not divide among 3 processes"):
        whole.for_process(0, 3)
    with pytest.raises(ValueError, match="already reads for process 1 of 2"):
        parts[1].for_process(0, 4)
