"""Nothing silent about the data (issue 23, items 1, 2, 3 and 20).

1. A foreign loader wrapped by the user (``jn.PrefetchIterator(loader, workers=3)``) is
   adapted like an unwrapped one: a torch ``DataLoader`` trains, a grain ``MapDataset``
   reads grain's own order for each epoch.
2. The run's ``seed`` governs the order of a source built without its own seed
   (``bind_seed``); an explicit seed wins; a fixed seed stays bitwise reproducible at any
   worker count.
3. A source whose ``len()`` claims batches it does not have is said to be one, naming the
   split; a source's error names its split.
20. A plain iterable that gets one producer where the default would run several is warned
   about once, at setup, naming the split and ``batch_at``/``begin_epoch``.

Tests that need torch or grain are skipped, with the reason, when it is not installed.
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
import structlog

import jaxnitro as jn
import jaxnitro.exports  # noqa: F401 - jn.ArraySource and the adapters' names
from jaxnitro import PrefetchError, SourceLengthError
from jaxnitro.plugins.prefetch import wrappers as wrappers_mod
from tiny import Tiny, make_arrays, tiny_data


@pytest.fixture
def torch():
    return pytest.importorskip("torch", reason="torch is not installed (pip install jaxnitro[torch])")


@pytest.fixture
def grain():
    return pytest.importorskip("grain", reason="grain is not installed (pip install jaxnitro[grain])")


def columns(n=96, seed=0):
    x, y, oh = make_arrays(n, seed)
    return {"x": x, "label": oh, "y": y, "row": np.arange(n)}


def rows_of(src, epoch):
    src.begin_epoch(epoch)
    return np.concatenate([src.batch_at(i)["row"] for i in range(len(src))])


def params_of(nitro):
    return [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(nitro.params)]


# -- 1. a wrapped foreign loader is adapted ------------------------------------------------------


def torch_rows(torch, n=96):
    x, y, oh = make_arrays(n)

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return n

        def __getitem__(self, i):
            return {"x": torch.from_numpy(x[i]), "label": torch.from_numpy(oh[i]), "y": int(y[i]), "row": i}

    return Rows()


def test_wrapped_torch_loader_is_adapted_and_trains(tmp_path, torch):
    from jaxnitro.plugins.torch_loader import TorchSource

    g = torch.Generator().manual_seed(4)
    loader = torch.utils.data.DataLoader(torch_rows(torch), batch_size=16, shuffle=True, drop_last=True, generator=g)
    wrapped = jn.PrefetchIterator(loader, workers=3)
    assert isinstance(wrapped.source, TorchSource) and wrapped.addressable
    assert wrapped.info()["path"] == "batch_at, 3 producers"
    assert isinstance(jn.NoPrefetch(loader).source, TorchSource)
    batch = next(iter(wrapped.epoch(0)))
    assert isinstance(batch["x"], np.ndarray) and batch["x"].dtype == np.float32  # not a torch.Tensor
    n = jn.train(Tiny(max_epochs=1), data={"train": wrapped}, logger=None, run_dir=str(tmp_path))
    assert n.state.step == 6 and all(np.isfinite(p).all() for p in params_of(n))


def grain_pipeline(grain):
    class Rows:
        def __init__(self):
            self.c = columns()

        def __len__(self):
            return 96

        def __getitem__(self, i):
            return {k: v[i] for k, v in self.c.items()}

    return grain.MapDataset.source(Rows()).shuffle(seed=0).batch(16, drop_remainder=True)


def test_wrapped_grain_map_dataset_reads_grains_order_for_each_epoch(grain):
    from jaxnitro.plugins.grain_loader import GrainSource

    ds = grain_pipeline(grain)
    wrapped = jn.PrefetchIterator(ds, workers=3)
    assert isinstance(wrapped.source, GrainSource) and wrapped.info()["path"] == "batch_at, 3 producers"
    epochs = [np.concatenate([b["row"] for b in wrapped.epoch(e)]) for e in range(3)]
    for e, got in enumerate(epochs):  # grain's epoch e: indices e * len(ds) + i
        want = np.concatenate([ds[e * len(ds) + i]["row"] for i in range(len(ds))])
        np.testing.assert_array_equal(got, want)
        assert sorted(got) == list(range(96))
    assert not np.array_equal(epochs[0], epochs[1]) and not np.array_equal(epochs[1], epochs[2])


def test_wrapped_grain_records_are_refused_at_the_wrapper(grain):
    records = grain.MapDataset.source(list(range(10)))
    with pytest.raises(TypeError, match=r"this data source is a grain.MapDataset of single records.*\.batch\("):
        jn.PrefetchIterator(records, workers=2)


# -- 2. the run's seed governs an unseeded source's order ------------------------------------------


def array_train(**kw):
    return jn.ArraySource(columns(), batch_size=16, shuffle=True, drop_last=True, **kw)


def read_order(run_seed, **kw):
    n = jn.Nitro(Tiny(), data={"train": array_train(**kw)}, logger=None, seed=run_seed)
    return n.data["train"].source, [rows_of(n.data["train"].source, e) for e in (0, 1)]


def test_run_seed_changes_the_order_of_an_unseeded_array_source():
    src0, zero = read_order(0)
    src1, one = read_order(1)
    assert (src0.seed, src1.seed) == (0, 1) and src1.seed_from == "the run's seed"
    assert not np.array_equal(zero[0], one[0]) and not np.array_equal(zero[1], one[1])
    _, again = read_order(1)
    assert all(np.array_equal(a, b) for a, b in zip(one, again))  # a fixed seed repeats it
    # the default run seed (0) reads what an unbound source reads: DEFAULT_SEED's order
    np.testing.assert_array_equal(zero[1], rows_of(array_train(), 1))


def test_explicit_source_seed_wins_over_the_run_seed():
    src, one = read_order(1, seed=7)
    _, zero = read_order(0, seed=7)
    assert src.seed == 7 and src.seed_from == "seed="
    assert all(np.array_equal(a, b) for a, b in zip(one, zero))


def test_negative_run_seed_is_taken_modulo_2_64():
    src, _ = read_order(-1)
    assert src.seed == 2**64 - 1


def test_bound_seed_is_bitwise_reproducible_at_1_and_3_workers(tmp_path):
    def run(workers):
        data = {"train": jn.PrefetchIterator(array_train(), workers=workers)}
        return params_of(jn.train(Tiny(max_epochs=2), data=data, logger=None, run_dir=str(tmp_path / str(workers)), seed=5))

    one, three = run(1), run(3)
    assert all(np.array_equal(a, b) for a, b in zip(one, three))


def test_run_seed_governs_an_unseeded_torch_loader(torch):
    def order(run_seed, **kw):
        loader = torch.utils.data.DataLoader(torch_rows(torch), batch_size=16, shuffle=True, drop_last=True, **kw)
        n = jn.Nitro(Tiny(), data={"train": loader}, logger=None, seed=run_seed)
        return n.data["train"].source, rows_of(n.data["train"].source, 1)

    src0, zero = order(0)
    src1, one = order(1)
    assert (src0.seed, src1.seed, src1.seed_from) == (0, 1, "the run's seed")
    assert not np.array_equal(zero, one)
    g = lambda: torch.Generator().manual_seed(9)  # noqa: E731 - the generator's seed wins
    a, with_gen = order(1, generator=g())
    _, with_gen0 = order(0, generator=g())
    assert a.seed == 9 and a.seed_from == "generator" and np.array_equal(with_gen, with_gen0)


# -- 3. len() and the batches disagree; errors name the split --------------------------------------


class Addressable:
    """batch_at/begin_epoch over a list, with a len() that may lie and a row that may fail."""

    def __init__(self, batches, length=None, fail_at=None):
        self.batches, self.length, self.fail_at = batches, length, fail_at

    def __len__(self):
        return len(self.batches) if self.length is None else self.length

    def begin_epoch(self, epoch):
        pass

    def batch_at(self, i):
        if i == self.fail_at:
            raise KeyError(f"corrupt record in batch {i}")
        return self.batches[i]


def test_len_claiming_more_batches_is_said_naming_the_split():
    d = tiny_data()
    with pytest.raises(SourceLengthError) as err:
        jn.Nitro(Tiny(), data={"train": Addressable(d["train"], length=7)}, logger=None)
    msg = str(err.value)
    assert "the `train` split's len() is 7, but batch_at(6) raised IndexError" in msg
    assert "len() and the batches disagree" in msg and "Fix: make the source's __len__ return" in msg
    assert isinstance(err.value.__cause__, IndexError) and isinstance(err.value, ValueError)
    with pytest.raises(SourceLengthError, match=r"the `val` split's len\(\) is 5, but batch_at\(4\)"):
        jn.Nitro(Tiny(), data={"train": d["train"], "val": Addressable(d["val"], length=5)}, logger=None)


def test_iterated_source_with_a_lying_len_names_the_split(tmp_path):
    d = tiny_data()

    class Iterated:
        def __init__(self, n):
            self.n = n

        def __len__(self):
            return self.n

        def __iter__(self):
            return iter(d["train"])

    for n, said in ((7, "yielded 6 batches, but its len() is 7"), (5, "yielded more than its len() of 5")):
        with pytest.raises(SourceLengthError, match="the `train` split " + re.escape(said)):
            jn.train(Tiny(max_epochs=1), data={"train": Iterated(n)}, logger=None, run_dir=str(tmp_path / str(n)))


def test_a_val_source_error_names_the_split(tmp_path):
    d = tiny_data()
    data = {"train": d["train"], "val": Addressable(d["val"], fail_at=1)}  # a middle batch: read in the epoch
    with pytest.raises(PrefetchError) as err:
        jn.train(Tiny(max_epochs=1), data=data, logger=None, run_dir=str(tmp_path))
    assert "the `val` split's batch_at(1) raised KeyError for batch 1" in str(err.value)
    assert isinstance(err.value.__cause__, KeyError)
    data = {"train": d["train"], "val": Addressable(d["val"], fail_at=2)}  # the last: read at setup
    with pytest.raises(PrefetchError, match=r"the `val` split's batch_at\(2\) raised KeyError .*setup's read of its last batch"):
        jn.Nitro(Tiny(), data=data, logger=None)


def test_a_torch_dataset_error_in_val_names_the_split(tmp_path, torch):
    x, y, oh = make_arrays(40)

    class Bad(torch.utils.data.Dataset):
        def __len__(self):
            return 40

        def __getitem__(self, i):
            if i == 20:
                raise KeyError(f"bad row {i}")
            return {"x": x[i], "label": oh[i], "y": y[i]}

    data = {"train": tiny_data()["train"], "val": torch.utils.data.DataLoader(Bad(), batch_size=16)}
    with pytest.raises(PrefetchError, match=r"the `val` split's batch_at\(1\) raised KeyError for batch 1"):
        jn.train(Tiny(max_epochs=1), data=data, logger=None, run_dir=str(tmp_path))


# -- 20. one producer where several were meant: said once at setup ---------------------------------


class Plain:
    """A plain iterable of batches: no batch_at/begin_epoch."""

    def __init__(self, batches):
        self.batches = batches

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        return iter(self.batches)


def warnings_at_setup(data):
    with structlog.testing.capture_logs() as logs:
        jn.Nitro(Tiny(), data=data, logger=None)
    return [e for e in logs if e["log_level"] == "warning"]


def test_plain_iterable_is_warned_about_once_at_setup(monkeypatch):
    monkeypatch.setattr(wrappers_mod, "_default_cpus", lambda: 8)
    d = tiny_data()
    said = warnings_at_setup({"train": Plain(d["train"]), "val": d["val"]})
    assert len(said) == 1
    text = " ".join(str(v) for v in said[0].values())
    assert said[0]["split"] == "train" and said[0]["workers_default"] == 4
    for word in ("not index-addressable", "one prefetch producer", "batch_at", "begin_epoch", "check_batch_at"):
        assert word in text
    # no word for a list (a pointer load), for workers=1 (one producer meant), or on one CPU
    assert warnings_at_setup({"train": d["train"]}) == []
    assert warnings_at_setup({"train": jn.PrefetchIterator(Plain(d["train"]), workers=1)}) == []
    monkeypatch.setattr(wrappers_mod, "_default_cpus", lambda: 1)
    assert warnings_at_setup({"train": Plain(d["train"])}) == []


def test_explicit_workers_on_a_plain_iterable_warn_once(monkeypatch):
    monkeypatch.setattr(wrappers_mod, "_default_cpus", lambda: 8)
    d = tiny_data()
    with structlog.testing.capture_logs() as logs:
        n = jn.Nitro(Tiny(), data={"train": jn.PrefetchIterator(Plain(d["train"]), workers=3)}, logger=None)
    said = [e for e in logs if e["log_level"] == "warning"]
    assert len(said) == 1 and said[0]["workers_requested"] == 3
    assert n.data["train"].info()["path"] == "iterate, 1 producer"
