"""Mixed precision and rematerialization (entry point ``precision``): the ``precision`` and ``remat`` run knobs.

The precision plugin, as PyTorch Lightning's ``Precision`` plugins are: setup asks
``jaxnitro_precision_policy`` with the resolved knobs; this plugin answers (``trylast``)
with a :class:`Policy` (a :class:`jaxnitro.plugin.PrecisionPolicy`), refusing a bad value
naming the knob, its source and the fix (:func:`check_knobs`). The policy is decided once,
at setup (:meth:`Policy.for_params`), and applied inside the traced programs around the
experiment's ``forward`` (:meth:`jaxnitro.programs.ProgramSet._forward`). Disabled
(``JAXNITRO_DISABLE_PLUGINS=precision``), the core runs float32 without remat and refuses
any other ``precision`` or ``remat``, naming this plugin.

* ``precision="float32"`` (the default): nothing is cast.
* ``precision="bfloat16"``: the master parameters and the optimizer state stay float32 (they
  are what the handle holds, the optimizer updates and a checkpoint saves). Inside the
  traced step each trainable parameter is cast to bfloat16 (unless ``keep_float32(path)``
  says it stays float32), and so is each floating batch field ``forward`` receives; the
  model state (``eqx.nn.State``) is left as it is and handed back in its own dtypes.
  ``forward``'s floating outputs are cast to float32 before ``loss``, ``train_metrics`` and
  ``metrics``, so the loss, its reduction and the metrics are float32. The gradient is
  taken with respect to the float32 masters through the cast, so it reaches the optimizer
  in float32.
* ``precision="float16"`` is refused (:data:`FLOAT16_REFUSAL`): float16's range (largest
  65504, smallest normal 6e-5) makes gradients underflow without dynamic loss scaling,
  which would add a scale to the optimizer state and steps that are skipped, and
  bfloat16 (float32's range) gives the same memory and speed on the accelerators that
  have either.

``remat`` (``False``, ``True`` or the name of a policy in ``jax.checkpoint_policies``,
e.g. ``"dots_saveable"``; a policy function is accepted too) runs the training programs'
``forward`` under ``jax.checkpoint`` (:func:`equinox.filter_checkpoint`) block by block
(:meth:`Policy.rematerialized`): a block's activations are recomputed in the backward pass
instead of kept, except those the policy saves. Inference (validation, prediction) is
never wrapped. On XLA:CPU the training programs are compiled with :data:`KEEP_BARRIERS`
(:meth:`Policy.compiler_options`): XLA's CPU pipeline otherwise removes the
``optimization_barrier`` s ``jax.checkpoint`` places before it schedules, and its common
subexpression elimination then merges each recomputation with the forward pass's value,
which undoes remat (the same temporaries as without it). GPU and TPU compilers remove the
barriers only after scheduling, and need no option.

Both are trace-time constants: :meth:`Policy.key` is part of every program key. Neither
applies to an experiment with its own ``train_step`` (it takes the gradients itself): there
both are refused at setup.
"""

from __future__ import annotations

import inspect

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from jaxnitro.plugin import hookimpl, keypath_of, stable_key

__all__ = ["Policy", "PRECISIONS", "KEEP_BARRIERS", "check_knobs", "make_policy", "remat_policies", "FLOAT16_REFUSAL"]

PRECISIONS = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
"""The accepted ``precision`` values and the compute dtype each means."""

FLOAT16_REFUSAL = (
    "float16 is not supported: its range (largest 65504, smallest normal 6e-5) makes small "
    "gradients underflow to zero unless the loss is scaled dynamically (a scale carried in "
    "the optimizer state, steps with overflowed gradients skipped), which jaxnitro does not "
    "do. Use precision=\"bfloat16\": float32's range in 16 bits, the same memory and speed "
    "on GPUs (Ampere and later) and TPUs, and no loss scaling."
)


