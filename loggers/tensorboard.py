"""The TensorBoard logger: event files in the run folder, ``logger="tensorboard"``.

Registered as the entry point ``tensorboard`` in group ``jaxnitro``; needs the
optional extra ``pip install 'jaxnitro[tensorboard]'`` (``tensorboardX``, whose
summary builders and record format the logger writes with, and ``tensorboard``,
to look at the files: ``tensorboard --logdir <run_dir>``). The hook
:func:`jaxnitro_make_logger` answers ``"tensorboard"`` and ``"tb"`` with a
:class:`TensorBoardLogger` writing into the run's own folder, so
``tensorboard --logdir runs`` shows one TensorBoard run per jaxnitro run.
``jaxnitro.TensorBoardLogger`` (exported through ``jaxnitro_exports``) builds a
configured one to pass as the ``logger`` knob.

What a run writes (tags; the step axis is the optimizer step):

* ``<context>/<metric>`` scalars: ``train/loss`` (and every train metric and
  varying schedule, ``train/schedule/default/learning_rate``) per logged step,
  ``validate/<metric>`` per validation, ``data/data_wait_frac`` per epoch. A
  multi-element array is a histogram under the same tag, a string a text.
  NaN and infinities are written as they are (TensorBoard draws them).
* the run's parameters twice: as the HParams dashboard's session (hyperparameter
  columns; the dashboard takes its metric columns from the scalar tags) and as
  the text ``params`` (a Markdown table);
* ``log_other(key, value)`` as the text ``key`` (``binding_report``), indented
  four spaces so Markdown shows it verbatim in a monospace block;
* the final status as the text ``status`` and as the HParams session's end
  status (``done`` -> success; ``diverged``, ``failed``, ``interrupted``,
  ``terminated`` -> failure, the only other end the HParams protocol knows).

**Durability.** The logger writes its event file itself, synchronously (tensorboardX's
``SummaryWriter`` hands events to a background thread whose ``flush()`` does not wait for
the queue, so a kill right after a validation lost it): every event is in the file's buffer
when its verb returns, and a validation line, :meth:`~TensorBoardLogger.flush` (at each
epoch's end), the binding report, the parameters and the end of the run push the file to
disk (``fsync``) before returning. Train lines are pushed at most ``flush_secs`` later.

**Resume.** A run resumed from a checkpoint at step ``S`` into its own folder
(:meth:`~TensorBoardLogger.resume`) opens a new event file that begins with a
``SessionLog.START`` event at step ``S + 1``: TensorBoard's reader then drops every event
of the folder's earlier files at a step above ``S`` (what the interrupted run logged past its
checkpoint), and the resumed run's values replace them, so each step appears once.

This module imports ``tensorboardX`` only when a logger starts writing, so the
plugin loads (and the other loggers work) without the extra installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np

from jaxnitro.plugin import hookimpl, scalar_value

__all__ = [
    "NAMES",
    "SESSION_STATUS",
    "TensorBoardLogger",
    "jaxnitro_exports",
    "jaxnitro_make_logger",
]

NAMES = ("tensorboard", "tb")
"""The ``logger`` knob names this plugin answers (any case)."""

SESSION_STATUS = {
    "done": "STATUS_SUCCESS",
    "diverged": "STATUS_FAILURE",
    "failed": "STATUS_FAILURE",
    "interrupted": "STATUS_FAILURE",
    "terminated": "STATUS_FAILURE",
    "preempted": "STATUS_FAILURE",
}
"""A run status -> the HParams session end status (anything else: ``STATUS_UNKNOWN``). The
HParams protocol knows no "aborted": every run that did not end ``done`` is a failure there,
and the text ``status`` keeps the run's own word."""

_INSTALL = "pip install 'jaxnitro[tensorboard]' (or pip install tensorboardX tensorboard)"


def _require_tensorboardx() -> None:
    if importlib.util.find_spec("tensorboardX") is None:
        raise ImportError(
            f"jaxnitro: the TensorBoard logger needs the package `tensorboardX`, which is not "
            f"installed. Install it with {_INSTALL}, or choose another logger."
        )


