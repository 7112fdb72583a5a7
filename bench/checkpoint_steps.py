"""What checkpoints every N optimizer steps cost: the share of a run's wall time.

Trains the tutorial's experiment (784-128-10 MLP, RAdam, accum 2) for a fixed number of
optimizer steps on full-size data (the Fashion-MNIST IDX files of Debian's
``dataset-fashion-mnist`` with ``--data-dir``, else 55,000 synthetic images: 275 steps an
epoch either way), with no checkpointer and with ``jn.Checkpointer(every_n_steps=N,
keep=(jn.Best(2), jn.Last(1)))`` for each N, interleaved, and prints the medians and the
share ``(t_N - t_none) / t_N`` (goal: under 2% at N = 1,000). The whole ``train()`` is
timed, the wait for the last save at the run's end included; every run validates every
N steps too, so only the checkpoints differ between the timed contenders.

    python bench/checkpoint_steps.py [--steps 3000] [--every 100 1000] [--repeats 3] [--data-dir DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "mnist"))
sys.path.insert(0, str(ROOT / "bench"))

import jaxnitro as jn  # noqa: E402
from checkpoint import full_size_data  # noqa: E402
from mnist_tutorial import MnistMLP  # noqa: E402


def fashion_data(folder: str) -> dict:
    """The IDX files' 60,000 training images as train (55,000) and val (5,000) splits."""
    from mnist_data import load_idx_dir, one_hot  # noqa: PLC0415
    from mnist_tutorial import BATCH  # noqa: PLC0415

    x, y = load_idx_dir(folder)["train"]
    def part(sl, **kw):
        return jn.ArraySource({"img": x[sl], "label": one_hot(y[sl]), "digit": y[sl]}, batch_size=BATCH, **kw)

    return {"train": part(slice(0, 55_000), shuffle=True, drop_last=True, seed=0), "val": part(slice(55_000, None))}


def timed(e, data, run_dir, steps: int, val_every: int, checkpointer) -> float:
    n = jn.Nitro(e, data=data, run_dir=run_dir, logger=None, early_stop=None, max_steps=steps, max_epochs=None,
                 val_every_n_steps=val_every, checkpointer=checkpointer)
    t0 = time.perf_counter()
    n.train()
    return time.perf_counter() - t0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--every", type=int, nargs="+", default=[100, 1000])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--data-dir", default=None)
    a = ap.parse_args(argv)
    data = fashion_data(a.data_dir) if a.data_dir else full_size_data()
    e = MnistMLP()
    with tempfile.TemporaryDirectory() as tmp:
        for n in a.every:  # compile and warm every program (and orbax) once, untimed
            timed(e, data, f"{tmp}/warm", min(a.steps, 2 * n), n, jn.Checkpointer(every_n_steps=n))
        rows = {n: {"none": [], "ckpt": []} for n in a.every}
        for r in range(a.repeats):
            for n in a.every:
                rows[n]["none"].append(timed(e, data, f"{tmp}/{r}-{n}-none", a.steps, n, None))
                ckpt = jn.Checkpointer(every_n_steps=n, keep=(jn.Best(2), jn.Last(1)))
                rows[n]["ckpt"].append(timed(e, data, f"{tmp}/{r}-{n}-ckpt", a.steps, n, ckpt))
    print(f"{a.steps} optimizer steps, {'IDX files in ' + a.data_dir if a.data_dir else '55,000 synthetic images'}; "
          f"medians of {a.repeats} interleaved runs")
    print(f"{'every N':>8} | {'no ckpt s':>9} | {'ckpt s':>7} | {'saves':>5} | share")
    for n in a.every:
        none, ckpt = statistics.median(rows[n]["none"]), statistics.median(rows[n]["ckpt"])
        print(f"{n:>8} | {none:>9.3f} | {ckpt:>7.3f} | {a.steps // n:>5} | {(ckpt - none) / ckpt:6.1%}")


if __name__ == "__main__":
    main()
