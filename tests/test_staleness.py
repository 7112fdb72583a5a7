"""A handle is a fixed point: what it resolved at construction is what it runs.

When a hook or a run-knob accessor is redefined afterwards, every entry point
prints (to stderr) what changed and keeps running what it was built with.
Experiment classes here are LOCAL (subclasses of ``TinyCore`` defined in the
test functions), so monkeypatching never touches the shared ``Tiny`` class.
"""

from __future__ import annotations

import sys
import textwrap
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxnitro as jn

from tiny import N_CLASSES, Tiny, TinyCore, tiny_data

DATA = tiny_data()
BATCH = {"x": DATA["val"][0]["x"]}


def misses() -> int:
    return jn.cache_stats().misses


def same_params(a, b) -> bool:
    return all(
        np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(jax.tree_util.tree_leaves(a.params), jax.tree_util.tree_leaves(b.params))
    )


def zero_forward(self, model, state, *, x):
    return jnp.zeros((x.shape[0], N_CLASSES)), state


# -- redefined hooks ---------------------------------------------------------------------------


def test_monkeypatched_hook_is_reported_by_every_verb_and_not_used(tmp_path, capsys, monkeypatch):
    @jn.experiment
    class Local(TinyCore):
        max_epochs: int = 1

    run = dict(run_dir=tmp_path, logger=None)
    reference = jn.train(Local(), **run)  # trained before anything changed
    n = jn.Nitro(Local(), **run)
    outputs = n.predict(BATCH)
    val = n.validate()
    test = n.evaluate("val")
    assert "redefined" not in capsys.readouterr().err  # silent while nothing changed

    monkeypatch.setattr(Local, "forward", zero_forward)
    m = misses()
    for verb, call in [
        ("predict", lambda: np.testing.assert_array_equal(n.predict(BATCH), outputs)),
        ("validate", lambda: assert_equal(n.validate(), val)),
        ("evaluate", lambda: assert_equal(n.evaluate("val"), test)),
        ("train", n.train),
    ]:
        call()
        err = capsys.readouterr().err
        assert f"reported by `{verb}`" in err
        assert "hooks were redefined after this Nitro was built: forward." in err
        assert "keeps running the programs it was built with" in err
        assert "jn.Nitro(e, data=n.data" in err  # says how to rebuild
    assert misses() - m == 0  # it kept the old programs: nothing compiled
    assert n.status == "done"
    assert n.rows == reference.rows and same_params(n, reference)  # trained with the old forward

    # A new handle picks the new code up, and has nothing to report.
    fresh = jn.Nitro(Local(), **run)
    np.testing.assert_array_equal(fresh.predict(BATCH), np.zeros((16, N_CLASSES)))
    assert "redefined" not in capsys.readouterr().err

    # Restoring the original makes the old handle silent again.
    monkeypatch.undo()
    n.predict(BATCH)
    assert "redefined" not in capsys.readouterr().err


def assert_equal(a: dict, b: dict) -> None:
    assert a == b


def test_added_and_removed_hooks_are_reported(tmp_path, capsys, monkeypatch):
    @jn.experiment
    class Local(TinyCore):  # not Tiny: a deleted learning_rate must not fall back to Tiny's
        def learning_rate(self):
            return 1e-2

    n = jn.Nitro(Local(), data={}, run_dir=tmp_path, logger=None)
    monkeypatch.setattr(Local, "metrics", lambda self, logits: {}, raising=False)
    monkeypatch.delattr(Local, "learning_rate")
    with pytest.raises(KeyError, match="no split 'test'"):  # the report comes first
        n.evaluate("test")
    err = capsys.readouterr().err
    assert "metrics (added)" in err and "learning_rate (removed)" in err


def test_redefined_class_in_a_notebook_cell_is_reported(tmp_path, capsys, monkeypatch):
    cell = textwrap.dedent(
        """
        import jax
        import jaxnitro as jn
        from tiny import TinyCore

        @jn.experiment
        class Cell(TinyCore):
            def forward(self, model, state, *, x):
                return jax.vmap(model)(x) * SCALE, state
        """
    )
    notebook = types.ModuleType("fake_notebook_for_staleness")
    monkeypatch.setitem(sys.modules, notebook.__name__, notebook)
    exec(cell.replace("SCALE", "1.0"), notebook.__dict__)
    n = jn.Nitro(notebook.Cell(), data=DATA, run_dir=tmp_path, logger=None)
    before = n.predict(BATCH)

    exec(cell.replace("SCALE", "1.0"), notebook.__dict__)  # the same cell re-run: same code
    n.predict(BATCH)
    assert "redefined" not in capsys.readouterr().err

    exec(cell.replace("SCALE", "0.0"), notebook.__dict__)  # the cell edited and re-run
    np.testing.assert_array_equal(n.predict(BATCH), before)
    err = capsys.readouterr().err
    assert "hooks were redefined" in err and "forward" in err and "Cell" in err


# -- redefined run-knob accessors ------------------------------------------------------------------


