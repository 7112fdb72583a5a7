"""Sharded parameters on 4 forced CPU devices and on 2 processes x 2 devices (slow: fresh processes).

* FSDP: every leaf with a dimension that divides by 4 is split (each device holds a quarter:
  ``addressable_shards``), the optimizer state too; params, history and validation equal the
  replicated run's; ``steps_per_dispatch``, ``accum`` and the EMA shard the same way;
* a 2 x 2 ``data`` x ``model`` mesh with a ``param_sharding`` hook (a column-parallel then a
  row-parallel layer): the same numbers;
* checkpoints written sharded restore onto 1, 2 and 4 devices, replicated or FSDP, and in a
  process with 2 devices;
* 2 processes x 2 devices with FSDP train as 1 process x 4 devices.

Tolerance: the same as data parallelism's (``test_scale_out_multi.py``), ``atol=1e-6, rtol=1e-5``:
a split parameter's gradient is reduce-scattered rather than all-reduced, so the float32 sums run
in another order (a few ulps a step). Measured after 12 RAdam steps of the tiny MLP: 1.5e-8 (FSDP
and the 2 x 2 mesh against one device), and the history's losses equal to the printed digits.
"""

from __future__ import annotations

import json
import subprocess
import textwrap

import numpy as np
import pytest

from test_scale_out_multi import PY, RTOL, _child, _close, _env, _free_port, _rows_close, _wait

pytestmark = pytest.mark.slow

FOUR_DEVICES = textwrap.dedent(
    """
    import json, os
    import jaxnitro as jn
    jn.setup_devices(4)
    import jax, numpy as np
    from jax.sharding import PartitionSpec as P
    from tiny import Tiny, tiny_data

    def leaves(tree):
        return [np.asarray(a).tolist() for a in jax.tree_util.tree_leaves(tree)]

    def shards(tree):
        return [sorted({tuple(s.data.shape) for s in a.addressable_shards}) for a in jax.tree_util.tree_leaves(tree)]

    @jn.experiment
    class TP(Tiny):
        def param_sharding(self, path, leaf):
            return {("l1", "weight"): P("model", None), ("l1", "bias"): P("model"),
                    ("l2", "weight"): P(None, "model")}.get(path)

    out = {}
    runs = os.path.abspath("runs")
    for name, e, knobs in (("one", Tiny(), {"n_devs": 1}), ("rep", Tiny(), {}),
                           ("fsdp", Tiny(), {"sharding": "fsdp", "run_dir": runs, "logger": "jsonl",
                                             "checkpointer": jn.Checkpointer(keep=(jn.Last(1),))}),
                           ("fsdp_k2", Tiny(), {"sharding": "fsdp", "steps_per_dispatch": 2}),
                           ("fsdp_accum", Tiny(), {"sharding": "fsdp", "accum": 2}),
                           ("one_accum", Tiny(), {"n_devs": 1, "accum": 2}),
                           ("fsdp_ema", Tiny(), {"sharding": "fsdp", "ema": jn.EMA(0.9)}),
                           ("one_ema", Tiny(), {"n_devs": 1, "ema": jn.EMA(0.9)}),
                           ("tp", TP(), {"mesh_shape": {"data": 2, "model": 2}})):
        knobs.setdefault("logger", None)
        nitro = jn.Nitro(e, data=tiny_data(), max_epochs=2, **knobs)
        nitro.train()
        out[name] = {"params": leaves(nitro.params), "opt": leaves(nitro.opt_state), "rows": nitro.rows,
                     "val": nitro.validate(), "shards": shards(nitro.params), "opt_shards": shards(nitro.opt_state),
                     "specs": [str(getattr(a.sharding, "spec", None)) for a in jax.tree_util.tree_leaves(nitro.params)],
                     "report": " ".join(repr(nitro).split())}
        if name == "fsdp":
            saved = nitro
    # the FSDP checkpoint, restored onto other device counts and layouts
    for n, sharding in ((1, "replicated"), (2, "fsdp"), (2, "replicated"), (4, "fsdp")):
        r = jn.Nitro(Tiny(), data=tiny_data(), logger=None, n_devs=n, sharding=sharding, resume="auto",
                     run_dir=runs, max_epochs=3)
        out[f"restored_{n}_{sharding}"] = {"params": leaves(r.params), "opt": leaves(r.opt_state), "step": r.step,
                                           "shards": shards(r.params)}
    r = jn.Nitro(Tiny(), data=tiny_data(), logger=None, n_devs=2, sharding="fsdp", weights=(saved.run_dir, "last"))
    out["weights_2_fsdp"] = {"params": leaves(r.params), "shards": shards(r.params)}
    try:
        @jn.experiment
        class Bad(Tiny):
            width: jn.GraphConst[int] = 6
            def param_sharding(self, path, leaf):
                return P("model") if path == ("l1", "weight") else None
        jn.Nitro(Bad(), data=tiny_data(), logger=None, mesh_shape={"data": 1, "model": 4})
    except ValueError as err:
        out["indivisible"] = str(err)
    print("RESULT" + json.dumps(out))
    """
)

