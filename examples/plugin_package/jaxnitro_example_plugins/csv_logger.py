"""A jaxnitro logger writing a run's metrics as one CSV table: ``logger="csv"``.

Registered as the entry point ``csv`` in group ``jaxnitro``. The hook
:func:`jaxnitro_make_logger` answers the name ``"csv"`` (any case) with a
:class:`CSVLogger` on the run's folder, and ``None`` for every other name, so
the built-in loggers keep theirs.

Files written in ``run_dir``:

* ``metrics.csv``: a header line, then one row per ``log_metrics`` call. The
  first columns are always ``context, step, epoch, time`` (``context`` is
  ``"train"`` for a per-step line, ``"validate"`` for a validation, ``"data"``
  for the data-pipeline figures of an epoch, ...; ``time`` is Unix seconds);
  then one column per metric name, in the order the names first appeared. A
  row leaves the metrics it does not carry empty. The same name logged in two
  contexts (``loss`` on train and on validate rows) shares one column: select
  rows by ``context``. Read it with ``pandas.read_csv(path)``.
* ``run.json``: ``{"params": {...}, "other": {key: value}, "status": ...}``,
  rewritten on every ``log_params``/``log_other``/``finish``.
"""

from __future__ import annotations

import csv
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from jaxnitro.plugin import Logger, hookimpl  # a plugin imports only jaxnitro and jaxnitro.plugin

__all__ = ["CSVLogger", "HEADER", "jaxnitro_make_logger"]

HEADER = ("context", "step", "epoch", "time")
"""The columns every row of ``metrics.csv`` starts with; no metric may use these names."""


def cell(value: Any) -> Any:
    """What ``metrics.csv`` holds for ``value``: one number or one piece of text. Never raises.

    ``None`` -> empty cell; Python and NumPy numbers, and 0-d arrays (a JAX
    scalar included), -> the number (non-finite floats as ``nan``, ``inf``,
    ``-inf``, which pandas reads back as floats); strings -> themselves; arrays
    of more than one element -> their values as a JSON list; anything else ->
    its ``repr``.
    """
    if value is None:
        return ""
    if isinstance(value, (str, bool, int, float)):
        return value
    try:
        if isinstance(value, np.generic):
            return value.item()
        if hasattr(value, "__array__") and hasattr(value, "shape"):
            array = np.asarray(value)
            if array.ndim == 0:
                return array.item()
            return json.dumps(array.tolist(), default=repr)
        return repr(value)
    except Exception:  # noqa: BLE001 - a deleted buffer, a broken __repr__: logging goes on
        return f"<unrepresentable {type(value).__qualname__}>"


