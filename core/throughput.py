"""Throughput: steps/s, samples (or tokens) per second, FLOPs per step and MFU, per history row.

Measured, not estimated. The loop already takes a timestamp whenever it reads a stretch
of finished steps back from the device (:mod:`jaxnitro.reads`); a :class:`Meter` turns
those into the device-bound seconds of each history row: the time between consecutive
reads is shared among the steps the later read found finished. The clock restarts when
the loop dispatches again after the device went idle (validation, a checkpoint, an event),
so those pauses are not counted; nothing is synchronised per step.

Per row (``nitro.record.throughput``, ``nitro.history(throughput=True)``, and a
``throughput`` line to the loggers at the row's end):

* ``steps_per_sec``: optimizer steps of this run in the row / their seconds;
* ``<unit>_per_sec`` (``samples_per_sec``, ``tokens_per_sec``, ...): when the experiment
  defines ``samples_per_batch`` (an ``int``, or ``{unit: count}``): ``steps_per_sec x accum
  x count`` (the count is per train batch of the whole job);
* ``flops_per_step``: XLA's ``cost_analysis()`` of the compiled step, per device (from the
  memory preflight, :mod:`jaxnitro.memory`); ``flops_per_sec`` = that x ``steps_per_sec``;
* ``mfu``: ``flops_per_sec`` / the device's peak, from the ``device_peak_flops`` knob or,
  under ``precision="bfloat16"``, the known dense bfloat16 peak of a few accelerators
  (:data:`KNOWN_BF16_PEAKS`); absent when no peak is known (a CPU, float32 without the knob).
"""

from __future__ import annotations

import math
import numbers
import time

import jax

__all__ = ["Meter", "KNOWN_BF16_PEAKS", "peak_flops", "samples_per_batch"]

KNOWN_BF16_PEAKS = (
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("GH200", 989e12),
    ("A100", 312e12),
    ("L4", 121e12),
    ("TPU v4", 275e12),
    ("TPU v5 lite", 197e12),
    ("TPU v5p", 459e12),
    ("TPU v6 lite", 918e12),
)
"""``(substring of device_kind, dense bfloat16 FLOP/s)``, first match wins (vendors' data sheets,
without sparsity). Used only under ``precision="bfloat16"``; give ``device_peak_flops`` otherwise."""


def peak_flops(settings, device) -> float | None:
    """One device's peak FLOP/s: the ``device_peak_flops`` knob, else a known bfloat16 peak."""
    if settings.device_peak_flops is not None:
        return float(settings.device_peak_flops)
    if settings.precision != "bfloat16":
        return None
    kind = getattr(device, "device_kind", "")
    return next((peak for name, peak in KNOWN_BF16_PEAKS if name in kind), None)


def samples_per_batch(nitro) -> dict[str, float]:
    """``{unit: count per train batch}`` from the experiment's ``samples_per_batch`` hook ({} without it)."""
    hook = nitro.plan.hooks.get("samples_per_batch")
    if hook is None:
        return {}
    got = hook.function(nitro.experiment)
    units = {"samples": got} if isinstance(got, numbers.Real) and not isinstance(got, bool) else got
    if not isinstance(units, dict) or not units or not all(
        isinstance(k, str) and k.isidentifier() and isinstance(v, numbers.Real) and not isinstance(v, bool)
        and math.isfinite(v) and v > 0 for k, v in units.items()
    ):
        raise TypeError(
            f"jaxnitro: `samples_per_batch` of {type(nitro.experiment).__name__} returned {got!r}; "
            f"return the samples in one train batch as a number > 0 (logged as samples_per_sec), "
            f"or {{unit: count}} such as {{'tokens': 64 * 1024}} (logged as tokens_per_sec)."
        )
    return {k: float(v) for k, v in units.items()}


class Meter:
    """The device-bound seconds of the open history row, from the loop's read times."""

    def __init__(self, nitro):
        self.nitro = nitro
        self.units = samples_per_batch(nitro)
        self.t: float | None = None  # the last read (or the restart of the clock)
        self.seconds = 0.0  # of the open row's steps timed in this run
        self.steps = 0

    def restart(self) -> None:
        """The loop dispatches after the device was idle: the clock starts now."""
        self.t = time.perf_counter()

    def read(self, n: int) -> float:
        """A read found ``n`` steps finished: the seconds each of them is given."""
        now = time.perf_counter()
        t, self.t = self.t, now
        return (now - t) / n if t is not None and n else 0.0

    def step(self, seconds: float) -> None:
        self.seconds += seconds
        self.steps += 1

    def close(self, epoch: int, step: int) -> dict | None:
        """The figures of the row ending at ``step`` (None when none of its steps was timed),
        appended to ``nitro.record.throughput``; the next row starts from zero."""
        steps, seconds = self.steps, self.seconds
        self.steps, self.seconds = 0, 0.0
        if not steps or seconds <= 0:
            return None
        nitro = self.nitro
        sps = steps / seconds
        out = {"epoch": epoch, "step": step, "steps_per_sec": sps}
        for unit, count in self.units.items():
            out[f"{unit}_per_sec"] = sps * nitro.settings.accum * count
        memory = getattr(nitro.plan, "memory", None)
        flops = getattr(memory, "flops_per_step", None)
        if flops:
            out["flops_per_step"] = flops
            out["flops_per_sec"] = flops * sps
            dist = nitro.plan.dist
            device = dist.devices[0] if dist is not None and getattr(dist, "devices", None) else jax.devices()[0]
            peak = peak_flops(nitro.settings, device)
            if peak:
                out["mfu"] = flops * sps / peak
        nitro.record.throughput.append(out)
        return out
