"""``Nitro``: the handle that holds a resolved experiment, its data, weights and programs.

A handle is a fixed point: every keyword and run-knob accessor is resolved
once, at construction (:mod:`jaxnitro.setup`), into a few typed objects the
verbs read: ``settings`` (the run knobs), ``data``, ``plan`` (hooks, routing,
programs, optimizer), ``state`` (the :class:`~jaxnitro.state.TrainState`),
``device_values`` and ``record`` (what runs leave behind). Programs come from the
module-level compile cache, so a new handle on the same experiment compiles
nothing. Nothing compiles during construction; the first verb that needs a
program compiles it.
"""

from __future__ import annotations

from collections.abc import Mapping

import equinox as eqx
import jax
import numpy as np

from . import knobs as _knobs
from .sources import batches_of, release_sources
from .describe import describe
from .evaluation import FieldReference, evaluate_split, predict_batch
from .history import MetricHistory
from .inference import export_program, inference_program
from .interrupts import Preempted, stop_signals
from .interrupts import check as check_stop
from .interrupts import consume as consume_stop
from .knobs import Settings
from .first_step import first_step, preflight
from .hookcalls import emit, recording
from .plugin_manager import disabled_note, first_result
from .progress import SetupSteps
from .setup import build
from .run_state import RunState
from .state import Plan, RunRecord
from .trainer import run_training

__all__ = ["Nitro", "train", "memory_report"]


