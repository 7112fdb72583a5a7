"""Sweeps: ``jn.sweep(e, grid, **knobs)`` trains one run per grid point on one set of programs.

Entry point ``sweep``; exports :func:`sweep`, :class:`SweepResults` and
:func:`constant_schedule` (``jn.sweep``, ``jn.SweepResults``,
``jn.constant_schedule``).

A grid point may set, without compiling anything new:

* a **Device field** (``"smoothing": 0.1``): a program input;
* a **schedule key**, ``"learning_rate"`` or ``"weight_decay"``: a number is a
  constant schedule of that optimizer hyperparameter (the learning rate is the
  base rate, multiplied by each group's ``learning_rate_ratio``, as the
  ``learning_rate`` hook's value is); a factory (``total_steps -> (step ->
  value)``) is that key's schedule for the point. Hyperparameters reach the
  programs as device scalars (``optax.inject_hyperparams``);
* a Device field's **schedule**: a factory as the field's value;
* a **run knob** (``"seed": 1``, ``"max_epochs": 3``, ``"schedules": {...}``).

A Host field may be swept too (it is not part of any compile key), but the
data is then built again for each point, and a Host field that sets a shape
(a batch size) compiles at each new shape: each row's ``compiles`` column
shows what every point cost. A **GraphConst** field is refused: each value is
a different program. So are the knobs that are trace-time constants
(``accum``, ``n_devs``, ``steps_per_dispatch``).

Host-side only: nothing here is part of a compiled program.
"""

from __future__ import annotations

import itertools
import math
import numbers
import time
from collections.abc import Mapping, Sequence

import attrs
import numpy as np

import jaxnitro as jn
from jaxnitro.plugin import HANDLE_KEYWORDS, HYPERS, RUN_KNOBS, fields_of, hookimpl, to_device_value

__all__ = ["SweepResults", "constant_schedule", "sweep"]

#: Run knobs that are trace-time constants: a new value is a new program.
COMPILING_KNOBS = {
    "accum": "the gradient program accumulates that many micro-batches",
    "n_devs": "the programs are compiled for that many devices",
    "steps_per_dispatch": "the step program runs that many steps per dispatch",
}

#: Columns every row has after the point's own keys.
RESULT_COLUMNS = ("status", "epochs", "steps", "train_loss", "best_epoch", "stop_reason", "compiles",
                  "seconds", "run_dir")


class _Constant:
    """A NumPy schedule with one value. NumPy on purpose: the core evaluates it on an
    array of steps, so a new value compiles nothing (a jitted ``lambda step: v`` would)."""

    def __init__(self, value: float):
        self.value = float(value)

    def __call__(self, step):
        return np.full(np.shape(np.asarray(step)), self.value, np.float32)

    def __repr__(self) -> str:
        return f"constant({self.value!r})"


class constant_schedule:
    """``constant_schedule(v)``: a schedule factory whose every step is ``v``.

    Evaluated with NumPy, so a sweep over ``v`` compiles nothing (a traced
    ``lambda total: lambda step: v`` compiles one small program per value).
    """

    def __init__(self, value: float):
        self.value = float(value)

    def __call__(self, total: int) -> _Constant:
        return _Constant(self.value)

    def __repr__(self) -> str:
        return f"constant_schedule({self.value!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, constant_schedule) and other.value == self.value

    def __hash__(self) -> int:
        return hash(("constant_schedule", self.value))


