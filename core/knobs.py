"""Run knobs: keyword > experiment method > experiment field > framework default.

The fourteen knobs are resolved once, when a handle is built. For each knob
the handle records where its value came from, so :mod:`jaxnitro.staleness`
can tell later whether an accessor now answers differently.
"""

from __future__ import annotations

import difflib
import inspect
from dataclasses import dataclass

from .experiment import fields_of

__all__ = ["RUN_KNOBS", "KNOB_DEFAULTS", "HANDLE_KEYWORDS", "ResolvedKnob", "resolve_knobs", "check_keywords"]

KNOB_DEFAULTS: dict[str, object] = {
    "seed": 0,
    "run_dir": "runs",
    "n_devs": None,
    "accum": 1,
    "max_epochs": 10,
    "schedules": None,
    "gradient_clip_norm": 0.0,
    "check_divergence": True,
    "autolog_schedules": True,
    "log_every_n_steps": 1,
    "logger": "jsonl",
    "checkpointer": None,
    "early_stop": None,
    "ema": None,
}
RUN_KNOBS = tuple(KNOB_DEFAULTS)

HANDLE_KEYWORDS = ("data", "weights", "resume", "run_ref", "w0", "restore_optimizer", "restore_best")

SCALAR_KNOBS = ("seed", "accum", "max_epochs", "gradient_clip_norm", "check_divergence",
                "autolog_schedules", "log_every_n_steps", "n_devs", "run_dir")


@dataclass(frozen=True)
class ResolvedKnob:
    """A knob's value and its source: ``"keyword"``, ``"accessor"``, ``"field"`` or ``"default"``."""

    name: str
    value: object
    source: str
    accessor: object = None  # the method object when source == "accessor"


def check_keywords(kwargs: dict) -> None:
    """Raise ``TypeError`` for a keyword that is neither a run knob nor a handle keyword."""
    known = RUN_KNOBS + HANDLE_KEYWORDS
    for k in kwargs:
        if k not in known:
            close = difflib.get_close_matches(k, known, n=1)
            hint = f" Did you mean `{close[0]}`?" if close else ""
            raise TypeError(
                f"jaxnitro: unknown keyword `{k}` to Nitro.{hint} Run knobs: {', '.join(RUN_KNOBS)}; "
                f"handle keywords: {', '.join(HANDLE_KEYWORDS)}. Per-group optimizer values "
                f"(learning_rate_ratio, weight_decay, ...) are methods on the experiment, not keywords."
            )


def accessor_of(e, name: str):
    """The experiment class's method ``name`` (a plain function), or None."""
    attr = inspect.getattr_static(type(e), name, None)
    if isinstance(attr, (staticmethod, classmethod)):
        return getattr(type(e), name)
    return attr if inspect.isfunction(attr) else None


def resolve_knobs(e, kwargs: dict) -> dict[str, ResolvedKnob]:
    """Resolve every run knob for experiment ``e`` given the handle's keywords."""
    fields = fields_of(e)
    out = {}
    for name, default in KNOB_DEFAULTS.items():
        if name in kwargs:
            out[name] = ResolvedKnob(name, kwargs[name], "keyword")
            continue
        method = accessor_of(e, name)
        if method is not None:
            out[name] = ResolvedKnob(name, getattr(e, name)(), "accessor", method)
        elif name in fields and name != "schedules":
            out[name] = ResolvedKnob(name, getattr(e, name), "field")
        else:
            out[name] = ResolvedKnob(name, default, "default")
    return out
