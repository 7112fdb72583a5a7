"""Plots of a run's history with matplotlib: ``h.plot(...)`` and ``jn.plot(h, ...)``.

Entry point ``plot``, on the ``jaxnitro_plot`` extension hook (trylast); it
exports :func:`plot` as ``jaxnitro.plot``. matplotlib is an optional extra
(``pip install jaxnitro[plot]``) imported on the first plot; without it a plot
raises ``ImportError`` saying what to install.

What is drawn, for a :class:`jaxnitro.MetricHistory` ``h`` (``jn.plot(nitro)`` draws
``nitro.history()``):

* ``h.plot()``: one axis, the monitored metric over epochs, the best epoch
  starred (without a ``monitor``: the train loss);
* ``h[10:20].plot()``: the same over that window (a selection is a history);
* ``h["acc", "loss"].plot()``: one axis per selected metric, stacked;
* ``h.plot(metrics="all")``: one axis per scalar metric, the train loss included;
  ``metrics=["acc"]`` names them;
* ``h.plot(x="step")``: optimizer steps on the x axis; the run's per-step train
  lines (read from ``metrics.jsonl`` in the run folder, when there is one) are
  drawn as a line under each metric they carry (``loss`` under the train loss,
  a ``train_metrics`` name under that metric), with the epoch values as points;
* ``h.plot(ax=ax)``: draws into the caller's axes (one per metric: an ``Axes``
  for one metric, a sequence for several) and returns their figure, so a plot
  can sit in a larger figure.

Returns the :class:`matplotlib.figure.Figure`; in a notebook it displays inline.
The figure is made with :class:`matplotlib.figure.Figure` directly (not
pyplot), so nothing depends on a GUI backend and figures are not kept alive by
pyplot's registry.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence

import numpy as np

from jaxnitro.plugin import hookimpl

__all__ = ["plot"]

_FIXED = ("epoch", "step")


def _history_of(obj):
    """``obj`` if it is a history (it has ``scalar_columns``), else a handle's ``history()``."""
    if hasattr(obj, "scalar_columns"):
        return obj
    history = getattr(obj, "history", None)
    if callable(history):
        return history()
    raise TypeError(
        f"jaxnitro.plot: got a {type(obj).__name__}; give a history (`nitro.history()`, a "
        f"selection such as `h[10:20]`) or a handle (`jn.plot(nitro)`)."
    )


def _metrics(history, metrics) -> list[str]:
    """The metrics to draw, one axis each (scalar columns only)."""
    scalar = [c for c in history.scalar_columns if c not in _FIXED]
    if metrics == "all":
        return scalar
    if metrics is not None:
        names = [metrics] if isinstance(metrics, str) else list(metrics)
        unknown = [m for m in names if m not in scalar]
        if unknown:
            raise KeyError(
                f"jaxnitro.plot: no scalar metric {', '.join(map(repr, unknown))} in this history; "
                f"plottable: {', '.join(scalar) or '(none)'}."
            )
        return names
    selected = getattr(history, "selected_columns", None)
    if selected:  # h["acc", "loss"]: what the user picked
        return [c for c in selected if c in scalar]
    monitor = history.monitor
    if monitor is not None and monitor[0] in scalar:
        return [monitor[0]]
    return ["train_loss"] if "train_loss" in scalar else scalar[:1]


def _train_lines(history) -> list[dict]:
    """The run's per-step train lines from ``metrics.jsonl`` (empty when there is none)."""
    run_dir = history.run_dir
    path = os.path.join(os.fspath(run_dir), "metrics.jsonl") if run_dir else None
    if not path or not os.path.exists(path):
        return []
    lines = []
    with open(path, encoding="utf-8") as f:
        for text in f:
            try:
                line = json.loads(text)
            except ValueError:  # a line cut by a killed process
                continue
            if line.get("context") == "train":
                lines.append(line)
    return lines


def _number(v) -> float:
    if isinstance(v, str):  # the JSONL logger writes non-finite values as strings
        return {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}.get(v, math.nan)
    return math.nan if v is None else float(v)


def _axes(ax, n: int):
    """``(figure, [axes])``: the caller's axes, or a new figure with ``n`` stacked axes."""
    if ax is not None:
        axes = list(ax) if isinstance(ax, (Sequence, np.ndarray)) else [ax]
        if len(axes) != n:
            raise ValueError(
                f"jaxnitro.plot: {n} metric(s) to draw but {len(axes)} axes given in `ax`; pass one "
                f"Axes per metric (or choose the metrics with `metrics=`)."
            )
        return axes[0].figure, axes
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 2.6 * n + 0.6), layout="constrained")
    return fig, [fig.add_subplot(n, 1, i + 1) for i in range(n)]


def plot(history, *, metrics=None, x: str | None = None, ax=None, title: str | None = None):
    """Draw ``history``; see the module docstring. Returns the matplotlib ``Figure``.

    ``history`` is a :class:`jaxnitro.MetricHistory` or a handle (``jn.plot(nitro)``, as the
    tutorial spells it: the handle's ``history()``). Raises ``TypeError`` for anything else,
    ``ValueError`` for an unknown ``x`` or a wrong number of axes, ``KeyError`` for an unknown
    metric, ``ValueError`` for an empty history. ``x`` defaults to ``"epoch"``, or ``"step"``
    when an epoch has several rows (validated every N steps).
    """
    history = _history_of(history)
    try:
        import matplotlib  # noqa: F401
    except ImportError as err:  # pragma: no cover - the extra is installed in CI
        raise ImportError(
            "jaxnitro.plot needs matplotlib: pip install 'jaxnitro[plot]' (or matplotlib)."
        ) from err
    epochs = history.column("epoch").tolist()
    row = "epoch" if len(set(epochs)) == len(epochs) else "step"  # rows every N steps share epochs
    x = row if x is None else x
    if x not in ("epoch", "step"):
        raise ValueError(f"jaxnitro.plot: x={x!r}; use 'epoch' or 'step'.")
    if len(history) == 0:
        raise ValueError("jaxnitro.plot: the history has no rows yet; train first.")
    names = _metrics(history, metrics)
    fig, axes = _axes(ax, len(names))
    xs = history.column(x).astype(float)
    best = history.best
    monitor = history.monitor[0] if history.monitor else None
    train = _train_lines(history) if x == "step" else []
    for axis, name in zip(axes, names):
        per_step = name[len("train_"):] if name.startswith("train_") else name  # train_loss -> loss
        steps = [t for t in train if per_step in t]
        if steps:
            axis.plot([t["step"] for t in steps], [_number(t[per_step]) for t in steps],
                      lw=0.8, alpha=0.6, label=f"{per_step} (train, per step)")
        ys = history.column(name).astype(float)
        axis.plot(xs, ys, marker="o", ms=3, label=name if not steps else f"{name} (per {'epoch' if row == 'epoch' else 'validation'})")
        if best is not None and name == monitor:
            axis.plot([float(best[x])], [float(best[name])], marker="*", ms=14, ls="none",
                      color="gold", markeredgecolor="black", label=f"best ({row} {best[row]:,})")
        axis.set_ylabel(name)
        axis.grid(alpha=0.3)
        if steps or (best is not None and name == monitor):
            axis.legend(loc="best", fontsize="small")
    axes[-1].set_xlabel(x)
    if ax is None:
        fig.suptitle(title or history.title)
    return fig


@hookimpl(trylast=True)
def jaxnitro_plot(history, options):
    return plot(history, **options)


@hookimpl(trylast=True)
def jaxnitro_exports():
    return {"plot": plot}
