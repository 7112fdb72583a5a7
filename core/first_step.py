"""The first optimizer step as the loop dispatches it, for a memory preflight (a plugin).

Before the first step of a run (and for ``jn.memory_report``) the core asks the
``jaxnitro_preflight`` hook (the built-in answer is the ``memory_preflight`` plugin) with
a :class:`FirstStep`: the programs the loop's first optimizer step runs, each with the very
arguments its first dispatch passes (the handle's own state leaves and Device values, the
train split's first batch staged as the loop stages it, the run's hyperparameters and
``1/accum``), so that a plugin compiling them ahead of time
(``jitted.lower(*args).compile()``) leaves JAX's caches holding the programs of that
signature: the first step compiles nothing again. It also carries the device facts the
figures are for: the device and how many the mesh has (what the device can hold is the
plugin's to find out: the built-in one reads ``device.memory_stats()``). The answer is
kept with the programs (``nitro.plan.memory``).

This module reports; it compiles nothing and judges nothing (what fits, what helps).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from .batches import peek
from .evaluation import make_transfer
from .plugin_manager import disabled_note, first_result, plugin_manager
from .routing import KEY_COUNT, KEY_DATA

__all__ = ["FirstStep", "StepProgram", "first_step", "preflight"]

TRAIN_HOOKS = ("forward", "loss", "train_metrics", "train_step")


@dataclass(frozen=True)
class StepProgram:
    """One program of the first optimizer step: ``jitted`` (a ``jax.jit`` function) called as
    ``jitted(*args)``; ``runs``: how many times one optimizer step runs it (``accum - 1`` for
    ``"accumulate"``, 1 for ``"train_step"``)."""

    name: str
    jitted: Any
    args: tuple
    runs: int = 1


@dataclass(frozen=True)
class FirstStep:
    """The first optimizer step of a handle, as the loop dispatches it (see the module docstring).

    ``device``: the ``jax.Device`` the figures are for (the mesh's first); ``n_devices``:
    the devices the step runs on; ``params``, ``model_state``, ``opt_state``: the
    state's leaves as the step takes them; ``batch``: one staged micro-batch's fields (no key
    entries); ``programs``: the step's programs, in the order they run; empty with ``note``
    saying why when the first dispatch runs another program (``steps_per_dispatch`` > 1: the
    block program, compiled at its first dispatch).
    """

    device: Any
    n_devices: int
    params: Any
    model_state: Any
    opt_state: Any
    batch: dict
    programs: tuple[StepProgram, ...] = ()
    note: str = ""


def _first_batch(plan, train, rng) -> dict:
    """A batch of split ``train`` (zeros of the first batch's fields, which setup recorded: the
    source is not read again, a stream not restarted), staged as the loop stages a one-step
    dispatch (with the key entries of the run's key ``rng`` when a hook declares ``key``)."""
    specs = getattr(train, "first_batch_spec", None)
    if specs is None:
        first = peek(train)
    else:
        first = {f: np.zeros((plan.width, *shape), dtype) for f, (shape, dtype) in specs.items()}
    batch = make_transfer(plan, TRAIN_HOOKS)(first)
    if any(plan.routes[h].wants_key for h in TRAIN_HOOKS if h in plan.routes):
        batch = {**batch, KEY_DATA: rng, KEY_COUNT: np.uint32(0)}
    return batch


def _dev_values(plan, device_values: dict, step: int, scheds) -> dict:
    """The Device values the first dispatch passes at ``step`` (a scheduled field: its host scalar)."""
    if scheds is not None:
        return scheds.dev(step)
    dev = dict(device_values)
    for name in plan.bindings.device:  # a scheduled field arrives as a host scalar per step
        dev[name] = np.zeros((), np.dtype(dev[name].dtype))[()]
    return dev


def _hypers_and_scale(plan, accum: int, step: int, scheds):
    """``(hypers, scale)`` of the first dispatch at ``step``: the hyperparameter vector (the
    schedules' row, else ``plan``'s base vector) and ``1/accum``, placed as the loop places them."""
    if scheds is not None:
        return scheds.hypers(step), scheds.scale
    dist = plan.sharded_dist
    scale = jax.device_put(np.float32(1.0 / accum))
    if dist is not None:
        scale = dist.replicate(scale)
    base = plan.opt_spec.base
    if plan.bindings.opt:  # scheduled: a host row per step
        return base, scale
    vector = jax.device_put(base)
    return (dist.replicate(vector) if dist is not None else vector), scale


@jax.jit
def _zeros_like(leaves):
    """Zeros shaped, placed and committed as a jitted function's outputs over ``leaves`` are
    (an uncommitted input gives an uncommitted output: a jit cache key of its own)."""
    return [jax.numpy.zeros_like(x) for x in leaves]


def first_step(plan, settings, state, device_values: dict, train, scheds=None) -> FirstStep:
    """The first optimizer step of a handle (its ``plan``, ``settings``, ``state``,
    ``device_values`` and ``train`` split) as the loop will dispatch it.

    ``scheds`` (the run's :class:`~jaxnitro.dispatch.StepValues`: hyperparameters, Device
    values, scale) is the loop's, when it asks; without it the same avals are rebuilt from
    the handle's values.
    """
    dist = plan.sharded_dist
    device = (dist.devices[0] if dist is not None else None) or jax.devices()[0]
    p, s, o = state.leaves()
    batch = _first_batch(plan, train, state.rng)
    common = dict(device=device, n_devices=dist.n_devs if dist is not None else 1, params=p, model_state=s, opt_state=o,
                  batch={k: v for k, v in batch.items() if k not in (KEY_DATA, KEY_COUNT)})
    if settings.steps_per_dispatch != "auto" and settings.steps_per_dispatch > 1:  # "auto" starts at 1
        return FirstStep(note="steps_per_dispatch > 1: the block program is compiled at its first dispatch", **common)
    step_prog = plan.programs.train_step(plan.opt_spec, plan.tx, jax.tree_util.tree_structure(state.opt_state))
    hypers, scale = _hypers_and_scale(plan, settings.accum, state.step, scheds)
    dev = _dev_values(plan, device_values, state.step, scheds)
    programs, acc = [], None
    if settings.accum > 1:
        programs.append(StepProgram("accumulate", plan.programs.accumulate().jitted, (p, s, dev, batch, None),
                                    settings.accum - 1))
        acc = _zeros_like(p)  # as accumulate returns them: its signature is the first train step's
    programs.append(StepProgram("train_step", step_prog.jitted, (p, s, o, dev, batch, acc, scale, hypers)))
    return FirstStep(programs=tuple(programs), **common)


def preflight(nitro, make_step: Callable[[], FirstStep], *, refuse: bool = True, required: bool = False):
    """The ``jaxnitro_preflight`` answer for a handle's first step (``make_step()``: see
    :func:`first_step`; called only when a plugin implements the hook, so nothing is built
    otherwise), or None when none does. ``nitro`` is only handed on: it is the hook's argument.
    With ``required`` (``jn.memory_report``) no answer is a ``RuntimeError`` naming the
    ``memory_preflight`` plugin."""
    if plugin_manager().hook.jaxnitro_preflight.get_hookimpls():
        report = first_result("jaxnitro_preflight", nitro=nitro, step=make_step(), refuse=refuse)
        if report is not None or not required:
            return report
    elif not required:
        return None
    raise RuntimeError(
        f"jaxnitro: no plugin answers the memory preflight (hook `jaxnitro_preflight`){disabled_note()}. "
        f"Enable the built-in `memory_preflight` plugin, or install one that answers the hook."
    )
