"""The shapes a plugin's objects take, as ``typing.Protocol``s (re-exported by :mod:`jaxnitro.plugin`).

jaxnitro has no base classes: a logger, a progress reporter, a data source, a stop
policy is any object with the methods below (structural typing). The protocols say
so to a type checker, and the core checks objects with them where it checks shapes
at all (``isinstance`` works: each is ``runtime_checkable``, which looks for the
methods, not their signatures; the core then names the missing method in its error).

This module imports nothing of jaxnitro, so every core module may use it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

from jax.sharding import PartitionSpec

__all__ = [
    "Batch",
    "Checkpointer",
    "Exporter",
    "IndexedSource",
    "LOGGER_VERBS",
    "Logger",
    "PREFETCHER_MEMBERS",
    "PrecisionPolicy",
    "Prefetcher",
    "REPORTER_METHODS",
    "Reporter",
    "RunFolderHold",
    "ShardingPolicy",
    "Source",
    "StatefulStream",
    "StopPolicy",
]

Batch = Mapping[str, Any]
"""One batch: ``{field: NumPy array}``, batch dimension first."""

LOGGER_VERBS = ("log_params", "log_other", "log_metrics", "finish")
"""The verbs every logger has (the members of :class:`Logger`)."""

REPORTER_METHODS = ("begin", "update", "close")
"""The methods every progress reporter has (the members of :class:`Reporter`)."""


@runtime_checkable
class Logger(Protocol):
    """What the ``logger`` knob's objects (and ``jaxnitro_make_logger``'s answers) offer.

    The ``logger_relay`` plugin (:mod:`jaxnitro.plugins.logger_relay`) calls the verbs from lifecycle
    events; a logger that raises gets nothing more that run (the others go on).
    Optional verbs, called only when the logger has them: ``info() -> dict`` (what
    identifies it: a path, a URL; ``jn.logger_info``), ``backend`` (the wrapped
    tracker object; ``jn.backend``), ``resume(step: int) -> None`` (the run continues an
    existing run folder from optimizer step ``step``: called once, before any other
    verb of the run) and ``flush() -> None`` (push what is buffered: called at each
    history row's end and each step boundary, before the checkpointer saves).
    """

    def log_params(self, params: dict[str, Any]) -> None:
        """The run's parameters (experiment fields, knobs, prefetch settings), once at run start."""

    def log_other(self, key: str, value: Any) -> None:
        """A named text or value (the binding report as ``"binding_report"``)."""

    def log_metrics(self, metrics: dict[str, Any], *, step: int, epoch: int, context: str) -> None:
        """Metrics at optimizer step ``step`` of ``epoch``; ``context`` is ``"train"`` (per-step
        scalars), ``"data"`` (an epoch's pipeline figures) or ``"validate"``."""

    def finish(self, status: str) -> None:
        """The run ended with ``status`` (``"done"``, ``"diverged"``, ``"interrupted"``,
        ``"preempted"``, ``"failed"``)."""


@runtime_checkable
class Reporter(Protocol):
    """A progress reporter (``jn.progress_reporter(obj)``, ``jaxnitro_make_progress_reporter``)."""

    def begin(self, total: int, label: str) -> None:
        """A stretch of ``total`` epochs begins (``total == 0``: named phases with no epochs, setup)."""

    def update(self, position: float, label: str) -> None:
        """Move to ``position`` (in epochs, fractional) and show ``label``."""

    def close(self, label: str) -> None:
        """The stretch ended; ``label`` says how (``"done: 40/40 epochs"``)."""


@runtime_checkable
class Source(Protocol):
    """A data split: ``len()`` batches per epoch, read in order by iterating.

    Optional: ``release()`` (free what it holds; the framework calls it at the run's
    end), ``bind_seed(seed)`` (draw the shuffle from the run's seed), ``info()`` (what
    the binding report shows), ``prefetch_workers`` (the producer threads it wants).
    """

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Batch]: ...


