"""Where parameters live (``sharding``) as a plugin, as PyTorch Lightning's strategies decide
placement: the core asks ``jaxnitro_sharding_policy``; the built-in plugin answers; an installed
plugin replaces it; disabled, every parameter is replicated and the rest refused, naming it."""

from __future__ import annotations

import textwrap

import pytest
from jax.sharding import PartitionSpec

import jaxnitro as jn
import jaxnitro.plugin as P
from jaxnitro.sharding import REPLICATED
from plugin_dist import installed_plugin, trains_the_same_without
from tiny import Tiny, fresh_tiny, tiny_data

QUIET = dict(logger=None)


def test_the_built_in_sharding_policy_is_the_sharding_plugins():
    n = jn.Nitro(Tiny(max_epochs=1), data=tiny_data(), sharding="fsdp", **QUIET)
    policy = n.settings.sharding_policy
    assert isinstance(policy, P.ShardingPolicy) and type(policy).__module__ == "jaxnitro.plugins.sharding"
    assert (policy.mode, policy.mesh_shape) == ("fsdp", None) and n.settings.sharding == "fsdp"
    answered = {p.name: p.answered for p in jn.plugins_info()}
    assert "jaxnitro_sharding_policy()" in answered["sharding"]


def test_without_the_sharding_plugin_replicated_trains_the_same_and_the_rest_is_refused(tmp_path, disabled):
    def check(without, with_plugin):
        assert without.settings.sharding_policy is REPLICATED
        assert not without.plan.layout.sharded and without.plan.layout.mode == "replicated"

    trains_the_same_without("sharding", disabled, tmp_path, check)  # bitwise: the same programs
    for knob, value in (("sharding", "fsdp"), ("mesh_shape", {"data": 1})):
        with pytest.raises(ValueError) as err:
            jn.Nitro(Tiny(max_epochs=1), data=tiny_data(), **{knob: value}, **QUIET)
        text = str(err.value)
        assert f"run knob `{knob}` = {value!r} (keyword) needs the built-in plugin `sharding`" in text
        assert "plugins disabled by JAXNITRO_DISABLE_PLUGINS: sharding" in text
    rules = fresh_tiny(param_sharding=lambda self, path, leaf: None)
    with pytest.raises(ValueError, match=r"FreshTiny defines `param_sharding`, which needs the built-in plugin `sharding`"):
        jn.Nitro(rules(max_epochs=1), data=tiny_data(), **QUIET)
    jn.Nitro(Tiny(max_epochs=1), data=tiny_data(), sharding="replicated", mesh_shape=None, **QUIET)  # the defaults pass


SHARDING = textwrap.dedent(
    '''
    """A third-party sharding rule: every matrix split over "data" (its first dimension), the
    rest replicated, whatever the `sharding` knob says; `broken` answers no policy."""
    from jax.sharding import PartitionSpec
    from jaxnitro.plugin import ShardingPolicy, hookimpl

    ASKED = []


    class Rows(ShardingPolicy):
        mode = "rows"

        def specs(self, paths, leaves, mesh, rule, cls_name):
            ASKED.append(("specs", paths, mesh.axis_names, rule is None, cls_name))
            return "rows", tuple(PartitionSpec("data") if leaf.ndim == 2 else PartitionSpec() for leaf in leaves)


    @hookimpl
    def jaxnitro_sharding_policy(sharding, mesh_shape, n_devs):
        ASKED.append(("policy", sharding.value, sharding.source, mesh_shape.value, n_devs))
        return object() if sharding.value == "broken" else Rows()
    '''
)


def test_an_installed_sharding_plugin_answers_instead_of_the_built_in(tmp_path):
    with installed_plugin(tmp_path / "site", module="jaxnitro_sharding_testplugin", source=SHARDING,
                          dist="jaxnitro-sharding-testplugin", entry="rows_sharding") as plugin:
        n = jn.Nitro(Tiny(max_epochs=1), data=tiny_data(), run_dir=tmp_path, **QUIET)
        assert plugin.ASKED == [("policy", "replicated", "default", None, 1),
                                ("specs", (("l1", "weight"), ("l1", "bias"), ("l2", "weight"), ("l2", "bias")),
                                 ("data",), True, "Tiny")]
        layout = n.plan.layout
        assert layout.mode == "rows" and layout.specs == (PartitionSpec("data"), PartitionSpec()) * 2
        assert "jaxnitro_sharding_policy()" in str(n)
        with pytest.raises(TypeError, match=r"`jaxnitro_sharding_policy` answered <object object at .*>, which is "
                                            r"not a jaxnitro.plugin.ShardingPolicy"):
            jn.Nitro(Tiny(max_epochs=1), data=tiny_data(), sharding="broken", **QUIET)
