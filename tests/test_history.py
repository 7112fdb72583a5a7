"""MetricHistory: selection semantics, best epoch, the printed table, conversions, errors,
and the rendering contract (plugin `history_table`, fallback, a third-party renderer)."""

from __future__ import annotations

import csv
import math
import sys

import numpy as np
import pytest

import jaxnitro
from jaxnitro.history import MetricHistory
from jaxnitro.hookspecs import hookimpl
from jaxnitro.plugins import history_table


def mnist_like(n: int = 25, best: int = 20, **kwargs) -> MetricHistory:
    """``n`` epochs of 275 steps; macro_recall peaks at epoch ``best``; a 3x3 confusion per row."""
    rows = []
    for e in range(1, n + 1):
        recall = 0.9824 if e == best else 0.90 + 0.05 * e / n  # below 0.9824
        rows.append(
            {
                "epoch": e,
                "step": 275 * e,
                "train_loss": 2.0 / e,
                "acc": 0.5 + e * 0.01,
                "macro_recall": recall,
                "confusion": np.eye(3) * e,
            }
        )
    kwargs.setdefault("monitor", ("macro_recall", "max"))
    return MetricHistory(rows, **kwargs)


def body(table: str) -> list[str]:
    """The table's body lines (between the header rule and the bottom rule)."""
    lines = table.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("├")) + 1
    stop = next(i for i, line in enumerate(lines) if line.startswith("└"))
    return lines[start:stop]


def shown_epochs(table: str) -> list[int]:
    out = []
    for line in body(table):
        first = line.strip("│ ").split()[0]
        if first != "⋮":
            out.append(int(first))
    return out


def footers(table: str) -> list[str]:
    lines = table.splitlines()
    stop = next(i for i, line in enumerate(lines) if line.startswith("└"))
    return [line.strip() for line in lines[stop + 1 :]]


# -- construction -------------------------------------------------------------------


def test_column_order_fixed_then_monitor_then_first_seen():
    rows = [
        {"zeta": 1.0, "epoch": 1, "step": 10, "train_loss": 0.5, "acc": 0.1},
        {"epoch": 2, "step": 20, "train_loss": 0.4, "f1": 0.3, "acc": 0.2, "zeta": 2.0},
    ]
    h = MetricHistory(rows, monitor=("acc", "min"))
    assert h.columns == ["epoch", "step", "train_loss", "acc", "zeta", "f1"]
    # a scalar missing from a row reads as NaN there
    assert math.isnan(h[0]["f1"])
    np.testing.assert_array_equal(h.f1, [np.nan, 0.3])


def test_numpy_scalars_become_python_scalars():
    h = MetricHistory([{"epoch": np.int64(1), "step": np.int32(5), "train_loss": np.float32(0.5),
                        "acc": np.float64(0.25), "n": np.int64(3)}])
    row = h[0]
    assert row == {"epoch": 1, "step": 5, "train_loss": 0.5, "acc": 0.25, "n": 3}
    assert type(row["epoch"]) is int and type(row["acc"]) is float and type(row["n"]) is int


def test_constructor_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"row 1 has no `step`"):
        MetricHistory([{"epoch": 1, "step": 1, "train_loss": 0.0}, {"epoch": 2, "train_loss": 0.0}])
    with pytest.raises(ValueError, match=r"rows must be in order.*row 1 has epoch 1, step 1 after epoch 1, step 1"):
        MetricHistory([{"epoch": 1, "step": 1, "train_loss": 0.0}] * 2)
    with pytest.raises(ValueError, match=r"row 1 has epoch 1, step 9 after epoch 2, step 8"):
        MetricHistory([{"epoch": 2, "step": 8, "train_loss": 0.0}, {"epoch": 1, "step": 9, "train_loss": 0.0}])
    with pytest.raises(ValueError, match=r"unknown monitor mode 'maximum'.*'max'.*'min'"):
        MetricHistory([], monitor=("acc", "maximum"))
    with pytest.raises(ValueError, match=r"epoch=1.5"):
        MetricHistory([{"epoch": 1.5, "step": 1, "train_loss": 0.0}])


# -- selection ------------------------------------------------------------------------