class Nitro:
    """A training/evaluation handle for one experiment.

    ``Nitro(e, data=None, weights=None, resume=False, w0=None, restore_optimizer=True,
    restore_best=False, run_ref=None, **run_knobs)``:

    * ``data``: ``{split: source}`` used instead of ``build_data`` (``{}``
      for a handle that only predicts; no optimizer state is allocated
      without a ``train`` split);
    * ``weights``: another ``Nitro`` (warm start: its parameters and model
      state, a fresh optimizer, step 0), or a checkpoint: a path, a run folder,
      ``(run, "best" | "last" | step)``, ``jn.Average(jn.Last(n))`` (needs a
      checkpointer plugin; see docs/checkpoints.md);
    * ``resume``: ``"auto"``, a path or a ``(run, checkpoint)`` pair: continue a
      run from its checkpoint (``restore_optimizer``, ``restore_best`` refine
      it); ``w0="weights"`` anchors ``decay_anchor="w0"`` groups to ``weights``;
    * ``run_ref``: a one-element list filled with the handle before training;
    * run knobs (``seed``, ``run_dir``, ``n_devs``, ``accum``, ``max_epochs``,
      ``schedules``, ``gradient_clip_norm``, ``check_divergence``,
      ``autolog_schedules``, ``log_every_n_steps``, ``steps_per_dispatch``,
      ``logger``, ``checkpointer``, ``early_stop``, ``ema``): a keyword wins over
      an experiment method of that name, which wins over a field of that name,
      which wins over the framework default. They are resolved once, into
      ``nitro.settings``.

    Raises at construction, naming the culprit and the fix, for every mistake
    setup can see (docs/errors.md lists them): an unknown keyword, an invalid
    split, a missing required hook, a batch lacking a field a hook requires, a
    knob no loaded plugin acts on, weights that do not fit the model, ...
    """

    def __init__(self, experiment, **kwargs):
        with stop_signals(), recording(self):  # which plugin answered each extension hook
            self._setup(experiment, kwargs)
        if kwargs.get("run_ref") is not None:
            kwargs["run_ref"][:] = [self]

    def _setup(self, experiment, kwargs: dict) -> None:
        steps = SetupSteps(experiment)
        ok = False
        try:
            built = build(experiment, kwargs, steps)
            self.experiment = built.experiment
            self.settings: Settings = built.settings
            self.data: dict = built.data
            self.plan: Plan = built.plan
            self.device_values: dict = built.device_values
            self._reference = FieldReference(self.data)  # what predicted batches must look like
            self.record = RunRecord()
            self.run_state = RunState(built.state, self.record)  # the state training changes
            self._check_plugin_knobs()
            check_stop()  # a Ctrl-C that a hook swallowed still ends setup
            self.record.status = "ready"
            ok = True
        except (KeyboardInterrupt, Preempted):
            consume_stop()
            raise
        finally:
            steps.close(ok)

    def _check_plugin_knobs(self) -> None:
        """Every knob the core does not act on, when set, must be accepted by a plugin."""
        for name in _knobs.PLUGIN_KNOBS:
            value = getattr(self.settings, name)
            if value is None:
                continue
            if not first_result("jaxnitro_accept_knob", name=name, value=value, nitro=self):
                raise ValueError(
                    f"jaxnitro: run knob `{name}` is set ({self.settings.source(name)}) but no loaded "
                    f"plugin acts on it{disabled_note()}, so it would be silently ignored. Install or "
                    f"enable the plugin that provides it, or set `{name}=None`."
                )

    # -- what the handle holds, by name ----------------------------------------------------

    state = property(lambda self: self.run_state.state, lambda self, new: setattr(self.run_state, "state", new),
                     doc="The published :class:`~jaxnitro.state.TrainState` (``run_state.state``).")
    params = property(lambda self: self.state.params, doc="The trainable arrays (``eqx.partition``'s array half).")
    model_state = property(lambda self: self.state.model_state, doc="The model state (``eqx.nn.State``) or None.")
    opt_state = property(lambda self: self.state.opt_state, doc="The optimizer state (None without a train split).")
    step = property(lambda self: self.state.step, doc="Optimizer steps taken.")
    epoch = property(lambda self: self.state.epoch, doc="Epochs begun.")
    status = property(lambda self: self.record.status, doc="``ready``, ``running``, ``done``, ``diverged``, ``interrupted`` or ``failed``.")
    stop_reason = property(lambda self: self.record.stop_reason, doc="Why the run ended before ``max_epochs`` (or None).")
    rows = property(lambda self: self.record.rows, doc="The history rows (see :meth:`history`).")
    run_dir = property(lambda self: self.record.run_dir, doc="The run's folder (None before ``train()``).")
    loggers = property(lambda self: self.record.loggers, doc="The run's loggers (empty before ``train()``).")
    hooks = property(lambda self: self.plan.hooks, doc="``{hook: ResolvedHook}``: each hook's implementation and source.")

    @property
    def model(self):
        """The trained model as one Equinox module (params combined with the static half; the
        EMA weights when ``ema`` is on)."""
        return eqx.combine(self.state.eval_params, self.plan.skeleton.static)

    # -- verbs -------------------------------------------------------------------------

    def train(self) -> "Nitro":
        """Train for ``max_epochs`` (or until early stopping / divergence); return ``self``.

        The run gets its own folder under ``run_dir``; the logger writes there.
        On divergence the run stops with status ``"diverged"`` and a warning; on an
        exception or Ctrl-C the logger is finished with ``"failed"``/``"interrupted"``
        and the exception propagates.
        """
        emit("jaxnitro_before_verb", nitro=self, verb="train")
        if "train" not in self.data:
            raise ValueError(
                f"jaxnitro: this handle has no `train` split (splits: {sorted(self.data)}); build it "
                f"with data that includes 'train' to train."
            )
        if self.status != "ready":
            raise RuntimeError(
                f"jaxnitro: this handle already ran (status {self.status!r}). A Nitro trains once; "
                f"build a new one for a new training job: `jn.Nitro(e, data=n.data, ...)` reuses the "
                f"data and compiles nothing."
            )
        with recording(self):
            run_training(self)
        return self

    def validate(self) -> dict:
        """Evaluate the ``val`` split; return what ``finalize_metrics`` returned."""
        emit("jaxnitro_before_verb", nitro=self, verb="validate")
        return self._evaluate("val")

    def evaluate(self, split: str = "test") -> dict:
        """Evaluate ``split``; return what ``finalize_metrics`` returned.

        Raises ``KeyError`` naming the known splits for an unknown one.
        """
        emit("jaxnitro_before_verb", nitro=self, verb="evaluate")
        return self._evaluate(split)

    def _evaluate(self, split: str) -> dict:
        if split not in self.data:
            raise KeyError(
                f"jaxnitro: no split {split!r}; this handle's data has {sorted(self.data)}. "
                f"Return it from `build_data` (or pass it in `data=`) to evaluate it."
            )
        metrics, self.plan = evaluate_split(self.experiment, self.plan, self.state, self.device_values,
                                            self.data[split], split)
        return metrics

    def predict(self, batch):
        """Run ``forward`` (inference mode) on new data; outputs are host NumPy arrays.

        ``batch`` is a dict with (at least) the fields ``forward`` declares, or a
        source of such dicts (a list, a generator, ``jn.ArraySource``, or a loader a
        plugin adapts: a grain dataset, a torch ``DataLoader``), for which a lazy
        iterator of outputs is returned, batch by batch in the source's order (an
        index-addressable source is read as its epoch 0). A batch narrower than the
        compiled width is padded and sliced back; a wider one is an error. A bare
        array is a ``TypeError``.
        """
        emit("jaxnitro_before_verb", nitro=self, verb="predict")
        if isinstance(batch, Mapping):
            return self._predict_one(batch)
        if isinstance(batch, (np.ndarray, jax.Array)) or hasattr(batch, "__array__"):
            fields = self.plan.routes["forward"].fields
            raise TypeError(
                f"jaxnitro: `predict` takes a batch dict (or an iterable of them), not a bare "
                f"{type(batch).__name__}: `forward` is routed by field name. Call it as "
                f"`nitro.predict({{{', '.join(repr(f) + ': ...' for f in fields)}}})` "
                f"(fields `forward` declares: {list(fields)})."
            )
        try:
            batches = batches_of(batch, "predict")
        except TypeError:
            raise TypeError(
                f"jaxnitro: `predict` takes a batch dict or a source of them (an iterable, or a "
                f"loader a plugin adapts), got {type(batch).__name__}."
            ) from None
        return (self._predict_one(b) for b in batches)

    def _predict_one(self, batch: Mapping):
        """One batch dict's host outputs; the handle keeps the plan (its compiled width fixed by
        the first batch of a handle without data)."""
        outputs, self.plan = predict_batch(self.plan, self.state, self.device_values, self._reference, batch)
        return outputs

    def export(self, path, *, example=None, device_inputs: bool = False, symbolic_batch: bool = True,
               platforms=None, overwrite: bool = False) -> str:
        """Write the inference program (``forward`` in inference mode, as ``predict`` runs it) with
        ``jax.export`` to the folder ``path``, with a ``metadata.json``; return ``path``.

        Load it with ``jn.load_exported(path)`` (no experiment import needed). Weights
        (``state.eval_params``: the EMA when on, and the model state) are baked in as constants;
        Device values are baked in, or named inputs with ``device_inputs=True``. The batch
        dimension is symbolic when the model allows it (``symbolic_batch``). ``example``: one
        batch dict, needed when the handle has no data and has predicted nothing. ``metrics`` and
        other host hooks are not part of the program. Refuses (``ExportError``) a ``forward`` with
        host callbacks and unknown field shapes, and, before tracing, a ``path`` that is a file, a
        folder already holding an export (pass ``overwrite=True`` to replace it) or an unwritable
        location. Written by the plugin answering ``jaxnitro_export`` (the built-in ``export``
        plugin; a ``RuntimeError`` naming it when none is loaded). See docs/export.md.
        """
        options = {"example": example, "device_inputs": device_inputs, "symbolic_batch": symbolic_batch,
                   "platforms": platforms, "overwrite": overwrite}
        with recording(self):  # the exporter that answered is the handle's (print(nitro))
            program = inference_program(type(self.experiment), self.plan, self.state, self.device_values,
                                        self._reference, self._keep_plan)
            return export_program(program, path, options)

    def _keep_plan(self, plan: Plan) -> None:
        self.plan = plan

    def history(self, throughput: bool = False) -> MetricHistory:
        """The run as data: one row per validated epoch (epoch, step, train_loss, metrics).

        ``throughput=True`` adds each row's measured figures (``steps_per_sec``, ``samples_per_sec``
        or ``tokens_per_sec``, ``flops_per_step``, ``mfu``: the ``throughput`` plugin's ``nitro.record.throughput``) as
        columns; they are left out by default so that the rows of two runs of the same
        settings (a resumed run and a straight one) stay equal."""
        rows = self.rows
        if throughput:
            timed = {r["step"]: r for r in self.record.throughput}
            rows = [{**r, **{k: v for k, v in timed.get(r["step"], {}).items() if k not in ("epoch", "step")}}
                    for r in rows]
        return MetricHistory(
            rows,
            monitor=self.settings.monitor,
            title=f"history of {type(self.experiment).__name__}",
            run_dir=self.run_dir,
            total_epochs=self.settings.max_epochs,  # None for a run bounded by max_steps alone
            resumed_from=self.plan.resumed.epoch if self.plan.resumed is not None else None,
        )

    def release(self) -> None:
        """Release every split's source (calls ``release()`` on sources that define it).

        ``train()`` does it once when its run ends (done, diverged, interrupted or
        failed); call it yourself for a handle that only evaluated or predicted, or
        use the handle as a context manager (``with jn.Nitro(e) as n: ...``). A
        released source must reopen on its next epoch, so ``validate``/``evaluate``
        after a run and a rebuilt handle (``data=n.data``) keep working.
        """
        release_sources(self.data)

    def __enter__(self) -> "Nitro":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    # -- Device values -------------------------------------------------------------------

    def set_device(self, **values) -> None:
        """Write Device fields in place; takes effect at the next call, compiling nothing.

        Refuses (``TypeError``/``ValueError`` naming the case; the answer is a new
        ``Nitro``): an unknown name, a GraphConst or Host field, a scheduled field,
        a value that does not convert to the field's dtype, an array of another shape.
        """
        from .device_values import set_device_values

        set_device_values(self.experiment, self.plan.bindings.device, self.device_values, values)

    def device_value(self, name: str):
        """The current value of Device field ``name`` as a host value (NumPy scalar or array)."""
        from .device_values import get_device_value

        return get_device_value(self.experiment, self.device_values, name)

    # -- display -----------------------------------------------------------------------------

    @property
    def logger(self):
        """The run's logger (the first, when there are several); None before ``train()`` or with
        logging off. ``nitro.loggers`` lists them all."""
        return self.loggers[0] if self.loggers else None

    def __repr__(self) -> str:
        return describe(self, "text")

    def _repr_html_(self) -> str:
        return describe(self, "html")


