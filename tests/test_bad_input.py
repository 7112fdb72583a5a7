"""Silent acceptance, refused: one test per misuse that used to pass silently (issue 8).

Each asserts the error (or warning) type, that the message names the culprit (the field,
hook, knob, key or split) and, where there is one, the fix. docs/errors.md lists them with
where each is raised (decoration, setup, the first step, a verb).
"""

from __future__ import annotations

import textwrap
import warnings

import jax
import numpy as np
import pytest

import jaxnitro as jn
from jaxnitro import Device
from jaxnitro import SourceLengthError
from jaxnitro.routing import BatchFieldError
from tiny import N_CLASSES, Tiny, TinyCore, batches, fresh_tiny, make_arrays, tiny_data

QUIET = dict(logger=None)
DATA = tiny_data()


def msg(excinfo) -> str:
    return str(excinfo.value)


def jaxnitro_warnings(record) -> list[str]:
    return [str(w.message) for w in record if str(w.message).startswith("jaxnitro:")]


# == hooks and fields ==============================================================================


@pytest.mark.parametrize(
    "method, closest",
    [("metric", "metrics"), ("monitr", "monitor"), ("learning_rat", "learning_rate"), ("acum", "accum")],
)
def test_misspelled_hook_or_knob_method_warns_with_the_closest_name(tmp_path, method, closest):
    cls = jn.experiment(type("Typo", (Tiny,), {method: lambda self, *a, **k: None}))
    with pytest.warns(UserWarning) as record:
        jn.Nitro(cls(), run_dir=tmp_path, **QUIET)
    (text,) = [t for t in jaxnitro_warnings(record) if f"`{method}`" in t]
    assert f"method `{method}` of Typo" in text and "jaxnitro never calls it" in text  # culprit
    assert "did you mean the" in text and f"`{closest}`" in text  # the closest name
    assert f"Rename it to `{closest}`" in text  # fix


def test_helper_methods_far_from_hook_names_do_not_warn(tmp_path):
    @jn.experiment
    class Helpers(Tiny):
        def encode(self, x):
            return x

        def accuracy(self, logits, y):
            return 0.0

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jn.Nitro(Helpers(), run_dir=tmp_path, **QUIET)
    assert [str(w.message) for w in caught if "jaxnitro" in str(w.message)] == []


@pytest.mark.parametrize("hook, fix", [
    ("learning_rate", "`lr: <type> = ...` and `def learning_rate(self): return self.lr`"),
    ("monitor", "def monitor(self): return self.monitored"),
    ("weight_decay", "def weight_decay(self, group): return self.wd"),
])
def test_field_named_like_a_hook_is_refused_at_decoration(hook, fix):
    with pytest.raises(TypeError) as err:
        jn.experiment(type("Fielded", (Tiny,), {"__annotations__": {hook: float}, hook: 1e-3}))
    assert f"field `{hook}` of Fielded" in msg(err) and f"named like the experiment hook `{hook}`" in msg(err)
    assert "silently ignored" in msg(err) and fix in msg(err)


@jn.experiment
class AccumField(Tiny):
    accum: int = 1
    "A field named like the run knob."


def test_subclass_method_wins_over_an_inherited_knob_field_and_warns(tmp_path):
    @jn.experiment
    class AccumMethod(AccumField):
        def accum(self):
            return 3

    with pytest.warns(UserWarning) as record:
        n = jn.Nitro(AccumMethod(), run_dir=tmp_path, **QUIET)
    assert n.settings.accum == 3 and n.settings.source("accum") == "accessor"  # method > field
    (text,) = jaxnitro_warnings(record)
    assert "both a method `accum` (in AccumMethod) and a field `accum` = 1" in text
    assert "the method wins" in text and "Rename one of them" in text


