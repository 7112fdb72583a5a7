"""The MLflow logger: a run in an MLflow tracking store, ``logger="mlflow"``.

Registered as the entry point ``mlflow`` in group ``jaxnitro``; needs the
optional extra ``pip install 'jaxnitro[mlflow]'`` (``mlflow-skinny`` with
``sqlalchemy`` and ``alembic`` for the SQLite store; the full ``mlflow`` works
too; the UI, ``mlflow ui``, needs the full ``mlflow``: ``jaxnitro[mlflow-ui]``). The hook
:func:`jaxnitro_make_logger` answers ``"mlflow"`` with an :class:`MLflowLogger` whose
store is one SQLite file at the root of the ``run_dir``, shared by every run made there:
``sqlite:///<run_dir>/mlflow.db``, artifacts in ``<run_dir>/mlartifacts``, so
``mlflow ui --backend-store-uri sqlite:///<run_dir>/mlflow.db`` shows them side by side.
``jaxnitro.MLflowLogger`` (exported through ``jaxnitro_exports``) builds a configured one:
``tracking_uri="sqlite:///elsewhere/mlflow.db"`` picks another store,
``tracking_uri="http://host:5000"`` a tracking server.

**One MLflow run per jaxnitro run, across resumes.** Each run folder records its MLflow
run in ``<run folder>/mlflow_run.json`` (tracking URI, experiment id, run id). A run
resumed into that folder (``resume=``; jaxnitro calls :meth:`MLflowLogger.resume` first)
reopens the same MLflow run: its status goes back to ``RUNNING``, then to
``FINISHED``/``FAILED``/``KILLED`` at the end. Values at steps the MLflow run already holds
(what the interrupted run logged past its checkpoint, which the resumed run computes again)
are *skipped*, per metric key: MLflow keeps the first value of such a step (MLflow has no
call to delete a logged value), and each step appears once. Params are immutable in MLflow:
a parameter already there is not logged again, and one whose value changed on resume
(``knob/max_epochs`` for a longer run, say) goes to the tag ``jaxnitro.resume/<name>``.

What a run records (through ``MlflowClient``, never the process-global
``mlflow.start_run`` state, so several loggers and runs never mix):

* the MLflow experiment named after the experiment class (``params["experiment"]``),
  made if missing; the MLflow run named after the run folder, tagged
  ``jaxnitro.run_dir``;
* every parameter as an MLflow param, the value as text (``None`` -> ``"None"``),
  cut to MLflow's limit (6000 characters) with a marker saying how much was cut;
* metrics as ``<context>/<metric>`` (``train/loss``, ``validate/loss``,
  ``data/data_wait_frac``) with the optimizer step as the MLflow step. Train
  lines are sent in batches (every ``flush_interval`` seconds, or 1000 values);
  every other line and :meth:`~MLflowLogger.finish` send at once. NaN is kept;
  a SQLite store keeps an infinity as the largest float. A non-numeric value is
  skipped;
* ``log_other(key, value)`` as the artifact ``<key>.txt`` (the binding report:
  ``binding_report.txt``);
* the status: the tag ``jaxnitro.status`` holds the run's own word, and the
  MLflow run ends with ``done`` -> ``FINISHED``; ``diverged``, ``failed`` ->
  ``FAILED``; ``interrupted``, ``terminated`` -> ``KILLED``.

Names MLflow refuses (characters outside letters, digits, ``_ - . /`` and space,
empty path parts, more than 250 characters) are written with ``_`` in place of
each refused character. A failing store (a server out of reach, a database
locked or full) raises :class:`MLflowStoreError`, an ``OSError``: jaxnitro
reports it once and trains on without this logger, as for a full disk.
``jaxnitro.backend(logger)`` returns an :class:`MLflowRun`: the ``MlflowClient``
and the run id, to call the client directly.

This module imports MLflow only when a logger starts its run, so the plugin
loads (and the other loggers work) without the extra installed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


from jaxnitro.plugin import hookimpl, scalar_value

__all__ = [
    "MAX_PARAM_LENGTH",
    "RUN_FILE",
    "RUN_STATUS",
    "STORE_FILE",
    "MLflowLogger",
    "MLflowRun",
    "MLflowStoreError",
    "jaxnitro_exports",
    "jaxnitro_make_logger",
    "mlflow_name",
    "param_value",
]

RUN_STATUS = {
    "done": "FINISHED",
    "diverged": "FAILED",
    "failed": "FAILED",
    "interrupted": "KILLED",
    "terminated": "KILLED",
    "preempted": "KILLED",
}
"""A jaxnitro run status -> the MLflow run status it ends with (anything else: ``FAILED``)."""

MAX_PARAM_LENGTH = 6000
"""MLflow's limit on a param value (``mlflow.utils.validation.MAX_PARAM_VAL_LENGTH``)."""
_MAX_KEY_LENGTH = 250
_BATCH_PARAMS = 100  # MLflow's per-request limits
_BATCH_METRICS = 1000
_BAD_CHARACTER = re.compile(r"[^\w.\- /]")
_INSTALL = "pip install 'jaxnitro[mlflow]' (or pip install mlflow-skinny sqlalchemy alembic)"
RUN_FILE = "mlflow_run.json"
"""The file in a run folder that names the folder's MLflow run (for resumes)."""
STORE_FILE = "mlflow.db"
"""The default store's SQLite file, at the root of the ``run_dir``."""


