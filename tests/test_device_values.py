"""Device values on a live handle: ``set_device`` writes in place (zero compiles),
``device_value`` reads back a host value, and every refusal names its case and
says that a new ``Nitro`` is the answer."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jaxnitro as jn
from jaxnitro import Device

from tiny import N_CLASSES, Tiny, TinyCore, tiny_data

DATA = tiny_data()
BATCH = {"x": DATA["val"][0]["x"]}
NEW_NITRO = "new `Nitro`"


def misses() -> int:
    return jn.cache_stats().misses


@jn.experiment
class Weighted(TinyCore):
    """Tiny with an array-valued Device field and an integer Device field."""

    class_weights: Device[np.ndarray] = jn.field(factory=lambda: np.ones(N_CLASSES, np.float32))
    "Per-class loss weights."
    offset: Device[int] = 0
    "An integer Device field."
    max_epochs: int = 1
    "Epoch budget (Host)."

    def forward(self, model, state, *, x):
        logits, state = TinyCore.forward(self, model, state, x=x)
        return logits * self.class_weights + self.offset, state


@pytest.fixture
def nitro(tmp_path):
    return jn.Nitro(Tiny(), data=DATA, run_dir=tmp_path, logger=None)


@pytest.fixture
def weighted(tmp_path):
    return jn.Nitro(Weighted(), data=DATA, run_dir=tmp_path, logger=None)


# -- writing and reading ----------------------------------------------------------------------


def test_set_device_temperature_rescales_predictions_with_zero_compiles(nitro):
    before = nitro.predict(BATCH)  # temperature 1.0: the raw logits
    m = misses()
    nitro.set_device(temperature=0.5)
    after = nitro.predict(BATCH)
    assert misses() - m == 0
    np.testing.assert_array_equal(after, before / np.float32(0.5))
    # writing it back restores the original outputs, still without compiling
    m = misses()
    nitro.set_device(temperature=1.0)
    np.testing.assert_array_equal(nitro.predict(BATCH), before)
    assert misses() - m == 0


def test_set_device_affects_validation_loss_without_compiling(nitro):
    base = nitro.validate()["loss"]
    m = misses()
    nitro.set_device(smoothing=0.5)
    smoothed = nitro.validate()["loss"]
    assert misses() - m == 0
    assert smoothed != base


def test_device_value_returns_host_values(nitro, weighted):
    t = nitro.device_value("temperature")
    assert isinstance(t, np.generic) and not isinstance(t, jax.Array)
    assert t == np.float32(1.0) and t.dtype == np.float32
    nitro.set_device(temperature=0.25)
    assert nitro.device_value("temperature") == np.float32(0.25)

    w = weighted.device_value("class_weights")
    assert isinstance(w, np.ndarray) and not isinstance(w, jax.Array)
    np.testing.assert_array_equal(w, np.ones(N_CLASSES, np.float32))
    weighted.set_device(class_weights=[1, 2, 3, 4], offset=3)
    np.testing.assert_array_equal(weighted.device_value("class_weights"), [1.0, 2.0, 3.0, 4.0])
    assert weighted.device_value("class_weights").dtype == np.float32
    assert weighted.device_value("offset") == 3 and weighted.device_value("offset").dtype == np.int32


def test_array_device_field_write_takes_effect_with_zero_compiles(weighted):
    before = weighted.predict(BATCH)
    m = misses()
    weights = np.array([1.0, 0.0, 2.0, -1.0], np.float32)
    weighted.set_device(class_weights=weights)
    after = weighted.predict(BATCH)
    assert misses() - m == 0
    np.testing.assert_allclose(after, before * weights, rtol=1e-6)


def test_device_value_of_a_non_device_field_is_refused(nitro):
    with pytest.raises(KeyError, match=r"`width` is not a Device field.*temperature"):
        nitro.device_value("width")


# -- refusals: each names its case and says a new Nitro is the answer ------------------------


def test_refuses_a_graph_const_field(nitro):
    with pytest.raises(TypeError, match=r"`width`: it is a GraphConst field") as err:
        nitro.set_device(width=32)
    assert NEW_NITRO in str(err.value)


def test_refuses_a_host_field(nitro):
    with pytest.raises(TypeError, match=r"`max_epochs`: it is a Host field") as err:
        nitro.set_device(max_epochs=5)
    assert NEW_NITRO in str(err.value)


def test_refuses_a_scheduled_field(tmp_path):
    n = jn.Nitro(
        Tiny(),
        data=DATA,
        run_dir=tmp_path,
        logger=None,
        schedules={"smoothing": lambda total: lambda step: 0.1},
    )
    with pytest.raises(TypeError, match=r"`smoothing`: it is scheduled") as err:
        n.set_device(smoothing=0.2)
    assert NEW_NITRO in str(err.value)
    n.set_device(temperature=0.5)  # an unscheduled field of the same handle is fine
    assert n.device_value("temperature") == np.float32(0.5)


def test_refuses_a_value_that_does_not_convert(nitro, weighted):
    with pytest.raises(TypeError, match=r"`temperature`: the value 'hot' does not convert .*float32") as err:
        nitro.set_device(temperature="hot")
    assert NEW_NITRO in str(err.value)
    with pytest.raises(TypeError, match=r"`offset`: the value 1.5 does not convert .*int32") as err:
        weighted.set_device(offset=1.5)
    assert NEW_NITRO in str(err.value)
    with pytest.raises(TypeError, match=r"does not convert"):
        nitro.set_device(temperature=object())


def test_refuses_an_array_of_another_shape(weighted):
    with pytest.raises(ValueError, match=r"`class_weights`: the new value has shape \(3,\), the field has shape \(4,\)") as err:
        weighted.set_device(class_weights=np.ones(3, np.float32))
    assert NEW_NITRO in str(err.value)
    with pytest.raises(ValueError, match=r"shape \(\)"):
        weighted.set_device(temperature=np.ones(2))


def test_refuses_an_unknown_name_with_a_suggestion(nitro):
    with pytest.raises(KeyError, match=r"unknown name.*no field `temprature`.*Did you mean `temperature`") as err:
        nitro.set_device(temprature=0.5)
    assert NEW_NITRO in str(err.value)
    assert "smoothing" in str(err.value) and "temperature" in str(err.value)  # lists the Device fields


def test_messages_are_distinct_per_case(nitro, weighted, tmp_path):
    scheduled = jn.Nitro(
        Tiny(), data=DATA, run_dir=tmp_path, logger=None,
        schedules={"smoothing": lambda total: lambda step: 0.1},
    )
    cases = [
        (nitro, {"width": 8}),
        (nitro, {"max_epochs": 3}),
        (scheduled, {"smoothing": 0.3}),
        (nitro, {"temperature": "hot"}),
        (weighted, {"class_weights": np.ones(2)}),
        (nitro, {"nope": 1}),
    ]
    messages = set()
    for handle, values in cases:
        with pytest.raises((TypeError, ValueError, KeyError)) as err:
            handle.set_device(**values)
        text = str(err.value)
        assert NEW_NITRO in text
        messages.add(text.split(":")[2])  # the case, after "jaxnitro: set_device cannot write `x`"
    assert len(messages) == len(cases)


def test_set_device_is_all_or_nothing(nitro, weighted):
    with pytest.raises(TypeError, match="GraphConst"):
        nitro.set_device(temperature=0.5, width=32)
    assert nitro.device_value("temperature") == np.float32(1.0)
    with pytest.raises(TypeError, match="does not convert"):
        nitro.set_device(temperature=0.5, smoothing="lots")
    assert nitro.device_value("temperature") == np.float32(1.0)
    assert nitro.device_value("smoothing") == np.float32(0.0)
    with pytest.raises(ValueError, match="shape"):
        weighted.set_device(offset=2, class_weights=np.ones(5))
    assert weighted.device_value("offset") == 0
    np.testing.assert_array_equal(weighted.device_value("class_weights"), np.ones(N_CLASSES))


def test_set_device_does_not_touch_the_experiment_or_other_handles(nitro, tmp_path):
    other = jn.Nitro(Tiny(), data=DATA, run_dir=tmp_path, logger=None)
    nitro.set_device(temperature=0.5)
    assert nitro.experiment.temperature == 1.0  # the experiment is frozen; the handle holds the value
    assert other.device_value("temperature") == np.float32(1.0)


# -- a Device field's default must convert (checked at construction) ---------------------------


def test_device_field_whose_default_does_not_convert_is_refused():
    @jn.experiment
    class BadDefault:
        label: Device[float] = "cat"
        "A string is no Device value."

    with pytest.raises(TypeError, match=r"Device field `label` of BadDefault .*does not convert to an array"):
        BadDefault()

    @jn.experiment
    class Ragged:
        table: Device[np.ndarray] = jn.field(factory=lambda: [np.ones(2), np.ones(3)])

    with pytest.raises(TypeError, match=r"Device field `table` of Ragged"):
        Ragged()

    with pytest.raises(TypeError, match=r"Device field `temperature` of Tiny"):
        Tiny(temperature={"a": 1})


class SetTemperatureAfterEpoch1:
    """A plugin changing a Device field mid-run (a curriculum), at epoch 1's end."""

    @jn.hookimpl
    def jaxnitro_epoch_end(self, run, row):
        if row["epoch"] == 1:
            run.nitro.set_device(temperature=5.0)


def test_set_device_mid_run_reaches_blocks_of_steps_too(tmp_path):
    """With ``steps_per_dispatch`` > 1 the fixed Device values enter each block tiled ``k``
    times; a ``set_device`` between blocks is tiled again, so the run is bitwise the one
    dispatched a step at a time (the tiles were once made per run, and the change was lost)."""
    from jaxnitro.events import run_scoped

    params = {}
    for k in (1, 3):
        n = jn.Nitro(Tiny(max_epochs=2), data=tiny_data(), logger=None, steps_per_dispatch=k, run_dir=tmp_path)
        with run_scoped([SetTemperatureAfterEpoch1()]):
            n.train()
        assert float(n.device_value("temperature")) == 5.0
        params[k] = jax.tree_util.tree_leaves(n.params)
    for one, block in zip(params[1], params[3]):
        np.testing.assert_array_equal(one, block)
