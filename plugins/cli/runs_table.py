"""``jaxnitro runs RUN_DIR``: one row per run folder, read from what the run left on disk.

Each run folder's ``metrics.jsonl`` (``jn.read_jsonl``) gives the experiment, the
status (its last ``finish`` line; none: the process is still running or was
killed), the epochs and optimizer steps reached, the monitored metric (recorded in
the ``params`` line) and its best validation value; ``checkpoints/`` gives the
checkpoints kept (orbax step folders; an unfinished save's temporary folder is not
counted).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

__all__ = ["read_run", "read_runs", "format_runs"]

COLUMNS = ("run", "experiment", "status", "epochs", "steps", "best", "checkpoints")


def _number(v):
    if isinstance(v, str):
        return {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}.get(v)
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _checkpoint_steps(folder: Path) -> list[int]:
    ckpts = folder / "checkpoints"
    if not ckpts.is_dir():
        return []
    return sorted(int(p.name) for p in ckpts.iterdir() if p.is_dir() and p.name.isdigit())


def read_run(folder) -> dict:
    """What :data:`COLUMNS` shows for one run folder (plus ``monitor``, ``best_epoch``,
    ``max_epochs`` and ``path``); a folder without ``metrics.jsonl`` has status ``"no log"``."""
    import jaxnitro as jn

    folder = Path(folder)
    row = {"run": folder.name, "path": str(folder), "experiment": "?", "status": "no log", "epochs": None,
           "max_epochs": None, "steps": None, "monitor": None, "best": None, "best_epoch": None}
    steps = _checkpoint_steps(folder)
    row["checkpoints"] = f"{len(steps)} (last step {steps[-1]})" if steps else "0"
    log = folder / "metrics.jsonl"
    if not log.is_file():
        return row
    row["status"] = "unfinished (running or killed)"
    epochs = max_step = 0
    best = None
    for line in jn.read_jsonl(log):
        kind = line.get("kind")
        if kind == "params":
            p = line.get("params", {})
            row["experiment"] = p.get("experiment", row["experiment"])
            row["max_epochs"] = p.get("knob/max_epochs", row["max_epochs"])
            monitor = p.get("monitor")
            if monitor:
                row["monitor"] = tuple(monitor)
            row["status"] = "unfinished (running or killed)"  # a resumed run starts again
        elif kind == "finish":
            row["status"] = line.get("status")
        elif kind == "metrics":
            epochs = max(epochs, int(line.get("epoch") or 0))
            max_step = max(max_step, int(line.get("step") or 0))
            monitor = row["monitor"]
            if monitor and line.get("context") == "validate":
                value = _number(line.get(monitor[0]))
                if value is not None and not math.isnan(value):
                    better = best is None or (value > best[0] if monitor[1] == "max" else value < best[0])
                    if better:
                        best = (value, line.get("epoch"))
    row["epochs"], row["steps"] = epochs, max_step
    if best is not None:
        row["best"], row["best_epoch"] = best
    return row


def read_runs(run_dir) -> list[dict]:
    """:func:`read_run` for every run folder directly under ``run_dir`` (a folder holding
    ``metrics.jsonl`` or ``checkpoints/``), oldest first. Raises ``FileNotFoundError`` for a
    missing ``run_dir``."""
    root = Path(run_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"no folder {os.fspath(run_dir)!r}: give the run_dir that holds the run folders.")
    folders = [p for p in sorted(root.iterdir()) if p.is_dir()
               and ((p / "metrics.jsonl").is_file() or (p / "checkpoints").is_dir())]
    return [read_run(p) for p in folders]


def _cell(row: dict, column: str) -> str:
    value = row[column]
    if column == "epochs" and value is not None:
        return f"{value}/{row['max_epochs']}" if row["max_epochs"] is not None else str(value)
    if column == "steps" and value is not None:
        return f"{value:,}"
    if column == "best":
        if row["monitor"] is None:
            return "-"
        name, mode = row["monitor"]
        if value is None:
            return f"{name} ({mode}): -"
        return f"{name} {value:.4g} (epoch {row['best_epoch']}, {mode})"
    return "-" if value is None else str(value)


def format_runs(rows: list[dict], run_dir) -> str:
    """The rows as an aligned text table headed by ``run_dir``."""
    if not rows:
        return f"no runs in {os.fspath(run_dir)}"
    cells = [list(COLUMNS)] + [[_cell(r, c) for c in COLUMNS] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    lines = [f"runs in {os.fspath(run_dir)}"]
    for i, row in enumerate(cells):
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
