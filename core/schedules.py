"""Schedules: binding keys to optimizer hyperparameters or Device fields, and materializing them.

``schedules()`` returns ``{key: factory}``; each factory is called once with the
run's total number of optimizer steps and returns ``schedule(step) -> value``
(an optax schedule works as is: ``lambda total: optax.cosine_onecycle_schedule(total, 1e-3)``).

Keys:

* ``"learning_rate"`` / ``"weight_decay"``: every group's optimizer
  hyperparameter (the learning rate is multiplied by each group's ratio);
* a Device field's name: the field is rewritten every step;
* ``{"opt": {"learning_rate": f, "encoder": {"learning_rate": g}}}`` and
  ``{"device": {"smoothing": f}}``: qualified forms; a group path binds one
  group and overrides a bare key for it.

A bare key naming both an optimizer hyperparameter and a Device field is an
ambiguity error that shows both qualified forms.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from .optim import HYPERS

__all__ = ["Bindings", "StepValues", "bind_schedules", "materialize"]


@dataclass
class Bindings:
    """Where each schedule landed: ``opt[(group or None, hyper)]`` and ``device[field]``."""

    opt: dict = field(default_factory=dict)
    device: dict = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.opt or self.device)

    def describe(self) -> list[tuple[str, str]]:
        rows = [
            (f"opt/{g}/{h}" if g else f"opt/{h}", "optimizer hyperparameter")
            for (g, h) in self.opt
        ]
        rows += [(f"device/{k}", "Device field") for k in self.device]
        return rows


def _check_factory(key: str, value):
    if not callable(value):
        raise TypeError(
            f"jaxnitro: schedule `{key}` is {value!r}; a schedule is a factory of the horizon, "
            f"`total_steps -> (step -> value)`, e.g. `lambda total: optax.linear_schedule(1e-3, 0, total)`. "
            f"For a constant, use `lambda total: lambda step: 1e-3`."
        )
    return value


def bind_schedules(schedules, device_fields: dict, groups: tuple[str, ...]) -> Bindings:
    """Bind the ``schedules`` dict to optimizer slots and Device fields; raise on unknown keys.

    ``device_fields`` maps Device field names to FieldInfo; ``groups`` lists the
    parameter group names.
    """
    b = Bindings()
    if not schedules:
        return b
    if not isinstance(schedules, dict):
        raise TypeError(f"jaxnitro: `schedules` must be a dict of key -> factory, got {type(schedules).__name__}.")
    for key, value in schedules.items():
        if key == "opt":
            if not isinstance(value, dict):
                raise TypeError("jaxnitro: schedules['opt'] must be a dict: {'learning_rate': f, 'group': {...}}.")
            for k, v in value.items():
                if k in HYPERS:
                    b.opt[(None, k)] = _check_factory(f"opt/{k}", v)
                elif k in groups and isinstance(v, dict):
                    for h, f in v.items():
                        if h not in HYPERS:
                            raise KeyError(
                                f"jaxnitro: schedule `opt/{k}/{h}`: unknown optimizer hyperparameter "
                                f"`{h}`; schedulable: {', '.join(HYPERS)}."
                            )
                        b.opt[(k, h)] = _check_factory(f"opt/{k}/{h}", f)
                else:
                    raise KeyError(
                        f"jaxnitro: schedule `opt/{k}` names neither an optimizer hyperparameter "
                        f"({', '.join(HYPERS)}) nor a parameter group ({', '.join(groups)})."
                    )
        elif key == "device":
            if not isinstance(value, dict):
                raise TypeError("jaxnitro: schedules['device'] must be a dict: {'field': f}.")
            for k, v in value.items():
                if k not in device_fields:
                    raise KeyError(
                        f"jaxnitro: schedule `device/{k}`: `{k}` is not a Device field; Device "
                        f"fields: {', '.join(device_fields) or '(none)'}."
                    )
                b.device[k] = _check_factory(f"device/{k}", v)
        else:
            in_opt, in_dev = key in HYPERS, key in device_fields
            if in_opt and in_dev:
                raise KeyError(
                    f"jaxnitro: schedule key `{key}` is ambiguous: it names both an optimizer "
                    f"hyperparameter and a Device field. Say which: "
                    f"{{'opt': {{'{key}': ...}}}} or {{'device': {{'{key}': ...}}}}."
                )
            if in_opt:
                b.opt[(None, key)] = _check_factory(key, value)
            elif in_dev:
                b.device[key] = _check_factory(key, value)
            else:
                raise KeyError(
                    f"jaxnitro: unknown schedule key `{key}`. Schedulable: optimizer hyperparameters "
                    f"({', '.join(HYPERS)}), Device fields ({', '.join(device_fields) or 'none'}), or "
                    f"the qualified forms {{'opt': {{...}}}} / {{'device': {{...}}}}."
                )
    return b


def materialize(factory, total: int, name: str) -> np.ndarray:
    """Call ``factory(total)`` and evaluate the schedule at steps ``0 .. total-1`` as float32.

    Tries one vectorized call on ``np.arange(total)`` (most optax schedules accept
    arrays), then one jitted ``vmap`` over the steps (optax's one-cycle and other
    piecewise schedules: about 0.1 s for 8,000 steps instead of about 1 ms a step), and
    falls back to one call per step for a schedule that cannot be traced.
    """
    schedule = factory(total)
    if not callable(schedule):
        raise TypeError(
            f"jaxnitro: schedule `{name}`'s factory returned {schedule!r}; it must return a "
            f"function of the step."
        )
    steps = np.arange(total)
    values = None
    try:
        values = np.asarray(schedule(steps), dtype=np.float32)
        if values.shape != (total,):
            values = None
    except Exception:
        pass
    if values is None:  # e.g. optax's piecewise schedules: traceable, but not over an array
        try:
            values = np.asarray(jax.jit(jax.vmap(schedule))(jnp.arange(total)), dtype=np.float32)
            if values.shape != (total,):
                values = None
        except Exception:
            values = None
    if values is None:  # a schedule that cannot be traced: one call per step
        values = np.asarray([float(schedule(int(s))) for s in steps], dtype=np.float32)
    return check_schedule_values(values, name)


def check_schedule_values(values: np.ndarray, name: str) -> np.ndarray:
    """Refuse a NaN or infinite schedule value, and a negative optimizer hyperparameter,
    naming the schedule and the first bad step. Returns ``values``."""
    bad = ~np.isfinite(values)
    if name.startswith("opt/"):
        bad |= values < 0
    if bad.any():
        i = int(np.argmax(bad))
        must = "a finite number >= 0" if name.startswith("opt/") else "a finite number"
        raise ValueError(
            f"jaxnitro: schedule `{name}` gives {float(values[i])!r} at step {i} (of {len(values)} "
            f"steps, counted from 0); every value must be {must}. A NaN or negative learning rate "
            f"or decay would silently make the weights NaN (reported later as a divergence). Fix "
            f"the schedule (an optax schedule's arguments, a division by the horizon when it is 0 "
            f"or 1, ...)."
        )
    return values


class StepValues:
    """The per-step inputs of a run: the optimizer hyperparameter vector and scheduled Device fields.

    Every bound schedule is materialized once for the run's ``total`` optimizer
    steps. ``hypers(step)`` is one float32 vector (a device constant when no
    optimizer value is scheduled); ``dev(base, step)`` is the Device values with
    scheduled fields replaced. ``logged`` maps ``schedule/<group>/<hyper>`` and
    ``schedule/<field>`` to the tables of the schedules that vary.
    """

    def __init__(self, nitro, total: int):
        spec = nitro.plan.opt_spec
        self.layout = spec.layout
        base = spec.base_vector(nitro.plan.base_lr)
        self.constant = not nitro.plan.bindings.opt
        self.logged: dict[str, np.ndarray] = {}
        if self.constant:
            self.vector = jax.device_put(base)
        else:
            table = np.tile(base, (total, 1))
            bare = {h: materialize(f, total, f"opt/{h}") for (g, h), f in nitro.plan.bindings.opt.items() if g is None}
            for i, (group, hyper) in enumerate(self.layout.slots):
                gspec = next(x for x in spec.groups if x.name == group)
                values = None
                if (group, hyper) in nitro.plan.bindings.opt:
                    values = materialize(nitro.plan.bindings.opt[(group, hyper)], total, f"opt/{group}/{hyper}")
                elif hyper in bare:
                    values = bare[hyper]
                if values is not None:
                    table[:, i] = values * gspec.ratio if hyper == "learning_rate" else values
                    if values.min() != values.max():
                        self.logged[f"schedule/{group}/{hyper}"] = table[:, i]
            self.table = table
        self.device = {}
        for name, f in nitro.plan.bindings.device.items():
            dtype = nitro.device_values[name].dtype
            values = materialize(f, total, f"device/{name}").astype(dtype)
            self.device[name] = values
            if values.min() != values.max():
                self.logged[f"schedule/{name}"] = values

    def hypers(self, step: int):
        return self.vector if self.constant else self.table[min(step, len(self.table) - 1)]

    def hypers_block(self, step: int, k: int):
        """``[k, n]``: the hyperparameter vectors of steps ``step .. step + k - 1``."""
        if self.constant:
            blocks = self.__dict__.setdefault("_blocks", {})
            if k not in blocks:
                blocks[k] = jax.device_put(np.tile(np.asarray(self.vector), (k, 1)))
            return blocks[k]
        return self.table[np.minimum(np.arange(step, step + k), len(self.table) - 1)]

    def dev_block(self, step: int, k: int) -> dict:
        """The scheduled Device fields of steps ``step .. step + k - 1``: ``{name: [k]}``."""
        if not self.device:
            return {}
        return {
            name: values[np.minimum(np.arange(step, step + k), len(values) - 1)]
            for name, values in self.device.items()
        }

    def dev(self, base: dict, step: int) -> dict:
        if not self.device:
            return base
        out = dict(base)
        for name, values in self.device.items():
            out[name] = values[min(step, len(values) - 1)]
        return out
