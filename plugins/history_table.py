"""The built-in renderer of :class:`jaxnitro.MetricHistory`: terminal table, HTML, CSV, pandas.

Registered as the entry point ``history_table`` in group ``jaxnitro``. It
implements ``jaxnitro_render_history(history, format, options)`` with
``trylast=True``, so an installed plugin that answers the same format wins.
It answers:

* ``"text"``: a framed table (``print(h)``, ``h.table()``). ``options`` may
  hold ``width`` (characters) and ``max_rows`` (body lines, ``⋮`` lines
  included); a missing one defaults to the terminal's size
  (``shutil.get_terminal_size``, 100x24 without a terminal; the rows get the
  height minus 9 lines of title, rules and footers). When the rows do not fit,
  the table keeps the first rows, the best row with its neighbours and the
  last rows, writes ``⋮`` for each gap and says in a footer which selection
  shows every row; columns wider than ``width`` are dropped from the right
  (the monitored metric last) and named in a footer. The best row is starred.
  The title line fits ``width`` too: the run folder relative to the working
  directory when inside it, its leading folders elided with ``…`` when too long.
* ``"html"``: every row as an HTML table (``_repr_html_`` in a notebook); the
  best row bold and starred.
* ``"csv"``: the scalar columns written to ``options["path"]`` (header row
  first, floats at full precision, NaN as ``nan``); returns the path.
* ``"pandas"``: a ``pandas.DataFrame`` indexed by ``epoch`` (pandas is
  imported here, on demand).
* any other format: ``None`` (not ours).

Only scalar columns (``history.scalar_columns``) are tabulated or written to
CSV; the others are named in a footer with the expression that reaches them.
The renderer reads a history only through its public API (``rows``,
``columns``, ``scalar_columns``, ``best_position``, ``monitor``, ``title``,
``run_dir``, ``total_epochs``, ``resumed_from``, ``column()``,
``reads_as_attribute()``), never its private attributes.
"""

from __future__ import annotations

import csv
import html
import math
import numbers
import os
import shutil
from typing import Any

import numpy as np

from jaxnitro.plugin import hookimpl

__all__ = ["jaxnitro_render_history"]

# Lines of a printed table that are not body rows: title, three rules, header
# and up to four footers. The rest of the terminal's height holds rows.
_CHROME_LINES = 9
_MIN_BODY_ROWS = 5  # first, gap, best, gap, last
_GAP = "⋮"


@hookimpl(trylast=True)
def jaxnitro_render_history(history, format, options):
    """Render ``history`` as ``format`` (``"text"``, ``"html"``, ``"csv"``, ``"pandas"``), else ``None``."""
    render = _RENDERERS.get(format)
    return None if render is None else render(history, dict(options or {}))


# --------------------------------------------------------------------------
# cells and lines shared by the text and HTML views


