"""The torch adapter (plugin ``torch_loader``): ``jn.TorchSource`` and ``jn.TorchStream``.

A ``DataLoader`` over a map-style dataset becomes index-addressable (its plan rebuilt per
epoch from its settings; bitwise reproducible at any worker count); an iterable-style one is
iterated by one producer and says so; options that have no effect warn, naming the option.
Tests that need torch are skipped, with the reason, when it is not installed
(``pip install jaxnitro[torch]``); the module itself loads without it.
"""

from __future__ import annotations

import importlib.util
import itertools
import sys
import warnings

import jax
import numpy as np
import pytest

import jaxnitro as jn
import jaxnitro.exports
from jaxnitro.batches import wrap_split
from jaxnitro.plugin_manager import plugin_manager
from jaxnitro.plugins import torch_loader as mod
from tiny import Tiny, assert_parts_make_the_batches, make_arrays, tiny_data

NAME = "torch_loader"


@pytest.fixture
def torch():
    return pytest.importorskip("torch", reason="torch is not installed (pip install jaxnitro[torch])")


def rows_dataset(torch, n=96, seed=0):
    """A map-style dataset of dict samples (tensors), with the row index."""
    x, y, oh = make_arrays(n, seed)

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return n

        def __getitem__(self, i):
            return {"x": torch.from_numpy(x[i]), "label": torch.from_numpy(oh[i]), "y": int(y[i]), "row": i}

    return Rows()


def loader(torch, n=96, seed=0, **kw):
    kw.setdefault("batch_size", 16)
    return torch.utils.data.DataLoader(rows_dataset(torch, n, seed), **kw)


def rows_of(src, epoch):
    src.begin_epoch(epoch)
    return np.concatenate([src.batch_at(i)["row"] for i in range(len(src))])


def test_exports(torch):
    assert jn.TorchSource is mod.TorchSource and jn.TorchStream is mod.TorchStream


def test_map_style_loader_becomes_index_addressable(torch):
    g = torch.Generator().manual_seed(5)
    wrapped = wrap_split(loader(torch, shuffle=True, drop_last=True, generator=g), "train")
    src = wrapped.source
    assert isinstance(src, mod.TorchSource) and wrapped.addressable
    assert (len(src), src.batch_size, src.drop_last, src.seed) == (6, 16, True, 5)
    assert src.prefetch_workers == 0 and wrapped.info()["path"] == "synchronous"  # num_workers=0
    for epoch in (0, 1, 4):
        jn.check_batch_at(src, epoch=epoch)
    b = src.batch_at(0)
    assert b["x"].dtype == np.float32 and b["x"].shape == (16, 8) and b["y"].dtype == np.int64


def test_epoch_order_per_epoch_reproducible_and_seeded(torch):
    def make(gen_seed, **kw):
        return mod.TorchSource(loader(torch, shuffle=True, generator=torch.Generator().manual_seed(gen_seed)), **kw)

    a, b = make(1), make(1)
    e1, e2 = rows_of(a, 1), rows_of(a, 2)
    assert sorted(e1) == list(range(96)) and not np.array_equal(e1, e2)
    assert np.array_equal(rows_of(b, 1), e1) and np.array_equal(rows_of(b, 2), e2)
    assert not np.array_equal(rows_of(make(2), 1), e1)  # the generator's seed is the seed
    assert np.array_equal(rows_of(make(2, seed=1), 1), e1)  # seed= overrides it
    unseeded = mod.TorchSource(loader(torch, shuffle=True))
    assert unseeded.seed == mod.DEFAULT_SEED
    assert np.array_equal(rows_of(unseeded, 3), rows_of(mod.TorchSource(loader(torch, shuffle=True)), 3))
    plain = mod.TorchSource(loader(torch, n=40))  # SequentialSampler, partial last batch kept
    assert np.array_equal(rows_of(plain, 7), np.arange(40)) and len(plain) == 3


def test_samplers_rebuilt(torch):
    data = torch.utils.data
    ds = rows_dataset(torch)
    subset = data.DataLoader(ds, batch_size=8, sampler=data.SubsetRandomSampler(range(10, 50)))
    src = mod.TorchSource(subset)
    assert len(src) == 5 and sorted(rows_of(src, 1)) == list(range(10, 50))
    repl = data.DataLoader(ds, batch_size=10, sampler=data.RandomSampler(ds, replacement=True, num_samples=30))
    got = rows_of(mod.TorchSource(repl), 1)
    assert len(got) == 30 and got.max() < 96
    more = data.DataLoader(ds, batch_size=50, sampler=data.RandomSampler(ds, num_samples=150))
    got = rows_of(mod.TorchSource(more), 2)
    assert sorted(got[:96]) == list(range(96)) and len(got) == 150


