"""An experiment class as command-line options (jsonargparse) and as a YAML config.

:func:`build_parser` turns an ``@jn.experiment`` class into a jsonargparse parser:
one option per field (its marker, type, default and attribute docstring in the
help; the type checks the value), one per run knob (the list is
``jaxnitro.knobs.RUN_KNOBS``; the default shown is what the experiment resolves it
to), ``--config FILE.yaml`` and ``--print_config``. :func:`parse` reads a command
line into an :class:`Invocation` (the experiment built from the fields, the knobs
the command line set, the command's own options); :func:`config_yaml` writes the
YAML that reproduces it, which ``--config`` reads back.

Rules:

* A field whose type the command line cannot spell (an array, an arbitrary object)
  keeps its default and is listed in the help as not settable here.
* A name that is both a field and a run knob (``max_epochs``) is the field: the
  knob then reads the field, as it does in Python; ``--max_epochs null`` sets the knob to
  None instead and the field keeps its default.
* A knob the command line does not set is left to the experiment (its method, its
  field, the framework's default), exactly as ``jn.Nitro(e)`` resolves it. A knob
  whose default is a bool, int or float takes that type (``max_epochs`` also ``null``,
  ``remat`` also a policy name); any other knob takes a
  YAML value (``--n_devs 2``, ``--logger tensorboard``, ``--early_stop null`` to
  switch a plugin knob off).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import pathlib
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import attrs

from jaxnitro.plugin import KNOB_DEFAULTS, RUN_KNOBS, fields_of, is_experiment, resolve_knobs

__all__ = [
    "CommandLineError", "Invocation", "build_parser", "config_yaml", "load_class", "parse",
    "settable_fields", "yaml_plain",
]

RESERVED = ("config", "print_config", "experiment", "help")
"""Option names the command line itself uses; a field of one of these names is refused."""

_SOURCE = {"keyword": "command line", "accessor": "method {name}()", "field": "field", "default": "framework default"}


class CommandLineError(ValueError):
    """A command line that names an unknown class, a bad value, or a field the CLI cannot set."""


# -- the experiment class -------------------------------------------------------------------


def load_class(spec: str):
    """The experiment class named by ``spec``: ``pkg.module:Class`` (imported) or
    ``path/to/file.py:Class`` (loaded from the file, its folder put on ``sys.path`` so
    its sibling modules import). Raises :class:`CommandLineError` saying which part failed."""
    module_name, sep, qualname = str(spec).rpartition(":")
    if not sep or not module_name or not qualname:
        raise CommandLineError(
            f"experiment {spec!r}: name it as `pkg.module:Class` or `path/to/file.py:Class`."
        )
    try:
        if module_name.endswith(".py") or os.sep in module_name or "/" in module_name:
            module = _load_file(module_name)
        else:
            module = importlib.import_module(module_name)
    except ImportError as err:
        raise CommandLineError(f"experiment {spec!r}: cannot import {module_name!r}: {err}") from err
    obj = module
    for part in qualname.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise CommandLineError(
                f"experiment {spec!r}: module {module_name!r} has no {qualname!r}; its experiment "
                f"classes: {', '.join(_experiments_in(module)) or '(none)'}."
            ) from None
    if not (isinstance(obj, type) and is_experiment(obj)):
        raise CommandLineError(
            f"experiment {spec!r} is not an experiment class: decorate it with `@jn.experiment`."
        )
    return obj


def _load_file(path: str) -> types.ModuleType:
    file = pathlib.Path(path).resolve()
    if not file.is_file():
        raise ImportError(f"no file {str(file)!r}")
    folder = str(file.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    name = file.stem
    existing = sys.modules.get(name)
    if existing is not None and getattr(existing, "__file__", None) and pathlib.Path(existing.__file__).resolve() == file:
        return existing
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # inspect.getsource (attribute docs) and pickling find it
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def _experiments_in(module) -> list[str]:
    return [n for n, v in vars(module).items() if isinstance(v, type) and is_experiment(v)]


# -- which values the command line can spell ------------------------------------------------

_PLAIN = (bool, int, float, str, type(None), pathlib.Path)


def _spellable(tp) -> bool:
    """True for the types a command line or a YAML file can give: bool, int, float, str,
    Path, None, Literal, and unions / lists / tuples / dicts of them."""
    if tp in _PLAIN or tp is Any:
        return True
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return all(isinstance(a, _PLAIN) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType, list, tuple, dict, set, frozenset):
        return all(a is Ellipsis or _spellable(a) for a in typing.get_args(tp))
    return False


def yaml_plain(value) -> bool:
    """True for a value YAML writes and reads back as itself (None, bool, number, str, lists,
    tuples and dicts of them)."""
    if isinstance(value, (bool, int, float, str, type(None))):
        return True
    if isinstance(value, (list, tuple)):
        return all(yaml_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and yaml_plain(v) for k, v in value.items())
    return False


def _to_plain(value):
    if isinstance(value, tuple):
        return [_to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    if isinstance(value, pathlib.PurePath):
        return str(value)
    return value


def _default_of(attribute):
    """An attrs attribute's default value, or ``attrs.NOTHING`` (no default, or a factory that
    needs the instance)."""
    default = attribute.default
    if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
        if default.takes_self:
            return attrs.NOTHING
        return default.factory()
    return default


@dataclass(frozen=True)
class FieldOption:
    """One experiment field as a command-line option."""

    name: str
    marker: str
    type: object
    default: object  # attrs.NOTHING: required
    doc: str
    knob: bool  # also a run knob of this name (max_epochs)


def _inner_type(cls, info):
    tp = info.inner_type
    if isinstance(tp, str):  # an annotation get_type_hints could not resolve
        module = sys.modules.get(cls.__module__)
        try:
            tp = eval(tp, vars(module) if module else {})  # noqa: S307 - the class's own annotation
        except Exception:
            return None
    return tp


def settable_fields(cls) -> tuple[list[FieldOption], list[str]]:
    """``(options, skipped)``: the fields a command line can set, and the others as
    ``"name (Marker type)"`` (they keep their defaults)."""
    options, skipped = [], []
    attributes = {a.name: a for a in attrs.fields(cls)}
    for name, info in fields_of(cls).items():
        tp = _inner_type(cls, info)
        default = _default_of(attributes[name]) if name in attributes else attrs.NOTHING
        if tp is None or not _spellable(tp) or not (default is attrs.NOTHING or yaml_plain(default)):
            shown = getattr(tp, "__name__", None) or str(tp if tp is not None else info.inner_type)
            skipped.append(f"{name} ({info.marker!r} {shown})")
            continue
        if name in RESERVED:
            raise CommandLineError(
                f"field `{name}` of {cls.__name__} has the name of the command line's own option "
                f"`--{name}`; rename the field."
            )
        options.append(FieldOption(name, repr(info.marker), tp, default, info.doc, name in RUN_KNOBS))
    return options, skipped


def _type_name(tp) -> str:
    return tp.__name__ if isinstance(tp, type) else str(tp).replace("typing.", "")


# -- the parser -----------------------------------------------------------------------------


@dataclass
class ParserSpec:
    """What :func:`build_parser` built: the parser and how its options map to the experiment."""

    parser: Any
    cls: type
    fields: list[FieldOption]
    knobs: list[str]
    skipped: list[str]
    command_options: list[str]


def _resolved_knobs(cls, field_values: dict) -> dict:
    """``{knob: ResolvedKnob}`` for the class with these field values, or {} when the
    experiment cannot be built from them (a field without a default, say)."""
    import warnings

    try:
        e = cls(**field_values)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return resolve_knobs(e, {})
    except Exception:
        return {}


def _fill(text: str) -> str:
    import shutil
    import textwrap

    width = max(40, min(100, shutil.get_terminal_size((80, 24)).columns) - 4)
    return textwrap.fill(text, width, initial_indent="  ", subsequent_indent="  ")


def _describe(value) -> str:
    """``repr`` with functions by name (``{'learning_rate': <lambda in MnistMLP.schedules>}``)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_describe(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType)):
        name = value.__qualname__.replace(".<locals>", "")
        if name.endswith("<lambda>"):
            return f"<lambda in {name[: -len('.<lambda>')] or value.__module__}>"
        return f"<function {name}>"
    return repr(value)


