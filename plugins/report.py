"""The binding report: ``print(nitro)``, its HTML view, the report a run logs, an experiment's repr.

Entry point ``report``, on the ``jaxnitro_describe`` extension hook (trylast).
A handle is described by a title (status, seed, accum, horizon, batch width,
devices, where the weights came from, step and epoch) and bands, each a framed
table: ``data`` (splits and prefetch), ``routing`` (which batch fields each
hook receives and where it runs), ``hooks`` (each hook that is not the
experiment's own, with the plugin and distribution it came from, then each extension hook
a plugin answered for this handle, e.g. ``jaxnitro_accept_knob(name='early_stop')``),
``bindings`` (schedules and run knobs with their source, the precision policy and
remat), ``parameter groups`` and ``memory per device`` (the memory preflight's
figures, once a run or ``jn.memory_report`` compiled the train step). An experiment is described by its fields (marker, value, doc).
The ``parameter groups`` band's ``anchor`` column says where each group's decay
pulls: ``zero``, or ``w0 (<where the initial weights came from>)`` (L2-SP).
Formats: ``"text"`` (sized to the terminal), ``"report"`` (120 columns, for a
log) and ``"html"``.
"""

from __future__ import annotations

import html
import shutil
import textwrap
from collections.abc import Sequence

import attrs
import jax

from jaxnitro.plugin import answer_source, answers_for, fields_of, hookimpl, summarize_value

__all__ = ["text_table", "html_table", "Band", "render_bands_text", "render_bands_html", "handle_bands"]


_MIN_COLUMN = 6


def _column_widths(cells: list[list[str]], width: int) -> list[int]:
    """Each column's natural width, the widest narrowed one character at a time until the
    table fits ``width`` (down to a few characters per column)."""
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    budget = width - (3 * (len(widths) - 1) + 4)
    while sum(widths) > budget:
        i = max(range(len(widths)), key=widths.__getitem__)
        if widths[i] <= _MIN_COLUMN:
            break
        widths[i] -= 1
    return widths


def _wrapped(cell: str, width: int) -> list[str]:
    return textwrap.wrap(cell, width, break_on_hyphens=False) or [""]


def text_table(
    title: str, header: Sequence[str], rows: Sequence[Sequence[object]], width: int | None = None
) -> str:
    """A box-drawn table at most ``width`` characters wide (default: the terminal's).

    Columns keep their natural width when the table fits; otherwise the widest are
    narrowed and their cells wrap onto more lines (a row stays one framed block).
    """
    width = width or shutil.get_terminal_size((100, 24)).columns
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = _column_widths(cells, width)
    inner = sum(widths) + 3 * (len(widths) - 1) + 2

    def lines(r):
        parts = [_wrapped(c, w) for c, w in zip(r, widths)]
        return [
            "│ " + " │ ".join((p[k] if k < len(p) else "").ljust(w) for p, w in zip(parts, widths)) + " │"
            for k in range(max(len(p) for p in parts))
        ]

    out = [title, "┌" + "─" * inner + "┐", *lines(cells[0]), "├" + "─" * inner + "┤"]
    for r in cells[1:]:
        out += lines(r)
    out.append("└" + "─" * inner + "┘")
    return "\n".join(out)


def html_table(title: str, header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """The same table as HTML."""
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows
    )
    return (
        f"<div><strong>{html.escape(title)}</strong><table><thead><tr>{head}</tr></thead>"
        f"<tbody>{body}</tbody></table></div>"
    )


class Band:
    """One titled section of a report: a header and rows."""

    def __init__(self, title: str, header: Sequence[str], rows: Sequence[Sequence[object]]):
        self.title, self.header, self.rows = title, tuple(header), [tuple(r) for r in rows]


def render_bands_text(bands: Sequence[Band], width: int | None = None) -> str:
    return "\n".join(text_table(b.title, b.header, b.rows, width) for b in bands if b.rows)


def render_bands_html(bands: Sequence[Band]) -> str:
    return "".join(html_table(b.title, b.header, b.rows) for b in bands if b.rows)


# -- a handle ---------------------------------------------------------------------------


