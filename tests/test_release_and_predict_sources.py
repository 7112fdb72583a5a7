"""Sources are released once when a run ends (however it ends) and reopen when read again;
``predict`` reads any source in order, adapting foreign loaders through the plugins."""

from __future__ import annotations

import numpy as np
import pytest

import jaxnitro as jn
from jaxnitro.plugin_manager import plugin_manager
from tiny import Tiny, batches, make_arrays, tiny_data


class Counted(list):
    """A list of batches that counts ``release()`` calls and reopens after one."""

    def __init__(self, items):
        super().__init__(items)
        self.released = 0

    def release(self):
        self.released += 1


def counted_data():
    data = tiny_data()
    return {split: Counted(src) for split, src in data.items()}


def released(n):
    return {split: n.data[split].source.released for split in n.data}


def test_done_run_releases_each_split_once_and_they_reopen(tmp_path):
    n = jn.train(Tiny(max_epochs=2), data=counted_data(), run_dir=tmp_path, logger=None)
    assert released(n) == {"train": 1, "val": 1}
    assert np.isfinite(n.validate()["loss"])  # reopened
    again = jn.train(Tiny(max_epochs=1), data=n.data, run_dir=tmp_path, logger=None)
    assert again.status == "done" and released(again) == {"train": 2, "val": 2}


def test_failed_and_interrupted_runs_release_too(tmp_path):
    class Raise:
        def __init__(self, exc):
            self.exc = exc

        @jn.hookimpl
        def jaxnitro_epoch_end(self, run, row):
            raise self.exc

    for exc, status in ((RuntimeError("boom"), "failed"), (KeyboardInterrupt(), "interrupted")):
        plugin = Raise(exc)
        plugin_manager().register(plugin, name="raiser")
        try:
            n = jn.Nitro(Tiny(max_epochs=3), data=counted_data(), run_dir=tmp_path, logger=None)
            with pytest.raises(type(exc)):
                n.train()
        finally:
            plugin_manager().unregister(plugin)
        assert n.status == status and released(n) == {"train": 1, "val": 1}


def test_a_diverged_run_releases(tmp_path):
    x, y, onehot = make_arrays(96)
    x = x.copy()
    x[:16] = np.nan
    data = {"train": Counted(batches(x, y, onehot, 16))}
    with pytest.warns(RuntimeWarning, match="non-finite"):
        n = jn.train(Tiny(max_epochs=2), data=data, run_dir=tmp_path, logger=None)
    assert n.status == "diverged" and released(n) == {"train": 1}


def test_predict_reads_sources_in_order(tmp_path):
    n = jn.train(Tiny(max_epochs=1), data=tiny_data(), run_dir=tmp_path, logger=None)
    x, y, onehot = make_arrays(40, seed=3)
    whole = n.predict({"x": x[:16]})
    source = jn.ArraySource({"x": x, "y": y}, batch_size=16, shuffle=False, drop_last=False)
    outs = list(n.predict(source))
    assert [o.shape for o in outs] == [(16, 4), (16, 4), (8, 4)]  # the last batch padded and sliced back
    assert np.allclose(outs[0], whole)
    gen = list(n.predict({"x": x[i : i + 16]} for i in range(0, 40, 16)))
    assert all(np.allclose(a, b) for a, b in zip(outs, gen))
    with pytest.raises(TypeError, match="a batch dict or a source of them"):
        n.predict(42)


def test_predict_adapts_a_torch_loader(tmp_path):
    torch = pytest.importorskip("torch", reason="the torch adapter needs torch")
    n = jn.train(Tiny(max_epochs=1), data=tiny_data(), run_dir=tmp_path, logger=None)
    x, _, _ = make_arrays(32, seed=4)

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return len(x)

        def __getitem__(self, i):
            return {"x": torch.from_numpy(x[i])}

    loader = torch.utils.data.DataLoader(Rows(), batch_size=16)
    outs = list(n.predict(loader))
    expected = np.concatenate([n.predict({"x": x[:16]}), n.predict({"x": x[16:]})])
    assert len(outs) == 2 and np.allclose(np.concatenate(outs), expected)