def test_inherited_knob_method_wins_over_a_subclass_field_and_warns(tmp_path):
    @jn.experiment
    class Base(Tiny):
        def accum(self):
            return 2

    @jn.experiment
    class Sub(Base):
        accum: int = 3

    with pytest.warns(UserWarning, match=r"both a method `accum` \(in Base\) and a field `accum` = 3"):
        n = jn.Nitro(Sub(), run_dir=tmp_path, **QUIET)
    assert n.settings.accum == 2  # consistently: a method > a field


def test_method_named_like_a_non_knob_field_is_refused_at_decoration():
    with pytest.raises(TypeError) as err:

        @jn.experiment
        class Shadow(Tiny):
            def width(self):
                return 32

    assert "Shadow defines a method `width`, but `width` is a field (declared in TinyCore)" in msg(err)
    assert "silently drop the method" in msg(err) and "redeclare the field with a new default" in msg(err)


def test_a_train_metric_that_is_not_a_scalar_is_refused_naming_it(tmp_path):
    per_row = fresh_tiny("PerRow", train_metrics=lambda self, logits, *, label: {"margin": logits[:, 0]})
    with pytest.raises(TypeError) as err:
        jn.train(per_row(), run_dir=tmp_path, logger=None)
    assert "train metric `margin` has shape (16,); `train_metrics` returns per-step scalars" in msg(err)
    assert "Reduce it (e.g. `.mean()`)" in msg(err)


def test_a_train_step_with_the_wrong_positionals_is_refused_by_name():
    with pytest.raises(TypeError) as err:
        jn.Nitro(fresh_tiny("Manual", train_step=lambda self, model, *, x: model)(), logger=None)
    assert "hook `train_step` of Manual takes positional parameters ('self', 'model')" in msg(err)
    assert "`train_step(self, models, optimizers, *, <batch fields>)`" in msg(err)


# == numbers and flags =============================================================================


@pytest.mark.parametrize("rate", [-1e-3, float("nan"), float("inf")])
def test_learning_rate_that_is_negative_or_not_finite(tmp_path, rate):
    cls = jn.experiment(type("BadRate", (TinyCore,), {"learning_rate": lambda self: rate}))
    with pytest.raises(ValueError) as err:
        jn.Nitro(cls(), run_dir=tmp_path, **QUIET)
    assert f"base learning rate is {rate!r}" in msg(err) and "`learning_rate` of BadRate (experiment)" in msg(err)
    assert "finite number >= 0" in msg(err)


def test_learning_rate_that_is_a_string(tmp_path):
    cls = jn.experiment(type("StrRate", (TinyCore,), {"learning_rate": lambda self: "1e-3"}))
    with pytest.raises(TypeError, match=r"base learning rate is '1e-3'.*it must be a number"):
        jn.Nitro(cls(), run_dir=tmp_path, **QUIET)


@pytest.mark.parametrize("hook", ["learning_rate_ratio", "weight_decay"])
def test_nan_group_ratio_or_decay(tmp_path, hook):
    cls = jn.experiment(type("NanGroup", (Tiny,), {hook: lambda self, group: float("nan")}))
    with pytest.raises(ValueError) as err:
        jn.Nitro(cls(), run_dir=tmp_path, **QUIET)
    assert f"`{hook}('default')` of NanGroup returned nan" in msg(err) and "finite number >= 0" in msg(err)


@pytest.mark.parametrize("clip", [-1.0, float("nan"), "1.0"])
def test_gradient_clip_norm_that_would_switch_clipping_off(tmp_path, clip):
    with pytest.raises(ValueError) as err:
        jn.Nitro(Tiny(), run_dir=tmp_path, gradient_clip_norm=clip, **QUIET)
    assert f"run knob `gradient_clip_norm` = {clip!r} (keyword)" in msg(err)
    assert "finite number >= 0" in msg(err) and "0 (or None) for no clipping" in msg(err)


@pytest.mark.parametrize("knob", ["check_divergence", "autolog_schedules"])
def test_flag_knob_given_a_string(tmp_path, knob):
    with pytest.raises(ValueError) as err:
        jn.Nitro(Tiny(), run_dir=tmp_path, **{knob: "False"}, **QUIET)
    assert f"run knob `{knob}` = 'False' (keyword)" in msg(err) and "True or False" in msg(err)


