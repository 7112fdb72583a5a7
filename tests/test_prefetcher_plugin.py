"""Prefetch is a plugin behind ``jaxnitro_make_prefetcher``: a third-party prefetcher replaces the
built-in ``PrefetchIterator``, and with the ``prefetch`` plugin disabled the core's serial
``NoPrefetch`` (the fallback) trains to the same parameters, in the consumer's thread."""

from __future__ import annotations

import textwrap
import threading

import jax
import numpy as np
import pytest

import jaxnitro as jn
import jaxnitro.plugin as P
from jaxnitro import hookcalls
from plugin_dist import installed_plugin
from tiny import Tiny, make_arrays, tiny_data

THIRD_PARTY = textwrap.dedent(
    '''
    """A third-party prefetcher: reads each split serially and counts the batches it serves."""
    from jaxnitro.plugin import hookimpl

    ASKED = []    # (split, source type) per hook call
    SERVED = {}   # split -> batches delivered
    MODE = ["count"]


    class CountingPrefetcher:
        """The Prefetcher shape, built from nothing of jaxnitro's."""

        split = None

        def __init__(self, source):
            self.source = source
            self.sized = True

        def __len__(self):
            return len(self.source)

        def epoch(self, epoch, transfer=None, start=0):
            def one_pass():
                src = self.source
                if isinstance(src, (list, tuple)):
                    get = src.__getitem__
                else:
                    src.begin_epoch(epoch)
                    get = src.batch_at
                for i in range(start, len(src)):
                    batch = get(i)
                    SERVED[self.split] = SERVED.get(self.split, 0) + 1
                    yield batch if transfer is None else transfer(batch)
            return one_pass()

        def release(self):
            pass

        def info(self):
            return {"path": "counting, serial", "workers": 0, "device_batches": 0, "host_batches": 0}


    @hookimpl
    def jaxnitro_make_prefetcher(source, split):
        ASKED.append((split, type(source).__name__))
        if MODE[0] == "off":
            return None
        if MODE[0] == "broken":
            return object()
        return CountingPrefetcher(source)
    '''
)


@pytest.fixture
def third_party(tmp_path):
    with installed_plugin(tmp_path / "site", module="jaxnitro_prefetch_testplugin", source=THIRD_PARTY,
                          dist="jaxnitro-prefetch-test", entry="prefetch_test", version="1.0") as plugin:
        yield plugin


class Shuffled:
    """Index-addressable, reshuffled per epoch; records the threads that read it."""

    def __init__(self):
        self.x, _, self.y = make_arrays(96)
        self.order = np.arange(96)
        self.threads = set()

    def __len__(self):
        return 6

    def begin_epoch(self, epoch):
        self.order = np.random.default_rng(epoch).permutation(96)

    def batch_at(self, i):
        self.threads.add(threading.current_thread().name)
        idx = self.order[i * 16:(i + 1) * 16]
        return {"x": self.x[idx], "label": self.y[idx]}


