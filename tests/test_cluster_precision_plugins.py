"""Process start-up (``cluster``) and the precision policy (``precision``) as plugins, as
PyTorch Lightning's ClusterEnvironment and Precision plugins are: the core asks a hook; the
built-in plugin answers; an installed plugin replaces it; disabled, the core says which plugin
is missing."""

from __future__ import annotations

import textwrap

import jax
import numpy as np
import pytest

import jaxnitro as jn
import jaxnitro.plugin as P
from plugin_dist import installed_plugin, trains_the_same_without
from tiny import Tiny, tiny_data

QUIET = dict(logger=None)

SLURMISH = textwrap.dedent(
    '''
    """A third-party cluster environment: the job's coordinator, size and rank from a
    scheduler's environment variables (as a SLURM plugin reads SLURM_*)."""
    import os

    import jax
    from jaxnitro.plugin import hookimpl

    ASKED = []


    @hookimpl
    def jaxnitro_initialize_processes(coordinator_address, num_processes, process_id, local_device_count,
                                      heartbeat_timeout_s, cpu_collectives, options):
        env = os.environ
        job = (coordinator_address or f"{env['TESTJOB_NODE0']}:{env['TESTJOB_PORT']}",
               num_processes or int(env["TESTJOB_NTASKS"]),
               process_id if process_id is not None else int(env["TESTJOB_PROCID"]))
        ASKED.append(("initialize", job, local_device_count, heartbeat_timeout_s, cpu_collectives, options))
        return True  # (a real one calls jax.distributed.initialize(*job) here)


    @hookimpl
    def jaxnitro_setup_devices(n_devs, backend):
        ASKED.append(("setup_devices", n_devs, backend))
        return jax.local_devices(backend=backend)[:n_devs]
    '''
)


def test_an_installed_cluster_plugin_answers_instead_of_the_built_in(tmp_path, monkeypatch):
    for name, value in {"TESTJOB_NODE0": "node7", "TESTJOB_PORT": "4321", "TESTJOB_NTASKS": "4",
                        "TESTJOB_PROCID": "2"}.items():
        monkeypatch.setenv(name, value)
    with installed_plugin(tmp_path / "site", module="jaxnitro_slurmish_testplugin", source=SLURMISH,
                          dist="jaxnitro-slurmish-testplugin", entry="slurmish") as plugin:
        assert jn.distributed.initialize() is None
        jn.distributed.initialize("head:99", heartbeat_timeout_s=7, cpu_collectives=None, initialization_timeout=5)
        assert jn.setup_devices(1) == jax.local_devices()[:1]
        assert plugin.ASKED == [
            ("initialize", ("node7:4321", 4, 2), None, 100, "gloo", {}),
            ("initialize", ("head:99", 4, 2), None, 7, None, {"initialization_timeout": 5}),
            ("setup_devices", 1, None),
        ]
        assert not jax.distributed.is_initialized()  # the built-in (jax.distributed) was not asked
        answered = {p.name: p.answered for p in jn.plugins_info()}
        assert "jaxnitro_setup_devices()" in answered["slurmish"]
        assert "jaxnitro_initialize_processes()" in answered["slurmish"]


def test_without_the_cluster_plugin_start_up_is_refused_naming_it(tmp_path, disabled):
    assert len(jn.setup_devices(1)) == 1  # the built-in answers
    disabled("cluster")
    for call, verb in ((lambda: jn.setup_devices(1), "jn.setup_devices"),
                       (lambda: jn.distributed.initialize("127.0.0.1:1234", 2, 0), "jn.distributed.initialize")):
        with pytest.raises(RuntimeError) as err:
            call()
        text = str(err.value)
        assert f"`{verb}` found no plugin that starts processes and devices" in text
        assert "the built-in plugin `cluster`" in text and "module jaxnitro.plugins.cluster" in text
        assert "plugins disabled by JAXNITRO_DISABLE_PLUGINS: cluster" in text
    assert not jax.distributed.is_initialized()
    # a one-process run on JAX's default devices does not need it
    assert jn.Nitro(Tiny(max_epochs=1), data=tiny_data(), run_dir=tmp_path, **QUIET).train().status == "done"


def test_the_built_in_precision_policy_is_the_precision_plugins():
    n = jn.Nitro(Tiny(max_epochs=1), data=tiny_data(), precision="bfloat16", **QUIET)
    policy = n.plan.programs.precision
    assert isinstance(policy, P.PrecisionPolicy) and type(policy).__module__ == "jaxnitro.plugins.precision"
    assert policy.key()[:2] == ("precision", "bfloat16")
    answered = {p.name: p.answered for p in jn.plugins_info()}
    assert "jaxnitro_precision_policy()" in answered["precision"]


def test_without_the_precision_plugin_float32_trains_the_same_and_the_rest_is_refused(tmp_path, disabled):
    def check(without, with_plugin):
        assert without.plan.programs.precision.key() == with_plugin.plan.programs.precision.key()
        assert ("precision", "float32", (), False) == without.plan.programs.precision.key()
        assert "precision" in str(without) and "float32" in str(without)

    trains_the_same_without("precision", disabled, tmp_path, check)  # bitwise: the same programs
    for knob, value, shown in (("precision", "bfloat16", "'bfloat16'"), ("remat", True, "True"),
                               ("remat", "dots_saveable", "'dots_saveable'")):
        with pytest.raises(ValueError) as err:
            jn.Nitro(Tiny(max_epochs=1), data=tiny_data(), **{knob: value}, **QUIET)
        text = str(err.value)
        assert f"run knob `{knob}` = {shown} (keyword) needs the built-in plugin `precision`" in text
        assert "plugins disabled by JAXNITRO_DISABLE_PLUGINS: precision" in text
        assert "leave `precision` at 'float32' and `remat` at False" in text
    jn.Nitro(Tiny(max_epochs=1), data=tiny_data(), precision="float32", remat=np.False_, **QUIET)  # the defaults pass


PRECISION = textwrap.dedent(
    '''
    """A third-party precision plugin: float32 compute with its own program key and report lines,
    and a policy that is no policy for the experiment class named `Broken`."""
    from jaxnitro.plugin import PrecisionPolicy, hookimpl

    ASKED = []


    class Custom(PrecisionPolicy):
        def for_params(self, experiment, hooks, params):
            ASKED.append(("for_params", type(experiment).__name__, "keep_float32" in hooks))
            return self

        def key(self):
            return ("precision", "custom")

        def describe(self):
            return "custom float32"


    @hookimpl
    def jaxnitro_precision_policy(precision, remat):
        ASKED.append(("policy", precision.value, precision.source, remat.value))
        return object() if precision.value == "broken" else Custom()
    '''
)


def test_an_installed_precision_plugin_answers_instead_of_the_built_in(tmp_path):
    with installed_plugin(tmp_path / "site", module="jaxnitro_precision_testplugin", source=PRECISION,
                          dist="jaxnitro-precision-testplugin", entry="custom_precision") as plugin:
        n = jn.Nitro(Tiny(max_epochs=1), data=tiny_data(), run_dir=tmp_path, **QUIET)
        assert plugin.ASKED == [("policy", "float32", "default", False), ("for_params", "Tiny", True)]
        assert n.plan.programs.precision.key() == ("precision", "custom")
        assert "custom float32" in str(n) and "jaxnitro_precision_policy()" in str(n)
        with pytest.raises(TypeError, match=r"`jaxnitro_precision_policy` answered <object object at .*>, which is "
                                            r"not a jaxnitro.plugin.PrecisionPolicy"):
            jn.Nitro(Tiny(max_epochs=1), data=tiny_data(), precision="broken", **QUIET)