@pytest.mark.parametrize("seed", [1.7, "3", True])
def test_seed_that_is_not_an_integer(tmp_path, seed):
    with pytest.raises(ValueError) as err:
        jn.Nitro(Tiny(), run_dir=tmp_path, seed=seed, **QUIET)
    assert f"run knob `seed` = {seed!r}" in msg(err) and "it must be an integer" in msg(err)


@jn.experiment
class Typed(TinyCore):
    count: Device[int] = 0
    rate: Device[float] = 0.5
    flag: Device[bool] = False


@pytest.mark.parametrize(
    "field, value, error, reason",
    [
        ("count", 2.7, TypeError, "is not an integer type (a float would be truncated)"),
        ("count", 2**40, ValueError, "does not fit in int32"),
        ("count", 2**70, ValueError, "does not fit in int32"),
        ("rate", None, TypeError, "None is not a value (it would become NaN)"),
        ("rate", "0.1", TypeError, "a str is refused, never parsed as a number"),
        ("rate", 1e40, ValueError, "overflows float32"),
        ("flag", 0.5, TypeError, "for a bool field would be read as True/False"),
    ],
)
def test_device_value_that_would_change_meaning_at_construction(field, value, error, reason):
    with pytest.raises(error) as err:
        Typed(**{field: value})
    assert f"Device field `{field}` of Typed" in msg(err) and reason in msg(err)
    assert type(err.value) is error  # never NumPy's raw OverflowError


@pytest.fixture(scope="module")
def typed_handle(tmp_path_factory):
    return jn.Nitro(Typed(), data={}, run_dir=tmp_path_factory.mktemp("typed"), **QUIET)


@pytest.mark.parametrize(
    "field, value, error, reason",
    [
        ("count", 2**40, ValueError, "does not fit in int32"),  # used to wrap to 0
        ("count", 2.7, TypeError, "is not an integer type"),
        ("rate", "0.1", TypeError, "a str is refused"),  # used to be parsed
        ("rate", None, TypeError, "None is not a value"),
        ("flag", 0.5, TypeError, "give True or False"),  # used to give True
    ],
)
def test_set_device_value_that_would_change_meaning(typed_handle, field, value, error, reason):
    with pytest.raises(error) as err:
        typed_handle.set_device(**{field: value})
    assert f"set_device cannot write `{field}`" in msg(err) and reason in msg(err)
    assert "Pass a value of that dtype" in msg(err)
    typed_handle.set_device(count=7, rate=0.25, flag=True)  # the right kinds still work
    assert typed_handle.device_value("count") == 7 and typed_handle.device_value("flag")


@pytest.mark.parametrize(
    "kwargs, text",
    [
        (dict(min_delta=-0.1), "EarlyStopping(min_delta=-0.1)"),
        (dict(min_delta=float("nan")), "EarlyStopping(min_delta=nan)"),
        (dict(patience=2.5), "EarlyStopping(patience=2.5)"),
        (dict(patience=0), "EarlyStopping(patience=0)"),
    ],
)
def test_early_stopping_arguments(kwargs, text):
    with pytest.raises(ValueError) as err:
        jn.EarlyStopping(**kwargs)
    assert text in msg(err)


@pytest.mark.parametrize(
    "schedules, name",
    [
        ({"learning_rate": lambda total: lambda s: np.where(np.asarray(s) < 3, 1e-3, np.nan)}, "opt/learning_rate"),
        ({"learning_rate": lambda total: lambda s: -1e-3}, "opt/learning_rate"),
        ({"smoothing": lambda total: lambda s: np.where(np.asarray(s) < 3, 0.0, np.nan)}, "device/smoothing"),
    ],
)
def test_schedule_with_nan_or_negative_values(tmp_path, schedules, name):
    n = jn.Nitro(Tiny(), data={"train": DATA["train"]}, run_dir=tmp_path, schedules=schedules, **QUIET)
    with pytest.raises(ValueError) as err:
        n.train()  # materialized at train start, before any step
    assert f"schedule `{name}` gives" in msg(err) and "at step" in msg(err)
    assert n.step == 0


