"""The module-level compile cache, witnessed by ``jn.cache_stats()``.

The cache is process-wide, so every assertion compares *deltas* of
``misses`` (one miss = one trace = one XLA compilation), never absolute
values. Tests that need exact miss counts use a fresh experiment class
(``fresh_tiny`` from ``tiny.py``): the class's name is part of every program
key and each fresh class has a unique qualified name, so such a class starts with no
programs whatever other tests compiled before.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections import defaultdict
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

import jaxnitro as jn
from jaxnitro import cache as jcache

from tiny import Tiny, TinyCore, fresh_tiny, tiny_data

TESTS_DIR = Path(__file__).resolve().parent


def misses() -> int:
    return jn.cache_stats().misses


def traces_of(cls) -> dict[str, list[int]]:
    """``{kind: [traces of each cached program of that kind]}`` for the programs of ``cls``."""
    out: dict[str, list[int]] = defaultdict(list)
    mine = jcache.experiment_key(cls)  # every program key starts with the class's name and fields
    for (kind, key), program in list(jcache._programs.items()):
        if key[0] == mine:
            out[kind].append(program.traces)
    return {k: sorted(v) for k, v in out.items()}


def leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def same_params(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(leaves(a.params), leaves(b.params)))


TRAIN_ONLY = {"train": tiny_data()["train"]}  # 6 batches of 16: accum 1, 2, 3 and 6 divide it


# -- the witness ---------------------------------------------------------------------------


def test_cache_stats_is_a_named_tuple_of_counts():
    s = jn.cache_stats()
    assert isinstance(s, jn.CacheStats) and isinstance(s, tuple)
    assert s._fields == ("hits", "misses", "entries")
    hits, miss, entries = s
    assert (hits, miss, entries) == (s.hits, s.misses, s.entries)
    assert all(isinstance(v, int) and v >= 0 for v in s)


# -- what does not compile --------------------------------------------------------------------


def test_second_train_on_a_fresh_handle_compiles_nothing(tmp_path):
    jn.train(Tiny(), run_dir=tmp_path, logger=None)  # compiles, unless another test did
    before = jn.cache_stats()
    n = jn.train(Tiny(), run_dir=tmp_path, logger=None)
    after = jn.cache_stats()
    assert n.status == "done" and len(n.rows) == 2
    assert after.misses - before.misses == 0
    assert after.entries == before.entries
    assert after.hits > before.hits  # the programs were requested and served from the cache


def test_device_field_sweep_compiles_nothing(tmp_path):
    jn.train(Tiny(), run_dir=tmp_path, logger=None)
    m = misses()
    losses = []
    for s in (0.05, 0.1, 0.15, 0.2):
        n = jn.train(Tiny(smoothing=s), run_dir=tmp_path, logger=None)
        losses.append(n.rows[-1]["train_loss"])
    assert misses() - m == 0
    assert len(set(losses)) == 4  # every value reached the compiled program


def test_seed_run_dir_max_epochs_and_schedules_compile_nothing(tmp_path):
    base = jn.train(Tiny(), run_dir=tmp_path, logger=None)
    m = misses()
    other_seed = jn.train(Tiny(), seed=7, run_dir=tmp_path, logger=None)
    jn.train(Tiny(), run_dir=tmp_path / "elsewhere", logger=None)
    longer = jn.train(Tiny(), max_epochs=3, run_dir=tmp_path, logger=None)
    one_cycle = jn.train(
        Tiny(),
        schedules={"learning_rate": lambda total: optax.cosine_onecycle_schedule(total, 1e-2)},
        run_dir=tmp_path,
        logger=None,
    )
    flat = jn.train(
        Tiny(), schedules={"learning_rate": lambda total: lambda step: 1e-3}, run_dir=tmp_path, logger=None
    )
    assert misses() - m == 0
    # ... and each of them did take effect
    assert not same_params(base, other_seed)
    assert len(longer.rows) == 3 and longer.step == 18
    assert not same_params(one_cycle, flat)
    assert not same_params(base, flat)


# -- what compiles, exactly -------------------------------------------------------------------


def test_graph_const_change_compiles_new_programs(tmp_path):
    C = fresh_tiny(max_epochs=1)
    jn.train(C(), run_dir=tmp_path, logger=None)
    assert traces_of(C) == {"train_step": [1], "forward": [1]}
    m = misses()
    jn.train(C(width=8), run_dir=tmp_path, logger=None)
    assert misses() - m == 2  # a new train step and a new forward for the new width
    assert traces_of(C) == {"train_step": [1, 1], "forward": [1, 1]}
    m = misses()
    jn.train(C(width=8, smoothing=0.3), run_dir=tmp_path, logger=None)
    assert misses() - m == 0


def test_accum_compiles_the_accumulate_program_only_for_new_signatures(tmp_path):
    C = fresh_tiny(max_epochs=1)
    run = dict(data=TRAIN_ONLY, run_dir=tmp_path, logger=None)
    m = misses()
    jn.train(C(), **run)
    assert misses() - m == 1
    assert traces_of(C) == {"train_step": [1]}  # acc=None signature

    # accum=2: the accumulate program (first micro-batch: acc=None) and the
    # train step's second signature (it receives the accumulated gradient).
    m = misses()
    n2 = jn.train(C(), accum=2, **run)
    assert misses() - m == 2
    assert traces_of(C) == {"train_step": [2], "accumulate": [1]}
    assert n2.step == 3

    # accum=3: micro-batch 2 adds into a running sum (acc=tree), the one new signature.
    m = misses()
    n3 = jn.train(C(), accum=3, **run)
    assert misses() - m == 1
    assert traces_of(C) == {"train_step": [2], "accumulate": [2]}
    assert n3.step == 2

    # Any larger accum reuses both signatures: 1/accum is an input, not a constant.
    m = misses()
    n6 = jn.train(C(), accum=6, **run)
    jn.train(C(), accum=2, **run)
    assert misses() - m == 0
    assert n6.step == 1 and np.isfinite(n6.rows[-1]["train_loss"])


def test_gradient_clip_norm_compiles_a_new_train_step_and_reuses_accumulate(tmp_path):
    C = fresh_tiny(max_epochs=1)
    run = dict(data=TRAIN_ONLY, run_dir=tmp_path, logger=None)
    jn.train(C(), accum=3, **run)
    assert traces_of(C) == {"train_step": [1], "accumulate": [2]}

    m = misses()
    clipped = jn.train(C(), accum=3, gradient_clip_norm=1e-3, **run)
    assert misses() - m == 1  # turning clipping on: a new train step; accumulate is shared
    assert traces_of(C) == {"train_step": [1, 1], "accumulate": [2]}

    m = misses()
    other = jn.train(C(), accum=3, gradient_clip_norm=2e-3, **run)  # another threshold: an input
    assert misses() - m == 0
    assert traces_of(C) == {"train_step": [1, 1], "accumulate": [2]}
    assert not same_params(clipped, other)  # the new threshold took effect without compiling

    m = misses()
    again = jn.train(C(), accum=3, gradient_clip_norm=1e-3, **run)
    assert misses() - m == 0
    assert same_params(clipped, again)

    unclipped = jn.train(C(), accum=3, **run)
    assert not same_params(clipped, unclipped)  # the clip took effect


def test_validate_evaluate_and_predict_share_one_forward(tmp_path):
    C = fresh_tiny(max_epochs=1)
    data = tiny_data()  # val: 2 full batches of 16 and a partial batch of 8
    n = jn.Nitro(C(), data=data, run_dir=tmp_path, logger=None)
    m = misses()
    first = n.validate()
    assert misses() - m == 1
    assert traces_of(C) == {"forward": [1]}

    m = misses()
    assert n.evaluate("val") == first
    n.evaluate("train")
    full = n.predict({"x": data["val"][0]["x"]})
    partial = n.predict({"x": data["val"][-1]["x"]})  # 8 rows, padded to 16 and sliced back
    few = n.predict({"x": data["val"][0]["x"][:3]})
    listed = list(n.predict([{"x": data["val"][0]["x"]}, {"x": data["val"][-1]["x"][:5]}]))
    assert misses() - m == 0
    assert traces_of(C) == {"forward": [1]}
    assert full.shape == (16, 4) and partial.shape == (8, 4) and few.shape == (3, 4)
    np.testing.assert_allclose(few, full[:3], rtol=1e-6)
    assert [o.shape for o in listed] == [(16, 4), (5, 4)]

    # A second handle, or a trained one, validates with the same forward.
    m = misses()
    trained = jn.train(C(), data=data, run_dir=tmp_path, logger=None)
    assert misses() - m == 1  # only the train step
    trained.validate()
    jn.Nitro(C(), data=data, run_dir=tmp_path, logger=None).evaluate("val")
    assert misses() - m == 1
    assert traces_of(C) == {"forward": [1], "train_step": [1]}


def test_device_metrics_program_is_shared_by_validate_and_evaluate(tmp_path):
    import jax.numpy as jnp

    @jn.experiment
    class DeviceMetrics(TinyCore):
        def metrics(self, logits, *, y):
            return {"correct": ((jnp.argmax(logits, -1) == y).sum(), y.shape[0])}

        def metrics_residency(self, hook):
            return "device"

    n = jn.Nitro(DeviceMetrics(), run_dir=tmp_path, logger=None)
    first = n.validate()
    kinds = traces_of(DeviceMetrics)
    assert set(kinds) == {"forward", "metrics"} and kinds["forward"] == [1]
    m = misses()
    assert n.validate() == first
    n.evaluate("val")
    n.evaluate("train")  # full batches only: a signature the val split already had
    n.predict({"x": tiny_data()["val"][0]["x"]})
    assert misses() - m == 0
    assert traces_of(DeviceMetrics) == kinds
    assert 0.0 <= first["correct"] <= 1.0


# -- JAX's persistent compilation cache (opt-in) -------------------------------------------------

_CHILD = textwrap.dedent(
    """
    import os, sys
    import jax, jax.monitoring
    hits = []
    jax.monitoring.register_event_listener(
        lambda name, **kw: hits.append(name) if name == "/jax/compilation_cache/cache_hits" else None
    )
    explicit = sys.argv[2] if len(sys.argv) > 2 else None
    if explicit:
        jax.jit(lambda v: v + 1)(1.0)  # compiles before the cache is enabled: never written
    import jaxnitro as jn
    from tiny import Tiny
    if explicit:
        assert jn.enable_persistent_cache(explicit) == os.path.abspath(explicit)
    n = jn.train(Tiny(), max_epochs=1, logger=None, run_dir=sys.argv[1])
    print("RESULT", len(hits), jn.cache_stats().misses, n.status)
    """
)


def _child(tmp_path, *args, env_cache=None):
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    env = {k: v for k, v in os.environ.items() if k != jcache.CACHE_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS_DIR), env.get("PYTHONPATH", "")])
    if env_cache is not None:
        env[jcache.CACHE_ENV] = str(env_cache)
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "runs"), *args],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(l for l in out.stdout.splitlines() if l.startswith("RESULT"))
    _, hits, miss, status = line.split()
    return int(hits), int(miss), status


@pytest.mark.slow  # two fresh processes (~4 s)
def test_persistent_cache_lets_a_second_process_skip_xla_compilation(tmp_path):
    cache_dir = tmp_path / "xla-cache"
    # 1st process: opted in through the environment variable, on an empty folder.
    hits, miss, status = _child(tmp_path, env_cache=cache_dir)
    written = sorted(os.listdir(cache_dir))
    assert status == "done" and hits == 0 and miss == 2
    assert written, "the persistent cache folder stayed empty"

    # 2nd process: opted in by calling jn.enable_persistent_cache after JAX already
    # compiled something. It still traces (its own in-process cache starts empty:
    # 2 misses), but XLA loads the executables from disk.
    hits, miss, status = _child(tmp_path, str(cache_dir))
    assert status == "done" and miss == 2
    assert hits > 0
    assert sorted(os.listdir(cache_dir)) == written  # nothing had to be compiled anew


def test_persistent_cache_is_opt_in():
    assert "enable_persistent_cache" in jn.__all__
    if not (os.environ.get(jcache.CACHE_ENV) or os.environ.get("JAX_COMPILATION_CACHE_DIR")):
        assert not jax.config.jax_compilation_cache_dir  # nothing is written to disk unless asked
