"""The accelerator check: jaxnitro against a hand-written loop on the visible devices.

Two models, the tutorial MLP (784-128-10, batch 400) and a small char-level GPT
(``bench/char_gpt.py``: 4 layers x 128 wide, context 64, batch 32), each in float32 (and
bfloat16 when the ``precision`` run knob exists: guarded, skipped with a line otherwise),
with the parameters replicated and FSDP-split over every visible device. Each row trains
the same model with ``jaxnitro`` (``Nitro(...).train()`` on a handle whose programs are
compiled) and with a hand-written ``jax.jit`` step with the same shardings (params and
optimizer state on ``NamedSharding``s, batches on ``P("data")``, ``out_shardings`` pinned),
interleaved, and prints the medians: steps/s of each, their ratio (goal >= 0.95), XLA's
FLOPs per step (``cost_analysis()`` of the hand-written step) and, where the device's peak
is known (H100/H200, A100, or ``GPU_CHECK_PEAK_FLOPS``), the MFU against the dense bfloat16
peak.

Settings (environment): ``GPU_CHECK_STEPS`` (timed steps per run, default 300),
``GPU_CHECK_REPEATS`` (default 2), ``GPU_CHECK_MODELS`` (default ``mlp,gpt``),
``GPU_CHECK_GPT`` (``layers,width``, default ``4,128``), ``GPU_CHECK_PEAK_FLOPS`` (a per-device
peak in FLOP/s). ``bench/gpu_check.sh`` runs it; on a CPU-only machine it runs too, tiny
(``GPU_CHECK_STEPS=20 GPU_CHECK_REPEATS=1 GPU_CHECK_GPT=1,32``: about a minute), with no MFU.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxnitro as jn
from jaxnitro.knobs import KNOB_DEFAULTS

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from char_gpt import CharGPT, corpus, gpt_logits, gpt_loss, make_gpt, windows  # noqa: E402
from step_overhead import BenchMLP  # noqa: E402

STEPS = int(os.environ.get("GPU_CHECK_STEPS", 300))
REPEATS = int(os.environ.get("GPU_CHECK_REPEATS", 2))
MODELS = os.environ.get("GPU_CHECK_MODELS", "mlp,gpt").split(",")
GPT_LAYERS, GPT_WIDTH = (int(v) for v in os.environ.get("GPU_CHECK_GPT", "4,128").split(","))
PEAKS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12, "A10": 125e12}
"""Dense bfloat16 peaks (FLOP/s per device), matched against ``device_kind``."""


def peak_flops() -> float | None:
    if os.environ.get("GPU_CHECK_PEAK_FLOPS"):
        return float(os.environ["GPU_CHECK_PEAK_FLOPS"])
    kind = jax.devices()[0].device_kind
    return next((v for k, v in PEAKS.items() if k in kind), None)


def fsdp_sharding(mesh, shape, n):
    """Split along the largest dimension divisible by ``n`` (the first on a tie), over "data"."""
    dims = [d for d, size in enumerate(shape) if size % n == 0 and size >= n]
    if not dims or n == 1:
        return NamedSharding(mesh, P())
    best = max(dims, key=lambda d: (shape[d], -d))
    return NamedSharding(mesh, P(*([None] * best), "data"))


def model_case(name: str):
    """``(experiment, fields, build(key) -> model, loss(model, batch, dtype) -> scalar, batch size)``."""
    if name == "mlp":
        rng = np.random.default_rng(0)
        x = rng.random((8000, 784), np.float32)
        y = np.eye(10, dtype=np.float32)[rng.integers(0, 10, 8000)]

        def build(key):
            k1, k2 = jax.random.split(key)
            import equinox as eqx

            return (eqx.nn.Linear(784, 128, key=k1), eqx.nn.Linear(128, 10, key=k2))

        def loss(model, b, dtype):
            l1, l2 = model
            logits = jax.vmap(lambda v: l2(jax.nn.relu(l1(v))))(b["img"].astype(dtype)).astype(jnp.float32)
            target = 0.95 * b["label"] + 0.05 / 10
            return -jnp.sum(target * jax.nn.log_softmax(logits, axis=-1)) / b["label"].shape[0]

        return BenchMLP(), {"img": x, "label": y}, build, loss, 400
    codes, _ = corpus()
    x, y = windows(codes, 64, 3200)

    def loss(model, b, dtype):
        return gpt_loss(gpt_logits(model, b["x"]), b["y"])

    e = CharGPT(layers=GPT_LAYERS, width=GPT_WIDTH)
    return e, {"x": x, "y": y}, lambda key: make_gpt(key, width=GPT_WIDTH, layers=GPT_LAYERS), loss, 32


def handwritten(case, n: int, fsdp: bool, precision: str, steps: int):
    """Steps/s of the hand-written loop, and XLA's FLOPs per step of its compiled step."""
    import equinox as eqx

    _, fields, build, loss_fn, batch = case
    mesh = Mesh(np.array(jax.devices()[:n]), ("data",))
    rep, shard = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    model = build(jax.random.split(jax.random.PRNGKey(0))[0])
    params, static = eqx.partition(model, eqx.is_inexact_array)
    opt = optax.radam(1e-3)
    opt_state = opt.init(params)
    dtype = jnp.bfloat16 if precision == "bfloat16" else jnp.float32
    where = (lambda a: fsdp_sharding(mesh, np.shape(a), n)) if fsdp else (lambda a: rep)
    p_sh, o_sh = jax.tree_util.tree_map(where, params), jax.tree_util.tree_map(where, opt_state)
    params, opt_state = jax.device_put(params, p_sh), jax.device_put(opt_state, o_sh)

    def step(params, opt_state, b):
        def f(p):
            cast = jax.tree_util.tree_map(lambda a: a.astype(dtype), p)  # float32 masters, compute in dtype
            return loss_fn(eqx.combine(cast, static), b, dtype)

        loss, grads = jax.value_and_grad(f)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    step = jax.jit(step, donate_argnums=(0, 1), out_shardings=(p_sh, o_sh, rep))
    src = jn.ArraySource(fields, batch_size=batch, shuffle=True, drop_last=True, seed=0)
    first = {k: jax.device_put(v, shard) for k, v in src.batch_at(0).items()}
    flops = (step.lower(params, opt_state, first).compile().cost_analysis() or {})
    flops = flops[0] if isinstance(flops, list) else flops
    losses, i, epoch, t0 = [], 0, 0, None
    while i < steps + 10:
        src.begin_epoch(epoch)
        for j in range(len(src)):
            if i == 10:
                jax.block_until_ready(losses[-1])
                t0 = time.perf_counter()
            b = {k: jax.device_put(v, shard) for k, v in src.batch_at(j).items()}
            params, opt_state, loss = step(params, opt_state, b)
            losses.append(loss)
            if len(losses) > 16:
                losses.pop(0).block_until_ready()
            i += 1
            if i >= steps + 10:
                break
        epoch += 1
    jax.block_until_ready(losses[-1])
    return steps / (time.perf_counter() - t0), float(flops.get("flops", float("nan")))


