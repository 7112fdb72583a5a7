"""The plugin surface: ``jaxnitro.plugin`` is all a plugin imports; every hook call goes through
pluggy (``wrapper=True``, ``tryfirst``, ``trylast`` work for ``jaxnitro_run_finish`` too); the
plugin that accepts a knob is the only one that acts on it; ``print(nitro)`` and
``jn.plugins_info()`` name the plugin that answered each extension hook."""

from __future__ import annotations

import ast
import inspect
import os
import textwrap
from pathlib import Path

import pytest

import jaxnitro as jn
import jaxnitro.plugin as P
from jaxnitro import hookspecs
from jaxnitro.events import run_scoped
from plugin_dist import installed, write_distribution
from tiny import Tiny

ROOT = Path(__file__).resolve().parents[1]

THIRD_PARTY = textwrap.dedent(
    '''
    """A third-party package replacing the built-in stop policy, checkpointer and reporter."""
    import jaxnitro as jn
    from jaxnitro.plugin import hookimpl, owns_knob

    SAVED = []
    SHOWN = []


    class StopAfter:
        """A stop policy of another shape (no should_stop): this plugin applies it."""

        def __init__(self, epochs):
            self.epochs = epochs


    class Reporter:
        def begin(self, total, label):
            SHOWN.append(("begin", total))

        def update(self, position, label):
            SHOWN.append(("update", position))

        def close(self, label):
            SHOWN.append(("close", label))


    @hookimpl
    def jaxnitro_accept_knob(name, value, nitro):
        if name == "early_stop" and isinstance(value, StopAfter):
            return True
        if name == "checkpointer" and isinstance(value, jn.Checkpointer):
            return True  # the built-in's configuration, saved by another backend
        return None


    @hookimpl
    def jaxnitro_epoch_end(run, row):
        if owns_knob(run, "checkpointer", __name__):
            SAVED.append(row["epoch"])
        if owns_knob(run, "early_stop", __name__) and row["epoch"] >= run.settings.early_stop.epochs:
            run.request_stop(f"third-party policy: {row['epoch']} epochs")


    @hookimpl
    def jaxnitro_make_progress_reporter(name):
        return Reporter() if name == "auto" else None
    '''
)


@pytest.fixture
def third_party(tmp_path):
    site = write_distribution(tmp_path / "site", module="jaxnitro_surface_testplugin", source=THIRD_PARTY,
                              dist="jaxnitro-surface-test", entry="surface_test", version="2.0")
    with installed(site, "jaxnitro_surface_testplugin"):
        import jaxnitro_surface_testplugin as plugin

        yield plugin


def test_a_third_party_stop_policy_checkpointer_and_reporter_replace_the_built_ins(tmp_path, third_party, monkeypatch):
    from jaxnitro import progress

    monkeypatch.setattr(progress, "_installed", "auto")  # the default, whatever an earlier test installed
    n = jn.Nitro(Tiny(max_epochs=5), run_dir=tmp_path / "runs", logger=None,
                 early_stop=third_party.StopAfter(2), checkpointer=jn.Checkpointer())
    n.train()
    assert (n.epoch, n.stop_reason) == (2, "third-party policy: 2 epochs")  # its policy stopped the run
    assert third_party.SAVED == [1, 2]
    assert not os.path.exists(os.path.join(n.run_dir, "checkpoints"))  # orbax did not act on the knob
    assert third_party.SHOWN[0][0] == "begin" and third_party.SHOWN[-1] == ("close", "done: 2/5 epochs")

    text = str(n)  # print(nitro): who answered each extension hook for this handle
    mine = "plugin surface_test (jaxnitro-surface-test 2.0)"
    for asked in ("jaxnitro_accept_knob(name='early_stop')", "jaxnitro_accept_knob(name='checkpointer')",
                  "jaxnitro_make_progress_reporter(name='auto')"):
        (line,) = [ln for ln in text.splitlines() if asked in ln]
        assert mine in line, line
    answered = {p.name: p.answered for p in jn.plugins_info()}
    assert "jaxnitro_accept_knob(name='checkpointer')" in answered["surface_test"]
    assert "jaxnitro_accept_knob(name='checkpointer')" not in answered["orbax"]


