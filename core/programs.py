"""The compiled programs: what runs on the device, built from the experiment's hooks.

Five kinds, each cached module-wide by :func:`jaxnitro.cache.get_program`:

* ``train_step`` — forward, loss and gradient of one batch, added to the
  accumulated gradient of the earlier micro-batches, scaled by ``1/accum``,
  clipped and applied by the optimizer. One dispatch per optimizer step.
  Key: the traced hooks, GraphConst values, model structure, routing, the precision
  policy (``precision``, ``keep_float32``'s answers, ``remat``: :mod:`jaxnitro.precision`'s hook) and the
  optimizer (rules, groups, whether ``gradient_clip_norm`` clips at all; the
  threshold itself is an input).
* ``accumulate`` — forward, loss and gradient of one micro-batch added to the
  running sum; used for the first ``accum - 1`` micro-batches of a step.
  Key: the same minus the optimizer.
* ``train_block`` — ``steps_per_dispatch`` (k > 1) optimizer steps, each with its
  ``accum`` micro-batches, as one ``lax.scan``; same key as ``train_step``, one
  trace per ``(k, accum)``.
* ``forward`` — ``forward`` in inference mode, for validation, evaluation and
  prediction alike.
* ``metrics`` — ``metrics`` traced on the device (``metrics_residency`` =
  ``"device"``).

Every program takes the trainable arrays, the model state and the Device
values as inputs, so Device values, schedules and seeds never enter a key.
Per-step scalars (the loss and ``train_metrics``) come back as one float32
vector, read by the host in bulk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import equinox as eqx
import jax
import jax.numpy as jnp

from .blocks import ROWS
from .contracts import PrecisionPolicy
from .cache import Program, experiment_key, get_program, stable_key, traced_class_key
from .experiment import make_view
from .hookspecs import EXPERIMENT_HOOKS
from .knobs import RUN_KNOBS
from .manual import Optimizers, check_step_result, per_step_scalars
from .markers import StrippedHost
from .metrics import check_metric_entry
from .optim import OptimizerSpec, rule_state_of
from .precision import FLOAT32
from .routing import KEY, KEY_COUNT, KEY_DATA, Route
from .sharding import constrain
from .train_metrics_host import host_train_metrics

__all__ = ["ProgramSet", "ModelSkeleton", "split_model"]

_UNTRACED = frozenset(EXPERIMENT_HOOKS) | frozenset(RUN_KNOBS)
"""The hooks and run knobs whose methods a program's key leaves out unless its traced hooks name
them: a program's own traced hooks are keyed by their code, the rest run on the host (what they
decide that shapes a program, the model, the optimizer, ``accum``, has its own part of the key)."""


@dataclass(frozen=True)
class ModelSkeleton:
    """The non-trainable part of a model (``eqx.partition``'s static half) and its key."""

    static: object
    key: tuple


def split_model(model):
    """Partition ``model`` once into trainable arrays and a :class:`ModelSkeleton`."""
    params, static = eqx.partition(model, eqx.is_inexact_array)
    leaves, treedef = jax.tree_util.tree_flatten(static)
    key = (stable_key(treedef), tuple(stable_key(x) for x in leaves))
    return params, ModelSkeleton(static, key)


def with_key(batch: dict) -> dict:
    """Inside a trace: turn the framework's key entries into the ``key`` hooks receive.

    ``key = fold_in(base key, counter)``; the base key comes from the run's seed
    and the counter numbers micro-batches, so every micro-batch gets its own key
    and a seed or counter change compiles nothing.
    """
    if KEY_COUNT not in batch:
        return batch
    batch = dict(batch)
    data, count = batch.pop(KEY_DATA), batch.pop(KEY_COUNT)
    batch[KEY] = jax.random.fold_in(data, count)
    return batch


def _check_forward_result(res, state, cls_name: str):
    if not (isinstance(res, tuple) and len(res) == 2):
        if isinstance(res, tuple):
            what = f"a tuple of {len(res)}"
        elif hasattr(res, "shape") and hasattr(res, "dtype"):
            what = f"a single array of shape {tuple(res.shape)}"
        else:
            what = type(res).__name__
        raise TypeError(
            f"jaxnitro: `forward` of {cls_name} returned {what}; it must return "
            f"`(outputs, state)`. For a stateless model return `(outputs, state)` with the `state` "
            f"argument it received (None); with `eqx.nn.State`, return the updated state."
        )
    outputs, new_state = res
    if new_state is not None and not isinstance(new_state, eqx.nn.State):
        second = (
            f"an array of shape {tuple(new_state.shape)}"
            if hasattr(new_state, "shape") and hasattr(new_state, "dtype")
            else type(new_state).__name__
        )
        raise TypeError(
            f"jaxnitro: `forward` of {cls_name} returned `(outputs, {second})`; "
            f"the second element must be the model state (`eqx.nn.State`, or the `state` argument "
            f"as received, None for a stateless model). To return several outputs, put them in "
            f"the first element: `return (a, b), state`."
        )
    if state is not None and new_state is None:
        raise TypeError(
            f"jaxnitro: `forward` of {cls_name} returned `(outputs, None)` for a model with state; "
            f"return the updated `eqx.nn.State` as the second element."
        )
    return outputs, new_state


class FlatProgram:
    """A program over leaves, called with pytrees: ``jitted(params, state, *rest)`` flattens
    ``params`` and ``state`` and calls the shared program; ``kind``, ``traces`` and ``meta``
    are the shared program's."""

    def __init__(self, program: Program):
        self.program = program

    @property
    def kind(self) -> str:
        return self.program.kind

    @property
    def traces(self) -> int:
        return self.program.traces

    @property
    def meta(self) -> dict:
        return self.program.meta

    def jitted(self, params, state, *rest):
        leaves = jax.tree_util.tree_leaves
        return self.program.jitted(leaves(params), leaves(state), *rest)


def _block_step(accumulate, train_step, dev, extra, columns, scale, accum: int):
    """The ``lax.scan`` body of the block program: one optimizer step of the block, its
    ``accum`` micro-batches (``accum - 1`` accumulate bodies, then the train-step body).

    The carry is ``(param_leaves, state_leaves, opt_leaves)``; the scanned inputs are the
    step's Device values (over ``dev``), its batches (every field ``[accum, ...]``, or the
    row numbers ``ROWS`` into ``columns``) and its hyperparameters; the output is the
    step's ``[accum, len(aux_names)]`` scalars. ``extra`` entries join every micro-batch."""

    def body(carry, xs):
        p, s, o = carry
        d_step, batch, h = xs
        d = {**dev, **d_step}
        acc, auxes = None, []
        for i in range(accum):
            micro = {**extra, **{f: v[i] for f, v in batch.items() if f != ROWS}}
            if ROWS in batch:  # the rows of a column source, gathered here
                micro.update({f: col[batch[ROWS][i]] for f, col in columns.items()})
            if i < accum - 1:
                (acc, aux), s = accumulate(p, s, d, micro, acc)
                auxes.append(aux)
            else:
                p, s, o, aux = train_step(p, s, o, d, micro, acc, scale, h)
                auxes.append(aux)
        return (p, s, o), jnp.stack(auxes)

    return body


class ProgramSet:
    """The programs of one handle, looked up in the module-level cache.

    Construct with everything that shapes the graphs; programs are requested
    (and, on first call with a new signature, compiled) lazily by the verbs.
    ``layout`` (:class:`~jaxnitro.sharding.Layout`, or None): with split parameters, the
    train programs pin the params, gradients and optimizer state they return to it.
    ``memory``: the memory preflight's report of the first train step, kept with the compiled
    programs it measured (set once, by the run's first step or ``jn.memory_report``), or None.
    """

    memory = None

    def __init__(
        self,
        *,
        cls,
        hooks: dict,
        routes: dict[str, Route],
        graph_values: dict,
        host_fields: tuple[str, ...],
        skeleton: ModelSkeleton,
        param_def,
        state_def,
        train_metrics_on_host: bool = False,
        precision: PrecisionPolicy | None = None,
        layout=None,
    ):
        self.cls = cls
        self.layout = layout
        self.hooks = hooks
        self.routes = routes
        self.graph_values = dict(graph_values)
        self.host_values = {n: StrippedHost(n, cls.__name__) for n in host_fields}
        self.skeleton = skeleton
        self.param_def = param_def
        self.state_def = state_def
        self.has_train_metrics = "train_metrics" in hooks
        self.train_metrics_on_host = bool(train_metrics_on_host and self.has_train_metrics)
        self.precision = precision if precision is not None else FLOAT32  # the casts and remat around forward
        self._base_key = (
            experiment_key(cls),  # what the programs reach of the class: in _hook_key
            tuple(sorted((k, stable_key(v)) for k, v in self.graph_values.items())),
            skeleton.key,
            self.precision.key(),
        )

    def _program(self, kind: str, key: tuple, build, donate_argnums=(), train: bool = False) -> Program:
        """This handle's program of ``kind``: looked up in the module cache once per handle,
        so ``cache_stats().hits`` counts programs a handle reused, not calls. ``train``: it
        differentiates ``forward`` (compiled with the policy's XLA options: ``remat``'s)."""
        memo = self.__dict__.setdefault("_memo", {})
        if (kind, key) not in memo:
            options = self.precision.compiler_options() if train else None
            memo[(kind, key)] = get_program(kind, key, build, donate_argnums=donate_argnums, compiler_options=options)
        return memo[(kind, key)]

    # -- helpers used inside traces ------------------------------------------

    def view(self, dev: dict):
        """The experiment as traced code sees it: Device values as tracers, Host fields stripped."""
        return make_view(self.cls, {**self.host_values, **self.graph_values, **dev})

    def _hook(self, name: str) -> Callable:
        return self.hooks[name].function

    def _hook_key(self, *names) -> tuple:
        """The traced hooks ``names`` (by code), their routes, and what their code can reach of
        the experiment class: every member but the host-side hooks and run-knob methods it does
        not name (:func:`jaxnitro.cache.traced_class_key`), so an edit of `metrics` kept on the
        host, `finalize_metrics` or `monitor` (or a re-run cell with one) compiles nothing."""
        present = [n for n in names if n in self.hooks]
        hooks = tuple((n, self.hooks[n].function, self.routes.get(n)) for n in present)
        traced = [self.hooks[n].function for n in present]
        return hooks + (traced_class_key(self.cls, traced, _UNTRACED),)

    def _forward(self, view, params, state, batch, inference: bool):
        """``forward`` under the precision policy (:mod:`jaxnitro.plugins.precision`): params and float
        fields cast to the compute dtype, outputs back to float32, remat when training."""
        policy = self.precision
        model = eqx.combine(policy.cast_params(params), self.skeleton.static)
        if inference:
            model = eqx.nn.inference_mode(model)
        fields = policy.cast_inputs(self.routes["forward"].select(batch))
        model, fn = policy.rematerialized(model, self._hook("forward"), inference)
        res = fn(view, model, state, **fields)
        return policy.outputs(*_check_forward_result(res, state, self.cls.__name__), state)

    def _loss_and_aux(self, params, state, dev, batch, meta):
        view = self.view(dev)
        outputs, new_state = self._forward(view, params, state, batch, inference=False)
        loss = self._hook("loss")(view, outputs, **self.routes["loss"].select(batch))
        loss = jnp.asarray(loss)
        if loss.shape != ():
            raise TypeError(
                f"jaxnitro: `loss` of {self.cls.__name__} returned an array of shape {loss.shape}; "
                f"it must return a scalar (reduce over the batch, e.g. with `.mean()`)."
            )
        aux = [loss.astype(jnp.float32)]
        names = ()
        if self.train_metrics_on_host:  # after the gradient: outputs go to the host callback
            meta["aux_names"] = ("loss",)
            return loss, (new_state, jnp.stack(aux), (outputs, self.routes["train_metrics"].select(batch)))
        if self.has_train_metrics:
            tm = self._hook("train_metrics")(view, outputs, **self.routes["train_metrics"].select(batch))
            if not isinstance(tm, dict):
                raise TypeError(
                    f"jaxnitro: `train_metrics` of {self.cls.__name__} returned "
                    f"{type(tm).__name__}; it must return a dict {{name: scalar}}."
                )
            names = tuple(tm)
            aux += per_step_scalars(
                tm, "train metric", "`train_metrics` returns per-step scalars (arrays belong in `metrics`)"
            )
        meta["aux_names"] = ("loss",) + names
        return loss, (new_state, jnp.stack(aux))

    def _grads(self, params, state, dev, batch, meta):
        if self.train_metrics_on_host:
            (_, (new_state, aux, seen)), grads = jax.value_and_grad(self._loss_and_aux, has_aux=True)(
                params, state, dev, batch, meta
            )
            names, host_aux = host_train_metrics(self, dev, *seen)
            meta["aux_names"] = ("loss",) + names
            return grads, new_state, jnp.concatenate([aux, host_aux])
        (_, (new_state, aux)), grads = jax.value_and_grad(self._loss_and_aux, has_aux=True)(
            params, state, dev, batch, meta
        )
        return grads, new_state, aux

    # -- programs ---------------------------------------------------------------

    def train_key(self) -> tuple:
        return self._base_key + self._hook_key("forward", "loss", "train_metrics", "train_step") + (
            stable_key(self.param_def),
            stable_key(self.state_def),
            self.train_metrics_on_host,
        ) + self._layout_key()

    def _layout_key(self) -> tuple:
        """``()`` with every parameter replicated; else the mesh and the specs."""
        return () if self.layout is None else self.layout.key()

    def _pinned(self, kind: str):
        """The shardings the train programs pin ``kind`` (``"params"``, ``"opt"``) to, or None."""
        if self.layout is None or not self.layout.sharded:
            return None
        return self.layout.param_shardings if kind == "params" else self.layout.opt_shardings

    # The training programs take and return FLAT LEAF LISTS of the parameters, model state
    # and optimizer state: a list of arrays goes through jit's C++ argument path, while an
    # Equinox module or an optax state is flattened in Python on every call.

    def _accumulate_fn(self, meta) -> Callable:
        """The body of :meth:`accumulate` (also traced inside :meth:`train_block`)."""
        p_def, s_def = self.param_def, self.state_def

        def accumulate(p_leaves, s_leaves, dev, batch, acc):
            batch = with_key(batch)
            params = jax.tree_util.tree_unflatten(p_def, p_leaves)
            state = jax.tree_util.tree_unflatten(s_def, s_leaves)
            grads, new_state, aux = self._grads(params, state, dev, batch, meta)
            g_leaves = jax.tree_util.tree_leaves(grads)
            if acc is not None:
                g_leaves = [a + g for a, g in zip(acc, g_leaves)]
            g_leaves = constrain(g_leaves, self._pinned("params"))
            return (g_leaves, aux), jax.tree_util.tree_leaves(new_state)

        return accumulate

    def accumulate(self) -> Program:
        """``(param_leaves, state_leaves, dev, batch, acc) -> ((acc, aux), state_leaves)``.

        ``acc``, the grad leaves summed so far, is None for the first micro-batch of a step
        (and donated); ``aux`` is this micro-batch's ``[loss, *train_metrics]``. The
        micro-batches' aux are not summed on the device: the host averages them
        (:func:`jaxnitro.trainer.step_scalars`), so that a step's scalars do not depend on how
        XLA compiled the programs that summed them (inside one ``train_block`` loop body, XLA
        rounded the average differently from separate programs).
        """
        return self._program("accumulate", self.train_key(), self._accumulate_fn, donate_argnums=(1, 4), train=True)

    def _train_step_fn(self, opt: OptimizerSpec, tx, opt_def, meta) -> Callable:
        """The body of :meth:`train_step` (also traced inside :meth:`train_block`)."""
        if "train_step" in self.hooks:
            return self._manual_step_fn(opt, tx, opt_def, meta)
        p_def, s_def = self.param_def, self.state_def

        def train_step(p_leaves, s_leaves, o_leaves, dev, batch, acc, scale, hypers):
            batch = with_key(batch)
            params = jax.tree_util.tree_unflatten(p_def, p_leaves)
            state = jax.tree_util.tree_unflatten(s_def, s_leaves)
            opt_state = jax.tree_util.tree_unflatten(opt_def, o_leaves)
            grads, new_state, aux = self._grads(params, state, dev, batch, meta)
            if acc is not None:
                grads = jax.tree_util.tree_unflatten(
                    p_def, [a + g for a, g in zip(acc, jax.tree_util.tree_leaves(grads))]
                )
            grads = jax.tree_util.tree_map(lambda g: g * scale.astype(g.dtype), grads)
            grads = jax.tree_util.tree_unflatten(p_def, constrain(jax.tree_util.tree_leaves(grads), self._pinned("params")))
            grads = opt.clip(grads, hypers)
            updates, opt_state = tx.update(grads, opt_state, params, hypers=hypers)
            params = eqx.apply_updates(params, updates)
            leaves = jax.tree_util.tree_leaves
            return (constrain(leaves(params), self._pinned("params")), leaves(new_state),
                    constrain(leaves(opt_state), self._pinned("opt")), aux)

        return train_step

    def _manual_step_fn(self, opt: OptimizerSpec, model_opts, opt_def, meta) -> Callable:
        """The train-step body of an experiment with its own ``train_step`` hook: the same
        signature as the automatic body (``acc`` and ``scale`` unused: ``accum`` is 1), so the
        loop, ``train_block`` and the cache treat both alike. ``model_opts`` is the
        :class:`~jaxnitro.manual.ModelOptimizers` setup made (``plan.tx``); the model state
        travels in the step context (``Optimizers.model_state`` / ``with_model_state``); ``aux``
        holds the returned scalars, their names in ``meta["aux_names"]``."""
        p_def, s_def, name = self.param_def, self.state_def, self.cls.__name__

        def train_step(p_leaves, s_leaves, o_leaves, dev, batch, acc, scale, hypers):
            batch = with_key(batch)
            given = jax.tree_util.tree_unflatten(p_def, p_leaves)
            model_state = jax.tree_util.tree_unflatten(s_def, s_leaves)
            opt_state = jax.tree_util.tree_unflatten(opt_def, o_leaves)
            models = eqx.combine(given, self.skeleton.static)
            res = self._hook("train_step")(
                self.view(dev), models, Optimizers(model_opts, rule_state_of(opt_state), hypers, model_state),
                **self.routes["train_step"].select(batch),
            )
            params, rules, meta["aux_names"], aux, model_state = check_step_result(
                res, name, p_def, model_opts, given, s_def
            )
            opt_state = model_opts.stepped(opt_state, rules, params, hypers)
            leaves = jax.tree_util.tree_leaves
            return (constrain(leaves(params), self._pinned("params")), leaves(model_state),
                    constrain(leaves(opt_state), self._pinned("opt")), aux)

        return train_step

    def train_step(self, opt: OptimizerSpec, tx, opt_def) -> Program:
        """``(param_leaves, state_leaves, opt_leaves, dev, batch, acc, scale, hypers)`` ->
        ``(param_leaves, state_leaves, opt_leaves, aux)``.

        ``acc`` is None for ``accum == 1``; ``scale`` is ``1/accum`` (an input,
        so every ``accum`` shares the program); ``hypers`` is the per-step
        hyperparameter vector laid out by ``opt.layout``, handed to ``tx.update`` (an EMA,
        :func:`~jaxnitro.optim.ema_params`, reads its decay there); ``aux`` is
        ``[loss, *train_metrics]`` of the step's last micro-batch (the host averages it with
        the accumulate programs' ones).
        """
        return self._program(
            "train_step",
            self.train_key() + (opt.key(), stable_key(opt_def)),
            lambda meta: self._train_step_fn(opt, tx, opt_def, meta),
            donate_argnums=(0, 1, 2),
            train=True,
        )

    def train_block(self, opt: OptimizerSpec, tx, opt_def) -> Program:
        """``k`` optimizer steps in one program (``steps_per_dispatch``): a ``lax.scan`` of
        the ``accum - 1`` accumulate bodies and the train-step body.

        ``(param_leaves, state_leaves, opt_leaves, dev, dev_steps, extra, columns, batches,
        scale, hypers)`` -> ``(param_leaves, state_leaves, opt_leaves, aux)``. ``batches`` holds
        every field with leading axes ``[k, accum]``, or (a column source, see
        :mod:`jaxnitro.blocks`) the ``[k, accum, batch]`` row numbers ``ROWS`` into
        ``columns`` (``{field: [rows, ...]}``, else ``{}``): each micro-batch's fields are then
        gathered inside the scan, where its step reads them; ``dev_steps`` Device values with a
        leading ``[k]`` axis, one per step (they override ``dev``; the loop passes every
        Device value this way, scheduled or not, so that none is loop-invariant to XLA, which
        could otherwise reassociate arithmetic with it and round differently from the
        one-step program); ``hypers`` ``[k, n]``; ``extra`` entries
        (the run's base key) join every micro-batch; ``aux`` is ``[k, accum, len(aux_names)]``,
        each micro-batch's scalars (averaged by the host, as for the one-step programs).
        ``k`` and ``accum`` are read from the shapes: changing ``k`` traces this program
        again (one compile), nothing else. The bodies are the ones :meth:`accumulate` and
        :meth:`train_step` trace, so the results are those of ``k`` separate steps.
        """

        def build(meta):
            accumulate = self._accumulate_fn(meta)
            train_step = self._train_step_fn(opt, tx, opt_def, meta)

            def train_block(p_leaves, s_leaves, o_leaves, dev, dev_steps, extra, columns, batches, scale, hypers):
                accum = jax.tree_util.tree_leaves(batches)[0].shape[1]
                body = _block_step(accumulate, train_step, dev, extra, columns, scale, accum)
                (p, s, o), aux = jax.lax.scan(body, (p_leaves, s_leaves, o_leaves), (dev_steps, batches, hypers))
                return p, s, o, aux

            return train_block

        return self._program(
            "train_block",
            self.train_key() + (opt.key(), stable_key(opt_def)),
            build,
            donate_argnums=(0, 1, 2),
            train=True,
        )

    def forward(self) -> "FlatProgram":
        """``(params, state, dev, batch) -> outputs``, the model in inference mode.

        The compiled program takes the params' and the state's leaves (as the training
        programs do), so a handle whose model class is an equal class defined again (a
        re-run notebook cell) calls the same executable: a pytree argument would make jit
        compare the model classes by identity and trace again."""
        p_def, s_def = self.param_def, self.state_def

        def build(meta):
            def forward(p_leaves, s_leaves, dev, batch):
                batch = with_key(batch)
                params = jax.tree_util.tree_unflatten(p_def, p_leaves)
                state = jax.tree_util.tree_unflatten(s_def, s_leaves)
                outputs, _ = self._forward(self.view(dev), params, state, batch, inference=True)
                return outputs

            return forward

        key = self._base_key + self._hook_key("forward") + (stable_key(p_def), stable_key(s_def))
        return FlatProgram(self._program("forward", key, build))

    def metrics(self) -> Program:
        """``(dev, outputs, batch) -> {name: (value, count)}`` for device-resident metrics.

        Modes are fixed at trace time; a string mode travels as count ``0``
        and is restored on the host from ``program.meta["modes"]``.
        """
        def build(meta):
            modes = meta.setdefault("modes", {})

            def metrics(dev, outputs, batch):
                batch = with_key(batch)
                res = self._hook("metrics")(self.view(dev), outputs, **self.routes["metrics"].select(batch))
                out = {}

                for name, entry in res.items():
                    mode = check_metric_entry(name, entry)
                    modes[name] = entry[1] if mode != "count" else "count"
                    count = entry[1] if mode == "count" else 0
                    out[name] = (jnp.asarray(entry[0]), jnp.asarray(count, jnp.float32))
                return out

            return metrics

        return self._program("metrics", self._base_key + self._hook_key("metrics"), build)