def test_slice_selects_epoch_labels_inclusive_not_positions():
    # validation every other epoch: labels differ from positions
    rows = [{"epoch": e, "step": 100 * e, "train_loss": 1.0 / e} for e in range(2, 31, 2)]
    h = MetricHistory(rows)
    assert list(h[4:8].epoch) == [4, 6, 8]
    assert list(h[5:9].epoch) == [6, 8]
    assert list(h[26:].epoch) == [26, 28, 30]
    assert list(h[:4].epoch) == [2, 4]
    assert list(h[8:8].epoch) == [8]
    assert len(h[7:7]) == 0
    assert isinstance(h[4:8], MetricHistory)


def test_integer_index_is_a_position_like_a_list():
    rows = [{"epoch": e, "step": 100 * e, "train_loss": 1.0 / e} for e in range(5, 9)]
    h = MetricHistory(rows)
    assert h[0]["epoch"] == 5
    assert h[-1] == {"epoch": 8, "step": 800, "train_loss": 1.0 / 8}
    assert h[np.int64(1)]["epoch"] == 6
    with pytest.raises(IndexError, match=r"no row at position 4; it has 4 rows"):
        h[4]


def test_metric_selection_keeps_epoch_and_step():
    h = mnist_like(5)
    assert h["acc"].columns == ["epoch", "step", "acc"]
    # columns keep the history's order whatever order they are asked in
    assert h["acc", "macro_recall"].columns == ["epoch", "step", "macro_recall", "acc"]
    assert h[["train_loss"]].columns == ["epoch", "step", "train_loss"]
    assert h["acc"][0] == {"epoch": 1, "step": 275, "acc": 0.51}


def test_epochs_and_metrics_together():
    h = mnist_like(25)
    a = h[10:12, "acc"]
    b = h[10:12, ("acc", "macro_recall")]
    c = h[10:12, "acc", "macro_recall"]
    assert a.columns == ["epoch", "step", "acc"]
    assert list(a.epoch) == [10, 11, 12]
    assert b.columns == c.columns == ["epoch", "step", "macro_recall", "acc"]
    assert b.rows == c.rows


def test_steps_selects_by_step_inclusive():
    h = mnist_like(25)
    assert list(h.steps(2000, 2750).epoch) == [8, 9, 10]
    assert list(h.steps(6600).epoch) == [24, 25]
    assert list(h.steps(stop=550).epoch) == [1, 2]


def test_selection_keeps_metadata_and_recomputes_best():
    h = mnist_like(25, title="history of MLP", run_dir="runs/x", total_epochs=40, resumed_from=3)
    assert h.best_epoch == 20
    part = h[5:10]
    assert (part.monitor, part.title, part.run_dir, part.total_epochs, part.resumed_from) == (
        ("macro_recall", "max"), "history of MLP", "runs/x", 40, 3)
    assert part.best_epoch == 10  # the best within the selection
    assert h[5:10, "macro_recall"].best_epoch == 10
    # without the monitored column there is no best
    no_monitor = h["acc"]
    assert no_monitor.best is None and no_monitor.best_epoch is None
    assert "*" not in no_monitor.table(width=100, max_rows=40)


def test_selection_errors():
    h = mnist_like(5)
    with pytest.raises(KeyError) as info:
        h["acc", "nope"]
    message = str(info.value)
    assert "'nope'" in message and "'acc'" not in message
    assert "epoch, step, train_loss, macro_recall, acc, confusion" in message
    with pytest.raises(ValueError, match=r"h\[1:10:2\] has a step"):
        h[1:10:2]
    with pytest.raises(TypeError, match=r"cannot index with 1.5"):
        h[1.5]
    with pytest.raises(TypeError, match=r"takes numbers"):
        h["a":"b"]


# -- best ------------------------------------------------------------------------------


def test_best_max_min_first_on_ties_nan_ignored():
    values = [0.5, float("nan"), 0.9, 0.9, 0.1]
    rows = [{"epoch": i + 1, "step": i, "train_loss": 0.0, "m": v} for i, v in enumerate(values)]
    assert MetricHistory(rows, monitor=("m", "max")).best_epoch == 3
    low = MetricHistory(rows, monitor=("m", "min"))
    assert low.best_epoch == 5
    assert low.best == {"epoch": 5, "step": 4, "train_loss": 0.0, "m": 0.1}
    assert MetricHistory(rows).best is None
    # monitor metric absent everywhere, or NaN everywhere: no best
    assert MetricHistory(rows, monitor=("other", "max")).best_epoch is None
    nan_rows = [{**r, "m": float("nan")} for r in rows]
    h = MetricHistory(nan_rows, monitor=("m", "max"))
    assert h.best_epoch is None
    assert "no best epoch: m has no number in these rows" in footers(h.table(width=100))


