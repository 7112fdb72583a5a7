"""Evaluation and prediction: one compiled forward for every split and every batch.

A partial final batch is padded to the compiled width on the host, run
through the same program, and its outputs and routed batch fields are sliced
back to the real rows before ``metrics`` sees them, so ``metrics`` never sees
padding.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from .batches import batch_width, field_specs, last_batch, pad_batch, peek, slice_outputs, unwrap
from .history import FIXED_COLUMNS, check_monitored_in
from .metrics import MetricAccumulator, check_metric_entry
from .source_contract import is_addressable
from .routing import KEY, KEY_COUNT, KEY_DATA, check_reserved_fields

__all__ = [
    "evaluate_split", "predict_batch", "FieldReference", "make_transfer", "check_eval_splits", "check_metric_names",
]

def _device_fields(routes: dict, hooks) -> tuple[str, ...]:
    """The batch fields ``hooks`` declare (``routes``: the plan's), in order, each once."""
    fields: list[str] = []
    for h in hooks:
        route = routes.get(h)
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


def make_transfer(plan, hooks, *, on_host: bool = False, width: int | None = None, counter=None, key=None):
    """The staging of one batch, one call per batch: the fields ``hooks`` declare in ``plan``'s
    routes (others never leave the host), sharded over the data mesh on several devices (in a
    multi-process job, this process's rows), ``device_put`` on one accelerator, NumPy on the
    CPU (:func:`stages_on_device`) or ``on_host`` (a block of ``k`` steps is sent at once).
    The loop's train split also passes ``width`` (refuse a batch of another width; None: setup
    read every batch), ``counter`` (each micro-batch's ``KEY_COUNT``) and ``key`` (the run's
    ``KEY_DATA``; None when a block carries it once)."""
    fields = _device_fields(plan.routes, hooks)
    dist = plan.sharded_dist
    if on_host or (dist is None and not stages_on_device()):
        put = None
    else:
        put = jax.device_put if dist is None else dist.put_batch

    def transfer(batch):
        if width is not None:
            try:
                same = all(len(v) == width for v in batch.values())
            except TypeError:  # a field without len(), or not a dict at all
                same = False
            if not same:
                _check_train_width(batch, width)
        out = {f: batch[f] for f in fields if f in batch}
        if put is not None:
            out = put(out)
        if counter is not None:
            if key is not None:
                out[KEY_DATA] = key
            out[KEY_COUNT] = np.uint32(next(counter))
        return out

    return transfer


def _check_train_width(batch, width: int) -> None:
    """Refuse a train batch of another width than ``width`` (a short, partial or empty one) or
    one that is not a dict of arrays (:func:`jaxnitro.batches.batch_width` names the problem):
    :func:`make_transfer` compares a length per field, and calls this only when one differs."""
    n = batch_width(batch, "train batch")
    if n != width:
        raise ValueError(
            f"jaxnitro: the `train` split yielded a batch of {n} rows; its batches have "
            f"{width}. Every train batch must have that width: the train split must drop its "
            f"partial final batch, and have no short batch anywhere (it would compile a "
            f"second train step and weight its rows differently). Fix: build the loader "
            f"with drop_last=True and equal batch sizes."
        )


def key_entries(rng) -> dict:
    """The key entries for evaluation and prediction: the run's base key ``rng``, counter 0 (fixed)."""
    return {KEY_DATA: rng, KEY_COUNT: np.uint32(0)}


def _width_for(plan, n: int, what: str) -> int:
    """The compiled width a batch of ``n`` rows runs at: the plan's, or, while it has none (a
    handle without data, before its first batch), ``n`` (on several devices: a multiple of
    their count). Refuses an empty batch and one wider than the plan's width."""
    if n == 0:
        raise ValueError(f"jaxnitro: {what} has no rows; pass a batch with at least one row.")
    if plan.width is None:  # on several devices: a multiple of their count
        dist = plan.sharded_dist
        return dist.pad_width(n) if dist is not None else n
    if n > plan.width:
        raise ValueError(
            f"jaxnitro: {what} has {n} rows, wider than the compiled batch width {plan.width}. "
            f"Split it into batches of at most {plan.width} rows (an iterable of batches works: "
            f"`nitro.predict(batches)`), or build a handle whose data has the wider batch."
        )
    return plan.width


def with_width(plan, width: int):
    """``plan`` with a compiled width: a plan without one (a handle without data) takes
    ``width``, the first batch's, as a new plan (the same programs); else ``plan`` itself."""
    return plan.replace(width=width) if plan.width is None else plan


def checked_width(plan, n: int, what: str):
    """``plan`` with a batch of ``n`` rows checked against its compiled width (fixing it when unset)."""
    return with_width(plan, _width_for(plan, n, what))


def _staged_for_forward(plan, rng, batch, hooks, what: str):
    """``(n, width, inputs)``: the fields ``hooks`` take, padded to the compiled width (see
    :func:`_width_for`), with the key entries (from ``rng``) when one of them declares ``key``."""
    n = batch_width(batch, what)
    w = _width_for(plan, n, what)
    inputs = {f: batch[f] for f in _device_fields(plan.routes, hooks) if f in batch}
    if n < w:
        inputs = pad_batch(inputs, w)
    if any(plan.routes[h].wants_key for h in hooks if h in plan.routes):
        inputs.update(key_entries(rng))
    return n, w, inputs


def _on_devices(plan, state, device_values: dict):
    """``(to_device, params, model_state, dev)``: how a staged evaluation batch reaches the
    devices, and the weights (``state.eval_params``: the EMA when on) and Device values it
    runs with; on several devices, this process's devices and its rows of the split."""
    to_device = jax.device_put if stages_on_device() else (lambda b: b)
    params, model_state, dev = state.eval_params, state.model_state, device_values
    dist = plan.sharded_dist
    if dist is not None:
        to_device = dist.put_local_batch
        params, model_state, dev = dist.local((params, model_state, dev))
    return to_device, params, model_state, dev


@dataclass(frozen=True)
class _SplitPass:
    """One evaluation pass's per-batch work: the forward program on a staged batch, then its
    metrics (the device-resident `metrics` program, a host `metrics`, or the default loss
    metric) added to an accumulator. ``metrics`` never sees padding."""

    e: Any
    plan: Any
    rng: Any
    params: Any
    model_state: Any
    dev: Any
    forward: Any
    forward_fields: tuple[str, ...]
    metrics_program: Any

    @classmethod
    def of(cls, e, plan, rng, params, model_state, dev) -> "_SplitPass":
        progs, routes = plan.programs, plan.routes
        forward_fields = _device_fields(routes, ("forward",)) + (
            (KEY_DATA, KEY_COUNT) if routes["forward"].wants_key else ()
        )
        return cls(e, plan, rng, params, model_state, dev, progs.forward(), forward_fields,
                   progs.metrics() if plan.metrics_on_device else None)

    @property
    def staged_hooks(self) -> tuple[str, ...]:
        """The hooks whose fields a batch is staged with (``metrics`` too when it is traced)."""
        return ("forward", "metrics") if self.plan.metrics_on_device else ("forward",)

    def check_first(self, host_batch: dict, split: str) -> None:
        """The split's first batch has the fields `forward` and `metrics` (or `loss`) require."""
        routes = self.plan.routes
        for h in ("forward", "metrics" if "metrics" in self.plan.hooks else "loss"):
            if h in routes:
                routes[h].check(host_batch.keys(), f"the `{split}` split's first batch")

    def add(self, acc: MetricAccumulator, n: int, w: int, host_batch: dict, inputs: dict) -> None:
        """Run one staged batch (``n`` real rows of ``w``) and add its metrics to ``acc``."""
        routes = self.plan.routes
        # the forward program sees exactly forward's fields, as in predict: one program for both
        outputs = self.forward.jitted(self.params, self.model_state, self.dev, {f: inputs[f] for f in self.forward_fields})
        if self.metrics_program is not None:
            fields = {k: v if k in (KEY_DATA, KEY_COUNT) else v[:n] for k, v in inputs.items()} if n < w else inputs
            res = jax.device_get(self.metrics_program.jitted(self.dev, slice_outputs(outputs, n, w), fields))
            modes = self.metrics_program.meta["modes"]
            acc.add({k: (v, c if modes[k] == "count" else modes[k]) for k, (v, c) in res.items()})
            return
        host_out = slice_outputs(jax.device_get(outputs), n, w)
        hooks = self.plan.hooks
        if "metrics" in hooks:
            acc.add(hooks["metrics"].function(self.e, host_out, **routes["metrics"].select(host_batch)))
        elif "loss" in hooks:  # the default metric: the loss, count 1 (a mean over batches)
            loss_batch = host_batch
            if routes["loss"].wants_key:
                loss_batch = {**host_batch, KEY: jax.random.fold_in(self.rng, 0)}
            value = hooks["loss"].function(self.plan.programs.view(self.dev), host_out, **routes["loss"].select(loss_batch))
            acc.add({"loss": (np.asarray(value), 1)})


def evaluate_split(e, plan, state, device_values: dict, source, split: str) -> tuple[dict, Any]:
    """Run split ``split`` (its wrapped source ``source``) through the forward program with
    ``state``'s eval weights and model state and ``device_values``; reduce ``metrics``,
    finalize. Returns ``(metrics, plan)``: what ``finalize_metrics`` returned, and ``plan``
    with its compiled width (a plan without one takes the first batch's: :func:`with_width`).

    Each batch is padded to the compiled width and staged (by the split's
    prefetcher) for the forward program; outputs and routed batch fields are
    sliced back to the real rows before ``metrics`` sees them.
    """
    to_device, params, model_state, dev = _on_devices(plan, state, device_values)
    one = _SplitPass.of(e, plan, state.rng, params, model_state, dev)

    def stage(batch):
        nonlocal plan
        n, w, inputs = _staged_for_forward(plan, state.rng, batch, one.staged_hooks, f"a batch of split `{split}`")
        plan = with_width(plan, w)
        return n, w, batch, to_device(inputs)

    acc = MetricAccumulator()
    read = False
    for n, w, host_batch, inputs in source.epoch(0, stage):
        if not read:
            one.check_first(host_batch, split)
            read = True
        one.add(acc, n, w, host_batch, inputs)
    acc, read = _merged_across_processes(plan.sharded_dist, acc, read)
    if not read:
        warnings.warn(
            f"jaxnitro: the `{split}` split yielded no batches, so it has no metrics (the result is "
            f"what finalize_metrics makes of an empty dict). Give the split at least one batch.",
            UserWarning,
            stacklevel=3,
        )
    return _finalized(plan, e, acc.result(), split), plan


def _merged_across_processes(dist, acc: MetricAccumulator, read: bool) -> tuple[MetricAccumulator, bool]:
    """In a multi-process job, every process's share merged in process order (and whether any
    process read a batch); otherwise ``(acc, read)`` as they are."""
    if dist is None or not dist.multi_process:
        return acc, read
    shares = dist.allgather_objects((acc, read))
    return MetricAccumulator.merged([share for share, _ in shares]), any(r for _, r in shares)


def _finalized(plan, e, reduced: dict, split: str) -> dict:
    final = plan.hooks["finalize_metrics"].function(e, reduced, split)
    if not isinstance(final, dict):
        raise TypeError(
            f"jaxnitro: `finalize_metrics` returned {type(final).__name__}; it must return a dict "
            f"of metrics (it replaces the reduced metrics for the logger, history and early stopping)."
        )
    check_metric_names(final, split)
    return final


def check_metric_names(metrics: dict, split: str) -> None:
    """Refuse a metric named like a fixed history column (``epoch``, ``step``, ``train_loss``):
    merged into the epoch's row, it would overwrite that column."""
    clash = [k for k in metrics if k in FIXED_COLUMNS]
    if clash:
        raise ValueError(
            f"jaxnitro: the `{split}` split's metrics include {clash}, named like the history's "
            f"fixed columns {list(FIXED_COLUMNS)}; merged into the epoch's row they would overwrite "
            f"them. Rename the metric in `metrics` / `finalize_metrics` (e.g. `{clash[0]}_metric`)."
        )


def predict_batch(plan, state, device_values: dict, reference: "FieldReference", batch) -> tuple[dict, Any]:
    """Forward one batch dict in inference mode with ``state``'s eval weights and model state
    and ``device_values``. Returns ``(outputs, plan)``: host outputs sliced to the real rows,
    and ``plan`` with its compiled width (a plan without one takes this batch's).

    Each field must have the trailing shape and the dtype of ``reference``'s (the data's
    batches, or, for a handle without data, the first predicted batch): see
    :meth:`FieldReference.check`."""
    route = plan.routes["forward"]
    route.check(batch.keys())
    host = {f: np.asarray(batch[f]) for f in route.fields if f in batch}  # only what forward takes
    reference.check(host)
    n, w, inputs = _staged_for_forward(plan, state.rng, host, ("forward",), "the prediction batch")
    plan = with_width(plan, w)
    to_device, params, model_state, dev = _on_devices(plan, state, device_values)  # this process's devices
    outputs = plan.programs.forward().jitted(params, model_state, dev, to_device(inputs))
    return slice_outputs(jax.device_get(outputs), n, w), plan


# -- predict: the fields' shapes and dtypes ----------------------------------------------------


class FieldReference:
    """The trailing shapes and dtypes a handle's prediction batches must have, one per handle.

    Read from ``data`` (``{split: wrapped source}``) once, when first asked: the train split's
    first batch, else the first split that can be read cheaply. A handle without such data
    records the first predicted batch (:meth:`check`) as the reference.
    """

    def __init__(self, data: Mapping):
        self._data = data
        self._specs: tuple[dict, str] | None = None

    def specs(self) -> tuple[dict, str] | None:
        """``({field: (trailing shape, dtype)}, where)``, or None (no data read cheaply, nothing
        predicted yet)."""
        if self._specs is not None:
            return self._specs
        data = self._data
        order = (["train"] if "train" in data else []) + [s for s in data if s != "train"]
        for split in order:
            src = data[split]
            specs = getattr(src, "first_batch_spec", None)  # recorded by setup's train-split check
            if specs is None and len(src) and is_addressable(unwrap(src)):  # never start a loader here
                first = peek(src)
                specs = field_specs(first) if first is not None else None
            if specs is not None:
                self._specs = (specs, f"the `{split}` split's batches")
                return self._specs
        return None

    def check(self, host: dict) -> None:
        """Refuse a prediction field whose trailing shape or dtype differs from the reference's.

        A different trailing shape would fail deep inside JAX; a 1-D row for a 2-D field would
        be read as several rows; a new dtype would silently compile the forward again. Without
        a reference, ``host`` (the first predicted batch) becomes it.
        """
        ref = self.specs()
        if ref is None:
            self._specs = (field_specs(host), "the first predicted batch")
            return
        specs, where = ref
        for f, v in host.items():
            if f in specs:
                _check_field(f, v, *specs[f], where)


def _check_field(f: str, v, shape: tuple, dtype, where: str) -> None:
    """Refuse prediction field ``f`` (value ``v``) unless it is batch-first with trailing
    ``shape`` and of ``dtype`` (``where``: what has that shape, in words)."""
    expected = "(batch" + "".join(f", {d}" for d in shape) + ("" if shape else ",") + ")"
    if np.ndim(v) == len(shape) and np.shape(v) == shape and len(shape) >= 1:
        raise ValueError(
            f"jaxnitro: prediction field `{f}` has shape {np.shape(v)}: one example without the "
            f"batch dimension ({where} have `{f}` of shape {expected}). It would be read as "
            f"{np.shape(v)[0]} rows. Fix: add the batch dimension, `{f}[None]` (or "
            f"`np.expand_dims({f}, 0)`)."
        )
    if np.ndim(v) == 0 or np.shape(v)[1:] != shape:
        raise ValueError(
            f"jaxnitro: prediction field `{f}` has shape {np.shape(v)}, but {where} have `{f}` of "
            f"shape {expected}. Pass arrays with the batch dimension first and the same trailing "
            f"shape as the data."
        )
    if v.dtype != dtype:
        raise TypeError(
            f"jaxnitro: prediction field `{f}` has dtype {v.dtype}, but {where} have {dtype}; a "
            f"new dtype would compile the forward program again. Fix: cast it, "
            f"`{f}.astype(np.{dtype})`."
        )


# -- setup: the evaluation splits, checked with one batch ------------------------------------------


def check_eval_splits(e, plan, state, device_values: dict, data: dict, monitor) -> None:
    """At setup: check every evaluation split cheaply, and the `val` split with one batch.

    * an empty split warns (it would give no metrics); an empty `val` split with a
      ``monitor`` is refused (the monitored metric could never be computed);
    * for a `val` split that can be read cheaply (a list of batches or an index-addressable
      source): its first batch has the fields `forward` and `metrics` (or `loss`) need, no
      reserved `key` column, and no batch is wider than the train batch;
    * on a training handle with a ``monitor`` (a `train` and a `val` split: validation runs
      after the first epoch and the monitored metric must be there): `forward`, `metrics`
      (or the default loss metric) and `finalize_metrics` see that batch (the traced hooks
      through ``jax.eval_shape``: nothing runs on the device, nothing compiles; host-side
      hooks see zeros of the outputs' shapes), and the result is checked:
      batch-first outputs, no metric named like a fixed history column, the monitored metric
      present and a scalar. Those hooks are thus called once more than the run calls them.
    """
    for split, src in data.items():
        if split != "train" and len(src) == 0:
            if split == "val" and monitor is not None:
                raise ValueError(
                    f"jaxnitro: the `val` split has no batches, so `monitor`'s metric "
                    f"{monitor[0]!r} can never be computed. Give the `val` split at least one batch, "
                    f"or drop the `monitor` hook."
                )
            warnings.warn(
                f"jaxnitro: the `{split}` split has no batches (len() is 0), so evaluating it gives no "
                f"metrics{' and training validates nothing' if split == 'val' else ''}. Give it at "
                f"least one batch, or leave it out of the data.",
                UserWarning,
                stacklevel=4,
            )
    src = data.get("val")
    if src is None or len(src) == 0 or not is_addressable(unwrap(src)):
        return
    where = "the `val` split's first batch"
    first = peek(src, epoch=0)
    n = batch_width(first, "`val` split's first batch")
    fields = first.keys()
    metrics_hook = "metrics" if "metrics" in plan.hooks else "loss"
    for h in ("forward", metrics_hook):
        if h in plan.routes:
            plan.routes[h].check(fields, where)
    check_reserved_fields(fields, {h: r for h, r in plan.routes.items() if h in ("forward", metrics_hook)}, where)
    if plan.width is not None:
        _check_val_widths(src, n, plan.width)
    if monitor is not None and "train" in data and plan.width is not None:
        _run_first_val_batch(e, plan, state, device_values, first, monitor)


def _check_val_widths(src, first_width: int, width: int) -> None:
    raw = unwrap(src)
    widths = [(0, first_width)]
    if isinstance(raw, (list, tuple)):
        widths += [(i, batch_width(b, f"`val` split's batch {i}")) for i, b in enumerate(raw[1:], start=1)]
    else:
        last = last_batch(src, epoch=0)
        widths.append((len(raw) - 1, batch_width(last, "`val` split's last batch")))
    for i, w in widths:
        if w > width:
            raise ValueError(
                f"jaxnitro: the `val` split's batch {i} has {w} rows, wider than the train batch "
                f"({width} rows). Evaluation runs the forward program compiled for the train batch "
                f"width (narrower batches are padded). Fix: batch the `val` split with at most "
                f"{width} rows per batch."
            )


def _zeros_like(tree):
    """NumPy zeros in the shapes and dtypes of ``tree`` (``jax.eval_shape``'s structs)."""
    return jax.tree_util.tree_map(lambda s: np.zeros(s.shape, s.dtype), tree)


def _run_first_val_batch(e, plan, state, device_values: dict, first: dict, monitor) -> None:
    """Trace `forward` (and a device-resident `metrics`) on ``first`` with ``jax.eval_shape``:
    nothing runs on the device and nothing compiles. Host-side `metrics` (or the default loss
    metric) and `finalize_metrics` then see zeros of the outputs' shapes and dtypes (numeric
    warnings silenced: their values are never used), and what comes out is checked."""
    hooks = ("forward", "metrics") if plan.metrics_on_device else ("forward",)
    n, w, inputs = _staged_for_forward(plan, state.rng, first, hooks, "the `val` split's first batch")
    outputs = _traced_forward(plan, state, device_values, inputs)
    acc = MetricAccumulator()
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        if plan.metrics_on_device:
            sliced = {k: v if k in (KEY_DATA, KEY_COUNT) else v[:n] for k, v in inputs.items()}
            acc.add(_traced_device_metrics(plan, device_values, slice_outputs(_zeros_like(outputs), n, w), sliced))
        else:
            host_out = slice_outputs(_zeros_like(outputs), n, w)
            if "metrics" in plan.hooks:
                acc.add(plan.hooks["metrics"].function(e, host_out, **plan.routes["metrics"].select(first)))
            elif "loss" in plan.hooks:
                acc.add({"loss": (_traced_loss(plan, device_values, host_out, first, state.rng), 1)})
        final = _finalized(plan, e, acc.result(check_counts=False), "val")
    if monitor is not None:
        check_monitored_in(final, monitor[0], " for its first batch")


def _traced_forward(plan, state, device_values: dict, inputs: dict):
    """``jax.eval_shape`` of the forward program (inference mode) on ``inputs``' forward fields."""
    from .programs import with_key

    progs = plan.programs
    forward_fields = set(plan.routes["forward"].fields) | {KEY_DATA, KEY_COUNT}

    def forward(params, model_state, dev, batch):
        outputs, _ = progs._forward(progs.view(dev), params, model_state, with_key(batch), inference=True)
        return outputs

    batch = {k: v for k, v in inputs.items() if k in forward_fields}
    return jax.eval_shape(forward, state.params, state.model_state, device_values, batch)


def _traced_device_metrics(plan, device_values: dict, outputs, batch: dict):
    """What a device-resident `metrics` adds to an accumulator on ``outputs`` (zeros) and
    ``batch``, traced with ``jax.eval_shape``: zeros for the values, each with its mode (a
    counted metric's count is 1: zeros would be "a total count of 0", a refusal of a count
    this check never computed); a result that is not a dict as it is (the accumulator refuses it)."""
    from .programs import with_key

    progs = plan.programs
    modes: dict = {}

    def device_metrics(dev, outputs, batch):  # as the metrics program: modes kept aside
        res = plan.hooks["metrics"].function(progs.view(dev), outputs, **plan.routes["metrics"].select(with_key(batch)))
        if not isinstance(res, dict):
            return res  # refused by the accumulator, naming the hook
        values = {}
        for name, entry in res.items():
            modes[name] = check_metric_entry(name, entry)
            values[name] = entry[0]
        return values

    res = jax.eval_shape(device_metrics, device_values, outputs, batch)
    if not isinstance(res, dict):
        return res
    return {k: (v, 1 if modes[k] == "count" else modes[k]) for k, v in _zeros_like(res).items()}


def _traced_loss(plan, device_values: dict, host_out, first: dict, rng):
    """Zeros shaped as the default loss metric of ``host_out`` on batch ``first``, traced."""
    progs = plan.programs

    def loss(dev, out, rng):
        batch = {**first, KEY: jax.random.fold_in(rng, 0)} if plan.routes["loss"].wants_key else first
        return plan.hooks["loss"].function(progs.view(dev), out, **plan.routes["loss"].select(batch))

    return _zeros_like(jax.eval_shape(loss, device_values, host_out, rng))


