"""The memory preflight: the train program compiled ahead of time, its figures per device.

:func:`preflight` lowers and compiles the first optimizer step's programs
(``jax.jit(...).lower(args).compile()``) with the arguments the loop's first dispatch
passes: the handle's own state leaves and Device values, the train split's first batch
staged as the loop stages it, the run's hyperparameters and ``1/accum``. JAX keeps the
traced and compiled program for that signature, so the first step compiles nothing again
(one trace in ``cache_stats()``). The :class:`MemoryReport` holds, for one device:

* ``params``, ``opt_state``, ``model_state``, ``batch``: the arrays' bytes on that device
  (a sharded array counts its shard: ``sharding.shard_shape``);
* ``temp``: XLA's temporary buffers of the step (``memory_analysis().temp_size_in_bytes``,
  the largest over the compiled programs);
* ``needed``: what the step holds at once, ``arguments + outputs - aliased (donated) +
  temp`` from ``memory_analysis()``, the largest over the programs;
* ``capacity``: ``device.memory_stats()["bytes_limit"]`` where JAX knows it (GPU, TPU),
  else None ("unknown": a CPU);
* ``flops_per_step``: XLA's ``cost_analysis()["flops"]`` of one optimizer step (the train
  step plus ``accum - 1`` accumulate programs), per device; what throughput's MFU uses.

A step that needs more than the capacity is refused (:class:`WontFitError`, a
``MemoryError``) before it runs, naming the knobs that help.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import jax
import numpy as np

from .batches import peek
from .evaluation import make_transfer
from .routing import KEY_COUNT, KEY_DATA

__all__ = ["MemoryReport", "WontFitError", "preflight", "per_device_bytes", "device_capacity"]

TRAIN_HOOKS = ("forward", "loss", "train_metrics", "train_step")


class WontFitError(MemoryError):
    """The train step needs more memory per device than the device has."""


@dataclass(frozen=True)
class MemoryReport:
    """One device's memory for the train step (bytes; see the module docstring)."""

    device: str
    n_devices: int
    params: int
    opt_state: int
    model_state: int
    batch: int
    temp: int | None
    needed: int | None
    capacity: int | None
    flops_per_step: float | None
    programs: tuple[str, ...] = ()
    settings: dict = field(default_factory=dict)
    note: str = ""

    @property
    def fits(self) -> bool | None:
        """Whether ``needed`` is within ``capacity``; None when either is unknown."""
        if self.capacity is None or self.needed is None:
            return None
        return self.needed <= self.capacity

    def rows(self) -> list[tuple[str, str]]:
        """``(what, figure)`` rows, as ``print(nitro)`` and ``str(report)`` show them."""
        out = [
            ("parameters", _mib(self.params)),
            ("optimizer state", _mib(self.opt_state)),
        ]
        if self.model_state:
            out.append(("model state", _mib(self.model_state)))
        out += [
            ("batch (one micro-batch)", _mib(self.batch)),
            ("temporaries (XLA)", _mib(self.temp) if self.temp is not None else f"not measured ({self.note})"),
            ("step needs (args + outputs - donated + temp)", _mib(self.needed) if self.needed is not None else "unknown"),
            ("device capacity", _mib(self.capacity) if self.capacity is not None else "unknown (JAX reports no memory limit for this device)"),
        ]
        if self.fits is not None:
            out.append(("fits", f"yes ({self.needed / self.capacity:.0%} of the device)" if self.fits
                        else f"NO ({self.needed / self.capacity:.0%} of the device)"))
        if self.flops_per_step is not None:
            out.append(("FLOPs per step (XLA cost analysis)", f"{self.flops_per_step:.4g}"))
        return out

    def __str__(self) -> str:
        knobs = ", ".join(f"{k}={v!r}" for k, v in self.settings.items())
        head = f"memory per device ({self.device}, {self.n_devices} device{'s' if self.n_devices != 1 else ''}; {knobs})"
        width = max(len(w) for w, _ in self.rows())
        return "\n".join([head] + [f"  {w.ljust(width)}  {v}" for w, v in self.rows()])


