"""Issue 23, items 8, 9, 10, 19 and 21: cases that passed without a word, or said the wrong thing.

* 8: an average of fewer checkpoints than asked warns with both counts;
* 9: ``resume="auto"`` continues the newest *compatible* run, and a changed optimizer is
  named as such, not as a corrupt checkpoint;
* 10: one rule of "best" on ties (the earliest epoch) for the history, the checkpointer,
  ``weights=(run, "best")`` and early stopping;
* 19: a notebook cell re-run (or a host-metric-only edit) compiles nothing;
* 21: an unknown history column suggests the real ones; the title line fits the width.
"""

from __future__ import annotations

import os
import warnings

import jax
import numpy as np
import pytest

import jaxnitro as jn
from jaxnitro.events import run_scoped
from jaxnitro.history import best_positions, improves
from tiny import Tiny

QUIET = {"logger": None}


def leaves(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(leaves(a), leaves(b), strict=True))


class Recorder:
    """The params (host copies) at the end of each epoch's steps."""

    def __init__(self):
        self.params = {}

    @jn.hookimpl
    def jaxnitro_epoch_trained(self, run, epoch, step, stats):
        self.params[epoch] = jax.tree_util.tree_map(np.asarray, run.nitro.state.params)


def steps_kept(run_folder) -> list[int]:
    return sorted(int(s) for s in os.listdir(os.path.join(run_folder, "checkpoints")) if s.isdigit())


# == 10: "best" on ties ===========================================================================


@jn.experiment
class Tied(Tiny):
    """Tiny whose monitored metric is the same every epoch: every epoch ties."""

    max_epochs: int = 3

    def metrics(self, logits, *, y):
        return {"score": (float(len(y)), len(y))}  # 1.0 whatever the weights

    def monitor(self):
        return ("score", "max")


def test_the_rule_of_best_is_strict_improvement_so_the_earliest_tie_wins():
    assert best_positions([0.5, 0.8, 0.8, 0.7], "max") == [1]
    assert best_positions([0.5, 0.8, 0.8, 0.7], "max", n=3) == [1, 2, 3]
    assert best_positions([0.3, 0.2, float("nan"), 0.2, None], "min", n=2) == [1, 3]
    assert best_positions([float("nan")], "max") == []
    assert not improves(0.8, 0.8, "max") and improves(0.9, 0.8, "max") and not improves(float("nan"), None, "min")
    h = jn.MetricHistory([{"epoch": e, "step": e, "acc": a} for e, a in ((1, 0.5), (2, 0.8), (3, 0.8))],
                         monitor=("acc", "max"))
    assert h.best_epoch == 2
    stop = jn.EarlyStopping(patience=2)
    assert [stop.should_stop(e, a, "max") for e, a in ((1, 0.5), (2, 0.8), (3, 0.8), (4, 0.8))] == [
        False, False, False, True]
    assert stop.best_epoch == 2  # the history's best epoch


def test_tied_epochs_history_checkpointer_and_weights_agree(tmp_path):
    rec = Recorder()
    with run_scoped([rec]):
        n = jn.train(Tied(), run_dir=tmp_path, checkpointer=jn.Checkpointer(keep=(jn.Best(1), jn.Last(1))), **QUIET)
    h = n.history()
    assert [r["score"] for r in h] == [1.0, 1.0, 1.0]
    assert h.best_epoch == 1  # the earliest of the tie
    assert steps_kept(n.run_dir) == [6, 18]  # Best(1) kept epoch 1 (orbax's BestN kept epoch 3)
    best = jn.Nitro(Tied(), run_dir=tmp_path, weights=("latest", "best"), **QUIET)
    assert same(best.params, rec.params[1])
    assert "checkpoint step 6 (epoch 1, best score=1)" in best.plan.weights_from
    resumed = jn.Nitro(Tied(), run_dir=tmp_path, resume="auto", restore_best=True, **QUIET)
    assert (resumed.step, resumed.epoch) == (6, 1)
