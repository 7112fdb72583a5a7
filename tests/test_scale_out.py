"""Scale-out pieces that run in this (one-device) test process.

The multi-device and multi-process runs themselves need a fresh process each
(the host device count is fixed when JAX starts): ``test_scale_out_multi.py`` (slow).
"""

from __future__ import annotations

import numpy as np
import pytest

import jaxnitro as jn
from jaxnitro.metrics import MetricAccumulator
from tiny import Tiny, assert_parts_make_the_batches, make_arrays, tiny_data


def test_one_device_is_the_default_and_is_not_sharded():
    nitro = jn.Nitro(Tiny(), data=tiny_data(), logger=None)
    assert nitro.settings.n_devs == 1
    assert nitro.plan.dist.n_devs == 1 and not nitro.plan.dist.sharded and not nitro.plan.dist.multi_process
    assert "mesh:" not in repr(nitro)  # no mesh line on one device
    assert "1 device (cpu:0), 1 process; not sharded" == nitro.plan.dist.describe()


def test_n_devs_beyond_the_devices_is_refused_naming_setup_devices():
    with pytest.raises(ValueError) as info:
        jn.Nitro(Tiny(), data=tiny_data(), n_devs=4)
    msg = str(info.value)
    assert "`n_devs` = 4 (keyword), but this job has 1 cpu device(s)" in msg
    assert "jn.setup_devices(4)" in msg and "XLA_FLAGS=--xla_force_host_platform_device_count=4" in msg


@pytest.mark.parametrize("bad", [0, 1.5, "2", True])
def test_n_devs_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match=r"run knob `n_devs` = .* \(keyword\); it must be an integer >= 1"):
        jn.Nitro(Tiny(), data=tiny_data(), n_devs=bad)


def test_setup_devices_after_jax_started_refuses_with_the_reason(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
    with pytest.raises(RuntimeError) as info:
        jn.setup_devices(n_devs=2)
    msg = str(info.value)
    assert "setup_devices(n_devs=2) but this process has 1 cpu device(s)" in msg
    assert "had already started before this call" in msg and "at the top of the script" in msg
    # the flag was set (for a process this one starts), replacing none of the others
    import os

    assert os.environ["XLA_FLAGS"] == "--xla_cpu_enable_fast_math=false --xla_force_host_platform_device_count=2"
    assert len(jn.setup_devices(n_devs=1)) == 1  # what the process has suffices: no error
    with pytest.raises(ValueError, match=r"setup_devices\(n_devs=...\) must be an integer >= 1, got 0"):
        jn.setup_devices(0)


def _fields(n):
    x, y, _ = make_arrays(n)
    return {"x": x, "y": y, "i": np.arange(n)}


@pytest.mark.parametrize("shuffle,drop_last,rows", [(False, False, 50), (True, True, 50), (True, False, 54), (False, True, 48)])
def test_array_source_process_parts_put_together_are_the_batch(shuffle, drop_last, rows):
    whole = jn.ArraySource(_fields(rows), batch_size=8, shuffle=shuffle, drop_last=drop_last, seed=3)
    parts = [whole.for_process(p, 2) for p in range(2)]
    assert [q.process for q in parts] == [(0, 2), (1, 2)]
    assert_parts_make_the_batches(whole, parts, "i", max_rows=4)
    # 50 rows, no drop: the last batch has 2 rows, all process 0's -> process 1 has a batch fewer
    expected = {(False, False, 50): [7, 6], (True, True, 50): [6, 6], (True, False, 54): [7, 7], (False, True, 48): [6, 6]}
    assert [len(q) for q in parts] == expected[(shuffle, drop_last, rows)]
    assert "process=1 of 2" in repr(parts[1])
    assert whole.for_process(0, 1) is whole and parts[0].for_process(0, 2) is parts[0]


def test_array_source_refuses_a_batch_that_does_not_divide_among_processes():
    src = jn.ArraySource(_fields(40), batch_size=10)
    with pytest.raises(ValueError, match=r"batch_size=10 does not divide among 4 processes .* use a multiple of 4, e.g. 8"):
        src.for_process(0, 4)
    with pytest.raises(ValueError, match="already reads for process 1 of 2; split the original source"):
        src.for_process(1, 2).for_process(0, 5)
    with pytest.raises(ValueError, match="process_index 2 is not below process_count 2"):
        src.for_process(2, 2)


def _acc(batches):
    acc = MetricAccumulator()
    for b in batches:
        acc.add(b)
    return acc


def test_metric_shares_merge_as_one_accumulator_would():
    """Per-process accumulators merged in process order equal one accumulator over every batch
    (counted, sum, max, min; concat interleaved batch by batch: the one-process order)."""
    def batch(rows, part):
        return {"acc": (float(np.sum(rows)), len(rows)), "n": (len(rows), "sum"), "top": (float(np.max(rows)), "max"),
                "low": (float(np.min(rows)), "min"), "rows": (rows, "concat"), "part": (part, "concat")}

    data = np.arange(20.0)
    batches = [data[i : i + 4] for i in range(0, 20, 4)]  # 5 batches of 4; each process reads half of each
    one = _acc([batch(b, np.asarray([0])) for b in batches]).result()
    shares = [_acc([batch(b[p * 2 : p * 2 + 2], np.asarray([p])) for b in batches if len(b[p * 2 :])]) for p in (0, 1)]
    merged = MetricAccumulator.merged(shares).result()
    for k in ("acc", "n", "top", "low"):
        assert merged[k] == pytest.approx(one[k])
    np.testing.assert_array_equal(merged["rows"], data)
    np.testing.assert_array_equal(merged["part"], [0, 1] * 5)
    with pytest.raises(ValueError, match="metric `n` has mode 'sum' on one process and 'max' on another"):
        MetricAccumulator.merged([_acc([{"n": (1, "sum")}]), _acc([{"n": (1, "max")}])])


def test_build_data_gets_none_in_one_process():
    seen = []

    class Seen(Tiny):
        def build_data(self, dist):
            seen.append(dist)
            return tiny_data()

    jn.Nitro(jn.experiment(Seen)(), logger=None)
    assert seen == [None]