def test_getitems_and_no_autobatching_read_without_copies(torch):
    x = torch.arange(96 * 3, dtype=torch.float32).reshape(96, 3)

    class Batched(torch.utils.data.Dataset):
        """Reads a whole batch at once (torch's __getitems__) and collates it itself."""

        def __len__(self):
            return 96

        def __getitems__(self, idx):
            return {"x": x[idx], "row": torch.tensor(idx)}

    src = mod.TorchSource(torch.utils.data.DataLoader(Batched(), batch_size=16, collate_fn=lambda b: b))
    assert np.array_equal(src.batch_at(1)["row"], np.arange(16, 32))

    class Chunks(torch.utils.data.Dataset):
        """batch_size=None: each index is a batch (here a view of the tensor)."""

        def __len__(self):
            return 6

        def __getitem__(self, i):
            return {"x": x[16 * i : 16 * (i + 1)]}

    chunks = mod.TorchSource(torch.utils.data.DataLoader(Chunks(), batch_size=None))
    assert len(chunks) == 6 and chunks.batch_size is None
    got = chunks.batch_at(2)["x"]
    assert np.shares_memory(got, x.numpy()) and np.array_equal(got, x[32:48].numpy())  # no copy
    jn.check_batch_at(chunks)


def test_bfloat16_becomes_a_view(torch):
    t = torch.arange(4, dtype=torch.float32).to(torch.bfloat16)
    a = mod._to_numpy(t)
    assert str(a.dtype) == "bfloat16" and np.array_equal(a.astype(np.float32), [0, 1, 2, 3])


def train_params(tmp_path, torch, workers, name):
    g = torch.Generator().manual_seed(7)
    train = mod.TorchSource(loader(torch, shuffle=True, drop_last=True, generator=g))
    val = mod.TorchSource(loader(torch, n=40, seed=1))
    data = {"train": jn.PrefetchIterator(train, workers=workers), "val": jn.PrefetchIterator(val, workers=workers)}
    n = jn.train(Tiny(max_epochs=3), data=data, logger=None, run_dir=str(tmp_path / name), seed=3)
    assert n.data["train"].info()["workers"] == workers
    return [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(n.params)]


def test_training_bitwise_equal_at_1_and_3_workers(tmp_path, torch):
    one, three = train_params(tmp_path, torch, 1, "one"), train_params(tmp_path, torch, 3, "three")
    assert all(np.array_equal(a, b) for a, b in zip(one, three))


def test_num_workers_become_producer_threads(torch):
    wrapped = wrap_split(loader(torch, num_workers=2), "val")
    assert wrapped.source.prefetch_workers == 2 and wrapped.info()["path"] == "batch_at, 2 producers"


@pytest.mark.parametrize(
    "kwargs, option",
    [
        (dict(pin_memory=True), "pin_memory=True"),
        (dict(num_workers=2, persistent_workers=True), "persistent_workers=True"),
        (dict(num_workers=2, worker_init_fn=print), "worker_init_fn"),
        (dict(num_workers=2, timeout=5), "timeout=5"),
        (dict(num_workers=2, multiprocessing_context="spawn"), "multiprocessing_context"),
        (dict(num_workers=2, in_order=False), "in_order=False"),
    ],
)
def test_ineffective_options_warn_naming_the_option(torch, kwargs, option):
    with pytest.warns(UserWarning, match=rf"DataLoader\({option}\)"):
        mod.TorchSource(loader(torch, **kwargs))


def test_plain_loader_does_not_warn(torch):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mod.TorchSource(loader(torch, shuffle=True, num_workers=2, generator=torch.Generator()))
    assert [str(w.message) for w in caught] == []


def test_tuple_batches_need_fields(torch):
    x, _, oh = make_arrays(96)
    ds = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(oh))
    src = wrap_split(torch.utils.data.DataLoader(ds, batch_size=16), "train").source
    with pytest.raises(TypeError, match=r"list of 2, not a dict.*fields=\('x', 'label'\)"):
        src.batch_at(0)
    named = mod.TorchSource(torch.utils.data.DataLoader(ds, batch_size=16), fields=("x", "label"))
    assert np.array_equal(named.batch_at(1)["label"], oh[16:32])
    jn.check_batch_at(named)


