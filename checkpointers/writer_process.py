"""orbax saves made by a child process: the checkpointer's ``writer="process"``.

One orbax save of the tutorial's 1 MB state runs ~35 ms of Python in the saving process:
orbax makes new asyncio event loops and helper threads for every save. On a writer thread
that Python takes turns with the training loop for the interpreter lock, and the loop's
dispatch waits for it. A child process runs the same save on another core, beside the
loop, as PyTorch's process-based asynchronous checkpoint does; the training process only
sends the host copy of the state down a pipe (~1 ms for 1 MB).

* :func:`writer` is the training process's one :class:`WriterProcess`, started on first use
  (a Python of its own, on the CPU only: it never touches an accelerator; at Linux's
  ``SCHED_IDLE`` priority, so it runs on the cores the training leaves idle) and reused by every later run of the process; a child that died is replaced
  at the next run.
* :meth:`WriterProcess.manager` opens an orbax ``CheckpointManager`` in the child and returns
  a :class:`ChildManager`: ``save`` (blocks its caller, the checkpointer's worker thread,
  until the checkpoint is complete on disk), ``all_steps``, ``wait_until_finished``,
  ``close``. An error in the child (a full disk) is raised in the caller as the same
  exception; a child that died is a ``RuntimeError`` naming its exit code.

The child ignores SIGINT and SIGTERM (and runs in a session of its own, out of the
terminal's Ctrl-C): a preempted or interrupted run sends it its last save, and the
training process's exit closes the pipe, which ends the child once its saves are done.
A training process killed outright (SIGKILL) takes the child with it (on Linux), as it
would take a writer thread: orbax renames a checkpoint into place only when it is complete,
so the save cut short is never listed, and a resumed run cleans up what it left.
"""

from __future__ import annotations

import atexit
import itertools
import os
import pickle
import signal
import subprocess
import sys
import threading
import time

__all__ = ["WriterProcess", "ChildManager", "writer", "save"]

_BOOT = """
import os, sys
try:  # Linux: run only on cores the training leaves idle (every thread started later inherits it)
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
except (AttributeError, OSError):
    os.nice(19)
from jaxnitro.checkpointers.writer_process import serve
serve(*map(int, sys.argv[1:]))
"""
"""The child's program: its priority is lowered before it imports anything (jax, orbax)."""

_lock = threading.Lock()
_writer: "WriterProcess | None" = None


def writer() -> "WriterProcess":
    """This process's writer child, started now if there is none alive."""
    global _writer
    with _lock:
        if _writer is None or not _writer.alive():
            _writer = _started_by_keeper()
        return _writer


def _started_by_keeper() -> "WriterProcess":
    """A new :class:`WriterProcess`, started from a thread that lives as long as this process:
    Linux sends the child its death signal when the thread that started it ends, so no run's
    thread (an Optuna trial's) may be the one."""
    made: list = []
    ready = threading.Event()

    def keeper():
        try:
            made.append(WriterProcess())
        except BaseException as err:  # noqa: BLE001 - raised on the caller's thread
            made.append(err)
        ready.set()
        threading.Event().wait()

    threading.Thread(target=keeper, name="jaxnitro-checkpoint-writer", daemon=True).start()
    ready.wait()
    if isinstance(made[0], BaseException):
        raise made[0]
    return made[0]


class WriterProcess:
    """The child process and the two pipes to it; calls are made one at a time."""

    def __init__(self):
        to_child, from_parent = os.pipe()
        to_parent, from_child = os.pipe()
        env = dict(os.environ, JAX_PLATFORMS="cpu")  # orbax imports jax: it must not claim a GPU
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _BOOT, str(to_child), str(from_child), str(os.getpid())],
            pass_fds=(to_child, from_child), env=env, start_new_session=True, stdin=subprocess.DEVNULL,
        )
        os.close(to_child)
        os.close(from_child)
        self.out = os.fdopen(from_parent, "wb")
        self.back = os.fdopen(to_parent, "rb")
        self.lock = threading.Lock()
        self.keys = itertools.count()
        atexit.register(self.close)

    def alive(self) -> bool:
        return self.proc.poll() is None and not self.out.closed

    def manager(self, directory: str, options: dict) -> "ChildManager":
        """An orbax ``CheckpointManager(directory, CheckpointManagerOptions(**options))`` in the
        child. Returns at once: the child opens it while the caller goes on (an error opening it
        is raised by the first call that uses it)."""
        key = next(self.keys)
        self._send(("open", key, directory, options))
        return ChildManager(self, key)

    def call(self, *message):
        """Send ``message`` and return the child's answer, raising the child's exception."""
        with self.lock:
            self._send(message)
            try:
                ok, value = pickle.load(self.back)
            except (EOFError, OSError, pickle.UnpicklingError) as err:
                code = self.proc.wait()
                raise RuntimeError(
                    f"jaxnitro: the checkpoint writer process (pid {self.proc.pid}) ended with exit code "
                    f"{code} before answering {message[0]!r}; the checkpoint it was given is not written. "
                    f"Its error output is above. Train again (a new writer starts), or pass "
                    f"jn.Checkpointer(writer=\"thread\") to save in the training process."
                ) from err
        if not ok:
            raise value
        return value

    def _send(self, message) -> None:
        try:
            pickle.dump(message, self.out, protocol=pickle.HIGHEST_PROTOCOL)
            self.out.flush()
        except (BrokenPipeError, ValueError) as err:
            raise RuntimeError(
                f"jaxnitro: the checkpoint writer process (pid {self.proc.pid}) is gone (exit code "
                f"{self.proc.poll()}); nothing was sent to it. Train again (a new writer starts), or pass "
                f"jn.Checkpointer(writer=\"thread\") to save in the training process."
            ) from err

    def close(self) -> None:
        """Close the pipe (the child finishes its saves and exits) and wait for it."""
        with self.lock:
            if not self.out.closed:
                self.out.close()
        try:
            self.proc.wait(timeout=600)
        except subprocess.TimeoutExpired:  # a save stuck on a dead file system: leave it
            pass