def _mib(n: int | None) -> str:
    """``n`` bytes in the largest binary unit below it, and exactly: ``1.50 MiB (1,572,864 bytes)``."""
    if n is None:
        return "unknown"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.2f} {unit} ({n:,} bytes)"
    return f"{n:,} bytes"


def per_device_bytes(tree, device=None) -> int:
    """Bytes of ``tree``'s arrays held by one device: a ``jax.Array``'s shard on it
    (``sharding.shard_shape``; 0 when it holds none), a host (NumPy) array whole."""
    total = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        if isinstance(leaf, jax.Array):
            sharding = leaf.sharding
            if device is not None and device not in sharding.device_set:
                continue
            total += math.prod(sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
        elif hasattr(leaf, "nbytes"):
            total += int(leaf.nbytes)
    return total


def device_capacity(device) -> int | None:
    """The device's memory limit in bytes, where JAX knows it (``memory_stats()["bytes_limit"]``)."""
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - a backend without memory statistics
        stats = None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"])


def _first_batch(nitro) -> dict:
    """A train batch (zeros of the first batch's fields, which setup recorded: the source is not
    read again, a stream not restarted), staged as the loop stages a one-step dispatch."""
    plan = nitro.plan
    train = nitro.data["train"]
    specs = getattr(train, "first_batch_spec", None)
    if specs is None:
        first = peek(train)
    else:
        first = {f: np.zeros((plan.width, *shape), dtype) for f, (shape, dtype) in specs.items()}
    batch = make_transfer(plan, TRAIN_HOOKS)(first)
    if any(plan.routes[h].wants_key for h in TRAIN_HOOKS if h in plan.routes):
        batch = {**batch, KEY_DATA: nitro.state.rng, KEY_COUNT: np.uint32(0)}
    return batch


def _dev_values(nitro, scheds) -> dict:
    if scheds is not None:
        return scheds.dev(nitro.device_values, nitro.step)
    dev = dict(nitro.device_values)
    for name in nitro.plan.bindings.device:  # a scheduled field arrives as a host scalar per step
        dev[name] = np.zeros((), np.dtype(dev[name].dtype))[()]
    return dev


def _hypers_and_scale(nitro, scheds):
    dist = nitro.plan.dist if nitro.plan.dist is not None and nitro.plan.dist.sharded else None
    scale = jax.device_put(np.float32(1.0 / nitro.settings.accum))
    if dist is not None:
        scale = dist.replicate(scale)
    if scheds is not None:
        return scheds.hypers(nitro.step), scale
    base = nitro.plan.opt_spec.base_vector(nitro.plan.base_lr)
    if nitro.plan.bindings.opt:  # scheduled: a host row per step
        return base, scale
    vector = jax.device_put(base)
    return (dist.replicate(vector) if dist is not None else vector), scale


def _stats(compiled) -> tuple[int, int, float | None]:
    """``(temp bytes, bytes the program holds at once, flops)`` of a compiled program."""
    m = compiled.memory_analysis()
    temp = int(m.temp_size_in_bytes)
    needed = int(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + temp
                 + m.generated_code_size_in_bytes)
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    flops = float(cost["flops"]) if cost and "flops" in cost else None
    return temp, needed, flops


@jax.jit
def _zeros_like(leaves):
    """Zeros shaped, placed and committed as a jitted function's outputs over ``leaves`` are
    (an uncommitted input gives an uncommitted output: a jit cache key of its own)."""
    return [jax.numpy.zeros_like(x) for x in leaves]


def preflight(nitro, scheds=None, scale=None, *, refuse: bool = True) -> MemoryReport:
    """Compile ``nitro``'s first optimizer step ahead of time and report its memory per device.

    ``scheds`` (the run's :class:`~jaxnitro.schedules.StepValues`) and ``scale`` are the
    loop's, when it calls this; without them the same avals are rebuilt from the handle.
    With ``refuse`` a step needing more than a known capacity raises :class:`WontFitError`.
    """
    plan, settings, state = nitro.plan, nitro.settings, nitro.state
    dist = plan.dist if plan.dist is not None and plan.dist.sharded else None
    device = (dist.devices[0] if dist is not None else None) or jax.devices()[0]
    p, s, o = state.leaves()
    batch = _first_batch(nitro)
    arrays = dict(
        params=per_device_bytes(p, device), opt_state=per_device_bytes(o, device),
        model_state=per_device_bytes(s, device),
        batch=per_device_bytes({k: v for k, v in batch.items() if k not in (KEY_DATA, KEY_COUNT)}, device),
    )
    shown = dict(precision=settings.precision, remat=settings.remat, accum=settings.accum, batch=plan.width)
    n_devices = dist.n_devs if dist is not None else 1
    capacity = device_capacity(device)
    common = dict(device=f"{device.platform}:{device.id} {device.device_kind}", n_devices=n_devices,
                  capacity=capacity, settings=shown, **arrays)
    if settings.steps_per_dispatch != "auto" and settings.steps_per_dispatch > 1:  # "auto" starts at 1
        note = "steps_per_dispatch > 1: the block program is compiled at its first dispatch"
        return MemoryReport(temp=None, needed=None, flops_per_step=None, note=note, **common)
    o_def = jax.tree_util.tree_structure(state.opt_state)
    progs = plan.programs
    step_prog = progs.train_step(plan.opt_spec, plan.tx, o_def)
    hypers, own_scale = _hypers_and_scale(nitro, scheds)
    scale = own_scale if scale is None else scale
    dev = _dev_values(nitro, scheds)
    acc, figures, names = None, [], []
    if settings.accum > 1:
        compiled = progs.accumulate().jitted.lower(p, s, dev, batch, None).compile()
        temp, needed, flops = _stats(compiled)
        figures.append((temp, needed, None if flops is None else flops * (settings.accum - 1)))
        names.append("accumulate")
        acc = _zeros_like(p)  # as accumulate returns them: its signature is the first train step's
    compiled = step_prog.jitted.lower(p, s, o, dev, batch, acc, scale, hypers).compile()
    figures.append(_stats(compiled))
    names.append("train_step")
    flops = None if any(f[2] is None for f in figures) else sum(f[2] for f in figures)
    report = MemoryReport(temp=max(f[0] for f in figures), needed=max(f[1] for f in figures),
                          flops_per_step=flops, programs=tuple(names), **common)
    if refuse and report.fits is False:
        raise WontFitError(_refusal(nitro, report))
    return report


def _refusal(nitro, r: MemoryReport) -> str:
    s = nitro.settings
    helps = []
    if s.precision == "float32":
        helps.append('precision="bfloat16" (activations, batch and temporaries in half the bytes; '
                     'the float32 master weights and optimizer state stay)')
    if r.n_devices > 1:
        helps.append(f'sharding="fsdp" (parameters and optimizer state, now {_mib(r.params + r.opt_state)}, '
                     f'split over the {r.n_devices} devices)')
    else:
        helps.append("more devices with sharding=\"fsdp\" (parameters and optimizer state split over them)")
    if s.remat is False:
        helps.append(f"remat=True or a policy such as remat=\"dots_saveable\" (temporaries, now {_mib(r.temp)}, "
                     f"recomputed in the backward pass instead of kept)")
    helps.append(f"accum=N with train batches N times smaller (the same optimizer step in N micro-batches; "
                 f"accum is {s.accum})")
    helps.append(f"a smaller batch (the train split's batches have {nitro.plan.width} rows)")
    return (
        f"jaxnitro: the train step of {type(nitro.experiment).__name__} needs {_mib(r.needed)} per device "
        f"(parameters {_mib(r.params)}, optimizer state {_mib(r.opt_state)}, batch {_mib(r.batch)}, "
        f"temporaries {_mib(r.temp)}), but {r.device} has {_mib(r.capacity)}. Refused before the first "
        f"step. What helps: " + "; ".join(helps) + ". `jn.memory_report(e, **knobs)` shows the figures "
        f"for a setting without training."
    )


# memory_report(experiment, **knobs), the verb that builds a handle for the preflight, is in
# jaxnitro.handle (next to train): this module is below the handle.