def _require(tracking_uri: str | None) -> None:
    missing = [m for m in ("mlflow",) if importlib.util.find_spec(m) is None]
    if tracking_uri is None or str(tracking_uri).startswith("sqlite:"):
        missing += [m for m in ("sqlalchemy", "alembic") if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(
            f"jaxnitro: the MLflow logger needs {', '.join(f'`{m}`' for m in missing)}, not installed. "
            f"Install them with {_INSTALL}, or choose another logger."
        )


def mlflow_name(name: Any) -> str:
    """``name`` as a key MLflow accepts: refused characters become ``_``, empty, ``.`` and ``..``
    path parts are dropped, at most 250 characters."""
    parts = [p for p in _BAD_CHARACTER.sub("_", str(name)).split("/") if p not in ("", ".", "..")]
    return ("/".join(parts) or "_")[:_MAX_KEY_LENGTH]


def param_value(value: Any, limit: int = MAX_PARAM_LENGTH) -> str:
    """``value`` as MLflow param text: strings as they are, others as JSON (``None`` -> ``"None"``),
    cut to ``limit`` characters ending in ``...[+N chars]`` when longer."""
    if value is None:
        text = "None"
    elif isinstance(value, str):
        text = value
    else:
        text = json.dumps(value, default=repr)
    if len(text) <= limit:
        return text
    keep = limit - len(f"...[+{len(text)} chars]")  # the marker is at most this long
    if keep <= 0:  # a limit shorter than the marker: no room to say what was cut
        return text[:limit]
    return text[:keep] + f"...[+{len(text) - keep} chars]"


class MLflowStoreError(OSError):
    """The tracking store failed (a server out of reach, a database locked, full or unwritable).

    An ``OSError``, so jaxnitro's ``logger_relay`` plugin treats it as it treats a full disk: it
    reports the failure once (a warning, ``nitro.record.problems``), training goes on, and
    this logger gets nothing more that run. The MLflow error is its ``__cause__``.
    """


_STORE_CODES = ("TEMPORARILY_UNAVAILABLE", "REQUEST_LIMIT_EXCEEDED", "IO_ERROR")


def _is_store_failure(err: BaseException) -> bool:
    """Whether ``err`` (from an MLflow call) means the store failed, not the request: an MLflow
    error coded as unavailable, or one raised while handling an ``OSError`` (a refused connection)."""
    if getattr(err, "error_code", None) in _STORE_CODES:
        return True
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, OSError):
            return True
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return False


@dataclass(frozen=True)
class MLflowRun:
    """One MLflow run a :class:`MLflowLogger` writes: ``jaxnitro.backend(logger)``.

    ``client`` is the ``MlflowClient`` bound to the store, ``run_id`` the run;
    call the client directly (``b.client.log_artifact(b.run_id, "plot.png")``).
    :attr:`run` reads the run back (``mlflow.entities.Run``: info, params,
    latest metrics, tags).
    """

    client: Any
    run_id: str
    experiment_id: str
    tracking_uri: str

    @property
    def run(self):
        """The run as the store holds it now (``client.get_run(run_id)``)."""
        return self.client.get_run(self.run_id)


