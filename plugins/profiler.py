"""The profiler: ``profile=(start_step, n_steps)`` traces those optimizer steps with ``jax.profiler``.

Entry point ``profiler``. It accepts the ``profile`` run knob at setup and, during
``train()``, writes one ``jax.profiler`` trace of optimizer steps ``start_step`` ..
``start_step + n_steps - 1`` (steps count from 1, as ``nitro.step`` does) into
``<run folder>/profile/``: ``plugins/profile/<timestamp>/<host>.xplane.pb`` (what
TensorBoard's profile plugin reads: ``tensorboard --logdir <run folder>/profile``),
``<host>.trace.json.gz`` (Chrome trace JSON) and ``perfetto_trace.json.gz`` (open it at
ui.perfetto.dev).

How: it answers ``jaxnitro_step_period`` with ``(start_step - 1, start_step - 1 + n_steps)``,
so the loop ends a dispatch at both steps; at the first ``jaxnitro_step_boundary`` (every
step before the window read) it starts the trace and sets ``run.step_annotation``, so each
dispatch inside the window runs in ``jax.profiler.StepTraceAnnotation("train",
step_num=<its first step>)`` (a block of ``steps_per_dispatch`` steps is one annotation);
at the second it waits for the device (``jax.block_until_ready`` on the state) and stops
the trace. A window starting at the run's first step starts the trace at run start (it then
holds the first step's compilation too). A run that ends inside the window (early stopping,
divergence, Ctrl-C, an error) stops the trace at ``jaxnitro_run_finish``, so what was traced
is written whatever the status. A validation due at the window's last step runs before the
trace stops and is in it.

In a multi-process job only process 0 traces. Nothing here is part of a compiled program:
profiling compiles nothing and, outside the window, costs the loop nothing.
"""

from __future__ import annotations

import numbers
import os

import jax

from jaxnitro.plugin import hookimpl, owns_knob

__all__ = ["PROFILE_FOLDER", "check_profile", "trace_files"]

PROFILE_FOLDER = "profile"
"""The folder of the run folder that traces are written into (``jax.profiler``'s log dir)."""


def _whole(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def check_profile(value, source: str = "keyword") -> tuple[int, int]:
    """``(start_step, n_steps)`` from the ``profile`` knob's value: a pair (tuple or list) of
    whole numbers, ``start_step >= 1`` (optimizer steps count from 1) and ``n_steps >= 1``.
    ``TypeError`` / ``ValueError`` naming the knob, its source and the fix otherwise."""
    head = f"jaxnitro: run knob `profile` = {value!r} ({source}); "
    if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list)) or len(value) != 2:
        raise TypeError(
            head + "give `profile=(start_step, n_steps)`: trace optimizer steps start_step .. "
            "start_step + n_steps - 1, e.g. `profile=(100, 10)`; or None for no trace."
        )
    start, n = value
    if not (_whole(start) and _whole(n)):
        raise TypeError(
            head + "start_step and n_steps must be whole numbers (optimizer steps), e.g. "
            "`profile=(100, 10)`."
        )
    if start < 1 or n < 1:
        raise ValueError(
            head + "start_step must be >= 1 (optimizer steps count from 1) and n_steps >= 1 "
            "(the steps traced), e.g. `profile=(100, 10)` traces steps 100..109."
        )
    return int(start), int(n)


def _run_total(nitro) -> int | None:
    """The last step ``nitro``'s run takes: the smaller of ``max_steps`` and ``max_epochs`` x
    steps per epoch (a stream without ``len()`` has only the first); None if neither is set."""
    settings, bounds = nitro.settings, []
    if settings.max_steps is not None:
        bounds.append(int(settings.max_steps))
    try:
        per_epoch = len(nitro.data["train"]) // settings.accum
    except TypeError:  # a stream without len()
        per_epoch = None
    if settings.max_epochs is not None and per_epoch is not None:
        bounds.append(int(settings.max_epochs) * per_epoch)
    return min(bounds) if bounds else None


