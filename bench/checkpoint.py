"""What checkpointing costs on the MNIST tutorial: per epoch, to restore, on disk.

Trains the tutorial's experiment (784-128-10 MLP, RAdam, accum 2) with and without
``checkpointer=jn.Checkpointer(keep=(jn.Best(3), jn.Last(1)))`` saving every epoch,
interleaved, and reports the medians:

* the cost of checkpointing as a fraction of epoch time (whole ``train()``, the final
  wait for the last save included), on the tutorial's default data (4,000 training
  images: 20 optimizer steps per epoch) and on a full-size epoch (55,000 images of
  synthetic data: 275 steps, as with ``--data-dir``); as wall time, as process CPU time
  (all threads: what the saves take from a machine's cores), and as the time the training
  loop itself spends in the checkpointer's hooks (the rest runs on its worker thread);
* the restore time: ``jn.Nitro(e, data=..., weights=(run, "best"))`` minus the same
  construction without ``weights``, and one plain orbax restore of a checkpoint's state;
* the disk used per checkpoint.

    python bench/checkpoint.py [--epochs 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "mnist"))

import jaxnitro as jn  # noqa: E402
from mnist_data import one_hot  # noqa: E402
from mnist_tutorial import BATCH, MnistMLP  # noqa: E402


def full_size_data(n_train: int = 55_000, n_val: int = 5_000) -> dict:
    rng = np.random.default_rng(0)
    y = rng.integers(0, 10, n_train + n_val).astype(np.int32)
    x = rng.random((n_train + n_val, 784), dtype=np.float32)

    def part(sl, **kw):
        return jn.ArraySource({"img": x[sl], "label": one_hot(y[sl]), "digit": y[sl]}, batch_size=BATCH, **kw)

    return {"train": part(slice(0, n_train), shuffle=True, drop_last=True, seed=0), "val": part(slice(n_train, None))}


def timed_train(e, data, run_dir, checkpointer) -> tuple[float, float]:
    """``(wall s, process CPU s)`` of one ``train()``."""
    n = jn.Nitro(e, data=data, run_dir=run_dir, logger=None, early_stop=None, checkpointer=checkpointer)
    t0, c0 = time.perf_counter(), time.process_time()
    n.train()
    return time.perf_counter() - t0, time.process_time() - c0


class HookClock:
    """Time the loop thread spends in the checkpointer's hooks."""

    def __init__(self):
        from jaxnitro.checkpointers import orbax as plugin

        self.plugin, self.spent, self.saved = plugin, 0.0, {}
        for name in ("epoch_trained", "epoch_end", "finish"):
            self.saved[name] = getattr(plugin._Saver, name)
            setattr(plugin._Saver, name, self.timed(self.saved[name]))

    def timed(self, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if fn.__name__ != "finish":  # the final wait is counted in the wall time
                    self.spent += time.perf_counter() - t0

        return wrapper


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def measure(label: str, data: dict, epochs: int, repeats: int, tmp: str, clock: HookClock) -> None:
    e = MnistMLP(max_epochs=epochs)
    keep = jn.Checkpointer(keep=(jn.Best(3), jn.Last(1)))
    timed_train(MnistMLP(max_epochs=1), data, tmp, keep)  # compile, import orbax
    plain, saved = [], []
    clock.spent = 0.0
    for _ in range(repeats):
        plain.append(timed_train(e, data, tmp, None))
        saved.append(timed_train(e, data, os.path.join(tmp, label), keep))
    p, s = statistics.median(w for w, _ in plain), statistics.median(w for w, _ in saved)
    pc, sc = statistics.median(c for _, c in plain), statistics.median(c for _, c in saved)
    print(f"{label}: {len(data['train']) // 2} optimizer steps per epoch, {epochs} epochs, median of {repeats}")
    print(f"  train() without checkpoints : {p:.3f} s ({p / epochs * 1000:.1f} ms per epoch), CPU {pc:.3f} s")
    print(f"  train() saving every epoch  : {s:.3f} s, CPU {sc:.3f} s -> checkpointing costs "
          f"{(s - p) / p:+.1%} of the wall time, {(sc - pc) / pc:+.1%} of the CPU time")
    print(f"  in the loop's thread        : {clock.spent / (repeats * epochs) * 1000:.2f} ms per epoch "
          f"({clock.spent / repeats / p:.1%} of the epoch time); the writes run on a worker thread")
    runs = sorted(Path(tmp, label).iterdir())
    steps = sorted((runs[-1] / "checkpoints").iterdir())
    sizes = [du(s_) for s_ in steps if s_.name.isdigit()]
    print(f"  disk per checkpoint         : {statistics.median(sizes) / 1e6:.2f} MB "
          f"({len(sizes)} kept of {epochs} saved)")
    # restore
    build = []
    load = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jn.Nitro(e, data=data, run_dir=tmp, logger=None)
        build.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        jn.Nitro(e, data=data, run_dir=tmp, logger=None, weights=(str(runs[-1]), "best"))
        load.append(time.perf_counter() - t0)
    import orbax.checkpoint as ocp

    mgr = ocp.CheckpointManager(str(runs[-1] / "checkpoints"))
    t0 = time.perf_counter()
    mgr.restore(mgr.latest_step(), args=ocp.args.Composite(state=ocp.args.StandardRestore()))
    raw = time.perf_counter() - t0
    print(f"  restore, weights=(run, 'best'): {statistics.median(load) - statistics.median(build):.3f} s "
          f"over a plain Nitro(e) ({statistics.median(build):.3f} s); one orbax restore of the whole state: {raw:.3f} s")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    jn.progress_reporter(None)
    clock = HookClock()
    with tempfile.TemporaryDirectory() as tmp:
        default = jn.Nitro(MnistMLP(), run_dir=tmp, logger=None).data
        measure("tutorial data", default, args.epochs, args.repeats, tmp, clock)
        measure("full-size epoch", full_size_data(), max(args.epochs // 2, 2), args.repeats, tmp, clock)


if __name__ == "__main__":
    main()
