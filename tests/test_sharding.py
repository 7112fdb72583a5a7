"""Sharded parameters, the pieces that run in this (one-device) test process: the knobs'
refusals, the FSDP rule, spec checks naming the parameter, the optimizer state following its
parameter. The runs on 4 forced CPU devices and 2 processes are in ``test_sharding_multi.py``
(slow: fresh processes)."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxnitro as jn
from jaxnitro.plugins.sharding import check_spec, fsdp_spec, param_layout
from tiny import Tiny, fresh_tiny, tiny_data


def test_fsdp_splits_the_largest_dimension_that_divides():
    assert fsdp_spec((16, 8), 4) == P("data")
    assert fsdp_spec((4, 16), 4) == P(None, "data")
    assert fsdp_spec((8, 8), 4) == P("data")  # a tie: the first
    assert fsdp_spec((10,), 4) == P() and fsdp_spec((), 4) == P()  # nothing divides: replicated
    assert fsdp_spec((6, 12), 4) == P(None, "data")  # the largest that divides, not the largest
    assert fsdp_spec((16, 8), 1) == P()


@pytest.mark.parametrize("bad", ["zero", "FSDP", 3])
def test_an_unknown_sharding_is_refused_naming_the_values(bad):
    with pytest.raises(ValueError) as err:
        jn.Nitro(Tiny(), data=tiny_data(), logger=None, sharding=bad)
    msg = str(err.value)
    assert f"run knob `sharding` = {bad!r} (keyword)" in msg
    assert '"replicated"' in msg and '"fsdp"' in msg and "param_sharding(self, path, leaf)" in msg


@pytest.mark.parametrize(
    "bad,problem",
    [
        ({"data": 2}, "its sizes multiply to 2, but the run trains on n_devs=1 devices"),
        ({"model": 1}, 'it has no axis "data"'),
        ({"data": 0}, "the size of axis 'data' is 0, not an integer >= 1"),
        ([("data", 1)], "it must be a non-empty dict {axis name: size}"),
    ],
)
def test_a_bad_mesh_shape_is_refused_with_an_example(bad, problem):
    with pytest.raises(ValueError) as err:
        jn.Nitro(Tiny(), data=tiny_data(), logger=None, mesh_shape=bad)
    msg = str(err.value)
    assert f"run knob `mesh_shape` = {bad!r} (keyword); {problem}" in msg
    assert "e.g. mesh_shape={" in msg


def test_a_spec_naming_an_axis_the_mesh_lacks_is_refused_naming_the_parameter():
    def param_sharding(self, path, leaf):
        return P(None, "model") if path == ("l2", "weight") else None

    with pytest.raises(ValueError) as err:
        jn.Nitro(fresh_tiny(param_sharding=param_sharding)(), data=tiny_data(), logger=None)
    msg = str(err.value)
    assert "`param_sharding` of FreshTiny returned P(None, 'model') for the parameter .l2.weight (shape (4, 16))" in msg
    assert "the axis 'model' is not an axis of the mesh (axes: {'data': 1})" in msg
    assert "name it in the `mesh_shape` run knob" in msg


def test_a_spec_that_is_not_a_partition_spec_or_too_long_is_refused():
    def not_a_spec(self, path, leaf):
        return ("data",)

    with pytest.raises(TypeError, match=r"returned \('data',\) for the parameter .l1.weight .*must return a jax.sharding.PartitionSpec"):
        jn.Nitro(fresh_tiny(param_sharding=not_a_spec)(), data=tiny_data(), logger=None)

    def too_long(self, path, leaf):
        return P(None, None, None) if path == ("l1", "bias") else None

    with pytest.raises(ValueError, match=r"for the parameter .l1.bias \(shape \(16,\)\): the spec has 3 entries but the parameter has 1 dimension"):
        jn.Nitro(fresh_tiny(param_sharding=too_long)(), data=tiny_data(), logger=None)


def test_an_indivisible_dimension_and_a_reused_axis_are_refused():
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    # a mesh of 4 on 'model' without 4 devices: check_spec reads the sizes from the mesh's shape
    sized = type("M", (), {"axis_names": ("data", "model"), "devices": np.empty((1, 4), object)})()
    with pytest.raises(ValueError) as err:
        check_spec(P("model"), ("l1", "weight"), (6, 8), sized, "Tiny")
    msg = str(err.value)
    assert "for the parameter .l1.weight (shape (6, 8)): dimension 0 has size 6, which does not divide among the 4 devices of 'model'" in msg
    assert "a multiple of 4" in msg and "return None for this parameter" in msg
    with pytest.raises(ValueError, match="the axis 'data' is used for two dimensions"):
        check_spec(P("data", "data"), ("w",), (2, 2), mesh, "Tiny")
    assert check_spec(P(None, ("data", "model")), ("w",), (3, 4), mesh, "Tiny") == P(None, ("data", "model"))


def test_the_optimizer_state_follows_its_parameter():
    """Adam's moments (and the EMA) take their parameter's spec, the step count and the
    injected hyperparameters are replicated."""
    nitro = jn.Nitro(Tiny(), data=tiny_data(), logger=None, ema=jn.EMA(0.9))
    mesh = nitro.plan.dist.mesh

    def rules(self, path, leaf):
        return P("data") if leaf.ndim == 2 else None

    layout = param_layout(fresh_tiny(param_sharding=rules)(), {"param_sharding": SimpleNamespace(function=rules)},
                          nitro.params, mesh, "replicated").with_opt(nitro.opt_state)
    assert layout.mode == "rules" and layout.specs == (P("data"), P(), P("data"), P())
    leaves = jax.tree_util.tree_leaves_with_path(nitro.opt_state)
    by_path = {jax.tree_util.keystr(p): s for (p, _), s in zip(leaves, layout.opt_specs)}
    moments = [k for k in by_path if k.endswith(".l1.weight") or k.endswith(".l2.weight")]
    assert len(moments) == 6  # mu, nu, EMA for two weights
    assert all(by_path[k] == P("data") for k in moments)
    assert all(s == P() for k, s in by_path.items() if k not in moments)


def test_fsdp_on_one_device_is_the_replicated_run():
    """One device: nothing divides into a 'data' axis of 1; the programs are the replicated
    ones (compiled once), the parameters the same, bitwise."""
    rep = jn.Nitro(Tiny(), data=tiny_data(), logger=None, max_epochs=1).train()
    fsdp = jn.Nitro(Tiny(), data=tiny_data(), logger=None, max_epochs=1, sharding="fsdp")
    before = jn.cache_stats().misses
    fsdp.train()
    assert jn.cache_stats().misses == before  # nothing new to compile
    assert not fsdp.plan.layout.sharded and fsdp.plan.layout.key() == ()
    for a, b in zip(jax.tree_util.tree_leaves(rep.params), jax.tree_util.tree_leaves(fsdp.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