class SweepResults(list):
    """The rows of a sweep, one dict per point, in grid order.

    Each row holds every grid key (the point's value, None where a point of a list grid
    does not set it), then ``status``, ``epochs``,
    ``steps``, the last ``train_loss``; with a ``monitor``, the monitored metric's
    last value (column ``<metric>``), its best (``best_<metric>``) and
    ``best_epoch``; then ``stop_reason``, ``compiles`` (traces this point caused,
    from ``jn.cache_stats()``), ``seconds`` and ``run_dir`` (the run's folder).

    ``monitor`` is ``(metric, mode)`` or None; ``data`` the splits every point
    shared (None when each point built its own); :meth:`best` the best row;
    :meth:`to_pandas` a ``pandas.DataFrame``; ``str(results)`` a table.
    """

    def __init__(self, rows=(), monitor=None, data=None):
        super().__init__(rows)
        self.monitor = monitor
        self.data = data

    def best(self) -> dict | None:
        """The row with the best ``best_<metric>`` (NaN ignored), or None without a monitor."""
        if self.monitor is None:
            return None
        name, mode = self.monitor
        scored = [r for r in self if _finite(r.get(f"best_{name}"))]
        if not scored:
            return None
        pick = max if mode == "max" else min
        return pick(scored, key=lambda r: r[f"best_{name}"])

    def to_pandas(self):
        """The rows as a ``pandas.DataFrame`` (needs pandas)."""
        try:
            import pandas as pd
        except ImportError:
            raise ImportError(
                "jaxnitro: SweepResults.to_pandas() needs pandas; `pip install pandas`, or read the "
                "rows as dicts (the results are a list of them)."
            ) from None
        return pd.DataFrame(list(self))

    def __str__(self) -> str:
        if not self:
            return "SweepResults(no rows)"
        skip = {"stop_reason", "run_dir"}
        cols = [c for c in self[0] if c not in skip]
        cells = [[_cell(r.get(c)) for c in cols] for r in self]
        widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
        lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths))]
        lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"SweepResults({len(self)} rows)\n{self}"


def _finite(v) -> bool:
    return isinstance(v, numbers.Real) and math.isfinite(v)


def _cell(v) -> str:
    if isinstance(v, float):
        text = f"{v:.4g}"
        return text if any(c in text for c in ".einf") else text + ".0"  # 0.0 stays a float
    return str(v)


# -- the grid ---------------------------------------------------------------------------------


def points_of(grid) -> list[dict]:
    """The grid as a list of points: the cartesian product of ``{key: [values]}`` (the last
    key varying fastest), or a list of ``{key: value}`` dicts taken as given."""
    if isinstance(grid, Mapping):
        if not grid:
            raise ValueError("jaxnitro: jn.sweep got an empty grid; give {key: [values, ...]} or a list of dicts.")
        for key, values in grid.items():
            if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
                raise TypeError(
                    f"jaxnitro: jn.sweep grid key `{key}` is {values!r}; each key of a grid dict takes a "
                    f"list of values to try, e.g. {{{key!r}: [{values!r}]}}."
                )
            if not values:
                raise ValueError(f"jaxnitro: jn.sweep grid key `{key}` has no values; give at least one.")
        keys = list(grid)
        return [dict(zip(keys, combo)) for combo in itertools.product(*(grid[k] for k in keys))]
    if isinstance(grid, Sequence) and not isinstance(grid, (str, bytes)):
        points = list(grid)
        if not points:
            raise ValueError("jaxnitro: jn.sweep got an empty list of points; give at least one dict.")
        for i, p in enumerate(points):
            if not isinstance(p, Mapping):
                raise TypeError(
                    f"jaxnitro: jn.sweep point {i} is {p!r}; a list grid holds dicts, one per run, "
                    f"e.g. [{{'smoothing': 0.1, 'learning_rate': 1e-3}}, ...]."
                )
        return [dict(p) for p in points]
    raise TypeError(
        f"jaxnitro: jn.sweep takes a grid dict {{key: [values]}} or a list of point dicts, got "
        f"{type(grid).__name__}."
    )


def _base_schedules(e, knobs: dict) -> tuple[dict, str]:
    """The schedules the run would use without the sweep, and where they come from."""
    if "schedules" in knobs:
        return dict(knobs["schedules"] or {}), "the schedules keyword"
    method = getattr(type(e), "schedules", None)
    if callable(method):
        return dict(method(e) or {}), f"{type(e).__name__}.schedules()"
    return {}, "no schedules"


def _scheduled_hypers(schedules: dict, hyper: str) -> list[str]:
    """Where ``schedules`` already schedules optimizer hyperparameter ``hyper``."""
    found = [hyper] if hyper in schedules else []
    opt = schedules.get("opt")
    if isinstance(opt, Mapping):
        found += [f"opt/{hyper}"] if hyper in opt else []
        found += [f"opt/{g}/{hyper}" for g, v in opt.items() if isinstance(v, Mapping) and hyper in v]
    return found


def _scheduled_fields(schedules: dict) -> set[str]:
    dev = schedules.get("device")
    return set(schedules) | (set(dev) if isinstance(dev, Mapping) else set())


