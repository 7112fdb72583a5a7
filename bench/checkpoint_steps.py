"""What checkpoints every N optimizer steps cost: the share of a run's wall time.

Trains the tutorial's experiment (784-128-10 MLP, RAdam, accum 2) for a fixed number of
optimizer steps on full-size data (the Fashion-MNIST IDX files of Debian's
``dataset-fashion-mnist`` with ``--data-dir``, else 55,000 synthetic images: 275 steps an
epoch either way), with no checkpointer and with ``jn.Checkpointer(every_n_steps=N,
keep=(jn.Best(2), jn.Last(1)))`` for each N, interleaved (which of the two goes first
alternates from one repeat to the next), and prints the medians and the
share ``(t_N - t_none) / t_N`` (goal: under 2% at N = 1,000). The whole ``train()`` is
timed, the wait for the last save at the run's end included; every run validates every
N steps too, so only the checkpoints differ between the timed contenders.

Beside the wall-time share (noisy on shared cores: other processes' load moves a run by more
than the checkpoints cost), it prints the share of the process CPU time, and what the loop's
own thread spends in the checkpointer (``loop ms``: its hooks at run start and at each step
boundary, and the run's end waiting for the last writes, ``end ms``), with the checkpoints
written and dropped unwritten (queued ones the keep policies would have deleted) per run.
``--steps 3000 --repeats 1`` is a quick look; the issue's figure is ``--steps 11000``.

``--parts`` adds two contenders that take a save apart: ``snapshots`` runs the checkpointer
with orbax's save skipped (the device snapshot, the record, the queue and the writer thread's
host copy only), ``record`` saves only the checkpoint's JSON record through orbax (its
manager and an item, no arrays). Neither writes a usable checkpoint; their shares against
the full save's say what the arrays cost.

    python bench/checkpoint_steps.py [--steps 3000] [--every 100 1000] [--repeats 3] [--data-dir DIR] [--parts]
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

import jax  # noqa: E402

import jaxnitro as jn  # noqa: E402
from checkpoint import HookClock, full_size_data  # noqa: E402
from mnist_tutorial import MnistMLP  # noqa: E402


def fashion_data(folder: str) -> dict:
    """The IDX files' 60,000 training images as train (55,000) and val (5,000) splits."""
    from mnist_data import load_idx_dir, one_hot  # noqa: PLC0415
    from mnist_tutorial import BATCH  # noqa: PLC0415

    x, y = load_idx_dir(folder)["train"]
    def part(sl, **kw):
        return jn.ArraySource({"img": x[sl], "label": one_hot(y[sl]), "digit": y[sl]}, batch_size=BATCH, **kw)

    return {"train": part(slice(0, 55_000), shuffle=True, drop_last=True, seed=0), "val": part(slice(55_000, None))}


def LoopClock():
    """:class:`checkpoint.HookClock` over the saver's ``__init__`` (made at the run's start)
    and its step-boundary hook (``spent``), and ``finish`` (``ending``)."""
    return HookClock(("__init__", "step_boundary", "finish"))


class SaveParts:
    """Switch the checkpointer's ``_Saver.write`` between the full save (``"ckpt"``), none
    (``"snapshots"``: the host copy only) and the JSON record alone (``"record"``)."""

    def __init__(self):
        from jaxnitro.checkpointers import orbax as plugin

        self.kind, full = "ckpt", plugin._Saver.write
        ocp = plugin._ocp()

        def write(saver, item):
            if self.kind == "ckpt":
                return full(saver, item)
            jax.device_get(item.state.params)  # what every save transfers before orbax starts
            if self.kind == "record":
                saver.mgr.save(item.step, args=ocp.args.Composite(meta=ocp.args.JsonSave(item.meta)),
                               metrics=item.metrics, force=True)
            saver.written += 1

        plugin._Saver.write = write


