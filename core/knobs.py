"""Run knobs: keyword > experiment method > experiment field > framework default.

The fourteen knobs are resolved once, when a handle is built, into one typed
:class:`Settings`. For each knob it records where the value came from, so the
stale-handle report can tell later whether an accessor now answers
differently, and ``print(nitro)`` can say where each value came from.
"""

from __future__ import annotations

import difflib
import inspect
import os
from dataclasses import dataclass

import numpy as np

from .experiment import fields_of
from .logger import DEFAULT_LOGGER

__all__ = [
    "RUN_KNOBS", "KNOB_DEFAULTS", "HANDLE_KEYWORDS", "PLUGIN_KNOBS", "ResolvedKnob", "Settings",
    "check_keywords", "make_settings", "resolve_knobs",
]

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
    "logger": DEFAULT_LOGGER,
    "checkpointer": None,
    "early_stop": None,
    "ema": None,
}
RUN_KNOBS = tuple(KNOB_DEFAULTS)

PLUGIN_KNOBS = ("early_stop", "checkpointer")
"""Knobs the core does not act on itself: a plugin must accept them (``jaxnitro_accept_knob``)."""

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


@dataclass(frozen=True)
class Settings:
    """A handle's resolved run knobs: one typed, read-only object (setup builds it once).

    ``knobs`` keeps each knob's provenance (:class:`ResolvedKnob`: value and
    source); ``monitor`` is the experiment's ``(metric, "max" | "min")`` or None.
    ``logger`` is the knob with the default resolved to the name plugins chose.
    """

    seed: int
    run_dir: str
    n_devs: int | None
    accum: int
    max_epochs: int
    schedules: dict
    gradient_clip_norm: float
    check_divergence: bool
    autolog_schedules: bool
    log_every_n_steps: int
    logger: object
    checkpointer: object
    early_stop: object
    ema: object
    monitor: tuple[str, str] | None
    knobs: dict

    def source(self, name: str) -> str:
        """Where knob ``name``'s value came from: keyword, accessor, field or default."""
        return self.knobs[name].source


def check_values(knobs: dict[str, ResolvedKnob]) -> None:
    """Refuse integer knobs that are not integers in range, naming the knob, its source and the fix."""
    for name in ("accum", "max_epochs", "log_every_n_steps"):
        v, low = knobs[name].value, (0 if name == "max_epochs" else 1)
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < low:
            raise ValueError(
                f"jaxnitro: run knob `{name}` = {v!r} ({knobs[name].source}); it must be "
                f"an integer >= {low}."
            )


def make_settings(knobs: dict[str, ResolvedKnob], *, logger, monitor) -> Settings:
    """Typed settings from resolved knobs (checked with :func:`check_values` first)."""
    check_values(knobs)
    k = {name: r.value for name, r in knobs.items()}
    return Settings(
        seed=int(k["seed"]),
        run_dir=os.fspath(k["run_dir"]),
        n_devs=k["n_devs"],
        accum=int(k["accum"]),
        max_epochs=int(k["max_epochs"]),
        schedules=k["schedules"] or {},
        gradient_clip_norm=float(k["gradient_clip_norm"] or 0.0),
        check_divergence=bool(k["check_divergence"]),
        autolog_schedules=bool(k["autolog_schedules"]),
        log_every_n_steps=int(k["log_every_n_steps"]),
        logger=logger,
        checkpointer=k["checkpointer"],
        early_stop=k["early_stop"],
        ema=k["ema"],
        monitor=monitor,
        knobs=dict(knobs),
    )
