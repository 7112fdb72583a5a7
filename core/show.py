"""The handle's description: its state line and the binding report's bands.

The same description is printed by ``print(nitro)``, drawn as HTML in a
notebook, and handed to the logger (``log_other("binding_report", ...)``).
"""

from __future__ import annotations

import jax
import numpy as np

from .experiment import fields_of, summarize_value
from .report import Band, render_bands_text

__all__ = ["handle_title", "handle_bands", "binding_report_text", "params_for_logger"]


def _horizon(nitro):
    train = nitro.data.get("train")
    if train is None:
        return None, None
    per_epoch = len(train) // nitro.accum
    return per_epoch, per_epoch * nitro.max_epochs


def handle_title(nitro) -> str:
    e = nitro.experiment
    per_epoch, total = _horizon(nitro)
    horizon = f"{total} optimizer steps ({nitro.max_epochs} epochs x {per_epoch})" if total is not None else "no train split"
    devices = ", ".join(str(d) for d in jax.devices()[: nitro.n_devs or 1])
    return (
        f"Nitro({type(e).__name__})  status: {nitro.status}\n"
        f"  seed {nitro.seed} | accum {nitro.accum} | horizon {horizon} | batch {nitro.width} | "
        f"devices {devices}\n"
        f"  weights: {nitro.weights_from} | step {nitro.step}, epoch {nitro.epoch}"
    )


def _data_band(nitro) -> Band:
    rows = []
    for split, src in nitro.data.items():
        info = src.info() if hasattr(src, "info") else {}
        warn = "" if info.get("ordered", True) else "UNORDERED: not bitwise reproducible"
        rows.append((split, len(src), info.get("path", "?"), info.get("workers", "?"),
                     info.get("device_batches", "?"), info.get("host_batches", "?"), warn))
    return Band("data", ("split", "batches", "prefetch", "workers", "on device", "on host", "note"), rows)


def _routing_band(nitro) -> Band:
    rows = []
    used = set()
    for hook, route in nitro.routes.items():
        where = "host" if hook == "metrics" and not nitro.metrics_on_device else "device"
        names = list(route.required) + [f"{f} (optional)" for f in route.optional]
        if route.wants_key:
            names.append("key (PRNG key from the framework)")
        fields = ", ".join(names) or "(none)"
        rows.append((hook, fields, where))
        if where == "device":
            used.update(route.fields)
    if nitro.batch_fields is not None:
        never = [f for f in nitro.batch_fields if f not in used]
        if never:
            rows.append(("never transferred", ", ".join(never), "host only"))
    return Band("routing", ("hook", "batch fields", "runs on"), rows)


def _bindings_band(nitro) -> Band:
    rows = [("gradient_clip_norm", nitro.gradient_clip_norm or "off", nitro.knobs["gradient_clip_norm"].source)]
    source = nitro.knobs["schedules"].source
    for key, target in nitro.bindings.describe():
        rows.append((f"schedule {key}", target, source))
    for name in ("accum", "max_epochs", "seed", "log_every_n_steps", "check_divergence"):
        r = nitro.knobs[name]
        rows.append((name, r.value, r.source))
    return Band("bindings", ("binding", "value", "source"), rows)


def _groups_band(nitro) -> Band:
    rows = []
    if nitro.opt_spec is not None:
        opt = nitro.bindings.opt
        for g in nitro.opt_spec.groups:
            lr_scheduled = (None, "learning_rate") in opt or (g.name, "learning_rate") in opt
            wd_scheduled = (None, "weight_decay") in opt or (g.name, "weight_decay") in opt
            rate = f"schedule x {g.ratio:g}" if lr_scheduled else f"{nitro.base_lr * g.ratio:g}"
            decay = "schedule" if wd_scheduled else g.weight_decay
            rows.append((g.name, rate, g.ratio, "zero", decay, g.rule_name, g.n_params))
    return Band("parameter groups", ("group", "rate", "ratio", "anchor", "decay", "rule", "parameters"), rows)


def handle_bands(nitro) -> list[Band]:
    return [_data_band(nitro), _routing_band(nitro), _bindings_band(nitro), _groups_band(nitro)]


def binding_report_text(nitro) -> str:
    return handle_title(nitro) + "\n" + render_bands_text(handle_bands(nitro), width=120)


def _json_safe(v):
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    if isinstance(v, np.generic):
        return v.item()
    if hasattr(v, "shape") and np.ndim(v) == 0:
        return np.asarray(v).item()
    return summarize_value(v)


def params_for_logger(nitro) -> dict:
    """The run's parameters: experiment fields, run knobs, prefetch settings, parameter count."""
    e = nitro.experiment
    params = {"experiment": type(e).__name__}
    for name in fields_of(e):
        params[f"field/{name}"] = _json_safe(getattr(e, name))
    for name, r in nitro.knobs.items():
        if name in ("logger", "early_stop", "schedules", "checkpointer", "ema"):
            params[f"knob/{name}"] = repr(r.value) if r.value is not None else None
        else:
            params[f"knob/{name}"] = _json_safe(r.value)
    for split, src in nitro.data.items():
        for k, v in (src.info() if hasattr(src, "info") else {}).items():
            params[f"prefetch/{split}/{k}"] = _json_safe(v)
    params["n_params"] = int(sum(np.size(x) for x in jax.tree_util.tree_leaves(nitro.params)))
    params["run_dir"] = nitro.run_dir
    return params
