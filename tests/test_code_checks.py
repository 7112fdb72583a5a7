"""The checks of the experiment's code left the core for the ``code_checks`` plugin, behind the
lifecycle hooks ``jaxnitro_check_experiment`` and ``jaxnitro_check_traced_code``: an installed
plugin gets the same questions (and may refuse), and with the built-in disabled neither check
runs."""

from __future__ import annotations

import textwrap
import warnings

import pytest

import jaxnitro as jn
from plugin_dist import installed_plugin
from tiny import Tiny, tiny_data

QUIET = dict(logger=None)

CHECKER = textwrap.dedent(
    '''
    """A third-party package with checks of its own: it records what it was asked, and refuses
    a `loss` hook, and an experiment class named `Refused`."""
    from jaxnitro.plugin import hookimpl

    ASKED = []


    @hookimpl
    def jaxnitro_check_experiment(experiment):
        ASKED.append(("experiment", type(experiment).__name__))
        if type(experiment).__name__ == "Refused":
            raise TypeError("checker: no experiment called Refused")


    @hookimpl
    def jaxnitro_check_traced_code(experiment, functions):
        ASKED.append(("traced", sorted(functions)))
        if "loss" in functions and getattr(experiment, "refuse_loss", False):
            raise TypeError("checker: this loss is refused")
    '''
)


def _moded(tmp_path):
    """An experiment whose traced `forward` tests a Host field by identity (`self.mode is None`)."""
    path = tmp_path / "moded_checks.py"
    path.write_text(textwrap.dedent(
        """
        import jaxnitro as jn
        from tiny import Tiny


        @jn.experiment
        class Moded(Tiny):
            mode: str = None

            def forward(self, model, state, *, x):
                logits, state = Tiny.forward(self, model, state, x=x)
                return (logits * 2 if self.mode is None else logits), state
        """
    ))
    namespace: dict = {}
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    return namespace["Moded"]


def _typo():
    """An experiment with a method `monitr` (the hook is `monitor`)."""
    return jn.experiment(type("Typo", (Tiny,), {"monitr": lambda self: ("loss", "min")}))


def test_an_installed_plugin_is_asked_both_questions_and_may_refuse(tmp_path):
    with installed_plugin(tmp_path / "site", module="jaxnitro_checks_testplugin", source=CHECKER,
                          dist="jaxnitro-checks-testplugin", entry="checks") as checker:
        jn.Nitro(Tiny(max_epochs=1), data=tiny_data(), run_dir=tmp_path, **QUIET)
        assert checker.ASKED == [("experiment", "Tiny"), ("traced", ["forward", "loss"])]

        Refused = jn.experiment(type("Refused", (Tiny,), {}))
        with pytest.raises(TypeError, match="checker: no experiment called Refused"):
            jn.Nitro(Refused(max_epochs=1), data=tiny_data(), run_dir=tmp_path, **QUIET)

        Strict = jn.experiment(type("Strict", (Tiny,), {"refuse_loss": True}))
        with pytest.raises(TypeError, match="checker: this loss is refused"):
            jn.Nitro(Strict(max_epochs=1), data=tiny_data(), run_dir=tmp_path, **QUIET)

        # the built-in still runs beside it: both implementations are called
        with pytest.raises(TypeError, match="hook `forward` of Moded tests Host field `mode`"):
            jn.Nitro(_moded(tmp_path)(), data=tiny_data(), run_dir=tmp_path, **QUIET)


def test_without_code_checks_nothing_is_refused_or_warned(tmp_path, disabled):
    with pytest.raises(TypeError, match="hook `forward` of Moded tests Host field `mode`"):
        jn.Nitro(_moded(tmp_path)(), data=tiny_data(), run_dir=tmp_path, **QUIET)
    with pytest.warns(UserWarning, match="method `monitr` of Typo .* did you mean the hook `monitor`"):
        jn.Nitro(_typo()(), data=tiny_data(), run_dir=tmp_path, **QUIET)

    disabled("code_checks")
    n = jn.Nitro(_moded(tmp_path)(), data=tiny_data(), run_dir=tmp_path, **QUIET)  # not refused
    assert n.status == "ready"
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        jn.Nitro(_typo()(), data=tiny_data(), run_dir=tmp_path, **QUIET)
    assert not [w for w in record if "monitr" in str(w.message)]