def leaves(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def same(a, b) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def built_in_run(tmp_path, data=None):
    n = jn.train(Tiny(max_epochs=2), data=data if data is not None else tiny_data(), run_dir=tmp_path,
                 logger=None)
    assert isinstance(n.data["train"], jn.PrefetchIterator)
    return n


def test_a_third_party_prefetcher_replaces_the_built_in(tmp_path, third_party, monkeypatch):
    from jaxnitro.plugins.prefetch import workers

    monkeypatch.setattr(workers, "_default_cpus", lambda: 4)  # the built-in runs 4 producer threads
    source = Shuffled()
    n = jn.train(Tiny(max_epochs=2), data={"train": source, "val": tiny_data()["val"]}, run_dir=tmp_path,
                 logger=None)
    assert {s: type(w).__name__ for s, w in n.data.items()} == {"train": "CountingPrefetcher", "val": "CountingPrefetcher"}
    assert third_party.ASKED == [("train", "Shuffled"), ("val", "list")]  # once per split, at setup; never per batch
    # it served every batch the run read: 2 epochs of 6 train batches, 2 validations of 3 val batches
    assert third_party.SERVED == {"train": 12, "val": 6}
    assert source.threads == {threading.current_thread().name}
    assert n.data["train"].info()["path"] == "counting, serial"

    text = str(n)  # print(nitro): who answered the hook, for each split
    mine = "plugin prefetch_test (jaxnitro-prefetch-test 1.0)"
    for split in ("train", "val"):
        (line,) = [ln for ln in text.splitlines() if f"jaxnitro_make_prefetcher(split='{split}')" in ln]
        assert mine in line, line
    answered = {p.name: p.answered for p in jn.plugins_info()}
    assert "jaxnitro_make_prefetcher(split='train')" in answered["prefetch_test"]
    assert "jaxnitro_make_prefetcher(split='train')" not in answered["prefetch"]
    assert "jaxnitro_make_prefetcher" not in hookcalls.OBSERVED  # recorded because it is a firstresult hook

    third_party.MODE[0] = "off"  # it answers None: the built-in (trylast) is asked next
    built_in = built_in_run(tmp_path, {"train": Shuffled(), "val": tiny_data()["val"]})
    assert built_in.data["train"].info()["path"] == "batch_at, 4 producers"
    assert third_party.SERVED == {"train": 12, "val": 6}  # nothing more through the third party
    assert same(leaves(n.params), leaves(built_in.params))  # bitwise: the same batches in the same order
    assert n.history()[-1]["loss"] == built_in.history()[-1]["loss"]
    (answer,) = [a for a in P.answers_for(built_in) if a.question == "split='train'"]
    assert (answer.hook, answer.plugin) == ("jaxnitro_make_prefetcher", "prefetch")


def test_a_prefetcher_answer_without_the_members_is_refused_naming_the_plugin(tmp_path, third_party):
    third_party.MODE[0] = "broken"
    with pytest.raises(TypeError) as err:
        jn.Nitro(Tiny(), data=tiny_data(), run_dir=tmp_path, logger=None)
    msg = str(err.value)
    assert "plugin `prefetch_test` answered jaxnitro_make_prefetcher for split `train` with an instance of object" in msg
    assert "lacks source, sized, split, __len__, epoch, release, info" in msg
    assert "jaxnitro.plugin.Prefetcher" in msg and "or None" in msg


def test_without_a_third_party_the_built_in_answers_every_split(tmp_path):
    n = built_in_run(tmp_path)
    answers = {a.question: a.plugin for a in P.answers_for(n) if a.hook == "jaxnitro_make_prefetcher"}
    assert answers == {"split='train'": "prefetch", "split='val'": "prefetch"}
    assert isinstance(n.data["train"], P.Prefetcher) and isinstance(jn.NoPrefetch([{"x": 1}]), P.Prefetcher)


def test_with_the_prefetch_plugin_disabled_a_run_trains_serially_to_the_same_parameters(tmp_path, monkeypatch):
    from jaxnitro.plugins.prefetch import workers

    monkeypatch.setattr(workers, "_default_cpus", lambda: 4)  # the built-in runs 4 producer threads
    source = Shuffled()
    built_in = built_in_run(tmp_path, {"train": source, "val": tiny_data()["val"]})
    assert built_in.data["train"].info()["path"] == "batch_at, 4 producers"
    assert any(t.startswith("jaxnitro-prefetch-") for t in source.threads)

    monkeypatch.setenv("JAXNITRO_DISABLE_PLUGINS", "prefetch")
    jn.reload_plugins()
    try:
        assert "prefetch" not in [p.name for p in jn.plugins_info()]
        serial_source = Shuffled()
        n = jn.train(Tiny(max_epochs=2), data={"train": serial_source, "val": tiny_data()["val"]},
                     run_dir=tmp_path, logger=None)
        assert n.status == "done" and n.step == 12
        assert type(n.data["train"]) is jn.NoPrefetch and type(n.data["val"]) is jn.NoPrefetch
        assert n.data["train"].info()["path"] == "none (NoPrefetch)"
        assert serial_source.threads == {threading.current_thread().name}  # read in the consumer's thread
        assert same(leaves(n.params), leaves(built_in.params))  # bitwise: same batches, same order
        assert n.history()[-1]["loss"] == built_in.history()[-1]["loss"]
        assert not [a for a in P.answers_for(n) if a.hook == "jaxnitro_make_prefetcher"]
        with pytest.raises(AttributeError, match="disabled by JAXNITRO_DISABLE_PLUGINS: prefetch"):
            jn.PrefetchIterator  # noqa: B018 - the plugin's export is absent
        assert jn.NoPrefetch is P.NoPrefetch  # the core's own, still there
    finally:
        monkeypatch.delenv("JAXNITRO_DISABLE_PLUGINS")
        jn.reload_plugins()