def _horizon(nitro):
    train = nitro.data.get("train")
    if train is None:
        return None, None
    s = nitro.settings
    try:
        per_epoch = len(train) // s.accum
    except TypeError:  # a stream: max_steps alone bounds the run
        return None, s.max_steps
    bounds = [b for b in (s.max_steps, per_epoch * s.max_epochs if s.max_epochs is not None else None) if b is not None]
    return per_epoch, min(bounds)


def _horizon_text(nitro) -> str:
    """``"20,000 optimizer steps (max_steps; 36.4 epochs of 550)"`` or ``"5500 optimizer steps (10 epochs x 550)"``."""
    s = nitro.settings
    per_epoch, total = _horizon(nitro)
    if total is None:
        return "no train split"
    if per_epoch is None:
        return f"{total:,} optimizer steps (max_steps; a stream without len())"
    if s.max_steps is not None and total == s.max_steps:
        return f"{total:,} optimizer steps (max_steps; {total / per_epoch:.3g} epochs of {per_epoch})"
    return f"{total} optimizer steps ({s.max_epochs} epochs x {per_epoch})"


def handle_title(nitro) -> str:
    """Three lines: the experiment and status; seed, accum, horizon, batch, devices; weights."""
    e, s = nitro.experiment, nitro.settings
    horizon = _horizon_text(nitro)
    dist = getattr(nitro.plan, "dist", None)
    devices = ", ".join(str(d) for d in (dist.devices if dist is not None else jax.devices()[:1]))
    ema = nitro.state.ema is not None
    return (
        f"Nitro({type(e).__name__})  status: {nitro.status}\n"
        f"  seed {s.seed} | accum {s.accum} | horizon {horizon} | batch {nitro.plan.width} | "
        f"devices {devices}\n"
        + _mesh_line(dist, nitro.plan.width, getattr(nitro.plan, "layout", None))
        + f"  weights: {nitro.plan.weights_from} | step {nitro.step}, epoch {nitro.epoch}"
        + (f" | EMA of the params (decay {nitro.plan.opt_spec.ema_decay:g})" if ema else "")
        + _derive_line(nitro.plan)
    )


def _derive_line(plan) -> str:
    """Whether ``derive`` ran: from a checkpoint (``weights=``/``resume=``) it is skipped and
    the values it derived for the saved run are restored; empty when there is no ``derive``."""
    hook = (getattr(plan, "hooks", None) or {}).get("derive")
    if hook is None or hook.source == "default":
        return ""
    values = ", ".join(f"{k}={v!r}" for k, v in (plan.derived or {}).items()) or "none"
    if plan.weights_meta is not None:
        return f"\n  derive: not run (weights from a checkpoint); its saved values restored: {values}"
    return f"\n  derive: ran ({hook.source}): {values}"


def _mesh_line(dist, width, layout=None) -> str:
    """Data parallel: the mesh, the processes, how a batch splits and where the params live
    (empty on one device)."""
    if dist is None or not dist.sharded:
        return ""
    axes = dict(zip(dist.mesh.axis_names, dist.mesh.devices.shape))
    procs = (
        f"{dist.process_count} processes x {dist.local_n_devs} devices (this is process {dist.process_index})"
        if dist.multi_process
        else "1 process"
    )
    split = ""
    if width is not None:
        per_device = width // (dist.local_n_devs * axes["data"] // dist.n_devs)
        split = (
            f" | global batch {width * dist.process_count} = {width} per process = {per_device} per device"
            if dist.multi_process
            else f" | batch {width} = {per_device} per device"
        )
    mesh = (f"{dist.n_devs} devices on axis 'data'" if len(axes) == 1
            else f"{dist.n_devs} devices, axes " + " x ".join(f"{a!r} {n}" for a, n in axes.items()))
    params = layout.describe() if layout is not None else "params replicated"
    return f"  mesh: {mesh}, {procs}{split}; {params}, batches sharded\n"