def classify(e, key: str) -> str:
    """``"knob"``, ``"schedule"``, ``"device"`` or ``"host"``; raise for what would recompile or
    is unknown, naming the key and the fix."""
    cls = type(e).__name__
    infos = fields_of(e)
    if key in COMPILING_KNOBS:
        raise ValueError(
            f"jaxnitro: jn.sweep cannot sweep the run knob `{key}`: it is a trace-time constant "
            f"({COMPILING_KNOBS[key]}), so each value would recompile. Pass one value as a keyword "
            f"(jn.sweep(e, grid, {key}=...)), or loop over its values and call jn.sweep once per value."
        )
    if key in HANDLE_KEYWORDS:
        raise ValueError(
            f"jaxnitro: jn.sweep cannot sweep `{key}`: it is a handle keyword, not a value to search; "
            f"pass it once as a keyword: jn.sweep(e, grid, {key}=...)."
        )
    if key in RUN_KNOBS:
        return "knob"
    info = infos.get(key)
    if key in HYPERS:
        if info is not None:
            raise KeyError(
                f"jaxnitro: jn.sweep grid key `{key}` is ambiguous: it names the optimizer "
                f"hyperparameter and the field {cls}.{key}. Rename the field."
            )
        return "schedule"
    if info is None:
        device = [n for n, i in infos.items() if i.is_device]
        raise KeyError(
            f"jaxnitro: jn.sweep grid key `{key}` is not a field of {cls}, an optimizer "
            f"hyperparameter ({', '.join(HYPERS)}) or a run knob. Device fields of {cls}: "
            f"{', '.join(device) or '(none)'}."
        )
    if info.is_graph_const:
        raise ValueError(
            f"jaxnitro: jn.sweep cannot sweep `{key}`: it is a GraphConst field of {cls}, part of the "
            f"compiled graph, so every value would recompile every program. Sweep Device fields and "
            f"schedule values in one jn.sweep; for `{key}`, loop: `for v in values: "
            f"jn.sweep(attrs.evolve(e, {key}=v), grid)` (one compile per value), or make it a "
            f"Device field if traced code can take it as an input."
        )
    return "device" if info.is_device else "host"


def _check_value(e, key: str, kind: str, value, base: dict, source: str) -> None:
    cls = type(e).__name__
    if kind == "schedule":
        if callable(value):
            return
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
            raise ValueError(
                f"jaxnitro: jn.sweep `{key}` = {value!r}; give a finite number >= 0 (a constant "
                f"{key}) or a schedule factory `lambda total: (lambda step: ...)`."
            )
        already = _scheduled_hypers(base, key)
        if already:
            raise ValueError(
                f"jaxnitro: jn.sweep `{key}` = {value!r} would replace the schedule "
                f"{', '.join(already)} ({source}) by a constant. Sweep schedules instead, one factory "
                f"per point ({{{key!r}: [lambda total: ..., ...]}}), or pass schedules={{}} to sweep "
                f"constants."
            )
        return
    if kind == "device":
        if callable(value):
            return  # the field's schedule for this point
        if key in _scheduled_fields(base):
            raise ValueError(
                f"jaxnitro: jn.sweep cannot set the Device field `{key}` to {value!r}: it is scheduled "
                f"({source}), and the schedule rewrites it every step. Sweep its schedule (a factory "
                f"per point: {{{key!r}: [lambda total: ..., ...]}}) or drop it from the schedules."
            )
        info = fields_of(e)[key]
        new, current = to_device_value(cls, info, value), to_device_value(cls, info, getattr(e, key))
        if new.shape != current.shape or new.dtype != current.dtype:
            raise ValueError(
                f"jaxnitro: jn.sweep `{key}` = {value!r} has shape {new.shape} ({new.dtype}); "
                f"{cls}.{key} has shape {current.shape} ({current.dtype}). A Device value of another "
                f"shape or dtype is a new program, so it would recompile; sweep values of one shape."
            )
    if kind == "knob" and key == "schedules" and value is not None and not isinstance(value, Mapping):
        raise TypeError(f"jaxnitro: jn.sweep `schedules` = {value!r}; give a dict of key -> factory per point.")


