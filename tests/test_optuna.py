"""The Optuna plugin: ``jn.OptunaPruning`` (a pruning stop policy) and ``jn.optuna_objective``,
with real in-memory studies; and the ``early_stop`` knob belonging to the plugin that accepted it."""

from __future__ import annotations

import os

import pytest
from tiny import Tiny, fresh_tiny, tiny_data

import jaxnitro as jn
import jaxnitro.plugin_manager

optuna = pytest.importorskip("optuna")
optuna.logging.set_verbosity(optuna.logging.WARNING)

DATA = tiny_data()
State = optuna.trial.TrialState


def monitored(name="TunedTiny"):
    return fresh_tiny(name, monitor=lambda self: ("loss", "min"))


def space(trial):
    return {"smoothing": trial.suggest_float("smoothing", 0.0, 0.3),
            "learning_rate": trial.suggest_float("learning_rate", 1e-4, 3e-2, log=True)}


def test_a_study_prunes_a_bad_trial_and_later_trials_compile_nothing(tmp_path):
    e = monitored()()
    study = optuna.create_study(storage=None, direction="minimize", sampler=optuna.samplers.RandomSampler(seed=0),
                                pruner=optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=0))
    study.enqueue_trial({"smoothing": 0.0, "learning_rate": 2e-2})   # learns: completes
    study.enqueue_trial({"smoothing": 0.0, "learning_rate": 1e-4})   # barely moves: pruned at epoch 1
    study.enqueue_trial({"smoothing": 0.0, "learning_rate": 3e-2})   # learns faster: completes
    before = jn.cache_stats().misses
    objective = jn.optuna_objective(e, space, max_epochs=3, run_dir=tmp_path, logger=None)
    study.optimize(objective, n_trials=4)
    trials = study.trials
    assert [t.state for t in trials[:3]] == [State.COMPLETE, State.PRUNED, State.COMPLETE]
    assert trials[0].user_attrs["compiles"] > 0
    assert [t.user_attrs["compiles"] for t in trials[1:]] == [0] * 3, "later trials compile nothing"
    assert jn.cache_stats().misses - before == trials[0].user_attrs["compiles"]
    pruned = trials[1]
    assert pruned.user_attrs["epochs"] == 1 and pruned.user_attrs["status"] == "done"
    assert list(pruned.intermediate_values) == [1]
    done = trials[0]
    assert list(done.intermediate_values) == [1, 2, 3] and done.user_attrs["epochs"] == 3
    assert done.value == pytest.approx(min(done.intermediate_values.values()))  # the best validated loss
    assert all(os.path.isdir(t.user_attrs["run_dir"]) for t in trials)
    assert study.best_trial.state == State.COMPLETE


def test_a_hand_written_objective_with_the_policy(tmp_path):
    """The documented pattern: OptunaPruning as early_stop, raise_if_pruned, return a value."""
    stops = []

    def objective(trial):
        pruning = jn.OptunaPruning(trial)
        e = Tiny(smoothing=trial.suggest_float("smoothing", 0.0, 0.2))
        n = jn.train(monitored("HandTuned")(**{"smoothing": e.smoothing}), data=DATA, max_epochs=3,
                     run_dir=tmp_path, logger=None, early_stop=pruning)
        stops.append(n.stop_reason)
        pruning.raise_if_pruned()
        return n.history().best["loss"]

    # prunes every trial whose first validation is above a threshold no run reaches
    study = optuna.create_study(direction="minimize", pruner=optuna.pruners.ThresholdPruner(upper=1e-6))
    study.optimize(objective, n_trials=2)
    assert [t.state for t in study.trials] == [State.PRUNED, State.PRUNED]
    assert all(s.startswith("optuna: trial ") and "pruned at epoch 1 (loss = " in s for s in stops), stops
    # a pruner that never prunes: the run trains every epoch and the trial completes
    study = optuna.create_study(direction="minimize", pruner=optuna.pruners.NopPruner())
    study.optimize(objective, n_trials=1)
    assert study.trials[0].state == State.COMPLETE and stops[-1] is None
    assert list(study.trials[0].intermediate_values) == [1, 2, 3]


def test_an_inner_early_stopping_policy_is_asked_after_the_pruner(tmp_path):
    Stuck = fresh_tiny("StuckTiny", monitor=lambda self: ("loss", "max"))  # epoch 1 is the best
    study = optuna.create_study(direction="maximize", pruner=optuna.pruners.NopPruner())
    trial = study.ask()
    pruning = jn.OptunaPruning(trial, early_stop=jn.EarlyStopping(patience=1))
    n = jn.train(Stuck(), data=DATA, max_epochs=5, run_dir=tmp_path, logger=None, early_stop=pruning)
    assert n.epoch == 2 and n.stop_reason == "early stopping: loss did not improve for 1 epochs"
    assert not pruning.pruned and len(pruning.reported) == 2
    # validated every N steps, the patience counts validations, and the reason says so
    pruning = jn.OptunaPruning(study.ask(), report_step="step", early_stop=jn.EarlyStopping(patience=1))
    n = jn.train(Stuck(), data=DATA, max_steps=40, max_epochs=None, val_every_n_steps=2, run_dir=tmp_path,
                 logger=None, early_stop=pruning)
    assert n.step == 4 and n.stop_reason == "early stopping: loss did not improve for 1 validations (one every 2 steps)"