def nitro(case, n: int, fsdp: bool, precision: str, steps: int, tmp: str) -> float:
    e, fields, _, _, batch = case
    src = jn.ArraySource(fields, batch_size=batch, shuffle=True, drop_last=True, seed=0)
    knobs = {"precision": precision} if "precision" in KNOB_DEFAULTS else {}
    handle = jn.Nitro(e, data={"train": src}, n_devs=n, max_steps=steps, logger=None, run_dir=tmp,
                      sharding="fsdp" if fsdp else "replicated", **knobs)
    t0 = time.perf_counter()
    handle.train()
    jax.block_until_ready(handle.params)
    return steps / (time.perf_counter() - t0)


def main() -> list[dict]:
    jn.progress_reporter(None)
    n = jax.device_count()
    precisions = ["float32"] + (["bfloat16"] if "precision" in KNOB_DEFAULTS else [])
    peak = peak_flops()
    print(f"devices: {n} x {jax.devices()[0].device_kind} ({jax.devices()[0].platform}); {STEPS} timed steps a run, "
          f"{REPEATS} repeats; peak {'%.0f TFLOP/s' % (peak / 1e12) if peak else 'unknown (no MFU)'}")
    if "bfloat16" not in precisions:
        print("bfloat16: skipped (this jaxnitro has no `precision` run knob)")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in MODELS:
            case = model_case(name)
            for precision in precisions:
                for fsdp in (False, True):
                    nitro(case, n, fsdp, precision, 1, tmp)  # compile
                    hand, ours, flops = [], [], None
                    for r in range(REPEATS):
                        if r % 2:
                            ours.append(nitro(case, n, fsdp, precision, STEPS, tmp))
                        h, flops = handwritten(case, n, fsdp, precision, STEPS)
                        hand.append(h)
                        if not r % 2:
                            ours.append(nitro(case, n, fsdp, precision, STEPS, tmp))
                    row = {"model": name, "precision": precision, "sharding": "fsdp" if fsdp else "replicated",
                           "hand": statistics.median(hand), "nitro": statistics.median(ours),
                           "ratio": statistics.median(o / h for o, h in zip(ours, hand)), "flops": flops}
                    row["mfu"] = (flops * row["nitro"] / peak) if peak and np.isfinite(flops) else None
                    rows.append(row)
                    mfu = f"{100 * row['mfu']:.1f}%" if row["mfu"] is not None else "n/a"
                    print(f"{name:>4} {precision:>8} {row['sharding']:>10} | hand {row['hand']:8.1f}/s | jaxnitro "
                          f"{row['nitro']:8.1f}/s | ratio {row['ratio']:.3f} | {flops / 1e9:8.3f} GFLOP/step | MFU {mfu}",
                          flush=True)
    return rows


if __name__ == "__main__":
    main()