# == the data contract ============================================================================


def test_short_batch_in_the_middle_of_the_train_split(tmp_path):
    train = list(DATA["train"])
    train[2] = {k: v[:10] for k, v in train[2].items()}
    with pytest.raises(ValueError) as err:
        jn.Nitro(Tiny(), data={"train": train}, run_dir=tmp_path, **QUIET)
    assert "`train` split's batch 2 (of 6) has 10 rows; its first batch has 16" in msg(err)
    assert "compiles a second train step" in msg(err) and "make all train batches 16 rows" in msg(err)


class Counted:
    """An iterable source whose len() is given, yielding ``yields`` batches."""

    def __init__(self, batches, length, yields):
        self.batches, self.length, self.yields = batches, length, yields

    def __len__(self):
        return self.length

    def __iter__(self):
        return iter(self.batches[: self.yields])


@pytest.mark.parametrize("workers", [0, 1])
@pytest.mark.parametrize("yields, said", [(5, "yielded 5 batches, but its len() is 6"),
                                          (7, "yielded more than its len() of 6 batches")])
def test_source_whose_len_disagrees_with_what_it_yields(tmp_path, workers, yields, said):
    train = DATA["train"] + DATA["train"][:1]
    source = jn.PrefetchIterator(Counted(train, 6, yields), workers=workers)
    n = jn.Nitro(Tiny(), data={"train": source}, run_dir=tmp_path, max_epochs=1, **QUIET)
    with pytest.raises(SourceLengthError) as err:
        n.train()
    assert isinstance(err.value, ValueError)
    assert f"the `train` split {said}" in msg(err) and "epoch 1" in msg(err)  # split, len, count
    assert "make the source's __len__ return the number of batches one pass yields" in msg(err)


def test_zero_row_batch(tmp_path):
    empty = {k: v[:0] for k, v in DATA["train"][0].items()}
    with pytest.raises(ValueError) as err:
        jn.Nitro(Tiny(), data={"train": [empty] * 6}, run_dir=tmp_path, **QUIET)
    assert "`train` split's first batch has no rows" in msg(err) and "drop empty batches" in msg(err)
    assert "lower the learning rate" not in msg(err)
    n = jn.Nitro(Tiny(), run_dir=tmp_path, **QUIET)
    with pytest.raises(ValueError, match="the prediction batch has no rows"):
        n.predict({"x": np.zeros((0, 8), np.float32)})


@jn.experiment
class Keyed(Tiny):
    def loss(self, logits, *, label, key):
        return Tiny.loss(self, logits, label=label) + 0.0 * jax.random.uniform(key)


def test_batch_column_named_key_is_refused_when_a_hook_declares_key(tmp_path):
    data = {"train": [{**b, "key": np.arange(16)} for b in DATA["train"]]}
    with pytest.raises(ValueError) as err:
        jn.Nitro(Keyed(), data=data, run_dir=tmp_path, **QUIET)
    assert "the `train` split's first batch has a field named `key`" in msg(err)
    assert "hook(s) ['loss'] declare the keyword `key`" in msg(err) and "rename the column" in msg(err)


@pytest.mark.parametrize(
    "batch, what",
    [
        ((np.zeros((16, 8), np.float32), np.zeros(16, np.int32)), "is a tuple of 2, not a dict"),
        (np.zeros((16, 8), np.float32), "is a bare array of shape (16, 8), not a dict"),
    ],
)
def test_batches_that_are_not_dicts(tmp_path, batch, what):
    with pytest.raises(TypeError) as err:
        jn.Nitro(Tiny(), data={"train": [batch] * 6}, run_dir=tmp_path, **QUIET)
    assert f"the first batch of the `train` split {what}" in msg(err)
    assert "`{'x': x, 'label': y}` instead of `(x, y)`" in msg(err)


