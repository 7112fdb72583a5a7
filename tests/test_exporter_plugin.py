"""Export is a plugin: ``nitro.export`` asks ``jaxnitro_export`` with the handle's
``InferenceProgram``. A third-party exporter installed as a distribution replaces the built-in
(``jaxnitro.plugins.export``, ``trylast``) for what it answers and leaves the rest to it;
``print(nitro)`` and ``jn.plugins_info()`` name the plugin that answered; with the built-in
disabled, ``nitro.export`` names the missing plugin and the fix."""

from __future__ import annotations

import os
import textwrap

import jax
import numpy as np
import pytest

import jaxnitro as jn
from plugin_dist import installed_plugin
from tiny import Tiny, tiny_data

DATA = tiny_data()
X = DATA["val"][0]["x"]  # 16 rows

THIRD_PARTY = textwrap.dedent(
    '''
    """A third-party exporter: ``.npz`` paths get the weights and the outputs on a probe batch."""
    import os

    import jax
    import numpy as np

    from jaxnitro.plugin import InferenceProgram, hookimpl

    ASKED = []


    @hookimpl
    def jaxnitro_export(program: InferenceProgram, path, options):
        ASKED.append(os.fspath(path))
        if not os.fspath(path).endswith(".npz"):
            return None  # not mine: the next exporter (the built-in) answers
        specs, width = program.signature(options["example"])
        probe = {f: np.ones((width, *shape), dtype) for f, (shape, dtype) in specs.items()}
        if program.key_entries is not None:
            probe.update(program.key_entries)
        out = jax.jit(program.apply)(program.params, program.model_state, dict(program.device_values), probe)
        leaves = jax.tree_util.tree_leaves(program.params)
        np.savez(path, outputs=np.asarray(out), probe=probe["x"], n_weights=len(leaves),
                 experiment=program.experiment_class.__qualname__, weights=program.weights_source)
        return {"path": os.fspath(path), "format": "npz-probe/1"}
    '''
)


@pytest.fixture
def exporter(tmp_path):
    with installed_plugin(tmp_path / "site", module="jaxnitro_exporter_testplugin", source=THIRD_PARTY,
                          dist="jaxnitro-exporter-test", entry="exporter_test", version="1.5") as plugin:
        yield plugin


def _answer_line(nitro) -> str:
    (line,) = [ln for ln in str(nitro).splitlines() if "jaxnitro_export()" in ln]
    return line


def test_a_third_party_exporter_replaces_the_built_in_for_what_it_answers(tmp_path, exporter):
    n = jn.Nitro(Tiny(temperature=0.5), data=DATA, logger=None)
    written = n.export(tmp_path / "model.npz")
    assert written == {"path": str(tmp_path / "model.npz"), "format": "npz-probe/1"}  # what the plugin returned
    assert sorted(os.listdir(tmp_path)) == ["model.npz", "site"]  # its own file, no forward.jaxexport
    saved = np.load(tmp_path / "model.npz")
    assert (str(saved["experiment"]), str(saved["weights"]), int(saved["n_weights"])) == (
        "Tiny", "params", len(jax.tree_util.tree_leaves(n.params)))
    np.testing.assert_allclose(saved["outputs"], n.predict({"x": saved["probe"]}), rtol=1e-6)  # program.apply is predict's forward
    assert saved["probe"].shape == (16, 8)  # program.signature: the data's fields and the compiled width
    assert "plugin exporter_test (jaxnitro-exporter-test 1.5)" in _answer_line(n)
    answered = {p.name: p.answered for p in jn.plugins_info()}
    assert "jaxnitro_export()" in answered["exporter_test"] and "jaxnitro_export()" not in answered["export"]

    # a path it declines goes on to the built-in, and the report says so
    folder = n.export(tmp_path / "folder")
    assert exporter.ASKED == [str(tmp_path / "model.npz"), str(tmp_path / "folder")]
    assert sorted(os.listdir(folder)) == ["forward.jaxexport", "metadata.json"]
    np.testing.assert_array_equal(jn.load_exported(folder)(x=X[:5]), n.predict({"x": X[:5]}))
    assert "plugin export (jaxnitro " in _answer_line(n) and "exporter_test" not in _answer_line(n)
    assert "jaxnitro_export()" in {p.name: p.answered for p in jn.plugins_info()}["export"]


def test_the_built_in_exporter_is_a_plugin_that_answers_and_exports_names():
    info = {p.name: p for p in jn.plugins_info()}
    assert info["export"].module == "jaxnitro.plugins.export" and info["export"].distribution == "jaxnitro"
    assert {"jaxnitro_export", "jaxnitro_exports"} <= set(info["export"].hooks)
    from jaxnitro.plugins import export

    assert (jn.load_exported, jn.ExportedForward, jn.ExportError) == (
        export.load_exported, export.ExportedForward, export.ExportError)
    assert issubclass(jn.ExportError, ValueError)
    import jaxnitro.plugin as P

    assert isinstance(export, P.Exporter)


def test_with_the_export_plugin_disabled_export_names_it_and_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXNITRO_DISABLE_PLUGINS", "export")
    jn.reload_plugins()
    try:
        n = jn.Nitro(Tiny(), data=DATA, logger=None)
        with pytest.raises(RuntimeError) as err:
            n.export(tmp_path / "e")
        msg = str(err.value)
        assert "`nitro.export` found no plugin that exports: the built-in plugin `export`" in msg
        assert "(plugins disabled by JAXNITRO_DISABLE_PLUGINS: export)" in msg
        assert "drop `export` from JAXNITRO_DISABLE_PLUGINS" in msg and "implementing `jaxnitro_export`" in msg
        assert not os.path.exists(tmp_path / "e")
        with pytest.raises(AttributeError, match=r"no attribute 'load_exported'.*disabled by JAXNITRO_DISABLE_PLUGINS: export"):
            jn.load_exported
        assert n.predict({"x": X[:3]}).shape == (3, 4)  # the core still predicts
    finally:
        monkeypatch.delenv("JAXNITRO_DISABLE_PLUGINS")
        jn.reload_plugins()
    assert sorted(os.listdir(n.export(tmp_path / "e"))) == ["forward.jaxexport", "metadata.json"]