class MLflowLogger:
    """Record a run's parameters, metrics, notes and final status as an MLflow run.

    Implements jaxnitro's logger contract (``log_params``, ``log_other``,
    ``log_metrics``, ``finish``, ``info``, ``backend``); see the module
    docstring for what goes where.

    **Arguments:**

    - `tracking_uri`: the store (``"sqlite:///path/mlflow.db"``, a server's
        ``"http://..."``, ``"databricks"``). ``None`` (the default) means
        ``sqlite:///<run_dir>/mlflow.db``: one store at the root of the ``run_dir``,
        the folder holding the run folders (the parent of the run folder
        ``jaxnitro_make_logger`` passes or, for a logger object given as the
        ``logger`` knob, of the ``"run_dir"`` entry of the parameters every run logs
        first). Without either, MLflow's own default (``MLFLOW_TRACKING_URI``).
    - `experiment_name`: the MLflow experiment (default: the experiment class's
        name, else ``"jaxnitro"``); made if missing.
    - `run_name`: the MLflow run's name (default: the run folder's name).
    - `tags`: extra tags for the run.
    - `artifact_location`: where a *new* MLflow experiment keeps artifacts.
        Default: ``mlartifacts`` next to the database file of a SQLite store
        (``<run_dir>/mlartifacts`` with the default store), and the store's own choice
        otherwise (a server decides).
    - `run_dir`: the run folder, when known beforehand (the hook passes it);
        otherwise each run's own, from its parameters.
    - `flush_interval`: the most seconds train values wait before they are sent
        (default 2.0).

    **Runs.** The MLflow run is made at the first verb (for a jaxnitro run:
    ``log_params`` at run start, so a run that fails before it leaves no empty
    MLflow run) and ended by :meth:`finish`; after :meth:`resume`, the run folder's
    MLflow run is reopened instead (see the module docstring). A finished logger given as the knob
    again (a second ``train()``) starts a new MLflow run at the next
    ``log_params``; every other verb on a finished logger raises
    ``RuntimeError``. Log from one thread.
    """

    def __init__(
        self,
        tracking_uri: str | None = None,
        *,
        experiment_name: str | None = None,
        run_name: str | None = None,
        tags: dict | None = None,
        artifact_location: str | None = None,
        run_dir=None,
        flush_interval: float = 2.0,
    ):
        _require(tracking_uri)
        self.tracking_uri = None if tracking_uri is None else str(tracking_uri)
        self.experiment_name = experiment_name
        self.run_name = run_name
        self.tags = dict(tags or {})
        self.artifact_location = artifact_location
        self.run_dir = None if run_dir is None else Path(run_dir)
        self.flush_interval = float(flush_interval)
        self._run: MLflowRun | None = None
        self._uri = self.tracking_uri
        self._status: str | None = None
        self._pending: list = []
        self._last_send = time.monotonic()
        self._resumed: int | None = None  # resume(step) was called for the next run
        self._held: dict[str, int] = {}  # a reopened run: metric key -> the last step it holds
        self._params: dict[str, str] = {}  # a reopened run: the params it holds

    def __repr__(self) -> str:
        """The configuration only (it is logged as the ``knob/logger`` param of every run)."""
        uri = self.tracking_uri or "sqlite:///<run_dir>/mlflow.db"
        name = f", experiment_name={self.experiment_name!r}" if self.experiment_name else ""
        return f"MLflowLogger({uri!r}{name})"

    # -- the logger contract ---------------------------------------------------

    def resume(self, step: int) -> None:
        """The next run continues its run folder from optimizer step ``step`` (a resumed
        checkpoint's): jaxnitro calls this before anything else of the run. At ``log_params``
        the folder's MLflow run (``mlflow_run.json``) is reopened, when it is in this store;
        else a new MLflow run is made, as without a resume."""
        if self._status is not None:  # a reused logger object: the next run is a new one
            self._run, self._status, self._pending = None, None, []
        if self._run is not None:
            raise RuntimeError(
                f"MLflowLogger.resume: MLflow run {self._run.run_id} is already started; resume(step) "
                f"comes before the run's first verb (jaxnitro calls it so)."
            )
        self._resumed = int(step)

    def log_params(self, params: dict) -> None:
        """Start the MLflow run (a new one after :meth:`finish`; the run folder's own after
        :meth:`resume`) and log ``params`` as MLflow params."""
        if self._status is not None:  # a reused logger object: a new run
            self._run, self._status, self._pending = None, None, []
        run = self._start("log_params", params)
        from mlflow.entities import Param

        entries, changed = [], {}
        for k, v in params.items():
            key, text = mlflow_name(k), param_value(v)
            held = self._params.get(key)
            if held is None:
                entries.append(Param(key, text))
            elif held != text:  # MLflow refuses to change a param: the resumed value is a tag
                changed[mlflow_name(f"jaxnitro.resume/{k}")] = text
        with self._store_errors("log_params"):
            for i in range(0, len(entries), _BATCH_PARAMS):
                run.client.log_batch(run.run_id, params=entries[i : i + _BATCH_PARAMS])
            for key, text in changed.items():
                run.client.set_tag(run.run_id, key, text)

    def log_other(self, key: str, value: Any) -> None:
        """Store ``value`` as the artifact ``<key>.txt`` (a non-string as indented JSON)."""
        run = self._start("log_other")
        text = value if isinstance(value, str) else json.dumps(value, default=repr, indent=1)
        with self._store_errors("log_other"):
            run.client.log_text(run.run_id, text, mlflow_name(key).replace("/", "_") + ".txt")

    def log_metrics(self, metrics: dict, *, step: int, epoch: int, context: str) -> None:
        """Queue each numeric metric as ``<context>/<name>`` at ``step``; send train values in
        batches, anything else at once. A non-numeric value is skipped; never fails on a value."""
        self._start("log_metrics")
        from mlflow.entities import Metric

        now, step, held = int(time.time() * 1000), int(step), self._held
        for name, value in metrics.items():
            number = scalar_value(value)
            if number is not None:
                key = mlflow_name(f"{context}/{name}")
                if held and step <= held.get(key, -1):
                    continue  # a reopened run holds this step already (logged before the resume)
                self._pending.append(Metric(key, number, now, step))
        if (
            context != "train"
            or len(self._pending) >= _BATCH_METRICS
            or time.monotonic() - self._last_send >= self.flush_interval
        ):
            self.flush()

    def finish(self, status: str) -> None:
        """Send what is queued, tag ``jaxnitro.status`` and end the run with the mapped MLflow
        status (:data:`RUN_STATUS`). The run is ended even if sending the last values fails."""
        run = self._start("finish")
        self._status = str(status)
        with self._store_errors("finish"):
            try:
                self.flush()
                run.client.set_tag(run.run_id, "jaxnitro.status", self._status)
            finally:
                self._pending, self._held, self._params, self._resumed = [], {}, {}, None
                run.client.set_terminated(run.run_id, RUN_STATUS.get(self._status, "FAILED"))

    # -- queries -----------------------------------------------------------------

    def flush(self) -> None:
        """Send the queued metric values now."""
        if self._run is None or not self._pending:
            return
        pending, self._pending = self._pending, []
        with self._store_errors("flush"):
            for i in range(0, len(pending), _BATCH_METRICS):
                self._run.client.log_batch(self._run.run_id, metrics=pending[i : i + _BATCH_METRICS])
        self._last_send = time.monotonic()

    def info(self) -> dict:
        """``{"backend": "mlflow", "tracking_uri": ..., "experiment_id": ..., "run_id": ...}``."""
        if self._run is None:
            return {"backend": "mlflow", "tracking_uri": self.tracking_uri}
        r = self._run
        return {"backend": "mlflow", "tracking_uri": r.tracking_uri, "experiment_id": r.experiment_id, "run_id": r.run_id}

    @property
    def backend(self) -> MLflowRun:
        """The current (or last) run as an :class:`MLflowRun` (client and run id).

        Raises ``RuntimeError`` before the run started (a jaxnitro run starts it in ``train()``).
        """
        if self._run is None:
            raise RuntimeError(
                "MLflowLogger.backend: no MLflow run yet; it is made when the run starts "
                "(train(), or the logger's first verb)."
            )
        return self._run

    @property
    def finished(self) -> bool:
        """Whether the last run was finished."""
        return self._status is not None

    # -- internals ---------------------------------------------------------------

    @contextlib.contextmanager
    def _store_errors(self, verb: str):
        """Raise a store failure from the block as :class:`MLflowStoreError`; anything else as is."""
        try:
            yield
        except MLflowStoreError:
            raise
        except Exception as err:
            if not _is_store_failure(err):
                raise
            uri = self._run.tracking_uri if self._run is not None else self._uri
            raise MLflowStoreError(f"MLflowLogger.{verb}: the tracking store {uri!r} failed: {err}") from err

    def _start(self, verb: str, params: dict | None = None) -> MLflowRun:
        if self._status is not None:
            raise RuntimeError(
                f"MLflowLogger.{verb}: MLflow run {self._run.run_id} is finished "
                f"(finish({self._status!r}) was called); a new run starts with log_params."
            )
        if self._run is not None:
            return self._run
        params = params or {}
        folder = self.run_dir or (Path(params["run_dir"]) if params.get("run_dir") else None)
        uri, artifacts = self.tracking_uri, self.artifact_location
        if uri is None and folder is not None:  # the run_dir's store: the folder above the run folders
            root = folder.resolve().parent
            root.mkdir(parents=True, exist_ok=True)
            uri = "sqlite:///" + str(root / STORE_FILE)
        if artifacts is None and uri is not None and uri.startswith("sqlite:///"):
            database = Path(uri[len("sqlite:///") :])
            if str(database) not in ("", ":memory:"):
                artifacts = (database.resolve().parent / "mlartifacts").as_uri()
        from mlflow.tracking import MlflowClient

        self._uri = uri
        name = self.experiment_name or params.get("experiment") or "jaxnitro"
        tags = {"jaxnitro.run_dir": str(folder)} if folder else {}
        tags.update((str(k), str(v)) for k, v in self.tags.items())
        run_name = self.run_name or (folder.name if folder else None)
        with self._store_errors(verb):
            client = MlflowClient(tracking_uri=uri)
            reopened = self._reopen(client, folder) if self._resumed is not None else None
            if reopened is not None:
                experiment_id, run_id = reopened
            else:
                experiment_id = _experiment_id(client, str(name), artifacts)
                run_id = client.create_run(experiment_id, run_name=run_name, tags=tags).info.run_id
        self._run = MLflowRun(client, run_id, experiment_id, client.tracking_uri)
        if folder is not None and reopened is None:
            _write_run_file(folder, self._run)
        self._last_send = time.monotonic()
        return self._run

    def _reopen(self, client, folder: Path | None) -> tuple[str, str] | None:
        """Reopen the MLflow run ``folder/mlflow_run.json`` names, when it is in ``client``'s
        store: status back to ``RUNNING``, what it holds read (last step per metric key, params).
        Returns ``(experiment id, run id)``, or None (no file, another store, a deleted run)."""
        from mlflow.exceptions import MlflowException

        try:
            record = json.loads((folder / RUN_FILE).read_text()) if folder is not None else None
        except (OSError, ValueError):
            record = None
        if not isinstance(record, dict) or record.get("tracking_uri") != client.tracking_uri:
            return None
        try:
            run = client.get_run(str(record.get("run_id")))
        except MlflowException as err:
            if _is_store_failure(err):
                raise
            return None  # deleted from the store meanwhile: a new MLflow run
        if run.info.lifecycle_stage == "deleted":
            return None
        self._held = {m.key: int(m.step) for m in run.data.to_proto().metrics}
        self._params = dict(run.data.params)
        resumes = [p for p in run.data.tags.get("jaxnitro.resumed_from", "").split(",") if p]
        client.set_tag(run.info.run_id, "jaxnitro.resumed_from", ",".join([*resumes, str(self._resumed)]))
        client.update_run(run.info.run_id, status="RUNNING")
        return run.info.experiment_id, run.info.run_id