KEEP_BARRIERS = {"xla_disable_hlo_passes": "cse_barrier_expander"}
"""The XLA options a training program is compiled with under ``remat`` on a CPU: skip
XLA:CPU's ``OptimizationBarrierExpander`` (named ``cse_barrier_expander``), so the barriers
``jax.checkpoint`` places keep the recomputation apart from the forward pass (and after it)
until the buffers are assigned, as on GPUs. The program computes the same values (a
barrier is an identity), so the results stay bitwise equal."""


def remat_policies() -> tuple[str, ...]:
    """The names in ``jax.checkpoint_policies`` that are policies themselves (callables
    ``(prim, *args, **params) -> bool``), not factories that make one from names."""
    out = []
    for name, value in sorted(vars(jax.checkpoint_policies).items()):
        if name.startswith("_") or not callable(value):
            continue
        try:
            params = inspect.signature(value).parameters.values()
        except (TypeError, ValueError):
            continue
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            out.append(name)
    return tuple(out)


def check_knobs(prec, remat) -> None:
    """Refuse a bad ``precision`` or ``remat`` (resolved knobs: ``.value`` and ``.source``),
    naming the knob, its source and the fix."""
    if prec.value == "float16" or prec.value is jnp.float16 or prec.value == np.float16:
        raise ValueError(f"jaxnitro: run knob `precision` = {prec.value!r} ({prec.source}); {FLOAT16_REFUSAL}")
    if not isinstance(prec.value, str) or prec.value not in PRECISIONS:
        raise ValueError(
            f"jaxnitro: run knob `precision` = {prec.value!r} ({prec.source}); give one of "
            f"{', '.join(map(repr, PRECISIONS))} (the compute dtype of forward and backward; the "
            f"master weights and the optimizer state are float32 either way)."
        )
    if not (isinstance(remat.value, (bool, np.bool_)) or callable(remat.value)):
        if not isinstance(remat.value, str) or remat.value not in remat_policies():
            raise ValueError(
                f"jaxnitro: run knob `remat` = {remat.value!r} ({remat.source}); give False (keep "
                f"every activation), True (recompute them all in the backward pass) or the name of "
                f"a policy of jax.checkpoint_policies saying which to keep: "
                f"{', '.join(map(repr, remat_policies()))} (or a policy function, e.g. "
                f"jax.checkpoint_policies.save_only_these_names('x'))."
            )


