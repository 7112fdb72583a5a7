"""Run knobs: keyword > experiment method > experiment field > framework default.

The fifteen knobs are resolved once, when a handle is built, into one typed
:class:`Settings`. For each knob it records where the value came from, so the
stale-handle report can tell later whether an accessor now answers
differently, and ``print(nitro)`` can say where each value came from.
"""

from __future__ import annotations

import difflib
import math
import numbers
import os
import warnings
from dataclasses import dataclass

import numpy as np

from .experiment import call_method, fields_of, method_of, method_owner
from .knob_table import KNOB_DEFAULTS, PLUGIN_KNOBS, RUN_KNOBS

__all__ = [
    "RUN_KNOBS", "KNOB_DEFAULTS", "HANDLE_KEYWORDS", "PLUGIN_KNOBS", "ResolvedKnob", "Settings",
    "check_keywords", "make_settings", "require_monitor_and_val", "resolve_knobs",
]

# KNOB_DEFAULTS, RUN_KNOBS, PLUGIN_KNOBS and DEFAULT_LOGGER live in jaxnitro.knob_table (a leaf module).

HANDLE_KEYWORDS = ("data", "weights", "resume", "run_ref", "w0", "restore_optimizer", "restore_best")

MIN_CLIP_NORM = 1e-8
"""The smallest ``gradient_clip_norm`` accepted (besides 0 = off): a global-norm threshold below
it leaves each float32 update at most ``1e-8 * learning_rate`` long (with Adam, below its ``eps``),
so the weights do not move; a positive value below float32's range is stored as 0."""

SCALAR_KNOBS = ("seed", "accum", "steps_per_dispatch", "max_epochs", "max_steps", "val_every_n_steps", "max_time",
                "gradient_clip_norm", "check_divergence", "autolog_schedules", "log_every_n_steps", "n_devs", "run_dir")


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
    """The experiment class's method ``name`` (a plain function; bound for a static or class
    method), or None. A method anywhere in the class hierarchy counts (a method > a field)."""
    method = method_of(type(e), name)
    if isinstance(method, (staticmethod, classmethod)):
        return method.__get__(None, type(e))
    return method


def _warn_method_and_field(e, name: str) -> None:
    warnings.warn(
        f"jaxnitro: {type(e).__name__} has both a method `{name}` (in "
        f"{method_owner(type(e), name).__name__}) and a field "
        f"`{name}` = {getattr(e, name)!r}; the method wins (a keyword > a method > a field), so "
        f"the field's value is not used. Rename one of them, or drop the method to use the field.",
        UserWarning,
        stacklevel=2,
    )


def resolve_knobs(e, kwargs: dict) -> dict[str, ResolvedKnob]:
    """Resolve every run knob for experiment ``e`` given the handle's keywords.

    A keyword > a method of that name (anywhere in the class hierarchy) > a field of
    that name > the default. A method and a field of one name warn (``UserWarning``).
    """
    fields = fields_of(e)
    out = {}
    for name, default in KNOB_DEFAULTS.items():
        method = method_of(type(e), name)
        if method is not None and name in fields:
            _warn_method_and_field(e, name)
        if name in kwargs:
            out[name] = ResolvedKnob(name, kwargs[name], "keyword")
            continue
        if method is not None:
            out[name] = ResolvedKnob(name, call_method(e, method), "accessor", accessor_of(e, name))
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
    steps_per_dispatch: int | str
    max_epochs: int | None
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
    max_steps: int | None = None
    val_every_n_steps: int | None = None
    max_time: float | None = None
    schedule_horizon: str | None = None
    profile: object = None
    precision: str = "float32"
    remat: object = False
    precision_policy: object = None  # a PrecisionPolicy (jaxnitro_precision_policy) before the params are known
    device_peak_flops: object = None  # accepted (checked, used) by the throughput plugin
    sharding_policy: object = None  # a ShardingPolicy (jaxnitro_sharding_policy): the mesh's shape, each param's spec
    sharding: str = "replicated"
    mesh_shape: dict | None = None
    compilation_cache: object = None

    @property
    def step_budgeted(self) -> bool:
        """Whether the run is counted in steps (``max_steps`` given): the progress bar and
        ``print(nitro)`` then speak in steps."""
        return self.max_steps is not None

    def source(self, name: str) -> str:
        """Where knob ``name``'s value came from: keyword, accessor, field or default."""
        return self.knobs[name].source


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))


