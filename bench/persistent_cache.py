"""What JAX's persistent compilation cache saves a second process, opt-in via jaxnitro.

Runs the MNIST tutorial's experiment for one epoch in fresh processes:
twice without the cache, then twice with ``JAXNITRO_COMPILATION_CACHE`` set to
an empty folder (the first fills it, the second reads it). Prints the time
each process spent in its first ``train()`` + ``evaluate()`` (the compiles
happen there) and the saving of the warm process.

    python bench/persistent_cache.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import sys, time
sys.path.insert(0, sys.argv[1])
import jaxnitro as jn
from mnist_tutorial import MnistMLP
jn.progress_reporter(None)
n = jn.Nitro(MnistMLP(max_epochs=1), run_dir=sys.argv[2], logger=None)
t0 = time.perf_counter()
n.train()
n.evaluate("test")
print(f"{time.perf_counter() - t0:.3f}")
"""


def run(env: dict, run_dir: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(ROOT / "examples" / "mnist"), run_dir],
        env=env, capture_output=True, text=True, check=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    base = {k: v for k, v in os.environ.items() if k != "JAXNITRO_COMPILATION_CACHE"}
    with tempfile.TemporaryDirectory() as tmp:
        plain = [run(base, tmp) for _ in range(2)]
        cached_env = dict(base, JAXNITRO_COMPILATION_CACHE=os.path.join(tmp, "xla"))
        cold = run(cached_env, tmp)
        warm = run(cached_env, tmp)
        files = len(os.listdir(os.path.join(tmp, "xla")))
    print("first train()+evaluate() of a fresh process, 1 epoch of the MNIST tutorial:")
    print(f"  no persistent cache      : {plain[0]:.2f} s, {plain[1]:.2f} s")
    print(f"  cache, cold (fills it)   : {cold:.2f} s  ({files} files written)")
    print(f"  cache, warm (reads it)   : {warm:.2f} s  -> saves {min(plain) - warm:.2f} s "
          f"({(min(plain) - warm) / min(plain):.0%}) per process")


if __name__ == "__main__":
    main()
