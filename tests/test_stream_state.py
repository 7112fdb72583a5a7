"""A streaming train split resumes from its iterator's own state: a checkpoint records the
state after the last trained batch (grain's ``get_state``, a torch ``state_dict``) and a
resumed run restores it, reading nothing again; a stream without one is read again from the
epoch's start, with a warning."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

import jaxnitro as jn
from test_long_runs import assert_same_state, train_lines
from tiny import Tiny, make_arrays, tiny_data

CKPT = dict(keep=jn.Last(1), asynchronous=False)
RUN = dict(max_epochs=None, val_every_n_steps=4, logger="jsonl")  # 6 batches (steps) a pass


class Records:
    """Tiny's 96 train rows as records, counting and logging each read (``read``); asks for a
    preemption (as SIGTERM does) when its ``at``-th read happens."""

    def __init__(self, at: int = 0):
        self.x, self.y, self.oh = make_arrays(96 + 40)
        self.read, self.at = [], at

    def __len__(self):
        return 96

    def __repr__(self):  # what grain's DataLoader checks a restored state against
        return "Records(96)"

    def __getitem__(self, i):
        i = int(i)
        self.read.append(i)
        if len(self.read) == self.at:
            from jaxnitro.interrupts import request

            request.status = "preempted"
        return {"x": self.x[i], "label": self.oh[i], "y": self.y[i]}


def grain_data(records: Records) -> dict:
    grain = pytest.importorskip("grain")
    # no read threads in grain: its records are read in order, as the producer asks for batches
    serial = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
    train = grain.MapDataset.source(records).to_iter_dataset(serial).batch(16, drop_remainder=True)
    return {"train": train, "val": tiny_data()["val"]}


def no_reread_warning(record) -> None:
    assert not [w for w in record if "from its start again" in str(w.message)], [str(w.message) for w in record]


def stop_resume_compare(tmp_path, make_data, at: int, max_steps: int = 15, before_train=None, k: int = 1):
    """Train ``max_steps`` straight; train again, preempted at the ``at``-th read record; resume
    with ``resume="auto"`` (``before_train(data)`` is called between its setup and its
    ``train()``). Returns ``(straight, resumed, resumed data, warnings recorded)``
    after asserting bitwise equality of the state, the rows and every train line."""
    kw = dict(max_steps=max_steps, checkpointer=jn.Checkpointer(every_n_steps=4, **CKPT), steps_per_dispatch=k, **RUN)
    straight = jn.train(Tiny(), data=make_data(0), run_dir=tmp_path / "a", **{**kw, "checkpointer": None})
    with pytest.raises(jn.Preempted):
        jn.train(Tiny(), data=make_data(at), run_dir=tmp_path / "b", **kw)
    data = make_data(0)
    resumed = jn.Nitro(Tiny(), data=data, run_dir=tmp_path / "b", resume="auto", **kw)
    if before_train is not None:
        before_train(data)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        resumed.train()
    assert_same_state(resumed, straight)
    assert resumed.rows == straight.rows[-len(resumed.rows):]
    assert len({r["step"] for r in straight.rows}) == len(straight.rows)  # one row per validation
    (a,), (b,) = (tmp_path / "a").iterdir(), (tmp_path / "b").iterdir()
    assert train_lines(b) == train_lines(a)  # every logged train value, each step once
    return straight, resumed, data, record


@pytest.mark.parametrize("k", [1, 4])  # steps_per_dispatch: blocks of 4 batches stacked on the host
def test_a_grain_stream_resumes_mid_epoch_from_its_iterator_state(tmp_path, k):
    records = {}

    def make(at):
        records[at] = Records(at)
        return grain_data(records[at])

    # preempted while epoch 2's records are read (96 a pass): the stop lands mid-epoch 2, with
    # prefetch (one producer, batches staged ahead) past the last trained batch
    def reads_from_here(data):  # setup read the first batch (its width): count the run's reads only
        records[0].read.clear()

    straight, resumed, data, record = stop_resume_compare(tmp_path, make, at=96 + 40, before_train=reads_from_here, k=k)
    start = resumed.plan.resumed.step
    assert 6 < start < 12
    saved = resumed.plan.weights_meta["data_position"]["stream_state"]
    assert saved["source"] == "jaxnitro.plugins.grain_loader.GrainStream"
    # the state after the last trained batch, not after the last one read ahead
    assert saved["state"] == {"batches": start - 6, "iterator": {"next_index": (start - 6) * 16}}
    no_reread_warning(record)
    # the resumed run's first read is the record after the last trained batch: nothing read again
    assert records[0].read[0] == (start - 6) * 16
    assert records[0].read[: 96 - (start - 6) * 16] == list(range((start - 6) * 16, 96))


def test_a_grain_dataloader_stream_resumes_from_its_state_too(tmp_path):
    grain = pytest.importorskip("grain")

    def make(at):
        records = Records(at)
        loader = grain.DataLoader(
            data_source=records, sampler=grain.samplers.IndexSampler(96, shuffle=True, seed=3, num_epochs=1),
            operations=[grain.transforms.Batch(16, drop_remainder=True)], worker_count=0,
            read_options=grain.ReadOptions(num_threads=0, prefetch_buffer_size=0),
        )
        return {"train": loader, "val": tiny_data()["val"]}

    _, resumed, _, record = stop_resume_compare(tmp_path, make, at=96 + 40)
    assert isinstance(resumed.plan.weights_meta["data_position"]["stream_state"]["state"]["iterator"], str)
    no_reread_warning(record)


def test_a_torch_iterable_dataset_with_state_dict_resumes_from_it(tmp_path):
    torch = pytest.importorskip("torch", reason="torch is not installed (extra `torch`)")

    class Rows(torch.utils.data.IterableDataset):
        """Records as an IterableDataset whose state_dict is its position in the pass."""

        def __init__(self, records):
            self.records, self.position, self.resume_at = records, 0, None

        def __iter__(self):
            start, self.resume_at = self.resume_at or 0, None
            for i in range(start, len(self.records)):
                self.position = i + 1
                yield self.records[i]

        def state_dict(self):
            return {"position": self.position}

        def load_state_dict(self, state):
            self.resume_at = state["position"]

    rows = {}

    def make(at):
        records = Records(at)
        rows[at] = records
        loader = torch.utils.data.DataLoader(Rows(records), batch_size=16, drop_last=True)
        return {"train": jn.TorchStream(loader, batches_per_epoch=6), "val": tiny_data()["val"]}

    _, resumed, _, record = stop_resume_compare(tmp_path, make, at=96 + 40,
                                                before_train=lambda data: rows[0].read.clear())
    start = resumed.plan.resumed.step
    saved = resumed.plan.weights_meta["data_position"]["stream_state"]
    assert saved == {"source": "jaxnitro.plugins.torch_loader.TorchStream",
                     "state": {"batches": start - 6, "state": {"position": (start - 6) * 16}}}
    no_reread_warning(record)
    assert rows[0].read[0] == (start - 6) * 16


class Generated:
    """A generator-backed stream (no len(), no state): Tiny's batches; asks for a preemption
    when its ``at``-th batch is read."""

    def __init__(self, at: int = 0):
        self.batches, self.at, self.reads = tiny_data()["train"], at, 0

    def __iter__(self):
        from jaxnitro.interrupts import request

        for b in self.batches:
            self.reads += 1
            if self.reads == self.at:
                request.status = "preempted"
            yield b


class Sized(Generated):
    """The same stream with a len(): still read again on resume (it has no state)."""

    def __len__(self):
        return len(self.batches)


@pytest.mark.parametrize("kind", [Generated, Sized])
def test_a_stream_without_state_still_reads_again_with_a_warning(tmp_path, kind):
    def make(at):
        return {"train": kind(at), "val": tiny_data()["val"]}

    _, resumed, data, record = stop_resume_compare(tmp_path, make, at=6 + 3)
    assert "stream_state" not in resumed.plan.weights_meta["data_position"]
    (w,) = [w for w in record if "from its start again" in str(w.message)]
    assert "restores no iterator state" in str(w.message)
    assert f"drops its first {resumed.plan.resumed.step - 6} batches" in str(w.message)


def test_a_state_saved_by_one_source_type_is_refused_by_another(tmp_path):
    kw = dict(max_steps=10, checkpointer=jn.Checkpointer(every_n_steps=4, **CKPT), **RUN)
    jn.train(Tiny(), data=grain_data(Records()), run_dir=tmp_path, **kw)  # ends mid-epoch 2
    with pytest.raises(ValueError, match=r"iterator state of a `train` split read from "
                                         r"jaxnitro\.plugins\.grain_loader\.GrainStream.*Generated.*same kind"):
        jn.Nitro(Tiny(), data={"train": Generated(), "val": tiny_data()["val"]}, run_dir=tmp_path, resume="auto", **kw)


class ArrayState(Generated):
    """A stream whose iterator state is a NumPy array (not JSON-able)."""

    def iterator_state(self, batches):
        return np.arange(batches)

    def restore_iterator(self, state):
        pass


def test_a_state_that_is_not_json_is_refused_at_the_first_checkpoint(tmp_path):
    kw = dict(max_steps=10, checkpointer=jn.Checkpointer(every_n_steps=4, **CKPT), **RUN)
    with pytest.raises(TypeError, match=r"ArrayState\.iterator_state\(\) returned a value that is not JSON-able.*tolist"):
        jn.train(Tiny(), data={"train": ArrayState(), "val": tiny_data()["val"]}, run_dir=tmp_path, **kw)
    (folder,) = tmp_path.iterdir()
    assert not (Path(folder) / "checkpoints" / "4").exists()


def test_pass_states_answer_for_the_batches_yielded_and_say_what_is_gone():
    from jaxnitro.plugin import PassStates, StatefulStream

    states = PassStates(keep=3)
    with pytest.raises(LookupError, match="no pass"):
        states.after(0)
    states.begin("s0")
    for k in range(1, 6):
        states.record(f"s{k}")
    assert [states.after(n) for n in (2, 3, 5)] == ["s2", "s3", "s5"]
    with pytest.raises(LookupError, match="has yielded 5 batches, not 6"):
        states.after(6)
    with pytest.raises(LookupError, match="state after batch 1 is gone"):
        states.after(1)
    assert isinstance(jn.GrainStream.__new__(jn.GrainStream), StatefulStream)


def test_a_stream_whose_pass_ends_at_a_cut_gets_one_row_there(tmp_path):
    # a stream's end is seen one read after its last step: the cut already made at that step
    # (a validation, a checkpoint) is not made twice, and an epoch's row still closes there
    data = {"train": Generated(), "val": tiny_data()["val"]}
    kw = dict(run_dir=tmp_path, max_steps=12, max_epochs=None, logger=None)
    by_steps = jn.train(Tiny(), data=data, val_every_n_steps=6, **kw)
    assert [(r["epoch"], r["step"]) for r in by_steps.rows] == [(1, 6), (2, 12)]
    assert all(np.isfinite(r["train_loss"]) for r in by_steps.rows)
    ckpt = jn.Checkpointer(every_n_steps=6, **CKPT)
    by_epochs = jn.train(Tiny(), data=data, checkpointer=ckpt, **kw)
    assert [(r["epoch"], r["step"]) for r in by_epochs.rows] == [(1, 6), (2, 12)]
    assert by_epochs.rows == by_steps.rows


def test_a_stateful_stream_resumed_from_a_checkpoint_without_state_reads_again(tmp_path):
    kw = dict(max_steps=10, checkpointer=jn.Checkpointer(every_n_steps=4, **CKPT), **RUN)
    jn.train(Tiny(), data={"train": Sized(), "val": tiny_data()["val"]}, run_dir=tmp_path, **kw)  # no state
    resumed = jn.Nitro(Tiny(), data=grain_data(Records()), run_dir=tmp_path, resume="auto", **{**kw, "max_steps": 12})
    with pytest.warns(UserWarning, match=r"holds no iterator state.*reads epoch 2 from its start again and drops "
                                         r"its first 4 batches"):
        resumed.train()
    assert resumed.step == 12