def test_without_the_third_party_the_built_ins_answer_and_act(tmp_path):
    n = jn.Nitro(Tiny(max_epochs=2), run_dir=tmp_path, logger=None, checkpointer=jn.Checkpointer())
    n.train()
    assert os.listdir(os.path.join(n.run_dir, "checkpoints"))
    assert P.owns_knob(n, "checkpointer", "jaxnitro.checkpointers.orbax")
    assert not P.owns_knob(n, "early_stop", "jaxnitro.plugins.early_stopping")  # not set: nobody owns it
    (answer,) = [a for a in P.answers_for(n) if a.hook == "jaxnitro_accept_knob"]
    assert (answer.plugin, answer.question) == ("orbax", "name='checkpointer'")
    assert P.answer_source(answer) == f"plugin orbax (jaxnitro {jn.__version__})"


def test_run_finish_goes_through_pluggy_wrappers_and_order_and_every_plugin_finishes(tmp_path):
    calls = []

    class Wrap:
        @jn.hookimpl(wrapper=True)
        def jaxnitro_run_finish(self, run, status):
            calls.append(("wrapper before", status))
            result = yield
            calls.append(("wrapper after", status))
            return result

    class First:
        @jn.hookimpl(tryfirst=True)
        def jaxnitro_run_finish(self, run, status):
            calls.append(("first", status))
            raise RuntimeError("first plugin failed to finish")

    class Last:
        @jn.hookimpl(trylast=True)
        def jaxnitro_run_finish(self, run, status):
            calls.append(("last", status))

    with run_scoped([Wrap(), First(), Last()]), pytest.raises(RuntimeError, match="first plugin failed"):
        jn.train(Tiny(max_epochs=1), run_dir=tmp_path, logger=None)
    # the wrapper wraps the call; the tryfirst one runs first, and its error is raised only after
    # the others (the trylast one included) have finished
    assert calls == [("wrapper before", "done"), ("first", "done"), ("last", "done"), ("wrapper after", "done")]


def test_the_hookspecs_are_typed():
    specs = [getattr(hookspecs, h) for h in hookspecs.EXPERIMENT_HOOKS]
    specs += [getattr(hookspecs.ExtensionSpec, h) for h in hookspecs.EXTENSION_HOOKS]
    specs += [getattr(hookspecs.LifecycleSpec, h) for h in hookspecs.LIFECYCLE_HOOKS]
    for spec in specs:
        sig = inspect.signature(spec)
        untyped = [p for p in list(sig.parameters)[1:] if sig.parameters[p].annotation is inspect.Parameter.empty]
        assert not untyped and sig.return_annotation is not inspect.Signature.empty, spec.__name__
    assert inspect.signature(hookspecs.LifecycleSpec.jaxnitro_epoch_end).parameters["row"].annotation == "dict[str, Any]"


def test_the_built_ins_have_the_protocols_shapes():
    from jaxnitro.checkpointers import orbax
    from jaxnitro.loggers.jsonl import JSONLLogger
    from jaxnitro.plugins.array_source import ArraySource
    from jaxnitro.plugins.progress import SilentReporter

    assert isinstance(orbax, P.Checkpointer)
    assert isinstance(SilentReporter(), P.Reporter) and not isinstance(object(), P.Reporter)
    assert isinstance(jn.EarlyStopping(patience=2), P.StopPolicy)
    assert issubclass(JSONLLogger, P.Logger)
    source = ArraySource({"x": __import__("numpy").zeros((8, 2))}, batch_size=4)
    assert isinstance(source, P.IndexedSource) and isinstance([{"x": 1}], P.Source)
    assert P.LOGGER_VERBS == ("log_params", "log_other", "log_metrics", "finish")


def _jaxnitro_imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.split(".")[0] == "jaxnitro"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "jaxnitro":
            out.append(node.module)
    return out


@pytest.mark.parametrize("folder", ["plugins", "loggers", "checkpointers", "examples/plugin_package"])
def test_plugins_import_only_jaxnitro_and_jaxnitro_plugin(folder):
    seen = {}
    for path in sorted((ROOT / folder).rglob("*.py")):
        seen[str(path.relative_to(ROOT))] = _jaxnitro_imports(path)
    bad = {p: [m for m in mods if m not in ("jaxnitro", "jaxnitro.plugin")] for p, mods in seen.items()}
    assert not {p: m for p, m in bad.items() if m}
    assert any("jaxnitro.plugin" in mods for mods in seen.values())
