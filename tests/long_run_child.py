"""A step-budgeted run that SIGKILLs itself (used by test_long_runs.py).

``python long_run_child.py <run_dir> <kill_at_step> '<json options>'`` trains :class:`LongRun`
(an :class:`~jaxnitro.ArraySource` over 3 epochs of 200 steps, or with ``"stream": "grain"``
a grain ``IterDataset`` streamed as one epoch of 600 steps; a one-cycle learning rate,
``val_every_n_steps`` and ``Checkpointer(every_n_steps=...)``) and kills itself, with no
cleanup, as soon as a stretch read back from the device reaches ``kill_at_step`` (0: never),
or, with ``"sigterm": true`` in the options, sends itself a SIGTERM there (a preemption). The class and the run's keywords live here
so that the test process and the child agree on them.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import jax.numpy as jnp
import numpy as np
import optax

import jaxnitro as jn
from jaxnitro.plugin_manager import plugin_manager
from tiny import TinyCore, make_arrays

STEPS_PER_EPOCH = 200


@jn.experiment
class LongRun(TinyCore):
    def learning_rate(self):
        return 1e-2

    def monitor(self):
        return ("loss", "min")

    def train_metrics(self, logits, *, y):
        return {"acc": jnp.mean(jnp.argmax(logits, -1) == y)}


def data(workers: int = 0, accum: int = 1, batch: int = 4) -> dict:
    """train: 200 * accum batches of ``batch`` rows, shuffled per epoch (seeded); val: 24 rows."""
    n = STEPS_PER_EPOCH * accum * batch
    x, y, oh = make_arrays(n + 24, seed=5)
    train = jn.ArraySource({"x": x[:n], "label": oh[:n], "y": y[:n]}, batch_size=batch, shuffle=True,
                           drop_last=True, seed=11)
    val = jn.ArraySource({"x": x[n:], "label": oh[n:], "y": y[n:]}, batch_size=batch)
    if workers:
        train = jn.PrefetchIterator(train, workers=workers)
    return {"train": train, "val": val}


def grain_stream(batch: int = 4) -> dict:
    """train: a grain ``IterDataset`` of 600 batches of ``batch`` rows (one epoch: ``max_steps=600``
    reads it once), shuffled (seeded) before it is streamed, no read threads in grain; val: 24 rows."""
    import grain

    n = 3 * STEPS_PER_EPOCH * batch
    x, y, oh = make_arrays(n + 24, seed=5)
    records = grain.MapDataset.source(np.arange(n)).seed(11).shuffle().map(
        lambda i: {"x": x[i], "label": oh[i], "y": y[i]})
    serial = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
    train = records.to_iter_dataset(serial).batch(batch, drop_remainder=True)
    val = jn.ArraySource({"x": x[n:], "label": oh[n:], "y": y[n:]}, batch_size=batch)
    return {"train": train, "val": val}


def keywords(opts: dict) -> dict:
    """The run's keywords: ``max_steps``, ``val_every_n_steps``, the checkpointer, a one-cycle
    learning rate over the run, ``accum`` and ``steps_per_dispatch`` from ``opts``."""
    every = opts.get("every", 100)
    return dict(
        data=grain_stream() if opts.get("stream") == "grain" else data(opts.get("workers", 0), opts.get("accum", 1)),
        max_steps=opts.get("max_steps", 600),
        val_every_n_steps=opts.get("val_every", 100),
        # synchronous: every save due before the kill is on disk (paced saves may still be held)
        checkpointer=jn.Checkpointer(every_n_steps=every, keep=(jn.Best(2), jn.Last(1)), asynchronous=False),
        schedules={"learning_rate": lambda total: optax.cosine_onecycle_schedule(total, 1e-2)},
        accum=opts.get("accum", 1),
        steps_per_dispatch=opts.get("k", 1),
    )


class Killer:
    """A plugin that ends the process once a read stretch reaches step ``at``."""

    def __init__(self, at: int, sig: int):
        self.at, self.sig, self.sent = at, sig, False

    @jn.hookimpl
    def jaxnitro_steps_read(self, run, stretch):
        if self.at and not self.sent and stretch.first_step + len(stretch) - 1 >= self.at:
            self.sent = True
            os.kill(os.getpid(), self.sig)


def main(run_dir: str, at: int, opts: dict) -> None:
    sig = signal.SIGTERM if opts.get("sigterm") else signal.SIGKILL
    plugin_manager().register(Killer(at, sig), name="killer")
    resume = "auto" if opts.get("resume") else False
    jn.train(LongRun(), run_dir=run_dir, logger="jsonl", resume=resume, **keywords(opts))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]))
