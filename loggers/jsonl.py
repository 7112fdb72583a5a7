"""The default logger: one JSON object per line in ``metrics.jsonl``.

Registered as the entry point ``jsonl`` in group ``jaxnitro``; it is the default
logger (``jaxnitro_default_logger`` answers ``"jsonl"``, trylast). The hook
:func:`jaxnitro_make_logger` answers the names ``"jsonl"`` and ``"json"``
with a :class:`JSONLLogger` writing ``run_dir / "metrics.jsonl"``.

Every line is a JSON object with a ``"kind"``:

* ``{"kind": "params", "params": {...}}``
* ``{"kind": "other", "key": key, "value": value}``
* ``{"kind": "metrics", "context": context, "step": step, "epoch": epoch, "time": t, <metric>: value, ...}``
* ``{"kind": "finish", "status": status, "time": t}`` (a failed run's also ``"error": "<Type>: <message>"``)
* ``{"kind": "resume", "step": step, "dropped": n, "repaired": how, "time": t}``: a resumed
  run continues the file from ``step`` (see :meth:`JSONLLogger.resume`).

The file is strict JSON: NaN and infinities are written as the strings
``"nan"``, ``"inf"`` and ``"-inf"`` (``NaN``/``Infinity`` literals are not JSON
and many readers refuse them); arrays become nested lists; NumPy and JAX
scalars become Python numbers; any other object becomes its ``repr`` string.
Logging never fails because of an odd value. :func:`read_jsonl` (exported as ``jn.read_jsonl``) reads a file
back, optionally turning those strings back into floats.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from jaxnitro.plugin import hookimpl

__all__ = ["JSONLLogger", "continue_jsonl", "read_jsonl", "jaxnitro_make_logger"]

_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
# Fields every metrics line owns; a metric may not reuse their names.
_METRICS_HEADER = ("kind", "context", "step", "epoch", "time")
_MAX_DEPTH = 64


def _default(o: Any) -> Any:
    """``json`` fallback for objects it cannot encode: never raises.

    The returned value is encoded again by ``json``, so it only has to be
    closer to JSON (a NumPy float32 becomes a Python float, an array a list).
    """
    if isinstance(o, np.generic):  # np.float32, np.int64, np.bool_, ...
        v = o.item()
        return v if type(v) is not type(o) else repr(o)
    if isinstance(o, np.ndarray):
        return o.tolist()  # object elements come back through _default
    if isinstance(o, (set, frozenset)):
        return list(o)
    if isinstance(o, os.PathLike):
        return os.fspath(o)
    if isinstance(o, (bytes, bytearray)):
        return repr(bytes(o))
    if isinstance(o, type) or (callable(o) and hasattr(o, "__qualname__")):
        mod = getattr(o, "__module__", None)
        return f"{mod}.{o.__qualname__}" if mod else o.__qualname__
    if hasattr(o, "__array__") and hasattr(o, "shape") and hasattr(o, "dtype"):
        # A JAX array (or another array-like with the NumPy protocol).
        try:
            return np.asarray(o).tolist()
        except Exception:  # noqa: BLE001 - a deleted/donated buffer, say
            pass
    try:
        return repr(o)
    except Exception:  # noqa: BLE001 - a broken __repr__ must not stop logging
        return f"<unrepresentable {type(o).__qualname__}>"


# One reusable C encoder. allow_nan=False makes a non-finite float raise, which
# sends that (rare) line through _sanitize; the common line costs one C call.
_ENCODER = json.JSONEncoder(allow_nan=False, default=_default)
_encode = _ENCODER.encode


def _key(k: Any) -> str | int | float | bool | None:
    if k is None or isinstance(k, (str, int, bool)):
        return k
    if isinstance(k, float):
        return float(k) if math.isfinite(k) else _sanitize(k)
    if isinstance(k, np.generic):
        return _key(k.item())
    return str(k)


def _sanitize(o: Any, depth: int = 0) -> Any:
    """Return a JSON-safe copy of ``o``: non-finite floats as strings, odd objects as text."""
    if o is None or isinstance(o, (bool, str)):
        return o
    if isinstance(o, int):
        return int(o)
    if isinstance(o, float):
        f = float(o)
        if math.isfinite(f):
            return f
        return "nan" if f != f else ("inf" if f > 0 else "-inf")
    if depth > _MAX_DEPTH:
        return _default(o) if not isinstance(o, (dict, list, tuple)) else repr(o)
    if isinstance(o, dict):
        return {_key(k): _sanitize(v, depth + 1) for k, v in o.items()}
    if isinstance(o, (list, tuple, set, frozenset)):
        return [_sanitize(v, depth + 1) for v in o]
    if isinstance(o, complex):
        return str(o)
    converted = _default(o)
    if isinstance(converted, str):
        return converted
    return _sanitize(converted, depth + 1)


def _dumps(obj: Any) -> str:
    try:
        return _encode(obj)
    except (ValueError, TypeError, RecursionError):
        # Non-finite floats, non-string keys that JSON refuses, or a cycle.
        return json.dumps(_sanitize(obj), allow_nan=False)


def _close_file(f) -> None:
    """Finalizer: flush and close ``f``. Holds no reference to the logger."""
    try:
        if not f.closed:
            f.flush()
            f.close()
    except Exception:  # noqa: BLE001 - interpreter shutdown; nothing to report to
        pass


class JSONLLogger:
    """Write a run's params, metrics and status as JSON lines.

    **Arguments:**

    - `path`: the file to write (conventionally ``run_dir / "metrics.jsonl"``).
        Parent folders are created. An existing file is appended to, never
        truncated.
    - `flush_interval`: the most seconds of ``"train"`` lines kept in the
        write buffer (default 2.0).

    **Durability contract.** Every line whose ``context`` is not ``"train"``
    (params, other, validation, data, finish) is flushed to the OS as it is
    written. ``"train"`` lines (one per optimizer step, thousands a second) are
    buffered and flushed when a train line arrives at least `flush_interval`
    seconds after the last flush, so a hard kill loses at most the train lines
    of the last ~`flush_interval` seconds of logging. If the process exits
    without :meth:`finish` (an exception, ``sys.exit``), a finalizer flushes
    and closes the file; no ``finish`` line is written then, so its absence
    marks a run that did not end cleanly. Call :meth:`flush` to force the
    buffer out (say, before a long blocking compile).

    **Lifetime.** After :meth:`finish`, every logging verb (``log_params``,
    ``log_other``, ``log_metrics``, ``finish``) raises ``RuntimeError``.
    :meth:`info` and :meth:`flush` stay callable. Not thread-safe: log from
    one thread.
    """

    def __init__(self, path: str | os.PathLike, *, flush_interval: float = 2.0):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.flush_interval = float(flush_interval)
        self._f = open(self.path, "a", encoding="utf-8", newline="\n", buffering=1 << 16)
        self._write = self._f.write
        self._last_flush = time.time()
        self._status: str | None = None
        # Runs at garbage collection or at interpreter exit, whichever first.
        self._finalizer = weakref.finalize(self, _close_file, self._f)

    def __repr__(self) -> str:
        state = "open" if self._status is None else f"finished: {self._status!r}"
        return f"JSONLLogger({str(self.path)!r}, {state})"

    # -- verbs -------------------------------------------------------------

    def log_params(self, params: dict) -> None:
        """Write ``{"kind": "params", "params": params}`` and flush.

        Values are made JSON-safe (NumPy scalars -> numbers, arrays -> lists,
        other objects -> their ``repr``); this never fails on an odd value.
        """
        self._check_open("log_params")
        self._line({"kind": "params", "params": dict(params)}, flush=True)

    def log_other(self, key: str, value: Any) -> None:
        """Write ``{"kind": "other", "key": key, "value": value}`` and flush.

        A string value is written as that string; anything else as
        :meth:`log_params` writes a value (a dict stays a JSON object).
        """
        self._check_open("log_other")
        self._line({"kind": "other", "key": key, "value": value}, flush=True)

    def log_metrics(self, metrics: dict, *, step: int, epoch: int, context: str) -> None:
        """Write one metrics line: header fields, then ``metrics`` flattened in.

        The line is ``{"kind": "metrics", "context": context, "step": step,
        "epoch": epoch, "time": <unix seconds>, **metrics}``. Non-finite
        values become ``"nan"``/``"inf"``/``"-inf"``; arrays become nested
        lists. A metric named like a header field raises ``ValueError``.
        ``context == "train"`` lines are buffered (see the class docstring);
        every other context is flushed at once.
        """
        if self._status is not None:
            self._check_open("log_metrics")
        now = time.time()
        line = {"kind": "metrics", "context": context, "step": step, "epoch": epoch, "time": now}
        line.update(metrics)
        if len(line) != 5 + len(metrics):
            clash = sorted(k for k in _METRICS_HEADER if k in metrics)
            raise ValueError(
                f"JSONLLogger: metric name(s) {clash} collide with the fields every metrics "
                f"line carries {list(_METRICS_HEADER)}; rename the metric (for example "
                f"{('metric/' + clash[0])!r} or {(clash[0] + '_')!r})."
            )
        self._write(_dumps(line) + "\n")
        if context != "train" or now - self._last_flush >= self.flush_interval or now < self._last_flush:
            self._f.flush()
            self._last_flush = now

    def finish(self, status: str, *, error: str | None = None) -> None:
        """Write ``{"kind": "finish", "status": status, "time": ...}``, flush and close; with
        ``error`` (a failed run's ``"<ExceptionType>: <message>"``), the line also carries
        ``"error": error``.

        The logger is finished afterwards: any further verb raises ``RuntimeError``.
        """
        self._check_open("finish")
        line = {"kind": "finish", "status": status, "time": time.time()}
        if error is not None:
            line["error"] = str(error)
        self._line(line, flush=False)
        self._status = str(status)
        self._finalizer()  # flush + close, exactly once

    def resume(self, step: int) -> None:
        """Continue the file of an interrupted run from optimizer step ``step`` (the resumed
        checkpoint's): called by jaxnitro before anything else of a resumed run is logged.

        The interrupted run may have logged past ``step`` (its checkpoint is older than its last
        line); the resumed run logs those steps again. So, before appending (see
        :func:`continue_jsonl`): a torn last line (a process killed mid-write: no newline at the
        end) is cut off, or terminated if it is a whole JSON object; then the metrics lines with
        a step above ``step`` at the end of the file (back to the run's last ``params`` line at
        most) are removed, every other line kept. The values logged again *replace* the removed
        ones, and each step's lines appear once. Then the line ``{"kind": "resume", "step":
        step, "dropped": <lines removed>, "repaired": "cut" | "terminated" | None, "time": ...}``
        marks where the resumed run begins.
        """
        self._check_open("resume")
        self._finalizer()  # flush + close: the file is rewritten below
        dropped, repaired = continue_jsonl(self.path, int(step))
        self._f = open(self.path, "a", encoding="utf-8", newline="\n", buffering=1 << 16)
        self._write = self._f.write
        self._finalizer = weakref.finalize(self, _close_file, self._f)
        self._line(
            {"kind": "resume", "step": int(step), "dropped": dropped, "repaired": repaired, "time": time.time()},
            flush=True,
        )

    # -- queries -----------------------------------------------------------

    def info(self) -> dict:
        """Return the backend's identifying parameters: ``{"backend": "jsonl", "path": ...}``."""
        return {"backend": "jsonl", "path": str(self.path)}

    def flush(self) -> None:
        """Push buffered lines to the OS now. A no-op once finished."""
        if not self._f.closed:
            self._f.flush()
            self._last_flush = time.time()

    @property
    def finished(self) -> bool:
        """Whether :meth:`finish` has been called."""
        return self._status is not None

    # -- internals ---------------------------------------------------------

    def _check_open(self, verb: str) -> None:
        if self._status is not None:
            raise RuntimeError(
                f"JSONLLogger.{verb}: the logger for {str(self.path)!r} is finished "
                f"(finish({self._status!r}) was called) and writes nothing more; "
                f"create a new logger (a new run) to log again."
            )
        if self._f.closed:  # closed by its finalizer at interpreter exit
            raise RuntimeError(
                f"JSONLLogger.{verb}: the logger for {str(self.path)!r} is finished "
                f"(its file was closed at interpreter exit)."
            )

    def _line(self, obj: dict, *, flush: bool) -> None:
        self._write(_dumps(obj) + "\n")
        if flush:
            self._f.flush()
            self._last_flush = time.time()


_STEP_OF_METRICS = re.compile(rb'\{"kind": "metrics", "context": "(?:[^"\\]|\\.)*", "step": (-?\d+)[,}]')


def continue_jsonl(path: str | os.PathLike, step: int) -> tuple[int, str | None]:
    """Make the JSON-lines file ``path`` ready for a run resumed from ``step`` to append to.

    1. A torn last line (the file does not end with a newline: a process killed mid-write) is
       cut off when it is not a whole JSON object (``"cut"``), or given its newline when it is
       (``"terminated"``).
    2. Every ``"metrics"`` line with a ``step`` above ``step`` after the file's last
       ``"params"`` line (where the interrupted run, or its latest resume, began; lines
       before it belong to earlier runs or were already continued) is removed; every other
       line is kept, in order.

    The file is rewritten from the first removed line on (the lines before it are not
    touched). Returns ``(lines removed, "cut" | "terminated" | None)``. A missing file is
    left missing: ``(0, None)``.
    """
    path = Path(path)
    try:
        f = open(path, "r+b")
    except FileNotFoundError:
        return 0, None
    with f:
        data = f.read()
        repaired, end = None, len(data)
        if data and not data.endswith(b"\n"):
            start = data.rfind(b"\n") + 1
            try:
                json.loads(data[start:])
                repaired = "terminated"
            except ValueError:
                repaired, end = "cut", start
        body = data[:end] + (b"\n" if repaired == "terminated" else b"")
        begin = body.rfind(b'\n{"kind": "params"') + 1  # the last run's first line (0: none found)
        first_dropped, kept_after, dropped = None, [], 0
        pos = begin
        while pos < len(body):
            nl = body.index(b"\n", pos)
            raw = body[pos:nl]
            if _step_above(raw, step):
                dropped += 1
                if first_dropped is None:
                    first_dropped = pos
            elif first_dropped is not None:
                kept_after.append(raw)
            pos = nl + 1
        if first_dropped is not None:
            at, tail = first_dropped, b"".join(line + b"\n" for line in kept_after)
        else:  # nothing removed: the file stays as it is (a torn line cut, or terminated)
            at, tail = end, (b"\n" if repaired == "terminated" else b"")
        f.seek(at)
        f.truncate()
        f.write(tail)
    return dropped, repaired


def _step_above(raw: bytes, step: int) -> bool:
    """Whether the line ``raw`` is a metrics line of a step above ``step``."""
    match = _STEP_OF_METRICS.match(raw)  # the lines this logger writes: no parse needed
    if match is not None:
        return int(match.group(1)) > step
    if b'"metrics"' not in raw:
        return False
    try:
        obj = json.loads(raw)
    except ValueError:
        return False  # a malformed line: left as it is, for read_jsonl to report
    if not isinstance(obj, dict) or obj.get("kind") != "metrics":
        return False
    line_step = obj.get("step")
    return isinstance(line_step, (int, float)) and not isinstance(line_step, bool) and line_step > step


def read_jsonl(path: str | os.PathLike, *, restore_nonfinite: bool = False) -> list[dict]:
    """Read a JSON-lines file into a list of dicts, one per line.

    **Arguments:**

    - `path`: the file (e.g. a run's ``metrics.jsonl``).
    - `restore_nonfinite`: if true, the strings ``"nan"``, ``"inf"`` and
        ``"-inf"`` in a metrics line's metric values (including inside lists)
        become the floats they stand for. Other lines and fields are untouched.

    **Returns:** the parsed lines, in file order. Blank lines are skipped. An
    unterminated final line that does not parse (a process killed mid-write)
    is dropped; a malformed line anywhere else raises ``ValueError`` naming
    the path and line number.
    """
    path = Path(path)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    lines = text.split("\n")
    out: list[dict] = []
    last = len(lines) - 1
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as err:
            if i == last:  # no trailing newline: a torn write
                break
            raise ValueError(f"read_jsonl: {str(path)!r} line {i + 1} is not JSON: {err}") from None
        if restore_nonfinite and isinstance(obj, dict) and obj.get("kind") == "metrics":
            for k, v in obj.items():
                if k not in _METRICS_HEADER:
                    obj[k] = _restore(v)
        out.append(obj)
    return out


def _restore(v: Any) -> Any:
    if isinstance(v, str):
        return _NONFINITE.get(v, v)
    if isinstance(v, list):
        return [_restore(x) for x in v]
    return v


@hookimpl(trylast=True)
def jaxnitro_make_logger(name, run_dir, experiment):
    """Return a :class:`JSONLLogger` on ``run_dir / "metrics.jsonl"`` for ``"jsonl"``/``"json"``.

    Any other ``name`` (or a non-string) is not ours: returns ``None``.
    ``experiment`` is unused.
    """
    if not isinstance(name, str) or name.lower() not in ("jsonl", "json"):
        return None
    return JSONLLogger(Path(run_dir) / "metrics.jsonl")


@hookimpl(trylast=True)
def jaxnitro_default_logger():
    """The default logger of a run whose ``logger`` knob is not set: ``"jsonl"``."""
    return "jsonl"


@hookimpl(trylast=True)
def jaxnitro_exports():
    """``jn.read_jsonl``: read a run's ``metrics.jsonl`` back (``jaxnitro runs`` uses it)."""
    return {"read_jsonl": read_jsonl}