def iterable(torch, n=96, with_len=True):
    x, _, oh = make_arrays(n)

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            for i in range(n):
                yield {"x": x[i], "label": oh[i], "row": i}

    if with_len:
        Stream.__len__ = lambda self: n
    return Stream()


def test_iterable_dataset_is_iterated_by_one_producer(tmp_path, torch):
    dl = torch.utils.data.DataLoader(iterable(torch), batch_size=16)
    wrapped = wrap_split(dl, "train")
    src = wrapped.source
    assert isinstance(src, mod.TorchStream) and not wrapped.addressable
    assert wrapped.info()["path"] == "iterate, 1 producer" and len(src) == 6
    assert "IterableDataset" in src.prefetch_note and "1 producer" in src.prefetch_note
    assert np.array_equal(np.concatenate([b["row"] for b in src]), np.arange(96))
    n = jn.train(Tiny(max_epochs=1), data={"train": dl}, logger=None, run_dir=str(tmp_path))
    assert n.state.step == 6
    with pytest.raises(TypeError, match="cannot make this DataLoader index-addressable: its dataset is an IterableDataset"):
        mod.TorchSource(dl)


def test_iterable_without_len_is_a_stream_without_len(torch):
    """No len(): a stream (each epoch one whole pass of the loader), no refusal; a run bounded
    by max_steps trains it. batches_per_epoch=N still gives it a len()."""
    dl = torch.utils.data.DataLoader(iterable(torch, with_len=False), batch_size=16)
    wrapped = wrap_split(dl, "train")
    assert isinstance(wrapped.source, mod.TorchStream) and not wrapped.sized and not wrapped.addressable
    with pytest.raises(TypeError, match=r"stream without len\(\) \(Stream defines no __len__\).*max_steps.*"
                                        r"batches_per_epoch=N"):
        len(wrapped.source)
    assert repr(wrapped.source) == "TorchStream(Stream, a stream without len(): each epoch one pass of the loader)"
    assert "no len(): each epoch is a pass of iter(loader)" in wrapped.source.prefetch_note
    assert np.array_equal(np.concatenate([b["row"] for b in wrapped.source]), np.arange(96))  # the whole pass
    src = mod.TorchStream(dl, batches_per_epoch=4)
    assert len(src) == 4 and len(list(src)) == 4 and repr(src) == "TorchStream(Stream, 4 batches per epoch)"
    assert "no len()" not in src.prefetch_note


def test_a_sampler_without_len_makes_a_stream_without_len(torch):
    data = torch.utils.data

    class Endless(data.Sampler):
        """Draws indices for ever (no __len__)."""

        def __iter__(self):
            return itertools.cycle(range(96))

    dl = data.DataLoader(rows_dataset(torch), batch_size=16, sampler=Endless())
    src = wrap_split(dl, "train").source
    assert isinstance(src, mod.TorchStream) and "Endless" in src.prefetch_note
    with pytest.raises(TypeError, match=r"stream without len\(\) \(its sampler Endless defines no __len__\)"):
        len(src)
    first = list(itertools.islice(src, 7))  # the pass goes on as long as the sampler does
    assert np.array_equal(np.concatenate([b["row"] for b in first]), np.arange(7 * 16) % 96)


KEEP_ROWS = 85  # of Tiny's 96 train rows: a filter keeps these, 5 full batches of 16 a pass


def keep(row) -> bool:
    return bool(row["y"] != 0 or row["x"][1] > 0)


def filtered(torch, records, stateful: bool = False):
    """A torch IterableDataset without __len__: the ``records`` (Tiny's 96 train rows) that
    :func:`keep` keeps, so its batches per pass are known only when the pass ends. With
    ``stateful``, its ``state_dict`` is its position in the records (the next to read)."""

    class Filtered(torch.utils.data.IterableDataset):
        def __init__(self):
            self.position, self.resume_at = 0, None

        def __iter__(self):
            start, self.resume_at = self.resume_at or 0, None
            for i in range(start, 96):
                row = records[i]
                self.position = i + 1
                if keep(row):
                    yield row

    if stateful:
        Filtered.state_dict = lambda self: {"position": self.position}

        def load_state_dict(self, state):
            self.position = self.resume_at = state["position"]

        Filtered.load_state_dict = load_state_dict
    return Filtered()