class Policy:
    """The precision and remat policy of one handle's programs (see the module docstring).

    ``keep``: per trainable leaf (in ``jax.tree_util.tree_leaves`` order), True when it stays
    float32 under a low precision; ``kept``: those leaves' paths (for ``print(nitro)``);
    ``sources``: where the knobs came from (``{"precision": "keyword", ...}``, for messages).
    """

    def __init__(self, precision: str = "float32", keep: tuple = (), kept: tuple = (), remat=False, sources=None):
        if isinstance(remat, np.bool_):
            remat = bool(remat)
        self.precision, self.keep, self.kept, self.remat = precision, tuple(keep), tuple(kept), remat
        self.dtype = PRECISIONS[precision]
        self.sources = dict(sources or {})

    def for_params(self, experiment, hooks: dict, params) -> "Policy":
        """The handle's policy (:func:`make_policy`); ``ValueError`` for a ``precision`` below
        float32 or a ``remat`` when the experiment writes its own ``train_step``."""
        name, source = type(experiment).__name__, lambda knob: self.sources.get(knob, "default")
        if self.precision != "float32" and "train_step" in hooks:
            raise ValueError(
                f"jaxnitro: run knob `precision` = {self.precision!r} ({source('precision')}), "
                f"but {name} writes its own `train_step`, whose losses and gradients the "
                f"framework does not see: cast inside your train_step (e.g. "
                f"`jax.tree_util.tree_map(lambda p: p.astype(jnp.bfloat16), model)` before the forward "
                f"pass, the loss in float32), and leave `precision` at 'float32'."
            )
        if self.remat not in (False, None) and "train_step" in hooks:
            raise ValueError(
                f"jaxnitro: run knob `remat` = {self.remat!r} ({source('remat')}), but "
                f"{name} writes its own `train_step`, which takes the gradients itself: the "
                f"framework's remat wraps `forward` inside its own train step only. Checkpoint inside your "
                f"train_step (e.g. `eqx.filter_checkpoint` around the forward pass you differentiate), "
                f"and leave `remat` at False."
            )
        policy = make_policy(experiment, hooks, params, self.precision, self.remat)
        policy.sources = self.sources
        return policy

    @property
    def low(self) -> bool:
        """Whether forward computes below float32."""
        return self.precision != "float32"

    def key(self) -> tuple:
        """The part of a program key the policy decides."""
        remat = self.remat if isinstance(self.remat, (bool, str)) or self.remat is None else stable_key(self.remat)
        return ("precision", self.precision, self.keep if self.low else (), remat)

    def describe(self) -> str:
        """One line for ``print(nitro)``."""
        if not self.low:
            return "float32"
        kept = f"; {len(self.kept)} of {len(self.keep)} arrays kept float32" if self.kept else ""
        return f"{self.precision} compute; float32 masters, optimizer state, loss, metrics{kept}"

    def describe_remat(self) -> str:
        if self.remat is False or self.remat is None:
            return "off"
        if self.remat is True:
            return "on (jax.checkpoint: every activation recomputed)"
        name = self.remat if isinstance(self.remat, str) else getattr(self.remat, "__name__", repr(self.remat))
        return f"on (jax.checkpoint, policy {name})"

    def compiler_options(self) -> dict | None:
        """XLA options for the programs that differentiate ``forward``: :data:`KEEP_BARRIERS`
        under ``remat`` when JAX's default backend is a CPU, else None (no option)."""
        if self.remat is False or self.remat is None or jax.default_backend() != "cpu":
            return None
        return dict(KEEP_BARRIERS)

    # -- inside a trace ---------------------------------------------------------------

    def cast_params(self, params):
        """``params`` with each floating leaf not kept float32 cast to the compute dtype."""
        if not self.low:
            return params
        leaves, treedef = jax.tree_util.tree_flatten(params)
        if len(leaves) != len(self.keep):  # another tree (a manual step's part): cast every float leaf
            keep = (False,) * len(leaves)
        else:
            keep = self.keep
        cast = [x if k or not _is_float(x) else x.astype(self.dtype) for x, k in zip(leaves, keep)]
        return jax.tree_util.tree_unflatten(treedef, cast)

    def cast_inputs(self, fields: dict) -> dict:
        """``forward``'s batch fields with each floating one cast to the compute dtype."""
        if not self.low:
            return fields
        return {n: v.astype(self.dtype) if _is_float(v) else v for n, v in fields.items()}

    def outputs(self, outputs, new_state, state):
        """``forward``'s outputs in float32 (floating leaves below it cast up) and its new
        model state in the incoming state's dtypes."""
        if not self.low:
            return outputs, new_state
        up = lambda x: x.astype(jnp.float32) if _is_float(x) and jnp.finfo(x.dtype).bits < 32 else x  # noqa: E731
        outputs = jax.tree_util.tree_map(up, outputs)
        if state is not None and new_state is not None:
            try:
                new_state = jax.tree_util.tree_map(
                    lambda new, old: new.astype(old.dtype) if hasattr(new, "astype") and hasattr(old, "dtype") else new,
                    new_state, state,
                )
            except ValueError:  # another structure: _check_forward_result / the carry refuses it
                pass
        return outputs, new_state

    def _policy(self):
        if self.remat is True:
            return None
        if isinstance(self.remat, str):
            return getattr(jax.checkpoint_policies, self.remat)
        return self.remat

    def rematerialized(self, model, fn, inference: bool):
        """``(model, fn)`` under ``remat`` when the program differentiates ``forward`` (not in
        inference): the blocks of ``model`` run under ``jax.checkpoint``
        (:class:`Checkpointed`), the outermost ones found in it of two kinds:

        * every Module in a list or tuple of Modules (the repeated blocks of a Python loop:
          ``eqx.nn.MLP``'s ``layers``, a transformer's tuple of blocks);
        * a Module of layers stacked for a ``lax.scan`` (:func:`_is_stacked`: made by
          ``eqx.filter_vmap`` of a block's constructor), wrapped whole: the scan slices the
          wrapper with its arrays, so each iteration's block is checkpointed. A Module that
          merely looks stacked (a lone convolution) is checkpointed as one block, which
          changes no value.

        A model with neither has its whole ``forward`` (``fn``) checkpointed instead."""
        if inference or self.remat is False or self.remat is None:
            return model, fn
        policy = self._policy()
        found = []

        def is_block(x):
            return _is_blocks(x) or (x is not model and _is_stacked(x))

        def wrap(x):
            if _is_blocks(x):
                found.append(len(x))
                return type(x)(Checkpointed(b, policy) for b in x)
            if x is not model and _is_stacked(x):
                found.append(1)
                return Checkpointed(x, policy)
            return x

        wrapped = jax.tree_util.tree_map(wrap, model, is_leaf=is_block)
        if found:
            return wrapped, fn
        checkpointed = eqx.filter_checkpoint(lambda view, m, state, fields: fn(view, m, state, **fields), policy=policy)
        return model, lambda view, m, state, **fields: checkpointed(view, m, state, fields)


