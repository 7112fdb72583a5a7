"""Field markers: where an experiment field lives.

* ``Host`` (the default for an unmarked field): driver-only. Never reaches traced
  code; inside a compiled program it is a :class:`StrippedHost` sentinel.
* ``GraphConst[T]``: baked into the compiled graph as a constant and part of the
  compile-cache key. Must be hashable, or a NumPy/JAX array (keyed by its shape, dtype
  and bytes). Changing it compiles new programs.
* ``Device[T]``: converted to a device array once at setup and passed to every
  program as an input. Changing, sweeping or scheduling it compiles nothing.

``Device[float]`` is ``typing.Annotated[float, Device]``, so type checkers see
the plain type.
"""

from __future__ import annotations

import typing

__all__ = ["Device", "GraphConst", "Host", "Marker", "StrippedHost", "marker_of"]


class Marker:
    """A field marker. Subscript it with the field's type: ``Device[float]``."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __getitem__(self, tp):
        return typing.Annotated[tp, self]

    def __repr__(self) -> str:
        return self.name

    def __reduce__(self):
        return self.name


Host = Marker("Host")
GraphConst = Marker("GraphConst")
Device = Marker("Device")

_BY_NAME = {"Host": Host, "GraphConst": GraphConst, "Device": Device}


def marker_of(annotation) -> tuple[Marker, object]:
    """Return ``(marker, inner_type)`` of a field annotation.

    Accepts a real annotation (``Annotated[float, Device]``) or, for modules
    using ``from __future__ import annotations``, its source string
    (``"jn.Device[float]"``). Unmarked annotations are ``Host``.
    """
    if isinstance(annotation, str):
        text = annotation.strip()
        for name, marker in _BY_NAME.items():
            for prefix in (f"{name}[", f"jn.{name}[", f"jaxnitro.{name}["):
                if text.startswith(prefix) and text.endswith("]"):
                    return marker, text[len(prefix) : -1].strip()
        return Host, text
    if typing.get_origin(annotation) is typing.Annotated:
        for meta in annotation.__metadata__:
            if isinstance(meta, Marker):
                return meta, annotation.__origin__
    return Host, annotation


class StrippedHost:
    """What traced code sees in place of a Host field.

    Any use (arithmetic, comparison with a value, indexing, attribute access,
    conversion to an array, a ``jax.numpy`` call) raises a ``TypeError`` naming
    the field and the fix. An identity test (``is``, ``isinstance``) cannot be
    intercepted: the ``code_checks`` plugin refuses one at setup, from the hooks' source.
    """

    __slots__ = ("_field", "_owner")

    def __init__(self, field: str, owner: str = "the experiment"):
        object.__setattr__(self, "_field", field)
        object.__setattr__(self, "_owner", owner)

    def _fail(self, *_args, **_kwargs):
        field = object.__getattribute__(self, "_field")
        owner = object.__getattribute__(self, "_owner")
        raise TypeError(
            f"jaxnitro: Host field `{field}` of {owner} was used inside traced code. "
            f"Host fields (the default for unmarked fields) never reach a compiled program; "
            f"traced code sees only the sentinel StrippedHost('{field}'). Fix: mark the field "
            f"`Device[...]` to pass it in as a traced input (sweepable without recompiling), "
            f"`GraphConst[...]` to bake a hashable value into the graph, or read it in a "
            f"host-side hook (build_data, derive, finalize_metrics) instead."
        )

    def __repr__(self) -> str:
        return f"StrippedHost({object.__getattribute__(self, '_field')!r})"

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        self._fail()

    __setattr__ = _fail
    __array__ = _fail
    # A property, not a method: JAX probes ``getattr(x, "__jax_array__", None)`` before
    # calling it and would otherwise raise its own error that names no field.
    __jax_array__ = property(_fail)
    __getitem__ = _fail
    __setitem__ = _fail
    __len__ = _fail
    __iter__ = _fail
    __bool__ = _fail
    __float__ = _fail
    __int__ = _fail
    __index__ = _fail
    __call__ = _fail
    __neg__ = _fail
    __pos__ = _fail
    __abs__ = _fail
    __invert__ = _fail
    __contains__ = _fail
    for _op in (
        "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul",
        "and", "or", "xor", "lshift", "rshift", "divmod",
    ):
        locals()[f"__{_op}__"] = _fail
        locals()[f"__r{_op}__"] = _fail
    for _op in ("lt", "le", "gt", "ge"):
        locals()[f"__{_op}__"] = _fail
    del _op

    def __eq__(self, other):
        # Sentinels compare among themselves; comparing one with a value is a use
        # (`if self.mode == "fast":` in traced code would otherwise be silently False).
        if not isinstance(other, StrippedHost):
            self._fail()
        return repr(self) == repr(other)

    def __ne__(self, other):
        return not self.__eq__(other)

    def __hash__(self):
        return hash(repr(self))


def _register_stripped_host() -> None:
    """Register :class:`StrippedHost` as a pytree with no leaves.

    A jitted ``jax.numpy`` function (``jnp.exp``, ``jnp.log`` ...) handed a
    sentinel would otherwise try to abstractify it as an argument and replace
    the sentinel's error with JAX's generic "Error interpreting argument";
    as an empty pytree it passes through to the function body, whose first use
    of it raises the sentinel's own message naming the field.
    """
    import jax

    jax.tree_util.register_pytree_node(
        StrippedHost,
        lambda s: ((), (object.__getattribute__(s, "_field"), object.__getattribute__(s, "_owner"))),
        lambda aux, _children: StrippedHost(*aux),
    )


_register_stripped_host()