def _data_band(nitro) -> Band:
    rows = []
    for split, src in nitro.data.items():
        info = src.info() if hasattr(src, "info") else {}
        notes = [info.get("note", "")] + ([] if info.get("ordered", True) else ["UNORDERED: not bitwise reproducible"])
        warn = "; ".join(n for n in notes if n)
        rows.append((split, len(src) if getattr(src, "sized", True) else "stream", info.get("path", "?"), info.get("workers", "?"),
                     info.get("device_batches", "?"), info.get("host_batches", "?"), warn))
    return Band("data", ("split", "batches", "prefetch", "workers", "on device", "on host", "note"), rows)


def _routing_band(nitro) -> Band:
    rows = []
    used = set()
    for hook, route in nitro.plan.routes.items():
        where = "host" if hook == "metrics" and not nitro.plan.metrics_on_device else "device"
        names = list(route.required) + [f"{f} (optional)" for f in route.optional]
        if route.wants_key:
            names.append("key (PRNG key from the framework)")
        fields = ", ".join(names) or "(none)"
        rows.append((hook, fields, where))
        if where == "device":
            used.update(route.fields)
    if nitro.plan.batch_fields is not None:
        never = [f for f in nitro.plan.batch_fields if f not in used]
        if never:
            rows.append(("never transferred", ", ".join(never), "host only"))
    return Band("routing", ("hook", "batch fields", "runs on"), rows)


def _hooks_band(nitro) -> Band:
    """Each experiment hook that is not the experiment's own, and where it came from."""
    rows = [(name, hook.source) for name, hook in nitro.plan.hooks.items() if hook.source != "experiment"]
    rows += [(f"{a.hook}({a.question})", answer_source(a)) for a in answers_for(nitro)  # the plugin that answered
             if a.hook != "jaxnitro_describe"]  # the report itself: it would change the report it is in
    return Band("hooks not defined by the experiment", ("hook", "from"), rows)


def _configured(value) -> str:
    """A knob's value as configured: an attrs object by its constructor arguments only
    (``EarlyStopping(patience=5, min_delta=0.0)``, not its running state)."""
    if attrs.has(type(value)):
        args = ", ".join(f"{f.name}={getattr(value, f.name)!r}" for f in attrs.fields(type(value)) if f.init)
        return f"{type(value).__name__}({args})"
    return repr(value)


def _bindings_band(nitro) -> Band:
    s = nitro.settings
    rows = [("gradient_clip_norm", s.gradient_clip_norm or "off", s.source("gradient_clip_norm"))]
    for key, target in nitro.plan.bindings.describe():
        rows.append((f"schedule {key}", target, s.source("schedules")))
    for name in ("accum", "steps_per_dispatch", "max_epochs", "max_steps", "val_every_n_steps", "max_time", "seed",
                 "log_every_n_steps", "check_divergence"):
        value = getattr(s, name)
        if name == "steps_per_dispatch" and value == "auto":
            value = "auto (k from the measured step time; one dispatch <= 0.1 s)"
        elif name == "steps_per_dispatch" and value > 1:
            value = f"{value} ({_dispatches(nitro, value)})"
        if value is None and name in ("max_epochs", "max_steps", "val_every_n_steps", "max_time"):
            continue  # a budget or an event that is not set: nothing to show
        rows.append((name, value, s.source(name)))
    policy = getattr(nitro.plan.programs, "precision", None)
    if policy is not None:  # the precision policy and remat (the precision plugin: jaxnitro_precision_policy)
        rows.append(("precision", policy.describe(), s.source("precision")))
        if policy.kept:
            rows.append(("keep_float32", ", ".join(policy.kept), nitro.plan.hooks["keep_float32"].source))
        rows.append(("remat", policy.describe_remat(), s.source("remat")))
    if getattr(s, "device_peak_flops", None) is not None:
        rows.append(("device_peak_flops", f"{s.device_peak_flops:.4g}", s.source("device_peak_flops")))
    if s.logger is not None:
        rows.append(("logger", s.logger, s.source("logger")))
    for name in ("early_stop", "checkpointer", "ema", "profile"):
        value = getattr(s, name, None)
        if value is not None:
            rows.append((name, _configured(value), s.source(name)))
    return Band("bindings", ("binding", "value", "source"), rows)


