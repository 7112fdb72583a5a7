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


from test_checkpoints import Recorder, leaves, same  # noqa: E402  (the same helpers)


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


# == 21: history columns and the title line =====================================================


def rows(n=3):
    return [{"epoch": e, "step": 10 * e, "train_loss": 1.0 / e, "acc": 0.5 + e / 10} for e in range(1, n + 1)]


def test_an_unknown_column_names_the_close_matches():
    h = jn.MetricHistory(rows(), monitor=("acc", "max"))
    with pytest.raises(KeyError) as err:
        h["acc", "loss"]
    msg = str(err.value)
    assert "no column 'loss'; for 'loss' did you mean 'train_loss'?" in msg
    assert "The columns are epoch, step, train_loss, acc." in msg and "`train_loss` is the epoch's training loss" in msg
    with pytest.raises(KeyError, match=r"for 'accuracy' did you mean 'acc'\?"):
        h.column("accuracy")
    with pytest.raises(AttributeError, match=r"no column or attribute 'trainloss'; for 'trainloss' did you mean 'train_loss'\?"):
        h.trainloss
    assert h["acc", "train_loss"].columns == ["epoch", "step", "train_loss", "acc"]  # the docs' spelling now


def test_the_title_line_fits_the_width_the_table_is_drawn_for(tmp_path, monkeypatch):
    deep = os.path.join(str(tmp_path), *["a-rather-long-folder-name"] * 6, "20261129-202146-1")
    h = jn.MetricHistory(rows(), monitor=("acc", "max"), title="history of MnistMLP", run_dir=deep, total_epochs=12)
    for width in (70, 80, 100):
        lines = h.table(width=width).splitlines()
        assert max(len(line) for line in lines) <= width, lines
        assert lines[0].startswith("history of MnistMLP  (…/") and "20261129-202146-1, 3 epochs, 12 planned)" in lines[0]
    assert h.table(width=60).splitlines()[0] == "history of MnistMLP  (3 epochs, 12 planned)"  # no room for it
    assert h.table(width=30).splitlines()[0] == "history of MnistMLP  (3 epoch…"  # nor for the line: cut
    empty = jn.MetricHistory([], title="history of MnistMLP", run_dir=deep)
    assert len(empty.table(width=50)) <= 50 and "no epochs yet" in empty.table(width=50)
    monkeypatch.chdir(tmp_path)  # inside the working directory: the relative path
    near = jn.MetricHistory(rows(), title="history", run_dir=os.path.join(str(tmp_path), "runs", "20261129-202146-1"))
    assert near.table(width=100).splitlines()[0] == "history  (runs/20261129-202146-1, 3 epochs)"


# == 8: an average of fewer checkpoints than asked ===============================================


