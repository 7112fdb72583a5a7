"""A child process of tests/test_scale_out.py: one process of a data-parallel job.

``python scale_out_child.py <out.json> <run_dir> <n_procs> <process_id> <port> <local_devices> [extra knobs as JSON]``

Trains a tiny classifier on ``jn.ArraySource`` splits (shuffled train, a val split
ending with a partial batch) and writes the params, the history, the splits' row
counts and the cache stats to ``out.json`` (process 0 only, unless ``n_procs`` is 1).
"""

from __future__ import annotations

import json
import sys

out, run_dir, n_procs, pid, port, local = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7])
extra = json.loads(sys.argv[7]) if len(sys.argv) > 7 else {}

import jaxnitro as jn  # noqa: E402

if n_procs > 1:
    jn.distributed.initialize(f"127.0.0.1:{port}", n_procs, pid, local_device_count=local, heartbeat_timeout_s=10)
else:
    jn.setup_devices(local)

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxnitro import GraphConst  # noqa: E402


def arrays(n, seed=0):
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(4, 8)) * 3
    y = rng.integers(0, 4, size=n).astype(np.int32)
    x = (centers[y] + rng.normal(size=(n, 8))).astype(np.float32)
    return x, y


@jn.experiment
class Par:
    width: GraphConst[int] = 16
    seen: list = jn.field(factory=list)

    def build_data(self, dist):
        self.seen.append(None if dist is None else (dist.process_index, dist.process_count, len(dist.local_devices)))
        x, y = arrays(200)
        return {
            "train": jn.ArraySource({"x": x[:128], "y": y[:128]}, batch_size=16, shuffle=True, drop_last=True, seed=1),
            "val": jn.ArraySource({"x": x[128:], "y": y[128:]}, batch_size=16),  # 72 rows: a partial batch of 8
        }

    def build_model(self, key):
        return eqx.nn.MLP(8, 4, self.width, 1, key=key)

    def forward(self, model, state, *, x):
        return jax.vmap(model)(x), state

    def loss(self, logits, *, y):
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))

    def metrics(self, logits, *, y):
        right = np.argmax(logits, -1) == y
        return {"acc": (right.sum(), len(y)), "n": (len(y), "sum"), "top": (float(np.max(logits)), "max"), "low": (float(np.min(logits)), "min"),
                "pred": (np.argmax(logits, -1), "concat")}

    def monitor(self):
        return ("acc", "max")

    def learning_rate(self):
        return 1e-2


knobs = dict(max_epochs=3, seed=0, run_dir=run_dir, logger="jsonl")
knobs.update(extra)
die_at = knobs.pop("die_at_epoch", None)
if die_at is not None and pid == 1:  # a lost process: exit without a word once epoch `die_at` is validated
    import os

    calls = []

    def finalize_metrics(self, acc, split):
        calls.append(split)
        if len(calls) == die_at + 1:  # setup checks the first val batch once
            os._exit(17)
        return acc

    Par.finalize_metrics = finalize_metrics
term_at = knobs.pop("term_at_step", None)
if term_at is not None and pid == 1:  # one host preempted: SIGTERM to process 1 alone, once step `term_at` is read
    import os
    import signal

    class TermOne:
        @jn.hookimpl
        def jaxnitro_steps_read(self, run, stretch):
            if stretch.first_step + len(stretch) - 1 >= term_at:
                jn.plugin_manager.plugin_manager().unregister(name="term-one")
                os.kill(os.getpid(), signal.SIGTERM)

    jn.plugin_manager.plugin_manager().register(TermOne(), name="term-one")
if "checkpointer" in knobs:
    knobs["checkpointer"] = jn.Checkpointer(keep=(jn.Last(2),))
if "early_stop" in knobs:  # patience N; no improvement can reach min_delta=10, so it stops after epoch N + 1
    knobs["early_stop"] = jn.EarlyStopping(patience=knobs["early_stop"], min_delta=10.0)
e = Par()
nitro = jn.Nitro(e, **knobs)
nitro.train()
hits, misses, entries = jn.cache_stats()


def whole(a):
    """A global array's value on this process (sharded params of several processes: gathered)."""
    if a.is_fully_addressable:
        return np.asarray(a)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(a, tiled=True))


result = {
    "params": [whole(a).tolist() for a in jax.tree_util.tree_leaves(nitro.params)],
    "opt_state": [whole(a).tolist() for a in jax.tree_util.tree_leaves(nitro.opt_state)],
    "shards": [sorted({tuple(s.data.shape) for s in a.addressable_shards}) for a in jax.tree_util.tree_leaves(nitro.params)],
    "rows": [{k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in r.items()} for r in nitro.rows],
    "run_dir": nitro.run_dir,
    "seen": e.seen,
    "train_batches": len(nitro.data["train"]),
    "val_batches": len(nitro.data["val"]),
    "width": nitro.plan.width,
    "n_devs": nitro.settings.n_devs,
    "misses": misses,
    "report": repr(nitro),
    "replicated": all(a.sharding.is_fully_replicated for a in jax.tree_util.tree_leaves(nitro.params)),
    "stop_reason": nitro.record.stop_reason,
}
if "checkpointer" in knobs:  # what the run's last checkpoint holds, read back into a new handle
    restored = jn.Nitro(Par(), run_dir=run_dir, weights=(nitro.run_dir, "last"), logger=None)
    result["checkpoint_params"] = [np.asarray(a).tolist() for a in jax.tree_util.tree_leaves(restored.params)]
if n_procs == 1 or pid == 0:
    with open(out, "w") as f:
        json.dump(result, f)
