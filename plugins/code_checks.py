"""Checks of the experiment's own code, at setup: the ``code_checks`` plugin.

Entry point ``code_checks``. It reads the experiment class and the source of its hooks for
what would otherwise be silently wrong, through two lifecycle hooks:

* ``jaxnitro_check_experiment`` (setup, first): a public method named close to a hook or
  run knob but neither (``metric``, ``monitr``, ``acum``) is never called; it warns
  (``UserWarning``) naming the method, the class that defines it and the closest name
  (:func:`warn_misspelled_hooks`).
* ``jaxnitro_check_traced_code`` (setup, before any program is built), with the functions
  of the hooks that will run traced (``forward``, ``loss``, ``train_metrics``,
  ``train_step``; ``metrics`` when it runs on the device; a host-resident
  ``train_metrics`` too, which sees the compile view). Traced code sees a Host field as
  the sentinel ``jn.StrippedHost(field)``, which refuses every use it can intercept; ``is``
  / ``is not`` and ``isinstance``, ``callable``, ``type``, ``id`` it cannot, so
  ``self.mode is None`` would silently give one answer whatever the value. The hooks'
  source (and that of the methods they call as ``self.<method>(...)``) is read with
  :mod:`ast`, and such a test refused with a ``TypeError`` naming the hook, the field, the
  line and the fix (:func:`check_traced_host_use`); a function without source is skipped.

Disabled (``JAXNITRO_DISABLE_PLUGINS=code_checks``), neither check runs: a misspelled
method is silently never called, and an identity test on a Host field runs and answers
from the sentinel. An installed plugin implementing either hook adds its own checks
(every implementation is called).
"""

from __future__ import annotations

import ast
import difflib
import inspect
import textwrap
import warnings

from jaxnitro.plugin import EXPERIMENT_HOOKS, RUN_KNOBS, fields_of, hookimpl

__all__ = ["check_traced_host_use", "warn_misspelled_hooks"]


# -- methods named close to a hook or run knob -------------------------------------------------


def _public_methods(cls):
    """``{name: defining class}`` of the public methods of ``cls`` and its bases (not ``object``).

    (A run-knob method the experiment class kept aside from attrs, ``__jaxnitro_knob_methods__``,
    is named like a run knob, so it is never a misspelling and is not listed.)"""
    out: dict[str, type] = {}
    for klass in reversed(cls.__mro__[:-1]):
        for name, value in vars(klass).items():
            if not name.startswith("_") and (
                inspect.isfunction(value) or isinstance(value, (staticmethod, classmethod))
            ):
                out[name] = klass
    return out


def warn_misspelled_hooks(e) -> None:
    """Warn (``UserWarning``) for a public method of the experiment whose name is close to a
    hook or run-knob name but is neither: it would be silently ignored (``metric``, ``monitr``)."""
    known = EXPERIMENT_HOOKS + RUN_KNOBS
    fields = fields_of(e)
    for name, klass in _public_methods(type(e)).items():
        if name in known or name in fields:
            continue
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
        if close:
            kind = "hook" if close[0] in EXPERIMENT_HOOKS else "run knob"
            warnings.warn(
                f"jaxnitro: method `{name}` of {type(e).__name__} (defined in {klass.__name__}) is "
                f"no hook or run knob, so jaxnitro never calls it; did you mean the {kind} "
                f"`{close[0]}`? Rename it to `{close[0]}`, or, if it is a helper, give it a name "
                f"further from the hooks (or a leading underscore).",
                UserWarning,
                stacklevel=2,
            )


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
    ``callable``, ``type``, ``id`` cannot be intercepted by ``jn.StrippedHost``: in traced
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


@hookimpl(trylast=True)
def jaxnitro_check_experiment(experiment):
    warn_misspelled_hooks(experiment)


@hookimpl(trylast=True)
def jaxnitro_check_traced_code(experiment, functions):
    host = [n for n, i in fields_of(experiment).items() if i.is_host]
    check_traced_host_use(type(experiment), functions, host)