@runtime_checkable
class IndexedSource(Protocol):
    """An index-addressable source: several producers read it at once, in any order.

    ``begin_epoch(epoch)`` fixes that epoch's plan (its shuffle); ``batch_at(i)`` then
    returns its ``i``-th batch for ``0 <= i < len(source)``, deterministic and safe to
    call from several threads. ``jn.check_batch_at(source)`` verifies one. A list or
    tuple of batches is one too (indexing is ``batch_at``).
    """

    def __len__(self) -> int: ...

    def begin_epoch(self, epoch: int) -> None: ...

    def batch_at(self, i: int) -> Batch: ...


PREFETCHER_MEMBERS = ("source", "sized", "split", "__len__", "epoch", "release", "info")
"""The members every prefetcher has (those of :class:`Prefetcher`)."""


@runtime_checkable
class Prefetcher(Protocol):
    """A wrapped split: what the loop reads a split's epochs from.

    Setup wraps every split in one, through ``jaxnitro_make_prefetcher`` (the built-in
    ``prefetch`` plugin's ``jn.PrefetchIterator``; with no answer the core's serial
    ``jn.NoPrefetch``), unless ``build_data`` returned one already, which is used as it is.
    The core reads a prefetcher only through these members, never per batch but per pass:

    - ``source``: the source it reads (adapted: ``jaxnitro_adapt_source``); the core reads
      ``batch_at``/``begin_epoch``/``columns`` on it directly where it needs one batch
      (setup's checks, ``predict``'s example, a divergence's report), never ``iter()``;
    - ``sized``: whether it has ``len()`` (False: a stream, the train split of a run bounded
      by ``max_steps``);
    - ``split``: the split's name for messages; None until setup names it (the core sets it
      when it is None);
    - ``len()``: batches per epoch (``TypeError`` for a stream);
    - ``epoch(epoch, transfer=None, start=0)``: one pass, an iterator of batches in index
      order from batch ``start`` on, each passed through ``transfer`` (the host-to-device
      copy of the routed fields) before it is delivered; nothing may happen before its
      first ``next()``, and closing it (or dropping it) ends the pass. A batch that cannot
      be produced raises ``jaxnitro.PrefetchError`` naming the index (``SourceLengthError``
      when an iterated source yields other than ``len()`` batches);
    - ``release()``: stop any open pass and call ``source.release()`` when defined (once,
      at a run's end);
    - ``info()``: how the split is read, for the binding report and ``run_params``: a dict
      with any of ``path``, ``workers``, ``device_batches``, ``host_batches``, ``ordered``,
      ``addressable``, ``note`` (those missing show as ``?``).

    Optional: ``adopt(split)``, called once at setup after ``split`` is set (the built-in
    warns there when a source that is not index-addressable gets one producer where the
    default would run several). Setup also sets ``first_batch_spec`` on the train split's
    prefetcher (what ``predict`` compares its inputs with). ``jaxnitro.plugin.SplitWrapper``
    is a base that implements all of it, reading serially; a subclass overrides ``_stream``.
    """

    source: Any
    sized: bool
    split: str | None

    def __len__(self) -> int: ...

    def epoch(self, epoch: int, transfer: Callable[[Batch], Any] | None = None, start: int = 0) -> Iterator[Any]: ...

    def release(self) -> None: ...

    def info(self) -> dict[str, Any]: ...


@runtime_checkable
class StatefulStream(Protocol):
    """A source that is iterated (not index-addressable) and can say where a pass over it
    is, and continue a pass from there: a resumed run then starts exactly after the last
    trained batch, with nothing read again (``jn.GrainStream``; ``jn.TorchStream`` over a
    loader or ``IterableDataset`` with ``state_dict``/``load_state_dict``).

    - ``iterator_state(batches)``: where the pass in progress (the latest ``__iter__``)
      continues after its first ``batches`` batches, counted from the pass's start (or
      from the state it was restored to): a JSON-able value (dicts, lists, str, numbers,
      bool, None), which a checkpoint records. ``None``: this source cannot say (a resume
      then reads the epoch again and drops what was trained, with a warning). The core asks
      from the consumer's thread, when a checkpoint is written, for a count the pass has
      already yielded; since prefetch reads ahead of training, the source keeps the state
      after each batch it yields, for at least the batches read ahead
      (:class:`jaxnitro.plugin.PassStates` does that bookkeeping).
    - ``restore_iterator(state)``: the next pass (the next ``__iter__``) continues from
      ``state`` (one ``iterator_state`` returned, by a source of the same type) instead
      of starting afresh; the passes after it start afresh.
    """

    def __iter__(self) -> Iterator[Batch]: ...

    def iterator_state(self, batches: int) -> Any: ...

    def restore_iterator(self, state: Any) -> None: ...


