"""Schedules: binding keys to optimizer hyperparameters or Device fields, and evaluating them in stretches.

``schedules()`` returns ``{key: factory}``; each factory is called once with the
run's total number of optimizer steps and returns ``schedule(step) -> value``
(an optax schedule works as is: ``lambda total: optax.cosine_onecycle_schedule(total, 1e-3)``).

Keys:

* ``"learning_rate"`` / ``"weight_decay"``: every group's optimizer
  hyperparameter (the learning rate is multiplied by each group's ratio);
* a rule's own hyperparameter, by the rule's name for it (``"b1"`` of
  ``optax.adam``, ``"momentum"`` of ``optax.sgd``): every group (each group's rule
  must have it), or one group with the group path;
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

__all__ = [
    "Bindings", "ScheduleLog", "ScheduleStream", "bind_schedules", "materialize",
    "scheduled_rule_hypers",
]


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


def _hyper_list(names) -> str:
    return ", ".join(names) or "(none)"


def bind_schedules(schedules, device_fields: dict, groups) -> Bindings:
    """Bind the ``schedules`` dict to optimizer slots and Device fields; raise on unknown keys.

    ``device_fields`` maps Device field names to FieldInfo; ``groups`` maps each parameter
    group's name to the hyperparameters a schedule may bind for it (``learning_rate``,
    ``weight_decay`` and its rule's own, e.g. ``b1``: :attr:`~jaxnitro.optim.GroupSpec.schedulable`);
    a tuple of names means ``HYPERS`` for each. A bare optimizer key binds every group, so
    each group's rule must have it (else the group-path form is the fix).
    """
    b = Bindings()
    if not schedules:
        return b
    if not isinstance(groups, dict):
        groups = {g: HYPERS for g in groups}
    known = tuple(dict.fromkeys([*HYPERS, *(h for hs in groups.values() for h in hs)]))
    if not isinstance(schedules, dict):
        raise TypeError(f"jaxnitro: `schedules` must be a dict of key -> factory, got {type(schedules).__name__}.")
    for key, value in schedules.items():
        if key == "opt":
            _bind_opt(b, value, groups, known)
        elif key == "device":
            _bind_device(b, value, device_fields)
        else:
            in_opt, in_dev = key in known, key in device_fields
            if in_opt and in_dev:
                raise KeyError(
                    f"jaxnitro: schedule key `{key}` is ambiguous: it names both an optimizer "
                    f"hyperparameter and a Device field. Say which: "
                    f"{{'opt': {{'{key}': ...}}}} or {{'device': {{'{key}': ...}}}}."
                )
            if in_opt:
                _bind_every_group(b, groups, key, value, key)
            elif in_dev:
                b.device[key] = _check_factory(key, value)
            else:
                raise KeyError(
                    f"jaxnitro: unknown schedule key `{key}`. Schedulable: optimizer hyperparameters "
                    f"by the rule's own name ({_hyper_list(known)}), Device fields "
                    f"({', '.join(device_fields) or 'none'}), or the qualified forms "
                    f"{{'opt': {{...}}}} / {{'device': {{...}}}}."
                )
    return b


def _bind_every_group(b: Bindings, groups: dict, key: str, value, label: str) -> None:
    """A bare optimizer key (``learning_rate``, ``opt/b1``): it binds every group, so every
    group's rule must have it; refused naming the groups that lack it and the group-path fix."""
    lacking = [g for g, hs in groups.items() if key not in hs]
    if lacking and len(lacking) < len(groups):
        having = next(g for g in groups if g not in lacking)
        raise KeyError(
            f"jaxnitro: schedule `{label}` binds every parameter group, but the rule of group(s) "
            f"{', '.join(f'`{g}`' for g in lacking)} has no hyperparameter `{key}` (theirs: "
            f"{_hyper_list(groups[lacking[0]])}). Schedule it for the groups whose rule has it: "
            f"{{'opt': {{'{having}': {{'{key}': ...}}}}}}."
        )
    b.opt[(None, key)] = _check_factory(label, value)