def _hparam(value: Any) -> str | bool | float | None:
    """A parameter value the HParams dashboard takes: text, a bool or a number (None: left out)."""
    if value is None or isinstance(value, (str, bool)):
        return value
    if isinstance(value, (int, float)):
        return float(value)
    return str(value)


def _markdown_cell(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=repr)
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def _verbatim(text: str) -> str:
    """``text`` as a Markdown code block (each line indented four spaces)."""
    return "\n".join("    " + line for line in str(text).split("\n"))


class TensorBoardLogger:
    """Write a run's metrics, parameters, notes and status as TensorBoard event files.

    Implements jaxnitro's logger contract (``log_params``, ``log_other``,
    ``log_metrics``, ``finish``, ``info``, ``backend``); see the module
    docstring for what goes where.

    **Arguments:**

    - `log_dir`: the folder the event files go to. ``None`` (the default) means
        the run's own folder: the one ``jaxnitro_make_logger`` passes, or, for a
        logger object given as the ``logger`` knob, the ``"run_dir"`` entry of
        the parameters every run logs first (``log_params``). So
        ``logger=TensorBoardLogger(flush_secs=1)`` writes into each run's folder,
        and ``logger=TensorBoardLogger("tb/sweep")`` into one fixed folder.
    - `flush_secs`: the most seconds train values wait in the file's buffer before they
        are pushed to disk (default 10). A validation, :meth:`flush`, the parameters, the
        binding report and the end of the run are pushed at once (see the module docstring).

    **Runs.** The event file opens at the first verb and closes at :meth:`finish`
    (everything on disk). A finished logger given as the knob again (a second
    ``train()``) opens a new file at the next ``log_params``; every other
    verb on a finished logger raises ``RuntimeError``. Log from one thread.
    """

    def __init__(self, log_dir: str | os.PathLike | None = None, *, flush_secs: float = 10):
        _require_tensorboardx()
        self.log_dir = None if log_dir is None else Path(log_dir)
        self.flush_secs = float(flush_secs)
        self._file: _EventFile | None = None
        self._writer = None  # the backend SummaryWriter, made when asked for
        self._dir: Path | None = None  # where the current (or last) run writes
        self._status: str | None = None
        self._step = 0
        self._resumed: int | None = None
        self._path: Path | None = None
        self._last_flush = time.monotonic()

    def __repr__(self) -> str:
        """The configuration only (it is logged as the ``knob/logger`` param of every run)."""
        return f"TensorBoardLogger({str(self.log_dir or '<run folder>')!r})"

    # -- the logger contract ---------------------------------------------------

    def resume(self, step: int) -> None:
        """The run continues its folder from optimizer step ``step`` (a resumed checkpoint's):
        called by jaxnitro before anything else of the run is logged. The run's event file then
        begins with a ``SessionLog.START`` event at step ``step + 1``, so TensorBoard drops what
        the interrupted run logged past ``step`` and shows the resumed run's values there."""
        self._resumed = int(step)
        self._step = int(step)
        if self._file is not None:  # already writing: mark the restart in this file
            self._file.restart(int(step) + 1)

    def log_params(self, params: dict) -> None:
        """Open the run's event file (a new one after :meth:`finish`) and write ``params`` as the
        HParams session and as the text ``params``; flushed."""
        if self._status is not None:  # a reused logger object: a new run
            self._status, self._file, self._writer, self._dir = None, None, None, None
            self._step = self._resumed or 0
        file = self._open(params.get("run_dir"))
        from tensorboardX.summary import hparams, text

        _, session_start, _ = hparams({str(k): _hparam(v) for k, v in params.items()}, {})
        file.add_summary(session_start, self._step)
        rows = "\n".join(f"| {_markdown_cell(k)} | {_markdown_cell(v)} |" for k, v in params.items())
        file.add_summary(text("params", "| parameter | value |\n|---|---|\n" + rows), self._step)
        self.flush()

    def log_other(self, key: str, value: Any) -> None:
        """Write ``value`` as the text ``key``, verbatim (a non-string as JSON); flushed."""
        file = self._open(None, verb="log_other")
        from tensorboardX.summary import text

        body = value if isinstance(value, str) else json.dumps(value, default=repr, indent=1)
        file.add_summary(text(str(key), _verbatim(body)), self._step)
        self.flush()

    def log_metrics(self, metrics: dict, *, step: int, epoch: int, context: str) -> None:
        """Write each metric under ``<context>/<name>`` at ``step``: a number as a scalar, an
        array as a histogram, a string as a text; ``None`` is skipped. Never fails on a value.
        Anything but a train line is on disk when this returns."""
        file = self._open(None, verb="log_metrics")
        from tensorboardX.summary import scalar, text

        self._step = int(step)
        for name, value in metrics.items():
            tag = f"{context}/{name}"
            number = scalar_value(value)
            if number is not None:
                file.add_summary(scalar(tag, number), self._step)
            elif isinstance(value, str):
                file.add_summary(text(tag, value), self._step)
            elif value is not None:
                self._histogram(file, tag, value)
        if context != "train" or time.monotonic() - self._last_flush >= self.flush_secs:
            self.flush()

    def finish(self, status: str) -> None:
        """Write the status (text ``status``, HParams session end), push the file to disk and
        close it (and the :attr:`backend` writer, if one was made)."""
        file = self._open(None, verb="finish")
        from tensorboardX.summary import text

        self._status = str(status)
        try:
            file.add_summary(text("status", self._status), self._step)
            file.add_summary(_session_end(self._status), self._step)
        finally:
            self._file = None
            self._resumed = None
            file.close()
            if self._writer is not None:
                self._writer.close()

    def flush(self) -> None:
        """Push what is written to disk now (the file's buffer, then ``fsync``). A no-op between runs."""
        if self._file is not None:
            self._file.flush()
        self._last_flush = time.monotonic()

    # -- queries -----------------------------------------------------------------

    def info(self) -> dict:
        """``{"backend": "tensorboard", "log_dir": ...}`` (the folder once a run started)."""
        where = self._dir or self.log_dir
        return {"backend": "tensorboard", "log_dir": None if where is None else str(where)}

    @property
    def backend(self):
        """A ``tensorboardX.SummaryWriter`` on the run's folder, for what the logger does not write
        (images, histograms of weights, a graph): made at the first access during a run (its own
        event file, beside the logger's), closed by :meth:`finish`. ``None`` before the first
        verb; after :meth:`finish`, the closed writer of the last run (adding to it opens a new
        event file in the same folder, which you close), or ``None`` if none was made."""
        if self._writer is None and self._file is not None:
            from tensorboardX import SummaryWriter

            self._writer = SummaryWriter(logdir=str(self._dir), flush_secs=self.flush_secs, filename_suffix=".backend")
        return self._writer

    @property
    def finished(self) -> bool:
        """Whether the last run was finished."""
        return self._status is not None

    @property
    def path(self) -> Path | None:
        """The event file the current (or last) run writes, or None before the first verb."""
        return self._path

    # -- internals ---------------------------------------------------------------

    def _open(self, run_dir, verb: str = "log_params") -> "_EventFile":
        if self._file is not None:
            return self._file
        if self._status is not None:
            raise RuntimeError(
                f"TensorBoardLogger.{verb}: the run writing to {str(self._dir)!r} is finished "
                f"(finish({self._status!r}) was called); a new run starts with log_params."
            )
        where = self.log_dir or (Path(run_dir) if run_dir else None)
        if where is None:
            raise ValueError(
                f"TensorBoardLogger.{verb}: no folder to write to. Pass log_dir=..., or log the "
                f"parameters first (jaxnitro's runs do: their 'run_dir' names the folder)."
            )
        where.mkdir(parents=True, exist_ok=True)
        self._dir = where
        self._file = _EventFile(where, restart_at=None if self._resumed is None else self._resumed + 1)
        self._path = self._file.path
        self._last_flush = time.monotonic()
        return self._file

    def _histogram(self, file: "_EventFile", tag: str, value: Any) -> None:
        from tensorboardX.summary import histogram, text

        try:
            array = np.asarray(value, dtype=np.float64).ravel()
        except Exception:  # noqa: BLE001 - not numbers: written as its text
            file.add_summary(text(tag, repr(value)), self._step)
            return
        finite = array[np.isfinite(array)]
        if finite.size:  # a histogram of nothing, or of NaN, is refused by the writer
            file.add_summary(histogram(tag, finite, _default_bins()), self._step)


