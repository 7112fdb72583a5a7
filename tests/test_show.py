"""What a handle and an experiment show: ``repr``/``print``, ``_repr_html_``, and the
binding report and prefetch settings handed to the logger."""

from __future__ import annotations

import jax
import numpy as np
import optax

import jaxnitro as jn
from jaxnitro import Device, GraphConst
from jaxnitro.loggers.jsonl import read_jsonl
from jaxnitro.plugins.report import handle_bands

from tiny import N_CLASSES, N_FEATURES, Tiny, tiny_data

DATA = tiny_data()
TINY_PARAMS = N_FEATURES * 16 + 16 + 16 * N_CLASSES + N_CLASSES  # 212


def band(nitro, title: str) -> dict:
    """``{first cell: row}`` of the band titled ``title``."""
    (b,) = [b for b in handle_bands(nitro) if b.title == title]
    return {row[0]: row for row in b.rows}


@jn.experiment
class Shown:
    """An experiment exercising every band: groups, host metrics, optional and unused fields."""

    width: GraphConst[int] = 16
    "Hidden width (structural)."
    smoothing: Device[float] = 0.0
    "Label smoothing."
    class_weights: Device[np.ndarray] = jn.field(factory=lambda: np.ones(N_CLASSES, np.float32))
    "Per-class loss weights."
    notes: str = "a host-only note"
    "Never reaches traced code."
    max_epochs: int = 4
    "Epoch budget."

    build_model = Tiny.build_model

    def build_data(self, dist):
        extra = lambda split: [dict(b, extra=b["y"]) for b in DATA[split]]  # noqa: E731
        return {"train": extra("train"), "val": extra("val")}

    def forward(self, model, state, *, x, mask=None):
        return jax.vmap(model)(x), state

    def loss(self, logits, *, label):
        return -(label * jax.nn.log_softmax(logits)).sum(-1).mean()

    def train_metrics(self, logits, *, label):
        return {"hit": (logits.argmax(-1) == label.argmax(-1)).mean()}

    def metrics(self, logits, *, y):
        return {"acc": ((logits.argmax(-1) == y).sum(), len(y))}

    def param_group(self, keypath):
        return "head" if keypath[0] == "l2" else "default"

    def learning_rate(self):
        return 0.02

    def learning_rate_ratio(self, group):
        return 0.5 if group == "head" else 1.0

    def weight_decay(self, group):
        return 1e-4 if group == "head" else 0.0

    def optimizer(self, group):
        return optax.adam if group == "head" else optax.sgd

    def schedules(self):
        return {"smoothing": lambda total: lambda step: 0.1 * step / total}


# -- the handle --------------------------------------------------------------------------------


def test_repr_shows_the_state_line(tmp_path):
    n = jn.Nitro(Tiny(), accum=2, seed=3, run_dir=tmp_path, logger=None)
    text = repr(n)
    assert text.startswith("Nitro(Tiny)  status: ready")
    assert "seed 3 | accum 2 | horizon 6 optimizer steps (2 epochs x 3) | batch 16 | devices" in text
    assert str(jax.devices()[0]) in text
    assert "weights: build_model (seed 3) | step 0, epoch 0" in text
    for title in ("data", "routing", "bindings", "parameter groups"):
        assert f"\n{title}\n" in text
    assert str(n) == text  # print(nitro) shows the same

    no_train = jn.Nitro(Tiny(), data={"val": DATA["val"]}, run_dir=tmp_path, logger=None)
    assert "horizon no train split" in repr(no_train)
    assert "parameter groups" not in repr(no_train)  # no optimizer without a train split


def test_data_band_rows(tmp_path):
    unordered = jn.PrefetchIterator(DATA["train"], workers=2, ordered=False)
    n = jn.Nitro(Tiny(), data={"train": unordered, "val": DATA["val"]}, run_dir=tmp_path, logger=None)
    rows = band(n, "data")
    assert set(rows) == {"train", "val"}
    for split, batches in (("train", 6), ("val", 3)):
        info = n.data[split].info()
        assert rows[split][:6] == (
            split, batches, info["path"], info["workers"], info["device_batches"], info["host_batches"]
        )
    assert rows["train"][2] == "batch_at, 2 producers" and rows["train"][3] == 2
    assert "UNORDERED" in rows["train"][6]
    # a plain list of batches is said not to be reshuffled
    assert rows["val"][6] == "a list of batches: the same order every epoch (not reshuffled)"
    text = repr(n)
    assert "batch_at, 2 producers" in text and "UNORDERED" in text


def test_routing_band_shows_the_fields_each_hook_receives(tmp_path):
    n = jn.Nitro(Shown(), run_dir=tmp_path, logger=None)
    rows = band(n, "routing")
    assert rows["forward"] == ("forward", "x, mask (optional)", "device")
    assert rows["loss"] == ("loss", "label", "device")
    assert rows["train_metrics"] == ("train_metrics", "label", "device")
    assert rows["metrics"] == ("metrics", "y", "host")  # host metrics: y never leaves the host
    assert rows["never transferred"] == ("never transferred", "y, extra", "host only")
    text = repr(n)
    assert "x, mask (optional)" in text and "never transferred" in text and "y, extra" in text

    tiny = band(jn.Nitro(Tiny(), run_dir=tmp_path, logger=None), "routing")
    assert tiny["forward"][1] == "x" and tiny["loss"][1] == "label"
    assert tiny["never transferred"][1] == "y"


