"""A run's per-epoch record: :class:`MetricHistory`.

One row per validated epoch. Every row has ``epoch`` (int), ``step`` (optimizer
steps taken when the epoch closed, int) and ``train_loss`` (the epoch's mean
training loss, float, NaN allowed), plus whatever metrics the experiment
returned for that epoch: scalars, or arrays such as a confusion matrix.

The history is data first and a display second::

    h = nitro.history
    h[10:20]                    # epochs 10 through 20 (labels, both ends included)
    h["acc", "macro_recall"]    # two metrics; epoch and step always come along
    h[10:20, "acc"]             # both at once
    h.steps(2000, 6000)         # epochs that closed within steps 2000..6000
    h[-1]                       # the last row, as a dict (position, like a list)
    h.macro_recall              # one column as a NumPy array
    h.to_pandas(); h.to_csv("run.csv")

This module is the data model only. Displaying and exporting a history
(``str(h)``, ``h.table()``, ``_repr_html_``, ``to_csv``, ``to_pandas``) goes
through the extension hook ``jaxnitro_render_history(history, format,
options)`` with ``format`` ``"text"``, ``"html"``, ``"csv"`` or ``"pandas"``:
the first plugin that answers renders it. The built-in plugin
``history_table`` answers all four (a framed table sized to the terminal that
keeps the first, best and last epochs and stars the best one; an HTML table
with every row; CSV; a DataFrame); an installed plugin answering the same
format wins over it. A renderer reads the history through its public API only.

When no plugin answers (``JAXNITRO_DISABLE_PLUGINS=history_table``, say),
``table``, ``to_csv`` and ``to_pandas`` raise ``RuntimeError`` naming the
missing format, while ``str``, ``repr`` and ``_repr_html_`` never raise: they
show a one-line summary (epochs, columns, best epoch).

This module depends on NumPy and the plugin manager only.
"""

from __future__ import annotations

import html
import keyword
import math
import numbers
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

import numpy as np

from .plugin_manager import disabled_note, first_result

__all__ = ["MetricHistory", "improves", "best_positions"]

_FIXED = ("epoch", "step", "train_loss")
FIXED_COLUMNS = _FIXED
"""The columns every history row has; a metric may not take one of these names."""
_MODES = ("max", "min")


# --------------------------------------------------------------------------
# values


def _normalize(value: Any) -> Any:
    """Plain Python scalars for scalars (NumPy/JAX ones included); copied arrays otherwise."""
    if isinstance(value, np.generic):  # before the float check: np.float64 is a float
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    try:
        array = np.array(value)  # copies: the history never aliases caller memory
    except Exception:  # noqa: BLE001 - an opaque object is kept as it is
        return value
    if array.ndim == 0:
        return array.item()
    return array


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real)


def _as_int(value: Any, key: str, position: int) -> int:
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise ValueError(
        f"MetricHistory: row {position} has {key}={value!r}; `{key}` must be an integer "
        f"(the {'epoch number' if key == 'epoch' else 'optimizer steps taken so far'})."
    )


# --------------------------------------------------------------------------
# "best": one rule for every consumer


def improves(value: Any, best: Any, mode: str, min_delta: float = 0.0) -> bool:
    """Whether monitored ``value`` beats ``best`` (None: nothing yet) in ``mode`` ("max" | "min").

    The one rule of "best" that the history (its starred row), the plot, the checkpointer
    (``jn.Best(n)``, ``("latest", "best")``, ``restore_best``) and early stopping share:
    a value is better only when it is **strictly** better (by more than ``min_delta``);
    NaN (and None) never is. So among epochs that tie, the **earliest** is the best: a later
    epoch that only equals it took more steps to get no further, and early stopping counts
    it as no improvement.
    """
    if value is None:
        return False
    value = float(value)
    if math.isnan(value):
        return False
    if best is None or math.isnan(float(best)):
        return True
    return value > float(best) + min_delta if mode == "max" else value < float(best) - min_delta


def best_positions(values: Sequence[Any], mode: str, n: int = 1) -> list[int]:
    """The positions of the ``n`` best of ``values`` (in epoch order), best first, by :func:`improves`.

    None and NaN are never chosen; among equal values the earlier position ranks higher.
    ``best_positions(v, mode)[0]`` is the best epoch's position (an empty list: none).
    """
    ranked: list[int] = []
    for position, value in enumerate(values):
        if value is None or math.isnan(float(value)):
            continue
        # insert after every kept value that this one does not beat: ties keep epoch order
        at = len(ranked)
        while at > 0 and improves(value, values[ranked[at - 1]], mode):
            at -= 1
        ranked.insert(at, position)
    return ranked[:n]


