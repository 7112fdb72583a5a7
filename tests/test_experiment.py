"""The experiment class: markers, attribute docs, pytree registration, the compile view,
and the refusals made at decoration / construction, plus ``derive``.

This module deliberately does NOT use ``from __future__ import annotations``, so the
markers are seen as real ``typing.Annotated`` objects here (``tests/tiny.py`` uses the
string form, so both paths are covered).
"""

import attrs
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxnitro as jn
from jaxnitro import Device, GraphConst, Host
from jaxnitro.experiment import fields_of
from tiny import Tiny, tiny_data


@jn.experiment
class Marked:
    width: GraphConst[int] = 8
    "Hidden width.\n\n    Structural."
    scale: Device[float] = 2.0
    "A traced scale."
    weights: Device[np.ndarray] = jn.field(factory=lambda: np.arange(3, dtype=np.float64))
    "Per-class weights."
    name: str = "run"
    "A host-only label."
    explicit: Host[int] = 3
    undocumented: int = 0


# -- markers, docs, construction ------------------------------------------------------------


def test_markers_inner_types_and_attribute_docs():
    infos = fields_of(Marked)
    assert list(infos) == ["width", "scale", "weights", "name", "explicit", "undocumented"]
    assert {n: i.marker.name for n, i in infos.items()} == {
        "width": "GraphConst",
        "scale": "Device",
        "weights": "Device",
        "name": "Host",
        "explicit": "Host",
        "undocumented": "Host",
    }
    assert infos["width"].inner_type is int and infos["scale"].inner_type is float
    assert infos["width"].doc == "Hidden width.\n\nStructural."  # cleandoc'ed
    assert infos["scale"].doc == "A traced scale."
    assert infos["name"].doc == "A host-only label."
    assert infos["explicit"].doc == "" and infos["undocumented"].doc == ""


def test_string_annotations_are_read_too():
    # tests/tiny.py uses `from __future__ import annotations`
    infos = fields_of(Tiny)
    assert infos["width"].is_graph_const and infos["smoothing"].is_device
    assert infos["max_epochs"].is_host
    assert infos["width"].doc == "Hidden width (structural)."


def test_frozen_keyword_only_and_repr_lists_fields():
    e = Marked(scale=3.0)
    with pytest.raises(TypeError):
        Marked(8)  # keyword-only
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        e.scale = 1.0
    text = repr(e)
    for needle in ("Marked", "width", "GraphConst", "scale", "Device", "3.0", "A traced scale.",
                   "name", "Host", "'run'", "ndarray(3,) float64"):
        assert needle in text, (needle, text)


def test_subclass_of_an_experiment_inherits_fields_and_docs():
    @jn.experiment
    class Wider(Tiny):
        extra: Device[float] = 0.5
        "An added knob."

        def monitor(self):
            return ("loss", "min")

    infos = fields_of(Wider)
    assert list(infos) == ["width", "smoothing", "temperature", "max_epochs", "extra"]
    assert infos["width"].is_graph_const and infos["width"].doc == "Hidden width (structural)."
    assert infos["extra"].is_device and infos["extra"].doc == "An added knob."
    e = Wider(smoothing=0.25)
    assert jax.tree_util.tree_leaves(e) == [0.25, 1.0, 0.5]
    view = jn.compile_view(e)
    assert view.temperature == 1.0 and view.width == 16
    assert isinstance(view.max_epochs, jn.StrippedHost)


# -- pytree -------------------------------------------------------------------------------------


def test_pytree_device_fields_are_leaves_graph_and_host_are_static():
    e = Marked(scale=3.0, name="a")
    leaves, treedef = jax.tree_util.tree_flatten(e)
    assert [np.asarray(x).tolist() for x in leaves] == [3.0, [0.0, 1.0, 2.0]]
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(e)[0]]
    assert paths == [".scale", ".weights"]
    back = jax.tree_util.tree_unflatten(treedef, [5.0, np.ones(3)])
    assert type(back) is Marked and back.scale == 5.0 and back.width == 8 and back.name == "a"
    doubled = jax.tree_util.tree_map(lambda x: x * 2, e)
    assert doubled.scale == 6.0 and doubled.width == 8 and doubled.explicit == 3

    traces = []

    @jax.jit
    def f(exp):
        traces.append(1)
        return exp.scale * exp.width + jnp.sum(exp.weights)

    assert float(f(e)) == 3.0 * 8 + 3.0
    assert float(f(attrs.evolve(e, scale=4.0))) == 4.0 * 8 + 3.0
    assert len(traces) == 1, "a new Device value is a new input, not a new trace"
    assert float(f(attrs.evolve(e, width=2))) == 3.0 * 2 + 3.0
    assert len(traces) == 2, "a new GraphConst value is static: it retraces"


# -- compile view and StrippedHost ---------------------------------------------------------------


