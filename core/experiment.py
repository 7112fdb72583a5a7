"""The ``@experiment`` decorator, field metadata and the compile view.

An experiment is one attrs class (frozen, keyword-only constructor) whose fields
are marked ``Host`` (default), ``GraphConst`` or ``Device`` and whose methods
implement the hooks of :mod:`jaxnitro.hookspecs`. The decorator also registers
the class as a JAX pytree: Device fields are leaves, GraphConst and Host fields
are static auxiliary data.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import typing
from dataclasses import dataclass

import attrs
import numpy as np

import jax

from .markers import Device, GraphConst, Host, Marker, StrippedHost, marker_of

__all__ = [
    "experiment",
    "field",
    "FieldInfo",
    "fields_of",
    "compile_view",
    "is_experiment",
    "make_view",
]

field = attrs.field
"""``jn.field(default=..., factory=...)``: ``attrs.field``, re-exported."""


@dataclass(frozen=True)
class FieldInfo:
    """What jaxnitro knows about one experiment field."""

    name: str
    marker: Marker
    doc: str
    inner_type: object

    @property
    def is_device(self) -> bool:
        return self.marker is Device

    @property
    def is_graph_const(self) -> bool:
        return self.marker is GraphConst

    @property
    def is_host(self) -> bool:
        return self.marker is Host


def is_experiment(obj) -> bool:
    """True for an instance or class made by ``@jn.experiment``."""
    return hasattr(obj, "__jaxnitro_fields__")


def fields_of(obj) -> dict[str, FieldInfo]:
    """Return ``{name: FieldInfo}`` for an experiment class or instance, in declaration order."""
    try:
        return obj.__jaxnitro_fields__
    except AttributeError:
        raise TypeError(
            f"jaxnitro: {type(obj).__name__} is not an experiment; decorate its class with "
            f"`@jn.experiment`."
        ) from None


def _attribute_docs(cls) -> dict[str, str]:
    """Map field names to the string literal written right after them (attribute docstrings)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError):
        return {}
    docs: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            body = node.body
            for prev, nxt in zip(body, body[1:]):
                if (
                    isinstance(prev, ast.AnnAssign)
                    and isinstance(prev.target, ast.Name)
                    and isinstance(nxt, ast.Expr)
                    and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)
                ):
                    docs[prev.target.id] = inspect.cleandoc(nxt.value.value)
            break
    return docs


def _annotations(cls) -> dict[str, object]:
    raw = dict(cls.__dict__.get("__annotations__", {}))
    try:
        resolved = typing.get_type_hints(cls, include_extras=True)
    except Exception:  # forward references that cannot resolve: use the strings
        resolved = {}
    return {name: resolved.get(name, ann) for name, ann in raw.items()}


def _check_graph_const_hashable(cls_name: str, name: str, value) -> None:
    try:
        hash(value)
    except TypeError:
        hint = (
            "use a tuple instead of a list"
            if isinstance(value, list)
            else "use a hashable value (tuple, frozenset, number, string)"
        )
        raise TypeError(
            f"jaxnitro: GraphConst field `{name}` of {cls_name} has an unhashable value of type "
            f"{type(value).__name__}. GraphConst values are part of the compile-cache key, so they "
            f"must be hashable: {hint}, or mark an array-valued field `Device[...]` so it is passed "
            f"to the programs as an input."
        ) from None


def _device_dtype(inner_type, value):
    """The dtype a Device field converts to: float -> float32, int -> int32, else the value's."""
    if inner_type in (float, "float"):
        return np.float32
    if inner_type in (int, "int"):
        return np.int32
    if inner_type in (bool, "bool"):
        return np.bool_
    arr = np.asarray(value)
    if arr.dtype == np.float64:
        return np.float32
    if arr.dtype == np.int64:
        return np.int32
    return arr.dtype


def to_device_value(cls_name: str, info: FieldInfo, value) -> np.ndarray:
    """Convert a Device field's value to the host array that is placed on the device.

    Raises ``TypeError`` naming the field when the value does not convert.
    """
    try:
        dtype = _device_dtype(info.inner_type, value)
        arr = np.asarray(value, dtype=dtype)
        if arr.dtype == object:
            raise TypeError("object dtype")
    except (TypeError, ValueError) as err:
        raise TypeError(
            f"jaxnitro: Device field `{info.name}` of {cls_name} has a value that does not convert "
            f"to an array ({type(value).__name__}: {err}). Device fields are passed to compiled "
            f"programs as arrays; give it a number or a NumPy array, or leave it unmarked (Host) "
            f"if traced code never reads it."
        ) from None
    return arr


def _post_init(self) -> None:
    cls = type(self)
    for name, info in cls.__jaxnitro_fields__.items():
        value = getattr(self, name)
        if info.is_graph_const:
            _check_graph_const_hashable(cls.__name__, name, value)
        elif info.is_device:
            to_device_value(cls.__name__, info, value)


