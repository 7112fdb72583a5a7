"""Adapt ``torch.utils.data.DataLoader``: ``jn.TorchSource`` and ``jn.TorchStream``.

Entry point ``torch_loader``. A split that ``build_data`` returns as a torch
``DataLoader`` is adapted through ``jaxnitro_adapt_source``:

* over a *map-style* dataset with torch's own samplers (``shuffle=True`` /
  ``False``, a ``RandomSampler``, ``SequentialSampler`` or
  ``SubsetRandomSampler``, batched by a plain ``BatchSampler``) it becomes a
  :class:`TorchSource`, *index-addressable*: jaxnitro reads the loader's
  settings (dataset, batch size, ``drop_last``, sampler, ``collate_fn``,
  generator seed) and rebuilds each epoch's plan itself instead of iterating
  the loader, so several producer threads read it in order and a fixed seed
  reproduces a run bit for bit at any worker count;
* anything else (an ``IterableDataset``, a custom sampler or batch sampler) is
  a :class:`TorchStream`, iterated by one producer; its ``prefetch_note`` says
  why. A loader without ``len()`` (an ``IterableDataset`` without ``__len__``, a
  sampler without one) is a stream without ``len()``: each pass an epoch that
  ends when the loader's iteration does, for a run bounded by ``max_steps``.

Tensors become NumPy arrays without a copy (``Tensor.numpy``; ``bfloat16``
through a view). torch is never imported here: the hook looks in
``sys.modules`` (a ``DataLoader`` exists only once torch is imported), so
this module loads, registers and answers ``None`` without torch installed.
"""

from __future__ import annotations

import copy
import itertools
import sys
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import structlog

from jaxnitro.plugin import (
    PassStates, ProcessPart, SourceLengthError, as_batch, batch_rows, check_epoch, check_fields, hookimpl,
    split_by_process,
)

__all__ = ["DEFAULT_SEED", "TorchSource", "TorchStream"]

log = structlog.get_logger("jaxnitro")

DEFAULT_SEED = 0
"""The shuffle seed of a loader with no ``generator`` (and no ``seed=``)."""


def _torch_data():
    """``torch.utils.data``, imported (by the caller's own import of torch) or importable."""
    try:
        from torch.utils import data
    except ImportError as err:  # pragma: no cover - exercised without torch only
        raise ImportError(
            "jaxnitro: the torch adapter needs torch; install it with `pip install jaxnitro[torch]`"
        ) from err
    return data


def _to_numpy(value: Any) -> np.ndarray:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        if value.dtype == torch.bfloat16:  # NumPy has no bfloat16: view the bits as ml_dtypes'
            import ml_dtypes

            return value.detach().cpu().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return value.numpy(force=True)  # a CPU tensor shares its memory: no copy
    return np.asarray(value)


_FIX = "return dicts from the dataset's __getitem__ (default_collate keeps them), or name the parts: jn.TorchSource(loader, fields=('x', 'label'))"


def _as_batch(value: Any, fields: Sequence[str] | None, what: str) -> dict:
    """A collated torch batch as a jaxnitro batch: a dict of NumPy arrays."""
    return as_batch(value, fields, what, _FIX, _to_numpy)




def _warn(option: str, message: str, stacklevel: int = 4) -> None:
    """A ``UserWarning`` naming the DataLoader option; ``stacklevel`` points at the user's call."""
    warnings.warn(f"jaxnitro: DataLoader({option}): {message}", UserWarning, stacklevel=stacklevel)


# -- index-addressable: a map-style dataset with torch's samplers ------------------------


def _unplannable(loader, data) -> str | None:
    """Why jaxnitro cannot rebuild ``loader``'s plan, or None when it can."""
    if isinstance(loader.dataset, data.IterableDataset):
        return "its dataset is an IterableDataset (no index to address)"
    try:
        len(loader.dataset)
    except TypeError:
        return "its dataset has no len()"
    sampler = loader.sampler
    if type(sampler) not in (data.SequentialSampler, data.RandomSampler, data.SubsetRandomSampler):
        return f"its sampler is a {type(sampler).__name__}, whose plan jaxnitro cannot rebuild"
    bs = loader.batch_sampler
    if bs is not None and (type(bs) is not data.BatchSampler or bs.sampler is not sampler):
        return f"its batch_sampler is a {type(bs).__name__}, whose plan jaxnitro cannot rebuild"
    return None