def test_monitored_missing_in_some_rows():
    rows = [
        {"epoch": 1, "step": 1, "train_loss": 1.0},
        {"epoch": 2, "step": 2, "train_loss": 0.5, "v": 3.0},
    ]
    h = MetricHistory(rows, monitor=("v", "min"))
    assert h.columns == ["epoch", "step", "train_loss", "v"]
    assert h.best_epoch == 2


# -- columns as arrays -----------------------------------------------------------------


def test_attribute_columns():
    h = mnist_like(4)
    assert h.epoch.dtype.kind == "i" and list(h.step) == [275, 550, 825, 1100]
    np.testing.assert_allclose(h.acc, [0.51, 0.52, 0.53, 0.54])
    assert h.confusion.shape == (4, 3, 3)  # same shape: stacked
    np.testing.assert_array_equal(h.confusion[2], np.eye(3) * 3)
    np.testing.assert_array_equal(h.column("acc"), h.acc)
    with pytest.raises(AttributeError, match=r"no column or attribute 'nope'.*epoch, step"):
        h.nope


def test_ragged_or_missing_arrays_give_object_column():
    rows = [
        {"epoch": 1, "step": 1, "train_loss": 0.0, "pc": np.ones(2)},
        {"epoch": 2, "step": 2, "train_loss": 0.0, "pc": np.ones(3)},
        {"epoch": 3, "step": 3, "train_loss": 0.0},
    ]
    col = MetricHistory(rows).pc
    assert col.dtype == object and col.shape == (3,)
    assert col[1].shape == (3,) and col[2] is None


def test_several_validations_in_one_epoch(tmp_path):
    # val_every_n_steps shorter than an epoch: rows share epochs and are keyed by step
    rows = [{"epoch": e, "step": s, "train_loss": 1.0 / s, "acc": a}
            for e, s, a in [(1, 4, 0.5), (2, 8, 0.7), (2, 12, 0.6), (3, 14, 0.65)]]
    h = MetricHistory(rows, monitor=("acc", "max"), title="history of MLP")
    assert h.best["step"] == 8 and h.best_epoch == 2 and len(h[2:2]) == 2
    assert [r["step"] for r in h.steps(8, 12)] == [8, 12]
    assert h.table(width=100).splitlines()[0] == "history of MLP  (4 rows)"
    pd = pytest.importorskip("pandas")
    df = h.to_pandas()
    assert df.index.name == "step" and list(df.index) == [4, 8, 12, 14] and list(df["epoch"]) == [1, 2, 2, 3]
    assert h[0:1].to_pandas().index.name == "epoch"  # one row an epoch: indexed by epoch, as before
    assert isinstance(df, pd.DataFrame)
    pytest.importorskip("matplotlib")
    drawn = {line.get_label(): line.get_xdata().tolist() for line in h.plot().axes[0].lines}
    assert drawn == {"acc": [4, 8, 12, 14], "best (step 8)": [8]}  # over steps, not stacked on epoch 2
    # and the handle's history of such a run (it raised "epochs must increase")
    import jaxnitro as jn
    from tiny import Tiny

    n = jn.train(Tiny(), run_dir=tmp_path, max_steps=10, max_epochs=None, val_every_n_steps=4, logger=None)
    assert [(r["epoch"], r["step"]) for r in n.history()] == [(1, 4), (2, 8), (2, 10)]


def test_rows_are_copies():
    h = mnist_like(3)
    row = h[0]
    row["acc"] = 99.0
    row["confusion"][0, 0] = 99.0
    for r in h.rows:
        r["acc"] = -1.0
    assert h[0]["acc"] == 0.51 and h[0]["confusion"][0, 0] == 1.0
    assert [r["epoch"] for r in h] == [1, 2, 3]
    assert len(h) == 3