def test_an_average_of_fewer_checkpoints_than_asked_warns_with_both_counts(tmp_path):
    rec = Recorder()
    with run_scoped([rec]):
        n = jn.train(Tiny(max_epochs=3), run_dir=tmp_path, checkpointer=jn.Checkpointer(keep=jn.Last(2)), **QUIET)
    assert steps_kept(n.run_dir) == [12, 18]
    with pytest.warns(RuntimeWarning) as caught:
        avg = jn.Nitro(Tiny(), run_dir=tmp_path, weights=("latest", jn.Average(jn.Last(5))), **QUIET)
    (msg,) = [str(w.message) for w in caught if "average" in str(w.message)]
    assert "asks for an average of 5 checkpoints, but run " in msg and "has only 2 to choose from (epochs [2, 3]" in msg
    assert "averaging those 2" in msg and "jn.Checkpointer(keep=(jn.Last(5), ...))" in msg and "jn.Average(jn.Last(2))" in msg
    expected = jax.tree_util.tree_map(lambda a, b: (a + b) / 2, rec.params[2], rec.params[3])
    for got, want in zip(leaves(avg.params), leaves(expected), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # asking for what there is: no word
        jn.Nitro(Tiny(), run_dir=tmp_path, weights=("latest", jn.Average(jn.Last(2))), **QUIET)


# == 9: resume="auto" and another experiment's runs; a changed optimizer ==========================


@jn.experiment
class Other(Tiny):
    """Another experiment class sharing Tiny's model."""


def test_resume_auto_continues_the_newest_run_of_this_experiment(tmp_path):
    ckpt = {"checkpointer": jn.Checkpointer(keep=jn.Last(1)), **QUIET}
    mine = jn.train(Tiny(max_epochs=1), run_dir=tmp_path, **ckpt)
    wider = jn.train(Tiny(max_epochs=1, width=8), run_dir=tmp_path, **ckpt)
    other = jn.train(Other(max_epochs=1), run_dir=tmp_path, **ckpt)
    with pytest.warns(RuntimeWarning, match="passed over newer runs that belong to another experiment") as caught:
        resumed = jn.Nitro(Tiny(), run_dir=tmp_path, resume="auto", **ckpt)
    assert resumed.plan.resumed.run_folder == mine.run_dir and (resumed.step, resumed.epoch) == (6, 1)
    (msg,) = [str(w.message) for w in caught if "passed over" in str(w.message)]
    assert f"continues run {os.path.basename(mine.run_dir)}" in msg
    assert f"{os.path.basename(wider.run_dir)} (other GraphConst values: width: this experiment 16, checkpoint 8)" in msg
    assert f"{os.path.basename(other.run_dir)} (saved by experiment class `test_nothing_silent_b.Other`" in msg
    # no run of this experiment at all: a fresh start whose warning names what is there
    with pytest.warns(RuntimeWarning, match=r"resume='auto' found no checkpoint.*belong to other experiments") as caught:
        fresh = jn.Nitro(Tiny(width=4), run_dir=tmp_path, resume="auto", **ckpt)
    assert fresh.step == 0
    # naming another experiment's checkpoint: the refusal names `resume=` and the fix
    with pytest.raises(ValueError, match=r"^jaxnitro: `resume=`: the checkpoint .* saved by experiment class .*Other.*"
                                         r"name a run of .*Tiny.* in `resume=`"):
        jn.Nitro(Tiny(), run_dir=tmp_path, resume=other.run_dir, **ckpt)
    with pytest.raises(ValueError, match=r"(?s)^jaxnitro: `resume=` names weights of a model with a different tree.*"
                                         r"width: this experiment 16, checkpoint 8.*without `resume=`"):
        jn.Nitro(Tiny(), run_dir=tmp_path, resume=wider.run_dir, **ckpt)


def test_resume_after_changing_the_optimizer_says_so_not_corrupt(tmp_path):
    import optax

    jn.train(Tiny(max_epochs=1), run_dir=tmp_path, checkpointer=jn.Checkpointer(), **QUIET)
    Sgd = jn.experiment(type("Tiny", (Tiny,), {"optimizer": lambda self, group: optax.sgd}))
    with pytest.raises(ValueError) as err:
        jn.Nitro(Sgd(), run_dir=tmp_path, resume="auto", **QUIET)
    msg = str(err.value)
    assert "corrupt" not in msg
    assert "the optimizer state saved in " in msg and "has another structure than this handle's optimizer" in msg
    assert "The checkpoint itself is readable" in msg and "Resume with `restore_optimizer=False`" in msg
    resumed = jn.Nitro(Sgd(), run_dir=tmp_path, resume="auto", restore_optimizer=False, **QUIET)
    assert (resumed.step, resumed.epoch) == (6, 1) and "fresh optimizer state" in resumed.plan.weights_from


# == 19: a re-run notebook cell compiles nothing ===================================================

CELL = '''
import jax, jax.numpy as jnp, equinox as eqx, numpy as np
import jaxnitro as jn
from jaxnitro import GraphConst
from tiny import tiny_data, N_FEATURES, N_CLASSES

class Net(eqx.Module):          # the model class lives in the cell too, as in a notebook
    l1: eqx.nn.Linear

    def __init__(self, width, key):
        self.l1 = eqx.nn.Linear(N_FEATURES, N_CLASSES, key=key)

    def __call__(self, x):
        return self.l1(x) * 1.0

@jn.experiment
class Cell:
    width: GraphConst[int] = 16
    max_epochs: int = 1

    def build_data(self, dist):
        return tiny_data()

    def build_model(self, key):
        return Net(self.width, key)

    def forward(self, model, state, *, x):
        return self.scaled(jax.vmap(model)(x)), state

    def scaled(self, logits):
        return logits * 1.0

    def loss(self, logits, *, label):
        return -jnp.mean(jnp.sum(label * jax.nn.log_softmax(logits), -1))

    def metrics(self, logits, *, y):
        return {"acc": (float(np.sum(np.argmax(logits, -1) == y)), len(y))}

    def monitor(self):
        return ("acc", "max")
'''


def run_cell(source: str, module: str, tmp_path):
    """Execute ``source`` as a notebook cell of module ``module`` and train its ``Cell``;
    returns (the misses that training added, the handle)."""
    notebook = {"__name__": module}
    exec(source, notebook)  # noqa: S102 - a notebook cell
    before = jn.cache_stats().misses
    n = jn.train(notebook["Cell"](), run_dir=tmp_path, **QUIET)
    assert n.status == "done"
    return jn.cache_stats().misses - before, n


def test_a_rerun_cell_and_a_host_metric_edit_compile_nothing(tmp_path):
    first, n1 = run_cell(CELL, "nb_silent_b_rerun", tmp_path)
    assert first == 2  # train_step, forward
    again, n2 = run_cell(CELL, "nb_silent_b_rerun", tmp_path)  # a new class object, the same source
    assert again == 0 and type(n2.experiment) is not type(n1.experiment)
    assert same(n2.params, n1.params) and n2.rows == n1.rows
    host_edit = CELL.replace('"acc": (float(np.sum(np.argmax(logits, -1) == y)), len(y))',
                             '"acc": (float(np.sum(np.argmax(logits, -1) == y)), len(y)), "n": (len(y), "sum")')
    edited, n3 = run_cell(host_edit, "nb_silent_b_rerun", tmp_path)
    assert edited == 0 and n3.rows[-1]["n"] == 40  # the new host metric is there, nothing compiled
    monitor_edit = CELL.replace('return ("acc", "max")', 'return ("acc", "min")')
    assert run_cell(monitor_edit, "nb_silent_b_rerun", tmp_path)[0] == 0


@pytest.mark.parametrize("edit", [
    ("return self.l1(x) * 1.0", "return self.l1(x) * 2.0"),  # the model class's __call__
    ("return logits * 1.0", "return logits * 3.0"),  # a helper method forward calls
    ("label * jax.nn.log_softmax", "0.5 * label * jax.nn.log_softmax"),  # the loss
])
def test_a_traced_edit_in_a_rerun_cell_compiles_anew(tmp_path, edit):
    module = f"nb_silent_b_traced_{abs(hash(edit)) % 10**8}"
    _, n1 = run_cell(CELL, module, tmp_path)
    misses, n2 = run_cell(CELL.replace(*edit), module, tmp_path)
    assert misses >= 1  # at least the train step: a program of the old code would be wrong
    assert n2.rows[-1]["train_loss"] != n1.rows[-1]["train_loss"]