class _EventFile:
    """One TensorBoard event file, written synchronously in TensorBoard's record format.

    Named ``events.out.tfevents.<unix time>.<host>.<pid>.jaxnitro`` (a counter appended if
    taken), so it never replaces another writer's file. Every event is handed to the file at
    once; :meth:`flush` pushes it to disk (tensorboardX's ``RecordWriter.flush``: the buffer,
    then ``fsync``). ``restart_at``: begin with a ``SessionLog.START`` event at that step.
    """

    def __init__(self, folder: Path, restart_at: int | None = None):
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.record_writer import RecordWriter

        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.jaxnitro"
        path, n = folder / name, 1
        while path.exists():
            n += 1
            path = folder / f"{name}.{n}"
        self.path = path
        self._records = RecordWriter(str(path))
        self._event = Event
        self._add(Event(wall_time=time.time(), file_version="brain.Event:2"))
        if restart_at is not None:
            self.restart(restart_at)

    def _add(self, event) -> None:
        self._records.write(event.SerializeToString())

    def add_summary(self, summary, step: int) -> None:
        self._add(self._event(wall_time=time.time(), step=int(step), summary=summary))

    def restart(self, step: int) -> None:
        """A ``SessionLog.START`` at ``step``: TensorBoard drops the folder's earlier events at or after it."""
        from tensorboardX.proto.event_pb2 import SessionLog

        self._add(self._event(wall_time=time.time(), step=int(step), session_log=SessionLog(status=SessionLog.START)))
        self.flush()

    def flush(self) -> None:
        self._records.flush()

    def close(self) -> None:
        self.flush()
        self._records.close()