class ChildManager:
    """The part of orbax's ``CheckpointManager`` the checkpointer uses, run in the child."""

    def __init__(self, process: WriterProcess, key: int):
        self.process, self.key = process, key
        self.steps: list[int] | None = None
        self.cpu = 0.0

    def save(self, step: int, tree: dict, meta: dict, metrics: dict) -> None:
        """Save ``tree`` (host arrays) and the JSON record ``meta`` as checkpoint ``step``;
        returns when it is on disk. ``cpu``: the seconds of CPU the child spent on it.

        The tree travels as orbax's own serialized form of it (``ocp.tree.serialize_tree``:
        dicts and lists, so the child needs none of the classes of the experiment's model and
        optimizer state); orbax writes the same metadata for it as for the tree itself."""
        import orbax.checkpoint as ocp  # noqa: PLC0415 - the checkpointer has imported it by now

        plain = ocp.tree.serialize_tree(tree, keep_empty_nodes=True)
        self.steps, self.cpu = self.process.call("save", self.key, step, plain, meta, metrics)

    def all_steps(self) -> list[int]:
        if self.steps is None:
            self.steps = self.process.call("all_steps", self.key)
        return list(self.steps)

    def wait_until_finished(self) -> None:
        self.process.call("wait", self.key)

    def close(self) -> None:
        self.process.call("close", self.key)


# -- the child ------------------------------------------------------------------------------


def _open(directory: str, options: dict):
    import orbax.checkpoint as ocp  # noqa: PLC0415 - the child alone needs it at once

    return ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(**options))


def save(mgr, step: int, tree: dict, meta: dict, metrics: dict) -> None:
    """One checkpoint with orbax's ``mgr``: the arrays of ``tree`` as one pytree item ``state``
    (each orbax item has a fixed cost of ~8 ms CPU) and the JSON record ``meta`` as ``meta``;
    ``metrics`` are what the preservation policies see."""
    import orbax.checkpoint as ocp  # noqa: PLC0415

    args = ocp.args.Composite(state=ocp.args.StandardSave(tree), meta=ocp.args.JsonSave(meta))
    mgr.save(step, args=args, metrics=metrics, force=True)


def _save_timed(mgr, *args):
    started = time.process_time()
    save(mgr, *args)
    return mgr.all_steps(), time.process_time() - started


_CALLS = {
    "save": _save_timed,
    "all_steps": lambda mgr: mgr.all_steps(),
    "wait": lambda mgr: mgr.wait_until_finished(),
    "close": lambda mgr: mgr.close(),
}


def _answer(managers: dict, message):
    """What the child answers ``message`` (``(True, value)`` or ``(False, exception)``), or
    None for ``open``, which is not answered."""
    op, key, *args = message
    try:
        if op == "cpu":  # the child's CPU seconds so far (benches count them with the run's)
            return True, time.process_time()
        if op == "open":
            managers[key] = _open(*args)
            return None
        mgr = managers[key]
        if isinstance(mgr, BaseException):
            raise mgr
        value = _CALLS[op](mgr, *args)
        if op == "close":
            del managers[key]
        return True, value
    except Exception as err:  # noqa: BLE001 - every error goes back to the caller
        if op == "open":
            managers[key] = err
            return None
        try:
            pickle.dumps(err)
        except Exception:  # noqa: BLE001 - an exception that cannot travel goes as its text
            err = RuntimeError(f"{type(err).__name__}: {err}")
        return False, err


def _die_with_parent(parent: int) -> None:
    """On Linux, have the kernel kill this child when the training process dies (a SIGKILL,
    an out-of-memory kill): the save in flight is cut short as a writer thread's would be,
    never completed behind the back of a run resumed meanwhile."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes  # noqa: PLC0415

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(1)


def serve(read_fd: int, write_fd: int, parent: int) -> None:
    """The child's loop: answer each message until the parent closes the pipe, then close
    every manager (waiting for their deletions)."""
    _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    managers: dict = {}
    with os.fdopen(read_fd, "rb") as inp, os.fdopen(write_fd, "wb") as out:
        while True:
            try:
                message = pickle.load(inp)
            except EOFError:
                break
            reply = _answer(managers, message)
            if reply is not None:
                pickle.dump(reply, out, protocol=pickle.HIGHEST_PROTOCOL)
                out.flush()
    for mgr in managers.values():
        if not isinstance(mgr, BaseException):
            mgr.close()