def timed(e, data, run_dir, steps: int, val_every: int, checkpointer) -> tuple[float, float]:
    """``(wall s, process CPU s)`` of one ``train()``."""
    n = jn.Nitro(e, data=data, run_dir=run_dir, logger=None, early_stop=None, max_steps=steps, max_epochs=None,
                 val_every_n_steps=val_every, checkpointer=checkpointer)
    t0, c0 = time.perf_counter(), time.process_time()
    n.train()
    return time.perf_counter() - t0, time.process_time() - c0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--every", type=int, nargs="+", default=[100, 1000])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--parts", action="store_true", help="add the snapshots-only and record-only contenders")
    a = ap.parse_args(argv)
    data = fashion_data(a.data_dir) if a.data_dir else full_size_data()
    e = MnistMLP()
    clock = LoopClock()
    kinds = ["none", "ckpt"] + (["snapshots", "record"] if a.parts else [])
    parts = SaveParts()
    with tempfile.TemporaryDirectory() as tmp:
        for n in a.every:  # compile and warm every program (and orbax) once, untimed
            timed(e, data, f"{tmp}/warm", min(a.steps, 2 * n), n, jn.Checkpointer(every_n_steps=n))
        rows = {n: {k: [] for k in kinds} for n in a.every}
        loop = {n: [0.0, 0.0, 0, 0] for n in a.every}  # spent, ending, written, dropped: summed over the repeats
        for r in range(a.repeats):
            for n in a.every:
                # the contenders' order rotates from repeat to repeat: a run right after a
                # checkpointed one inherits its writes' page cache and thread churn
                for kind in kinds[r % len(kinds):] + kinds[:r % len(kinds)]:
                    ckpt = None if kind == "none" else jn.Checkpointer(every_n_steps=n, keep=(jn.Best(2), jn.Last(1)))
                    clock.reset()
                    parts.kind = kind
                    rows[n][kind].append(timed(e, data, f"{tmp}/{r}-{n}-{kind}", a.steps, n, ckpt))
                    if kind == "ckpt":
                        for i, got in enumerate((clock.spent, clock.ending, clock.written, clock.dropped)):
                            loop[n][i] += got
    report(a, rows, loop)


def report(a, rows: dict, loop: dict) -> None:
    """The table: per N, the medians and the shares (``share``: of the median run
    times; ``paired``: the median over the repeats of each checkpointed run's share against
    the run without checkpoints next to it, which a drifting machine moves less)."""
    print(f"{a.steps} optimizer steps, {'IDX files in ' + a.data_dir if a.data_dir else '55,000 synthetic images'}; "
          f"medians of {a.repeats} interleaved runs, the contenders' order rotating")
    print(f"{'every N':>8} | {'no ckpt s':>9} | {'ckpt s':>7} | {'saves':>5} | {'written':>7} | "
          f"{'dropped':>7} | {'share':>6} | {'paired':>6} | {'CPU share':>9} | {'loop ms':>7} | {'end ms':>6} | loop share")
    for n in a.every:
        none = statistics.median(t for t, _ in rows[n]["none"])
        ckpt, _ = shares(rows[n], "ckpt")
        spent, ending, written, dropped = (x / a.repeats for x in loop[n])
        print(f"{n:>8} | {none:>9.3f} | {ckpt:>7.3f} | {a.steps // n:>5} | {written:>7.1f} | "
              f"{dropped:>7.1f} | {shares(rows[n], 'ckpt')[1]} | {spent * 1e3:>7.0f} | {ending * 1e3:>6.0f} | "
              f"{(spent + ending) / ckpt:6.2%}")
        for kind in ("snapshots", "record"):
            if kind in rows[n]:
                t, text = shares(rows[n], kind)
                print(f"{'':>8} | {kind:>9} | {t:>7.3f} | {'':>5} | {'':>7} | {'':>7} | {text} |")


def shares(rows: dict, kind: str) -> tuple[float, str]:
    """``kind``'s median wall time, and its share, paired share and CPU share against ``none``."""
    (none, none_cpu), (t, cpu) = ((statistics.median(x) for x in zip(*rows[k])) for k in ("none", kind))
    paired = statistics.median((c - o) / c for (c, _), (o, _) in zip(rows[kind], rows["none"]))
    return t, f"{(t - none) / t:6.1%} | {paired:6.1%} | {(cpu - none_cpu) / cpu:9.1%}"

if __name__ == "__main__":
    main()