# --------------------------------------------------------------------------
# the monitored metric: checked where it enters a row, read by the stop policies


def check_monitored_in(final: dict, name: str, what: str = "") -> None:
    """The monitored metric ``name`` is among the `val` split's metrics ``final``, and one
    number (:func:`check_monitored_value`): checked at setup on the first batch (``what``:
    ``" for its first batch"``) and on every validation, before the row carrying it reaches
    a plugin."""
    if name not in final:
        raise KeyError(
            f"jaxnitro: `monitor` names {name!r}, but the `val` split's metrics are {sorted(final)} "
            f"(what finalize_metrics returned{what}). Return {name!r} from "
            f"`metrics`/`finalize_metrics`, or monitor one of those."
        )
    check_monitored_value(name, final[name])


def monitored_value(run, row: dict):
    """``(name, mode, value)`` of the monitored metric in history row ``row``, or None when the
    run has no ``monitor`` or the row lacks the metric (a row that was not validated). What
    stop policies read at each row; the loop checked the value (:func:`check_monitored_in`)
    when it merged the validation's metrics into the row."""
    monitor = run.monitor
    if monitor is None or monitor[0] not in row:
        return None
    return (*monitor, row[monitor[0]])


def check_monitored_value(name: str, value) -> None:
    """Refuse a monitored metric that is not one number (an array, a string)."""
    shape = np.shape(value)
    if shape != () or not np.issubdtype(np.asarray(value).dtype, np.number):
        raise TypeError(
            f"jaxnitro: the monitored metric {name!r} is "
            f"{f'an array of shape {shape}' if shape else repr(value)}; `monitor` compares one "
            f"number per epoch. Monitor a scalar metric, or reduce this one in `finalize_metrics` "
            f"(e.g. its mean) and monitor that."
        )


# --------------------------------------------------------------------------
# building a history: its arguments checked, its columns, its rows


def _checked_monitor(monitor: Any) -> tuple[str, str] | None:
    """``monitor`` as ``(name, mode)``, or None; refuses anything but a pair with a known mode."""
    if monitor is None:
        return None
    if not (isinstance(monitor, (tuple, list)) and len(monitor) == 2):
        raise ValueError(
            "MetricHistory: `monitor` must be a pair (name, 'max' | 'min'), "
            f"got {monitor!r}."
        )
    name, mode = monitor
    if mode not in _MODES:
        raise ValueError(
            f"MetricHistory: unknown monitor mode {mode!r} for {name!r}; "
            "use 'max' (higher is better) or 'min' (lower is better)."
        )
    return (str(name), mode)


def _columns_of(rows: Sequence[Mapping[str, Any]], monitor: tuple[str, str] | None) -> list[str]:
    """The history's columns in order: ``epoch, step, train_loss`` (left out for a train_step's
    ``train_<name>`` columns), the monitored metric, then the others as they first appear.
    Refuses a row that is not a mapping or lacks ``epoch`` or ``step``."""
    seen: dict[str, None] = {}
    for position, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise TypeError(
                f"MetricHistory: row {position} is a {type(row).__name__}; "
                "each row must be a dict of column name to value."
            )
        for key in ("epoch", "step"):
            if key not in row:
                raise ValueError(
                    f"MetricHistory: row {position} has no `{key}` "
                    f"(it has {', '.join(map(str, row)) or 'no keys'}); "
                    "every row needs `epoch` and `step`."
                )
        for key in row:
            seen.setdefault(str(key), None)
    columns = list(_FIXED)
    if "train_loss" not in seen and any(c.startswith("train_") for c in seen):
        columns.remove("train_loss")  # a train_step's train_<name> columns instead
    if monitor is not None and monitor[0] in seen and monitor[0] not in columns:
        columns.append(monitor[0])
    return columns + [c for c in seen if c not in columns]


