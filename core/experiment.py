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

from . import hookspecs
from .cache import stable_key
from .describe import describe, summarize_value
from .hookspecs import EXPERIMENT_HOOKS
from .knob_table import RUN_KNOBS
from .markers import Device, GraphConst, Host, Marker, StrippedHost, marker_of

__all__ = [
    "experiment",
    "field",
    "FieldInfo",
    "fields_of",
    "compile_view",
    "is_experiment",
    "make_view",
    "method_of",
    "call_method",
    "convert_exactly",
    "ConversionRefused",
    "traced_functions",
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


def is_array_value(value) -> bool:
    """A NumPy or JAX array (a GraphConst may hold one: it is keyed by content, see
    :func:`graph_key`)."""
    return isinstance(value, (np.ndarray, jax.Array))


def graph_key(value):
    """The compile-key form of a GraphConst value: an array by ``(shape, dtype, hash of its
    bytes)`` (:func:`jaxnitro.cache.stable_key`), anything else (hashable) as it is."""
    return stable_key(value) if is_array_value(value) else value


def _check_graph_const_hashable(cls_name: str, name: str, value) -> None:
    if is_array_value(value):
        if np.asarray(value).dtype.kind in "OV":
            raise TypeError(
                f"jaxnitro: GraphConst field `{name}` of {cls_name} is an array of dtype "
                f"{np.asarray(value).dtype}; a GraphConst array is baked into the graph and keyed by "
                f"its bytes, so it must hold numbers or bools. Give a numeric array."
            )
        return
    try:
        hash(value)
    except TypeError:
        hint = (
            "use a tuple instead of a list"
            if isinstance(value, list)
            else "use a hashable value (tuple, frozenset, number, string) or a NumPy array"
        )
        raise TypeError(
            f"jaxnitro: GraphConst field `{name}` of {cls_name} has an unhashable value of type "
            f"{type(value).__name__}. GraphConst values are part of the compile-cache key, so they "
            f"must be hashable (arrays are keyed by their content): {hint}, or mark the field "
            f"`Device[...]` so it is passed to the programs as an input."
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


class ConversionRefused(Exception):
    """Why a value does not convert to a Device dtype without loss (``args[0]``, no prefix);
    ``out_of_range`` when the type is right but the value does not fit."""

    def __init__(self, reason: str, out_of_range: bool = False):
        super().__init__(reason)
        self.out_of_range = out_of_range


def convert_exactly(value, dtype) -> np.ndarray:
    """``value`` as an array of ``dtype``, refusing every silent change of meaning.

    Refused (:class:`ConversionRefused` with the reason): ``None``, strings and
    bytes (never parsed), objects and ragged lists; a float for an integer field
    (``2.7`` would become ``2``); anything but a bool for a bool field (``0.5``
    would become ``True``); a bool for a number field; an integer out of the
    dtype's range (``2**40`` would wrap to ``0``); a finite float that overflows
    to infinity.
    """
    if value is None:
        raise ConversionRefused("None is not a value (it would become NaN)")
    if isinstance(value, (str, bytes)):
        raise ConversionRefused(f"a {type(value).__name__} is refused, never parsed as a number")
    try:
        arr = np.asarray(value)
    except OverflowError:
        raise ConversionRefused(f"{value!r} does not fit in {np.dtype(dtype)}", out_of_range=True) from None
    except (TypeError, ValueError) as err:
        raise ConversionRefused(str(err)) from None
    kind, target = arr.dtype.kind, np.dtype(dtype)
    if kind == "O" and isinstance(value, int):
        raise ConversionRefused(f"{value!r} does not fit in {target}", out_of_range=True)
    if kind in "OUSVMm":
        what = "None or a ragged/mixed list" if kind == "O" else f"dtype {arr.dtype}"
        raise ConversionRefused(f"it is {what}, not a number or a numeric array")
    if target.kind == "b":
        if kind != "b":
            raise ConversionRefused(f"a {arr.dtype} value for a bool field would be read as True/False; give True or False")
    elif kind == "b":
        raise ConversionRefused(f"a bool for a {target} field; give a number")
    elif target.kind in "iu":
        if kind not in "iu":
            raise ConversionRefused(f"{arr.dtype} is not an integer type (a float would be truncated); give an integer")
        info = np.iinfo(target)
        if arr.size and (arr.min() < info.min or arr.max() > info.max):
            raise ConversionRefused(
                f"{value!r} does not fit in {target} ({info.min}..{info.max}); it would wrap around",
                out_of_range=True,
            )
    elif target.kind == "f":
        if kind not in "iuf":
            raise ConversionRefused(f"a {arr.dtype} value for a {target} field")
        with np.errstate(over="ignore"):
            new = arr.astype(target)
        if kind == "f" and bool(np.all(np.isfinite(arr))) and not bool(np.all(np.isfinite(new))):
            raise ConversionRefused(f"{value!r} overflows {target} (it would become inf)", out_of_range=True)
        return new
    return arr.astype(target)


def non_finite(arr: np.ndarray) -> str | None:
    """Why a converted Device value is refused as not finite, or None: a NaN anywhere (a NaN is
    never a setting: every output it touches becomes NaN), or a scalar that is ``inf``/``-inf``
    (a temperature, a smoothing, a scale). An array may hold ``±inf`` (an attention mask's
    ``-inf`` entries are a real use)."""
    if arr.dtype.kind != "f" or not arr.size:
        return None
    if bool(np.isnan(arr).any()):
        return "it is NaN" if arr.ndim == 0 else f"it holds NaN ({int(np.isnan(arr).sum())} of {arr.size} entries)"
    if arr.ndim == 0 and not bool(np.isfinite(arr)):
        return f"it is {float(arr)!r}"
    return None


def _refuse_non_finite(cls_name: str, name: str, arr: np.ndarray) -> np.ndarray:
    why = non_finite(arr)
    if why is not None:
        raise ValueError(
            f"jaxnitro: Device field `{name}` of {cls_name} is not finite: {why}. A Device value "
            f"reaches every compiled program as an input, where a NaN (or an infinite scalar) "
            f"turns the outputs, the loss and then the weights into NaN without an error. Give a "
            f"finite number (an array may hold +-inf, e.g. a mask, but never NaN)."
        )
    return arr


def to_device_value(cls_name: str, info: FieldInfo, value) -> np.ndarray:
    """Convert a Device field's value to the host array that is placed on the device.

    Raises ``TypeError`` naming the field when the value does not convert without
    loss (:func:`convert_exactly`), ``ValueError`` when it is out of the dtype's range or
    not finite (:func:`non_finite`: NaN anywhere, an infinite scalar).
    """
    try:
        dtype = _device_dtype(info.inner_type, value)
    except (TypeError, ValueError) as err:
        dtype, refused = None, ConversionRefused(str(err))
    else:
        try:
            converted = convert_exactly(value, dtype)
        except ConversionRefused as err:
            refused = err
        else:
            return _refuse_non_finite(cls_name, info.name, converted)
    raise (ValueError if refused.out_of_range else TypeError)(
        f"jaxnitro: Device field `{info.name}` of {cls_name} has a value that does not convert "
        f"to an array ({type(value).__name__}: {refused}). Device fields are passed to compiled "
        f"programs as arrays{f' of dtype {np.dtype(dtype)}' if dtype is not None else ''}; give a "
        f"number or a NumPy array of that kind, or leave the field unmarked (Host) if traced code "
        f"never reads it."
    ) from None


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
    after each field becomes its doc. Methods named like
    the experiment hooks of :mod:`jaxnitro.hookspecs` (``EXPERIMENT_HOOKS``) are the experiment's hooks.

    Raises at decoration (:func:`_check_member_names`): ``TypeError`` for a
    ``GraphConst`` field named ``seed``, a field named like an experiment hook, a
    method that attrs would drop because a field has its name. Raises at construction
    for an unhashable GraphConst value or a Device value that does not convert
    to an array without loss.
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
    knob_methods = _check_member_names(cls, infos)
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
    new_cls.__jaxnitro_knob_methods__ = knob_methods
    new_cls.__repr__ = _experiment_repr
    new_cls._repr_html_ = _experiment_repr_html
    _register_pytree(new_cls, infos)
    return new_cls


# -- names: fields, hooks, knob methods ----------------------------------------

RESERVED_HOOKS: tuple[str, ...] = ()
"""Hook names reserved for features not available yet (none at present)."""

_RENAMED = {"learning_rate": "lr", "weight_decay": "wd", "monitor": "monitored"}


def _is_method(value) -> bool:
    return inspect.isfunction(value) or isinstance(value, (staticmethod, classmethod, property))


def _declared_in(cls, name: str) -> str:
    for klass in cls.__mro__:
        if name in klass.__dict__.get("__annotations__", {}):
            return klass.__name__
    return cls.__name__


def _hook_signature(hook: str) -> str:
    params = [p for p in inspect.signature(getattr(hookspecs, hook)).parameters if p != "batch"]
    return f"{hook}({', '.join(params)})"


def _check_member_names(cls, infos: dict) -> dict:
    """Refuse names that would be silently ignored; return the class's own knob methods that
    attrs is about to drop because an inherited field has their name (``{name: method}``).

    * a field named like an experiment hook: hooks are methods (``TypeError``);
    * a method named like a field: attrs keeps the field and drops the method. For a run
      knob the method is kept aside (a method > a field, see :func:`method_of`); for any
      other name it is refused (``TypeError``).
    """
    name = cls.__name__
    for field in infos:
        if field in EXPERIMENT_HOOKS or field in RESERVED_HOOKS:
            new = _RENAMED.get(field, f"{field}_value")
            hook = _hook_signature(field) if field in EXPERIMENT_HOOKS else f"{field}(...)"
            raise TypeError(
                f"jaxnitro: field `{field}` of {name} (declared in {_declared_in(cls, field)}) is "
                f"named like the experiment hook `{field}`. Hooks are methods, so the field would "
                f"be silently ignored. Rename the field and return it from the hook: "
                f"`{new}: <type> = ...` and `def {hook}: return self.{new}`."
            )
    own = cls.__dict__.get("__annotations__", {})
    kept = {}
    for attr, value in cls.__dict__.items():
        if attr not in infos or not _is_method(value):
            continue
        if attr in own:
            raise TypeError(
                f"jaxnitro: {name} declares `{attr}` both as a field and as a method; one name "
                f"cannot be both. Rename one of them."
            )
        if attr in RUN_KNOBS and not isinstance(value, property):
            kept[attr] = value
            continue
        raise TypeError(
            f"jaxnitro: {name} defines a method `{attr}`, but `{attr}` is a field (declared in "
            f"{_declared_in(cls, attr)}); an experiment class keeps the field and would silently "
            f"drop the method. Rename the method, or, to change the field's value in {name}, "
            f"redeclare the field with a new default (`{attr}: <type> = <value>`)."
        )
    return kept


def method_of(cls, name: str):
    """The method named ``name`` on experiment class ``cls`` or a base, or None.

    As the run knobs resolve (a method > a field), a method anywhere in the class
    hierarchy wins over a field of that name, also when a subclass declares the
    field, or the field is inherited and a subclass defines the method (attrs drops
    that method from the class; the decorator keeps it aside). Returns the class
    attribute: a function, ``staticmethod`` or ``classmethod``.
    """
    return _find_method(cls, name)[0]


def method_owner(cls, name: str):
    """The class (``cls`` or a base) defining the method :func:`method_of` finds, or None."""
    return _find_method(cls, name)[1]


def _find_method(cls, name: str) -> tuple:
    for klass in cls.__mro__:
        kept = klass.__dict__.get("__jaxnitro_knob_methods__", {})
        if name in kept:
            return kept[name], klass
        value = klass.__dict__.get(name)
        if inspect.isfunction(value) or isinstance(value, (staticmethod, classmethod)):
            return value, klass
    return None, None


def call_method(e, method):
    """Call ``method`` (as :func:`method_of` returns it) on experiment ``e``."""
    if isinstance(method, staticmethod):
        return method.__func__()
    if isinstance(method, classmethod):
        return method.__func__(type(e))
    return method(e)


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


class _GraphBox:
    """Static pytree aux data holding GraphConst values, compared and hashed by
    :func:`graph_key` (an array by its content)."""

    __slots__ = ("values", "_key")

    def __init__(self, values):
        self.values = values
        self._key = tuple(graph_key(v) for v in values)

    def __eq__(self, other):
        return isinstance(other, _GraphBox) and self._key == other._key

    def __hash__(self):
        return hash(self._key)


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
        aux = (_GraphBox(tuple(getattr(e, n) for n in graph)), _HostBox(tuple(getattr(e, n) for n in host)))
        return children, aux

    def flatten(e):
        children, aux = flatten_with_keys(e)
        return [c for _, c in children], aux

    def unflatten(aux, children):
        graph_box, host_box = aux
        values = dict(zip(device, children))
        values.update(zip(graph, graph_box.values))
        values.update(zip(host, host_box.values))
        return make_view(cls, values)

    jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)


# -- display ----------------------------------------------------------------


def _experiment_repr(self) -> str:
    return describe(self, "text")


def _experiment_repr_html(self) -> str:
    return describe(self, "html")


def traced_functions(e, hooks: dict, metrics_on_device: bool, train_metrics_on_host: bool = False) -> dict:
    """``{hook: function}`` of the hooks that run traced, as ``jaxnitro_check_traced_code`` gets
    them: ``forward``, ``loss``, ``train_metrics``, ``train_step`` and, on the device,
    ``metrics``, those the experiment or a plugin implements (not the defaults). A
    host-resident ``train_metrics`` counts too: it runs inside the training program's host
    callback, shared by every handle, so it sees the compile view (Host fields stripped) as
    the traced hooks do."""
    traced = ("forward", "loss", "train_metrics", "train_step") + (("metrics",) if metrics_on_device else ())
    return {h: hooks[h].function for h in traced if h in hooks and hooks[h].source != "default"}