# -- the printed table ---------------------------------------------------------------------


def test_table_marks_best_and_formats_numbers():
    rows = [
        {"epoch": 1, "step": 275, "train_loss": 2.26594, "acc": 0.3682, "lr": 1e-5, "n": 7},
        {"epoch": 2, "step": 550, "train_loss": float("nan"), "acc": 0.94123, "lr": 1e-5, "n": 8},
        {"epoch": 3, "step": 825, "train_loss": 0.9654, "acc": 0.9036, "lr": 1e-5, "n": 9},
    ]
    text = MetricHistory(rows, monitor=("acc", "max"), title="history of MLP",
                         run_dir="runs/mnist").table(width=100, max_rows=20)
    lines = text.splitlines()
    assert lines[0] == "history of MLP  (runs/mnist, 3 epochs)"
    by_steps = [dict(r, epoch=e) for r, e in zip(rows, (4, 8, 11))]  # validated every 1,000 steps, not per epoch
    assert MetricHistory(by_steps, title="history of MLP").table(width=100).splitlines()[0] == "history of MLP  (3 rows)"
    assert lines[1].startswith("┌") and lines[1].endswith("┐")
    assert lines[2].split() == ["│", "epoch", "step", "train_loss", "acc", "lr", "n", "│"]
    rows_text = body(text)
    assert rows_text[0].split() == ["│", "1", "275", "2.2659", "0.3682", "1.000e-05", "7", "│"]
    assert rows_text[1].split() == [
        "│", "2", "550", "nan", "0.9412", "1.000e-05", "8", "*", "│"
    ]
    assert [line.endswith(" * │") for line in rows_text] == [False, True, False]
    assert len({len(line) for line in lines[1:5]}) == 1  # a rectangular frame
    assert footers(text) == ["* best acc (max), the monitored metric"]


def test_table_thins_around_first_best_last():
    h = mnist_like(25, best=20, title="history of MnistMLP", run_dir="runs/mnist")
    text = h.table(width=100, max_rows=15)
    assert text.splitlines()[0] == "history of MnistMLP  (runs/mnist, 14 of 25 epochs)"
    assert len(body(text)) == 15
    assert shown_epochs(text) == [1, 2, 3, 4, 5, 17, 18, 19, 20, 21, 22, 23, 24, 25]
    assert sum(line.split()[1] == "⋮" for line in body(text)) == 1
    starred = [line for line in body(text) if line.endswith(" * │")]
    assert len(starred) == 1 and starred[0].split()[1] == "20"
    assert footers(text)[:2] == [
        "* best macro_recall (max), the monitored metric",
        "11 of 25 epochs thinned to fit; select fewer, `h[11:25]` say, for every row",
    ]
    # the suggested selection does fit
    assert len(body(h[11:25].table(width=100, max_rows=15))) == 15
    assert not any("thinned" in f for f in footers(h[11:25].table(width=100, max_rows=15)))


def test_thinning_keeps_an_early_best_and_the_last_rows():
    h = mnist_like(200, best=3)
    text = h.table(width=100, max_rows=9)
    epochs = shown_epochs(text)
    assert len(body(text)) == 9
    assert epochs[0] == 1 and 3 in epochs and epochs[-1] == 200 and 199 in epochs
    assert any("epochs thinned to fit" in f for f in footers(text))


def test_tiny_row_budget_still_shows_first_best_last():
    text = mnist_like(50, best=25).table(width=100, max_rows=1)
    assert shown_epochs(text) == [1, 25, 50]


def test_footer_for_arrays_and_resume():
    text = mnist_like(3, resumed_from=12).table(width=100, max_rows=20)
    assert "confusion" not in text.splitlines()[2]  # not a column of the table
    foot = footers(text)
    assert "not tabulated: confusion (reach it as h.confusion)" in foot
    assert any(f.startswith("resumed from epoch 12: this history starts there") for f in foot)
    rows = [{"epoch": 1, "step": 1, "train_loss": 0.0, "per class": np.ones(2), "note": "x",
             "table": np.ones(2)}]
    foot = footers(MetricHistory(rows).table(width=100))
    assert ("not tabulated: per class, note, table (reach them as h.column('per class'), "
            "h.note, h.column('table'))") in foot