def _cell(value: Any, column: str, scalar: bool, position: int) -> Any:
    """Row ``position``'s value in ``column``, checked: ``epoch`` and ``step`` integers,
    ``train_loss`` a float (missing: NaN), a missing scalar metric NaN."""
    if column in ("epoch", "step"):
        return _as_int(value, column, position)
    if column == "train_loss":
        if value is not None and not _is_number(value):
            raise ValueError(
                f"MetricHistory: row {position} has train_loss={value!r}; "
                "it must be a number (NaN allowed)."
            )
        return float("nan") if value is None else float(value)
    if value is None and scalar:
        return float("nan")
    return value


def _normalized_rows(raw: list[dict[str, Any]], columns: list[str], scalar: dict[str, bool]) -> list[dict[str, Any]]:
    """Each row with every column (:func:`_cell`); refuses rows out of order: an epoch lower
    than the row before's, or the same epoch (rows every N steps) without a higher step."""
    normalized: list[dict[str, Any]] = []
    previous: tuple[int, int] | None = None
    for position, r in enumerate(raw):
        out = {c: _cell(r.get(c), c, scalar[c], position) for c in columns}
        if previous is not None and (out["epoch"], out["step"]) <= previous:
            raise ValueError(
                f"MetricHistory: rows must be in order, epochs never decreasing and the rows of one "
                f"epoch with increasing steps; row {position} has epoch {out['epoch']}, step "
                f"{out['step']} after epoch {previous[0]}, step {previous[1]}."
            )
        previous = (out["epoch"], out["step"])
        normalized.append(out)
    return normalized


# --------------------------------------------------------------------------
# the history


