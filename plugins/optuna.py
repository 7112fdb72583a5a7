"""Optuna: a pruning stop policy, ``jn.OptunaPruning(trial)``, and ``jn.optuna_objective``.

Entry point ``optuna`` (extra ``optuna``: ``pip install 'jaxnitro[optuna]'``). Optuna is
imported only when one of these is used, so the plugin loads without it.

``early_stop=jn.OptunaPruning(trial)`` reports the monitored metric of every validated
epoch to the trial (``trial.report(value, epoch)``) and, when ``trial.should_prune()``
says so, ends the run after that epoch with status ``"done"`` and ``nitro.stop_reason``
saying the trial was pruned; the objective then raises ``optuna.TrialPruned``
(``policy.raise_if_pruned()``), as Optuna's convention is.

``jn.optuna_objective(e, space, **knobs)`` is a whole objective: ``space(trial)`` returns a
point (Device fields, ``learning_rate``, ... as for ``jn.sweep``), the point is trained with
the pruning policy, and the best monitored value is returned. Device fields and the
learning rate are program inputs, so every trial after the first compiles nothing.

Host-side only: nothing here is part of a compiled program.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jaxnitro as jn
from jaxnitro.plugin import fields_of, hookimpl, is_experiment, monitored_value, owns_knob, require_monitor_and_val

__all__ = ["OptunaPruning", "optuna_objective"]

REPORT_STEPS = ("epoch", "step")


def _optuna():
    try:
        import optuna
    except ImportError:
        raise ImportError(
            "jaxnitro: the Optuna plugin needs optuna; install it with `pip install 'jaxnitro[optuna]'` "
            "(or `pip install optuna`)."
        ) from None
    return optuna


class OptunaPruning:
    """A stop policy for ``early_stop=``: report each validation to an Optuna trial, stop when pruned.

    At the end of every validated epoch the monitored metric (the experiment's ``monitor``)
    is reported with ``trial.report(value, step)``, ``step`` being the epoch
    (``report_step="epoch"``, the default) or the optimizer step (``"step"``, for runs that
    validate more than once an epoch). When ``trial.should_prune()`` is True the run ends
    after that epoch (status ``"done"``, ``nitro.stop_reason`` starting ``"optuna: trial N
    pruned"``); :attr:`pruned` is then True and :meth:`raise_if_pruned` raises
    ``optuna.TrialPruned``, which the objective lets through.

    ``early_stop``: another stop policy (``jn.EarlyStopping(patience=5)``) asked too, after
    the trial: the run also stops when it says so (not a pruning).

    The study's direction must agree with the monitor's mode (``"maximize"`` with
    ``"max"``); a mismatch is refused at setup.
    """

    def __init__(self, trial, *, report_step: str = "epoch", early_stop=None):
        if not callable(getattr(trial, "report", None)) or not callable(getattr(trial, "should_prune", None)):
            raise TypeError(
                f"jaxnitro: OptunaPruning({trial!r}): give the optuna.Trial the objective receives "
                f"(it has report() and should_prune())."
            )
        if report_step not in REPORT_STEPS:
            raise ValueError(
                f"jaxnitro: OptunaPruning(report_step={report_step!r}): report_step is 'epoch' (report "
                f"each validated epoch as step = epoch) or 'step' (step = optimizer step)."
            )
        if early_stop is not None and not callable(getattr(early_stop, "should_stop", None)):
            raise TypeError(
                f"jaxnitro: OptunaPruning(early_stop={early_stop!r}): give a stop policy with "
                f"`should_stop(epoch, value, mode) -> bool`, e.g. jn.EarlyStopping(patience=5), or None."
            )
        self.trial = trial
        self.report_step = report_step
        self.early_stop = early_stop
        self.pruned = False
        self.reason: str | None = None
        self.reported: list[tuple[int, float]] = []

    def reset(self) -> None:
        """Forget the record (a new run starts)."""
        self.pruned, self.reason, self.reported = False, None, []
        if callable(getattr(self.early_stop, "reset", None)):
            self.early_stop.reset()

    def raise_if_pruned(self) -> None:
        """Raise ``optuna.TrialPruned`` (with the stop reason) if the run was pruned."""
        if self.pruned:
            raise _optuna().TrialPruned(self.reason)

    def __repr__(self) -> str:
        number = getattr(self.trial, "number", "?")
        return f"OptunaPruning(trial {number}, report_step={self.report_step!r})"


def _check_direction(policy: OptunaPruning, monitor, source: str) -> None:
    study = getattr(policy.trial, "study", None)
    if study is None:  # optuna.trial.FixedTrial: nothing to prune, nothing to check
        return
    directions = [d.name.lower() for d in study.directions]
    if len(directions) != 1:
        raise ValueError(
            f"jaxnitro: `early_stop` = {policy!r} ({source}): the study has {len(directions)} "
            f"objectives; Optuna prunes single-objective studies only. Drop OptunaPruning, or "
            f"optimize one objective."
        )
    name, mode = monitor
    want = "maximize" if mode == "max" else "minimize"
    if directions[0] != want:
        raise ValueError(
            f"jaxnitro: `early_stop` = {policy!r} ({source}): the study is to {directions[0]} but the "
            f"monitored metric {name!r} is {mode!r}-is-better, so pruning would keep the worst "
            f"trials. Create the study with optuna.create_study(direction={want!r}), or change "
            f"`monitor`."
        )


@hookimpl  # not trylast: it answers for its own policy type only, before the generic early stopping
def jaxnitro_accept_knob(name, value, nitro):
    """Take ``early_stop=OptunaPruning(...)``: needs a ``monitor`` and a ``val`` split and a study
    whose direction matches the monitor."""
    if name != "early_stop" or not isinstance(value, OptunaPruning):
        return None
    require_monitor_and_val(nitro.settings, nitro.data, type(nitro.experiment).__name__, "early_stop",
                            "reports the monitored metric to the Optuna trial", "drop early_stop")
    _check_direction(value, nitro.settings.monitor, nitro.settings.source("early_stop"))
    return True


def _policy(run) -> OptunaPruning | None:
    policy = run.settings.early_stop
    return policy if isinstance(policy, OptunaPruning) and owns_knob(run, "early_stop", __name__) else None


@hookimpl
def jaxnitro_run_start(run):
    policy = _policy(run)
    if policy is not None:
        policy.reset()


@hookimpl
def jaxnitro_epoch_end(run, row):
    """Report a validated epoch to the trial; stop the run when the trial should be pruned."""
    policy = _policy(run)
    got = monitored_value(run, row) if policy is not None else None
    if got is None:
        return
    name, mode, value = got
    value = float(value)
    step = int(row["epoch"] if policy.report_step == "epoch" else row["step"])
    policy.trial.report(value, step)
    policy.reported.append((step, value))
    if policy.trial.should_prune():
        policy.pruned = True
        policy.reason = (
            f"optuna: trial {getattr(policy.trial, 'number', '?')} pruned at {policy.report_step} {step} "
            f"({name} = {value:.6g}{' (NaN)' if math.isnan(value) else ''})"
        )
        run.request_stop(policy.reason)
        return
    inner = policy.early_stop
    if inner is not None and inner.should_stop(row["epoch"], value, mode):
        every, patience = run.settings.val_every_n_steps, getattr(inner, "patience", "?")
        count = f"{patience} validations (one every {every:,} steps)" if every else f"{patience} epochs"
        run.request_stop(f"early stopping: {name} did not improve for {count}")


def _host_keys(e, point: Mapping) -> list[str]:
    infos = fields_of(e)
    return [k for k in point if k in infos and infos[k].is_host]


def optuna_objective(e, space, *, value: str = "best", report_step: str = "epoch", data=None, **knobs):
    """An Optuna objective that trains ``e`` at the point ``space(trial)`` returns.

    ``space(trial) -> {key: value}``: the trial's suggestions, keyed as a ``jn.sweep`` point
    (Device fields, ``"learning_rate"``, ``"weight_decay"``, ``"seed"``, ...), e.g.
    ``lambda t: {"smoothing": t.suggest_float("smoothing", 0, 0.3),
    "learning_rate": t.suggest_float("learning_rate", 1e-4, 1e-1, log=True)}``.
    ``knobs`` are ``jn.Nitro`` keywords for every trial (``max_epochs``, ``run_dir``, ...);
    an ``early_stop`` policy among them is asked after the pruner (see :class:`OptunaPruning`).

    Each trial runs with ``early_stop=jn.OptunaPruning(trial)``; a pruned trial raises
    ``optuna.TrialPruned``; a diverged run returns NaN (Optuna records a failed trial and the
    study goes on). Otherwise the objective returns the monitored metric's best value
    (``value="best"``) or its last (``value="last"``). The trial's user attributes get
    ``run_dir``, ``compiles`` (traces the trial caused), ``epochs`` and ``status``.

    The data is built by the first trial and reused by later ones (unless ``space`` sets a
    Host field); ``data=`` gives it instead. Needs the ``sweep`` plugin (``jn.sweep``).
    """
    if not is_experiment(e) or isinstance(e, type):
        raise TypeError(
            f"jaxnitro: optuna_objective(e, ...): `e` must be an experiment instance (an object of a "
            f"@jn.experiment class), got {e!r}."
        )
    if not callable(space):
        raise TypeError(
            f"jaxnitro: optuna_objective(e, space): `space` is {space!r}; give a function of the trial "
            f"returning a point, e.g. lambda t: {{'smoothing': t.suggest_float('smoothing', 0, 0.3)}}."
        )
    if value not in ("best", "last"):
        raise ValueError(
            f"jaxnitro: optuna_objective(value={value!r}): value is 'best' (the monitored metric's best "
            f"validated value) or 'last' (its final one)."
        )
    inner = knobs.pop("early_stop", None)
    shared = {"data": data}

    def objective(trial):
        point = space(trial)
        if not isinstance(point, Mapping):
            raise TypeError(
                f"jaxnitro: optuna_objective's space returned {point!r}; it must return a dict "
                f"{{key: value}} (a jn.sweep point)."
            )
        pruning = OptunaPruning(trial, report_step=report_step, early_stop=inner)
        reuse = shared["data"] if data is not None or not _host_keys(e, point) else None
        results = jn.sweep(e, [dict(point)], data=reuse, early_stop=pruning, **knobs)
        row = results[0]
        if data is None and results.data is not None:
            shared["data"] = results.data
        for key in ("run_dir", "compiles", "epochs", "status"):
            trial.set_user_attr(key, row[key])
        pruning.raise_if_pruned()
        if row["status"] != "done":
            return float("nan")
        name = results.monitor[0]
        result = row[f"best_{name}"] if value == "best" else row[name]
        if result is None:
            raise ValueError(
                f"jaxnitro: optuna_objective: the run of trial {trial.number} validated no epoch, so "
                f"{name!r} has no value; give the experiment a `val` split."
            )
        return result

    return objective


@hookimpl(trylast=True)
def jaxnitro_exports():
    return {"OptunaPruning": OptunaPruning, "optuna_objective": optuna_objective}
