"""The objects the lifecycle events carry: a :class:`RunContext` is what a plugin sees of a
run; a :class:`StepStretch` is one stretch of read optimizer steps; :func:`run_scoped`
registers plugins for one run. The events are emitted by :func:`jaxnitro.hookcalls.emit`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

from .batches import is_sized
from .plugin_manager import plugin_manager

__all__ = ["RunContext", "StepStretch", "run_scoped"]


@dataclass
class RunContext:
    """One ``train()`` as plugins see it.

    - ``nitro``: the handle (its data, hooks, state and history rows);
    - ``run_dir``: the run's own folder (absolute ``str``, created);
    - ``settings``: the resolved run knobs (:class:`jaxnitro.Settings`);
    - ``loggers``: the run's logger objects, in the order they were made;
    - ``stop_reason``: set by :meth:`request_stop`;
    - ``run_state``: set by the loop (None before): the run's changing state, a :class:`jaxnitro.plugin.RunState`;
      ``run_state.snapshot()`` (a :class:`jaxnitro.plugin.SavedRun`) is what a checkpoint serializes;
    - ``time_limit_reached``: set when ``max_time`` ended the run;
    - ``horizon``: set by the loop: the optimizer steps the schedules are planned over (a
      checkpoint records it, for the horizon rule of a resumed run);
    - ``chosen_k``, ``step_seconds``: set by the loop when ``steps_per_dispatch="auto"``
      chose ``k`` from the step time it measured (seconds a step at ``k = 1``);
    - ``start_step``: the optimizer step the run starts from (0 for a fresh handle);
    - ``resumed_step``: that step when the run continues an existing run folder, else None.
    - ``error``: the exception that failed the run (set by the loop, or by
      :func:`emit_finish` when a plugin fails to finish a run that was ``"done"``), else None.
    - ``step_annotation``: None, or set by a plugin (the profiler): a callable ``step ->
      context manager`` that the loop enters around each dispatch of the segments it starts
      from then on (``step`` is the dispatch's first optimizer step), e.g.
      ``lambda s: jax.profiler.StepTraceAnnotation("train", step_num=s)``; None again stops it.
    """

    nitro: object
    run_dir: str
    loggers: list = field(default_factory=list)
    stop_reason: str | None = None
    run_state: object = None
    time_limit_reached: bool = False
    horizon: int | None = None
    chosen_k: int | None = None
    step_seconds: float | None = None
    error: BaseException | None = None
    start_step: int = field(init=False, default=0)
    _stores: dict = field(init=False, default_factory=dict, repr=False)
    step_annotation: object = None

    def __post_init__(self):
        self.start_step = int(getattr(self.nitro, "step", 0) or 0)

    def store(self, key: str) -> dict:
        """This run's dict for the plugin state filed under ``key`` (by convention the plugin's
        module name, ``__name__``): the same dict at every hook of the run, gone with the run.
        It replaces module globals keyed by ``id(run)``, which outlive a run that fails
        before its finish and can be reused by a later run's id."""
        return self._stores.setdefault(str(key), {})

    @property
    def resumed_step(self) -> int | None:
        """The step this run continues from when it continues an existing run folder, else None.

        A handle made with ``resume=`` from a checkpoint whose run folder it continues
        (``nitro.plan.resumed.continue_folder``) trains into that folder: its loggers find
        there what the interrupted run logged, possibly past this step (the checkpoint is older
        than the last logged line). Loggers use it (through the optional ``resume(step)`` verb,
        which the ``logger_relay`` plugin calls first) to continue their records without
        logging a step twice. It is the step the run starts from: the checkpoint's step
        (``resumed.step``) for the handle's first ``train()``, and the handle's step then for a
        later ``train()`` into the same folder. None for a new run folder (a fresh run, or a
        resume that branches into a new folder).
        """
        plan = getattr(self.nitro, "plan", None)
        resumed = getattr(plan, "resumed", None)
        if resumed is None or not resumed.continue_folder or not resumed.run_folder:
            return None
        if os.path.realpath(resumed.run_folder) != os.path.realpath(self.run_dir):
            return None
        return max(int(resumed.step), self.start_step)

    @property
    def settings(self):
        return self.nitro.settings

    @property
    def monitor(self) -> tuple[str, str] | None:
        """``(metric, "max" | "min")`` from the experiment's ``monitor`` hook, or None."""
        return self.nitro.settings.monitor

    @property
    def experiment(self):
        return self.nitro.experiment

    @property
    def steps_per_epoch(self) -> int | None:
        """Optimizer steps in one epoch (the train split's batches // ``accum``); None for a
        stream without ``len()``."""
        train = self.nitro.data["train"]
        return len(train) // self.nitro.settings.accum if is_sized(train) else None

    def request_stop(self, reason: str) -> None:
        """Ask the loop to end the run after this epoch (at ``jaxnitro_run_start``: before its first
        step), with status ``"done"``; the first request's reason is kept (``nitro.stop_reason``)."""
        if self.stop_reason is None:
            self.stop_reason = str(reason)


@dataclass(frozen=True)
class StepStretch:
    """Consecutive optimizer steps read back from the device.

    ``first_step`` is the step number of ``rows[0]``; ``rows[i]`` holds the
    values named by ``names`` (``loss`` first, then ``train_metrics``);
    ``epochs[i]`` is step ``first_step + i``'s epoch; ``schedules`` maps a
    varying schedule's log name (``schedule/<group>/<hyper>``,
    ``schedule/<field>``) to its per-step table, indexed by ``step - 1``.

    When the loop read it (``time.perf_counter()`` seconds; None when not known):
    ``read_at``, the read; ``since``, the previous read, or the dispatch that found the
    device idle (after a validation, an event) when that came later: the device computed
    the ``fetched`` steps the read took in between (``len(rows)``, or more when the read
    stopped at a non-finite step). The throughput plugin makes its rates from these.
    """

    first_step: int
    names: tuple[str, ...]
    rows: list[list[float]]
    epochs: list[int]
    schedules: dict = field(default_factory=dict)
    read_at: float | None = None
    since: float | None = None
    fetched: int | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def lines(self, every: int = 1) -> Iterator[tuple[int, int, dict]]:
        """``(step, epoch, {name: value})`` for the steps divisible by ``every``."""
        names, sched = self.names, self.schedules
        for i, row in enumerate(self.rows):
            step = self.first_step + i
            if step % every:
                continue
            line = dict(zip(names, row))
            for key, table in sched.items():
                line[key] = float(table[min(step - 1, len(table) - 1)])
            yield step, self.epochs[i], line


@contextlib.contextmanager
def run_scoped(plugins: list):
    """``with run_scoped(objs):`` registers ``objs`` as plugins for the block (a run's loggers)."""
    pm = plugin_manager()
    for p in plugins:
        pm.register(p, name=f"run-scoped-{id(p)}")
    try:
        yield
    finally:
        for p in plugins:
            if pm.is_registered(p):
                pm.unregister(p)