class MetricHistory:
    """The per-epoch metrics of a run, as a small immutable table.

    **Arguments.**

    - ``rows``: one mapping per validated epoch, or per validation with
      ``val_every_n_steps`` (several rows of one epoch, keyed by ``step``), in order
      (``epoch`` never decreasing, ``step`` increasing within an epoch). Each has ``epoch`` and ``step`` (integers) and
      normally ``train_loss`` (float; NaN allowed, missing reads as NaN; a run with
      a ``train_step`` hook has ``train_<name>`` columns instead, and ``train_loss``
      only when the step returns a ``loss``), plus
      metrics: Python/NumPy/JAX scalars or arrays. Rows may carry different
      keys; a scalar metric missing from a row reads as NaN there, an array
      metric as ``None``. Values are copied in: NumPy scalars become Python
      scalars, arrays are copied.
    - ``monitor``: ``(name, "max" | "min")``, the metric the run selects its
      best epoch on (the checkpointer's metric). Its column comes right after
      ``train_loss``.
    - ``title``: the first words of the printed title line, e.g.
      ``"history of MnistMLP"``.
    - ``run_dir``: the run's folder, shown in the title line.
    - ``total_epochs``: the epochs the run was configured for, shown in the
      title line when given (an early-stopped run has fewer rows).
    - ``resumed_from``: the epoch a resumed run continued from; a footer says
      that earlier epochs are not in this history.

    **Columns** are ordered ``epoch, step, train_loss`` (left out when no row has it
    and the rows have other ``train_*`` columns), then the monitored
    metric if any row has it, then the others in the order they first appear.
    A column is *scalar* when every value in it is a real number; other columns
    (arrays, strings) are reachable but not tabulated.

    **Selection** always returns a new :class:`MetricHistory` with the same
    ``monitor``, ``title``, ``run_dir``, ``total_epochs`` and ``resumed_from``;
    its best epoch is recomputed within the selection, and exists only if the
    monitored column was kept.

    - ``h[10:20]``: epochs whose *label* lies in 10..20, **both ends
      included** (not positions). Open ends work: ``h[5:]``, ``h[:20]``. A
      slice step (``h[1:10:2]``) is refused.
    - ``h["acc"]``, ``h["acc", "macro_recall"]``: those columns; ``epoch``
      and ``step`` are always kept. Columns stay in the history's order.
    - ``h[10:20, "acc"]``, ``h[10:20, ("acc", "f1")]``: both.
    - ``h.steps(2000, 6000)``: epochs whose ``step`` lies in 2000..6000,
      both ends included.

    **Rows and columns.**

    - ``h[-1]``, ``h[0]``: an integer picks a row by **position**, like a list
      (``h[0]`` is the first row whatever its epoch; ``h[-1]`` the last), and
      returns it as a dict. Use ``h[7:7]`` to select epoch 7 by label.
    - ``h.acc``: the column as a NumPy array (``h.column("acc")`` for names
      that are not identifiers or collide with a method). Array columns whose
      values share a shape are stacked, ``(len(h), *shape)``; otherwise an
      object array of length ``len(h)``.
    - ``h.columns``, ``h.scalar_columns``, ``h.rows``, ``len(h)``,
      ``iter(h)`` (row dicts), ``h.best`` / ``h.best_epoch`` /
      ``h.best_position``.

    **Output.** ``str(h)`` / ``repr(h)`` is :meth:`table` at the terminal's
    size; ``_repr_html_`` shows every row; :meth:`to_pandas`, :meth:`to_csv`.
    All of them are rendered by a plugin through the hook
    ``jaxnitro_render_history`` (the built-in one is ``history_table``).
    """

    __slots__ = (
        "_rows",
        "_columns",
        "_scalar",
        "_monitor",
        "_title",
        "_run_dir",
        "_total_epochs",
        "_resumed_from",
        "_best",
        "_selected",
    )

    def __init__(
        self,
        rows: Sequence[Mapping[str, Any]],
        *,
        monitor: tuple[str, Literal["max", "min"]] | None = None,
        title: str = "history",
        run_dir: str | os.PathLike[str] | None = None,
        total_epochs: int | None = None,
        resumed_from: int | None = None,
    ) -> None:
        monitor = _checked_monitor(monitor)
        columns = _columns_of(rows, monitor)
        raw = [{str(k): _normalize(v) for k, v in row.items()} for row in rows]
        scalar = {
            c: all(r.get(c) is None or _is_number(r[c]) for r in raw) for c in columns
        }
        scalar.update({c: True for c in _FIXED if c in columns})
        normalized = _normalized_rows(raw, columns, scalar)

        self._init(
            normalized,
            columns,
            scalar,
            monitor,
            title,
            None if run_dir is None else os.fspath(run_dir),
            total_epochs,
            resumed_from,
        )

    def _init(self, rows, columns, scalar, monitor, title, run_dir, total_epochs, resumed_from, selected=None):
        self._selected: tuple[str, ...] | None = selected
        self._rows: list[dict[str, Any]] = rows
        self._columns: list[str] = columns
        self._scalar: dict[str, bool] = {c: scalar[c] for c in columns}
        self._monitor = monitor
        self._title = title
        self._run_dir = run_dir
        self._total_epochs = total_epochs
        self._resumed_from = resumed_from
        self._best = self._find_best()

    def _derive(self, rows: list[dict[str, Any]], columns: list[str], selected=None) -> MetricHistory:
        """A selection: same metadata, the given rows restricted to ``columns``; ``selected``
        names the metrics a column selection picked (kept through a later epoch slice)."""
        new = object.__new__(MetricHistory)
        new._init(
            [{c: r[c] for c in columns} for r in rows],
            columns,
            self._scalar,
            self._monitor,
            self._title,
            self._run_dir,
            self._total_epochs,
            self._resumed_from,
            tuple(selected) if selected is not None else self._selected,
        )
        return new

    def _find_best(self) -> int | None:
        if self._monitor is None:
            return None
        name, mode = self._monitor
        if name not in self._columns or not self._scalar[name]:
            return None
        ranked = best_positions([row[name] for row in self._rows], mode)
        return ranked[0] if ranked else None

    # -- metadata -----------------------------------------------------------

    @property
    def columns(self) -> list[str]:
        """Column names, in display order."""
        return list(self._columns)

    @property
    def scalar_columns(self) -> list[str]:
        """The columns whose every value is a real number, in display order.

        ``epoch``, ``step`` and ``train_loss`` always; a metric column with an
        array or a string anywhere is not scalar. These are the columns a table
        or a CSV can show; the others are reachable with :meth:`column`.
        """
        return [c for c in self._columns if self._scalar[c]]

    @property
    def rows(self) -> list[dict[str, Any]]:
        """Every row as a fresh dict (arrays copied), in epoch order."""
        return [self._copy_row(r) for r in self._rows]

    @property
    def monitor(self) -> tuple[str, str] | None:
        """``(name, "max" | "min")`` or ``None``."""
        return self._monitor

    @property
    def title(self) -> str:
        return self._title

    @property
    def run_dir(self) -> str | None:
        return self._run_dir

    @property
    def total_epochs(self) -> int | None:
        return self._total_epochs

    @property
    def resumed_from(self) -> int | None:
        return self._resumed_from

    @property
    def best(self) -> dict[str, Any] | None:
        """The best row (max/min of the monitored metric; the earliest on ties, see
        :func:`improves`; NaN ignored), or ``None``.

        ``None`` without a monitor, when the monitored column is not in this
        selection, or when it is NaN in every row.
        """
        return None if self._best is None else self._copy_row(self._rows[self._best])

    @property
    def best_epoch(self) -> int | None:
        """The epoch label of :attr:`best`, or ``None``."""
        return None if self._best is None else self._rows[self._best]["epoch"]

    @property
    def best_position(self) -> int | None:
        """The position of :attr:`best` among the rows (``h[h.best_position]``), or ``None``."""
        return self._best

    @classmethod
    def reads_as_attribute(cls, name: str) -> bool:
        """Whether a column called ``name`` reads as ``h.<name>``.

        True for identifiers that are not keywords, do not start with ``_``
        and are not names of this class; other columns read as
        ``h.column(name)``.
        """
        return (
            name.isidentifier()
            and not keyword.iskeyword(name)
            and not name.startswith("_")
            and not hasattr(cls, name)
        )

    @staticmethod
    def _copy_row(row: dict[str, Any]) -> dict[str, Any]:
        return {k: v.copy() if isinstance(v, np.ndarray) else v for k, v in row.items()}

    # -- sequence protocol ----------------------------------------------------

    def __len__(self) -> int:
        return len(self._rows)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (self._copy_row(r) for r in self._rows)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, (int, np.integer)) and not isinstance(key, (bool, np.bool_)):
            return self._row_at(int(key))
        if isinstance(key, slice):
            return self._derive(self._epoch_range(key), self._columns)
        if isinstance(key, str):
            return self._derive(self._rows, self._select_columns([key]), selected=[key])
        if isinstance(key, (tuple, list)) and key:
            first, rest = key[0], key[1:]
            if isinstance(first, slice):
                if len(rest) == 1 and isinstance(rest[0], (tuple, list)):
                    rest = tuple(rest[0])
                if rest and all(isinstance(k, str) for k in rest):
                    return self._derive(self._epoch_range(first), self._select_columns(rest), selected=rest)
            elif all(isinstance(k, str) for k in key):
                return self._derive(self._rows, self._select_columns(key), selected=key)
        raise TypeError(
            f"MetricHistory: cannot index with {key!r}. Use h[10:20] (epochs 10 to 20, "
            'inclusive), h["acc"] or h["acc", "f1"] (metrics), h[10:20, "acc"] (both), '
            "or an integer position, h[-1], for one row."
        )

    def _row_at(self, position: int) -> dict[str, Any]:
        n = len(self._rows)
        if not -n <= position < n:
            where = "the history is empty" if n == 0 else f"it has {n} rows (positions 0..{n - 1})"
            raise IndexError(
                f"MetricHistory: no row at position {position}; {where}. An integer index is a "
                "position, like a list; select epochs by label with a slice, h[7:7]."
            )
        return self._copy_row(self._rows[position])

    def _epoch_range(self, key: slice) -> list[dict[str, Any]]:
        if key.step is not None:
            raise ValueError(
                f"MetricHistory: h[{_slice_text(key)}] has a step; slices select epochs by label, "
                "both ends included, and take no step. Select the range, h"
                f"[{_slice_text(slice(key.start, key.stop))}], then thin it yourself, "
                "e.g. h.rows[::2]."
            )
        return _in_range(self._rows, "epoch", key.start, key.stop, "h[start:stop]")

    def steps(self, start: int | None = None, stop: int | None = None) -> MetricHistory:
        """The epochs whose ``step`` lies in ``start..stop``, both ends included.

        ``None`` leaves that end open: ``h.steps(6000)`` is every epoch that
        closed at step 6000 or later. Returns a :class:`MetricHistory`.
        """
        return self._derive(
            _in_range(self._rows, "step", start, stop, "h.steps(start, stop)"), self._columns
        )

    def _select_columns(self, names: Sequence[str]) -> list[str]:
        unknown = [n for n in names if n not in self._columns]
        if unknown:
            raise KeyError(_no_column(unknown, self._columns))
        wanted = {"epoch", "step", *names}
        return [c for c in self._columns if c in wanted]

    # -- columns ----------------------------------------------------------------

    def column(self, name: str) -> np.ndarray:
        """One column as a NumPy array of length ``len(h)``.

        Scalar columns give a numeric array (``epoch`` and ``step`` as
        integers; a column with a missing value as floats with NaN). Array
        columns whose values all share one shape are stacked into
        ``(len(h), *shape)``; anything else is a 1-D object array (``None``
        where a row lacks the value). ``h.name`` is the same for names that
        are identifiers and not methods of this class.
        """
        if name not in self._columns:
            raise KeyError(_no_column([name], self._columns))
        values = [r[name] for r in self._rows]
        if self._scalar[name]:
            if not values:
                return np.zeros(0, dtype=int if name in ("epoch", "step") else float)
            return np.asarray(values)
        if values and all(isinstance(v, np.ndarray) for v in values):
            if len({(v.shape) for v in values}) == 1:
                return np.stack(values)
        out = np.empty(len(values), dtype=object)
        for i, v in enumerate(values):
            out[i] = v.copy() if isinstance(v, np.ndarray) else v
        return out

    def __getattr__(self, name: str) -> np.ndarray:
        # Only reached for names that are not attributes of the class.
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            columns = object.__getattribute__(self, "_columns")
        except AttributeError:
            raise AttributeError(name) from None
        if name in columns:
            return self.column(name)
        raise AttributeError(_no_column([name], columns, "MetricHistory has no column or attribute"))

    def __dir__(self) -> list[str]:
        names = set(super().__dir__())
        names.update(c for c in self._columns if self.reads_as_attribute(c))
        return sorted(names)

    # -- output: rendered by plugins ---------------------------------------------

    def _render(self, format: str, **options: Any) -> Any:
        """The first plugin's answer to ``jaxnitro_render_history`` for ``format``, or ``None``."""
        return first_result("jaxnitro_render_history", history=self, format=format, options=options)

    def _render_or_raise(self, format: str, caller: str, **options: Any) -> Any:
        """:meth:`_render`, raising ``RuntimeError`` (for ``h.<caller>``) when no plugin answers."""
        rendered = self._render(format, **options)
        if rendered is None:
            raise RuntimeError(
                f"MetricHistory.{caller}: no plugin renders histories as {format!r}. The "
                "built-in plugin `history_table` (entry point `history_table` in group "
                "`jaxnitro`) provides it, and it is not loaded" + disabled_note() + ". Re-enable "
                "or reinstall it, or register a plugin implementing `jaxnitro_render_history`."
            )
        return rendered

    def _summary(self, note: str) -> str:
        """One plain line (epochs, columns, best epoch, ``note``), shown when no plugin renders."""
        n = len(self._rows)
        where = f" ({self._run_dir})" if self._run_dir else ""
        epochs = "no epochs yet" if n == 0 else f"{n} epoch{'s' if n != 1 else ''}"
        text = f"MetricHistory {self._title!r}{where}: {epochs}, columns {', '.join(self._columns)}"
        if self._best is not None:
            name, mode = self._monitor
            text += f"; best epoch {self.best_epoch} by {name} ({mode})"
        return f"{text} [{note}]"

    def _display(self, format: str, fallback) -> str:
        """``format`` as a plugin renders it, else ``fallback(summary)``. Never raises."""
        try:
            rendered = self._render(format)
        except Exception as error:  # noqa: BLE001 - a display must never raise
            return fallback(self._summary(f"rendering failed: {type(error).__name__}: {error}"))
        if not isinstance(rendered, str):
            return fallback(self._summary(f"no plugin renders histories as {format!r}"))
        return rendered

    def table(self, width: int | None = None, max_rows: int | None = None) -> str:
        """The history as a text table, rendered by a plugin (format ``"text"``).

        ``width`` (characters) and ``max_rows`` (body lines) default to the
        terminal's size. The built-in plugin ``history_table`` draws a framed
        table that, when the rows do not fit, keeps the first rows, the best row
        with its neighbours and the last rows, drops columns that pass
        ``width`` from the right, names what it left out in footers and stars
        the best row. Raises ``RuntimeError`` if no plugin renders text.
        """
        options = {k: v for k, v in (("width", width), ("max_rows", max_rows)) if v is not None}
        return self._render_or_raise("text", "table()", **options)

    def __str__(self) -> str:
        return self._display("text", str)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        """Every row as an HTML table (format ``"html"``); the plain summary if no plugin renders it."""
        return self._display("html", lambda summary: f"<pre>{html.escape(summary)}</pre>")

    def to_pandas(self):
        """A ``pandas.DataFrame`` indexed by ``epoch`` with every other column (format ``"pandas"``).

        With the built-in plugin, scalar columns keep their NumPy dtype (int for
        ``step``; float where a value is NaN) and array columns are ``object``
        columns holding one array per row. Needs pandas (``pip install
        pandas``). Raises ``RuntimeError`` if no plugin renders pandas.
        """
        return self._render_or_raise("pandas", "to_pandas()")

    def to_csv(self, path: str | os.PathLike[str]) -> str | os.PathLike[str]:
        """Write the scalar columns to ``path`` as CSV (format ``"csv"``); returns ``path``.

        With the built-in plugin: a header row first, floats at full precision,
        NaN as ``nan``; array columns are left out (reach them as ``h.name``).
        Needs no pandas. Raises ``RuntimeError`` if no plugin writes CSV.
        """
        return self._render_or_raise("csv", "to_csv()", path=path)

    @property
    def selected_columns(self) -> tuple[str, ...] | None:
        """The metrics a column selection (``h["acc", "loss"]``) picked, in order; None when
        no column selection was made."""
        return self._selected

    def plot(self, *, metrics=None, x: str | None = None, ax=None, title: str | None = None):
        """Plot the history; returns the figure (matplotlib with the built-in ``plot`` plugin).

        Default: the monitored metric over epochs (over steps when an epoch has several rows),
        its best epoch starred; a column
        selection plots each selected metric; ``metrics="all"`` every scalar one;
        ``x="step"`` the step axis with the per-step train lines; ``ax=`` draws into given
        axes. Raises ``RuntimeError`` if no plugin plots histories.
        """
        options = {"metrics": metrics, "x": x, "ax": ax, "title": title}
        figure = first_result("jaxnitro_plot", history=self, options=options)
        if figure is None:
            raise RuntimeError(
                "MetricHistory.plot(): no plugin plots histories. The built-in plugin `plot` "
                "(entry point `plot` in group `jaxnitro`, with matplotlib: pip install "
                "'jaxnitro[plot]') provides it, and it is not loaded" + disabled_note() + "."
            )
        return figure