def check_values(knobs: dict[str, ResolvedKnob]) -> None:
    """Refuse knob values that would be silently converted, naming the knob, its source and the fix.

    * ``accum``, ``steps_per_dispatch``, ``max_epochs``, ``log_every_n_steps``: integers in range;
    * ``seed``: an integer (``1.7`` would become ``1``) in JAX's 64-bit range;
    * ``gradient_clip_norm``: ``None`` or a finite number >= 0 (NaN or a negative value
      would switch clipping off), and not below :data:`MIN_CLIP_NORM` unless it is 0 (a
      threshold of ``1e-30`` zeroes every update);
    * ``check_divergence``, ``autolog_schedules``: ``True`` or ``False`` (the string
      ``"False"`` is true).
    """
    def refuse(name: str, must: str) -> None:
        raise ValueError(
            f"jaxnitro: run knob `{name}` = {knobs[name].value!r} ({knobs[name].source}); {must}"
        )

    for name in ("accum", "steps_per_dispatch", "max_epochs", "log_every_n_steps"):
        v, low = knobs[name].value, (0 if name == "max_epochs" else 1)
        if name == "steps_per_dispatch" and v == "auto":
            continue  # chosen at run time from the measured step time
        if name == "max_epochs" and v is None and knobs["max_steps"].value is not None:
            continue  # the steps alone bound the run
        if not _is_int(v) or v < low:
            refuse(name, f"it must be an integer >= {low}" + {"max_epochs": " (or None with max_steps).",
                                                              "steps_per_dispatch": " or \"auto\"."}.get(name, "."))
    for name, what in (("max_steps", "the optimizer steps the run takes"),
                       ("val_every_n_steps", "validate every that many optimizer steps")):
        v = knobs[name].value
        if v is not None and (not _is_int(v) or v < 1):
            refuse(name, f"it must be an integer >= 1 ({what}), or None.")
    max_time_seconds(knobs["max_time"].value, knobs["max_time"].source)
    if knobs["schedule_horizon"].value not in (None, "saved", "new"):
        refuse("schedule_horizon", "give \"saved\" (a resumed run's schedules continue the curves of "
                                   "the horizon they were planned over) or \"new\" (re-plan them over "
                                   "this run's steps), or None.")
    seed = knobs["seed"].value
    if not _is_int(seed) or not -(2**63) <= seed < 2**63:
        refuse("seed", "it must be an integer in JAX's 64-bit range (e.g. `seed=1`); a float or a "
                       "string would be truncated or parsed silently.")
    clip = knobs["gradient_clip_norm"].value
    if clip is not None and (not _is_real(clip) or not math.isfinite(clip) or clip < 0):
        refuse("gradient_clip_norm", "it must be a finite number >= 0: the global-norm threshold, "
                                     "or 0 (or None) for no clipping. NaN or a negative value "
                                     "would silently switch clipping off.")
    if clip is not None and 0 < clip < MIN_CLIP_NORM:
        refuse("gradient_clip_norm", f"a threshold this small (below {MIN_CLIP_NORM:g}) scales every "
                                     f"update to almost nothing (and below float32's smallest "
                                     f"number it becomes 0): the run would report `done` with the "
                                     f"weights barely moved. Use a threshold near the gradient's "
                                     f"global norm (e.g. 1.0), or 0 (or None) for no clipping.")
    for name in ("check_divergence", "autolog_schedules"):
        if not isinstance(knobs[name].value, (bool, np.bool_)):
            refuse(name, "it must be True or False (a string such as \"False\" is true in Python).")


def max_time_seconds(value, source: str = "keyword") -> float | None:
    """``max_time`` in seconds: None, a number of seconds > 0, or a string read as Slurm reads
    ``--time``: ``"M:S"``, ``"H:M:S"``, ``"D-H"``, ``"D-H:M"``, ``"D-H:M:S"``; a minutes or seconds
    field after the first is below 60. Slurm's ``"M"`` (``"45"``: minutes to Slurm, seconds as a
    number, and on the command line) is refused as ambiguous.

    ``ValueError`` naming the knob, its source and the accepted forms otherwise.
    """
    if value is None:
        return None
    seconds = float(value) if _is_real(value) else None
    if isinstance(value, str) and value.strip().isdigit():
        raise ValueError(
            f"jaxnitro: run knob `max_time` = {value!r} ({source}) is ambiguous: Slurm reads it as "
            f"{value.strip()} minutes, a number is seconds. Give {int(value) * 60} (seconds) or "
            f"\"{int(value) // 60}:{int(value) % 60:02d}:00\" for minutes, or {int(value)} (a number) for seconds."
        )
    if isinstance(value, str):
        days, dash, clock = value.strip().partition("-") if "-" in value else ("0", "", value.strip())
        fields = clock.split(":")
        if days.isdigit() and len(fields) <= 3 and all(f.isdigit() for f in fields):
            n = [int(f) for f in fields]
            h, m, s = (n + [0, 0])[:3] if dash else [0] * (3 - len(n)) + n  # D-H[:M[:S]], [H:]M:S
            seconds = float(int(days) * 86400 + h * 3600 + m * 60 + s) if all(f < 60 for f in n[1:]) else None
    if seconds is None or not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(
            f"jaxnitro: run knob `max_time` = {value!r} ({source}); give the wall-clock time the run "
            f"may take: seconds > 0 (e.g. 3600), or a string in Slurm's --time forms \"M:S\", "
            f"\"H:M:S\", \"D-H\", \"D-H:M\", \"D-H:M:S\" (e.g. \"23:30:00\"; minutes and seconds "
            f"after the first field below 60), or None for no limit."
        )
    return seconds


