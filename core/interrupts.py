"""Ctrl-C and SIGTERM as requests the loop honours between optimizer steps.

A KeyboardInterrupt raised at an arbitrary bytecode can land inside a train-step
call whose input buffers were donated: the handle would then hold deleted
arrays. While :func:`stop_signals` is active (``Nitro(...)`` setup and
``train()``), SIGINT and SIGTERM run a handler that records the request
(``"interrupted"`` or ``"preempted"``) and, outside a :func:`deferring` block,
raises at once (:class:`KeyboardInterrupt` / :class:`Preempted`). Inside one
(the train loop's dispatch), the loop sees :attr:`StopRequest.status` after the
step in flight, finishes cleanly (reads and logs the steps already computed,
publishes the state) and then raises. A second signal during a deferred
stretch raises at once. :func:`check` raises a recorded request that
something swallowed (an exception raised inside a callback can be lost), so a
request always ends setup or the run.

Handlers are installed only from the main thread (Python delivers signals
there) and restored on exit; nested uses share one installation.
"""

from __future__ import annotations

import contextlib
import signal
import threading

__all__ = ["Preempted", "Terminated", "PREEMPTED_EXIT_CODE", "StopRequest", "stop_signals", "deferring", "immediate", "check", "consume", "request"]


PREEMPTED_EXIT_CODE = 128 + signal.SIGTERM
"""143: the exit code of a process whose run was preempted (SIGTERM, or ``max_time`` reached)."""


class Preempted(SystemExit):
    """Raised by ``train()`` after a SIGTERM or the ``max_time`` limit ended the run cleanly
    (status ``"preempted"``): the step in flight finished, a resumable checkpoint was written
    (with a checkpointer), every logger was finished.

    A ``SystemExit`` with code :data:`PREEMPTED_EXIT_CODE` (143 = 128 + SIGTERM): uncaught,
    the process exits with that code and no traceback, which a job script reads to requeue
    the job (``resume="auto"`` then continues exactly).
    """

    def __init__(self):
        super().__init__(PREEMPTED_EXIT_CODE)


Terminated = Preempted
"""The earlier name of :class:`Preempted`."""


class StopRequest:
    """The pending stop: ``status`` is None, ``"interrupted"`` or ``"preempted"``."""

    def __init__(self):
        self.status: str | None = None
        self.defer = 0

    def exception(self) -> BaseException:
        return Preempted() if self.status == "preempted" else KeyboardInterrupt()

    def seen(self, step: int) -> bool:
        """Whether a stop is pending after ``step`` (the dispatcher asks after each dispatch)."""
        return self.status is not None


class JobStop:
    """A multi-process job's stop: what every process acts on, the same at the same step (one
    process stopping alone would leave the others waiting in a collective for ever). A stop one
    process saw (SIGTERM to its host, its ``max_time``, Ctrl-C) becomes the job's at the next
    agreement (``gather``: every process's local status, in process order): at each cut
    (:meth:`agree`), and between cuts once ``every`` steps were dispatched since the last
    (:meth:`seen`); the processes reach both at the same steps."""

    def __init__(self, local: StopRequest, gather, every: int):
        self.local, self.gather, self.every = local, gather, every
        self.status: str | None = None
        self.agreed_at: int | None = None

    def agree(self, step: int) -> str | None:
        """Gather every process's stop at ``step``; the first one seen is the job's."""
        seen = [s for s in self.gather(self.local.status) if s is not None]
        if seen and self.status is None:
            self.status = self.local.status = seen[0]  # every process raises the same exception
        self.agreed_at = step
        return self.status

    def seen(self, step: int) -> bool:
        if self.status is None and (self.agreed_at is None or step - self.agreed_at >= self.every):
            self.agree(step)
        return self.status is not None


request = StopRequest()
"""The process-wide request (signals are process-wide)."""

_depth = 0
_previous: dict = {}


def _handler(signum, frame):
    status = "preempted" if signum == signal.SIGTERM else "interrupted"
    repeated = request.status is not None
    request.status = request.status or status
    if request.defer == 0 or repeated:
        raise request.exception()


@contextlib.contextmanager
def stop_signals():
    """Install the SIGINT/SIGTERM handlers for the block (main thread only; nests)."""
    global _depth
    main = threading.current_thread() is threading.main_thread()
    if main and _depth == 0:
        request.status = None
        for sig in (signal.SIGINT, signal.SIGTERM):
            _previous[sig] = signal.signal(sig, _handler)
    _depth += main
    try:
        yield request
    finally:
        _depth -= main
        if main and _depth == 0:
            for sig, old in _previous.items():
                signal.signal(sig, old)
            _previous.clear()


@contextlib.contextmanager
def deferring():
    """Within the block a signal only records the request; the caller polls ``request.status``."""
    request.defer += 1
    try:
        yield request
    finally:
        request.defer -= 1


@contextlib.contextmanager
def immediate():
    """Within a :func:`deferring` block: a stretch where a signal raises at once (nothing is
    in flight, e.g. evaluation). A request recorded before the stretch is raised on entry."""
    saved, request.defer = request.defer, 0
    try:
        check()
        yield request
    finally:
        request.defer = saved


def check() -> None:
    """Raise the recorded request, if any (once: the request is cleared as it is raised)."""
    if request.status is not None and request.defer == 0:
        exc = request.exception()
        request.status = None
        raise exc


def consume() -> str | None:
    """Clear the request once its exception has been caught where it ends the work; return
    the status it carried."""
    status, request.status = request.status, None
    return status