@hookimpl(trylast=True)
def jaxnitro_accept_knob(name, value, nitro):
    """Take the ``profile`` knob: a window of steps after the handle's step, within the run."""
    if name != "profile":
        return None
    source = nitro.settings.source("profile")
    start, n = check_profile(value, source)
    if "train" in nitro.data:
        last, total, done = start + n - 1, _run_total(nitro), int(nitro.step)
        if start <= done:
            raise ValueError(
                f"jaxnitro: run knob `profile` = {value!r} ({source}) traces steps {start}..{last}, "
                f"but this handle starts at step {done} (it resumes a run that took steps "
                f"1..{done}). Choose a start_step after {done}, e.g. `profile=({done + 1}, {n})`."
            )
        if total is not None and last > total:
            s = max(done + 1, total - n + 1)
            example = f", e.g. `profile=({s}, {min(n, total - s + 1)})`" if s <= total else ""
            raise ValueError(
                f"jaxnitro: run knob `profile` = {value!r} ({source}) traces steps {start}..{last}, "
                f"but the run ends at step {total} (max_steps, or max_epochs x steps per epoch), so "
                f"the trace would miss steps. Choose a window inside steps {done + 1}..{total}"
                f"{example}, or train longer."
            )
    return True


def trace_files(run_dir) -> list[str]:
    """The trace files under ``<run_dir>/profile`` (``*.xplane.pb``, ``*.trace.json.gz``,
    ``perfetto_trace.json.gz``), sorted; empty when the run wrote none."""
    found = []
    for root, _, names in os.walk(os.path.join(os.fspath(run_dir), PROFILE_FOLDER)):
        found += [os.path.join(root, f) for f in names if f.endswith((".xplane.pb", ".json.gz"))]
    return sorted(found)


def _annotation(step: int):
    return jax.profiler.StepTraceAnnotation("train", step_num=step)


class _Window:
    """One run's trace of steps ``first .. last``, started after step ``begin`` (``first - 1``)."""

    def __init__(self, run, first: int, last: int, begin: int):
        self.run, self.first, self.last, self.begin = run, first, last, begin
        self.folder = os.path.join(run.run_dir, PROFILE_FOLDER)
        self.tracing = False

    def start(self) -> None:
        os.makedirs(self.folder, exist_ok=True)
        try:
            jax.profiler.start_trace(self.folder, create_perfetto_trace=True)
        except RuntimeError as err:  # a trace of the user's is running: jax allows one at a time
            raise RuntimeError(
                f"jaxnitro: run knob `profile` = ({self.first}, {self.last - self.first + 1}) cannot "
                f"start its trace: {err}. jax traces one thing at a time in a process; stop the "
                f"other trace (jax.profiler.stop_trace()) before train(), or set `profile=None`."
            ) from err
        self.tracing = True
        self.run.step_annotation = _annotation

    def stop(self) -> None:
        if not self.tracing:
            return
        self.tracing = False
        self.run.step_annotation = None
        try:
            jax.block_until_ready(self.run.nitro.state.leaves())  # the window's steps computed
        except RuntimeError:  # a dispatch that failed deleted its donated buffers: nothing to wait for
            pass
        finally:
            jax.profiler.stop_trace()


def _main_process(run) -> bool:
    dist = getattr(run.nitro.plan, "dist", None)
    return dist is None or dist.is_main


@hookimpl(trylast=True)
def jaxnitro_run_start(run):
    """Plan the run's window (starting the trace now when it starts at the run's first step).

    A handle trains once, from the step its setup saw, so the window accepted at setup lies
    ahead of the run."""
    value = run.settings.profile
    if value is None or not owns_knob(run, "profile", __name__) or not _main_process(run):
        return  # not profiled, or another plugin took the knob (it applies it)
    start, n = check_profile(value, run.settings.source("profile"))
    w = run.store(__name__)["window"] = _Window(run, start, start + n - 1, start - 1)
    if w.begin <= run.start_step:
        w.start()


def _window(run):
    return run.store(__name__).get("window")


@hookimpl(trylast=True)
def jaxnitro_step_period(run):
    w = _window(run)
    return None if w is None else (w.begin, w.last)


@hookimpl(trylast=True)
def jaxnitro_step_boundary(run, step, epoch):
    w = _window(run)
    if w is None:
        return
    if step == w.begin and not w.tracing:
        w.start()
    elif step == w.last:
        w.stop()


@hookimpl(trylast=True)
def jaxnitro_run_finish(run, status):
    """Stop a trace the run ended inside (any status), so what was traced is written."""
    w = _window(run)
    if w is not None:
        w.stop()