@jn.experiment
class ClassesFirst(Tiny):
    def forward(self, model, state, *, x):
        return (jax.vmap(model)(x) / self.temperature).T, state  # (classes, batch)

    def loss(self, logits, *, label):
        return Tiny.loss(self, logits.T, label=label)


def test_outputs_that_are_not_batch_first(tmp_path):
    n = jn.Nitro(ClassesFirst(), run_dir=tmp_path, **QUIET)
    with pytest.raises(ValueError) as err:
        n.validate()
    assert "returned the output with shape (4, 16), but the batch has 16 rows" in msg(err)
    assert "must be batch-first" in msg(err) and "transpose it" in msg(err)
    with pytest.raises(ValueError, match=r"shape \(4, 16\).*16 rows \(3 real rows padded to 16\)"):
        n.predict({"x": np.zeros((3, 8), np.float32)})


# == metrics and stopping ========================================================================


def metrics_returning(entry):
    def metrics(self, logits, *, y):
        return {"acc": entry(logits, y)}

    return metrics


@pytest.mark.parametrize(
    "entry, text",
    [
        (lambda logits, y: (np.sum(logits.argmax(-1) == y), 0), "metric `acc` has a total count of 0"),
        (lambda logits, y: (np.sum(logits.argmax(-1) == y), -len(y)), "returned the count -16.0 for a batch"),
    ],
)
def test_metric_count_of_zero_or_below(tmp_path, entry, text):
    cls = jn.experiment(type("BadCount", (Tiny,), {"metrics": metrics_returning(entry)}))
    n = jn.Nitro(cls(), run_dir=tmp_path, **QUIET)
    with pytest.raises(ValueError) as err:
        n.validate()
    assert text in msg(err) and "`(value_sum, n)`" in msg(err)


@jn.experiment
class MonitorsAcc(Tiny):
    def metrics(self, logits, *, y):
        return {"acc": (np.sum(logits.argmax(-1) == y), len(y))}

    def monitor(self):
        return ("acc", "max")


def test_empty_val_split_warns_or_is_refused_with_a_monitor(tmp_path):
    data = {"train": DATA["train"], "val": []}
    with pytest.warns(UserWarning, match=r"the `val` split has no batches .*training validates nothing"):
        jn.Nitro(Tiny(), data=data, run_dir=tmp_path, **QUIET)
    with pytest.raises(ValueError) as err:
        jn.Nitro(MonitorsAcc(), data=data, run_dir=tmp_path, **QUIET)
    assert "the `val` split has no batches, so `monitor`'s metric 'acc' can never be computed" in msg(err)


def test_nan_monitored_metric_is_named_in_the_stop_reason(tmp_path):
    @jn.experiment
    class NanAcc(MonitorsAcc):
        def finalize_metrics(self, acc, split):
            return {**acc, "acc": float("nan")}

    with pytest.warns(RuntimeWarning, match=r"monitored metric 'acc' is NaN at epoch \d"):
        n = jn.train(NanAcc(), run_dir=tmp_path, max_epochs=5, early_stop=jn.EarlyStopping(patience=2), **QUIET)
    assert n.status == "done" and n.epoch == 2
    assert "acc was NaN at epoch 2 (NaN never counts as an improvement)" in n.stop_reason


def test_array_valued_monitored_metric(tmp_path):
    @jn.experiment
    class ArrayAcc(MonitorsAcc):
        def finalize_metrics(self, acc, split):
            return {"acc": np.full(3, acc["acc"])}

    with pytest.raises(TypeError) as err:
        jn.Nitro(ArrayAcc(), run_dir=tmp_path, **QUIET)  # checked at setup, with one val batch
    assert "the monitored metric 'acc' is an array of shape (3,)" in msg(err)
    assert "reduce this one in `finalize_metrics`" in msg(err)