@runtime_checkable
class StopPolicy(Protocol):
    """What the ``early_stop`` knob's value offers to the built-in early-stopping plugin.

    ``should_stop`` is asked at every validated history row with the monitored value
    and its mode (``"max"`` or ``"min"``). Optional: ``reset()`` (called at run start)
    and ``patience`` (named in the stop reason). A policy of another kind is fine as
    long as the plugin that accepts it (``jaxnitro_accept_knob``) applies it, as
    ``jn.OptunaPruning`` is accepted and applied by the optuna plugin: the plugin that
    accepts a knob is the only one that acts on it.
    """

    def should_stop(self, epoch: int, value: float, mode: str) -> bool: ...


@runtime_checkable
class Checkpointer(Protocol):
    """The hooks a checkpointer plugin implements (a module or an object registered as a plugin).

    It accepts the ``checkpointer`` knob (``jaxnitro_accept_knob``: return True for a
    value it acts on), asks for the steps it saves at (``jaxnitro_step_period``), saves
    ``run.run_state.snapshot()`` (a :class:`jaxnitro.plugin.SavedRun`) at history rows' ends
    and step boundaries, writes what it holds as the run ends (``jaxnitro_run_ending``: a
    failure there fails the run), and finds saved checkpoints for ``weights=`` / ``resume=``
    (``jaxnitro_load_weights``, returning a :class:`jaxnitro.plugin.WeightsRecord`). The
    built-in one is ``jaxnitro.checkpointers.orbax``. It acts only on a knob it accepted
    (:func:`jaxnitro.plugin.owns_knob`).
    """

    def jaxnitro_accept_knob(self, name: str, value: Any, nitro: Any) -> bool | None: ...

    def jaxnitro_run_start(self, run: Any) -> None: ...

    def jaxnitro_epoch_end(self, run: Any, row: dict[str, Any]) -> None: ...

    def jaxnitro_run_ending(self, run: Any, status: str) -> None: ...

    def jaxnitro_load_weights(self, spec: Any, run_dir: str, experiment: Any, monitor: tuple[str, str] | None,
                              purpose: str) -> Any: ...


@runtime_checkable
class Exporter(Protocol):
    """The hook an exporter plugin implements (a module or an object registered as a plugin).

    ``nitro.export(path, **options)`` asks ``jaxnitro_export`` (``firstresult``) with the
    handle's :class:`jaxnitro.plugin.InferenceProgram`; the first plugin returning what it
    wrote (not ``None``) has exported, and ``nitro.export`` returns that. The built-in one is
    ``jaxnitro.plugins.export`` (``jax.export`` and ``metadata.json``; it also exports
    ``jn.load_exported``, ``jn.ExportedForward`` and ``jn.ExportError``), marked ``trylast``,
    so an installed exporter replaces it.
    """

    def jaxnitro_export(self, program: Any, path: Any, options: dict[str, Any]) -> Any: ...


@runtime_checkable
class RunFolderHold(Protocol):
    """What ``jaxnitro_hold_run_folder`` returns: one run's hold on its folder (the built-in is
    the ``run_lock`` plugin's lock, ``<run folder>/.jaxnitro-run.lock``).

    The core registers it as a plugin for that run only (from before ``jaxnitro_run_start``
    to after ``jaxnitro_run_finish``), so the lifecycle hooks it implements with
    ``@hookimpl`` see that run (the built-in checks at each cut that the folder is still
    there), and calls :meth:`release` once at the run's end.
    """

    def release(self, status: str) -> None:
        """The run ended with ``status`` (``"done"``, ``"diverged"``, ``"interrupted"``,
        ``"preempted"``, ``"failed"``): give the folder up. Called whatever the status, after
        every ``jaxnitro_run_finish``; what it raises propagates (replacing none: the core
        calls it in a ``finally``)."""