def _write_run_file(folder: Path, run: MLflowRun) -> None:
    """Record the run folder's MLflow run in ``folder/mlflow_run.json`` (atomically)."""
    folder.mkdir(parents=True, exist_ok=True)
    record = {"tracking_uri": run.tracking_uri, "experiment_id": run.experiment_id, "run_id": run.run_id}
    tmp = folder / f".{RUN_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, folder / RUN_FILE)


def _experiment_id(client, name: str, artifact_location: str | None) -> str:
    """The id of the MLflow experiment ``name``: made if missing, restored if deleted."""
    from mlflow.exceptions import MlflowException

    found = client.get_experiment_by_name(name)
    if found is None:
        try:
            return client.create_experiment(name, artifact_location=artifact_location)
        except MlflowException:  # made meanwhile by another process
            found = client.get_experiment_by_name(name)
            if found is None:
                raise
    if found.lifecycle_stage == "deleted":
        client.restore_experiment(found.experiment_id)
    return found.experiment_id


@hookimpl(trylast=True)
def jaxnitro_make_logger(name, run_dir, experiment):
    """An :class:`MLflowLogger` for ``"mlflow"`` (its store: ``mlflow.db`` at the root of the
    ``run_dir``, the run folder's parent); else None.

    Raises ``ImportError`` naming the extra when MLflow (or SQLAlchemy/Alembic) is missing.
    """
    if not isinstance(name, str) or name.lower() != "mlflow":
        return None
    return MLflowLogger(run_dir=run_dir)


@hookimpl(trylast=True)
def jaxnitro_exports():
    return {"MLflowLogger": MLflowLogger}