def _dispatches(nitro, k: int) -> str:
    """How an epoch's steps are dispatched at ``steps_per_dispatch`` = k: ``5 blocks an
    epoch``, or ``8 blocks + 38 single steps an epoch`` (a remainder runs one step a dispatch:
    choose k dividing the epoch to avoid it)."""
    per_epoch, _ = _horizon(nitro)
    if per_epoch is None:
        return "no train split"
    blocks, rest = divmod(per_epoch, k)
    said = f"{blocks} block{'s' if blocks != 1 else ''}"
    if rest:
        said += f" + {rest} single step{'s' if rest != 1 else ''}"
    return said + " an epoch"


def _groups_band(nitro) -> Band:
    rows = []
    per_model = getattr(nitro.plan.tx, "specs", None)  # a train_step experiment: one optimizer per model
    model_of = {g.name: name for name, sp in zip(nitro.plan.tx.names, per_model) for g in sp.groups} if per_model else {}
    if nitro.plan.opt_spec is not None:
        opt = nitro.plan.bindings.opt
        for g in nitro.plan.opt_spec.groups:
            lr_scheduled = (None, "learning_rate") in opt or (g.name, "learning_rate") in opt
            wd_scheduled = (None, "weight_decay") in opt or (g.name, "weight_decay") in opt
            rate = f"schedule x {g.ratio:g}" if lr_scheduled else f"{nitro.plan.base_lr * g.ratio:g}"
            decay = "schedule" if wd_scheduled else g.weight_decay
            anchor = f"w0 ({nitro.plan.anchor_from})" if g.anchor == "w0" else g.anchor
            row = (g.name, rate, g.ratio, anchor, decay, g.rule_name, g.n_params)
            rows.append(row + ((_model_optimizer(model_of.get(g.name)),) if per_model else ()))
    header = ("group", "rate", "ratio", "anchor", "decay", "rule", "parameters")
    return Band("parameter groups", header + (("optimizer (train_step)",) if per_model else ()), rows)


def _model_optimizer(name) -> str:
    """The optimizer a train_step applies to a group: ``optimizers.update(..., name=...)``."""
    return "the model's" if name is None else f"name={name!r}"


def _memory_band(nitro) -> Band:
    """The memory preflight's figures per device (``jn.memory_report`` or a run's first step);
    empty before either."""
    report = getattr(nitro.plan, "memory", None)
    if report is None:
        return Band("memory per device", ("what", "bytes"), [])
    return Band(f"memory per device ({report.device}, {report.n_devices} device(s))", ("what", "bytes"), report.rows())


def handle_bands(nitro) -> list[Band]:
    """The bands of ``print(nitro)``, in order (an empty band is not shown)."""
    return [_data_band(nitro), _routing_band(nitro), _hooks_band(nitro), _bindings_band(nitro), _groups_band(nitro),
            _memory_band(nitro)]


# -- an experiment --------------------------------------------------------------------------


def _field_rows(e) -> list[tuple[str, str, str, str]]:
    """Rows ``(name, marker, value summary, doc)`` for an experiment instance."""
    return [
        (name, info.marker.name, summarize_value(getattr(e, name, None)), info.doc)
        for name, info in fields_of(e).items()
    ]


_FIELD_HEADER = ("field", "marker", "value", "doc")


@hookimpl(trylast=True)
def jaxnitro_describe(subject, format):
    """Describe a handle (bands) or an experiment (its fields) as text, report or HTML."""
    if hasattr(subject, "settings") and hasattr(subject, "experiment"):
        title, bands = handle_title(subject), handle_bands(subject)
        if format == "html":
            return f"<pre>{html.escape(title)}</pre>" + render_bands_html(bands)
        width = 120 if format == "report" else shutil.get_terminal_size((100, 24)).columns
        title = "\n".join(
            "\n".join(textwrap.wrap(line, width, subsequent_indent="    ", break_on_hyphens=False)) or line
            for line in title.splitlines()
        )
        return title + "\n" + render_bands_text(bands, width=width)
    name = type(subject).__name__
    if format == "html":
        return html_table(name, _FIELD_HEADER, _field_rows(subject))
    return text_table(name, _FIELD_HEADER, _field_rows(subject), width=120 if format == "report" else None)