def experiment(cls=None, /):
    """Make ``cls`` an experiment: a frozen, keyword-only attrs class registered as a pytree.

    Fields are read from the class annotations with their markers
    (``Device[T]``, ``GraphConst[T]``, unmarked = Host) and the string literal
    after each field becomes its doc. Methods named like the hooks in
    :class:`jaxnitro.hookspecs.ExperimentSpec` are the experiment's hooks.

    Raises ``TypeError`` at decoration for a ``GraphConst`` field named ``seed``,
    and at construction for an unhashable GraphConst value or a Device value
    that does not convert to an array.
    """
    if cls is None:
        return experiment
    if not isinstance(cls, type):
        raise TypeError("jaxnitro: @jn.experiment decorates a class.")
    docs = _attribute_docs(cls)
    infos: dict[str, FieldInfo] = {}
    # A subclass of an experiment inherits its fields (markers and docs); its own
    # annotations add fields or override inherited ones, as attrs does.
    for base in reversed(cls.__mro__[1:]):
        infos.update(base.__dict__.get("__jaxnitro_fields__", {}))
    for name, ann in _annotations(cls).items():
        if typing.get_origin(ann) is typing.ClassVar or (
            isinstance(ann, str) and ann.startswith(("ClassVar", "typing.ClassVar"))
        ):
            continue
        marker, inner = marker_of(ann)
        infos[name] = FieldInfo(name, marker, docs.get(name, ""), inner)
    seed = infos.get("seed")
    if seed is not None and seed.is_graph_const:
        raise TypeError(
            f"jaxnitro: field `seed` of {cls.__name__} is marked GraphConst. A GraphConst value is "
            f"baked into the compiled graph, so every new seed would compile new programs. Remove "
            f"the marker: an unmarked (Host) `seed` field is read by the `seed` run knob and never "
            f"reaches traced code."
        )
    user_post_init = cls.__dict__.get("__attrs_post_init__")

    def __attrs_post_init__(self):
        _post_init(self)
        if user_post_init is not None:
            user_post_init(self)

    cls.__attrs_post_init__ = __attrs_post_init__
    new_cls = attrs.define(cls, frozen=True, kw_only=True, eq=False, slots=True)
    new_cls.__jaxnitro_fields__ = infos
    new_cls.__repr__ = _experiment_repr
    new_cls._repr_html_ = _experiment_repr_html
    _register_pytree(new_cls, infos)
    return new_cls


# -- views ------------------------------------------------------------------


def make_view(cls, values: dict[str, object]):
    """Build an instance of ``cls`` from ``values`` without running attrs validation.

    Used to hand traced code an experiment whose Device fields are tracers and
    whose Host fields are :class:`StrippedHost` sentinels.
    """
    obj = object.__new__(cls)
    for name, value in values.items():
        object.__setattr__(obj, name, value)
    return obj


def compile_view(e):
    """Return what traced code sees of experiment ``e``: Host fields replaced by sentinels.

    GraphConst and Device fields keep their values; every Host field becomes
    ``StrippedHost(name)``, whose any use raises naming the field and the fix.
    """
    infos = fields_of(e)
    owner = type(e).__name__
    return make_view(
        type(e),
        {
            name: (StrippedHost(name, owner) if info.is_host else getattr(e, name))
            for name, info in infos.items()
        },
    )


class _HostBox:
    """Static pytree aux data holding Host values, compared by identity (never hashed by value)."""

    __slots__ = ("values",)

    def __init__(self, values):
        self.values = values

    def __eq__(self, other):
        return isinstance(other, _HostBox) and all(
            a is b for a, b in zip(self.values, other.values)
        )

    def __hash__(self):
        return hash(tuple(id(v) for v in self.values))


def _register_pytree(cls, infos: dict[str, FieldInfo]) -> None:
    device = [n for n, i in infos.items() if i.is_device]
    graph = [n for n, i in infos.items() if i.is_graph_const]
    host = [n for n, i in infos.items() if i.is_host]

    def flatten_with_keys(e):
        children = [(jax.tree_util.GetAttrKey(n), getattr(e, n)) for n in device]
        aux = (tuple(getattr(e, n) for n in graph), _HostBox(tuple(getattr(e, n) for n in host)))
        return children, aux

    def flatten(e):
        children, aux = flatten_with_keys(e)
        return [c for _, c in children], aux

    def unflatten(aux, children):
        graph_values, host_box = aux
        values = dict(zip(device, children))
        values.update(zip(graph, graph_values))
        values.update(zip(host, host_box.values))
        return make_view(cls, values)

    jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)


# -- display ----------------------------------------------------------------


def summarize_value(value) -> str:
    """A short text for a field value: arrays by shape and dtype, others by repr (truncated)."""
    if hasattr(value, "shape") and hasattr(value, "dtype") and np.ndim(value) > 0:
        return f"{type(value).__name__}{tuple(value.shape)} {value.dtype}"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _experiment_repr(self) -> str:
    from .describe import describe

    return describe(self, "text")


def _experiment_repr_html(self) -> str:
    from .describe import describe

    return describe(self, "html")
