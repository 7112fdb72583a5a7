"""Throughput: steps/s, samples (or tokens) per second, FLOPs per step and MFU, per history row.

Entry point ``throughput``. Measured, not estimated. The loop takes a timestamp whenever it
reads a stretch of finished steps back from the device and says so in the stretch
(:class:`jaxnitro.StepStretch`: ``since``, ``read_at``, ``fetched``); this plugin turns those
into the device-bound seconds of each history row: the time between consecutive reads is
shared among the steps the later read found finished. The loop's clock restarts when it
dispatches again after the device went idle (validation, a checkpoint, an event), so those
pauses are not counted; nothing is synchronised per step, and nothing here runs per step.

Per row (``nitro.record.throughput``, ``nitro.history(throughput=True)``, and a
``throughput`` line to the loggers at the row's end, which the ``logger_relay`` plugin sends):

* ``steps_per_sec``: optimizer steps of this run in the row / their seconds;
* ``<unit>_per_sec`` (``samples_per_sec``, ``tokens_per_sec``, ...): when the experiment
  defines ``samples_per_batch`` (an ``int``, or ``{unit: count}``): ``steps_per_sec x accum
  x count`` (the count is per train batch of the whole job);
* ``flops_per_step``: XLA's ``cost_analysis()`` of the compiled step, per device (from the
  memory preflight's report, kept with the programs: ``nitro.plan.memory``);
  ``flops_per_sec`` = that x ``steps_per_sec``;
* ``mfu``: ``flops_per_sec`` / the device's peak, from the ``device_peak_flops`` knob (this
  plugin accepts it) or, under ``precision="bfloat16"``, the known dense bfloat16 peak of a
  few accelerators (:data:`KNOWN_BF16_PEAKS`); absent when no peak is known (a CPU, float32
  without the knob).

The figures of a row are closed at ``jaxnitro_row_closed`` (every step of the row read), so
they are in ``nitro.record.throughput`` before ``jaxnitro_epoch_end`` reaches the loggers. The
per-run state (the units, the steps read and not yet given to a row) lives in ``run.store``.
Disabled (``JAXNITRO_DISABLE_PLUGINS=throughput``), a run trains the same and has no
throughput figures; ``device_peak_flops`` is then refused at setup, naming this plugin.
"""

from __future__ import annotations

import math
import numbers

import jax

from jaxnitro.plugin import hookimpl, owns_knob

__all__ = ["KNOWN_BF16_PEAKS", "Meter", "check_peak", "peak_flops", "samples_per_batch"]

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


def check_peak(value, source: str) -> float:
    """The ``device_peak_flops`` knob as a float; ``ValueError`` naming the knob, its source and
    the fix unless it is a finite number > 0."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value)
            or value <= 0):
        raise ValueError(
            f"jaxnitro: run knob `device_peak_flops` = {value!r} ({source}); give one device's peak "
            f"FLOP/s at the run's precision as a number > 0 (e.g. 989e12 for an H100's bfloat16 "
            f"dense peak), or None to use the known peak of the device, if any."
        )
    return float(value)


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
    hook = nitro.hooks.get("samples_per_batch")
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
    """The device-bound seconds of one run's open history row, from the loop's read times.

    ``read(stretch)`` files the stretch's steps with the seconds each is given;
    ``close(epoch, step)`` sums those up to ``step`` into the row's figures.
    """

    def __init__(self, run):
        self.nitro = nitro = run.nitro
        self.units = samples_per_batch(nitro)
        # the knob is applied only when this plugin accepted it (another may have taken it)
        self.peaked = nitro.settings.device_peak_flops is None or owns_knob(run, "device_peak_flops", __name__)
        self.spans: list[list] = []  # [first step, last step, seconds each] read, not yet in a row

    def read(self, stretch) -> None:
        """A read found ``stretch.fetched`` steps finished since ``stretch.since``: each step is
        given an equal share of the time; the stretch's steps are kept for their rows."""
        since, now, n = stretch.since, stretch.read_at, stretch.fetched or len(stretch)
        each = (now - since) / n if since is not None and now is not None and n else 0.0
        if len(stretch):
            self.spans.append([stretch.first_step, stretch.first_step + len(stretch) - 1, each])

    def close(self, epoch: int, step: int) -> dict | None:
        """The figures of the row ending at ``step`` (None when none of its steps was timed);
        the steps after it stay for the next row."""
        steps, seconds = 0, 0.0
        while self.spans and self.spans[0][0] <= step:
            first, last, each = self.spans[0]
            upto = min(last, step)
            steps, seconds = steps + upto - first + 1, seconds + (upto - first + 1) * each
            if upto == last:
                self.spans.pop(0)
            else:
                self.spans[0][0] = upto + 1
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
            peak = peak_flops(nitro.settings, device) if self.peaked else None
            if peak:
                out["mfu"] = flops * sps / peak
        return out


def _meter(run) -> Meter | None:
    return run.store(__name__).get("meter")


@hookimpl(trylast=True)
def jaxnitro_accept_knob(name, value, nitro):
    """Take the ``device_peak_flops`` knob (the denominator of MFU), a number > 0."""
    if name != "device_peak_flops":
        return None
    check_peak(value, nitro.settings.source("device_peak_flops"))
    return True


@hookimpl
def jaxnitro_run_start(run):
    run.store(__name__)["meter"] = Meter(run)  # asks samples_per_batch once per train()


@hookimpl
def jaxnitro_steps_read(run, stretch):
    meter = _meter(run)
    if meter is not None:
        meter.read(stretch)


@hookimpl
def jaxnitro_row_closed(run, row):
    meter = _meter(run)
    if meter is None:
        return
    figures = meter.close(row["epoch"], row["step"])
    if figures is not None:
        run.nitro.record.throughput.append(figures)