def _bind_opt(b: Bindings, value, groups: dict, known: tuple) -> None:
    """``schedules["opt"]``: ``{hyper: f}`` for every group, ``{group: {hyper: f}}`` for one."""
    if not isinstance(value, dict):
        raise TypeError("jaxnitro: schedules['opt'] must be a dict: {'learning_rate': f, 'group': {...}}.")
    for k, v in value.items():
        if k in groups and isinstance(v, dict):
            for h, f in v.items():
                if h not in groups[k]:
                    raise KeyError(
                        f"jaxnitro: schedule `opt/{k}/{h}`: unknown optimizer hyperparameter "
                        f"`{h}` for group `{k}`; schedulable for its rule: {_hyper_list(groups[k])}."
                    )
                b.opt[(k, h)] = _check_factory(f"opt/{k}/{h}", f)
        elif k in known:
            _bind_every_group(b, groups, k, v, f"opt/{k}")
        else:
            raise KeyError(
                f"jaxnitro: schedule `opt/{k}` names neither an optimizer hyperparameter "
                f"({_hyper_list(known)}) nor a parameter group ({', '.join(groups)})."
            )


def _bind_device(b: Bindings, value, device_fields: dict) -> None:
    """``schedules["device"]``: ``{Device field: f}``."""
    if not isinstance(value, dict):
        raise TypeError("jaxnitro: schedules['device'] must be a dict: {'field': f}.")
    for k, v in value.items():
        if k not in device_fields:
            raise KeyError(
                f"jaxnitro: schedule `device/{k}`: `{k}` is not a Device field; Device "
                f"fields: {', '.join(device_fields) or '(none)'}."
            )
        b.device[k] = _check_factory(f"device/{k}", v)


def scheduled_rule_hypers(bindings: Bindings, groups) -> dict[str, tuple[str, ...]]:
    """``{group: rule hyperparameters a schedule drives}`` (``learning_rate`` and
    ``weight_decay`` aside, which every group injects): what
    :meth:`~jaxnitro.optim.OptimizerSpec.with_scheduled` takes. ``groups`` as for
    :func:`bind_schedules` (a mapping)."""
    out: dict[str, tuple[str, ...]] = {}
    for g, hs in groups.items():
        names = {h for (grp, h) in bindings.opt if h not in HYPERS and (grp is None or grp == g) and h in hs}
        if names:
            out[g] = tuple(h for h in hs if h in names)
    return out


#: Steps per stretch for a schedule evaluated in one call (an array call or a jitted vmap).
BLOCK = 1024
#: Steps per stretch for a schedule that cannot be traced (one Python call per step).
SLOW_BLOCK = 64
#: Steps spread over the horizon, evaluated with the first stretch, that decide whether a
#: schedule varies (and so is logged) without evaluating the whole horizon.
PROBES = 64


