"""Nothing silent about the data (issue 23, items 1, 2, 3 and 20).

1. A foreign loader wrapped by the user (``jn.PrefetchIterator(loader, workers=3)``) is
   adapted like an unwrapped one: a torch ``DataLoader`` trains, a grain ``MapDataset``
   reads grain's own order for each epoch.
2. The run's ``seed`` governs the order of a source built without its own seed
   (``bind_seed``); an explicit seed wins; a fixed seed stays bitwise reproducible at any
   worker count.
3. A source whose ``len()`` disagrees with its batches is said to be one, naming the split,
   ``len()`` and the batches seen, in every position (train at k = 1 and 2, val, test, predict,
   setup) and behind every wrapper: one claiming batches it does not have, one hiding a full
   batch past ``len()`` (found by the check one past the end), a torch or grain dataset whose
   ``__len__`` hides data; a source's error (a torch dataset's in ``val`` too) names its split.
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


# -- 3 (cont.). len() one short of the batches: the check one past the end --------------------------

WRAPS = {
    "default": lambda s: s,
    "workers=0": lambda s: jn.PrefetchIterator(s, workers=0),
    "workers=3": lambda s: jn.PrefetchIterator(s, workers=3),
    "workers=3, unordered": lambda s: jn.PrefetchIterator(s, workers=3, ordered=False),
    "NoPrefetch": lambda s: jn.NoPrefetch(s),
}


def short_by_one(n_real):
    """An addressable source over ``n_real`` full batches whose len() says one fewer."""
    return Addressable(tiny_data(n_train=16 * n_real)["train"], length=n_real - 1)


@pytest.mark.parametrize("wrap", list(WRAPS))
def test_addressable_len_one_short_is_refused_at_the_end_of_a_pass(tmp_path, wrap):
    """The `test` split is not read at setup: the pass over it (serial, or the prefetch plugin's
    ordered or unordered producers) reads batch_at(len()) after its last batch and finds a full one."""
    d = tiny_data()
    nitro = jn.train(Tiny(max_epochs=1), data={"train": d["train"], "test": WRAPS[wrap](short_by_one(3))},
                     logger=None, run_dir=str(tmp_path))
    with pytest.raises(SourceLengthError) as err:
        nitro.evaluate("test")
    msg = str(err.value)
    assert ("the `test` split's len() is 2, but batch_at(2), one past its last batch, returned a full batch "
            "(16 rows, as wide as its batch of 16) in epoch 0") in msg
    assert "at least 3 batches exist" in msg and "make batch_at raise IndexError for i >= len()" in msg
    assert (err.value.split, err.value.length, err.value.count) == ("test", 2, 3)


@pytest.mark.parametrize("split", ["train", "val"])
def test_addressable_len_one_short_is_refused_at_setup(split):
    d = tiny_data()
    data = {"train": short_by_one(6)} if split == "train" else {"train": d["train"], "val": short_by_one(3)}
    n = 5 if split == "train" else 2
    with pytest.raises(SourceLengthError, match=re.escape(
            f"the `{split}` split's len() is {n}, but batch_at({n}), one past its last batch, returned a "
            f"full batch (16 rows, as wide as its batch of 16) in epoch {1 if split == 'train' else 0} "
            f"(setup's check of its last batch)")):
        jn.Nitro(Tiny(), data=data, logger=None)


def test_addressable_len_one_short_is_refused_at_the_epochs_end_with_steps_per_dispatch(tmp_path):
    """k = 2 over a source whose batch_at(len()) is full only from epoch 1 on (setup reads
    epoch 1): the pass of epoch 2 finds it, after its steps were dispatched in blocks."""
    batches = tiny_data()["train"]

    class GrowsInEpoch2(Addressable):
        def begin_epoch(self, epoch):
            self.length = 6 if epoch < 2 else 5

    with pytest.raises(SourceLengthError, match=r"the `train` split's len\(\) is 5, but batch_at\(5\).* in epoch 2"):
        jn.train(Tiny(max_epochs=2), data={"train": GrowsInEpoch2(batches)}, logger=None,
                 run_dir=str(tmp_path), steps_per_dispatch=2)


def test_a_partial_or_empty_batch_past_len_is_not_refused(tmp_path):
    """A source whose len() drops a partial remainder (batch_at(len()) slices it) or whose
    batch_at slices past its rows (an empty batch) keeps the contract."""
    x, y, oh = make_arrays(100)

    class Sliced:
        def __len__(self):
            return 100 // 16  # the 4-row remainder is dropped

        def begin_epoch(self, epoch):
            pass

        def batch_at(self, i):
            s = slice(16 * i, 16 * (i + 1))
            return {"x": x[s], "label": oh[s], "y": y[s]}

    assert len(Sliced().batch_at(6)["x"]) == 4 and len(Sliced().batch_at(7)["x"]) == 0
    n = jn.train(Tiny(max_epochs=2), data={"train": Sliced(), "test": Sliced()}, logger=None, run_dir=str(tmp_path))
    assert n.state.step == 12 and np.isfinite(n.evaluate("test")["loss"])


@pytest.mark.parametrize("split", ["train k=2", "val", "test"])
def test_iterated_source_with_a_len_one_short_is_refused_in_each_position(tmp_path, split):
    d = tiny_data()

    class Iterated:
        def __init__(self, batches):
            self.batches = batches

        def __len__(self):
            return len(self.batches) - 1

        def __iter__(self):
            return iter(self.batches)

    name = split.split()[0]
    data = {"train": Iterated(d["train"])} if name == "train" else {"train": d["train"], name: Iterated(d["val"])}
    n = 5 if name == "train" else 2
    said = re.escape(f"the `{name}` split yielded more than its len() of {n} batches (batch {n} arrived)")
    with pytest.raises(SourceLengthError, match=said):
        nitro = jn.train(Tiny(max_epochs=1), data=data, logger=None, run_dir=str(tmp_path),
                         steps_per_dispatch=2 if name == "train" else 1)
        nitro.evaluate("test")


def test_predict_over_an_addressable_source_with_a_len_one_short_is_refused():
    d = tiny_data()
    nitro = jn.Nitro(Tiny(), data=d, logger=None)
    out = nitro.predict(short_by_one(3))
    next(out), next(out)  # its 2 batches are predicted; then the check one past the end
    with pytest.raises(SourceLengthError, match=r"the `predict` split's len\(\) is 2, but batch_at\(2\)"):
        next(out)


def test_check_batch_at_refuses_a_full_batch_past_len():
    with pytest.raises(ValueError, match=re.escape(
            "len(source) is 5, but batch_at(5), one past its last batch, returned a full batch (16 rows")):
        jn.check_batch_at(Addressable(tiny_data()["train"], length=5))
    jn.check_batch_at(Addressable(tiny_data()["train"]))


def lying_rows(n_rows, claimed):
    """Rows ``0..n_rows - 1`` of x/label/y; ``__len__`` says ``claimed``; IndexError past the rows."""
    x, y, oh = make_arrays(n_rows)

    class Rows:
        def __len__(self):
            return claimed

        def __getitem__(self, i):
            return {"x": x[i], "label": oh[i], "y": y[i]}

    return Rows


def test_torch_dataset_whose_len_hides_samples_is_refused_naming_the_split(tmp_path, torch):
    Rows = lying_rows(48, 32)
    Dataset = type("Rows", (Rows, torch.utils.data.Dataset), {})
    loader = torch.utils.data.DataLoader(Dataset(), batch_size=16)
    with pytest.raises(SourceLengthError) as err:
        jn.train(Tiny(max_epochs=1), data={"train": tiny_data()["train"], "val": loader}, logger=None,
                 run_dir=str(tmp_path))
    msg = str(err.value)
    assert ("the `val` split's len() is 2, but its DataLoader's dataset (Rows) still serves samples at and "
            "past its __len__ of 32 (dataset[32] returned one)") in msg
    assert "(epoch 0 (setup's check of its last batch))" in msg and "more than the 2 batches len() counts" in msg
    assert "make the dataset's __len__ return the number of samples __getitem__ serves" in msg
    # a bounded dataset, and one whose batch_size=None batches are empty past its len, pass
    ok = torch.utils.data.DataLoader(type("Rows", (lying_rows(48, 48), torch.utils.data.Dataset), {})(), batch_size=16)
    x = make_arrays(48)[0]

    class Chunks(torch.utils.data.Dataset):
        def __len__(self):
            return 3

        def __getitem__(self, i):
            return {"x": x[16 * i:16 * (i + 1)]}

    for loader in (ok, torch.utils.data.DataLoader(Chunks(), batch_size=None)):
        src = jn.NoPrefetch(loader)
        assert sum(1 for _ in src.epoch(0)) == 3


def test_grain_source_whose_len_hides_records_is_refused_naming_the_split(tmp_path, grain):
    ds = grain.MapDataset.source(lying_rows(96, 80)()).batch(16, drop_remainder=True)
    with pytest.raises(SourceLengthError, match=re.escape(
            "the `train` split's len() is 5, but its grain pipeline's data source (Rows) still serves a "
            "record at its __len__ of 80 (source[80] returned one), while grain reads it modulo that length")):
        jn.train(Tiny(max_epochs=1), data={"train": ds}, logger=None, run_dir=str(tmp_path))
    bounded = grain.MapDataset.source(lying_rows(96, 96)()).batch(16, drop_remainder=True)
    assert sum(1 for _ in jn.NoPrefetch(bounded).epoch(0)) == 6


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
