"""Mixed precision, remat, the memory preflight and throughput (issue 21 items 1, 3, 4, 5)."""

from __future__ import annotations

import json
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxnitro as jn
import jaxnitro.first_step as memory
import jaxnitro.plugins.memory_preflight as preflight_plugin
from jaxnitro import GraphConst
from jaxnitro.plugins.precision import KEEP_BARRIERS, Policy
from tiny import N_CLASSES, fresh_tiny


def leaves(tree):
    return jax.tree_util.tree_leaves(tree)


# -- 1. mixed precision ---------------------------------------------------------------


def recording_tiny(seen: list, **members):
    """A fresh Tiny whose traced forward and loss record the dtypes they see (at trace time)."""

    def forward(self, model, state, *, x):
        seen.append(("forward", str(model.l1.weight.dtype), str(model.l2.weight.dtype), str(x.dtype)))
        return jax.vmap(model)(x), state

    def loss(self, logits, *, label):
        seen.append(("loss", str(logits.dtype), str(label.dtype)))
        return -jnp.mean(jnp.sum(label * jax.nn.log_softmax(logits), -1))

    return fresh_tiny(forward=forward, loss=loss, **members)


def test_bfloat16_trains_close_to_float32_with_float32_masters_and_the_dtypes_hooks_see(tmp_path):
    seen32, seen16 = [], []
    f32 = jn.train(recording_tiny(seen32)(max_epochs=3), run_dir=tmp_path, logger=None)
    b16 = jn.train(recording_tiny(seen16)(max_epochs=3), run_dir=tmp_path, logger=None, precision="bfloat16")
    a, b = np.array([r["train_loss"] for r in f32.rows]), np.array([r["train_loss"] for r in b16.rows])
    assert not np.array_equal(a, b)  # computed in bfloat16 ...
    np.testing.assert_allclose(b, a, rtol=2e-3)  # ... and close: measured gap < 3e-4 relative
    assert np.all(np.diff(b) < 0)  # and it learns
    assert ("forward", "float32", "float32", "float32") in seen32
    assert ("forward", "bfloat16", "bfloat16", "bfloat16") in seen16  # params and the float field cast
    assert ("loss", "float32", "float32") in seen16 and all(s[1] == "float32" for s in seen16 if s[0] == "loss")
    # the handle's master weights, the optimizer state and (so) the gradients are float32
    assert {str(x.dtype) for x in leaves(b16.state.params)} == {"float32"}
    assert {str(x.dtype) for x in leaves(b16.state.opt_state) if jnp.issubdtype(x.dtype, jnp.floating)} == {"float32"}
    assert "precision" in str(b16) and "bfloat16 compute; float32 masters" in str(b16)


def test_keep_float32_keeps_the_named_parameters_and_is_part_of_the_program_key(tmp_path):
    seen = []
    E = recording_tiny(seen, keep_float32=lambda self, path: path[0] == "l2")
    n = jn.train(E(max_epochs=1), run_dir=tmp_path, logger=None, precision="bfloat16")
    assert ("forward", "bfloat16", "float32", "bfloat16") in seen  # l2 kept, l1 cast
    assert ("loss", "float32", "float32") in seen
    text = str(n)
    assert "2 of 4 arrays kept float32" in text and "l2.weight, l2.bias" in text
    # leaf order l1.weight, l1.bias, l2.weight, l2.bias: the answers are in every program key
    assert n.plan.programs.precision.key() == ("precision", "bfloat16", (False, False, True, True), False)
    assert n.plan.programs.train_key() != jn.Nitro(E(), logger=None).plan.programs.train_key()
    F = fresh_tiny(keep_float32=lambda self, path: None)
    with pytest.raises(TypeError, match=r"`keep_float32` of FreshTiny returned None for \('l1', 'weight'\)"):
        jn.Nitro(F(), logger=None, precision="bfloat16")


def test_checkpoints_hold_the_float32_masters(tmp_path):
    import orbax.checkpoint as ocp

    E = fresh_tiny()
    n = jn.train(E(max_epochs=1), run_dir=tmp_path, logger=None, precision="bfloat16",
                 checkpointer=jn.Checkpointer(keep=(jn.Last(1),)))
    mgr = ocp.CheckpointManager(os.path.join(n.run_dir, "checkpoints"))
    got = mgr.restore(mgr.latest_step(), args=ocp.args.Composite(state=ocp.args.StandardRestore()))
    saved = got["state"]["params"]
    assert str(saved["l1"]["weight"].dtype) == "float32"
    np.testing.assert_array_equal(saved["l1"]["weight"], n.state.params.l1.weight)