@pytest.mark.parametrize(
    "use",
    [
        pytest.param(lambda h: h + 1, id="add"),
        pytest.param(lambda h: 2 * h, id="rmul"),
        pytest.param(lambda h: -h, id="neg"),
        pytest.param(lambda h: h < 3, id="compare"),
        pytest.param(lambda h: h == "fast", id="equal"),
        pytest.param(lambda h: h != 3, id="not-equal"),
        pytest.param(lambda h: h[0], id="index"),
        pytest.param(lambda h: len(h), id="len"),
        pytest.param(lambda h: float(h), id="float"),
        pytest.param(lambda h: bool(h), id="bool"),
        pytest.param(lambda h: np.asarray(h), id="np.asarray"),
        pytest.param(lambda h: np.ones(3) * h, id="numpy-array-mul"),
        pytest.param(lambda h: jnp.asarray(h), id="jnp.asarray"),
        pytest.param(lambda h: jnp.add(h, 1), id="jnp.add"),
        pytest.param(lambda h: jnp.exp(h), id="jnp.exp"),
        pytest.param(lambda h: jnp.ones(3) * h, id="jax-array-mul"),
        pytest.param(lambda h: jax.nn.relu(h), id="jax.nn.relu"),
        pytest.param(lambda h: jax.jit(lambda x: x * h)(1.0), id="inside-jit-with-tracer"),
        pytest.param(lambda h: jax.jit(lambda x: jnp.log(h) + x)(1.0), id="jnp.log-inside-jit"),
        pytest.param(lambda h: h.shape, id="attribute"),
        pytest.param(lambda h: h.upper(), id="method"),
    ],
)
def test_stripped_host_any_use_raises_naming_field_and_fix(use):
    view = jn.compile_view(Marked(name="hello"))
    with pytest.raises(TypeError) as err:
        use(view.name)
    msg = str(err.value)
    assert "Host field `name` of Marked" in msg
    assert "Device[...]" in msg and "GraphConst[...]" in msg  # the fix


def test_compile_view_keeps_device_and_graph_values_strips_every_host_field():
    e = Marked(scale=3.0, name="x")
    view = jn.compile_view(e)
    assert type(view) is Marked
    assert view.scale == 3.0 and view.width == 8
    np.testing.assert_array_equal(view.weights, np.arange(3))
    for host in ("name", "explicit", "undocumented"):
        value = getattr(view, host)
        assert isinstance(value, jn.StrippedHost) and repr(value) == f"StrippedHost({host!r})"
    assert e.name == "x", "the experiment itself is untouched"
    # sentinels compare among themselves (they are hashable), but not with values
    assert view.name == jn.StrippedHost("name") and view.name != view.explicit
    assert len({view.name, jn.StrippedHost("name")}) == 1


# -- refusals ---------------------------------------------------------------------------------------


def test_graph_const_seed_refused_at_decoration():
    with pytest.raises(TypeError, match=r"field `seed` of Seeded is marked GraphConst") as err:

        @jn.experiment
        class Seeded:
            seed: GraphConst[int] = 0

    assert "Remove the marker" in str(err.value)


def test_unmarked_seed_is_fine_and_feeds_the_knob():
    @jn.experiment
    class Seeded:
        seed: int = 7

    assert fields_of(Seeded)["seed"].is_host


def test_unhashable_graph_const_refused_at_construction():
    @jn.experiment
    class Layers:
        sizes: GraphConst[tuple] = (4, 4)

    assert Layers(sizes=(8, 2)).sizes == (8, 2)
    with pytest.raises(TypeError, match=r"GraphConst field `sizes` of Layers has an unhashable value of type list"):
        Layers(sizes=[8, 2])
    with pytest.raises(TypeError, match=r"unhashable value of type dict"):
        Layers(sizes={"a": 1})
    Layers(sizes=np.arange(2))  # an array is keyed by its content (tests/test_nothing_silent_a.py)


def test_device_default_that_cannot_convert_refused_at_construction():
    @jn.experiment
    class BadDefault:
        rate: Device[float] = "fast"

    with pytest.raises(TypeError, match=r"Device field `rate` of BadDefault has a value that does not convert"):
        BadDefault()

    @jn.experiment
    class Ragged:
        table: Device[np.ndarray] = jn.field(factory=lambda: [[1, 2], [3]])

    with pytest.raises(TypeError, match=r"Device field `table` of Ragged"):
        Ragged()
    with pytest.raises(TypeError, match=r"Device field `scale` of Marked"):
        Marked(scale={"a": 1})


# -- derive -------------------------------------------------------------------------------------------


@jn.experiment
class Derived(Tiny):
    class_weights: Device[np.ndarray] = jn.field(factory=lambda: np.ones(4, np.float32))
    "Filled in by derive from the training labels."
    n_train: int = 0
    "Filled in by derive (Host)."

    def derive(self, data):
        ys = np.concatenate([b["y"] for b in data["train"]])
        counts = np.bincount(ys, minlength=4)
        return {"class_weights": counts / counts.sum(), "n_train": int(len(ys))}


def test_derive_merges_values_before_device_conversion(tmp_path):
    data = tiny_data()
    n = jn.Nitro(Derived(), run_dir=tmp_path, logger=None)
    ys = np.concatenate([b["y"] for b in data["train"]])
    expected = np.bincount(ys, minlength=4) / len(ys)
    assert n.experiment.n_train == 96
    np.testing.assert_allclose(n.experiment.class_weights, expected)
    dev = n.device_values["class_weights"]
    assert dev.dtype == jnp.float32, "derived float64 values are converted like any Device value"
    np.testing.assert_allclose(np.asarray(dev), expected, rtol=1e-6)
    np.testing.assert_allclose(n.device_value("class_weights"), expected, rtol=1e-6)


def test_derive_is_skipped_with_empty_data(tmp_path):
    n = jn.Nitro(Derived(), data={}, run_dir=tmp_path, logger=None)
    assert n.experiment.n_train == 0


def test_derive_unknown_key_raises_naming_it(tmp_path):
    @jn.experiment
    class Typo(Tiny):
        def derive(self, data):
            return {"class_wieghts": np.ones(4)}

    with pytest.raises(KeyError) as err:
        jn.Nitro(Typo(), run_dir=tmp_path, logger=None)
    msg = str(err.value)
    assert "class_wieghts" in msg and "not fields of Typo" in msg and "declare them as fields" in msg