def _apply(e, point: dict, kinds: dict, knobs: dict):
    """The experiment and the keywords of ``Nitro`` for one point."""
    fields = {k: v for k, v in point.items() if kinds[k] in ("device", "host") and not callable(v)}
    run_knobs = dict(knobs)
    run_knobs.update({k: v for k, v in point.items() if kinds[k] == "knob"})
    scheduled = {k: v for k, v in point.items() if kinds[k] in ("schedule", "device") and (
        kinds[k] == "schedule" or callable(v))}
    if scheduled:
        schedules, _ = _base_schedules(e, run_knobs)
        for k, v in scheduled.items():
            factory = v if callable(v) else constant_schedule(v)
            if kinds[k] == "schedule":
                opt = schedules.get("opt")
                if isinstance(opt, Mapping) and k in opt:  # the point's value replaces opt/<key>
                    schedules["opt"] = {kk: vv for kk, vv in opt.items() if kk != k}
                schedules[k] = factory
            else:
                dev = schedules.get("device")
                if isinstance(dev, Mapping):
                    dev = {kk: vv for kk, vv in dev.items() if kk != k}
                    schedules["device"] = dev
                schedules[k] = factory
        run_knobs["schedules"] = schedules
    return (attrs.evolve(e, **fields) if fields else e), run_knobs


def _row(keys: list, point: dict, nitro, compiles: int, seconds: float) -> dict:
    row = {k: point.get(k) for k in keys}  # every grid key; None: the point left it as it was
    rows = nitro.rows
    last = rows[-1] if rows else {}
    row.update(status=nitro.status, epochs=nitro.epoch, steps=nitro.step, train_loss=last.get("train_loss"))
    monitor = nitro.settings.monitor
    if monitor is not None:
        name, _ = monitor
        h = nitro.history()
        validated = [r for r in rows if name in r]
        row[name] = float(validated[-1][name]) if validated else None
        best = h.best
        row[f"best_{name}"] = float(best[name]) if best is not None else None
        row["best_epoch"] = h.best_epoch
    else:
        row["best_epoch"] = None
    row.update(stop_reason=nitro.stop_reason, compiles=compiles, seconds=round(seconds, 3),
               run_dir=nitro.run_dir)
    return row


def sweep(e, grid, *, data=None, **knobs) -> SweepResults:
    """Train ``e`` once per point of ``grid``; return the results as a :class:`SweepResults`.

    ``grid``: ``{key: [values]}`` (every combination, the last key varying fastest) or a
    list of ``{key: value}`` points. Keys: Device fields, ``"learning_rate"`` and
    ``"weight_decay"`` (a number: a constant; a factory: a schedule), Device fields' schedules
    (a factory as the value), run knobs such as ``seed``, and Host fields (see the module
    docs). ``knobs`` are ``jn.Nitro`` keywords shared by every point (``max_epochs``,
    ``run_dir``, ``logger``, ``early_stop``, ...); a point's own value wins.

    The data is built by the first point and shared by the others (``data=`` gives it
    instead); a grid over a Host field builds it once per point. Every point is checked
    before the first one trains, so a bad key or value raises at once, naming it: an
    unknown key, a GraphConst field or a compiling knob (it would recompile), a Device
    field the schedules already set, a number that would replace a schedule.

    Only the first point compiles (if nothing compiled the programs earlier): the later
    points' ``compiles`` column is 0, as ``jn.cache_stats()`` shows. A point that diverges
    is a row with status ``"diverged"``; the sweep goes on. An exception (a Ctrl-C) ends it.
    """
    points = points_of(grid)
    kinds: dict[str, str] = {}
    for p in points:
        for key in p:
            if key not in kinds:
                kinds[key] = classify(e, key)
            if key in RESULT_COLUMNS:
                raise ValueError(
                    f"jaxnitro: jn.sweep grid key `{key}` is also a result column; rename the field."
                )
    for p in points:
        base, source = _base_schedules(e, {**knobs, **{k: v for k, v in p.items() if k == "schedules"}})
        for key, value in p.items():
            _check_value(e, key, kinds[key], value, base, source)
    share = data is None and "host" not in kinds.values()
    results = SweepResults(data=data)
    for i, point in enumerate(points):
        experiment, run_knobs = _apply(e, point, kinds, knobs)
        if data is not None:
            run_knobs["data"] = data
        before = jn.cache_stats().misses
        t0 = time.perf_counter()
        nitro = jn.Nitro(experiment, **run_knobs)
        try:
            nitro.train()
        finally:
            nitro.release()
        results.append(_row(list(kinds), point, nitro, jn.cache_stats().misses - before, time.perf_counter() - t0))
        if i == 0:
            results.monitor = nitro.settings.monitor
            if share:
                data = results.data = nitro.data
    return results


@hookimpl(trylast=True)
def jaxnitro_exports():
    return {"sweep": sweep, "SweepResults": SweepResults, "constant_schedule": constant_schedule}