@pytest.mark.parametrize("value, match", [
    ("float16", r"`precision` = 'float16' \(keyword\); float16 is not supported: .*dynamically.*precision=\"bfloat16\""),
    ("fp32", r"`precision` = 'fp32' \(keyword\); give one of 'float32', 'bfloat16'"),
])
def test_bad_precision_is_refused(value, match):
    with pytest.raises(ValueError, match=match):
        jn.Nitro(fresh_tiny()(), logger=None, precision=value)


def test_bad_remat_and_peak_are_refused_listing_what_is_valid():
    with pytest.raises(ValueError, match=r"`remat` = 'dots' \(keyword\).*'dots_saveable'.*'nothing_saveable'"):
        jn.Nitro(fresh_tiny()(), logger=None, remat="dots")
    with pytest.raises(ValueError, match=r"`device_peak_flops` = -1 \(keyword\)"):
        jn.Nitro(fresh_tiny()(), logger=None, device_peak_flops=-1)


# -- 3. remat -------------------------------------------------------------------------


class Block(eqx.Module):
    """A residual MLP block whose hidden layer (8x wider) is the big activation."""

    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, d, key):
        k1, k2 = jax.random.split(key)
        self.up, self.down = eqx.nn.Linear(d, 8 * d, key=k1), eqx.nn.Linear(8 * d, d, key=k2)

    def __call__(self, x):
        return x + self.down(jnp.tanh(self.up(x)))


class Deep(eqx.Module):
    blocks: tuple
    head: eqx.nn.Linear

    def __init__(self, depth, d, key):
        keys = jax.random.split(key, depth + 1)
        self.blocks = tuple(Block(d, k) for k in keys[:-1])
        self.head = eqx.nn.Linear(d, N_CLASSES, key=keys[-1])

    def __call__(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def deep_data(n=256, batch=128, d=16):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, d)).astype(np.float32)
    oh = np.eye(N_CLASSES, dtype=np.float32)[rng.integers(0, N_CLASSES, n)]
    return {"train": [{"x": x[i:i + batch], "label": oh[i:i + batch]} for i in range(0, n, batch)]}


@jn.experiment
class DeepMLP:
    depth: GraphConst[int] = 3
    max_epochs: int = 1

    def build_data(self, dist):
        return deep_data()

    def build_model(self, key):
        return Deep(self.depth, 16, key)

    def forward(self, model, state, *, x):
        return jax.vmap(model)(x), state

    def loss(self, logits, *, label):
        return -jnp.mean(jnp.sum(label * jax.nn.log_softmax(logits), -1))


class Scanned(eqx.Module):
    """Deep's blocks stacked (``eqx.filter_vmap``) and run by a ``lax.scan`` over them."""

    blocks: Block
    head: eqx.nn.Linear

    def __init__(self, depth, d, key):
        keys = jax.random.split(key, depth + 1)
        self.blocks = eqx.filter_vmap(lambda k: Block(d, k))(keys[:-1])
        self.head = eqx.nn.Linear(d, N_CLASSES, key=keys[-1])

    def __call__(self, x):
        x, _ = jax.lax.scan(lambda x, block: (block(x), None), x, self.blocks)
        return self.head(x)


@jn.experiment
class ScannedMLP(DeepMLP):
    def build_model(self, key):
        return Scanned(self.depth, 16, key)


def saved_for_backward(n) -> int:
    """Bytes JAX keeps from the forward pass for the backward pass of the train step's loss."""
    from jax._src.ad_checkpoint import saved_residuals  # print_saved_residuals' list form

    progs, batch = n.plan.programs, memory._first_batch(n.plan, n.data["train"], n.state.rng)
    fn = lambda p: progs._loss_and_aux(p, n.state.model_state, n.device_values, batch, {})[0]  # noqa: E731
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a, why in saved_residuals(fn, n.state.params)
               if "argument" not in why)