def _json_safe(value: Any) -> Any:
    """``value`` made strict-JSON-safe for ``run.json`` (non-finite floats become strings)."""
    if isinstance(value, float):
        if math.isfinite(value):
            return float(value)
        return "nan" if value != value else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if value is None or isinstance(value, (str, bool)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    converted = cell(value)  # a number, or text
    return converted if isinstance(converted, str) else _json_safe(converted)


class CSVLogger:
    """Write a run's metrics to ``run_dir/metrics.csv`` and its params to ``run_dir/run.json``.

    Implements the verbs of jaxnitro's logger contract (``log_params``,
    ``log_other``, ``log_metrics``, ``finish``, ``info``).

    **Arguments:**

    - `run_dir`: the run's folder (created if missing). An existing
        ``metrics.csv`` or ``run.json`` in it is replaced.
    - `flush_interval`: the most seconds ``"train"`` rows stay in the write
        buffer (default 2.0). Every other row is flushed as it is written.

    **Columns.** A metric name seen for the first time adds a column: the file
    is rewritten once with the wider header (the earlier rows get an empty
    cell), which happens a handful of times per run (the first validation, the
    first data row), never per step. A metric named like a header column
    (``context``, ``step``, ``epoch``, ``time``) raises ``ValueError``.

    **Lifetime.** After :meth:`finish` the files are complete and closed, and
    every logging verb raises ``RuntimeError``. Log from one thread.
    """

    def __init__(self, run_dir: str | os.PathLike, *, flush_interval: float = 2.0):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.csv"
        self.run_json = self.run_dir / "run.json"
        self.flush_interval = float(flush_interval)
        self.columns: list[str] = list(HEADER)
        self._record: dict[str, Any] = {"params": {}, "other": {}, "status": None}
        self._file = open(self.path, "w", newline="", encoding="utf-8")
        self._writer = csv.writer(self._file)
        self._writer.writerow(self.columns)
        self._file.flush()
        self._last_flush = time.monotonic()
        self._write_run_json()

    def __repr__(self) -> str:
        state = "open" if self._record["status"] is None else f"finished: {self._record['status']!r}"
        return f"CSVLogger({str(self.path)!r}, {state})"

    # -- the logger contract ---------------------------------------------------

    def log_params(self, params: dict) -> None:
        """Record the run's parameters under ``"params"`` in ``run.json``."""
        self._check_open("log_params")
        self._record["params"] = dict(params)
        self._write_run_json()

    def log_other(self, key: str, value: Any) -> None:
        """Record ``value`` under ``"other"[key]`` in ``run.json`` (e.g. the binding report)."""
        self._check_open("log_other")
        self._record["other"][str(key)] = value
        self._write_run_json()

    def log_metrics(self, metrics: dict, *, step: int, epoch: int, context: str) -> None:
        """Append one row: ``context, step, epoch, time``, then each metric in its column.

        Values are converted by :func:`cell`: this never fails on an odd value.
        """
        self._check_open("log_metrics")
        clash = sorted(str(k) for k in metrics if str(k) in HEADER)
        if clash:
            raise ValueError(
                f"CSVLogger: metric name(s) {clash} collide with the columns every row starts with "
                f"{list(HEADER)}; rename the metric (for example {clash[0] + '_'!r})."
            )
        row = {"context": context, "step": step, "epoch": epoch, "time": time.time()}
        row.update((str(k), cell(v)) for k, v in metrics.items())
        new = [name for name in row if name not in self.columns]
        if new:
            self._widen(new)
        self._writer.writerow([row.get(name, "") for name in self.columns])
        now = time.monotonic()
        if context != "train" or now - self._last_flush >= self.flush_interval:
            self._file.flush()
            self._last_flush = now

    def finish(self, status: str) -> None:
        """Record ``status`` in ``run.json``, flush and close ``metrics.csv``."""
        self._check_open("finish")
        self._record["status"] = str(status)
        self._file.close()
        self._write_run_json()

    def info(self) -> dict:
        """The backend's identifying parameters: ``{"backend": "csv", "path": ...}``."""
        return {"backend": "csv", "path": str(self.path)}

    @property
    def finished(self) -> bool:
        """Whether :meth:`finish` has been called."""
        return self._record["status"] is not None

    # -- internals -------------------------------------------------------------

    def _check_open(self, verb: str) -> None:
        if self.finished:
            raise RuntimeError(
                f"CSVLogger.{verb}: the logger for {str(self.path)!r} is finished "
                f"(finish({self._record['status']!r}) was called); a new run makes a new logger."
            )

    def _widen(self, new: list[str]) -> None:
        """Rewrite ``metrics.csv`` with ``new`` columns appended to the header."""
        self._file.close()
        with open(self.path, newline="", encoding="utf-8") as f:
            rows = list(csv.reader(f))[1:]
        self.columns += new
        pad = [""] * len(new)
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow(self.columns)
            writer.writerows(row + pad for row in rows)
        os.replace(tmp, self.path)
        self._file = open(self.path, "a", newline="", encoding="utf-8")
        self._writer = csv.writer(self._file)

    def _write_run_json(self) -> None:
        tmp = self.run_json.with_name(self.run_json.name + ".tmp")
        tmp.write_text(json.dumps(_json_safe(self._record), indent=1, allow_nan=False) + "\n")
        os.replace(tmp, self.run_json)


@hookimpl
def jaxnitro_make_logger(name: str, run_dir: Path, experiment: Any) -> Logger | None:
    """Return a :class:`CSVLogger` on ``run_dir`` for the name ``"csv"``; ``None`` otherwise.

    Not ``trylast``: no built-in answers ``"csv"``, so there is nothing to defer
    to. ``experiment`` is unused.
    """
    if not isinstance(name, str) or name.lower() != "csv":
        return None
    return CSVLogger(run_dir)
