"""The hook contracts of jaxnitro, as pluggy hookspecs.

Three families live here.

**Experiment hooks** (module-level functions below) are plain methods on an
experiment class (no decorator). The core resolves each one once, when a
:class:`jaxnitro.Nitro` is built: the experiment's own method wins, then an
installed plugin's implementation, then the built-in default
(:mod:`jaxnitro.defaults`). The core calls the chosen implementation itself,
because batch fields are routed to hooks as keyword-only arguments:
``def forward(self, model, state, *, img)`` receives the batch's ``img`` and
nothing else. The ``batch`` parameter of a spec stands for those keyword-only
fields (pluggy ignores keyword-only parameters when it validates).

An experiment's own method may name its positional parameters freely
(``def loss(self, logits, *, label)``): they are passed by position and only
their count must match the spec (checked at setup, naming the hook). The
annotations are the contract's types (``batch`` stands for keyword-only fields). A
plugin module's implementation is validated by pluggy and uses the spec's
names, ``self`` first: every implementation is called with the experiment as
its first argument, the real experiment in host-side hooks and its compile
view (Device values traced, Host fields stripped) in traced hooks
(``forward``, ``loss``, ``train_metrics``, device-resident ``metrics``).

**Extension hooks** (:class:`ExtensionSpec`) answer one question each
(``firstresult``): make a logger from a name, choose the default logger,
adapt a foreign data source, make a progress reporter, accept a run knob,
render a history, describe a handle, export public names, export the
inference program, load weights, wrap a split in a prefetcher, make the precision
policy, start this process's devices, join a multi-process job.

**Lifecycle hooks** (:class:`LifecycleSpec`) are called for every plugin at
fixed points: each setup step, a run's start, a phase's start, a stretch of
steps read, an epoch trained, a split evaluated, an epoch's end, the run's
finish, a progress note, and before a verb.

Extension and lifecycle hooks are implemented by modules registered as entry
points in group ``jaxnitro`` (``[project.entry-points.jaxnitro]``), the
built-in features included, exactly as a third-party package registers its
own; their names start with ``jaxnitro_``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any, Literal

import pluggy

if TYPE_CHECKING:  # the annotations only: none of these is imported at run time
    from os import PathLike
    from pathlib import Path

    import jax

    from .contracts import (IndexedSource, Logger, PrecisionPolicy, Prefetcher, Reporter, RunFolderHold,
                            ShardingPolicy, Source)
    from .distributed import Dist
    from .events import RunContext, StepStretch
    from .first_step import FirstStep
    from .handle import Nitro
    from .inference import InferenceProgram
    from .knobs import ResolvedKnob
    from .history import MetricHistory
    from .manual import Optimizers
    from .weights import WeightsRecord

PROJECT = "jaxnitro"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# == experiment hooks =====================================================
# Module-level, so their first parameter (``self``, the experiment) is part of
# the contract: a plugin module's implementation takes it too.

# -- data and model ---------------------------------------------------

@hookspec(firstresult=True)
def build_data(self, dist: Dist | None) -> dict[str, Any]:
    """Return the splits: ``{"train": source, "val": source, "test": ...}``.

    Runs on the host against the real experiment (Host fields readable).
    A source is an iterable of dicts of host (NumPy) arrays with ``len()``;
    the batch dimension is first. ``train`` must drop its partial final
    batch and its batch count must divide by ``accum``. ``dist`` is
    reserved for a distribution handle and is ``None`` in one process.
    Skipped when ``Nitro(e, data=...)`` is given.
    """

@hookspec(firstresult=True)
def derive(self, data: dict[str, Any]) -> dict[str, Any]:
    """Return ``{field: host value}`` computed from the data.

    Runs after ``build_data`` and before Device fields are converted; the
    result is merged into the experiment with ``attrs.evolve``. An unknown
    field name raises.
    """

@hookspec(firstresult=True)
def build_model(self, key: jax.Array) -> Any:
    """Return an Equinox model, or ``(model, state)`` from ``eqx.nn.make_with_state``.

    ``key`` is a ``jax.random`` key derived from the run's ``seed``. The model may be
    a dict of named Equinox modules (``{"generator": g, "discriminator": d}``): each
    model's parameters then form their own group(s) and get their own optimizer
    (see ``param_group``), which a ``train_step`` applies by name.
    """

# -- traced hooks -----------------------------------------------------

@hookspec(firstresult=True)
def forward(self, model: Any, state: Any, batch: Any) -> tuple[Any, Any]:
    """Return ``(outputs, state)``. Batch fields arrive as keyword-only arguments.

    ``state`` is the ``eqx.nn.State`` (``None`` for a stateless model); the
    core strips the returned state before ``loss``/``metrics``. During
    evaluation and prediction ``model`` is in inference mode.
    """

@hookspec(firstresult=True)
def loss(self, outputs: Any, batch: Any) -> jax.Array:
    """Return the scalar loss of one batch (traced, differentiated)."""

@hookspec(firstresult=True)
def metrics(self, outputs: Any, batch: Any) -> dict[str, tuple[Any, Any]]:
    """Return ``{name: (value, mode)}`` for one evaluation batch.

    ``mode`` is a number (a count: values and counts are summed over the
    split and divided once), ``"sum"``, ``"max"``, ``"min"`` or
    ``"concat"``. Never sees padding rows. Default: ``{"loss": (loss, 1)}``.
    """

@hookspec(firstresult=True)
def train_metrics(self, outputs: Any, batch: Any) -> dict[str, Any]:
    """Return ``{name: scalar}``: per-step diagnostics traced in the gradient program.

    With ``metrics_residency("train_metrics") == "host"`` it runs on the host instead, on
    NumPy arrays, once per micro-batch, through a host callback inside the same program
    (every micro-batch's outputs then cross to the host; see docs/metrics.md)."""

@hookspec(firstresult=True)
def train_step(self, models: Any, optimizers: Optimizers, batch: Any) -> tuple[Any, Optimizers, dict[str, Any]]:
    """Manual training: one optimizer step written by the experiment (traced).

    ``models`` is what ``build_model`` returned (a dict of named Equinox modules,
    or one module), in training mode; ``optimizers`` is a
    :class:`jaxnitro.Optimizers`: ``optimizers.update(grads, model, name=...)``
    applies the named model's optimizer (its groups' rules, learning rates and
    schedules) and returns ``(updated model, updated optimizers)``. Batch fields
    arrive as keyword-only arguments; ``key`` (keyword-only) is a fresh PRNG key
    per step. Returns ``(models, optimizers, {name: scalar})``: the scalars are
    logged as train lines (``loss`` becomes the history's ``train_loss``, every
    other ``name`` a ``train_<name>`` column), and a non-finite one stops the run
    as diverged. An experiment defining ``train_step`` defines no ``loss``
    (``metrics`` reports validation) and uses ``accum = 1``. Every model with an
    optimizer gets its ``update`` (or ``optimizers.skip(name)``) in the returned
    ``Optimizers``, else the trace refuses the step naming the model. A model with
    state reads it as ``optimizers.model_state`` and hands the new one back with
    ``optimizers.with_model_state(state)``.
    """

@hookspec(firstresult=True)
def finalize_metrics(self, acc: dict[str, Any], split: str) -> dict[str, Any]:
    """Host-side: turn the reduced split metrics ``acc`` into what is reported.

    Counted keys arrive divided, ``"sum"`` keys as raw totals. The return
    value replaces ``acc`` for the logger, early stopping and history.
    """

@hookspec(firstresult=True)
def metrics_residency(self, hook: str) -> Literal["device", "host"]:
    """Return ``"device"`` or ``"host"`` for ``hook`` (``"metrics"`` or ``"train_metrics"``).

    Defaults: ``"device"`` for ``train_metrics``, ``"host"`` for ``metrics``.
    """

# -- optimizer --------------------------------------------------------

@hookspec(firstresult=True)
def param_group(self, keypath: tuple[str | int, ...], leaf: Any) -> str:
    """Return the group name of the parameter at ``keypath`` (a tuple of str/int).

    ``leaf`` is optional: an implementation that declares a second positional parameter
    (``param_group(self, keypath, leaf)``) also receives the parameter array itself, as
    ``build_model`` made it (read its ``ndim``, ``shape``, ``dtype``; do not keep it), so
    "decay the 2-D weights only" is ``return "decay" if leaf.ndim >= 2 else "no_decay"``.
    The one-argument form ``param_group(self, keypath)`` is called without it. Called
    once per trainable array, at setup.

    Default: ``"default"``; when ``build_model`` returns a dict of models, the model's
    name (``keypath[0]``), so each model gets its own optimizer.
    """

@hookspec(firstresult=True)
def learning_rate(self) -> float:
    """Return the base learning rate (default ``1e-3``)."""

@hookspec(firstresult=True)
def learning_rate_ratio(self, group: str) -> float:
    """Return ``group``'s rate as a ratio of the base rate (default ``1.0``)."""

@hookspec(firstresult=True)
def weight_decay(self, group: str) -> float:
    """Return ``group``'s decoupled weight decay (default ``0.0``)."""

@hookspec(firstresult=True)
def optimizer(self, group: str) -> Callable[..., Any]:
    """Return an optax rule factory taking ``learning_rate`` (default ``optax.radam``)."""

@hookspec(firstresult=True)
def decay_anchor(self, group: str) -> Literal["zero", "w0"]:
    """Return where ``group``'s decoupled weight decay pulls: ``"zero"`` (default) or ``"w0"``.

    ``"w0"`` is L2-SP: the decay pulls toward the group's initial weights (those
    ``build_model`` made), or toward the transferred weights when the handle is
    built with ``weights=...`` and ``w0="weights"``. The anchor is a copy of
    those weights held in the optimizer state (restored with it on resume).
    """

@hookspec(firstresult=True)
def monitor(self) -> tuple[str, Literal["max", "min"]] | None:
    """Return ``(metric, "max" | "min")``: the metric the run is judged by."""

# -- precision and throughput (the throughput plugin asks samples_per_batch) -------------------------------------------------

@hookspec(firstresult=True)
def keep_float32(self, path: tuple) -> bool:
    """Return True to keep the parameter at ``path`` in float32 under ``precision="bfloat16"``.

    ``path`` is the parameter's key path as ``param_group`` receives it (a tuple of ``str``
    and ``int``, e.g. ``("norm", "weight")``). Asked once per trainable array at setup, only
    under a precision below float32; the answers are a trace-time constant (part of the
    program key). A parameter kept float32 makes its layer compute in float32 (bfloat16
    inputs are promoted): use it for LayerNorm scales, the loss head. Default: False.
    """

@hookspec(firstresult=True)
def samples_per_batch(self) -> int | dict[str, int]:
    """Say what one train batch holds, for the throughput figures (see docs/precision.md).

    Return an ``int`` (samples in one train batch of the whole job: history and log get
    ``samples_per_sec``) or ``{unit: count}`` (e.g. ``{"tokens": 64 * 1024}``:
    ``tokens_per_sec``). Called once per ``train()`` on the host. Without it only
    ``steps_per_sec`` (and, with known FLOPs and peak, ``mfu``) are reported.
    """

@hookspec(firstresult=True)
def param_sharding(self, path: tuple, leaf: Any) -> Any:
    """Return where the parameter at ``path`` (a tuple of str/int, as ``param_group`` gets it)
    lives on the mesh: a ``jax.sharding.PartitionSpec`` over the mesh's axes (named by the
    ``mesh_shape`` run knob, e.g. ``PartitionSpec(None, "model")`` splits the second dimension
    over ``"model"``), or ``None`` for the ``sharding`` knob's rule (``"replicated"``: whole on
    every device; ``"fsdp"``: split over ``"data"``). ``leaf`` is the array as ``build_model``
    made it (read its ``shape``). Called once per trainable array, at setup; the parameter's
    optimizer state follows its spec. A spec naming an axis the mesh lacks, or splitting a
    dimension that does not divide, is refused naming the parameter. No default: without it
    every parameter follows the ``sharding`` knob.
    """



class ExtensionSpec:
    """Extension hooks, implemented by entry-point plugins (group ``jaxnitro``).

    Each is ``firstresult``: plugins are asked in pluggy's order (the most
    recently registered first, ``trylast`` implementations last) and the first
    answer that is not ``None`` wins. Every built-in implementation is
    ``trylast``, so an installed plugin answering the same question wins,
    whatever the install order.
    """

    @hookspec(firstresult=True)
    def jaxnitro_make_logger(self, name: str, run_dir: Path, experiment: Any) -> Logger | None:
        """Return a logger for ``name`` (e.g. ``"jsonl"``), or ``None`` if not yours.

        ``run_dir`` is the run's own folder (a ``pathlib.Path``, created).
        A logger is any object with the verbs the framework calls:
        ``log_params(params)``, ``log_other(key, value)``,
        ``log_metrics(metrics, *, step, epoch, context)``, ``finish(status)``
        and optionally ``info()``.
        """

    @hookspec(firstresult=True)
    def jaxnitro_default_logger(self) -> str | None:
        """Return the name of the logger a run uses when the ``logger`` knob is not set.

        The core names no logger itself. With no answer, a run logs nothing.
        """

    @hookspec(firstresult=True)
    def jaxnitro_adapt_source(self, source: Any, split: str | None) -> Source | IndexedSource | None:
        """Return a jaxnitro source wrapping a foreign loader, or ``None`` if not yours.

        Asked for every split the framework wraps, and by ``PrefetchIterator`` /
        ``NoPrefetch`` for the source they are given, so a loader is adapted
        whether or not the user wraps it; ``split`` is then ``None`` (the wrapper
        is named later) and is ``"predict"`` for what ``predict`` reads.
        """

    @hookspec(firstresult=True)
    def jaxnitro_make_progress_reporter(self, name: str) -> Reporter | None:
        """Return a progress reporter for ``name`` (``"auto"`` = the default), or ``None``.

        A reporter has ``begin(total, label)``, ``update(position, label)``
        (``position`` in epochs, fractional) and ``close(label)``. ``total == 0``
        is a stretch of named phases with no epochs (setup): show the label, no rate.
        """

    @hookspec(firstresult=True)
    def jaxnitro_accept_knob(self, name: str, value: Any, nitro: Nitro) -> bool | None:
        """Say whether this plugin acts on run knob ``name`` set to ``value``.

        Asked at setup for every run knob that the core does not act on itself
        (``early_stop``, ``checkpointer``, ``profile``) when its value is not ``None``.
        Return ``True`` to take charge of it; raise (naming the knob, the
        problem and the fix) if the value is wrong for ``nitro``, a handle
        whose data, hooks, ``monitor`` and settings are resolved. A knob no
        plugin accepts is refused at setup, naming any disabled plugins.
        """

    @hookspec(firstresult=True)
    def jaxnitro_render_history(self, history: MetricHistory, format: str, options: dict[str, Any]) -> Any:
        """Render a :class:`jaxnitro.MetricHistory`; return ``None`` if ``format`` is not yours.

        ``format`` is ``"text"`` (a table for a terminal; ``options`` may hold
        ``width`` and ``max_rows``), ``"html"`` (a notebook table), ``"csv"``
        (write ``options["path"]``, return the path) or ``"pandas"`` (return a
        ``pandas.DataFrame``). Other formats may be answered by other plugins.
        """

    @hookspec(firstresult=True)
    def jaxnitro_describe(self, subject: Any, format: str) -> str | None:
        """Describe ``subject`` (a :class:`jaxnitro.Nitro` or an experiment instance).

        ``format`` is ``"text"`` (``print(nitro)``, sized to the terminal),
        ``"html"`` (a notebook) or ``"report"`` (fixed-width plain text: the
        binding report a run logs). Return ``None`` if not yours; the core then
        shows a one-line summary.
        """

    @hookspec(firstresult=True)
    def jaxnitro_plot(self, history: MetricHistory, options: dict[str, Any]) -> Any:
        """Plot a :class:`jaxnitro.MetricHistory`; return the figure, or ``None`` if not yours.

        ``options`` are the keywords of ``h.plot(...)``: ``metrics`` (None, a name, a
        list or ``"all"``), ``x`` (``"epoch"`` or ``"step"``), ``ax`` (axes to draw
        into) and ``title``.
        """

    @hookspec
    def jaxnitro_exports(self) -> dict[str, Any] | None:
        """Return ``{name: object}``: public names this plugin adds to the ``jaxnitro`` namespace.

        ``jn.EarlyStopping`` is the early-stopping plugin's export. A name the
        core already defines cannot be replaced; two plugins exporting one
        name is an error naming both.
        """

    @hookspec(firstresult=True)
    def jaxnitro_load_weights(self, spec: Any, run_dir: str, experiment: Any, monitor: tuple[str, str] | None, purpose: Literal["weights", "resume"]) -> WeightsRecord | None:
        """Find the checkpoint(s) ``spec`` names; return a :class:`jaxnitro.weights.WeightsRecord`.

        ``spec`` is what the handle was given: a checkpoint path, a run folder (name or
        path), a ``(run, checkpoint)`` pair such as ``("latest", "best")``,
        ``("latest", "last")``, ``("latest", 1200)`` (a step), an average such as
        ``("latest", jn.Average(jn.Last(10)))``, or ``"auto"`` (``purpose="resume"``:
        the newest checkpoint a run can continue from, of the newest run that
        :func:`jaxnitro.weights.incompatibility` does not rule out for ``experiment``).
        What differs from what ``spec`` asked (an average of fewer checkpoints, runs
        passed over) goes in the record's ``notes``, which the core warns. ``run_dir`` is the ``run_dir``
        knob (the folder holding run folders); ``monitor`` is ``(metric, "max" | "min")``
        or None (what ``"best"`` ranks by); ``purpose`` is ``"weights"`` or ``"resume"``.

        Return ``None`` if ``spec`` is not a form this plugin reads. Raise
        :class:`jaxnitro.weights.NoCheckpointError` when nothing matches (for
        ``resume="auto"`` the core then warns and starts fresh), and ``ValueError``
        naming the path and the fix for a corrupt or incomplete checkpoint. Nothing is
        read into memory but the record's metadata: the core checks it against the
        experiment before it calls ``record.restore``.
        """

    @hookspec(firstresult=True)
    def jaxnitro_export(self, program: InferenceProgram, path: str | PathLike[str], options: dict[str, Any]) -> str | None:
        """Write ``program`` (``nitro.export(path, **options)``) to ``path``; return what was
        written (the path, as ``nitro.export`` returns it), or ``None`` if you do not export.

        ``program`` is a :class:`jaxnitro.inference.InferenceProgram`: the handle's ``forward``
        in inference mode (``program.apply``, traceable), its weights, Device values and key
        entries, and ``program.signature(example)``, the input signature (read it after
        checking the destination: on a handle without data it records the reference batch).
        ``options`` are ``nitro.export``'s keywords: ``example``, ``device_inputs``,
        ``symbolic_batch``, ``platforms``, ``overwrite``. Raise (naming the path or the
        option and the fix) for what cannot be exported. The built-in answer (``trylast``) is
        the ``export`` plugin: ``jax.export`` plus ``metadata.json``, read by
        ``jn.load_exported``. With no answer ``nitro.export`` raises, naming that plugin.
        """

    @hookspec(firstresult=True)
    def jaxnitro_make_prefetcher(self, source: Source | IndexedSource, split: str) -> Prefetcher | None:
        """Wrap split ``split``'s ``source`` in the prefetcher the loop reads it through, or return ``None``.

        Asked once per split when a handle is built (setup's ``"building data"`` step), after
        ``jaxnitro_adapt_source``, for every split ``build_data`` (or ``data=``) did not return
        wrapped already (a :class:`jaxnitro.plugin.Prefetcher`, e.g. ``jn.PrefetchIterator(src,
        workers=2)`` or ``jn.NoPrefetch(src)``, is used as it is). ``source`` is a jaxnitro
        source: it has ``len()`` unless ``split`` is ``"train"`` and it is an iterable stream;
        it is iterable, or index-addressable (``batch_at``/``begin_epoch``), or a list of batches.

        The answer must have the :class:`jaxnitro.plugin.Prefetcher` members (``source``,
        ``sized``, ``split``, ``len()``, ``epoch(epoch, transfer=None, start=0)``, ``release()``,
        ``info()``); the core refuses another answer at setup, naming the plugin. The loop calls
        its ``epoch(...)`` once per pass (a training epoch, an evaluation), never this hook per
        batch; delivering in index order keeps a fixed seed reproducing a run bitwise.
        With no answer, the core reads the split serially with its ``jn.NoPrefetch`` (the
        fallback). The built-in ``prefetch`` plugin answers ``jn.PrefetchIterator(source)``
        (``trylast``): ordered producer threads and transfers staged one batch ahead.
        """

    @hookspec(firstresult=True)
    def jaxnitro_new_run_folder(self, root: str, experiment: Any) -> str | None:
        """Create a new, empty folder for one run under ``root`` and return its path, or ``None``
        if not yours.

        ``root`` is the ``run_dir`` knob as an absolute path; it may not exist yet (create it).
        Never return a folder that existed before the call: a run folder holds one run (its
        lock, ``metrics.jsonl``, checkpoints), and two runs started at once must get two
        folders. ``experiment`` is the experiment instance being trained (name the folder
        after it if you like). Called at the start of each ``train()`` that does not continue
        a resumed run's folder; in a multi-process job, on process 0 only. An ``OSError``
        raised here is reported naming ``run_dir`` and the fix. The built-in answer
        (``run_folder`` plugin) is ``<root>/<YYYYmmdd-HHMMSS>-<n>``; the checkpointer's
        ``("latest", ...)`` and ``resume="auto"`` look for folders named that way.
        """

    @hookspec(firstresult=True)
    def jaxnitro_hold_run_folder(self, folder: str, dist: Dist | None) -> RunFolderHold | None:
        """Take ``folder`` (absolute, created) for one run, so that no other run writes it
        meanwhile; return the hold (a :class:`jaxnitro.plugin.RunFolderHold`), or ``None`` if
        not yours.

        Called once per ``train()``, after the folder is named (or a resumed run's folder is
        chosen to continue) and before anything is written into it: no logger is made and no
        lifecycle hook of the run has been called. ``dist`` is the handle's
        :class:`jaxnitro.distributed.Dist` (``process_count``, ``is_main``, ``from_main``). In a
        multi-process job (``dist.multi_process``) it is called on every
        process at the same point, on the job's one folder: the answer must agree across
        processes (the built-in locks on process 0 and tells the others with
        ``dist.from_main``). To refuse the run, raise on every process (the built-in raises
        ``jn.RunFolderInUse``, naming the owner and the fix): the run is then ``"failed"``
        before it starts, and no run hook and no ``release`` is called.

        The core registers the returned object as a plugin for this run only (its lifecycle
        hooks see this run: the built-in checks at each cut that the folder is still there,
        raising ``jn.RunFolderLost``) and calls ``hold.release(status)`` once at the run's end,
        whatever the status, after every ``jaxnitro_run_finish``. With no answer the run
        trains unlocked, with a ``RuntimeWarning`` naming the ``run_lock`` plugin.
        """

    @hookspec(firstresult=True)
    def jaxnitro_persistent_cache(self, path: str | None) -> str | None:
        """Switch a persistent (on-disk) compilation cache on for this process; return its
        folder's absolute path, or ``None`` if not yours.

        Asked by ``jn.enable_persistent_cache(path)``. ``path`` is the folder asked for, or
        ``None`` for your default. Every program compiled afterwards should be written there
        and read back by a later process. The built-in answer (``compilation_cache`` plugin)
        is JAX's own cache (``jax_compilation_cache_dir``).
        """

    @hookspec(firstresult=True)
    def jaxnitro_preflight(self, nitro: Nitro, step: FirstStep, refuse: bool) -> Any:
        """Check, before it runs, that ``nitro``'s train step fits the device; return a report,
        or ``None`` if not yours.

        ``step`` is a :class:`jaxnitro.plugin.FirstStep`: the programs the loop's first
        optimizer step runs, each with the arguments of its first dispatch (compile them with
        ``jitted.lower(*args).compile()``: the step then compiles nothing again), the device
        and the mesh's device count (the device's capacity is the plugin's to read). Asked
        once per set of programs, before the first step of a run (``refuse=True``: raise a
        ``MemoryError`` naming the knobs that help when it cannot fit; the run then fails
        before its first step) and by ``jn.memory_report`` (``refuse=False``: report only).
        The core keeps the answer with the programs (``nitro.plan.memory``); ``print(nitro)``
        shows ``report.rows()`` (``[(what, figure)]``) headed by ``report.device`` and
        ``report.n_devices``, and the throughput plugin reads ``report.flops_per_step`` (FLOPs
        of one optimizer step per device, or None). The built-in answer (``trylast``) is the
        ``memory_preflight`` plugin's ``jn.MemoryReport``.
        """


    @hookspec(firstresult=True)
    def jaxnitro_precision_policy(self, precision: ResolvedKnob, remat: ResolvedKnob) -> PrecisionPolicy | None:
        """Check the run's ``precision`` and ``remat`` knobs (``.value``, ``.source``: keyword,
        accessor, field or default) and return its :class:`jaxnitro.plugin.PrecisionPolicy`, or
        ``None`` if not yours. Asked once per handle at setup, with the other knob checks; raise
        (naming the knob, its source and the fix) for a value you refuse. The built-in answer
        (``trylast``) is the ``precision`` plugin; with no answer the core runs float32 without
        remat and refuses anything else, naming that plugin.
        """

    @hookspec(firstresult=True)
    def jaxnitro_sharding_policy(self, sharding: ResolvedKnob, mesh_shape: ResolvedKnob,
                                 n_devs: int) -> ShardingPolicy | None:
        """Check the run's ``sharding`` and ``mesh_shape`` knobs for a run on ``n_devs``
        devices and return its :class:`jaxnitro.plugin.ShardingPolicy` (the mesh's shape, each
        parameter's spec), or ``None`` if not yours. Asked once per handle at setup, with the
        other knob checks; raise (naming the knob, its source and the fix) for a value you
        refuse. The built-in answer (``trylast``) is the ``sharding`` plugin; with no answer
        every parameter is replicated and anything else refused, naming that plugin.
        """

    @hookspec(firstresult=True)
    def jaxnitro_setup_devices(self, n_devs: int | None, backend: str | None) -> list[jax.Device] | None:
        """``jn.setup_devices(n_devs, backend)`` (arguments as given): make ``n_devs`` devices
        available to this process, on platform ``backend`` (None: JAX's default), and return the
        backend's local devices; raise naming the reason and the fix when it cannot. The
        built-in answer (``trylast``) is the ``cluster`` plugin (the host device count on a
        CPU). With no answer ``jn.setup_devices`` raises, naming that plugin.
        """

    @hookspec(firstresult=True)
    def jaxnitro_initialize_processes(self, coordinator_address: str | None, num_processes: int | None,
                                      process_id: int | None, local_device_count: int | None,
                                      heartbeat_timeout_s: int, cpu_collectives: str | None,
                                      options: dict[str, Any]) -> bool | None:
        """``jn.distributed.initialize(...)`` (its arguments as given; ``options``: its other
        keywords): join this process to the multi-process job before any other JAX use, so that
        ``jax.process_count()`` and ``jax.devices()`` see the job; return True, or ``None`` if not
        yours. Raise naming the argument and the fix for what is wrong. The built-in answer
        (``trylast``) is the ``cluster`` plugin (``jax.distributed.initialize``); a plugin may
        read what is ``None`` here from its scheduler's environment. With no answer
        ``jn.distributed.initialize`` raises, naming that plugin.
        """


class LifecycleSpec:
    """Lifecycle hooks: the core calls every plugin's implementation at fixed points of a run.

    Like pytest's ``pytest_sessionstart``/``pytest_runtest_logreport``: loggers,
    progress, early stopping, checkpointers and reports subscribe to them. They
    are called once per stretch of steps read, per epoch or per run, never per
    step from Python, so they cost nothing measurable in step throughput.
    Return values are ignored; a plugin acts on the run through ``run``
    (for instance ``run.request_stop(reason)``).

    ``run`` is a :class:`jaxnitro.RunContext`: the handle (``run.nitro``), the
    run folder (``run.run_dir``), the resolved settings (``run.settings``), the
    monitored metric (``run.monitor``) and the loggers of the run
    (``run.loggers``).
    """

    @hookspec
    def jaxnitro_run_start(self, run: RunContext) -> None:
        """A run begins: its folder exists and its loggers are made; no step has run."""

    @hookspec
    def jaxnitro_steps_read(self, run: RunContext, stretch: StepStretch) -> None:
        """A stretch of optimizer steps has been computed and read back to the host.

        ``stretch`` is a :class:`jaxnitro.StepStretch`: consecutive steps, each
        with its epoch and its per-step scalars (``loss``, ``train_metrics``,
        varying schedule values); ``stretch.lines()`` yields
        ``(step, epoch, {name: float})``. Steps are read in order, each once.
        """

    @hookspec
    def jaxnitro_epoch_trained(self, run: RunContext, epoch: int, step: int, stats: dict[str, float]) -> None:
        """An epoch's steps have all been dispatched (``step`` is the last one).

        ``stats`` holds the epoch's data-pipeline figures, e.g.
        ``{"data_wait_frac": 0.03}`` (the share of the epoch spent waiting for
        batches).
        """

    @hookspec
    def jaxnitro_split_evaluated(self, run: RunContext, split: str, metrics: dict[str, Any], context: str) -> None:
        """A split was evaluated inside the run (``context`` is ``"validate"``).

        ``metrics`` is what ``finalize_metrics`` returned.
        """

    @hookspec
    def jaxnitro_epoch_end(self, run: RunContext, row: dict[str, Any]) -> None:
        """A history row is complete: ``row`` holds ``epoch``, ``step``, ``train_loss`` and
        the validation metrics, when validated. Rows follow epochs; with
        ``val_every_n_steps`` they follow validations (mid-epoch too, keyed by ``step``),
        and the run's last step closes one either way.

        Early stopping subscribes here and calls ``run.request_stop(reason)``; so it counts
        validations, whichever way they are scheduled.
        """

    @hookspec
    def jaxnitro_step_period(self, run: RunContext) -> int | Collection[int] | None:
        """Which optimizer steps this plugin wants to see the run's state at
        (``jaxnitro_step_boundary``): an int N (every N steps), a collection of step numbers
        (those steps), or None. Asked once at run start, of every plugin; the loop ends a
        dispatch at each such step (a checkpointer with ``every_n_steps=N`` answers N; a
        profiler of steps 100..109 answers ``(99, 109)``)."""

    @hookspec
    def jaxnitro_step_boundary(self, run: RunContext, step: int, epoch: int) -> None:
        """The run reached optimizer step ``step`` (of epoch ``epoch``), a multiple of a
        period some plugin asked for: every step up to it has been read and logged, a row
        closing there has been validated and emitted, and ``run.nitro.state`` is the state
        after that step (copy it to keep it: the next step donates its buffers)."""

    @hookspec
    def jaxnitro_run_ending(self, run: RunContext, status: str) -> None:
        """The run is about to finish with ``status``: a plugin whose last work can fail
        (the checkpointer's final saves and the wait for them) does it here. With status
        ``"done"``, an exception here fails the run: every ``jaxnitro_run_finish`` then gets
        ``"failed"`` and the error is raised once all plugins have finished."""

    @hookspec
    def jaxnitro_run_finish(self, run: RunContext, status: str) -> None:
        """The run ended with ``status``: ``"done"``, ``"diverged"``, ``"interrupted"``
        (Ctrl-C), ``"preempted"`` (SIGTERM, or ``max_time`` reached) or ``"failed"``. Called
        whatever happened, after the last event."""

    @hookspec
    def jaxnitro_setup_step(self, experiment: Any, step: str) -> None:
        """``Nitro(experiment)``'s setup is at ``step``: ``"starting"``, then named steps
        (``"building data"``, ``"deriving"``, ``"checking splits"``, ``"building model"``,
        ``"building optimizer"``), then ``"done"`` or ``"failed"``."""

    @hookspec
    def jaxnitro_check_experiment(self, experiment: Any) -> None:
        """Setup, first, before the experiment's hooks are resolved: check the experiment (its
        class, its methods). Warn for what would be silently ignored, raise to refuse it (the
        error leaves ``Nitro(e)`` as it is). The built-in ``code_checks`` plugin warns for a
        public method named close to a hook or run knob (``monitr``)."""

    @hookspec
    def jaxnitro_check_traced_code(self, experiment: Any, functions: dict[str, Callable[..., Any]]) -> None:
        """Setup, step ``"building model"``, before any program is built: check the code that
        will run traced. ``functions`` maps each traced hook the experiment or a plugin
        implements (``forward``, ``loss``, ``train_metrics``, ``train_step``; ``metrics`` when
        it runs on the device) to its function. Raise to refuse the experiment (the error
        leaves ``Nitro(e)`` as it is). The built-in ``code_checks`` plugin refuses an
        identity test on a Host field (``self.mode is None``)."""

    @hookspec
    def jaxnitro_phase_start(self, run: RunContext, epoch: int, phase: str, detail: str | None) -> None:
        """Epoch ``epoch``'s ``phase`` (``"train"`` or ``"validate"``) begins; ``detail`` says
        what it does first (``"compiling train step"``, ``"compiling forward"``) or is None."""

    @hookspec
    def jaxnitro_progress_note(self, note: str | None) -> None:
        """The current progress note changed (``jn.progress_note``, ``jn.with_progress_note``);
        ``note`` is the innermost open note or None."""

    @hookspec
    def jaxnitro_before_verb(self, nitro: Nitro, verb: str) -> None:
        """A verb (``"train"``, ``"validate"``, ``"evaluate"``, ``"predict"``) is about to
        run on ``nitro``. The stale-handle report subscribes here."""

    @hookspec
    def jaxnitro_row_closed(self, run: RunContext, row: dict[str, Any]) -> None:
        """A history row's train columns are complete: every step up to ``row["step"]`` has been
        read (and given to ``jaxnitro_steps_read``), and ``row`` (``epoch``, ``step``,
        ``train_loss``) is appended to ``run.nitro.rows``. Its validation, when the run
        validates, comes next, then ``jaxnitro_epoch_end`` (the partial row a diverged run
        appends at its end gets neither). Once per row, never per step; a
        row's figures made from the stretches read (the throughput plugin's
        ``nitro.record.throughput``) are closed here, so they are in place for
        ``jaxnitro_epoch_end``."""


EXPERIMENT_HOOKS = (
    "build_data", "derive", "build_model", "forward", "loss", "metrics", "train_metrics",
    "train_step", "finalize_metrics", "metrics_residency", "param_group", "learning_rate",
    "learning_rate_ratio", "weight_decay", "optimizer", "decay_anchor", "monitor",
    "keep_float32", "samples_per_batch", "param_sharding",
)
"""Names of the experiment hooks, in contract order."""

OPTIONAL_POSITIONALS = {"param_group": ("leaf",)}
"""Trailing positional parameters of an experiment hook that an implementation may leave out;
the core then calls it without them (see :func:`jaxnitro.plugin_manager.takes_positionals`)."""

EXTENSION_HOOKS = tuple(n for n in vars(ExtensionSpec) if not n.startswith("_"))
"""Names of the extension hooks."""

LIFECYCLE_HOOKS = tuple(n for n in vars(LifecycleSpec) if not n.startswith("_"))
"""Names of the lifecycle hooks, in declaration order (docs/architecture.md gives the call order)."""