@pytest.mark.slow
def test_remat_recomputes_the_blocks_keeps_less_for_the_backward_pass_and_is_bitwise_equal(tmp_path):
    plain = jn.Nitro(DeepMLP(), logger=None, run_dir=tmp_path)
    remat = jn.Nitro(DeepMLP(), logger=None, run_dir=tmp_path, remat=True)
    dots = jn.Nitro(DeepMLP(), logger=None, run_dir=tmp_path, remat="dots_saveable")
    kept = [saved_for_backward(n) for n in (plain, remat, dots)]
    assert kept[1] < kept[0] / 4, kept  # measured: 204,800 -> 24,576 bytes (only the blocks' inputs)
    assert kept[1] < kept[2] < kept[0], kept  # dots_saveable keeps the matmul outputs
    # the lowered step recomputes each block's first matmul in the backward pass
    texts = []
    for n in (plain, remat):
        p, s, o = n.state.leaves()
        hypers, scale = memory._hypers_and_scale(n.plan, n.settings.accum, n.step, None)
        prog = n.plan.programs.train_step(n.plan.opt_spec, n.plan.tx, jax.tree_util.tree_structure(n.state.opt_state))
        texts.append(prog.jitted.lower(p, s, o, n.device_values, memory._first_batch(n.plan, n.data["train"], n.state.rng), None, scale, hypers).as_text())
    assert texts[1].count("dot_general") == texts[0].count("dot_general") + 3
    plain.train()
    remat.train()
    assert all(np.array_equal(a, b) for a, b in zip(leaves(plain.state.params), leaves(remat.state.params)))
    assert plain.rows == remat.rows
    assert "on (jax.checkpoint: every activation recomputed)" in str(remat)


def temps_and_bitwise(E, tmp_path) -> dict:
    """``{remat: jn.memory_report(...).temp}`` of ``E(depth=4)`` with remat off and on, after
    asserting that the two train to bitwise equal parameters and rows (the programs the
    reports compiled)."""
    temps, runs = {}, {}
    for remat in (False, True):
        temps[remat] = jn.memory_report(E(depth=4), remat=remat).temp
        runs[remat] = jn.Nitro(E(depth=4), logger=None, run_dir=tmp_path, remat=remat)
        runs[remat].train()
    assert all(np.array_equal(a, b) for a, b in zip(leaves(runs[False].state.params), leaves(runs[True].state.params)))
    assert runs[False].rows == runs[True].rows
    return temps


def test_remat_lowers_xlas_temporaries_of_the_train_step_and_is_bitwise_equal(tmp_path):
    """XLA:CPU's own figure (``memory_analysis()``, through ``jn.memory_report``) falls for
    blocks in a Python loop: the train programs keep jax.checkpoint's barriers
    (``KEEP_BARRIERS``; without them XLA:CPU merges the recomputation away, the same bytes)."""
    assert Policy(remat=True).compiler_options() == KEEP_BARRIERS and Policy().compiler_options() is None
    temps = temps_and_bitwise(DeepMLP, tmp_path)
    assert temps[True] < 0.6 * temps[False], temps  # measured: 369,476 -> 172,520 bytes (0.47x)


@pytest.mark.slow
def test_remat_of_a_scan_over_stacked_blocks_checkpoints_each_iteration(tmp_path):
    """A scan over stacked blocks: each iteration's block is checkpointed (the stacked Module
    is wrapped, the scan slices the wrapper), not the whole forward (which recomputes the
    scan, stacking every iteration's activations again: 732,376 bytes for 731,992)."""
    temps = temps_and_bitwise(ScannedMLP, tmp_path)
    assert temps[True] < 0.5 * temps[False], temps  # measured: 731,992 -> 265,040 bytes (0.36x)


# -- 4. the memory preflight ------------------------------------------------------------


def test_memory_report_figures_and_the_first_step_compiles_nothing_again(tmp_path):
    E = fresh_tiny()
    report = jn.memory_report(E(), accum=2)
    n = jn.Nitro(E(max_epochs=1), logger=None, run_dir=tmp_path, accum=2)
    assert report.params == sum(x.nbytes for x in leaves(n.state.params)) == 848
    assert report.opt_state == sum(x.nbytes for x in leaves(n.state.opt_state))
    assert report.batch == 16 * 8 * 4 + 16 * 4 * 4  # one micro-batch's x and label (y never leaves the host)
    assert report.temp > 0 and report.needed > report.params + report.opt_state + report.batch
    assert report.capacity is None and report.fits is None  # a CPU: JAX knows no limit
    assert "device capacity" in str(report) and "unknown" in str(report)
    assert report.programs == ("accumulate", "train_step") and report.flops_per_step > 0
    traced = jn.cache_stats().misses
    compiled = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **kw: compiled.append(kw.get("fun_name")) if event.endswith("backend_compile_duration") else None)
    n.train()
    assert "jit(train_step)" not in compiled and "jit(accumulate)" not in compiled and "jit(forward)" in compiled
    step = n.plan.programs.train_step(n.plan.opt_spec, n.plan.tx, jax.tree_util.tree_structure(n.state.opt_state))
    assert step.traces == 1 and n.plan.programs.accumulate().traces == 1
    assert jn.cache_stats().misses == traced + 1  # the forward program (validation) only
    assert n.plan.memory.needed == report.needed and "memory per device" in str(n)


