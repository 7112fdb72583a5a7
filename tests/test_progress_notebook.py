"""The progress display in a real Jupyter kernel (issue 11, item 6).

Not a simulation: each test builds a small notebook with nbformat and executes
it with nbclient on an ipykernel kernel running this venv's python, then reads
the executed notebook. With ipywidgets installed, ``"auto"`` sees the kernel
(:func:`in_notebook`) and ``TqdmReporter`` draws through ``tqdm.auto``, i.e.
tqdm's notebook widget: a ``display_data`` output per bar (the setup line, then
the run's bar), updated over comm messages; nothing on stderr. Without
ipywidgets, the same run falls back to the text bar on stderr instead of failing.

What the saved notebook holds: the widget state nbclient stores in the notebook's
metadata (what a front end renders), and a ``text/plain`` fallback for viewers
without widgets, which the reporter refreshes when a bar closes, so it shows the
end (``done: 2/2 epochs``), not the start.

The kernel is a fresh process importing jax (about 7 s on 2 cores), so these
tests are ``slow`` (CI runs them with ``-m slow``).
"""

from __future__ import annotations

import html
import importlib.util
import json
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="the notebook tests need nbformat (extra: test)")
nbclient = pytest.importorskip("nbclient", reason="the notebook tests need nbclient (extra: test)")
if importlib.util.find_spec("ipykernel") is None:  # not imported here: it would import IPython into pytest
    pytest.skip("the notebook tests need ipykernel (extra: test)", allow_module_level=True)

pytestmark = pytest.mark.slow  # a fresh kernel process that imports jax and compiles (~7 s)

TESTS_DIR = str(Path(__file__).resolve().parent)
KERNEL_NAME = "jaxnitro-test-venv"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
BAR_TEXT = ("epoch", "setup", "%|")  # what a text bar (or its label) would leave in a stream