def test_array_valued_monitored_metric_from_an_iterated_val_split(tmp_path):
    @jn.experiment
    class ArrayAcc(MonitorsAcc):
        def finalize_metrics(self, acc, split):
            return {"acc": np.full(3, acc["acc"])}

    val = Counted(DATA["val"], len(DATA["val"]), len(DATA["val"]))  # not read at setup
    n = jn.Nitro(ArrayAcc(), data={"train": DATA["train"], "val": val}, run_dir=tmp_path,
                 early_stop=jn.EarlyStopping(patience=2), **QUIET)
    with pytest.raises(TypeError, match=r"the monitored metric 'acc' is an array of shape \(3,\)"):
        n.train()  # at the end of the first validated epoch, by early stopping
    assert n.status == "failed"


def test_array_valued_monitored_metric_is_refused_at_validation_without_a_stop_policy(tmp_path):
    tripled = jn.experiment(type("Tripled", (MonitorsAcc,), {
        "finalize_metrics": lambda self, acc, split: {"acc": np.full(3, acc["acc"])}}))
    data = {"train": DATA["train"], "val": Counted(DATA["val"], len(DATA["val"]), len(DATA["val"]))}
    n = jn.Nitro(tripled(), data=data, run_dir=tmp_path, **QUIET)  # no stop policy reads the metric
    with pytest.raises(TypeError, match=r"the monitored metric 'acc' is an array of shape \(3,\)"):
        n.train()  # where the validation's metrics enter the row, before any plugin reads it
    assert (n.status, n.step) == ("failed", len(DATA["train"]))


@pytest.mark.parametrize("name", ["step", "epoch", "train_loss"])
def test_metric_named_like_a_history_column(tmp_path, name):
    cls = jn.experiment(type("Clash", (Tiny,), {"metrics": lambda self, logits, *, y: {name: (1.0, 1)}}))
    n = jn.Nitro(cls(), run_dir=tmp_path, **QUIET)
    with pytest.raises(ValueError) as err:
        n.validate()
    assert f"the `val` split's metrics include ['{name}']" in msg(err)
    assert "fixed columns ['epoch', 'step', 'train_loss']" in msg(err) and "Rename the metric" in msg(err)


def test_monitor_naming_a_missing_metric_is_found_at_setup(tmp_path):
    cls = jn.experiment(type("Missing", (MonitorsAcc,), {"monitor": lambda self: ("f1", "max")}))
    with pytest.raises(KeyError) as err:
        jn.Nitro(cls(), run_dir=tmp_path, **QUIET)
    assert "`monitor` names 'f1', but the `val` split's metrics are ['acc']" in msg(err)
    assert "Return 'f1' from `metrics`/`finalize_metrics`" in msg(err)


def test_setup_check_compiles_nothing(tmp_path):
    before = jn.cache_stats()
    jn.Nitro(MonitorsAcc(), run_dir=tmp_path, **QUIET)
    jn.Nitro(MonitorsAcc(width=24), run_dir=tmp_path, **QUIET)  # a GraphConst never compiled before
    assert jn.cache_stats() == before


def test_field_missing_from_the_val_split_is_found_at_setup(tmp_path):
    data = {"train": DATA["train"], "val": [{"x": b["x"]} for b in DATA["val"]]}
    with pytest.raises(BatchFieldError) as err:
        jn.Nitro(Tiny(), data=data, run_dir=tmp_path, **QUIET)
    assert "hook `loss` requires batch field(s) ['label'] but the `val` split's first batch has ['x']" in msg(err)


def test_val_batch_wider_than_the_train_batch_is_found_at_setup(tmp_path):
    x, y, oh = make_arrays(64, seed=3)
    data = {"train": DATA["train"], "val": batches(x, y, oh, 32)}
    with pytest.raises(ValueError) as err:
        jn.Nitro(Tiny(), data=data, run_dir=tmp_path, **QUIET)
    assert "the `val` split's batch 0 has 32 rows, wider than the train batch (16 rows)" in msg(err)
    assert "at most 16 rows per batch" in msg(err)


# == traced Host fields ============================================================================