def test_accessor_returning_a_new_value_is_reported_and_the_old_value_kept(tmp_path, capsys, monkeypatch):
    @jn.experiment
    class WithAccum(TinyCore):
        max_epochs: int = 1

        def accum(self):
            return 2

    n = jn.Nitro(WithAccum(), run_dir=tmp_path, logger=None)
    assert n.settings.accum == 2 and n.settings.knobs["accum"].source == "accessor"

    monkeypatch.setattr(WithAccum, "accum", lambda self: 2)  # redefined, same answer: silent
    n.validate()
    assert "redefined" not in capsys.readouterr().err

    monkeypatch.setattr(WithAccum, "accum", lambda self: 4)
    for verb, call in [("validate", n.validate), ("predict", lambda: n.predict(BATCH)), ("train", n.train)]:
        call()
        err = capsys.readouterr().err
        assert f"reported by `{verb}`" in err
        assert "`accum` returned 2 at construction and returns 4 now" in err
        assert "still uses 2" in err and "rebuild to pick up 4" in err
        assert "hooks were redefined" not in err  # an accessor is a knob, reported as such
    assert n.settings.accum == 2 and n.step == 3  # 6 batches, 2 per optimizer step


def test_set_config_report_silences_the_report(tmp_path, capsys, monkeypatch):
    @jn.experiment
    class Local(TinyCore):
        def seed(self):
            return 1

    n = jn.Nitro(Local(), data=DATA, run_dir=tmp_path, logger=None)
    monkeypatch.setattr(Local, "forward", zero_forward)
    monkeypatch.setattr(Local, "seed", lambda self: 2)
    previous = jn.set_config_report(False)
    try:
        assert previous is True
        n.predict(BATCH)
        n.validate()
        assert capsys.readouterr().err == ""
        assert jn.set_config_report(True) is False
        n.predict(BATCH)
        err = capsys.readouterr().err
        assert "`seed` returned 1 at construction and returns 2 now" in err and "forward" in err
    finally:
        jn.set_config_report(previous)


# -- rebuilding ------------------------------------------------------------------------------------


def test_rebuild_with_the_same_data_reuses_it_and_compiles_nothing(tmp_path, capsys):
    built = []

    @jn.experiment
    class Counted(TinyCore):
        max_epochs: int = 1

        def build_data(self, dist):
            built.append(1)
            return tiny_data()

    e = Counted()
    n = jn.train(e, run_dir=tmp_path, logger=None)
    assert len(built) == 1
    m = misses()
    again = jn.Nitro(e, data=n.data, max_epochs=2, run_dir=tmp_path, logger=None)
    assert len(built) == 1  # build_data was not called again
    assert all(again.data[s] is n.data[s] for s in n.data)  # the same prefetch wrappers
    again.train()
    assert misses() - m == 0
    assert again.status == "done" and len(again.rows) == 2 and again.step == 12
    assert again.rows[0] == n.rows[0]  # same seed, same data: the same first epoch
    assert "redefined" not in capsys.readouterr().err


# -- run knobs resolve once: keyword > accessor > field > default ------------------------------


def test_run_knob_precedence_and_sources(tmp_path):
    @jn.experiment
    class Knobs(TinyCore):
        max_epochs: int = 3
        seed: int = 11

        def accum(self):
            return 2

    n = jn.Nitro(Knobs(), data=DATA, run_dir=tmp_path, logger=None)
    assert (n.settings.max_epochs, n.settings.knobs["max_epochs"].source) == (3, "field")
    assert (n.settings.seed, n.settings.knobs["seed"].source) == (11, "field")
    assert (n.settings.accum, n.settings.knobs["accum"].source) == (2, "accessor")
    assert (n.settings.gradient_clip_norm, n.settings.knobs["gradient_clip_norm"].source) == (0.0, "default")
    k = jn.Nitro(Knobs(), data=DATA, run_dir=tmp_path, logger=None, accum=3, seed=5, max_epochs=1)
    assert (k.settings.accum, k.settings.seed, k.settings.max_epochs) == (3, 5, 1)
    assert {k.settings.knobs[x].source for x in ("accum", "seed", "max_epochs")} == {"keyword"}


@pytest.mark.parametrize(
    "keyword, suggestion",
    [("max_epoch", "max_epochs"), ("gradient_clip", "gradient_clip_norm"), ("acum", "accum"),
     ("schedule", "schedules")],
)
def test_unknown_run_knob_keyword_suggests_the_close_match(tmp_path, keyword, suggestion):
    with pytest.raises(TypeError, match=rf"unknown keyword `{keyword}` to Nitro\. Did you mean `{suggestion}`\?"):
        jn.Nitro(Tiny(), data=DATA, run_dir=tmp_path, logger=None, **{keyword: 1})
    with pytest.raises(TypeError, match=rf"unknown keyword `{keyword}`"):
        jn.train(Tiny(), data=DATA, run_dir=tmp_path, logger=None, **{keyword: 1})


def test_unknown_keyword_without_a_close_match_lists_the_knobs(tmp_path):
    with pytest.raises(TypeError) as err:
        jn.Nitro(Tiny(), data=DATA, run_dir=tmp_path, logger=None, banana=1)
    text = str(err.value)
    assert "unknown keyword `banana`" in text and "Did you mean" not in text
    assert "Run knobs: seed, run_dir" in text and "gradient_clip_norm" in text
