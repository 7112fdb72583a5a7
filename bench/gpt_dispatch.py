"""The default ``steps_per_dispatch="auto"`` against k=1 on the char-level GPT, in one process.

The issue's goal: the default is no slower than k=1 on ``bench/char_gpt.py``'s model
(4 layers x 128 wide, context 64, batch 32), and, for scale, both beside the hand-written
``jax.jit`` loop of ``bench/gpu_check.py`` (same model, loss, RAdam(1e-3), batches).
Each contender is warmed up once (its programs compiled: the compile cache is
module-level), then the timed runs are interleaved (hand-written, k=1, auto, ...) and
the medians compared, so background load hits all alike. The jaxnitro time is
``Nitro.train()`` wall time, every per-step cost of the framework included.

    python bench/gpt_dispatch.py [--steps 200] [--repeats 3] [--gpt 4,128]

Prints steps/s of each, ``auto / k=1`` (goal >= 1.0 within noise) and each against the
hand-written loop, and the k that ``auto`` chose from the step time it measured.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gpt", default="4,128", help="layers,width (default 4,128)")
    args = parser.parse_args(argv)
    os.environ["GPU_CHECK_GPT"] = args.gpt  # read by gpu_check at import
    import gpu_check  # noqa: E402 - after GPU_CHECK_GPT is set

    import jaxnitro as jn

    jn.progress_reporter(None)
    from jaxnitro.plugin import hookimpl
    from jaxnitro.plugin_manager import plugin_manager

    class ChosenK:  # what "auto" chose, read at the run's finish
        k = None

        @hookimpl
        def jaxnitro_run_finish(self, run, status):
            ChosenK.k = (run.chosen_k, run.step_seconds)

    plugin_manager().register(ChosenK(), name="bench-chosen-k")
    case = gpu_check.model_case("gpt")
    e, fields, _, _, batch = case
    times: dict[str, list[float]] = {"hand-written jit loop": [], "jaxnitro k=1": [], "jaxnitro auto (default)": []}
    chosen = None
    with tempfile.TemporaryDirectory() as tmp:

        def nitro(k):
            src = jn.ArraySource(fields, batch_size=batch, shuffle=True, drop_last=True, seed=0)
            handle = jn.Nitro(e, data={"train": src}, max_steps=args.steps, logger=None, run_dir=tmp,
                              steps_per_dispatch=k)
            t0 = time.perf_counter()
            handle.train()
            jax.block_until_ready(handle.params)
            return args.steps / (time.perf_counter() - t0), handle

        gpu_check.handwritten(case, 1, False, "float32", 20)  # warm-ups: compile every program once
        nitro(1)
        nitro("auto")
        for _ in range(args.repeats):
            times["hand-written jit loop"].append(gpu_check.handwritten(case, 1, False, "float32", args.steps)[0])
            times["jaxnitro k=1"].append(nitro(1)[0])
            rate, handle = nitro("auto")
            times["jaxnitro auto (default)"].append(rate)
            chosen = ChosenK.k
    med = {name: statistics.median(v) for name, v in times.items()}
    base = med["hand-written jit loop"]
    print(f"char GPT {args.gpt} (layers,width), batch {batch}, {args.steps} timed steps a run, "
          f"{args.repeats} repeats, {jax.devices()[0].platform}")
    print(f"{'contender':<26}{'steps/s':>10}{'vs hand-written':>18}")
    for name, rate in med.items():
        print(f"{name:<26}{rate:>10.1f}{rate / base:>18.3f}")
    ratio = med["jaxnitro auto (default)"] / med["jaxnitro k=1"]
    print(f"auto / k=1: {ratio:.3f} (goal >= 1.0 within noise)")
    k, step_s = chosen if chosen else (None, None)
    print(f"auto chose: k={k}" + (f" from a measured step of {1e3 * step_s:.1f} ms" if step_s else ""))
    return {"medians": med, "auto_over_k1": ratio, "chosen": chosen}


if __name__ == "__main__":
    main()