def test_a_step_that_cannot_fit_is_refused_before_it_runs_naming_the_knobs(tmp_path, monkeypatch):
    monkeypatch.setattr(preflight_plugin, "device_capacity", lambda device: 4096)  # a 4 KiB device
    n = jn.Nitro(fresh_tiny()(max_epochs=1), logger=None, run_dir=tmp_path)
    with pytest.raises(jn.WontFitError, match=r"needs .* per device .* but cpu:0 cpu has 4.00 KiB .*"
                                              r"precision=\"bfloat16\".*sharding=\"fsdp\".*remat=True.*accum=N.*"
                                              r"a smaller batch \(the train split's batches have 16 rows\)"):
        n.train()
    assert n.step == 0 and n.status == "failed"
    report = jn.memory_report(fresh_tiny()())  # the report itself does not refuse
    assert report.fits is False and report.capacity == 4096 and "NO (" in str(report)


# -- 5. throughput ----------------------------------------------------------------------


def test_throughput_per_row_measured_with_samples_flops_and_mfu(tmp_path):
    E = fresh_tiny(samples_per_batch=lambda self: 16)
    n = jn.train(E(max_epochs=2), run_dir=tmp_path, device_peak_flops=1e12)
    timed = n.record.throughput
    assert [(t["epoch"], t["step"]) for t in timed] == [(1, 6), (2, 12)]
    for t in timed:
        assert t["steps_per_sec"] > 0
        assert t["samples_per_sec"] == pytest.approx(16 * t["steps_per_sec"])
        assert t["flops_per_step"] == n.plan.memory.flops_per_step > 0
        assert t["mfu"] == pytest.approx(t["flops_per_step"] * t["steps_per_sec"] / 1e12)
    assert "steps_per_sec" not in n.history().columns  # the rows stay reproducible
    h = n.history(throughput=True)
    assert h.steps_per_sec.tolist() == [t["steps_per_sec"] for t in timed] and "mfu" in h.columns
    lines = [json.loads(ln) for ln in open(os.path.join(n.run_dir, "metrics.jsonl"))]
    logged = [ln for ln in lines if ln.get("context") == "throughput"]
    assert [ln["step"] for ln in logged] == [6, 12] and logged[0]["samples_per_sec"] == timed[0]["samples_per_sec"]


def test_tokens_and_a_bad_samples_per_batch(tmp_path):
    n = jn.train(fresh_tiny(samples_per_batch=lambda self: {"tokens": 160})(max_epochs=1), run_dir=tmp_path,
                 logger=None, accum=2)
    t = n.record.throughput[0]
    assert t["tokens_per_sec"] == pytest.approx(2 * 160 * t["steps_per_sec"]) and "mfu" not in t  # no peak on a CPU
    with pytest.raises(TypeError, match=r"`samples_per_batch` of FreshTiny returned 'many'"):
        jn.train(fresh_tiny(samples_per_batch=lambda self: "many")(max_epochs=1), run_dir=tmp_path, logger=None)


def test_bfloat16_is_refused_for_a_manual_train_step():
    E = fresh_tiny(train_step=lambda self, models, optimizers, *, x: (models, optimizers, {}))
    with pytest.raises(ValueError, match=r"`precision` = 'bfloat16' \(keyword\), but FreshTiny writes its own `train_step`"):
        jn.Nitro(E(), logger=None, precision="bfloat16")


def test_remat_is_refused_for_a_manual_train_step():
    """remat wraps `forward` inside the framework's own step; a train_step differentiates
    by itself, so the knob would do nothing: refused, naming the knob and the fix."""
    E = fresh_tiny(train_step=lambda self, models, optimizers, *, x: (models, optimizers, {}))
    with pytest.raises(ValueError, match=r"`remat` = True \(keyword\), but FreshTiny writes its own `train_step`.*"
                                         r"eqx.filter_checkpoint.*leave `remat` at False"):
        jn.Nitro(E(), logger=None, remat=True)