_BINS: list | None = None


def _default_bins() -> list:
    """The bucket limits tensorboardX's ``SummaryWriter`` uses for ``bins="tensorflow"``."""
    global _BINS
    if _BINS is None:
        v, buckets = 1e-12, []
        while v < 1e20:
            buckets.append(v)
            v *= 1.1
        _BINS = [-b for b in reversed(buckets)] + [0] + buckets
    return _BINS


def _session_end(status: str):
    """A ``Summary`` ending the HParams session with ``status`` mapped through SESSION_STATUS."""
    from tensorboardX.proto.api_pb2 import Status
    from tensorboardX.proto.plugin_hparams_pb2 import HParamsPluginData, SessionEndInfo
    from tensorboardX.proto.summary_pb2 import Summary, SummaryMetadata

    end = SessionEndInfo(status=Status.Value(SESSION_STATUS.get(status, "STATUS_UNKNOWN")))
    content = HParamsPluginData(session_end_info=end, version=0).SerializeToString()
    metadata = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="hparams", content=content))
    return Summary(value=[Summary.Value(tag="_hparams_/session_end_info", metadata=metadata)])


@hookimpl(trylast=True)
def jaxnitro_make_logger(name, run_dir, experiment):
    """A :class:`TensorBoardLogger` on the run's folder for ``"tensorboard"`` / ``"tb"``; else None.

    Raises ``ImportError`` naming the extra when ``tensorboardX`` is missing.
    """
    if not isinstance(name, str) or name.lower() not in NAMES:
        return None
    return TensorBoardLogger(run_dir)


@hookimpl(trylast=True)
def jaxnitro_exports():
    return {"TensorBoardLogger": TensorBoardLogger}
