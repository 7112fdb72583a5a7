"""A tiny experiment shared by the tests: 4-class logistic/MLP model on synthetic data.

Small enough that a compile takes well under a second on 2 CPU cores.
"""

from __future__ import annotations

import itertools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import jaxnitro as jn
from jaxnitro import Device, GraphConst
from jaxnitro.experiment import fields_of

N_FEATURES = 8
N_CLASSES = 4


def make_arrays(n: int = 96, seed: int = 0):
    """Linearly separable-ish data: x (n, 8) float32, y int32 (n,), onehot (n, 4)."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(N_CLASSES, N_FEATURES)) * 3
    y = rng.integers(0, N_CLASSES, size=n).astype(np.int32)
    x = (centers[y] + rng.normal(size=(n, N_FEATURES))).astype(np.float32)
    onehot = np.eye(N_CLASSES, dtype=np.float32)[y]
    return x, y, onehot


def batches(x, y, onehot, batch: int, drop_last: bool = True) -> list[dict]:
    """A list of batch dicts (a list is an index-addressable source)."""
    n = len(x)
    stop = n - n % batch if drop_last else n
    return [
        {"x": x[i : i + batch], "label": onehot[i : i + batch], "y": y[i : i + batch]}
        for i in range(0, stop, batch)
    ]


def assert_parts_make_the_batches(whole, parts, field: str, epochs=(0, 1), max_rows: int | None = None) -> None:
    """For each epoch, batch ``i`` of the index-addressable ``whole`` is batch ``i`` of each
    process part that has one (``for_process``), put together in process order; each part's
    batch has at most ``max_rows`` rows when given."""
    for epoch in epochs:
        for src in (whole, *parts):
            src.begin_epoch(epoch)
        for i in range(len(whole)):
            got = [q.batch_at(i)[field] for q in parts if i < len(q)]
            assert max_rows is None or all(len(g) <= max_rows for g in got)
            np.testing.assert_array_equal(np.concatenate(got), whole.batch_at(i)[field])


def tiny_data(n_train: int = 96, n_val: int = 40, batch: int = 16) -> dict:
    """train: 6 full batches of 16; val: 40 rows = 2 full batches + a partial batch of 8."""
    x, y, oh = make_arrays(n_train + n_val)
    return {
        "train": batches(x[:n_train], y[:n_train], oh[:n_train], batch),
        "val": batches(x[n_train:], y[n_train:], oh[n_train:], batch, drop_last=False),
    }


class Net(eqx.Module):
    l1: eqx.nn.Linear
    l2: eqx.nn.Linear

    def __init__(self, width, key):
        k1, k2 = jax.random.split(key)
        self.l1 = eqx.nn.Linear(N_FEATURES, width, key=k1)
        self.l2 = eqx.nn.Linear(width, N_CLASSES, key=k2)

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.l1(x)))


@jn.experiment
class TinyCore:
    """Tiny's model half: its structural and traced fields, its data, model, forward and loss.

    No run settings: ``max_epochs`` and ``learning_rate`` are left to the framework's
    defaults. Subclass it for a local experiment that must not inherit them (or
    whose hooks must disappear when deleted, rather than fall back to Tiny's).
    """

    width: GraphConst[int] = 16
    "Hidden width (structural)."
    smoothing: Device[float] = 0.0
    "Label smoothing (a traced input)."
    temperature: Device[float] = 1.0
    "Logit temperature."

    def build_data(self, dist):
        return tiny_data()

    def build_model(self, key):
        return Net(self.width, key)

    def forward(self, model, state, *, x):
        return jax.vmap(model)(x) / self.temperature, state

    def loss(self, logits, *, label):
        target = (1 - self.smoothing) * label + self.smoothing / N_CLASSES
        return -jnp.mean(jnp.sum(target * jax.nn.log_softmax(logits), -1))


@jn.experiment
class Tiny(TinyCore):
    max_epochs: int = 2
    "Epoch budget."

    def learning_rate(self):
        return 1e-2


def fresh_tiny(name: str = "FreshTiny", **members):
    """A new experiment class: a subclass of Tiny with its own compile-cache keys.

    Every program key starts with the class's module, qualified name and fields, and holds
    what the traced code reaches of its content (an unchanged class defined again shares
    its programs), so each fresh class gets a unique ``__qualname__`` (``__name__`` stays
    ``name``): it starts with no programs, whatever other tests compiled before.
    ``members`` become class attributes: hooks, or, for a name that is a field of
    Tiny, that field's new default (it keeps its marker; attribute docs of a class
    made here are empty).
    """
    fields = fields_of(Tiny)
    overridden = {field: _annotation(Tiny, field) for field in members if field in fields}
    unique = {"__qualname__": f"{name}_fresh{next(_FRESH_IDS)}"}
    return jn.experiment(type(name, (Tiny,), {"__annotations__": overridden, **unique, **members}))


_FRESH_IDS = itertools.count()


def _annotation(cls, name: str):
    """The annotation that declared field ``name`` on ``cls`` or its nearest base."""
    for klass in cls.__mro__:
        annotations = klass.__dict__.get("__annotations__", {})
        if name in annotations:
            return annotations[name]
    raise KeyError(name)