def train(experiment, **kwargs) -> Nitro:
    """``jn.train(e, **kw)`` is ``jn.Nitro(e, **kw).train()``."""
    return Nitro(experiment, **kwargs).train()


def memory_report(experiment, **kwargs):
    """The memory preflight of ``jn.Nitro(experiment, **kwargs)`` without training: build the
    handle (setup only), compile its first train step ahead of time (the programs then sit
    in the compile cache: a handle trained next with the same settings compiles nothing) and
    return the report, whether the step fits or not: the ``jaxnitro_preflight`` answer (the
    built-in ``memory_preflight`` plugin's ``jn.MemoryReport``, ``report.fits``). ``RuntimeError``
    naming that plugin when no plugin answers."""
    kwargs.setdefault("logger", None)
    nitro = Nitro(experiment, **kwargs)
    if "train" not in nitro.data:
        raise ValueError(
            f"jaxnitro: memory_report needs a `train` split (splits: {sorted(nitro.data)}); the "
            f"preflight compiles the train step. Return one from build_data or pass data=."
        )
    report = preflight(nitro, lambda: first_step(nitro.plan, nitro.settings, nitro.state, nitro.device_values,
                                                 nitro.data["train"]), refuse=False, required=True)
    nitro.plan.programs.memory = report  # kept with the programs it measured (``nitro.plan.memory``)
    return report