# --------------------------------------------------------------------------
# helpers


def close_columns(name: str, columns: Sequence[str]) -> list[str]:
    """The columns ``name`` probably meant: spelled alike (``difflib``), or containing it or
    contained in it (``"loss"`` -> ``"train_loss"``), best first."""
    import difflib

    lowered = name.lower()
    near = difflib.get_close_matches(name, list(columns), n=3, cutoff=0.6)
    near += [c for c in columns if c not in ("epoch", "step") and (lowered in c.lower() or c.lower() in lowered)]
    return list(dict.fromkeys(c for c in near if c != name))


def _no_column(unknown: Sequence[str], columns: Sequence[str], opening: str = "MetricHistory: no column") -> str:
    """The refusal of unknown column names: the close matches, then every column."""
    hints = []
    for name in unknown:
        close = close_columns(name, columns)
        if close:
            hints.append(f"for {name!r} did you mean {' or '.join(map(repr, close))}?")
    text = f"{opening} {', '.join(map(repr, unknown))}"
    if hints:
        text += "; " + "; ".join(hints)
    text += f" The columns are {', '.join(columns)}."
    if "loss" in unknown and "loss" not in columns:
        text += (
            " (`train_loss` is the epoch's training loss; a validation loss is a column only when "
            "`metrics` returns one, or, without a `metrics` hook, as `loss`.)"
        )
    return text


def _slice_text(s: slice) -> str:
    text = f"{'' if s.start is None else s.start}:{'' if s.stop is None else s.stop}"
    return text if s.step is None else f"{text}:{s.step}"


def _in_range(rows, key, start, stop, form) -> list[dict[str, Any]]:
    for bound in (start, stop):
        if bound is not None and (not _is_number(bound) or isinstance(bound, bool)):
            raise TypeError(
                f"MetricHistory: {form} takes numbers (or None for an open end), got {bound!r}."
            )
    return [
        r
        for r in rows
        if (start is None or r[key] >= start) and (stop is None or r[key] <= stop)
    ]

