"""The TensorBoard logger: event files in the run folder, ``logger="tensorboard"``.

Registered as the entry point ``tensorboard`` in group ``jaxnitro``; needs the
optional extra ``pip install 'jaxnitro[tensorboard]'`` (``tensorboardX``, the
writer; TensorBoard itself is only needed to look at the files). The hook
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

This module imports ``tensorboardX`` only when a logger starts writing, so the
plugin loads (and the other loggers work) without the extra installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from jaxnitro.hookspecs import hookimpl
from jaxnitro.logger import scalar_value

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

_INSTALL = "pip install 'jaxnitro[tensorboard]' (or pip install tensorboardX)"


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
    - `flush_secs`: the most seconds events wait in the writer's queue
        (default 10). Every validation and the end of the run are flushed at once.
    - `max_queue`: events queued before a write is forced (default 100).

    **Runs.** The writer opens at the first verb and closes at :meth:`finish`
    (everything flushed). A finished logger given as the knob again (a second
    ``train()``) opens a new writer at the next ``log_params``; every other
    verb on a finished logger raises ``RuntimeError``. Log from one thread.
    """

    def __init__(
        self,
        log_dir: str | os.PathLike | None = None,
        *,
        flush_secs: float = 10,
        max_queue: int = 100,
    ):
        _require_tensorboardx()
        self.log_dir = None if log_dir is None else Path(log_dir)
        self.flush_secs = flush_secs
        self.max_queue = int(max_queue)
        self._writer = None
        self._last_writer = None
        self._dir: Path | None = None  # where the current (or last) run writes
        self._status: str | None = None
        self._step = 0

    def __repr__(self) -> str:
        """The configuration only (it is logged as the ``knob/logger`` param of every run)."""
        return f"TensorBoardLogger({str(self.log_dir or '<run folder>')!r})"

    # -- the logger contract ---------------------------------------------------

    def log_params(self, params: dict) -> None:
        """Start the run's writer (a new one after :meth:`finish`) and write ``params`` as the
        HParams session and as the text ``params``."""
        if self._status is not None:  # a reused logger object: a new run
            self._status, self._writer, self._dir, self._step = None, None, None, 0
        writer = self._open(params.get("run_dir"))
        from tensorboardX.summary import hparams

        _, session_start, _ = hparams({str(k): _hparam(v) for k, v in params.items()}, {})
        writer.file_writer.add_summary(session_start)
        rows = "\n".join(f"| {_markdown_cell(k)} | {_markdown_cell(v)} |" for k, v in params.items())
        writer.add_text("params", "| parameter | value |\n|---|---|\n" + rows, 0)
        writer.flush()

    def log_other(self, key: str, value: Any) -> None:
        """Write ``value`` as the text ``key``, verbatim (a non-string as JSON)."""
        writer = self._open(None, verb="log_other")
        text = value if isinstance(value, str) else json.dumps(value, default=repr, indent=1)
        writer.add_text(str(key), _verbatim(text), self._step)
        writer.flush()

    def log_metrics(self, metrics: dict, *, step: int, epoch: int, context: str) -> None:
        """Write each metric under ``<context>/<name>`` at ``step``: a number as a scalar, an
        array as a histogram, a string as a text; ``None`` is skipped. Never fails on a value."""
        writer = self._open(None, verb="log_metrics")
        self._step = int(step)
        for name, value in metrics.items():
            tag = f"{context}/{name}"
            number = scalar_value(value)
            if number is not None:
                writer.add_scalar(tag, number, self._step)
            elif isinstance(value, str):
                writer.add_text(tag, value, self._step)
            elif value is not None:
                self._histogram(writer, tag, value)
        if context != "train":
            writer.flush()

    def finish(self, status: str) -> None:
        """Write the status (text ``status``, HParams session end), flush and close the writer."""
        writer = self._open(None, verb="finish")
        self._status = str(status)
        try:
            writer.add_text("status", self._status, self._step)
            writer.file_writer.add_summary(_session_end(self._status))
        finally:
            self._writer = None
            writer.close()

    # -- queries -----------------------------------------------------------------

    def info(self) -> dict:
        """``{"backend": "tensorboard", "log_dir": ...}`` (the folder once a run started)."""
        where = self._dir or self.log_dir
        return {"backend": "tensorboard", "log_dir": None if where is None else str(where)}

    @property
    def backend(self):
        """The run's ``tensorboardX.SummaryWriter``, for what the logger does not write (images,
        histograms of weights, a graph); ``None`` before the first verb. After :meth:`finish` it is
        the closed writer of the last run: adding to it opens a new event file in the same folder,
        which you close (``.close()``)."""
        return self._writer if self._writer is not None else self._last_writer

    @property
    def finished(self) -> bool:
        """Whether the last run was finished."""
        return self._status is not None

    # -- internals ---------------------------------------------------------------

    def _open(self, run_dir, verb: str = "log_params"):
        if self._writer is not None:
            return self._writer
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
        from tensorboardX import SummaryWriter

        where.mkdir(parents=True, exist_ok=True)
        self._dir = where
        self._writer = SummaryWriter(logdir=str(where), flush_secs=self.flush_secs, max_queue=self.max_queue)
        self._last_writer = self._writer
        return self._writer

    def _histogram(self, writer, tag: str, value: Any) -> None:
        try:
            array = np.asarray(value, dtype=np.float64).ravel()
        except Exception:  # noqa: BLE001 - not numbers: written as its text
            writer.add_text(tag, repr(value), self._step)
            return
        finite = array[np.isfinite(array)]
        if finite.size:  # a histogram of nothing, or of NaN, is refused by the writer
            writer.add_histogram(tag, finite, self._step)


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
