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

import ast
import inspect
import textwrap
import typing

__all__ = ["Device", "GraphConst", "Host", "Marker", "StrippedHost", "check_traced_host_use", "marker_of"]


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
    the field and the fix.
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


# -- identity tests on Host fields, found in the traced hooks' source ----------------------------

_IDENTITY_BUILTINS = ("isinstance", "callable", "type", "id")
_scanned: dict = {}


def _self_attribute(node, self_name: str | None) -> str | None:
    if (
        self_name is not None
        and isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == self_name
    ):
        return node.attr
    return None


def _scan(function, has_self: bool = True) -> tuple[list, set]:
    """``([(attribute, line, source text)], {methods called on self})`` for ``function``: every
    ``self.<attr> is / is not ...`` and ``isinstance(self.<attr>, ...)``-like use, and the names
    of the methods it calls as ``self.<name>(...)``. Empty when its source is not available."""
    code = getattr(function, "__code__", None)
    if code is None:
        return [], set()
    if (code, has_self) in _scanned:
        return _scanned[code, has_self]
    try:
        lines, first = inspect.getsourcelines(function)
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, SyntaxError, IndentationError):
        _scanned[code, has_self] = ([], set())
        return _scanned[code, has_self]
    func = tree.body[0] if tree.body and isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef)) else None
    if func is None:
        _scanned[code, has_self] = ([], set())
        return _scanned[code, has_self]
    params = func.args.posonlyargs + func.args.args
    self_name = params[0].arg if params and has_self else None
    found, calls = [], set()
    for node in ast.walk(func):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for op, a, b in zip(node.ops, operands, operands[1:]):
                if isinstance(op, (ast.Is, ast.IsNot)):
                    for side in (a, b):
                        attr = _self_attribute(side, self_name)
                        if attr is not None:
                            found.append((attr, first + node.lineno - 1, ast.unparse(node)))
        elif isinstance(node, ast.Call):
            if isinstance(node.func, ast.Name) and node.func.id in _IDENTITY_BUILTINS and node.args:
                attr = _self_attribute(node.args[0], self_name)
                # isinstance(self.x, StrippedHost) asks on purpose whether the code is traced
                if attr is not None and "StrippedHost" not in ast.unparse(node):
                    found.append((attr, first + node.lineno - 1, ast.unparse(node)))
            method = _self_attribute(node.func, self_name)
            if method is not None:
                calls.add(method)
    _scanned[code, has_self] = (found, calls)
    return found, calls


def check_traced_host_use(cls, traced: dict, host_fields) -> None:
    """Refuse an identity test on a Host field in traced code (``self.mode is None``).

    ``traced`` maps the traced hooks to their functions; the methods of ``cls`` they call
    as ``self.<method>(...)`` are scanned too. ``is`` / ``is not`` and ``isinstance``,
    ``callable``, ``type``, ``id`` cannot be intercepted by :class:`StrippedHost`: in traced
    code they would silently see the sentinel instead of the value. Read from the
    functions' source with :mod:`ast` (skipped where no source is available); raises
    ``TypeError`` naming the hook, the field, the line and the fix.
    """
    host_fields = set(host_fields)
    if not host_fields:
        return
    todo = [(f"hook `{hook}`", fn, True) for hook, fn in traced.items()]
    seen: set = set()
    while todo:
        where, fn, has_self = todo.pop(0)
        code = getattr(fn, "__code__", None)
        if code is None or code in seen:
            continue
        seen.add(code)
        found, calls = _scan(fn, has_self)
        for attr, line, text in found:
            if attr in host_fields:
                raise TypeError(
                    f"jaxnitro: {where} of {cls.__name__} tests Host field `{attr}` with `{text}` "
                    f"(line {line} of {code.co_filename}). Traced code sees a Host field as the "
                    f"sentinel StrippedHost('{attr}'), never its value, so this test silently gives "
                    f"the same answer whatever the value (`is None` is always False, `is not None` always True). Fix: mark the "
                    f"field `GraphConst[...]` (a hashable value, None included, baked into the graph, "
                    f"so the test runs at trace time), or `Device[...]` for a number traced code "
                    f"reads, or decide on the host (build_model, derive) and keep the result in a "
                    f"GraphConst field."
                )
        for name in sorted(calls):
            method = inspect.getattr_static(cls, name, None)
            has_self = inspect.isfunction(method)  # a static or class method has no instance
            if isinstance(method, (staticmethod, classmethod)):
                method = method.__func__
            if inspect.isfunction(method):
                todo.append((f"method `{name}` (called from {where.split(' (')[0]})", method, has_self))