def test_columns_that_do_not_fit_are_dropped_and_named():
    h = mnist_like(3)
    wide = h.table(width=200)
    narrow = h.table(width=40)
    assert all(len(line) <= 40 for line in narrow.splitlines()[1:5])
    header = narrow.splitlines()[2].split()
    assert "epoch" in header and "macro_recall" in header and "acc" not in header
    dropped = [f for f in footers(narrow) if f.startswith("not shown")]
    assert dropped == ["not shown, the table would pass 40 characters: step, acc "
                       "(select them, h['step', 'acc'], or widen the terminal)"]
    assert not any(f.startswith("not shown") for f in footers(wide))


def test_str_uses_terminal_size(monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.setenv("LINES", "20")  # 20 - 9 lines of chrome = 11 body lines
    h = mnist_like(40)
    assert len(body(str(h))) == 11
    assert repr(h) == str(h) == h.table()


def test_empty_history():
    h = MetricHistory([], monitor=("acc", "max"), title="history of MLP", run_dir="runs/x")
    assert len(h) == 0 and list(h) == [] and h.best is None
    assert str(h) == "history of MLP  (runs/x, no epochs yet)"
    assert "\n" not in repr(h)
    assert h.columns == ["epoch", "step", "train_loss"]
    assert h.epoch.shape == (0,)
    assert len(h[1:5]) == 0
    with pytest.raises(IndexError, match="the history is empty"):
        h[-1]
    assert "no epochs yet" in h._repr_html_()


# -- HTML ---------------------------------------------------------------------------------


def test_html_has_every_row_marks_best_and_escapes():
    rows = [{"epoch": e, "step": e, "train_loss": 0.1, "<b>m</b>": float(e % 7), "cm": np.eye(2)}
            for e in range(1, 61)]
    out = MetricHistory(rows, monitor=("<b>m</b>", "max"), title="a & b")._repr_html_()
    assert out.count("<tr") == 61  # header + every row, no thinning
    assert "<b>m</b>" not in out and "&lt;b&gt;m&lt;/b&gt;" in out
    assert "a &amp; b" in out
    assert out.count("class='best'") == 1
    best_row = out.split("class='best'")[1].split("</tr>")[0]
    assert ">6<" in best_row and ">*<" in best_row
    assert "not tabulated: cm (reach it as h.cm)" in out


# -- conversions ----------------------------------------------------------------------------


def test_to_pandas():
    pd = pytest.importorskip("pandas")
    h = mnist_like(4)
    df = h.to_pandas()
    assert isinstance(df, pd.DataFrame)
    assert df.index.name == "epoch" and list(df.index) == [1, 2, 3, 4]
    assert list(df.columns) == ["step", "train_loss", "macro_recall", "acc", "confusion"]
    assert df["step"].dtype.kind == "i" and df["acc"].dtype.kind == "f"
    assert df["confusion"].dtype == object
    np.testing.assert_array_equal(df.loc[3, "confusion"], np.eye(3) * 3)
    assert df.loc[2, "acc"] == pytest.approx(0.52)
    assert len(h[2:3].to_pandas()) == 2


def test_to_pandas_without_pandas(monkeypatch):
    monkeypatch.setitem(sys.modules, "pandas", None)  # makes `import pandas` fail
    with pytest.raises(ImportError, match=r"pip install pandas"):
        mnist_like(2).to_pandas()


def test_to_csv(tmp_path):
    rows = [
        {"epoch": 1, "step": 10, "train_loss": 0.5, "acc": 0.25, "cm": np.eye(2)},
        {"epoch": 2, "step": 20, "train_loss": float("nan"), "cm": np.eye(2)},
    ]
    path = tmp_path / "run.csv"
    assert MetricHistory(rows).to_csv(path) == path
    with open(path, newline="") as f:
        content = list(csv.reader(f))
    assert content == [
        ["epoch", "step", "train_loss", "acc"],
        ["1", "10", "0.5", "0.25"],
        ["2", "20", "nan", "nan"],
    ]


# -- rendering through the plugin hook ------------------------------------------------------


@pytest.fixture
def history_table_disabled(monkeypatch):
    """The built-in renderer blocked by JAXNITRO_DISABLE_PLUGINS, restored afterwards."""
    monkeypatch.setenv("JAXNITRO_DISABLE_PLUGINS", "history_table")
    jaxnitro.reload_plugins()
    try:
        yield
    finally:
        monkeypatch.undo()
        jaxnitro.reload_plugins()


@pytest.fixture
def register_plugin():
    """``register_plugin(obj)`` registers ``obj`` at runtime; it is unregistered afterwards."""
    pm = jaxnitro.plugin_manager.plugin_manager()
    names = []

    def register(obj, name="x"):
        pm.register(obj, name=name)
        names.append(name)
        return obj

    try:
        yield register
    finally:
        for name in names:
            pm.unregister(name=name)


def test_history_table_plugin_is_loaded_and_declines_other_formats():
    pm = jaxnitro.plugin_manager.plugin_manager()
    assert pm.get_plugin("history_table") is history_table
    h = mnist_like(3)
    assert history_table.jaxnitro_render_history(h, "latex", {}) is None
    assert history_table.jaxnitro_render_history(h, "text", {"width": 100}) == h.table(width=100)


def test_without_the_plugin_outputs_raise_and_display_falls_back(history_table_disabled, tmp_path):
    h = mnist_like(5, title="history of MLP", run_dir="runs/x")
    calls = {
        "text": lambda: h.table(width=100),
        "pandas": h.to_pandas,
        "csv": lambda: h.to_csv(tmp_path / "run.csv"),
    }
    for format, call in calls.items():
        with pytest.raises(RuntimeError) as info:
            call()
        message = str(info.value)
        assert f"no plugin renders histories as {format!r}" in message
        assert "built-in plugin `history_table`" in message
        assert "(plugins disabled by JAXNITRO_DISABLE_PLUGINS: history_table)" in message
    assert not (tmp_path / "run.csv").exists()

    text = str(h)
    assert text == repr(h)
    assert text == (
        "MetricHistory 'history of MLP' (runs/x): 5 epochs, columns epoch, step, train_loss, "
        "macro_recall, acc, confusion; best epoch 5 by macro_recall (max) "
        "[no plugin renders histories as 'text']"
    )
    page = h._repr_html_()
    assert page.startswith("<pre>") and "<table>" not in page
    assert "[no plugin renders histories as &#x27;html&#x27;]" in page
    empty = MetricHistory([], title="<h>")
    assert str(empty).startswith("MetricHistory '<h>': no epochs yet, columns epoch, step")
    assert "&lt;h&gt;" in empty._repr_html_()


def test_a_third_party_renderer_wins_over_the_built_in(register_plugin):
    seen = []

    class Shouting:
        @hookimpl
        def jaxnitro_render_history(self, history, format, options):
            seen.append((format, dict(options)))
            return f"{len(history)} EPOCHS" if format == "text" else None

    h = mnist_like(4)
    built_in = h.table(width=100, max_rows=10)
    register_plugin(Shouting())
    assert str(h) == repr(h) == "4 EPOCHS"
    assert h.table(width=100, max_rows=10) == "4 EPOCHS" != built_in
    assert "<table>" in h._repr_html_()  # "html" declined: the built-in answers
    assert seen == [("text", {}), ("text", {}), ("text", {"width": 100, "max_rows": 10}),
                    ("html", {})]


def test_a_failing_renderer_does_not_break_display(register_plugin):
    class Broken:
        @hookimpl
        def jaxnitro_render_history(self, history, format, options):
            raise ValueError("boom")

    h = mnist_like(2)
    register_plugin(Broken(), name="broken")
    assert str(h).endswith("; best epoch 2 by macro_recall (max) [rendering failed: ValueError: boom]")
    assert "rendering failed: ValueError: boom" in h._repr_html_()
    with pytest.raises(ValueError, match="boom"):
        h.table()


def test_public_accessors_the_renderer_reads():
    h = mnist_like(25, best=20)
    assert h.scalar_columns == ["epoch", "step", "train_loss", "macro_recall", "acc"]
    assert h.best_position == 19 and h[h.best_position]["epoch"] == h.best_epoch == 20
    assert h[3:8].best_position == 5 and h["acc"].best_position is None
    assert MetricHistory.reads_as_attribute("acc")
    assert not any(MetricHistory.reads_as_attribute(n) for n in ("per class", "table", "_x", "class"))
