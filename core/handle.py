"""``Nitro``: the handle that holds a resolved experiment, its data, weights and programs.

A handle is a fixed point: every keyword and run-knob accessor is resolved
once, at construction, into the handle's own fields. Programs come from the
module-level compile cache, so a new handle on the same experiment compiles
nothing. Nothing compiles during construction; the first verb that needs a
program compiles it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

import attrs
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from . import knobs as _knobs
from .batches import batch_width, check_train_split, peek, unwrap, wrap_split
from .defaults import Defaults
from .describe import describe
from .events import emit
from .experiment import fields_of, is_experiment, to_device_value
from .history import MetricHistory
from .logger import check_logger_knob
from .optim import build_optimizer_spec
from .plugin_manager import disabled_note, first_result, resolve_hooks
from .progress import SetupSteps
from .programs import ProgramSet, split_model
from .routing import route_of
from .schedules import bind_schedules

__all__ = ["Nitro", "train"]

_TRACED_HOOKS = ("forward", "loss", "train_metrics", "metrics")


class Nitro:
    """A training/evaluation handle for one experiment.

    ``Nitro(e, data=None, run_ref=None, weights=None, **run_knobs)``:

    * ``data``: ``{split: source}`` used instead of ``build_data`` (``{}``
      for a handle that only predicts; no optimizer state is allocated
      without a ``train`` split);
    * ``weights``: another ``Nitro`` to warm-start from (its parameters and
      model state; fresh optimizer, step 0);
    * ``run_ref``: a one-element list filled with the handle before training;
    * run knobs (``seed``, ``run_dir``, ``accum``, ``max_epochs``,
      ``schedules``, ``gradient_clip_norm``, ``check_divergence``,
      ``autolog_schedules``, ``log_every_n_steps``, ``logger``,
      ``early_stop``, ``n_devs``): a keyword wins over an experiment method of
      that name, which wins over a field of that name, which wins over the
      framework default.

    Raises at construction, naming the culprit and the fix, for: an unknown
    keyword, an invalid split (partial train batch, batch count not divisible
    by ``accum``), a missing required hook, or a batch lacking a field a hook
    requires.
    """

    def __init__(self, experiment, **kwargs):
        progress = SetupSteps(experiment)
        ok = False
        try:
            self._setup(experiment, kwargs, progress)
            ok = True
        finally:
            progress.close(ok)

    def _setup(self, experiment, kwargs: dict, progress: SetupSteps) -> None:
        if not is_experiment(experiment) or isinstance(experiment, type):
            raise TypeError(
                f"jaxnitro: Nitro takes an experiment instance (a class decorated with "
                f"@jn.experiment, instantiated), got {experiment!r}."
            )
        _knobs.check_keywords(kwargs)
        for unsupported in ("resume", "w0", "restore_optimizer", "restore_best"):
            if kwargs.get(unsupported) not in (None, False):
                raise NotImplementedError(
                    f"jaxnitro: `{unsupported}` is not available in this version yet "
                    f"(checkpointing, resume and EMA arrive with the checkpoint plugin)."
                )
        self.status = "setup"
        self.stop_reason: str | None = None
        e = experiment
        self.hooks = resolve_hooks(e, Defaults())
        knobs = _knobs.resolve_knobs(e, kwargs)
        if knobs["ema"].value is not None:
            raise NotImplementedError(
                f"jaxnitro: run knob `ema` is set ({knobs['ema'].source}) but EMA is not available in "
                f"this version yet; remove it (or set it to None) rather than have it silently ignored."
            )
        if knobs["n_devs"].value not in (None, 1):
            raise NotImplementedError(
                "jaxnitro: n_devs > 1 (data parallel) is not available in this version yet; use "
                "n_devs=1 or leave it unset."
            )
        self.settings = _knobs.make_settings(
            knobs, logger=check_logger_knob(knobs["logger"].value, knobs["logger"].source), monitor=None
        )

        progress.to("building data")
        e = self._load_data(e, kwargs, progress)
        self.experiment = e
        progress.to("checking splits")
        self._check_splits()
        progress.to("building model")
        self._build_model(e, kwargs.get("weights"))
        # Device values: converted once, placed once
        self.device_values = {
            name: jnp.asarray(to_device_value(type(e).__name__, info, getattr(e, name)))
            for name, info in fields_of(e).items()
            if info.is_device
        }
        self._resolve_residency(e)
        self.programs = self._program_set()
        progress.to("building optimizer")
        self._build_optimizer(e)
        self.settings = dataclasses.replace(self.settings, monitor=self._resolve_monitor())
        self._check_plugin_knobs()
        self.step = 0
        self.epoch = 0
        self.rows: list[dict] = []
        self.run_dir: str | None = None
        self.loggers: list = []
        self.status = "ready"
        if kwargs.get("run_ref") is not None:
            kwargs["run_ref"][:] = [self]

    # -- setup steps ----------------------------------------------------------------

    def _load_data(self, e, kwargs: dict, progress: SetupSteps):
        """Take ``data=`` or call ``build_data``; wrap each split; run ``derive``. Returns the
        experiment with the derived values merged (host values, before device conversion)."""
        if kwargs.get("data") is not None:
            data = kwargs["data"]
        else:
            if "build_data" not in self.hooks:
                raise TypeError(
                    f"jaxnitro: {type(e).__name__} has no `build_data` hook and no `data=` was "
                    f"given. Define `def build_data(self, dist) -> dict` returning the splits, or "
                    f"pass `Nitro(e, data={{'train': ..., 'val': ...}})` (`data={{}}` to only predict)."
                )
            data = self.hooks["build_data"].function(e, None)
        if not isinstance(data, Mapping):
            raise TypeError(
                f"jaxnitro: the data must be a dict {{split: source}}, got {type(data).__name__}."
            )
        self.data = {str(s): wrap_split(src, str(s)) for s, src in data.items()}
        if "derive" not in self.hooks or not data:
            return e
        progress.to("deriving")
        # derive sees the user's sources, also when `data=` came from another handle
        derived = self.hooks["derive"].function(e, {s: unwrap(src) for s, src in self.data.items()}) or {}
        unknown = [n for n in derived if n not in fields_of(e)]
        if unknown:
            raise KeyError(
                f"jaxnitro: `derive` returned {unknown}, which are not fields of "
                f"{type(e).__name__}; declare them as fields (Device[...] for values traced "
                f"code reads) so derive can fill them in."
            )
        return attrs.evolve(e, **derived)

    def _check_splits(self) -> None:
        """Resolve routing; check the train split (or find the batch width from another split)."""
        self._resolve_routes()
        self.width: int | None = None
        self.batch_fields: tuple[str, ...] | None = None
        if "train" in self.data:
            self.width = check_train_split(self.data["train"], self.settings.accum)
            self._check_routes(peek(self.data["train"]), "train", ("forward", "loss", "train_metrics"))
            return
        for split, src in self.data.items():
            first = peek(src) if len(src) else None
            if first is not None:
                self.width = batch_width(first, f"`{split}` split's first batch")
                return

    def _build_model(self, e, weights) -> None:
        """Call ``build_model`` with a key from the seed; partition it once; warm-start if asked."""
        for hook in ("build_model", "forward"):
            if hook not in self.hooks:
                raise TypeError(
                    f"jaxnitro: {type(e).__name__} has no `{hook}` hook; define it as a method "
                    f"(see jaxnitro.hookspecs.{hook})."
                )
        seed = self.settings.seed
        model_key, self.run_key = jax.random.split(jax.random.PRNGKey(seed))
        built = self.hooks["build_model"].function(e, model_key)
        # (model, eqx.nn.State) from eqx.nn.make_with_state; anything else is the model itself
        # (a tuple of modules is a valid model).
        if isinstance(built, tuple) and len(built) == 2 and isinstance(built[1], eqx.nn.State):
            model, state = built
        else:
            model, state = built, None
        self.params, self.skeleton = split_model(model)
        self.model_state = state
        self.weights_from = "build_model (seed %d)" % seed
        if weights is not None:
            self._warm_start(weights)

    def _resolve_residency(self, e) -> None:
        residency = self.hooks["metrics_residency"].function
        for hook in ("metrics", "train_metrics"):
            where = residency(e, hook)
            if where not in ("device", "host"):
                raise ValueError(
                    f"jaxnitro: metrics_residency({hook!r}) returned {where!r}; expected 'device' or 'host'."
                )
        if "train_metrics" in self.hooks and residency(e, "train_metrics") != "device":
            raise ValueError(
                "jaxnitro: `train_metrics` runs traced in the gradient program; "
                "metrics_residency('train_metrics') must be 'device'."
            )
        self.metrics_on_device = "metrics" in self.hooks and residency(e, "metrics") == "device"
        if "metrics" in self.routes and self.routes["metrics"].wants_key and not self.metrics_on_device:
            raise TypeError(
                "jaxnitro: `metrics` declares the keyword `key`, but it runs on the host (its "
                "metrics_residency is 'host'); a PRNG key is supplied to traced hooks only. Drop "
                "`key` from `metrics`, or make it device-resident (metrics_residency -> 'device')."
            )

    def _build_optimizer(self, e) -> None:
        """Groups, rules and optimizer state (only with a train split); bind the schedules."""
        self.opt_spec = None
        self.opt_state = None
        if "train" in self.data:
            if "loss" not in self.hooks:
                raise TypeError(
                    f"jaxnitro: {type(e).__name__} has a `train` split but no `loss` hook; define "
                    f"`def loss(self, outputs, *, <batch fields>) -> scalar`."
                )
            self.opt_spec = build_optimizer_spec(e, self.hooks, self.params, self.settings.gradient_clip_norm)
            self.base_lr = float(self.hooks["learning_rate"].function(e))
            self.tx = self.opt_spec.transformation()
            self.opt_state = self.tx.init(self.params)
        group_names = tuple(g.name for g in self.opt_spec.groups) if self.opt_spec else ()
        device_fields = {n: i for n, i in fields_of(e).items() if i.is_device}
        self.bindings = bind_schedules(self.settings.schedules, device_fields, group_names)

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

    # -- setup helpers ------------------------------------------------------------

    def _resolve_routes(self) -> None:
        self.routes = {h: route_of(h, self.hooks[h].function) for h in _TRACED_HOOKS if h in self.hooks}

    def _check_routes(self, batch, split: str, hooks) -> None:
        if batch is None:
            return
        for h in hooks:
            if h in self.routes:
                self.routes[h].check(batch.keys())
        if self.batch_fields is None:
            self.batch_fields = tuple(batch.keys())

    def _program_set(self) -> ProgramSet:
        e = self.experiment
        infos = fields_of(e)
        return ProgramSet(
            cls=type(e),
            hooks=self.hooks,
            routes=self.routes,
            graph_values={n: getattr(e, n) for n, i in infos.items() if i.is_graph_const},
            host_fields=tuple(n for n, i in infos.items() if i.is_host),
            skeleton=self.skeleton,
            param_def=jax.tree_util.tree_structure(self.params),
            state_def=jax.tree_util.tree_structure(self.model_state),
        )

    def _resolve_monitor(self):
        if "monitor" in self.hooks:
            m = self.hooks["monitor"].function(self.experiment)
            if not (isinstance(m, tuple) and len(m) == 2 and m[1] in ("max", "min") and isinstance(m[0], str)):
                raise ValueError(
                    f"jaxnitro: `monitor` returned {m!r}; it must return (metric name, 'max' | 'min'), "
                    f"e.g. ('macro_recall', 'max')."
                )
            return m
        return None

    def _warm_start(self, other) -> None:
        if not isinstance(other, Nitro):
            raise NotImplementedError(
                "jaxnitro: `weights=` takes another Nitro (warm start) in this version; checkpoint "
                "paths and ('latest', 'best') arrive with the checkpoint plugin."
            )
        mine = jax.tree_util.tree_flatten_with_path(self.params)[0]
        theirs = jax.tree_util.tree_flatten_with_path(other.params)[0]
        diff = []
        a = {jax.tree_util.keystr(p): np.shape(x) for p, x in mine}
        b = {jax.tree_util.keystr(p): np.shape(x) for p, x in theirs}
        for name in sorted(set(a) | set(b)):
            if a.get(name) != b.get(name):
                diff.append(f"{name}: this model {a.get(name, 'missing')}, weights {b.get(name, 'missing')}")
        if diff:
            raise ValueError(
                "jaxnitro: `weights=` come from a model with a different tree; leaves that differ:\n  "
                + "\n  ".join(diff)
                + "\nWarm-start from a handle whose model has the same structure (same GraphConst "
                "fields such as the width), or build this one without `weights=`."
            )
        self.params = jax.tree_util.tree_map(jnp.copy, other.params)
        if other.model_state is not None:
            self.model_state = jax.tree_util.tree_map(jnp.copy, other.model_state)
        self.weights_from = f"warm start from a {type(other.experiment).__name__} handle (step {other.step})"

    # -- verbs -------------------------------------------------------------------------

    def train(self) -> "Nitro":
        """Train for ``max_epochs`` (or until early stopping / divergence); return ``self``.

        The run gets its own folder under ``run_dir``; the logger writes there.
        On divergence the run stops with status ``"diverged"`` and a warning; on an
        exception or Ctrl-C the logger is finished with ``"failed"``/``"interrupted"``
        and the exception propagates.
        """
        emit("jaxnitro_before_verb", nitro=self, verb="train")
        from .trainer import run_training

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
        from .evaluation import evaluate_split

        if split not in self.data:
            raise KeyError(
                f"jaxnitro: no split {split!r}; this handle's data has {sorted(self.data)}. "
                f"Return it from `build_data` (or pass it in `data=`) to evaluate it."
            )
        return evaluate_split(self, split)

    def predict(self, batch):
        """Run ``forward`` (inference mode) on new data; outputs are host NumPy arrays.

        ``batch`` is a dict with (at least) the fields ``forward`` declares, or an
        iterable of such dicts, for which a lazy iterator of outputs is returned.
        A batch narrower than the compiled width is padded and sliced back; a
        wider one is an error. A bare array is a ``TypeError``.
        """
        emit("jaxnitro_before_verb", nitro=self, verb="predict")
        from .evaluation import predict_batch

        if isinstance(batch, Mapping):
            return predict_batch(self, batch)
        if isinstance(batch, (np.ndarray, jax.Array)) or hasattr(batch, "__array__"):
            fields = self.routes["forward"].fields
            raise TypeError(
                f"jaxnitro: `predict` takes a batch dict (or an iterable of them), not a bare "
                f"{type(batch).__name__}: `forward` is routed by field name. Call it as "
                f"`nitro.predict({{{', '.join(repr(f) + ': ...' for f in fields)}}})` "
                f"(fields `forward` declares: {list(fields)})."
            )
        if isinstance(batch, Iterable):
            return (predict_batch(self, b) for b in batch)
        raise TypeError(
            f"jaxnitro: `predict` takes a batch dict or an iterable of them, got {type(batch).__name__}."
        )

    def history(self) -> MetricHistory:
        """The run as data: one row per validated epoch (epoch, step, train_loss, metrics)."""
        return MetricHistory(
            self.rows,
            monitor=self.settings.monitor,
            title=f"history of {type(self.experiment).__name__}",
            run_dir=self.run_dir,
            total_epochs=self.settings.max_epochs,
        )

    def release(self) -> None:
        """Release every split's source (calls ``release()`` on sources that define it).

        Call it when done with the handle, or use the handle as a context manager
        (``with jn.Nitro(e) as n: ...``). The framework does not release sources
        by itself after ``train()``: the handle's ``validate``/``evaluate`` and a
        rebuilt handle (``data=n.data``) still read them.
        """
        for src in self.data.values():
            src.release()

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

        set_device_values(self, values)

    def device_value(self, name: str):
        """The current value of Device field ``name`` as a host value (NumPy scalar or array)."""
        from .device_values import get_device_value

        return get_device_value(self, name)

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