def test_bindings_band_shows_clip_and_schedule_sources(tmp_path):
    keyword = jn.Nitro(
        Tiny(),
        gradient_clip_norm=0.5,
        schedules={"learning_rate": lambda total: optax.cosine_onecycle_schedule(total, 1e-2)},
        run_dir=tmp_path,
        logger=None,
    )
    rows = band(keyword, "bindings")
    assert rows["gradient_clip_norm"] == ("gradient_clip_norm", 0.5, "keyword")
    assert rows["schedule opt/learning_rate"] == ("schedule opt/learning_rate", "optimizer hyperparameter", "keyword")
    assert rows["max_epochs"] == ("max_epochs", 2, "field")
    assert rows["seed"] == ("seed", 0, "default")

    accessor = jn.Nitro(Shown(), run_dir=tmp_path, logger=None)
    rows = band(accessor, "bindings")
    assert rows["gradient_clip_norm"] == ("gradient_clip_norm", "off", "default")
    assert rows["schedule device/smoothing"] == ("schedule device/smoothing", "Device field", "accessor")
    assert not any(k.startswith("schedule opt") for k in rows)
    text = repr(accessor)
    assert "schedule device/smoothing" in text and "accessor" in text
    assert "schedule opt/learning_rate" in repr(keyword) and "keyword" in repr(keyword)


def test_parameter_groups_band(tmp_path):
    rows = band(jn.Nitro(Tiny(), run_dir=tmp_path, logger=None), "parameter groups")
    assert rows == {"default": ("default", "0.01", 1.0, "zero", 0.0, "radam", TINY_PARAMS)}

    rows = band(jn.Nitro(Shown(), run_dir=tmp_path, logger=None), "parameter groups")
    hidden = N_FEATURES * 16 + 16
    assert rows["default"] == ("default", "0.02", 1.0, "zero", 0.0, "sgd", hidden)
    assert rows["head"] == ("head", "0.01", 0.5, "zero", 1e-4, "adam", TINY_PARAMS - hidden)


def test_repr_html_has_tables(tmp_path):
    n = jn.Nitro(Shown(), run_dir=tmp_path, logger=None)
    html = n._repr_html_()
    assert html.startswith("<pre>Nitro(Shown)")
    assert html.count("<table>") == 5
    for title in ("data", "routing", "hooks not defined by the experiment", "bindings", "parameter groups"):
        assert f"<strong>{title}</strong>" in html
    assert "<td>head</td>" in html and "<td>adam</td>" in html
    assert "x, mask (optional)" in html


# -- the experiment -------------------------------------------------------------------------------


def test_experiment_repr_lists_fields_with_marker_value_and_doc():
    text = repr(Shown())
    lines = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[1:-1]]
             for line in text.splitlines() if line.startswith("│")}
    assert text.splitlines()[0] == "Shown"
    assert lines["field"] == ["field", "marker", "value", "doc"]
    assert lines["width"] == ["width", "GraphConst", "16", "Hidden width (structural)."]
    assert lines["smoothing"] == ["smoothing", "Device", "0.0", "Label smoothing."]
    assert lines["class_weights"] == ["class_weights", "Device", "ndarray(4,) float32", "Per-class loss weights."]
    assert lines["notes"] == ["notes", "Host", "'a host-only note'", "Never reaches traced code."]
    assert lines["max_epochs"] == ["max_epochs", "Host", "4", "Epoch budget."]

    big = repr(Shown(class_weights=np.zeros((2, 3), np.float64)))
    assert "ndarray(2, 3) float64" in big and "0., 0." not in big  # summarised, never dumped

    html = Shown()._repr_html_()
    assert "<table>" in html and "<td>GraphConst</td>" in html and "<td>ndarray(4,) float32</td>" in html


# -- the logger receives the report and the prefetch settings -------------------------------------


def test_jsonl_log_has_the_binding_report_and_prefetch_params(tmp_path):
    n = jn.train(Tiny(), max_epochs=1, run_dir=tmp_path)  # the default logger: metrics.jsonl
    lines = read_jsonl(f"{n.run_dir}/metrics.jsonl")
    (other,) = [l for l in lines if l["kind"] == "other" and l["key"] == "binding_report"]
    report = other["value"]
    assert report.startswith("Nitro(Tiny)")
    for piece in ("seed 0 | accum 1", "routing", "never transferred", "bindings", "parameter groups", "radam"):
        assert piece in report
    (params,) = [l["params"] for l in lines if l["kind"] == "params"]
    for split in ("train", "val"):
        info = n.data[split].info()
        for key in ("path", "workers", "device_batches", "host_batches", "ordered"):
            assert params[f"prefetch/{split}/{key}"] == info[key]
    assert params["n_params"] == TINY_PARAMS
    assert params["knob/max_epochs"] == 1 and params["field/width"] == 16
    assert lines[-1]["kind"] == "finish" and lines[-1]["status"] == "done"


def test_a_72_column_terminal_gets_tables_that_fit_and_wrap(tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "72")
    n = jn.Nitro(Shown(), run_dir=tmp_path, logger=None, early_stop=None)
    for text in (repr(n), repr(Shown())):
        lines = text.splitlines()
        assert max(len(line) for line in lines) <= 72
    # a long doc wraps onto more lines of the same framed row instead of being cut
    doc = "Per-class loss weights."
    words = " ".join(line.strip("│ ").split("│")[-1].strip() for line in repr(Shown()).splitlines())
    assert all(w in words for w in doc.split())