def make_settings(knobs: dict[str, ResolvedKnob], *, logger, monitor, n_devs, precision_policy=None,
                  sharding_policy=None) -> Settings:
    """Typed settings from resolved knobs (checked with :func:`check_values` first), made once:
    ``logger`` and ``n_devs`` are those knobs as setup checked and resolved them;
    ``precision_policy`` is ``precision`` and ``remat``'s policy
    (:func:`jaxnitro.precision.precision_policy`), ``sharding_policy`` ``sharding`` and
    ``mesh_shape``'s (:func:`jaxnitro.sharding.sharding_policy`: the ``sharding`` and
    ``mesh_shape`` settings are its ``mode`` and ``mesh_shape``); ``monitor`` is the
    experiment's ``monitor`` answer (or None)."""
    check_values(knobs)
    k = {name: r.value for name, r in knobs.items()}
    return Settings(
        seed=int(k["seed"]),
        run_dir=os.fspath(k["run_dir"]),
        n_devs=n_devs,
        accum=int(k["accum"]),
        steps_per_dispatch="auto" if k["steps_per_dispatch"] == "auto" else int(k["steps_per_dispatch"]),
        # with max_steps and no max_epochs of the user's, the steps alone end the run
        max_epochs=(None if k["max_steps"] is not None and (knobs["max_epochs"].source == "default" or k["max_epochs"] is None)
                    else int(k["max_epochs"])),
        max_steps=None if k["max_steps"] is None else int(k["max_steps"]),
        val_every_n_steps=None if k["val_every_n_steps"] is None else int(k["val_every_n_steps"]),
        max_time=max_time_seconds(k["max_time"], knobs["max_time"].source),
        schedule_horizon=k["schedule_horizon"],
        schedules=k["schedules"] or {},
        gradient_clip_norm=float(k["gradient_clip_norm"] or 0.0),
        check_divergence=bool(k["check_divergence"]),
        autolog_schedules=bool(k["autolog_schedules"]),
        log_every_n_steps=int(k["log_every_n_steps"]),
        logger=logger,
        checkpointer=k["checkpointer"],
        early_stop=k["early_stop"],
        ema=k["ema"],
        profile=k["profile"],
        precision=k["precision"],
        remat=k["remat"],
        precision_policy=precision_policy,
        device_peak_flops=k["device_peak_flops"],
        monitor=monitor,
        knobs=dict(knobs),
        sharding_policy=sharding_policy,
        sharding=getattr(sharding_policy, "mode", "replicated"),
        mesh_shape=getattr(sharding_policy, "mesh_shape", None),
        compilation_cache=k["compilation_cache"],
    )


def require_monitor_and_val(settings: Settings, splits, cls_name: str, name: str, purpose: str,
                            instead: str) -> None:
    """For a plugin knob that needs the monitored metric on the `val` split (early stopping,
    best checkpoints): refuse, naming knob ``name``, its source (from ``settings``), ``purpose``
    (what the metric is for) and the alternative ``instead``, when ``settings.monitor`` is None
    (``cls_name``, the experiment's class, has no ``monitor`` hook) or ``splits`` (the data's
    split names) has ``train`` but no ``val``."""
    source = settings.source(name)
    if settings.monitor is None:
        raise ValueError(
            f"jaxnitro: `{name}` ({source}) {purpose}, but {cls_name} has no `monitor` hook, so "
            f"there is no metric for it. Define `def monitor(self): return ('<metric>', 'max' | "
            f"'min')`, or {instead}."
        )
    if "val" not in splits and "train" in splits:
        raise ValueError(
            f"jaxnitro: `{name}` ({source}) {purpose}, ranked on the `val` split's "
            f"{settings.monitor[0]!r}, but the data has no `val` split (splits: "
            f"{sorted(splits)}). Return one from build_data, or {instead}."
        )