"""Tests for jaxnitro.prefetch: ordering, teardown, errors, staging, check_batch_at."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest
import structlog

from jaxnitro import NoPrefetch, PrefetchError
from jaxnitro.plugin import is_addressable
from jaxnitro.plugins.prefetch import PrefetchIterator, check_batch_at


class Source:
    """Index-addressable: shuffled per epoch from (seed, epoch), thread-safe."""

    def __init__(self, n=24, batch=4, jitter=0.0, fail_at=None, seed=0):
        self.n, self.batch, self.jitter, self.fail_at, self.seed = n, batch, jitter, fail_at, seed
        self.data = np.arange(n * batch * 3, dtype=np.float32).reshape(n * batch, 3)
        self.perm = None
        self.calls = 0
        self.lock = threading.Lock()
        self.released = 0

    def __len__(self):
        return self.n

    def begin_epoch(self, epoch):
        self.perm = np.random.default_rng((self.seed, epoch)).permutation(self.n * self.batch)

    def batch_at(self, i):
        with self.lock:
            self.calls += 1
        if self.jitter:
            time.sleep(random.uniform(0, self.jitter))
        if i == self.fail_at:
            raise ValueError("corrupt record")
        if not 0 <= i < self.n:
            raise IndexError(i)
        idx = self.perm[i * self.batch : (i + 1) * self.batch]
        return {"x": self.data[idx], "i": np.full(len(idx), i)}

    def release(self):
        self.released += 1


class Iterated:
    """Not addressable: only iteration and len."""

    def __init__(self, n=10, fail_at=None):
        self.n, self.fail_at = n, fail_at

    def __len__(self):
        return self.n

    def __iter__(self):
        for i in range(self.n):
            if i == self.fail_at:
                raise KeyError("lost shard")
            yield {"x": np.full((2, 3), i, np.float32)}


def producer_threads():
    return [t for t in threading.enumerate() if t.name.startswith("jaxnitro-prefetch")]


def assert_no_producers():
    for t in producer_threads():
        t.join(timeout=1.0)
    assert producer_threads() == []


def as_tuples(batches):
    return [(int(b["i"][0]), b["x"].tobytes()) for b in batches]


@pytest.fixture(autouse=True)
def no_leaked_threads():
    yield
    assert_no_producers()


# -- delivery --------------------------------------------------------------


def test_ordered_identical_at_any_worker_count():
    ref = as_tuples(NoPrefetch(Source()).epoch(3))
    assert [i for i, _ in ref] == list(range(24))
    for workers in (0, 1, 2, 4):
        p = PrefetchIterator(Source(jitter=1e-3), workers=workers)
        assert len(p) == 24
        assert as_tuples(p.epoch(3)) == ref, workers
    # another epoch is another order, identical again across worker counts
    other = as_tuples(PrefetchIterator(Source(), workers=0).epoch(4))
    assert other != ref
    assert as_tuples(PrefetchIterator(Source(jitter=1e-3), workers=3).epoch(4)) == other


def test_unordered_delivers_same_multiset():
    ref = as_tuples(NoPrefetch(Source()).epoch(1))
    for workers in (1, 2, 4):
        p = PrefetchIterator(Source(jitter=1e-3), workers=workers, ordered=False)
        got = as_tuples(p.epoch(1))
        assert sorted(got) == sorted(ref)
        assert p.info()["ordered"] is False


def test_list_source_works_synchronously_by_default():
    batches = [{"x": np.full((2,), k)} for k in range(7)]
    assert is_addressable(batches) and is_addressable(tuple(batches))
    with structlog.testing.capture_logs() as logs:
        p = PrefetchIterator(batches)
    assert logs == []
    assert p.info() == {
        "path": "synchronous", "workers": 0, "device_batches": 1, "host_batches": 0,
        "ordered": True, "addressable": True,
        "note": "a list of batches: the same order every epoch (not reshuffled)",
    }
    assert [int(b["x"][0]) for b in p.epoch(0)] == list(range(7))
    threaded = PrefetchIterator(tuple(batches), workers=2)
    assert [int(b["x"][0]) for b in threaded.epoch(5)] == list(range(7))


def test_iterating_the_wrapper_is_epoch_zero():
    p = PrefetchIterator(Source(), workers=2)
    assert as_tuples(p) == as_tuples(NoPrefetch(Source()).epoch(0))


def test_empty_source():
    assert list(PrefetchIterator(Source(n=0), workers=2).epoch(0)) == []
    assert list(PrefetchIterator([], workers=2).epoch(0, transfer=lambda b: b)) == []


# -- non-addressable sources ---------------------------------------------------


def test_non_addressable_with_several_workers_warns_and_delivers_all():
    with structlog.testing.capture_logs() as logs:
        p = PrefetchIterator(Iterated(), workers=3)
    assert len(logs) == 1 and logs[0]["log_level"] == "warning"
    text = " ".join(str(v) for v in logs[0].values())
    for word in ("batch_at", "begin_epoch", "jaxnitro.check_batch_at"):
        assert word in text
    assert p.info()["path"] == "iterate, 1 producer"
    assert p.info()["workers"] == 1 and p.info()["addressable"] is False
    got = [int(b["x"][0, 0]) for b in p.epoch(0, transfer=lambda b: b)]
    assert got == list(range(10))


def test_non_addressable_default_does_not_warn():
    with structlog.testing.capture_logs() as logs:
        p = PrefetchIterator(Iterated())
        assert [int(b["x"][0, 0]) for b in p.epoch(2)] == list(range(10))
    assert logs == []


# -- teardown ----------------------------------------------------------------


@pytest.mark.parametrize("ordered", [True, False])
def test_early_break_stops_producers(ordered):
    src = Source(n=200, jitter=2e-4)
    p = PrefetchIterator(src, workers=3, ordered=ordered)
    for k, _ in enumerate(p.epoch(0)):
        if k == 2:
            assert producer_threads()  # the stream is running
            break
    assert_no_producers()
    assert src.calls < 200  # producers stopped, they did not run the epoch out


def test_close_and_with_block_and_consumer_error_stop_producers():
    p = PrefetchIterator(Source(n=100), workers=2)
    stream = p.epoch(0)
    next(stream)
    stream.close()
    assert_no_producers()
    with pytest.raises(ZeroDivisionError):
        with p.epoch(1) as batches:
            for _ in batches:
                1 / 0
    assert_no_producers()
    stream = PrefetchIterator(Iterated(n=50), workers=1).epoch(0)
    next(stream)
    del stream
    assert_no_producers()


def test_new_stream_supersedes_open_one():
    p = PrefetchIterator(Source(), workers=2)
    first = p.epoch(0)
    next(first)
    second = p.epoch(1)
    assert_no_producers()  # the first was torn down
    with pytest.raises(RuntimeError, match="new stream"):
        next(first)
    assert len(list(second)) == 24


def test_host_batches_bounds_production():
    src = Source(n=60)
    p = PrefetchIterator(src, workers=2, host_batches=3, device_batches=0)
    for k, _ in enumerate(p.epoch(0)):
        time.sleep(2e-3)  # let producers run ahead as far as allowed
        assert src.calls <= k + 1 + 3
        if k == 10:
            break


# -- errors --------------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 1, 3])
def test_producer_exception_names_index(workers):
    p = PrefetchIterator(Source(fail_at=5, jitter=2e-4), workers=workers)
    seen = []
    with pytest.raises(PrefetchError, match=r"batch_at\(5\)") as info:
        for b in p.epoch(0):
            seen.append(int(b["i"][0]))
    assert seen == [0, 1, 2, 3, 4]  # every earlier batch first: the same step at any worker count
    assert isinstance(info.value.__cause__, ValueError)
    assert info.value.index == 5


@pytest.mark.parametrize("workers", [0, 2])
def test_errors_surface_after_staged_batches(workers):
    """With transfer staging ahead, a failure still surfaces at its own batch."""
    p = PrefetchIterator(Source(fail_at=5), workers=workers, device_batches=2)
    seen = []
    with pytest.raises(PrefetchError, match=r"batch_at\(5\)"):
        for b in p.epoch(0, transfer=dict):
            seen.append(int(b["i"][0]))
    assert seen == [0, 1, 2, 3, 4]

    def transfer(b):
        if int(b["i"][0]) == 3:
            raise OSError("device lost")
        return b

    seen = []
    with pytest.raises(PrefetchError, match="transfer raised OSError for batch 3") as info:
        for b in PrefetchIterator(Source(), workers=workers, device_batches=2).epoch(0, transfer):
            seen.append(int(b["i"][0]))
    assert seen == [0, 1, 2]
    assert isinstance(info.value.__cause__, OSError) and info.value.index == 3


def test_unordered_producer_exception():
    p = PrefetchIterator(Source(fail_at=5), workers=2, ordered=False)
    with pytest.raises(PrefetchError, match="batch 5") as info:
        list(p.epoch(0))
    assert isinstance(info.value.__cause__, ValueError)


@pytest.mark.parametrize("workers", [0, 1])
def test_iterator_exception_names_index(workers):
    p = PrefetchIterator(Iterated(fail_at=4), workers=workers)
    with pytest.raises(PrefetchError, match="batch 4") as info:
        list(p.epoch(0))
    assert isinstance(info.value.__cause__, KeyError)


def test_transfer_exception_names_index():
    def transfer(b):
        if int(b["i"][0]) == 3:
            raise OSError("device lost")
        return b

    for workers in (0, 2):
        with pytest.raises(PrefetchError, match="transfer raised OSError for batch 3") as info:
            list(PrefetchIterator(Source(), workers=workers).epoch(0, transfer))
        assert isinstance(info.value.__cause__, OSError)


def test_bad_arguments():
    for kw in ({"workers": -1}, {"device_batches": -1}, {"host_batches": 0}, {"workers": 1.5}):
        with pytest.raises(ValueError):
            PrefetchIterator(Source(), **kw)
    with pytest.raises(TypeError, match="len"):
        PrefetchIterator(iter([{"x": np.zeros(1)}]))
    with pytest.raises(ValueError, match="epoch"):
        PrefetchIterator(Source()).epoch(-1)


# -- staging -------------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("device_batches", [0, 1, 3])
def test_transfer_runs_device_batches_ahead(workers, device_batches):
    calls = []

    def transfer(b):
        calls.append(int(b["i"][0]))
        return {"staged": b["i"][0]}

    p = PrefetchIterator(Source(n=10), workers=workers, device_batches=device_batches)
    got = []
    for k, b in enumerate(p.epoch(0, transfer)):
        got.append(int(b["staged"]))
        # batch k is being consumed; batches k+1 .. k+device_batches are already transferred
        assert len(calls) == min(10, k + 1 + device_batches)
    assert got == calls == list(range(10))


# -- info, NoPrefetch, release -------------------------------------------------


def test_info_paths():
    assert PrefetchIterator(Source(), workers=2).info() == {
        "path": "batch_at, 2 producers", "workers": 2, "device_batches": 1,
        "host_batches": 4, "ordered": True, "addressable": True, "note": "",
    }
    assert PrefetchIterator(Source(), workers=1, host_batches=7).info()["path"] == "batch_at, 1 producer"
    assert PrefetchIterator(Source(), workers=0).info()["path"] == "synchronous"
    assert PrefetchIterator(Iterated()).info()["path"] == "iterate, 1 producer"
    auto = PrefetchIterator(Source()).info()
    assert auto["path"].startswith("batch_at, ") and 1 <= auto["workers"] <= 4

    class Hinted(Source):
        prefetch_workers = 0

    assert PrefetchIterator(Hinted()).info()["path"] == "synchronous"


def test_no_prefetch():
    src = Source()
    n = NoPrefetch(src)
    assert len(n) == 24
    assert n.info()["path"] == "none (NoPrefetch)"
    seen = []
    out = list(n.epoch(3, transfer=lambda b: seen.append(1) or b))
    assert len(seen) == 24
    assert as_tuples(out) == as_tuples(PrefetchIterator(Source(), workers=2).epoch(3))
    assert [int(b["x"][0, 0]) for b in NoPrefetch(Iterated()).epoch(0)] == list(range(10))
    n.release()
    assert src.released == 1


def test_release_forwards_and_stops_stream():
    src = Source(n=100)
    p = PrefetchIterator(src, workers=2)
    stream = p.epoch(0)
    next(stream)
    p.release()
    assert src.released == 1
    assert_no_producers()
    PrefetchIterator([{"x": np.zeros(1)}]).release()  # no release method: nothing to do


# -- check_batch_at ----------------------------------------------------------------


def test_check_batch_at_accepts_a_good_source():
    assert check_batch_at(Source()) is None
    assert check_batch_at(Source(), epoch=7) is None
    assert check_batch_at([{"x": np.zeros((4, 2))}, {"x": np.ones((3, 2))}]) is None  # short final batch


def test_check_batch_at_missing_method():
    class OnlyBatchAt:
        def __len__(self):
            return 2

        def batch_at(self, i):
            return {"x": np.zeros(2)}

    with pytest.raises(TypeError, match="begin_epoch") as info:
        check_batch_at(OnlyBatchAt())
    assert "batch_at and" not in str(info.value)  # only the missing one is named
    with pytest.raises(TypeError, match="batch_at and begin_epoch"):
        check_batch_at(Iterated())


def test_check_batch_at_catches_nondeterminism():
    class Noisy(Source):
        def batch_at(self, i):
            b = super().batch_at(i)
            if i == 3:
                b["x"] = b["x"] + np.random.random(b["x"].shape).astype(np.float32)
            return b

    with pytest.raises(ValueError, match=r"batch_at\(3\) field 'x'.*deterministic"):
        check_batch_at(Noisy())


def test_check_batch_at_catches_stateful_plan():
    class Drifting(Source):
        def begin_epoch(self, epoch):
            self.perm = np.random.permutation(self.n * self.batch)  # ignores the epoch

    with pytest.raises(ValueError, match="begin_epoch"):
        check_batch_at(Drifting())


def test_check_batch_at_catches_shape_dtype_fields_and_length():
    class Short(Source):
        def __len__(self):
            return self.n + 1  # batch_at(n) raises IndexError

    with pytest.raises(ValueError, match=r"batch_at\(24\).*IndexError"):
        check_batch_at(Short())

    class WideX(Source):
        def batch_at(self, i):
            b = super().batch_at(i)
            if i == 2:
                b["x"] = b["x"].astype(np.float64)
            return b

    with pytest.raises(ValueError, match=r"batch_at\(2\) field 'x': dtype float64"):
        check_batch_at(WideX())
    # only the final batch may be shorter
    with pytest.raises(ValueError, match=r"batch_at\(1\) field 'i': shape \(2,\)"):
        check_batch_at([{"i": np.zeros(4)}, {"i": np.zeros(2)}, {"i": np.zeros(4)}])
    with pytest.raises(ValueError, match=r"batch_at\(1\) field 'i'"):
        check_batch_at([{"x": np.zeros(4), "i": np.zeros(4)}, {"x": np.zeros(4)}])
    with pytest.raises(ValueError, match=r"batch_at\(0\) returned a list"):
        check_batch_at([[np.zeros(4)]])