def _short_repr(value, limit: int = 70) -> str:
    text = _describe(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def build_parser(cls, *, prog: str, description: str | None = None, command_options=None,
                 aliases: dict | None = None, defaults: dict | None = None, with_experiment: bool = False,
                 epilog: str | None = None) -> ParserSpec:
    """A jsonargparse parser for experiment class ``cls``.

    ``command_options(parser)`` adds the command's own options (``--resume``, ``--weights``
    ...) and returns their names; ``aliases`` maps a field or knob to extra option strings
    (``{"max_epochs": ["--epochs"]}``); ``defaults`` replaces field defaults;
    ``with_experiment`` adds ``--experiment`` (the class spec, written by ``--print_config``).
    """
    from jsonargparse import ActionConfigFile, ArgumentParser

    aliases = aliases or {}
    options, skipped = settable_fields(cls)
    overrides = dict(defaults or {})
    unknown = [k for k in overrides if k not in {o.name for o in options}]
    if unknown:
        raise CommandLineError(f"defaults for {unknown}: not settable fields of {cls.__name__}.")
    field_values = {o.name: overrides.get(o.name, o.default) for o in options if o.default is not attrs.NOTHING
                    or o.name in overrides}
    resolved = _resolved_knobs(cls, field_values)
    class_doc = (cls.__doc__ or "").strip()
    parser = ArgumentParser(
        prog=prog, description=description if description is not None else class_doc or None,
        exit_on_error=False, print_config=None, epilog=epilog,
        formatter_class=_help_formatter(),
    )
    parser.add_argument("--config", action=ActionConfigFile,
                        help="a YAML file of option values (what --print_config writes); later options override it")
    parser.add_argument("--print_config", action="store_true",
                        help="print the YAML that reproduces this command (fields and run knobs) and exit")
    if with_experiment:
        # the class spec (given as the first argument); a key of --config files, hidden in --help
        parser.add_argument("--experiment", type=str, help=argparse.SUPPRESS)
    names = command_options(parser) if command_options else []
    group = parser.add_argument_group(
        f"fields of {cls.__name__}",
        _fill("Each field's marker: Device (a traced input: changing it compiles nothing), GraphConst "
        "(baked into the compiled graph), Host (never reaches traced code)."
        + (f" Not settable here (they keep their defaults): {', '.join(skipped)}." if skipped else "")),
    )
    for o in options:
        default = overrides.get(o.name, o.default)
        doc = o.doc.replace("%", "%%") if o.doc else "(no docstring)"
        knob = (f" Also the `{o.name}` run knob (null: the knob is None, the field keeps its default)."
                if o.knob else "")
        kwargs = {"type": _or_none(o.type) if o.knob else o.type, "help": f"[{o.marker}] {doc}{knob}"}
        if default is attrs.NOTHING:
            kwargs["required"] = True
        else:
            kwargs["default"] = _to_plain(default)
        group.add_argument(f"--{o.name}", *aliases.get(o.name, ()), **kwargs)
    knob_group = parser.add_argument_group(
        "run knobs",
        _fill("Left out, a knob is what the experiment resolves it to (a method, a field, the framework "
              "default), as in jn.Nitro(e); the default shown says which."),
    )
    field_names = {o.name for o in options} | set(fields_of(cls))
    knob_names = [k for k in RUN_KNOBS if k not in field_names]
    for name in knob_names:
        r = resolved.get(name)
        value, source = (r.value, r.source) if r is not None else (KNOB_DEFAULTS[name], "default")
        tp = _knob_type(name)
        where = _SOURCE[source].format(name=name)
        text = f"[run knob] default: {_short_repr(value)} ({where})".replace("%", "%%")
        knob_group.add_argument(f"--{name}", *aliases.get(name, ()), type=tp, default=argparse.SUPPRESS, help=text)
    return ParserSpec(parser, cls, options, knob_names, skipped, names)


def _or_none(tp):
    """``tp | None`` (``typing.Optional`` for an annotation ``|`` does not take)."""
    try:
        return tp | None
    except TypeError:
        return typing.Optional[tp]


def _takes_none(tp) -> bool:
    """Whether annotation ``tp`` admits None (``int | None``, ``Optional[int]``, ``Any``)."""
    return tp is Any or tp is type(None) or type(None) in typing.get_args(tp)


_KNOB_TYPES = {"remat": bool | str, "max_epochs": int | None}
"""Knobs whose values go beyond their default's type (``--remat dots_saveable``,
``--max_epochs null``: no epoch bound, for a run bounded by ``--max_steps``)."""


def _knob_type(name: str):
    """The command-line type of run knob ``name``: a bool, int or float knob takes its
    default's type (or what :data:`_KNOB_TYPES` says), any other a YAML value."""
    if name in _KNOB_TYPES:
        return _KNOB_TYPES[name]
    plain = KNOB_DEFAULTS[name]
    return type(plain) if type(plain) in (bool, int, float) else Any


def _help_formatter():
    """jsonargparse's help formatter (type and default after each option) that keeps the
    description's line breaks."""
    from jsonargparse import DefaultHelpFormatter

    return type("HelpFormatter", (DefaultHelpFormatter, argparse.RawDescriptionHelpFormatter), {})


# -- parsing --------------------------------------------------------------------------------


@dataclass
class Invocation:
    """A parsed command line: the experiment, the knobs it set, the command's options."""

    spec: ParserSpec
    experiment: object
    field_values: dict
    knobs: dict
    options: dict
    print_config: bool
    experiment_spec: str | None = None
    given: set = field(default_factory=set)


_KEY = re.compile(r'Parser key "([^"]+)"')


def _explain(spec: ParserSpec, err: Exception) -> str:
    text = str(err).strip()
    m = _KEY.search(text)
    key = m.group(1) if m else None
    by_name = {o.name: o for o in spec.fields}
    if key in by_name:
        o = by_name[key]
        return (f"bad value for field `{key}` of {spec.cls.__name__} ({o.marker}[{_type_name(o.type)}]): "
                f"{' '.join(text.split())}. Give a value of type {_type_name(o.type)} (see --help).")
    if key in spec.knobs:
        return f"bad value for run knob `{key}`: {' '.join(text.split())} (see --help)."
    return f"{' '.join(text.split())} (see --help)."


def parse(spec: ParserSpec, argv: list[str], *, experiment_spec: str | None = None) -> Invocation:
    """Parse ``argv`` with ``spec``'s parser and build the experiment.

    Raises :class:`CommandLineError` naming the field (and its marker and type) for a value
    of the wrong type, and for an experiment its constructor refuses (a Device value that
    does not convert, an unhashable GraphConst value).
    """
    parser = spec.parser
    argv = list(argv)
    if experiment_spec is not None and any(f.dest == "experiment" for f in parser._actions):
        argv = [*argv, "--experiment", experiment_spec]  # last: the first argument wins over a --config file
    try:
        ns = parser.parse_args(argv)
        given_ns = parser.parse_args(argv, defaults=False)
    except argparse.ArgumentError as err:
        raise CommandLineError(_explain(spec, err)) from None
    except SystemExit:  # --help printed, or jsonargparse's own usage error
        raise
    values = ns.as_dict()
    given = {k for k in given_ns.as_dict() if k not in ("config", "print_config")}
    field_values = {o.name: values[o.name] for o in spec.fields if o.name in values}
    knobs = {k: values[k] for k in spec.knobs if k in values}
    for o in spec.fields:  # `--max_epochs null`: the knob is None (keyword > field), the field its default
        if o.knob and o.name in field_values and field_values[o.name] is None and not _takes_none(o.type):
            del field_values[o.name]
            knobs[o.name] = None
    options = {k: values.get(k) for k in spec.command_options}
    try:
        e = spec.cls(**field_values)
    except (TypeError, ValueError) as err:
        raise CommandLineError(str(err)) from None
    return Invocation(spec, e, field_values, knobs, options, bool(values.get("print_config")),
                      values.get("experiment") or experiment_spec, given)


def config_yaml(inv: Invocation, *, include_options: bool = True) -> str:
    """The YAML that reproduces ``inv``: the class (for ``jaxnitro``), every settable field,
    every run knob the experiment resolves to a plain value (a knob set to an object by a
    method, such as a checkpointer, is left to that method), and the command's options
    except ``resume`` and ``print_config``."""
    import warnings

    import yaml

    out: dict = {}
    if inv.experiment_spec:
        out["experiment"] = inv.experiment_spec
    if include_options:
        for k, v in inv.options.items():
            if k != "resume" and v is not None and yaml_plain(v):
                out[k] = _to_plain(v)
    for name, value in inv.field_values.items():
        out[name] = _to_plain(value)
    for o in inv.spec.fields:  # a field-knob set to None on the command line (`--max_epochs null`)
        if o.knob and o.name not in inv.field_values and inv.knobs.get(o.name, ...) is None:
            out[o.name] = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resolved = resolve_knobs(inv.experiment, inv.knobs)
    for name in inv.spec.knobs:
        r = resolved[name]
        if r.source == "keyword" or yaml_plain(r.value):
            out[name] = _to_plain(r.value)
    return yaml.safe_dump(out, sort_keys=False, default_flow_style=False)
