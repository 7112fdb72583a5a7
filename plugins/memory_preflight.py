"""The memory preflight: the train step compiled ahead of time, its figures per device.

Entry point ``memory_preflight``; it answers ``jaxnitro_preflight`` (``trylast``: an
installed plugin answering the hook wins) and exports ``jn.MemoryReport`` and ``jn.WontFitError``. The core
asks the hook before the first step of a run and for ``jn.memory_report(e, **knobs)``, with
the first optimizer step as the loop dispatches it (:class:`jaxnitro.plugin.FirstStep`: its
programs with their first arguments, the device and the mesh's device count); this plugin
reads the device's capacity (:func:`device_capacity`). It lowers and
compiles those programs (``jitted.lower(*args).compile()``): JAX keeps the traced and compiled
program for that signature, so the first step compiles nothing again (one trace in
``cache_stats()``). The :class:`MemoryReport` holds, for one device:

* ``params``, ``opt_state``, ``model_state``, ``batch``: the arrays' bytes on that device
  (a sharded array counts its shard: ``sharding.shard_shape``);
* ``temp``: XLA's temporary buffers of the step (``memory_analysis().temp_size_in_bytes``,
  the largest over the compiled programs);
* ``needed``: what the step holds at once, ``arguments + outputs - aliased (donated) +
  temp`` from ``memory_analysis()``, the largest over the programs;
* ``capacity``: ``device.memory_stats()["bytes_limit"]`` where JAX knows it (GPU, TPU),
  else None ("unknown": a CPU);
* ``flops_per_step``: XLA's ``cost_analysis()["flops"]`` of one optimizer step (the train
  step plus ``accum - 1`` accumulate programs), per device; what the throughput plugin's MFU
  reads (through ``nitro.plan.memory``, where the core keeps the report).

A step that needs more than the capacity is refused (:class:`WontFitError`, a
``MemoryError``) before it runs, naming the knobs that help. Disabled
(``JAXNITRO_DISABLE_PLUGINS=memory_preflight``), runs start without a preflight (no ``memory per
device`` band, no ``flops_per_step``) and ``jn.memory_report`` says no plugin answers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import jax

from jaxnitro.plugin import hookimpl

__all__ = ["MemoryReport", "WontFitError", "device_capacity", "preflight", "per_device_bytes"]


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


def device_capacity(device) -> int | None:
    """The device's memory limit in bytes, where JAX knows it (``memory_stats()["bytes_limit"]``)."""
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - a backend without memory statistics
        stats = None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"])


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


def preflight(nitro, step, *, refuse: bool = True) -> MemoryReport:
    """Compile ``step``'s programs (a :class:`jaxnitro.plugin.FirstStep` of ``nitro``) ahead of
    time and report their memory per device. With ``refuse`` a step needing more than a known
    capacity raises :class:`WontFitError`."""
    settings, device = nitro.settings, step.device
    common = dict(
        device=f"{device.platform}:{device.id} {device.device_kind}", n_devices=step.n_devices,
        capacity=device_capacity(device), params=per_device_bytes(step.params, device),
        opt_state=per_device_bytes(step.opt_state, device), model_state=per_device_bytes(step.model_state, device),
        batch=per_device_bytes(step.batch, device),
        settings=dict(precision=settings.precision, remat=settings.remat, accum=settings.accum, batch=nitro.plan.width),
    )
    if not step.programs:
        return MemoryReport(temp=None, needed=None, flops_per_step=None, note=step.note, **common)
    figures = []
    for prog in step.programs:
        temp, needed, flops = _stats(prog.jitted.lower(*prog.args).compile())
        figures.append((temp, needed, None if flops is None else flops * prog.runs))
    flops = None if any(f[2] is None for f in figures) else sum(f[2] for f in figures)
    report = MemoryReport(temp=max(f[0] for f in figures), needed=max(f[1] for f in figures),
                          flops_per_step=flops, programs=tuple(p.name for p in step.programs), **common)
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


@hookimpl(trylast=True)
def jaxnitro_preflight(nitro, step, refuse):
    return preflight(nitro, step, refuse=refuse)


@hookimpl
def jaxnitro_exports():
    return {"MemoryReport": MemoryReport, "WontFitError": WontFitError}