def _fmt(value: Any) -> str:
    """One table cell: ints plain, floats with four decimals (scientific when tiny or huge)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):
        x = float(value)
        if math.isnan(x):
            return "nan"
        if math.isinf(x):
            return "inf" if x > 0 else "-inf"
        if x == 0 or 1e-3 <= abs(x) < 1e6:
            return f"{x:.4f}"
        return f"{x:.3e}"
    return str(value)


def _shown_dir(run_dir: str) -> str:
    """The run folder as the title shows it: relative to the working directory when inside it."""
    try:
        relative = os.path.relpath(run_dir)
    except ValueError:  # another drive (Windows)
        return run_dir
    return relative if not relative.startswith(os.pardir) and len(relative) < len(run_dir) else run_dir


def _fit(make, run_dir: str | None, width: int | None) -> str:
    """``make(dir)`` (``dir`` the run folder's text, or None) within ``width`` characters.

    The run folder is shown relative to the working directory when inside it; when the line
    is still too wide its leading folders give way to ``…`` (the run's own folder name
    stays), then the folder is left out, then the line is cut with ``…``.
    """
    if not run_dir:
        line = make(None)
    else:
        shown = _shown_dir(run_dir)
        line = make(shown)
        if width is not None and len(line) > width:
            room = width - (len(line) - len(shown))
            tail = shown[-(room - 1):] if room > 1 else ""
            cut = tail.find(os.sep)
            tail = tail[cut:] if cut > 0 else tail
            name = os.path.basename(shown.rstrip(os.sep))
            line = make("…" + tail) if room > 1 and name in tail else make(None)
    if width is not None and len(line) > width:
        line = line[: max(width - 1, 0)] + "…"
    return line


def _title_line(history, shown: int | None = None, width: int | None = None) -> str:
    """``<title>  (<run dir>, [<shown> of ]<n> epochs[, <planned> planned])``, within ``width``; ``rows``
    for ``epochs`` when the rows are not one per epoch (validated every N steps)."""
    n = len(history)
    numbers = [row["epoch"] for row in history]
    per_epoch = numbers == list(range(numbers[0], numbers[0] + n)) if n else True
    epochs = ("epoch" if n == 1 else "epochs") if per_epoch else ("row" if n == 1 else "rows")
    thinned = shown is not None and shown < n
    parts = [f"{shown} of {n} {epochs}" if thinned else f"{n} {epochs}"]
    if history.total_epochs is not None:
        parts.append(f"{history.total_epochs} planned")
    return _fit(lambda where: f"{history.title}  ({', '.join(([where] if where else []) + parts)})",
                history.run_dir, width)


def _empty_line(history, width: int | None = None) -> str:
    """The whole display of a history without rows."""
    resumed = history.resumed_from
    tail = f"; resumed from epoch {resumed}" if resumed is not None else ""
    return _fit(lambda where: f"{history.title}  ({f'{where}, ' if where else ''}no epochs yet{tail})",
                history.run_dir, width)


def _reach(history, name: str) -> str:
    """The expression that reads column ``name``: ``h.name`` or ``h.column('name')``."""
    return f"h.{name}" if history.reads_as_attribute(name) else f"h.column({name!r})"


def _common_footers(history) -> list[str]:
    """Footer lines shared by the text and HTML views (best, arrays, resume)."""
    lines = []
    monitor = history.monitor
    if history.best_position is not None:
        name, mode = monitor
        lines.append(f"* best {name} ({mode}), the monitored metric")
    elif monitor is not None and monitor[0] in history.columns and len(history):
        lines.append(f"no best epoch: {monitor[0]} has no number in these rows")
    scalar = set(history.scalar_columns)
    hidden = [c for c in history.columns if c not in scalar]
    if hidden:
        them = "it" if len(hidden) == 1 else "them"
        lines.append(
            f"not tabulated: {', '.join(hidden)} "
            f"(reach {them} as {', '.join(_reach(history, c) for c in hidden)})"
        )
    if history.resumed_from is not None:
        lines.append(
            f"resumed from epoch {history.resumed_from}: this history starts there; "
            "earlier epochs belong to the run it resumed"
        )
    return lines


# --------------------------------------------------------------------------
# text: thinning rows


def _layout_cost(kept: set[int], n: int) -> int:
    """Body lines needed to show positions ``kept`` of ``n``: one per row, one per gap."""
    order = sorted(kept)
    gaps = (order[0] > 0) + (order[-1] < n - 1)
    gaps += sum(1 for a, b in zip(order, order[1:]) if b - a > 1)
    return len(order) + gaps


def _thin(n: int, best: int | None, budget: int) -> list[int]:
    """Positions to show when ``n`` rows must fit in ``budget`` body lines.

    The first row, the best row and the last row are always kept. Then blocks
    grow around each of them in turn (head, tail, both sides of the best), a
    row at a time, while the rows plus one ``⋮`` line per gap fit the budget. A
    row that closes a one-row gap costs nothing and is always taken.
    """
    if n <= budget:
        return list(range(n))
    anchors = [0, n - 1] + ([best] if best is not None else [])
    kept = set(anchors)
    b = best if best is not None else 0
    candidates: list[int] = []
    for k in range(1, n):
        candidates += [k, n - 1 - k]
        if best is not None:
            candidates += [b - k, b + k]
    for p in candidates:
        if _layout_cost(kept, n) >= budget:
            break
        if 0 <= p < n and p not in kept and _layout_cost(kept | {p}, n) <= budget:
            kept.add(p)
    # A row between two kept rows replaces its own gap line: free.
    kept.update([p + 1 for p in list(kept) if p + 2 in kept and p + 1 not in kept])
    return sorted(kept)


# --------------------------------------------------------------------------
# text: fitting columns and drawing the frame


def _content_width(widths: dict[str, int], columns: list[str], star: bool) -> int:
    """Width inside the frame's padding: the cells, two-space gutters and the star column."""
    return sum(widths[c] for c in columns) + 2 * (len(columns) - 1) + (2 if star else 0)


def _fit_columns(history, columns, widths, width, star) -> tuple[list[str], list[str]]:
    """``(visible, dropped)``: columns dropped from the right until the frame fits ``width``.

    ``epoch``, the monitored metric, ``train_loss`` and ``step`` go last, in
    the reverse of that order.
    """
    monitor = history.monitor[0] if history.monitor else None
    protected = [c for c in ("epoch", monitor, "train_loss", "step") if c in columns]
    drop_order = [c for c in reversed(columns) if c not in protected] + protected[:0:-1]
    visible, dropped = list(columns), []
    for c in drop_order:
        if _content_width(widths, visible, star) + 4 <= width:
            break
        visible.remove(c)
        dropped.append(c)
    return visible, dropped


def _frame(visible, widths, body_cells, shown, best, star) -> list[str]:
    """The framed table: top rule, header, rule, one line per shown row (``⋮`` per gap), bottom rule."""
    inner = _content_width(widths, visible, star)

    def line(texts: list[str], mark: bool) -> str:
        body = "  ".join(t.rjust(widths[c]) for c, t in zip(visible, texts))
        if star:
            body += " *" if mark else "  "
        return f"│ {body} │"

    out = ["┌" + "─" * (inner + 2) + "┐", line(visible, False), "├" + "─" * (inner + 2) + "┤"]
    previous = -1
    for i, p in enumerate(shown):
        if p != previous + 1:
            out.append("│ " + _GAP.rjust(widths[visible[0]]).ljust(inner) + " │")
        out.append(line([body_cells[c][i] for c in visible], p == best))
        previous = p
    out.append("└" + "─" * (inner + 2) + "┘")
    return out


def _text_footers(history, epochs, shown, budget, columns, dropped, width) -> list[str]:
    """The common footers plus, for the text view, rows thinned and columns dropped."""
    footers = _common_footers(history)
    n = len(epochs)
    if len(shown) < n:
        tail = epochs[max(n - budget, 0)]
        footers.insert(
            1 if history.best_position is not None else 0,
            f"{n - len(shown)} of {n} epochs thinned to fit; select fewer, "
            f"`h[{tail}:{epochs[-1]}]` say, for every row",
        )
    if dropped:
        names = [c for c in columns if c in dropped]
        quoted = ", ".join(repr(c) for c in names)
        footers.append(
            f"not shown, the table would pass {width} characters: {', '.join(names)} "
            f"(select them, h[{quoted}], or widen the terminal)"
        )
    return footers


def _text(history, options: dict) -> str:
    """The framed text table; see the module docstring."""
    size = shutil.get_terminal_size((100, 24))
    width = options.get("width")
    width = size.columns if width is None else width
    if not len(history):
        return _empty_line(history, width)
    max_rows = options.get("max_rows")
    max_rows = size.lines - _CHROME_LINES if max_rows is None else max_rows
    budget = max(int(max_rows), _MIN_BODY_ROWS)

    rows = history.rows
    best = history.best_position
    shown = _thin(len(rows), best, budget)
    star = best is not None
    columns = history.scalar_columns
    cells = {c: [_fmt(rows[p][c]) for p in shown] for c in columns}
    widths = {c: max([len(c)] + [len(s) for s in cells[c]]) for c in columns}
    visible, dropped = _fit_columns(history, columns, widths, width, star)

    epochs = [r["epoch"] for r in rows]
    footers = _text_footers(history, epochs, shown, budget, columns, dropped, width)
    out = [_title_line(history, len(shown), width)]
    out += _frame(visible, widths, cells, shown, best, star)
    out += ["  " + f for f in footers]
    return "\n".join(out)


# --------------------------------------------------------------------------
# html


def _html(history, options: dict) -> str:
    """Every row as an HTML table; the best row is bold and starred."""
    esc = html.escape
    if not len(history):
        return f"<div class='jaxnitro-history'><p>{esc(_empty_line(history))}</p></div>"
    best = history.best_position
    star = best is not None
    columns = history.scalar_columns
    head = "".join(f"<th>{esc(c)}</th>" for c in columns) + ("<th></th>" if star else "")
    body = []
    for p, r in enumerate(history.rows):
        is_best = p == best
        tds = "".join(f"<td style='text-align:right'>{esc(_fmt(r[c]))}</td>" for c in columns)
        if star:
            tds += f"<td>{'*' if is_best else ''}</td>"
        attrs = " class='best' style='font-weight:bold'" if is_best else ""
        body.append(f"<tr{attrs}>{tds}</tr>")
    footers = "".join(f"<div>{esc(f)}</div>" for f in _common_footers(history))
    return (
        f"<div class='jaxnitro-history'><div><strong>{esc(_title_line(history))}</strong></div>"
        f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
        f"{footers}</div>"
    )


# --------------------------------------------------------------------------
# csv and pandas


def _csv_cell(value: Any) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else repr(value)
    return str(value)


def _csv(history, options: dict):
    """Write the scalar columns to ``options["path"]``; return the path."""
    path = options["path"]
    columns = history.scalar_columns
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        for r in history.rows:
            writer.writerow([_csv_cell(r[c]) for c in columns])
    return path


def _pandas(history, options: dict):
    """A ``pandas.DataFrame`` indexed by ``epoch``, or by ``step`` when an epoch has several rows
    (validated every N steps); array columns are ``object`` columns."""
    try:
        import pandas as pd
    except ImportError as error:
        raise ImportError(
            "MetricHistory.to_pandas() needs pandas, which is not installed; "
            "install it with `pip install pandas` (or use h.to_csv(path) / h.rows)."
        ) from error
    epochs = history.column("epoch")
    key = "epoch" if len(set(epochs.tolist())) == len(epochs) else "step"
    index = pd.Index(history.column(key), name=key)
    scalar = set(history.scalar_columns)
    rows = history.rows
    columns = [c for c in history.columns if c != key]
    data: dict[str, Any] = {}
    for c in columns:
        if c in scalar:
            data[c] = history.column(c)
        else:
            values = np.empty(len(rows), dtype=object)  # one array per cell, never stacked
            for i, r in enumerate(rows):
                values[i] = r[c]
            data[c] = pd.Series(values, index=index, dtype=object)
    return pd.DataFrame(data, index=index, columns=columns)


_RENDERERS = {"text": _text, "html": _html, "csv": _csv, "pandas": _pandas}