class ScheduleStream:
    """One bound schedule, evaluated in stretches of steps as training reaches them.

    ``factory(total)`` is called once, here. Values are float32 and produced by
    :meth:`values` a stretch at a time and cached: a stretch of :data:`BLOCK` steps
    in one jitted ``jax.vmap`` over the step indices (compiled once: every call has
    the same shape), else in one call on an array of steps (NumPy code, a schedule
    the user vmapped already), else (a schedule that can do neither) one Python call
    per step in stretches of :data:`SLOW_BLOCK`. The way is chosen on the first
    stretch and kept. Steps past the horizon take the last step's value (``total - 1``).

    The first stretch is evaluated at construction together with :data:`PROBES`
    steps spread evenly over the horizon (and its last step); :attr:`varies` is
    True when any of those values differ. Each stretch is checked with
    :func:`check_schedule_values` when it is produced, so a NaN, infinite or (for
    an optimizer hyperparameter) negative value raises when the stretch holding it
    is first needed (at train start for the first stretch and the probes).

    :attr:`evaluated` counts the step values computed so far (probes included):
    it depends on the steps reached, never on the horizon's length.
    """

    def __init__(self, factory, total: int, name: str):
        self.name, self.total = name, max(int(total), 1)
        schedule = factory(self.total)
        if not callable(schedule):
            raise TypeError(
                f"jaxnitro: schedule `{name}`'s factory returned {schedule!r}; it must return a "
                f"function of the step."
            )
        self.schedule = schedule
        self.mode: str | None = None  # "array", "vmap" or "per-step", fixed by the first call
        self._vmapped = None
        self.evaluated = 0
        self.blocks: dict[int, np.ndarray] = {}
        self.block = min(BLOCK, self.total)
        # PROBES distinct steps from the first to the last (fewer for a shorter horizon), so
        # the first call's size is the same for every horizon of at least BLOCK steps
        probes = np.unique(np.linspace(0, self.total - 1, min(PROBES, self.total)).round().astype(np.int64))
        # the first stretch and the probes in one call, of the shape every later call has
        steps = np.concatenate([np.arange(self.block, dtype=np.int64), probes])
        self.width = len(steps)
        values = self._fast(steps)
        if values is None:  # a schedule that cannot be traced: one call per step, shorter stretches
            self.mode, self.block = "per-step", min(SLOW_BLOCK, self.total)
            steps = np.concatenate([np.arange(self.block, dtype=np.int64), probes])
            values = self._per_step(steps)
        self.evaluated += len(steps)
        check_schedule_values(values, name, steps, self.total)
        self.blocks[0] = values[: self.block]
        self.varies = bool(values.min() != values.max())

    def _fast(self, steps: np.ndarray):
        """One jitted vmap, else one array call; None (mode unset) when neither works.

        The vmap comes first: one small compiled program (reused by every later stretch,
        and kept by the persistent compile cache) costs less than an array call's eager
        ops, and far less than an array call that fails halfway (optax's one-cycle).
        """
        try:
            vmapped = jax.jit(jax.vmap(self.schedule))
            out = np.asarray(vmapped(jnp.asarray(steps, jnp.int32)), dtype=np.float32)
            if out.shape == steps.shape:
                self.mode, self._vmapped = "vmap", vmapped
                return out
        except Exception:  # noqa: BLE001, S110 - any refusal means "cannot be traced"
            pass
        try:  # NumPy code, or a schedule already vmapped: not traceable per step, fine on an array
            out = np.asarray(self.schedule(steps), dtype=np.float32)
            if out.shape == steps.shape:
                self.mode = "array"
                return out
        except Exception:  # noqa: BLE001, S110 - any refusal means "not an array schedule"
            pass
        return None

    def _per_step(self, steps: np.ndarray) -> np.ndarray:
        return np.asarray([float(self.schedule(int(s))) for s in steps], dtype=np.float32)

    def _evaluate(self, steps: np.ndarray) -> np.ndarray:
        """The checked values at ``steps`` (within the horizon), the way the first call chose."""
        # padded to the first call's shape: an array call on jnp ops and the jitted vmap then
        # reuse what the first call compiled
        padded = np.concatenate([steps, np.full(self.width - len(steps), steps[-1])])
        if self.mode == "array":
            values = np.asarray(self.schedule(padded), dtype=np.float32)
            if values.shape != padded.shape:
                raise ValueError(
                    f"jaxnitro: schedule `{self.name}` returned shape {values.shape} for "
                    f"{len(padded)} steps ({int(steps[0])}..{int(steps[-1])}); its first stretch "
                    f"gave one value per step."
                )
            values = values[: len(steps)]
        elif self.mode == "vmap":
            values = np.asarray(self._vmapped(jnp.asarray(padded, jnp.int32)), dtype=np.float32)[: len(steps)]
        else:
            values = self._per_step(steps)
        self.evaluated += len(steps)
        return check_schedule_values(values, self.name, steps, self.total)

    def _fill(self, b: int) -> np.ndarray:
        start = b * self.block
        steps = np.arange(start, min(start + self.block, self.total), dtype=np.int64)
        values = self._evaluate(steps)
        self.blocks[b] = values
        return values

    def value(self, step: int) -> float:
        """The value at ``step`` (counted from 0; a step past the horizon gets the last value)."""
        step = min(max(int(step), 0), self.total - 1)
        b, i = divmod(step, self.block)
        block = self.blocks.get(b)
        if block is None:
            block = self._fill(b)
        return block[i]

    def values(self, start: int, stop: int) -> np.ndarray:
        """float32 ``[stop - start]``: the values of steps ``start .. stop - 1``."""
        steps = np.minimum(np.arange(max(start, 0), max(stop, start)), self.total - 1)
        out = np.empty(len(steps), np.float32)
        i = 0
        while i < len(steps):
            b, j = divmod(int(steps[i]), self.block)
            block = self.blocks.get(b)
            if block is None:
                block = self._fill(b)
            if steps[i] == self.total - 1:  # clamped: the rest repeat the last value
                out[i:] = block[j]
                break
            n = min(len(block) - j, len(steps) - i)
            out[i : i + n] = block[j : j + n]
            i += n
        return out