class Rows:
    """Tiny's 96 train rows as records (a dict of arrays each)."""

    def __init__(self):
        self.x, self.y, self.oh = make_arrays(96 + 40)

    def __getitem__(self, i):
        return {"x": self.x[i], "label": self.oh[i], "y": self.y[i]}


def filtered_loader(torch, records=None, stateful: bool = False):
    records = Rows() if records is None else records
    return torch.utils.data.DataLoader(filtered(torch, records, stateful), batch_size=16, drop_last=True)


@pytest.mark.parametrize("stateful", [False, True])
def test_a_filtered_iterable_dataset_trains_by_steps_like_the_same_batches(tmp_path, torch, stateful):
    """It was refused even with max_steps ("has no len() ... batches_per_epoch=N"), though a
    plain stream of the same batches trains: now a stream without len(), each pass an epoch."""
    from test_long_runs import _Stream, assert_same_state

    same = list(mod.TorchStream(filtered_loader(torch, stateful=stateful)))  # the batches one pass yields
    assert len(same) == KEEP_ROWS // 16 == 5 and all(len(b["y"]) == 16 for b in same)
    assert sum(keep(Rows()[i]) for i in range(96)) == KEEP_ROWS
    kw = dict(max_steps=12, max_epochs=None, logger=None, seed=2)

    def run(train, name):
        return jn.train(Tiny(), data={"train": train, "val": tiny_data()["val"]}, run_dir=str(tmp_path / name), **kw)

    runs = {
        "bare": run(filtered_loader(torch, stateful=stateful), "bare"),
        "wrapped": run(jn.TorchStream(filtered_loader(torch, stateful=stateful)), "wrapped"),
        "stream": run(_Stream(same), "stream"),
    }
    listed = run(same, "list")  # the same batches with a len()
    assert [(r["epoch"], r["step"]) for r in listed.rows] == [(1, 5), (2, 10), (3, 12)]
    assert not runs["bare"].data["train"].sized and isinstance(runs["bare"].data["train"].source, mod.TorchStream)
    for name, got in runs.items():
        assert got.step == 12, name
        assert got.rows == listed.rows, name
        assert_same_state(got, listed)


def test_a_filtered_iterable_dataset_without_max_steps_is_refused_naming_max_steps(tmp_path, torch):
    data = {"train": filtered_loader(torch)}
    # Tiny's max_epochs (2) cannot bound a stream: setup names max_steps, not the loader's length
    with pytest.raises(ValueError, match=r"the `train` split is a stream without len\(\) \(TorchStream\).*"
                                         r"Pass `max_steps=N`"):
        jn.Nitro(Tiny(), data=data, run_dir=tmp_path, logger=None)
    with pytest.raises(ValueError, match=r"max_epochs=2 .*cannot bound the run: the `train` split is a stream "
                                         r"without len\(\) \(TorchStream\).*batches_per_epoch=N"):
        jn.Nitro(Tiny(), data=data, run_dir=tmp_path, logger=None, max_steps=12)
    # batches_per_epoch gives it a len(): epochs bound the run again
    sized = jn.TorchStream(filtered_loader(torch), batches_per_epoch=5)
    assert jn.train(Tiny(), data={"train": sized}, run_dir=tmp_path, logger=None).step == 10


def test_a_filtered_iterable_dataset_resumes_mid_epoch_from_its_state_dict(tmp_path, torch):
    """Stopped mid-epoch 2 (a checkpoint every 4 steps, preempted) and resumed with
    resume="auto": bitwise the uninterrupted run, the dataset's state_dict loaded (nothing
    read again, no warning)."""
    from test_stream_state import Records, no_reread_warning, stop_resume_compare

    records = {}

    def make(at):
        records[at] = Records(at)
        return {"train": filtered_loader(torch, records[at], stateful=True), "val": tiny_data()["val"]}

    def reads_from_here(data):  # setup read the first batch (its width): count the run's reads only
        records[0].read.clear()

    kept = [i for i in range(96) if keep(Records()[i])]
    assert len(kept) == KEEP_ROWS  # Records' rows are Rows'
    # preempted while epoch 2's third batch is read (setup read ~18 records, epoch 1 all 96)
    _, resumed, data, record = stop_resume_compare(tmp_path, make, at=18 + 96 + 40, before_train=reads_from_here)
    assert not resumed.data["train"].sized and isinstance(resumed.data["train"].source, mod.TorchStream)
    start = resumed.plan.resumed.step
    assert 5 < start < 10, start  # mid-epoch 2
    saved = resumed.plan.weights_meta["data_position"]["stream_state"]
    assert saved["source"] == "jaxnitro.plugins.torch_loader.TorchStream"
    nxt = kept[(start - 5) * 16 - 1] + 1  # after the last trained batch's last kept record
    assert saved["state"] == {"batches": start - 5, "state": {"position": nxt}}
    no_reread_warning(record)
    assert records[0].read[: 96 - nxt] == list(range(nxt, 96))  # nothing read again


