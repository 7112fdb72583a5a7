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
  the run's end, which waits for the last saves, separately; how many saves were written
  and how many dropped unwritten (queued saves the keep policies would have deleted);
* the restore time: ``jn.Nitro(e, data=..., weights=(run, "best"))`` minus the same
  construction without ``weights``, and one plain orbax restore of a checkpoint's state;
* the disk used per checkpoint;
* the anatomy of one save: orbax's CPU time for the whole checkpoint and for its JSON
  record alone, the keep/delete decision, and deleting a checkpoint folder.

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
    """Time the loop thread spends in the checkpointer's ``methods`` (``spent``) and in the
    run's end (``ending``: ``finish``, the wait for the last saves); saves written and dropped."""

    def __init__(self, methods=("epoch_trained", "epoch_end", "finish")):
        from jaxnitro.checkpointers import orbax as plugin

        self.plugin, self.saved = plugin, {}
        self.reset()
        for name in methods:
            self.saved[name] = getattr(plugin._Saver, name)
            setattr(plugin._Saver, name, self.timed(self.saved[name]))

    def reset(self):
        self.spent = self.ending = 0.0
        self.written = self.dropped = 0

    def timed(self, fn):
        def wrapper(saver, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(saver, *args, **kwargs)
            finally:
                if fn.__name__ == "finish":
                    self.ending += time.perf_counter() - t0
                    self.written += saver.written
                    self.dropped += saver.dropped
                else:
                    self.spent += time.perf_counter() - t0

        return wrapper


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def measure(label: str, data: dict, epochs: int, repeats: int, tmp: str, clock: HookClock) -> None:
    e = MnistMLP(max_epochs=epochs)
    policies = (jn.Best(3), jn.Last(1))
    variants = {  # label -> checkpointer, interleaved with the runs without one
        "default (min_interval='auto')": jn.Checkpointer(keep=policies),
        "every epoch (min_interval=0)": jn.Checkpointer(keep=policies, min_interval=0),
    }
    timed_train(MnistMLP(max_epochs=1), data, tmp, variants["every epoch (min_interval=0)"])  # compile, import orbax
    plain, saved, clocks = [], {v: [] for v in variants}, {v: [0.0, 0.0, 0, 0] for v in variants}
    for _ in range(repeats):
        plain.append(timed_train(e, data, tmp, None))
        for v, ckpt in variants.items():
            clock.reset()
            saved[v].append(timed_train(e, data, os.path.join(tmp, label), ckpt))
            for i, got in enumerate((clock.spent, clock.ending, clock.written, clock.dropped)):
                clocks[v][i] += got
    p, pc = statistics.median(w for w, _ in plain), statistics.median(c for _, c in plain)
    print(f"{label}: {len(data['train']) // 2} optimizer steps per epoch, {epochs} epochs, median of {repeats}")
    print(f"  train() without checkpoints : {p:.3f} s ({p / epochs * 1000:.1f} ms per epoch), CPU {pc:.3f} s")
    for v in variants:
        s, sc = statistics.median(w for w, _ in saved[v]), statistics.median(c for _, c in saved[v])
        spent, ending, written, dropped = (x / repeats for x in clocks[v])
        print(f"  {v}:")
        print(f"    train()                   : {s:.3f} s, CPU {sc:.3f} s -> checkpointing costs "
              f"{(s - p) / p:+.1%} of the wall time, {(sc - pc) / pc:+.1%} of the CPU time")
        print(f"    in the loop's thread      : {spent / epochs * 1000:.2f} ms per epoch "
              f"({spent / p:.1%} of the epoch time); the writes run on a worker thread")
        print(f"    the run's end             : {ending * 1000:.0f} ms waiting for the last saves; without it "
              f"checkpointing costs {(s - ending - p) / p:+.1%} of the wall time")
        print(f"    saves                     : {written:.1f} written, {dropped:.1f} dropped unwritten "
              f"(the keep policies would have deleted them) of {epochs} per run")
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
    anatomy(mgr, mgr.latest_step(), tmp)


def anatomy(mgr, step: int, tmp: str, n: int = 10) -> None:
    """What one save is made of, measured on the worker's calls, one at a time."""
    import shutil

    import orbax.checkpoint as ocp
    from jaxnitro.checkpointers import orbax as plugin

    got = mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore()))
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False, max_to_keep=1)

    def cpu_per_save(**items) -> tuple[float, float]:
        out = ocp.CheckpointManager(os.path.join(tmp, f"anatomy-{'-'.join(items)}"), options=options)
        out.save(0, args=ocp.args.Composite(**items), force=True)  # warm
        t0, c0 = time.perf_counter(), time.process_time()
        for i in range(1, n + 1):  # each save also deletes the previous one (max_to_keep=1)
            out.save(i, args=ocp.args.Composite(**items), force=True)
        out.close()
        return (time.perf_counter() - t0) / n, (time.process_time() - c0) / n

    whole = cpu_per_save(state=ocp.args.StandardSave(got["state"]), meta=ocp.args.JsonSave(got["meta"]))
    record = cpu_per_save(meta=ocp.args.JsonSave(got["meta"]))
    policy = plugin._policy((plugin.Best(3), plugin.Last(1)), ("macro_recall", "max"), {})
    listed = [plugin._Known(s, {plugin._EPOCH_END: 1.0, "macro_recall": s / 100}, None) for s in range(0, 200, 20)]
    t0 = time.perf_counter()
    for _ in range(100):
        policy.should_preserve(listed, context=ocp.checkpoint_managers.PreservationContext())
    decide = (time.perf_counter() - t0) / 100
    deletes = []
    for i in range(n):
        copy = os.path.join(tmp, f"anatomy-delete-{i}")
        shutil.copytree(os.path.join(mgr.directory, str(step)), copy)
        t0 = time.perf_counter()
        shutil.rmtree(copy)
        deletes.append(time.perf_counter() - t0)
    print(f"  one save (worker thread)    : {whole[0] * 1000:.0f} ms wall, {whole[1] * 1000:.0f} ms CPU (all threads); "
          f"of which the JSON record item {record[1] * 1000:.0f} ms CPU; the keep/delete decision over 10 "
          f"checkpoints {decide * 1e6:.0f} us; deleting one checkpoint folder {statistics.median(deletes) * 1000:.1f} ms")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=30, help="the example's default")
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
