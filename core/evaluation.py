"""Evaluation and prediction: one compiled forward for every split and every batch.

A partial final batch is padded to the compiled width on the host, run
through the same program, and its outputs and routed batch fields are sliced
back to the real rows before ``metrics`` sees them, so ``metrics`` never sees
padding.
"""

from __future__ import annotations

import jax
import numpy as np

from .batches import batch_width, pad_batch, slice_outputs
from .metrics import MetricAccumulator
from .routing import KEY, KEY_COUNT, KEY_DATA

__all__ = ["evaluate_split", "predict_batch", "make_transfer"]

def _device_fields(nitro, hooks) -> tuple[str, ...]:
    fields: list[str] = []
    for h in hooks:
        route = nitro.plan.routes.get(h)
        if route is not None:
            fields += [f for f in route.fields if f not in fields]
    return tuple(fields)


def stages_on_device() -> bool:
    """Whether batches are staged with ``jax.device_put`` ahead of the step.

    On an accelerator the copy of batch k+1 then overlaps step k. On the CPU
    backend a NumPy array handed straight to the compiled program is converted
    in jit's C++ argument path, which is cheaper than a separate ``device_put``
    per batch (measured ~10% of a small model's step), so batches stay NumPy.
    """
    return jax.default_backend() != "cpu"


def make_transfer(nitro, hooks):
    """The host->device transfer of exactly the fields ``hooks`` declare (others never leave the host)."""
    fields = _device_fields(nitro, hooks)
    if not stages_on_device():
        return lambda batch: {f: batch[f] for f in fields if f in batch}
    put = jax.device_put
    return lambda batch: put({f: batch[f] for f in fields if f in batch})


def eval_key_entries(nitro) -> dict:
    """The key entries for evaluation and prediction: the run's base key, counter 0 (fixed)."""
    return {KEY_DATA: nitro.state.rng, KEY_COUNT: np.uint32(0)}


def _check_width(nitro, n: int, what: str) -> None:
    if n == 0:
        raise ValueError(f"jaxnitro: {what} has no rows; pass a batch with at least one row.")
    if nitro.plan.width is None:
        nitro.plan.width = n
    elif n > nitro.plan.width:
        raise ValueError(
            f"jaxnitro: {what} has {n} rows, wider than the compiled batch width {nitro.plan.width}. "
            f"Split it into batches of at most {nitro.plan.width} rows (an iterable of batches works: "
            f"`nitro.predict(batches)`), or build a handle whose data has the wider batch."
        )


def _staged_for_forward(nitro, batch, hooks, what: str):
    """``(n, width, inputs)``: the fields ``hooks`` take, padded to the compiled width, with
    the key entries when one of them declares ``key``. Checks the batch's width."""
    n = batch_width(batch, what)
    _check_width(nitro, n, what)
    w = nitro.plan.width
    inputs = {f: batch[f] for f in _device_fields(nitro, hooks) if f in batch}
    if n < w:
        inputs = pad_batch(inputs, w)
    if any(nitro.plan.routes[h].wants_key for h in hooks if h in nitro.plan.routes):
        inputs.update(eval_key_entries(nitro))
    return n, w, inputs


def evaluate_split(nitro, split: str) -> dict:
    """Run ``split`` through the forward program, reduce ``metrics``, finalize.

    Each batch is padded to the compiled width and staged (by the split's
    prefetcher) for the forward program; outputs and routed batch fields are
    sliced back to the real rows before ``metrics`` sees them.
    """
    e, progs, dev = nitro.experiment, nitro.plan.programs, nitro.device_values
    forward = progs.forward()
    device_metrics = nitro.plan.metrics_on_device
    metrics_prog = progs.metrics() if device_metrics else None
    metrics_fn = nitro.plan.hooks["metrics"].function if "metrics" in nitro.plan.hooks else None
    staged_hooks = ("forward", "metrics") if device_metrics else ("forward",)
    forward_fields = _device_fields(nitro, ("forward",)) + (
        (KEY_DATA, KEY_COUNT) if nitro.plan.routes["forward"].wants_key else ()
    )
    to_device = jax.device_put if stages_on_device() else (lambda b: b)

    def stage(batch):
        n, w, inputs = _staged_for_forward(nitro, batch, staged_hooks, f"a batch of split `{split}`")
        return n, w, batch, to_device(inputs)

    acc = MetricAccumulator()
    first = True
    for n, w, host_batch, inputs in nitro.data[split].epoch(0, stage):
        if first:
            for h in ("forward", "metrics" if metrics_fn is not None else "loss"):
                if h in nitro.plan.routes:
                    nitro.plan.routes[h].check(host_batch.keys())
            first = False
        # the forward program sees exactly forward's fields, as in predict: one program for both
        outputs = forward.jitted(nitro.params, nitro.model_state, dev, {f: inputs[f] for f in forward_fields})
        if device_metrics:
            fields = {k: v if k in (KEY_DATA, KEY_COUNT) else v[:n] for k, v in inputs.items()} if n < w else inputs
            res = jax.device_get(metrics_prog.jitted(dev, slice_outputs(outputs, n, w), fields))
            modes = metrics_prog.meta["modes"]
            acc.add({k: (v, c if modes[k] == "count" else modes[k]) for k, (v, c) in res.items()})
            continue
        host_out = slice_outputs(jax.device_get(outputs), n, w)
        if metrics_fn is not None:
            acc.add(metrics_fn(e, host_out, **nitro.plan.routes["metrics"].select(host_batch)))
        elif "loss" in nitro.plan.hooks:  # the default metric: the loss, count 1 (a mean over batches)
            loss_batch = host_batch
            if nitro.plan.routes["loss"].wants_key:
                loss_batch = {**host_batch, KEY: jax.random.fold_in(nitro.state.rng, 0)}
            value = nitro.plan.hooks["loss"].function(progs.view(dev), host_out, **nitro.plan.routes["loss"].select(loss_batch))
            acc.add({"loss": (np.asarray(value), 1)})
    final = nitro.plan.hooks["finalize_metrics"].function(e, acc.result(), split)
    if not isinstance(final, dict):
        raise TypeError(
            f"jaxnitro: `finalize_metrics` returned {type(final).__name__}; it must return a dict "
            f"of metrics (it replaces the reduced metrics for the logger, history and early stopping)."
        )
    return final


def predict_batch(nitro, batch):
    """Forward one batch dict in inference mode; return host outputs sliced to the real rows."""
    route = nitro.plan.routes["forward"]
    route.check(batch.keys())
    host = {f: np.asarray(batch[f]) for f in route.fields if f in batch}  # only what forward takes
    n, w, inputs = _staged_for_forward(nitro, host, ("forward",), "the prediction batch")
    outputs = nitro.plan.programs.forward().jitted(
        nitro.params, nitro.model_state, nitro.device_values, jax.device_put(inputs)
    )
    return slice_outputs(jax.device_get(outputs), n, w)
