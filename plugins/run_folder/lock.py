"""One writer per run folder: the lock a run holds on its folder, and the check that the folder
is still there (entry point ``run_lock``).

Answers ``jaxnitro_hold_run_folder`` (``trylast``: an installed plugin holding folders its own
way wins), wraps ``jaxnitro_load_weights`` (a resume that would continue a folder a live run
holds is refused as the handle is built, before any array is read: :func:`held`) and exports
``jn.RunFolderInUse`` and ``jn.RunFolderLost``. With this plugin
disabled (``JAXNITRO_DISABLE_PLUGINS=run_lock``) and no other answer, runs train into their
folders unlocked and unguarded, with a warning. It shares the ``run_folder`` package with the
folder naming (entry point ``run_folder``) but is its own entry point, so either can be
disabled alone.

A run writes its folder (``metrics.jsonl``, ``checkpoints/``, other loggers' files) from its
start to its finish. Two runs writing one folder (a requeued job resuming with
``resume="auto"`` while the old one still runs) interleave their log lines and collide in
their saves, so :func:`hold_run_folder` takes the folder before anything is written into it:

* the lock is the file ``<run folder>/.jaxnitro-run.lock``, held with an exclusive
  ``flock`` by an open file for as long as the run writes, and holding the owner's record
  (``pid``, ``host``, ``started``, ``processes``) as JSON;
* a second writer is refused (:class:`RunFolderInUse`) naming the owner and the fix;
* a lock file left by a run that did not release it (a ``SIGKILL``, a crash of the machine):
  the kernel released its ``flock`` with the process, so the next run takes the lock over,
  with a warning naming the old owner. Where the file system has no ``flock`` (it refuses it),
  the record decides: a lock whose ``pid`` is not alive on this host is stale; one of another
  host is refused (that host may still run it);
* the lock is released at the run's end whatever its status (the file is removed).

In a multi-process job the processes share one folder (process 0 makes it): process 0 holds
the lock for the job (its record names the job's ``processes``) and every process learns
whether it got it, so a refused job fails on every process and the processes of one job never
lock each other out.

The held lock is also a run-scoped plugin (:class:`RunFolderLock`) that checks, at each cut of
the run (an epoch's end, a plugin's step boundary, a history row's end, the run's finish:
never per step), that the folder is still the one the run started in: one ``os.stat``
against the folder's device and inode recorded at the start, plus a listing of what it holds
(so that the refusal can say what was lost). A folder deleted while the run writes it (or
deleted and made again by a late writer) ends the run ``"failed"`` with
:class:`RunFolderLost`, instead of the run going on and recreating pieces of it.
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import socket
import time
import warnings

import structlog

from jaxnitro.plugin import hookimpl

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

__all__ = ["LOCK_NAME", "RunFolderInUse", "RunFolderLost", "RunFolderLock", "held", "hold_run_folder", "lock_owner",
           "jaxnitro_exports", "jaxnitro_hold_run_folder", "jaxnitro_load_weights"]

log = structlog.get_logger("jaxnitro")

LOCK_NAME = ".jaxnitro-run.lock"
"""The lock file inside a run folder (hidden: it is not a run artifact)."""

_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


class RunFolderInUse(RuntimeError):
    """Another run (process) is writing the run folder this run would write."""


class RunFolderLost(RuntimeError):
    """The run folder was deleted (or replaced) while the run was writing it."""


def _record(processes: int) -> dict:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "processes": processes,
    }


def lock_owner(folder) -> dict | None:
    """The record of the lock file in ``folder`` (``pid``, ``host``, ``started``, ``processes``),
    or None when there is none (or it is unreadable). Says who holds or held it; not whether it
    is held."""
    try:
        with open(os.path.join(os.fspath(folder), LOCK_NAME), encoding="utf-8") as f:
            got = json.load(f)
        return got if isinstance(got, dict) else None
    except (OSError, ValueError):
        return None


def _who(owner: dict | None) -> str:
    if not owner:
        return "an unknown process (its lock file has no record)"
    here = owner.get("host") == socket.gethostname()
    who = f"pid {owner.get('pid')} on host {owner.get('host')!r}" + (" (this host)" if here else "")
    if owner.get("pid") == os.getpid() and here:
        who += ", this very process (another train() of it)"
    if (owner.get("processes") or 1) > 1:
        who += f", process 0 of a job of {owner['processes']} processes"
    return who + (f", since {owner['started']}" if owner.get("started") else "")


def _in_use(folder: str, owner: dict | None, why: str) -> RunFolderInUse:
    return RunFolderInUse(
        f"jaxnitro: the run folder {folder} is in use: {why} {_who(owner)}. Two runs writing one "
        f"folder would interleave their metrics.jsonl and collide in their checkpoint saves, so "
        f"this run was refused before writing anything. Wait for that run to end (or stop it), or "
        f"train into a new run folder (resume=False, or resume= a checkpoint path: the run branches "
        f"into a new folder). If that process is gone for sure (its host crashed), delete "
        f"{os.path.join(folder, LOCK_NAME)}."
    )


def _pid_alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    except (OSError, TypeError, ValueError, OverflowError):
        return False
    return True


def _stale_warning(folder: str, owner: dict | None, how: str) -> None:
    text = (
        f"jaxnitro: the run folder {folder} had a lock left by {_who(owner)}, which did not release "
        f"it ({how}: killed, or it crashed); this run takes the folder over. What that run wrote "
        f"after its last checkpoint is continued from that checkpoint."
    )
    log.warning("stale run folder lock taken over", folder=folder, owner=owner)
    warnings.warn(text, RuntimeWarning, stacklevel=4)


class RunFolderLock:
    """The lock one run holds on its folder (see the module's docstring), and its guard: a
    :class:`jaxnitro.plugin.RunFolderHold`, which the core registers as a plugin for the run
    (its lifecycle hooks below check the folder at each cut) and releases at the run's end.

    ``fd`` is None in a multi-process job's processes other than 0 (they share process
    0's lock); every process guards the folder. :meth:`release` removes the lock file and is
    idempotent.
    """

    def __init__(self, folder: str, fd: int | None = None):
        self.folder = folder
        self.path = os.path.join(folder, LOCK_NAME)
        self.fd = fd
        self.identity = self._identity()
        self.lost: str | None = None
        self.held: list[str] = []
        self._look()

    # -- the guard -------------------------------------------------------------------------

    def _identity(self):
        try:
            st = os.stat(self.folder)
        except OSError:
            return None
        return (st.st_dev, st.st_ino)

    def _look(self) -> None:
        """Remember what the folder holds, to say what a deletion lost."""
        try:
            names = sorted(n for n in os.listdir(self.folder) if n != LOCK_NAME)
        except OSError:
            return
        held = []
        for name in names:
            sub = os.path.join(self.folder, name)
            if name == "checkpoints" and os.path.isdir(sub):
                try:
                    steps = sorted(int(s) for s in os.listdir(sub) if s.isdigit())
                except OSError:
                    steps = []
                held.append(f"checkpoints/ (steps {steps})" if steps else "checkpoints/ (empty)")
            else:
                held.append(name + ("/" if os.path.isdir(sub) else ""))
        self.held = held

    def check(self, where: str) -> None:
        """Raise :class:`RunFolderLost` when the folder is gone or is not the one the run
        started in (deleted, perhaps made again); else note what it holds. Raises once."""
        if self.lost is not None:
            return
        if self._identity() == self.identity and self.identity is not None:
            self._look()
            return
        now = "is gone" if not os.path.isdir(self.folder) else "was deleted and made again (another inode)"
        lost = ", ".join(self.held) if self.held else "nothing yet"
        self.lost = (
            f"jaxnitro: the run folder {self.folder} {now}: it was deleted while this run was writing "
            f"it (found {where}). Lost with it: {lost}. The run stops as 'failed' rather than going on "
            f"and recreating pieces of the folder (checkpoints without their metrics.jsonl). The handle "
            f"keeps the state it trained to: evaluate or export it, or train on into a new run folder "
            f"(jn.Nitro(experiment, weights=nitro) warm-starts from it)."
        )
        log.error("run folder lost", folder=self.folder, where=where, lost=lost)
        raise RunFolderLost(self.lost)

    @hookimpl(tryfirst=True)
    def jaxnitro_epoch_trained(self, run, epoch, step, stats):
        self.check(f"at the end of epoch {epoch}, step {step}")

    @hookimpl(tryfirst=True)
    def jaxnitro_step_boundary(self, run, step, epoch):
        self.check(f"at step {step}, epoch {epoch}")

    @hookimpl(tryfirst=True)
    def jaxnitro_epoch_end(self, run, row):
        self.check(f"at the end of the history row of epoch {row.get('epoch')}, step {row.get('step')}")

    @hookimpl(tryfirst=True)
    def jaxnitro_run_finish(self, run, status):
        self.check(f"as the run finished ({status})")

    # -- the lock --------------------------------------------------------------------------

    def release(self, status: str | None = None) -> None:
        """Give the folder up: remove the lock file (when it is still this lock's) and close it.
        ``status`` is the run's final status (the lock goes whatever it is)."""
        fd, self.fd = self.fd, None
        if fd is None:
            return
        try:
            if _same_file(fd, self.path):
                os.unlink(self.path)  # while still locked: a waiting opener then retries
        except OSError:
            pass
        finally:
            os.close(fd)


def _same_file(fd: int, path: str) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _write_record(fd: int, record: dict) -> None:
    data = json.dumps(record).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)


def _read_fd(fd: int) -> dict | None:
    try:
        data = os.pread(fd, 1 << 16, 0)
        got = json.loads(data) if data.strip() else None
        return got if isinstance(got, dict) else None
    except (OSError, ValueError):
        return None


def _acquire(folder: str, processes: int) -> int:
    """An open, locked lock file of ``folder`` holding this process's record."""
    path = os.path.join(folder, LOCK_NAME)
    record = _record(processes)
    for attempt in range(100):  # a racing releaser unlinks the file we opened: open it again
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if fcntl is None:
                raise OSError(errno.ENOSYS, "no fcntl")
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _read_fd(fd)
            os.close(fd)
            if owner is not None and _pid_alive(owner.get("pid")) or attempt >= 9:
                raise _in_use(folder, owner, "it is locked by") from None
            time.sleep(0.005)  # a check's shared lock (:func:`held`, microseconds), or a releaser's
            continue
        except OSError as err:
            if err.errno not in _NO_FLOCK:
                os.close(fd)
                raise
            return _acquire_by_record(folder, fd, record)
        if not _same_file(fd, path):  # released (unlinked) between our open and our flock
            os.close(fd)
            continue
        previous = _read_fd(fd)
        if previous is not None:  # a lock file nobody holds: its owner did not release it
            _stale_warning(folder, previous, "its process no longer holds the lock")
        _write_record(fd, record)
        return fd
    raise OSError(f"jaxnitro: could not take the lock {path}: it was released and taken again 100 times")


def _held_by_record(folder: str, previous: dict | None) -> RunFolderInUse | None:
    """Where ``flock`` is refused, the record decides: the refusal when another host's record,
    or a live pid of this host, holds the folder; else None."""
    if previous is not None and previous.get("host") != socket.gethostname():
        return _in_use(folder, previous, "(this file system cannot lock files, so its record decides) it is held by")
    if previous is not None and _pid_alive(previous.get("pid")):
        return _in_use(folder, previous, "it is held by the live process")
    return None


def _acquire_by_record(folder: str, fd: int, record: dict) -> int:
    """Where ``flock`` is refused: the record decides (:func:`_held_by_record`)."""
    previous = _read_fd(fd)
    refused = _held_by_record(folder, previous)
    if refused is not None:
        os.close(fd)
        raise refused
    if previous is not None:
        _stale_warning(folder, previous, f"pid {previous.get('pid')} is not alive on this host")
    _write_record(fd, record)
    return fd


def held(folder) -> RunFolderInUse | None:
    """The refusal :func:`hold_run_folder` would raise for ``folder`` (a live run holds its lock),
    found without taking the lock: a shared ``flock`` released at once (where ``flock`` is
    refused, the record decides); else None (no lock file, or a stale one, which
    :func:`hold_run_folder` takes over)."""
    folder = os.path.abspath(os.fspath(folder))
    try:
        fd = os.open(os.path.join(folder, LOCK_NAME), os.O_RDONLY)
    except OSError:
        return None
    try:
        if fcntl is None:
            return _held_by_record(folder, _read_fd(fd))
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _in_use(folder, _read_fd(fd), "it is locked by")
    except OSError as err:
        return _held_by_record(folder, _read_fd(fd)) if err.errno in _NO_FLOCK else None
    finally:
        os.close(fd)  # releases the shared lock
    return None


def hold_run_folder(folder: str, dist=None) -> RunFolderLock:
    """Take ``folder`` for this run (see the module's docstring); raises :class:`RunFolderInUse`
    naming the owner when another run holds it. In a multi-process job every process calls it
    at the same point: process 0 locks for the job, and all of them raise if it was refused."""
    folder = os.path.abspath(folder)
    multi = dist is not None and dist.multi_process
    if not multi:
        return RunFolderLock(folder, _acquire(folder, 1))
    fd, refused, failure = None, None, None
    if dist.is_main:
        try:
            fd = _acquire(folder, dist.process_count)
        except Exception as err:  # noqa: BLE001 - every process must learn it, or they wait forever
            refused, failure = str(err), err
    refused = dist.from_main(refused)  # every process, at the same point
    if failure is not None:
        raise failure
    if refused is not None:
        raise RunFolderInUse(refused)
    return RunFolderLock(folder, fd)


@hookimpl(trylast=True)
def jaxnitro_hold_run_folder(folder, dist):
    return hold_run_folder(folder, dist)


@hookimpl(wrapper=True)
def jaxnitro_load_weights(spec, run_dir, experiment, monitor, purpose):
    """A resume that would continue a run folder a live run holds is refused as the handle is
    built, with the refusal ``train()`` would give, before any array is read: the record names
    the folder (``run_folder``, ``newest_in_run``), or the reader's error does (a checkpoint the
    live run's ``keep`` deleted under the search: a ``FileNotFoundError`` with ``run_folder``)."""
    try:
        record = yield
    except FileNotFoundError as err:
        refused = held(err.run_folder) if purpose == "resume" and getattr(err, "run_folder", None) else None
        if refused is not None:
            raise refused from err
        raise
    if purpose == "resume" and record is not None and record.newest_in_run and record.run_folder:
        refused = held(record.run_folder)
        if refused is not None:
            raise refused
    return record


@hookimpl
def jaxnitro_exports():
    return {"RunFolderInUse": RunFolderInUse, "RunFolderLost": RunFolderLost}