def test_a_study_direction_against_the_monitor_is_refused_at_setup(tmp_path):
    trial = optuna.create_study(direction="maximize").ask()
    with pytest.raises(ValueError, match=r"study is to maximize but the monitored metric 'loss' is 'min'.*"
                                         r"create_study\(direction='minimize'\)"):
        jn.Nitro(monitored("Mismatch")(), data=DATA, run_dir=tmp_path, early_stop=jn.OptunaPruning(trial))
    with pytest.raises(ValueError, match=r"`early_stop` \(keyword\) reports the monitored metric.*no `monitor`"):
        jn.Nitro(Tiny(), data=DATA, run_dir=tmp_path, early_stop=jn.OptunaPruning(trial))
    with pytest.raises(TypeError, match=r"OptunaPruning\(3\): give the optuna.Trial"):
        jn.OptunaPruning(3)
    with pytest.raises(ValueError, match=r"report_step='batch'"):
        jn.OptunaPruning(trial, report_step="batch")
    with pytest.raises(TypeError, match=r"`space` is 3; give a function of the trial"):
        jn.optuna_objective(Tiny(), 3)
    with pytest.raises(ValueError, match=r"value='median'"):
        jn.optuna_objective(Tiny(), space, value="median")


def test_a_graph_const_in_the_space_is_refused_naming_it(tmp_path):
    study = optuna.create_study(direction="minimize")
    objective = jn.optuna_objective(monitored("Structural")(), lambda t: {"width": t.suggest_int("width", 8, 32)},
                                    data=DATA, run_dir=tmp_path)
    with pytest.raises(ValueError, match=r"cannot sweep `width`: it is a GraphConst field.*recompile"):
        study.optimize(objective, n_trials=1, catch=())
    assert os.listdir(tmp_path) == []


# -- the early_stop knob belongs to the plugin that accepted it ------------------------------------


class PatienceOfOne:
    """A third party's stop policy: no `should_stop`, applied by its own plugin."""

    def __init__(self):
        self.seen = []


class ThirdPartyStopper:
    @jn.hookimpl
    def jaxnitro_accept_knob(self, name, value, nitro):
        return True if name == "early_stop" and isinstance(value, PatienceOfOne) else None

    @jn.hookimpl
    def jaxnitro_epoch_end(self, run, row):
        policy = run.settings.early_stop
        if isinstance(policy, PatienceOfOne):
            policy.seen.append(row["epoch"])
            run.request_stop("third party: one epoch is enough")


@pytest.fixture
def third_party():
    pm = jaxnitro.plugin_manager.plugin_manager()
    plugin = ThirdPartyStopper()
    pm.register(plugin, name="third-party-stopper")
    yield
    pm.unregister(plugin)


def test_the_built_in_early_stopping_leaves_another_plugins_policy_alone(third_party, tmp_path):
    # before: the built-in plugin called `should_stop` on any early_stop value (AttributeError here)
    policy = PatienceOfOne()
    n = jn.train(monitored("ThirdPartyStopped")(), data=DATA, max_epochs=4, run_dir=tmp_path, logger=None,
                 early_stop=policy)
    assert n.status == "done" and n.epoch == 1 and policy.seen == [1]
    assert n.stop_reason == "third party: one epoch is enough"
    # and the built-in still applies its own policies
    n = jn.train(fresh_tiny("Best1", monitor=lambda self: ("loss", "max"))(), data=DATA, max_epochs=5,
                 run_dir=tmp_path, logger=None, early_stop=jn.EarlyStopping(patience=2))
    assert n.epoch == 3 and n.stop_reason.startswith("early stopping: loss did not improve for 2 epochs")


def test_the_plugin_loads_without_optuna_and_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "optuna", None)  # `import optuna` now fails
    jn.reload_plugins()
    try:
        assert "optuna" in [p.name for p in jn.plugins_info()]
        study_trial = optuna.create_study().ask()  # the real module, imported before the block
        pruning = jn.OptunaPruning(study_trial)
        pruning.pruned = True
        with pytest.raises(ImportError, match=r"pip install 'jaxnitro\[optuna\]'"):
            pruning.raise_if_pruned()
    finally:
        monkeypatch.undo()
        jn.reload_plugins()


@pytest.mark.slow
def test_the_example_study_compiles_nothing_after_the_first_trial(capsys):
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples", "mnist"))
    import optuna_study

    study = optuna_study.main(["--trials", "4", "--epochs", "2"])
    assert len(study.trials) == 4
    assert study.trials[0].user_attrs["compiles"] > 0 or jn.cache_stats().misses > 0
    assert [t.user_attrs["compiles"] for t in study.trials[1:]] == [0, 0, 0]
    assert [t.user_attrs["xla_compiles"] for t in study.trials[1:]] == [0, 0, 0]
    out = capsys.readouterr().out
    assert "programs compiled by trials after the first: 0; XLA compilations: 0" in out