def test_custom_sampler_is_iterated_with_a_note(torch):
    data = torch.utils.data
    ds = rows_dataset(torch)
    weighted = data.DataLoader(ds, batch_size=16, sampler=data.WeightedRandomSampler([1.0] * 96, 96,
                                                                                      generator=torch.Generator()))
    src = wrap_split(weighted, "train").source
    assert isinstance(src, mod.TorchStream) and "WeightedRandomSampler" in src.prefetch_note


def test_stream_warnings_name_the_option(torch):
    dl = torch.utils.data.DataLoader(iterable(torch), batch_size=16, num_workers=2)
    with pytest.warns(UserWarning, match=r"DataLoader\(num_workers=2\).*no generator.*stops reproducing"):
        mod.TorchStream(dl)
    with pytest.warns(UserWarning, match=r"DataLoader\(pin_memory=True\)"):
        mod.TorchStream(torch.utils.data.DataLoader(iterable(torch), batch_size=16, pin_memory=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mod.TorchStream(torch.utils.data.DataLoader(iterable(torch), batch_size=16, num_workers=2,
                                                    generator=torch.Generator().manual_seed(0)))


def test_not_ours_returns_none(torch):
    assert mod.jaxnitro_adapt_source(source=[{"x": np.zeros(2)}], split="train") is None
    assert mod.jaxnitro_adapt_source(source=rows_dataset(torch), split="train") is None  # a Dataset


def test_module_loads_and_answers_none_without_torch(monkeypatch):
    """With torch absent the module imports, registers and adapts nothing (no torch needed)."""
    for name in [m for m in sys.modules if m == "torch" or m.startswith("torch.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now raises ImportError
    spec = importlib.util.spec_from_file_location("torch_loader_without_torch", mod.__file__)
    fresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fresh)
    pm = plugin_manager()
    pm.register(fresh, name="torch_loader_without_torch")
    try:
        assert fresh.jaxnitro_adapt_source(source=object(), split="train") is None
        with pytest.raises(ImportError, match=r"jaxnitro\[torch\]"):
            fresh.TorchSource(object())
    finally:
        pm.unregister(name="torch_loader_without_torch")


def test_for_process_reads_only_its_part_of_each_batch(torch):
    """Of each batch process p fetches only the p-th half of the rows; the halves put together
    are the one-process batch. A last batch of 4 rows (84 = 5 x 16 + 4) is all process 0's."""
    fetched = []

    class Counting(torch.utils.data.Dataset):
        def __init__(self):
            self.inner = rows_dataset(torch, 84)

        def __len__(self):
            return len(self.inner)

        def __getitem__(self, i):
            fetched.append(i)
            return self.inner[i]

    def make():
        return mod.TorchSource(torch.utils.data.DataLoader(Counting(), batch_size=16, shuffle=True), seed=5)

    whole = make()
    parts = [make().for_process(p, 2) for p in range(2)]
    assert [len(q) for q in parts] == [6, 5] and len(whole) == 6
    assert_parts_make_the_batches(whole, parts, "row")
    fetched.clear()
    parts[1].batch_at(0)
    assert len(fetched) == 8  # its half only
    assert "process=1 of 2" in repr(parts[1])
    with pytest.raises(ValueError, match=r"TorchSource: batch_size=16 does not divide among 3 processes"):
        make().for_process(0, 3)
    with pytest.raises(ValueError, match=r"batch_size=None .* cannot be split among processes"):
        mod.TorchSource(torch.utils.data.DataLoader(Counting(), batch_size=None)).for_process(0, 2)