def _is_blocks(x) -> bool:
    return isinstance(x, (list, tuple)) and len(x) > 1 and all(isinstance(b, eqx.Module) and callable(b) for b in x)


def _is_stacked(x) -> bool:
    """Whether ``x`` is a callable Module whose arrays all have at least two dimensions and
    one leading axis of the same length ``n >= 2``, one of them at least three (a stacked
    ``Linear``'s weight ``[n, out, in]``): layers stacked for a scan over them."""
    if not (isinstance(x, eqx.Module) and callable(x)):
        return False
    arrays = [a for a in jax.tree_util.tree_leaves(x) if eqx.is_array(a)]
    if not arrays or min(a.ndim for a in arrays) < 2 or max(a.ndim for a in arrays) < 3:
        return False
    n = arrays[0].shape[0]
    return n >= 2 and all(a.shape[0] == n for a in arrays)


class Checkpointed(eqx.Module):
    """A block of the model run under ``jax.checkpoint`` (``remat``): called as the block,
    its activations are recomputed in the backward pass except those ``policy`` saves.
    Attribute reads go to the block (``layer.weight``)."""

    inner: eqx.Module
    policy: object = eqx.field(static=True, default=None)

    def __call__(self, *args, **kwargs):
        run = eqx.filter_checkpoint(lambda m, a, k: m(*a, **k), policy=self.policy)
        return run(self.inner, args, kwargs)

    def __getattr__(self, name):
        if name in ("inner", "policy") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.inner, name)


def _is_float(x) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def make_policy(e, hooks: dict, params, precision: str, remat) -> Policy:
    """The handle's :class:`Policy`: under a low precision, ``keep_float32(path)`` is asked
    once per trainable array (``path`` as ``param_group`` receives it: a tuple of ``str``
    and ``int``) and must answer a bool."""
    if precision == "float32" or "keep_float32" not in hooks:
        n = len(jax.tree_util.tree_leaves(params))
        return Policy(precision, (False,) * n, (), remat)
    ask = hooks["keep_float32"].function
    keep, kept = [], []
    for path, _leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        kp = keypath_of(path)
        answer = ask(e, kp)
        if not isinstance(answer, (bool, np.bool_)):
            raise TypeError(
                f"jaxnitro: `keep_float32` of {type(e).__name__} returned {answer!r} for {kp}; it must "
                f"return True (this parameter stays float32 under precision={precision!r}) or False "
                f"(it is cast to {precision} in the step)."
            )
        keep.append(bool(answer))
        if answer:
            kept.append(".".join(map(str, kp)))
    return Policy(precision, tuple(keep), tuple(kept), remat)


@hookimpl(trylast=True)
def jaxnitro_precision_policy(precision, remat):
    """The run's :class:`Policy` from the resolved ``precision`` and ``remat`` knobs, checked."""
    check_knobs(precision, remat)
    return Policy(precision.value, remat=remat.value, sources={"precision": precision.source, "remat": remat.source})