def _generator_seed(loader) -> int | None:
    gen = getattr(loader.sampler, "generator", None) or loader.generator
    return None if gen is None else int(gen.initial_seed())


class TorchSource:
    """An index-addressable jaxnitro source rebuilt from a torch ``DataLoader``.

    ``jn.TorchSource(DataLoader(ds, batch_size=100, shuffle=True, drop_last=True, generator=g))``

    The loader is never iterated. Its settings are read once:

    - ``dataset`` (map-style), read per batch as torch's fetcher does:
      ``dataset.__getitems__(indices)`` when defined, else ``[dataset[i] ...]``,
      then ``collate_fn``; with ``batch_size=None`` each index is one batch,
      ``collate_fn(dataset[i])``;
    - the sampler: ``SequentialSampler`` (in order), ``RandomSampler``
      (``replacement``, ``num_samples`` honoured), ``SubsetRandomSampler``;
      ``batch_size`` and ``drop_last`` from its ``BatchSampler``;
    - the seed: ``seed=`` when given, else the generator's ``initial_seed()``
      (``DataLoader(generator=...)`` or the sampler's own), else the run's
      ``seed`` knob (jaxnitro calls :meth:`bind_seed` at setup;
      :data:`DEFAULT_SEED` until then). Epoch ``e``'s order is drawn from
      ``numpy.random.default_rng((seed, e))``: a new order each epoch, the same
      across runs. It is not the order torch's own iteration would give.
    - ``num_workers`` becomes ``prefetch_workers``: that many producer
      *threads* of this process read batches (0: in the training thread).

    Options with no effect here warn, naming the option: ``pin_memory``,
    ``persistent_workers``, ``worker_init_fn`` (never called: no worker
    processes), ``timeout``, ``multiprocessing_context``, ``in_order=False``
    (delivery is in order). ``prefetch_factor`` is replaced by the wrapper's
    ``host_batches``.

    **Arguments:** ``loader``; ``seed`` (int >= 0, overrides the generator's);
    ``fields``: names for the parts of tuple/list batches (``TensorDataset``
    yields ``[x, y]``: ``fields=("x", "label")``).

    **Raises:** ``TypeError`` for a loader whose plan cannot be rebuilt
    (an ``IterableDataset``, a custom sampler: use :class:`TorchStream`);
    ``ValueError`` for a bad seed or a loader with no batch.
    """

    def __init__(self, loader: Any, *, seed: int | None = None, fields: Sequence[str] | None = None):
        data = _torch_data()
        if not isinstance(loader, data.DataLoader):
            raise TypeError(f"TorchSource takes a torch.utils.data.DataLoader, got {type(loader).__name__}")
        reason = _unplannable(loader, data)
        if reason is not None:
            raise TypeError(
                f"TorchSource: cannot make this DataLoader index-addressable: {reason}. Iterate it "
                f"with jn.TorchStream(loader) (one producer), or use a map-style dataset with "
                f"shuffle=True/False or a RandomSampler/SequentialSampler/SubsetRandomSampler"
            )
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise ValueError(f"TorchSource: seed must be an int >= 0, got {seed!r}")
        gen_seed = _generator_seed(loader)
        self.seed = seed if seed is not None else gen_seed if gen_seed is not None else DEFAULT_SEED
        self.seed_from = "seed=" if seed is not None else "generator" if gen_seed is not None else "the run's seed"
        """Where :attr:`seed` comes from: ``"seed="``, ``"generator"`` (both kept by
        :meth:`bind_seed`) or ``"the run's seed"`` (bound at setup)."""
        self.loader, self.dataset, self.fields = loader, loader.dataset, check_fields(fields)
        self.sampler, self.collate_fn = loader.sampler, loader.collate_fn
        bs = loader.batch_sampler
        self.batch_size = None if bs is None else int(bs.batch_size)
        self.drop_last = False if bs is None else bool(bs.drop_last)
        n = len(self.sampler)
        if self.batch_size is None:
            self._len = n
        else:
            self._len = n // self.batch_size if self.drop_last else -(-n // self.batch_size)
        if self._len == 0:
            raise ValueError(f"TorchSource: the DataLoader makes no batch ({n} samples, batch_size="
                             f"{self.batch_size}, drop_last={self.drop_last})")
        getitems = getattr(self.dataset, "__getitems__", None)
        self._getitems = getitems if getitems else None
        self.prefetch_workers = int(loader.num_workers)
        self._warn_ineffective(loader)
        self._part = None  # a ProcessPart after for_process: this process's part of every batch
        self._plan: tuple[int, np.ndarray] = (0, self._order(0))

    @staticmethod
    def _warn_ineffective(loader) -> None:
        why = "jaxnitro reads the dataset in threads of this process; there are no worker processes"
        if loader.pin_memory:
            _warn("pin_memory=True", "has no effect: JAX copies batches from NumPy arrays, not from "
                  "torch's pinned memory. Drop it.")
        if loader.persistent_workers:
            _warn("persistent_workers=True", f"has no effect: {why}. Drop it.")
        if loader.worker_init_fn is not None:
            _warn("worker_init_fn", f"is never called: {why}. Set up what it prepares in the "
                  "dataset itself (lazily, thread-safe), or iterate with jn.TorchStream(loader).")
        if loader.timeout:
            _warn(f"timeout={loader.timeout}", f"has no effect: {why}.")
        if loader.multiprocessing_context is not None:
            _warn("multiprocessing_context", f"has no effect: {why}.")
        if getattr(loader, "in_order", True) is False:
            _warn("in_order=False", "has no effect: jaxnitro delivers batches in order, so a run "
                  "is reproducible at any worker count (PrefetchIterator(ordered=False) trades that).")

    def _order(self, epoch: int) -> np.ndarray:
        """The sample indices epoch ``epoch`` reads, in reading order (a function of (seed, epoch))."""
        s = self.sampler
        n = len(self.dataset)
        if type(s).__name__ == "SequentialSampler":
            return np.arange(n)
        rng = np.random.default_rng((self.seed, epoch))
        if type(s).__name__ == "SubsetRandomSampler":
            indices = np.asarray(s.indices)
            return indices[rng.permutation(len(indices))]
        k = s.num_samples  # RandomSampler
        if s.replacement:
            return rng.integers(0, n, size=k)
        return np.concatenate([rng.permutation(n) for _ in range(-(-k // n))])[:k]

    def __len__(self) -> int:
        return self._len

    @property
    def epoch(self) -> int:
        return self._plan[0]

    def bind_seed(self, seed: int) -> None:
        """Take the run's ``seed`` as the shuffle seed, unless ``seed=`` or a generator gave one.

        jaxnitro calls it once at setup, before any epoch is read (the source contract's
        optional ``bind_seed``); a negative run seed is taken modulo 2**64. The current
        epoch's order is redrawn."""
        if self.seed_from != "the run's seed":
            return
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise TypeError(f"TorchSource.bind_seed: the seed must be an int, got {seed!r}")
        self.seed = int(seed) % 2**64
        self.begin_epoch(self.epoch)

    def begin_epoch(self, epoch: int) -> None:
        """Fix epoch ``epoch``'s order: drawn from ``(seed, epoch)`` when the sampler shuffles."""
        epoch = check_epoch(epoch)
        self._plan = (epoch, self._order(epoch))

    def batch_at(self, i: int) -> dict:
        """Batch ``i`` (``0 <= i < len(self)``) of the current epoch; else ``IndexError``.

        ``batch_at(len(self))``, jaxnitro's check one past the end, raises
        ``SourceLengthError`` instead when the dataset serves a whole batch at its own
        ``__len__`` (:meth:`_hides_samples`): samples the loader would never read."""
        if not 0 <= i < self._len:
            if i == self._len and self._hides_samples():
                n = len(self.dataset)
                raise SourceLengthError.hidden(
                    None, self._len, self.epoch,
                    f"its DataLoader's dataset ({type(self.dataset).__name__}) still serves samples "
                    f"at and past its __len__ of {n} (dataset[{n}] returned one), while the loader "
                    f"draws its batches from the first {n} only",
                    "make the dataset's __len__ return the number of samples __getitem__ serves, or "
                    "make __getitem__ raise IndexError for an index >= __len__ (a dataset that serves "
                    "any index, e.g. generated data, must still bound it).",
                )
            raise IndexError(f"TorchSource: batch {i} out of range [0, {self._len})")
        return self._read(self._plan[1], int(i))

    def _hides_samples(self) -> bool:
        """Whether the dataset serves a whole batch past its ``__len__``: ``batch_size`` samples
        from index ``len(dataset)`` on (with ``batch_size=None``, a batch with rows at
        ``len(dataset)``). Any exception (the ``IndexError`` of a bounded dataset) is a no."""
        n = len(self.dataset)
        try:
            if self.batch_size is None:
                return bool(batch_rows(_as_batch(self.collate_fn(self.dataset[n]), self.fields, "")))
            for j in range(n, n + self.batch_size):
                self.dataset[j]
        except Exception:  # noqa: BLE001 - the end of the dataset
            return False
        return True

    def for_process(self, process_index: int, process_count: int) -> "TorchSource":
        """This source as process ``process_index`` of ``process_count`` reads it in a
        multi-process job (jaxnitro calls it for the splits ``build_data`` returns): every
        process draws the same epoch order, and of each batch process ``p`` reads (fetches from
        the dataset and collates) only the ``p``-th of ``process_count`` equal parts, so the
        parts put together are the one-process batch (see ``jaxnitro.distributed.ProcessPart``).

        Raises ``ValueError`` when the batch size does not divide by ``process_count``, or the
        loader has no batch size (``batch_size=None``: its batches cannot be split).
        """
        if self.batch_size is None:
            raise ValueError(
                "TorchSource: a DataLoader with batch_size=None yields whole batches from the "
                "dataset, which cannot be split among processes; give the loader a batch_size"
            )
        used = min(len(self.sampler), self._len * self.batch_size)
        return split_by_process(
            self, process_index, process_count,
            lambda: ProcessPart.of(process_index, process_count, self.batch_size, used, "TorchSource"),
            self._len, "TorchSource",
        )

    def _read(self, order: np.ndarray, i: int) -> dict:
        if self.batch_size is None:  # no auto-batching: the dataset returns whole batches
            value = self.collate_fn(self.dataset[int(order[i])])
        else:
            start, stop = (i * self.batch_size, (i + 1) * self.batch_size) if self._part is None else self._part.span(i)
            idx = order[start:stop].tolist()
            samples = self._getitems(idx) if self._getitems else [self.dataset[j] for j in idx]
            value = self.collate_fn(samples)
        return _as_batch(value, self.fields, f"the DataLoader's batch {i}")

    def __iter__(self):
        """The current epoch's batches in order (the plan is read once, at the start)."""
        order = self._plan[1]
        for i in range(self._len):
            yield self._read(order, i)

    def __repr__(self) -> str:
        return (
            f"TorchSource({type(self.dataset).__name__}, {self._len} batches, batch_size="
            f"{self.batch_size}, sampler={type(self.sampler).__name__}, drop_last={self.drop_last}, "
            f"seed={self.seed}{'' if self._part is None else f', process={self._part.index} of {self._part.count}'})"
        )


# -- iterated: an IterableDataset or a custom sampler ------------------------------------------


class TorchStream:
    """A jaxnitro source that iterates a torch ``DataLoader`` (one producer thread).

    For what :class:`TorchSource` cannot address: an ``IterableDataset``, a
    custom sampler or batch sampler. Each epoch iterates the loader afresh
    (``iter(loader)``), with all its options: its worker processes, pinning,
    sampler. ``len()`` is ``batches_per_epoch`` when given (each epoch takes
    the first that many batches), else ``len(loader)``. A loader without one (an
    ``IterableDataset`` without ``__len__``, a sampler or batch sampler without one)
    and no ``batches_per_epoch`` is a *stream without len()* (``len()`` raises
    ``TypeError``): each epoch is one whole pass of ``iter(loader)``, ending when
    the loader's does, and it can be the train split of a run bounded by
    ``max_steps`` (setup refuses it without one, naming the fix).

    Warnings, naming the option: ``num_workers > 0`` with no ``generator``
    (the workers' seeds come from torch's global RNG, so jaxnitro's fixed seed
    does not reproduce the split), ``pin_memory=True`` (no effect on JAX's
    copy; it costs one), ``in_order=False`` with workers (delivery order then
    varies between runs).

    **Resume** (a :class:`jaxnitro.plugin.StatefulStream`). A loader with
    ``state_dict()``/``load_state_dict()`` of its own (torchdata's
    ``StatefulDataLoader``), or one with ``num_workers=0`` over an ``IterableDataset``
    that has them, has its state taken after each batch it yields; a checkpoint
    records the one after the last trained batch (it must be JSON-able: ints, strings,
    lists, dicts), and a resumed run loads it (``load_state_dict``) before the pass
    continues, with nothing read again. The dataset's contract: ``load_state_dict(s)``
    makes its next ``__iter__`` continue from ``s``; a later ``__iter__`` starts a new
    pass. Any other loader is read again from the epoch's start and the trained batches
    dropped, with a warning (an ``IterableDataset`` in worker processes: the workers
    hold copies, whose positions this process cannot read).

    **Raises:** ``TypeError`` for another type than a ``DataLoader``; ``ValueError``
    for a bad ``batches_per_epoch``.
    """

    prefetch_workers = 1

    def __init__(self, loader: Any, *, batches_per_epoch: int | None = None,
                 fields: Sequence[str] | None = None, why: str | None = None):
        data = _torch_data()
        if not isinstance(loader, data.DataLoader):
            raise TypeError(f"TorchStream takes a torch.utils.data.DataLoader, got {type(loader).__name__}")
        if batches_per_epoch is not None:
            if isinstance(batches_per_epoch, bool) or not isinstance(batches_per_epoch, int) or batches_per_epoch < 1:
                raise ValueError(f"TorchStream: batches_per_epoch must be an int >= 1, got {batches_per_epoch!r}")
            n = batches_per_epoch
        else:
            try:
                n = len(loader)
            except TypeError:  # no len(): a stream, each epoch one whole pass of the loader
                n = None
        self.loader, self.fields = loader, check_fields(fields)
        self._len, self._take = n, batches_per_epoch is not None
        why = why or _unplannable(loader, data) or "iterated as asked"
        self._owner, no_state = _state_owner(loader, data)  # whose state_dict says where a pass is
        self._states, self._restore = PassStates(), None
        resume = "a resume restores its state_dict" if self._owner is not None else f"a resume re-reads ({no_state})"
        epochs = "" if n is not None else (
            "no len(): each epoch is a pass of iter(loader), ending when the loader's does (bound the "
            "run with max_steps, or give it batches_per_epoch=N); "
        )
        self.prefetch_note = f"torch DataLoader: not index-addressable ({why}); 1 producer; {epochs}{resume}"
        self._no_state = no_state
        if loader.num_workers > 0 and loader.generator is None:
            _warn(f"num_workers={loader.num_workers}", "with no generator: the workers' seeds (and a "
                  "shuffling sampler's order) come from torch's global RNG, so a fixed jaxnitro seed "
                  "stops reproducing this split. Pass generator=torch.Generator().manual_seed(seed).", 3)
        if loader.pin_memory:
            _warn("pin_memory=True", "has no effect on JAX's host-to-device copy and costs a copy; drop it.", 3)
        if loader.num_workers > 0 and getattr(loader, "in_order", True) is False:
            _warn("in_order=False", "delivers batches as workers finish them: the order, and so the "
                  "run, varies between runs. Drop it for a reproducible run.", 3)

    def __len__(self) -> int:
        if self._len is None:  # TypeError: what len() of an object without __len__ raises
            raise TypeError(
                f"jaxnitro: this DataLoader is a stream without len() ({_no_len(self.loader)}), so an "
                f"epoch ends when the loader's iteration does. It trains in a run bounded by "
                f"max_steps; for a len(), define __len__ on the dataset, or pass "
                f"jn.TorchStream(loader, batches_per_epoch=N) (each epoch takes the first N batches "
                f"of a fresh iteration)"
            )
        return self._len

    def __iter__(self):
        owner = self._owner
        if owner is None:
            batches = itertools.islice(self.loader, self._len) if self._take else self.loader
            for k, value in enumerate(batches):
                yield _as_batch(value, self.fields, f"the DataLoader's batch {k}")
            return
        restore, self._restore, done = self._restore, None, 0
        if restore is not None:
            owner.load_state_dict(restore["state"])
            done = restore["batches"]
        it = iter(self.loader)
        states = self._states
        states.begin({"batches": done, "state": copy.deepcopy(owner.state_dict())})
        batches = itertools.islice(it, self._len - done) if self._take else it
        for k, value in enumerate(batches, done + 1):
            batch = _as_batch(value, self.fields, f"the DataLoader's batch {k - 1}")
            states.record({"batches": k, "state": copy.deepcopy(owner.state_dict())})
            yield batch

    def iterator_state(self, batches: int) -> dict | None:
        """``{"batches": n, "state": state_dict}`` after the current pass's first ``batches``
        batches (``n`` counts from the epoch's start); None when the loader keeps no state."""
        return None if self._owner is None else self._states.after(batches)

    def restore_iterator(self, state: dict) -> None:
        """The next pass starts from ``state`` (what :meth:`iterator_state` returned)."""
        if self._owner is None:
            raise ValueError(f"TorchStream: this loader restores no state ({self._no_state})")
        if not (isinstance(state, dict) and isinstance(state.get("batches"), int) and "state" in state):
            raise ValueError(
                f"TorchStream.restore_iterator takes what iterator_state returned, a dict "
                f"{{'batches': int, 'state': state_dict}}; got {state!r}"
            )
        self._restore = state

    def __repr__(self) -> str:
        if self._len is None:
            return (f"TorchStream({type(self.loader.dataset).__name__}, a stream without len(): each epoch "
                    f"one pass of the loader)")
        return f"TorchStream({type(self.loader.dataset).__name__}, {self._len} batches per epoch)"


def _no_len(loader) -> str:
    """Why ``len(loader)`` raises: the dataset, or the (batch) sampler, has no ``__len__``."""
    dataset = loader.dataset
    try:
        len(dataset)
    except TypeError:
        return f"{type(dataset).__name__} defines no __len__"
    for part in ("sampler", "batch_sampler"):  # a BatchSampler has none when its sampler has none
        obj = getattr(loader, part, None)
        if obj is not None:
            try:
                len(obj)
            except TypeError:
                return f"its {part} {type(obj).__name__} defines no __len__"
    return "len(loader) raises TypeError"


def _state_owner(loader, data):
    """``(object whose state_dict/load_state_dict follow the loader's passes, None)``, or
    ``(None, why none)``."""
    def stateful(obj):
        return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))

    if stateful(loader):  # torchdata's StatefulDataLoader: its workers' positions too
        return loader, None
    dataset = loader.dataset
    if not isinstance(dataset, data.IterableDataset) or not stateful(dataset):
        return None, "neither the loader nor an IterableDataset has state_dict/load_state_dict"
    if loader.num_workers > 0:
        return None, (f"num_workers={loader.num_workers}: the worker processes iterate copies of the "
                      f"dataset; use torchdata's StatefulDataLoader, or num_workers=0")
    return dataset, None


# -- the hooks --------------------------------------------------------------------------------


@hookimpl(trylast=True)
def jaxnitro_adapt_source(source, split):
    """A torch ``DataLoader`` -> :class:`TorchSource` when its plan can be rebuilt, else
    :class:`TorchStream` (noted at setup; without ``len()`` when the loader has none, e.g.
    an ``IterableDataset`` without ``__len__``); anything else -> ``None``."""
    data = sys.modules.get("torch.utils.data")
    if data is None or not isinstance(source, data.DataLoader):
        return None
    why = _unplannable(source, data)
    if why is None:
        return TorchSource(source)
    stream = TorchStream(source, why=why)
    log.info("split is iterated by one producer", split=split, note=stream.prefetch_note,
             fix="a map-style dataset with torch's samplers is read by several ordered producers")
    return stream


@hookimpl(trylast=True)
def jaxnitro_exports():
    return {"TorchSource": TorchSource, "TorchStream": TorchStream}