class RecordingClient(nbclient.NotebookClient):
    """A NotebookClient that also keeps every string ``value`` a widget was set to, in order."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.widget_values: list[str] = []

    def handle_comm_msg(self, outs, msg, cell_index):
        state = msg["content"].get("data", {}).get("state", {})
        if isinstance(state.get("value"), str):
            self.widget_values.append(_text(state["value"]))
        super().handle_comm_msg(outs, msg, cell_index)


def _text(value: str) -> str:
    """A tqdm widget HTML value as plain text (tqdm writes figure spaces and escapes HTML)."""
    return html.unescape(value).replace("\u2007", " ")


@pytest.fixture
def venv_kernel(tmp_path, monkeypatch):
    """A kernel spec running this interpreter (not whatever ``python`` is on PATH), in a temp JUPYTER_PATH."""
    spec_dir = tmp_path / "jupyter" / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "jaxnitro test venv",
        "language": "python",
        # The notebook user's environment, not CI's: the "auto" rule is silent under CI
        # (tested in test_progress_plugin.py), and CI runs this test with CI set.
        "env": {"CI": ""},
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))  # connection files
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))  # no profile written to ~/.ipython
    monkeypatch.setenv("JUPYTER_PLATFORM_DIRS", "1")  # jupyter_core's path-migration warning
    return KERNEL_NAME


def _run_notebook(kernel_name: str, tmp_path: Path, first_lines: str = ""):
    """Build and execute the notebook: setup cell, training cell, history cell. Returns (nb, client)."""
    run_dir = str(tmp_path / "runs")
    cells = [
        first_lines
        + f"import sys; sys.path.insert(0, {TESTS_DIR!r})\n"
        + "import jaxnitro as jn\n"
        + "from jaxnitro.plugins.progress import in_notebook\n"
        + "from tiny import Tiny, tiny_data\n"
        + "assert in_notebook(), 'the kernel is not seen as a notebook'",
        f"n = jn.train(Tiny(max_epochs=2), data=tiny_data(), run_dir={run_dir!r}, logger=None)",
        "print(n.history())",
    ]
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source) for source in cells]
    client = RecordingClient(
        nb,
        kernel_name=kernel_name,
        timeout=120,
        startup_timeout=60,
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()  # raises CellExecutionError (with the traceback) if a cell fails
    return nb, client


def _check_history_cell(cell) -> None:
    out = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream" and o.name == "stdout")
    assert "history of Tiny" in out and "2 epochs, 2 planned" in out, out


def test_notebook_kernel_draws_tqdm_widgets(venv_kernel, tmp_path):
    if importlib.util.find_spec("ipywidgets") is None:
        pytest.skip("tqdm draws its notebook widget only with ipywidgets (extra: test)")
    nb, client = _run_notebook(venv_kernel, tmp_path)
    setup_cell, train_cell, history_cell = nb.cells

    assert not setup_cell.outputs, setup_cell.outputs
    # Two widget displays, in order: the setup line on its own, then the run's bar.
    widgets = [o for o in train_cell.outputs if o.output_type == "display_data" and WIDGET_VIEW in o.data]
    assert len(widgets) == 2, train_cell.outputs
    setup, run = widgets
    # text/plain, the fallback for widget-less viewers: refreshed at close, so it shows the end.
    assert setup.data["text/plain"].startswith("setup done"), setup.data
    assert setup.data["text/plain"].count("%|") == 0, setup.data  # phases: no bar, no percentage
    assert run.data["text/plain"].startswith("done: 2/2 epochs"), run.data
    assert "2.00/2" in run.data["text/plain"], run.data

    # No text bar instead (or as well): nothing bar-like on stderr or stdout of the training cell.
    for o in train_cell.outputs:
        if o.output_type == "stream":
            assert not any(marker in o.text for marker in BAR_TEXT), (o.name, o.text)
    assert not [o for o in train_cell.outputs if o.output_type == "error"]

    # The final state, as stored in the notebook (what a front end draws): each display's
    # HBox holds [left HTML, progress, right HTML].
    state = nb.metadata["widgets"][WIDGET_STATE]["state"]

    def parts(display):
        box = state[display.data[WIDGET_VIEW]["model_id"]]
        assert box["model_name"] == "HBoxModel", box
        left, bar, right = (state[ref.removeprefix("IPY_MODEL_")]["state"] for ref in box["state"]["children"])
        return _text(left["value"]) + "|" + _text(right["value"]), bar

    setup_text, _ = parts(setup)
    assert "setup done" in setup_text, setup_text
    run_text, run_bar = parts(run)
    assert run_text.startswith("done: 2/2 epochs"), run_text
    assert "100%" in run_text and "2.00/2" in run_text, run_text
    assert (run_bar["value"], run_bar["max"], run_bar["bar_style"]) == (2.0, 2.0, "success"), run_bar

    # Live updates went over comm messages while the cell ran: the epochs' labels, in order.
    seen = client.widget_values
    labels = ("setup done", "epoch 1/2: train [compiling", "epoch 2/2: train", "done: 2/2 epochs")
    firsts = [next((i for i, v in enumerate(seen) if v.startswith(label)), None) for label in labels]
    assert None not in firsts, (labels, seen)
    assert firsts == sorted(firsts), seen

    _check_history_cell(history_cell)


def test_notebook_kernel_without_ipywidgets_falls_back_to_text(venv_kernel, tmp_path):
    # A kernel where `import ipywidgets` fails: tqdm.auto picks the text bar (and warns).
    nb, _ = _run_notebook(venv_kernel, tmp_path, first_lines="import sys; sys.modules['ipywidgets'] = None\n")
    _, train_cell, history_cell = nb.cells
    assert not [o for o in train_cell.outputs if o.output_type == "display_data"], train_cell.outputs
    err = "".join(o.text for o in train_cell.outputs if o.output_type == "stream" and o.name == "stderr")
    assert "setup done" in err, err
    final = err.rstrip("\n").split("\r")[-1].split("\n")[-1]
    assert final.startswith("done: 2/2 epochs") and "100%" in final, err
    assert not [o for o in train_cell.outputs if o.output_type == "error"]
    _check_history_cell(history_cell)