@runtime_checkable
class PrecisionPolicy(Protocol):
    """What ``jaxnitro_precision_policy`` returns: the compute precision and remat of a run's
    programs (the built-in is the ``precision`` plugin's). Setup gets one from the
    ``precision`` and ``remat`` knobs, then :meth:`for_params` once the handle's trainable
    params are known; the programs call the rest, the casts and remat inside their traces.

    The bodies below are float32 compute without remat (nothing cast, nothing checkpointed):
    the core's policy when no plugin answers (``jaxnitro.precision.FLOAT32``, a subclass)."""

    kept: tuple[str, ...] = ()
    """Paths of the parameters kept float32 under a low precision (``print(nitro)``)."""

    def for_params(self, experiment: Any, hooks: Mapping[str, Any], params: Any) -> PrecisionPolicy:
        """The policy of one handle: ``hooks`` are its resolved experiment hooks (refuse, naming
        the knob and the fix, what they cannot honour; ask ``keep_float32``)."""
        return self

    def key(self) -> tuple:
        """A hashable part of every program key (a trace-time constant)."""
        return ("precision", "float32", (), False)

    def compiler_options(self) -> dict | None:
        """XLA options for the programs that differentiate ``forward`` (None: none)."""
        return None

    def describe(self) -> str:
        """The ``precision`` line of ``print(nitro)``."""
        return "float32"

    def describe_remat(self) -> str:
        """The ``remat`` line of ``print(nitro)``."""
        return "off"

    def cast_params(self, params: Any) -> Any:
        """``forward``'s params (traced), cast to the compute dtype."""
        return params

    def cast_inputs(self, fields: dict[str, Any]) -> dict[str, Any]:
        """``forward``'s batch fields (traced), cast to the compute dtype."""
        return fields

    def outputs(self, outputs: Any, new_state: Any, state: Any) -> tuple[Any, Any]:
        """``forward``'s ``(outputs, new state)`` for the loss and metrics (float32)."""
        return outputs, new_state

    def rematerialized(self, model: Any, fn: Callable[..., Any], inference: bool) -> tuple[Any, Callable[..., Any]]:
        """``(model, forward)`` as the program runs them (under ``jax.checkpoint`` with remat)."""
        return model, fn


@runtime_checkable
class ShardingPolicy(Protocol):
    """What ``jaxnitro_sharding_policy`` returns: the ``sharding`` and ``mesh_shape`` knobs,
    checked, and where each parameter of a handle lives on its mesh (the built-in is the
    ``sharding`` plugin's). Setup builds the mesh from :attr:`mesh_shape`, then asks
    :meth:`specs` once the params exist; the optimizer state follows its parameter (the
    core's ``Layout.with_opt``).

    The bodies below replicate every parameter on the 1-D ``"data"`` mesh: the core's
    policy when no plugin answers (``jaxnitro.sharding.REPLICATED``, a subclass)."""

    mode: str = "replicated"
    """The ``sharding`` knob's rule (``print(nitro)``; a run with split params is keyed by its specs)."""
    mesh_shape: dict[str, int] | None = None
    """``{axis: size}`` of the mesh (one axis ``"data"``), or None for the 1-D ``"data"`` mesh."""

    def specs(self, paths: tuple, leaves: list, mesh: Any, rule: Callable[..., Any] | None,
              cls_name: str) -> tuple[str, tuple]:
        """``(mode, specs)``: one ``jax.sharding.PartitionSpec`` per parameter leaf (``paths``:
        their key paths, tuples of str/int; ``leaves``: the arrays), over ``mesh``'s axes;
        ``rule(path, leaf)`` is the experiment's ``param_sharding`` hook (None when it has none),
        ``mode`` what placed them (``"rules"`` when that hook answered). Raise naming the
        parameter, the spec and the fix for one that does not fit."""
        if rule is not None:
            raise ValueError(
                f"jaxnitro: {cls_name} defines `param_sharding`, which needs the built-in plugin "
                f"`sharding` (entry point `sharding` in group `jaxnitro`), and it is not loaded. Fix: "
                f"re-enable it (drop `sharding` from JAXNITRO_DISABLE_PLUGINS) or install a plugin "
                f"implementing `jaxnitro_sharding_policy`.")
        return "replicated", tuple(PartitionSpec() for _ in paths)