TWO_DEVICES = textwrap.dedent(
    """
    import json, os
    import jaxnitro as jn
    jn.setup_devices(2)
    import jax, numpy as np
    from tiny import Tiny, tiny_data
    r = jn.Nitro(Tiny(), data=tiny_data(), logger=None, sharding="fsdp", resume="auto",
                 run_dir=os.path.abspath("runs"), max_epochs=3)
    before = [np.asarray(a).tolist() for a in jax.tree_util.tree_leaves((r.params, r.opt_state))]
    shards = [sorted({tuple(s.data.shape) for s in a.addressable_shards}) for a in jax.tree_util.tree_leaves(r.params)]
    r.train()
    print("RESULT" + json.dumps({"state": before, "shards": shards, "rows": r.rows}))
    """
)


def _run(script, cwd):
    res = subprocess.run([PY, "-c", script], capture_output=True, text=True, env=_env(), timeout=300, cwd=cwd)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.split("RESULT", 1)[1])


def test_fsdp_and_a_two_by_two_mesh_split_the_params_and_train_as_one_device(tmp_path):
    out = _run(FOUR_DEVICES, tmp_path)
    one, rep, fsdp, tp = out["one"], out["rep"], out["fsdp"], out["tp"]
    # Tiny's leaves: l1.weight (16, 8), l1.bias (16,), l2.weight (4, 16), l2.bias (4,)
    assert fsdp["specs"] == ["P('data',)", "P('data',)", "P(None, 'data')", "P('data',)"]
    assert fsdp["shards"] == [[[4, 8]], [[4]], [[4, 4]], [[1]]]  # a quarter of every leaf on every device
    assert rep["shards"] == [[[16, 8]], [[16]], [[4, 16]], [[4]]]
    # the optimizer state follows: RAdam's two moments split like their leaf; the count whole
    moments = [s for s in fsdp["opt_shards"] if s != [[]]]
    assert moments == fsdp["shards"] * 2
    assert "params fsdp over 'data' (4 of 4 leaves split), optimizer state follows" in fsdp["report"]
    assert tp["shards"] == [[[8, 8]], [[8]], [[4, 8]], [[4]]]  # split in two over 'model'; l2.bias whole
    assert "mesh: 4 devices, axes 'data' 2 x 'model' 2, 1 process | batch 16 = 8 per device" in tp["report"]
    assert "params split by param_sharding (3 of 4 leaves split)" in tp["report"]
    for run in (rep, fsdp, tp):
        _close(one["params"], run["params"])
        _close(one["opt"], run["opt"])
        _rows_close(one["rows"], run["rows"])
        assert run["val"] == pytest.approx(one["val"], rel=RTOL)
    _close(fsdp["params"], out["fsdp_k2"]["params"])
    _close(out["one_accum"]["params"], out["fsdp_accum"]["params"])
    _close(out["one_ema"]["opt"], out["fsdp_ema"]["opt"])  # the EMA lives in the optimizer state
    assert out["fsdp_ema"]["val"] == pytest.approx(out["one_ema"]["val"], rel=RTOL)
    # the FSDP checkpoint restores onto 1, 2 and 4 devices, replicated or split, exactly
    for key, shards in (("restored_1_replicated", one["shards"]), ("restored_2_fsdp", [[[8, 8]], [[8]], [[4, 8]], [[2]]]),
                        ("restored_2_replicated", rep["shards"]), ("restored_4_fsdp", fsdp["shards"])):
        assert out[key]["step"] == 12 and out[key]["shards"] == shards, key
        np.testing.assert_array_equal(np.concatenate([np.ravel(a) for a in out[key]["params"]]),
                                      np.concatenate([np.ravel(a) for a in fsdp["params"]]))
        for a, b in zip(out[key]["opt"], fsdp["opt"]):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert out["weights_2_fsdp"]["shards"] == [[[8, 8]], [[8]], [[4, 8]], [[2]]]
    msg = out["indivisible"]
    assert "returned P('model',) for the parameter .l1.weight (shape (6, 8)): dimension 0 has size 6, which does not divide among the 4 devices of 'model'" in msg
    # a process with 2 devices resumes the 4-device FSDP run and trains on
    two = _run(TWO_DEVICES, tmp_path)
    assert two["shards"] == [[[8, 8]], [[8]], [[4, 8]], [[2]]]
    for a, b in zip(two["state"], fsdp["params"] + fsdp["opt"]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert [r["epoch"] for r in two["rows"]] == [3] and np.isfinite(two["rows"][0]["train_loss"])


def test_two_processes_with_fsdp_train_as_one_process_on_four_devices(tmp_path):
    port = _free_port()
    knobs = {"checkpointer": 1, "sharding": "fsdp"}
    procs = [_child(tmp_path / "two.json", tmp_path / "two", 2, p, port, 2, knobs) for p in (0, 1)]
    procs.append(_child(tmp_path / "one.json", tmp_path / "one", 1, 0, 0, 4, knobs))
    codes, logs = _wait(procs)
    assert codes == [0, 0, 0], "\n".join(log[-3000:] for log in logs)
    two, one = (json.loads((tmp_path / f).read_text()) for f in ("two.json", "one.json"))
    # Par's leaves: (16, 8), (16,), (4, 16), (4,): each process holds 2 of the 4 quarters
    assert two["shards"] == one["shards"] == [[[4, 8]], [[4]], [[4, 4]], [[1]]]
    assert not two["replicated"] and two["n_devs"] == 4
    _close(one["params"], two["params"])
    _close(one["opt_state"], two["opt_state"])
    _rows_close(one["rows"], two["rows"])  # validation on sharded params: gathered per process
    # the 2-process FSDP checkpoint, read back by a replicated 2-process handle
    _close(two["checkpoint_params"], two["params"])
    _close(one["checkpoint_params"], two["checkpoint_params"])
