"""The core's progress contract: setup line, one bar per run, phase labels, notes from hooks."""

from __future__ import annotations

import pytest

import jaxnitro as jn
from tiny import Tiny, tiny_data


class Recorder:
    def __init__(self):
        self.events = []

    def begin(self, total, label):
        self.events.append(("begin", total, label))

    def update(self, position, label):
        self.events.append(("update", position, label))

    def close(self, label):
        self.events.append(("close", label))

    def labels(self):
        return [e[-1] for e in self.events]


@pytest.fixture
def recorder():
    r = Recorder()
    previous = jn.progress_reporter(r)
    yield r
    jn.progress_reporter(previous)


@jn.experiment
class Noted(Tiny):
    def build_data(self, dist):
        with jn.with_progress_note("reading shards"):
            jn.progress_note("reading shard 2/2")
            return tiny_data()


def test_setup_reports_its_steps_and_notes_from_hooks(recorder, tmp_path):
    jn.Nitro(Noted(), run_dir=tmp_path, logger=None)
    labels = recorder.labels()
    assert labels[0] == "setup [starting]"
    assert "setup [building data: reading shards]" in labels
    assert "setup [building data: reading shard 2/2]" in labels
    assert labels.index("setup [building data]") < labels.index("setup [building model]")
    assert recorder.events[-1] == ("close", "setup done")


def test_a_run_is_one_bar_of_epochs_with_phase_labels(recorder, tmp_path):
    @jn.experiment
    class Fresh(Tiny):  # a new class: its first train step compiles, so the label says so
        def monitor(self):
            return ("loss", "min")

    n = jn.Nitro(Fresh(max_epochs=2), run_dir=tmp_path, logger=None)
    recorder.events.clear()
    n.train()
    begin = recorder.events[0]
    assert begin[:2] == ("begin", 2)
    labels = recorder.labels()
    assert "epoch 1/2: train [preparing]" in labels
    assert "epoch 1/2: train [compiling train step]" in labels
    # after an epoch, the label carries its mean train loss and the monitored metric
    row = n.rows[0]
    figures = f"train_loss {row['train_loss']:.4g} | loss {row['loss']:.4g}"
    assert f"epoch 2/2: validate | {figures}" in labels
    positions = [e[1] for e in recorder.events if e[0] == "update"]
    assert positions == sorted(positions) and positions[-1] == 2.0
    assert recorder.events[-1] == ("close", "done: 2/2 epochs")


def test_setup_is_a_line_of_phases_and_an_early_stop_ends_at_the_epochs_done(recorder, tmp_path):
    n = jn.Nitro(Tiny(max_epochs=50), run_dir=tmp_path, logger=None)
    assert recorder.events[0][:2] == ("begin", 0)  # phases, no epochs: no bar and no rate
    recorder.events.clear()
    @jn.experiment
    class Monitored(Tiny):
        def monitor(self):
            return ("loss", "max")  # the loss falls: it never "improves", so patience 1 stops at 2

    n = jn.Nitro(Monitored(max_epochs=50), run_dir=tmp_path, logger=None, early_stop=jn.EarlyStopping(patience=1))
    recorder.events.clear()
    n.train()
    done = len(n.history())
    assert done == 2 and recorder.events[-1] == ("close", "done: 2/50 epochs")
    assert [e[1] for e in recorder.events if e[0] == "update"][-1] == float(done)


def test_reporter_validation():
    with pytest.raises(TypeError, match="begin.*update.*close.*lacks"):
        jn.progress_reporter(object())
    with pytest.raises(ValueError, match="no plugin provides a progress reporter named 'fancy'"):
        jn.progress_reporter("fancy")
