"""Throughput and the memory preflight are plugins (entry points ``throughput`` and ``memory``).

Disabled, a run trains bitwise the same and simply has no throughput figures (no
``throughput`` line, ``nitro.record.throughput`` empty) or no preflight (no
``nitro.plan.memory``); the knob or verb that needs the plugin is refused naming it. A
third-party ``jaxnitro_preflight`` answer replaces the built-in, and its FLOPs reach the
throughput figures through the programs, not through an import between plugins.
"""

from __future__ import annotations

import json
import os
import textwrap

import jax
import numpy as np
import pytest

import jaxnitro as jn
from plugin_dist import installed_plugin
from tiny import fresh_tiny


def contexts(n) -> list[str]:
    return [json.loads(line).get("context") for line in open(os.path.join(n.run_dir, "metrics.jsonl"))]


def same_training(a, b) -> bool:
    leaves = jax.tree_util.tree_leaves
    return a.rows == b.rows and all(np.array_equal(x, y) for x, y in zip(leaves(a.state.params), leaves(b.state.params)))


def test_without_the_throughput_plugin_a_run_trains_the_same_and_has_no_throughput(tmp_path, disabled):
    E = fresh_tiny(samples_per_batch=lambda self: 16)
    with_it = jn.train(E(max_epochs=2), run_dir=tmp_path)
    assert [t["step"] for t in with_it.record.throughput] == [6, 12] and "throughput" in contexts(with_it)
    disabled("throughput")
    without = jn.train(E(max_epochs=2), run_dir=tmp_path)
    assert same_training(with_it, without)
    assert without.record.throughput == [] and "throughput" not in contexts(without)
    assert list(without.history(throughput=True).columns) == list(without.history().columns)
    assert without.plan.memory.flops_per_step > 0  # the preflight is its own plugin
    with pytest.raises(ValueError, match=r"run knob `device_peak_flops` is set \(keyword\) but no loaded plugin "
                                         r"acts on it \(plugins disabled by JAXNITRO_DISABLE_PLUGINS: throughput\)"):
        jn.Nitro(E(), logger=None, device_peak_flops=1e12)


def test_without_the_memory_plugin_runs_start_without_a_preflight(tmp_path, disabled):
    E = fresh_tiny()
    with_it = jn.train(E(max_epochs=1), run_dir=tmp_path, logger=None)
    disabled("memory_preflight")
    without = jn.train(E(max_epochs=1), run_dir=tmp_path, logger=None)
    assert same_training(with_it, without)
    assert without.plan.memory is None and "memory per device" not in str(without)
    t = without.record.throughput[0]
    assert t["steps_per_sec"] > 0 and "flops_per_step" not in t and "mfu" not in t
    with pytest.raises(RuntimeError, match=r"no plugin answers the memory preflight \(hook `jaxnitro_preflight`\) "
                                           r"\(plugins disabled by JAXNITRO_DISABLE_PLUGINS: memory_preflight\)\. Enable the "
                                           r"built-in `memory_preflight` plugin"):
        jn.memory_report(E())
    with pytest.raises(AttributeError, match=r"no attribute 'WontFitError'.*disabled by JAXNITRO_DISABLE_PLUGINS: memory_preflight"):
        jn.WontFitError  # noqa: B018


PREFLIGHT = textwrap.dedent('''
    from jaxnitro.plugin import hookimpl

    asked = []


    class Report:
        device, n_devices, flops_per_step = "my device", 1, 1.0e6

        def __init__(self, programs):
            self.programs = programs

        def rows(self):
            return [("programs seen", ", ".join(self.programs))]


    @hookimpl
    def jaxnitro_preflight(nitro, step, refuse):
        asked.append(refuse)
        return Report(tuple(p.name for p in step.programs))
''')


def test_a_third_party_preflight_replaces_the_built_in(tmp_path):
    with installed_plugin(tmp_path / "site", module="jaxnitro_preflight_testplugin", source=PREFLIGHT,
                          dist="jaxnitro-preflight-test", entry="preflight_test") as plugin:
        E = fresh_tiny()
        report = jn.memory_report(E(), accum=2)
        assert type(report).__name__ == "Report" and report.programs == ("accumulate", "train_step")
        n = jn.train(E(max_epochs=1), run_dir=tmp_path, logger=None, device_peak_flops=1e12)
        assert plugin.asked == [False, True]
        assert n.plan.memory.programs == ("train_step",)
        shown = str(n)
        assert "memory per device (my device, 1 device(s))" in shown and "programs seen" in shown
        assert "jaxnitro_preflight()" in shown and "preflight_test" in shown  # who answered
        t = n.record.throughput[0]
        assert t["flops_per_step"] == 1.0e6 and t["mfu"] == pytest.approx(1.0e6 * t["steps_per_sec"] / 1e12)