def materialize(factory, total: int, name: str) -> np.ndarray:
    """Call ``factory(total)`` and evaluate the schedule at every step ``0 .. total-1`` as
    float32 (the whole horizon, in stretches; see :class:`ScheduleStream`). Training never
    calls it: :class:`~jaxnitro.dispatch.StepValues` evaluates only the stretches it reaches."""
    stream = ScheduleStream(factory, total, name)
    return stream.values(0, stream.total)


def check_schedule_values(values: np.ndarray, name: str, steps=None, total: int | None = None) -> np.ndarray:
    """Refuse a NaN or infinite schedule value, and a negative optimizer hyperparameter,
    naming the schedule and the first bad step. ``steps`` are the step numbers of
    ``values`` (default ``0 .. len(values) - 1``) and ``total`` the horizon (default
    ``len(values)``). Returns ``values``."""
    bad = ~np.isfinite(values)
    if name.startswith("opt/"):
        bad |= values < 0
    if bad.any():
        i = int(np.argmax(bad))
        step = int(steps[i]) if steps is not None else i
        total = len(values) if total is None else total
        must = "a finite number >= 0" if name.startswith("opt/") else "a finite number"
        raise ValueError(
            f"jaxnitro: schedule `{name}` gives {float(values[i])!r} at step {step} (of {total} "
            f"steps, counted from 0); every value must be {must}. A NaN or negative learning rate "
            f"or decay would silently make the weights NaN (reported later as a divergence). Fix "
            f"the schedule (an optax schedule's arguments, a division by the horizon when it is 0 "
            f"or 1, ...)."
        )
    return values


class ScheduleLog:
    """A varying schedule's per-step values for logging, produced on demand.

    ``log[i]`` is the value used by step ``i`` counted from 0 (the logged step
    ``i + 1``); ``len(log)`` is the horizon. Indexing a step not yet reached
    evaluates its stretch (see :class:`ScheduleStream`); the loop only reads
    steps it has already run, whose stretches exist.
    """

    def __init__(self, value, total: int):
        self._value, self._total = value, total

    def __len__(self) -> int:
        return self._total

    def __getitem__(self, step: int) -> float:
        if isinstance(step, slice):
            return np.asarray([self._value(s) for s in range(*step.indices(self._total))], np.float32)
        step = int(step)
        if step < 0:
            step += self._total
        if not 0 <= step < self._total:
            raise IndexError(f"schedule step {step} is outside the horizon of {self._total} steps")
        return self._value(step)

    def __repr__(self) -> str:
        return f"ScheduleLog({self._total} steps, evaluated in stretches)"