@pytest.mark.parametrize("test", ["self.mode is None", "self.mode is not None", "isinstance(self.mode, str)"])
def test_identity_test_on_a_host_field_in_traced_code(tmp_path, test):
    source = textwrap.dedent(
        f"""
        @jn.experiment
        class Moded(Tiny):
            mode: str = None

            def forward(self, model, state, *, x):
                logits, state = Tiny.forward(self, model, state, x=x)
                return self.scaled(logits), state

            def scaled(self, logits):
                return logits * 2 if {test} else logits
        """
    )
    path = tmp_path / "moded.py"
    path.write_text("import jaxnitro as jn\nfrom tiny import Tiny\n" + source)
    namespace: dict = {}
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    with pytest.raises(TypeError) as err:
        jn.Nitro(namespace["Moded"](), run_dir=tmp_path, **QUIET)
    text = msg(err)
    assert "method `scaled` (called from hook `forward`) of Moded tests Host field `mode`" in text
    assert f"`{test}`" in text and "moded.py" in text  # the expression, the line's file
    assert "mark the field `GraphConst[...]`" in text


# == predict ======================================================================================


@pytest.fixture(scope="module")
def tiny_handle(tmp_path_factory):
    return jn.Nitro(Tiny(), run_dir=tmp_path_factory.mktemp("predict"), **QUIET)


@pytest.mark.parametrize(
    "x, error, text",
    [
        (np.zeros((4, 5), np.float32), ValueError, "field `x` has shape (4, 5), but the `train` split's batches have `x` of shape (batch, 8)"),
        (np.zeros(8, np.float32), ValueError, "field `x` has shape (8,): one example without the batch dimension"),
        (np.zeros((4, 8), np.float64), TypeError, "field `x` has dtype float64, but the `train` split's batches have float32"),
    ],
)
def test_predict_input_unlike_the_train_batches(tiny_handle, x, error, text):
    with pytest.raises(error) as err:
        tiny_handle.predict({"x": x})
    assert text in msg(err)
    fix = {ValueError: ("`x[None]`", "batch dimension first"), TypeError: ("`x.astype(np.float32)`",)}[error]
    assert any(f in msg(err) for f in fix)


def test_predict_on_a_handle_without_data_follows_the_first_batch(tmp_path):
    n = jn.Nitro(Tiny(), data={}, run_dir=tmp_path, **QUIET)
    assert n.predict({"x": np.zeros((4, 8), np.float32)}).shape == (4, N_CLASSES)
    with pytest.raises(TypeError, match=r"dtype float64, but the first predicted batch have float32"):
        n.predict({"x": np.zeros((4, 8))})


# == notebook re-runs ============================================================================

CELL = textwrap.dedent(
    """
    import jax
    import jaxnitro as jn
    from tiny import TinyCore

    FACTOR = 1.0

    @jn.experiment
    class Cell(TinyCore):
        max_epochs: int = 1

        def forward(self, model, state, *, x):
            return self.scale(jax.vmap(model)(x)), state

        def scale(self, logits):
            return logits * FACTOR
    """
)


def test_unchanged_class_defined_again_hits_the_cache(tmp_path):
    notebook: dict = {"__name__": "notebook_for_bad_input"}
    exec(CELL, notebook)
    first = notebook["Cell"]
    jn.train(first(), run_dir=tmp_path, **QUIET)
    exec(CELL, notebook)  # the same cell re-run: a new class object, the same code and fields
    again = notebook["Cell"]
    assert again is not first
    before = jn.cache_stats()
    n = jn.train(again(), run_dir=tmp_path, **QUIET)
    after = jn.cache_stats()
    assert after.misses == before.misses and after.hits > before.hits
    assert n.status == "done"
    exec(CELL.replace("FACTOR = 1.0", "FACTOR = 0.5"), notebook)  # an edited global: recompiles
    jn.train(notebook["Cell"](), run_dir=tmp_path, **QUIET)
    assert jn.cache_stats().misses > after.misses
