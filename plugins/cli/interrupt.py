"""Ctrl-C and preemption on the command line: one line saying how to continue.

``train()`` already ends an interrupted run cleanly (the steps computed are logged,
the checkpointer saves the state the run ended with, the logger is finished with
``"interrupted"`` or ``"preempted"``) and then raises ``KeyboardInterrupt`` (Ctrl-C) or
``jn.Preempted`` (SIGTERM, or ``max_time`` reached). :func:`on_interrupt` turns either
into one line on stderr, saying how the run stopped, where, and the exact command that
continues it (the same command with ``--resume``), then exits with status 130 (Ctrl-C:
128 + SIGINT, what a shell reports) or 143 (preempted: 128 + SIGTERM, what a job script
reads to requeue), instead of a traceback or nothing.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import sys
import warnings

from jaxnitro import PREEMPTED_EXIT_CODE, Preempted
from jaxnitro.plugin import resolve_knobs

__all__ = ["continue_command", "interrupt_line", "on_interrupt", "program_words"]

EXIT_INTERRUPTED = 130
EXIT_PREEMPTED = PREEMPTED_EXIT_CODE
"""143: a run stopped by SIGTERM or by its ``max_time`` (a resumable preemption)."""


def program_words() -> list[str]:
    """How this process was started, as words to type again: ``["jaxnitro"]`` for the
    console script, ``["python", "-m", "jaxnitro"]``, ``[".venv/bin/python", "script.py"]``."""
    argv0 = sys.argv[0] if sys.argv else "jaxnitro"
    base = os.path.basename(argv0)
    if not base.endswith(".py") and base == "jaxnitro":  # the console script
        on_path = shutil.which(base)
        same = on_path and os.path.realpath(on_path) == os.path.realpath(argv0)
        return [base if same else argv0]
    orig = getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv]
    head = len(orig) - len(sys.argv) + 1
    return list(orig[:head]) if head > 0 else [sys.executable, argv0]


def continue_command(prog: list[str], argv: list[str], *, resume: bool = True) -> str:
    """The shell command ``prog argv`` with ``--resume`` added (once) when ``resume``."""
    args = list(argv)
    if resume and "--resume" not in args:
        args.append("--resume")
    return shlex.join([*prog, *args])


def _without_option(argv: list[str], option: str) -> list[str]:
    """``argv`` less every ``option VALUE`` and ``option=VALUE`` (``option`` such as
    ``"--checkpointer"``); the other words unchanged, in order."""
    out, skip = [], False
    for i, word in enumerate(argv):
        if skip:
            skip = False
        elif word == option:
            skip = i + 1 < len(argv)
        elif not word.startswith(option + "="):
            out.append(word)
    return out


def position(nitro, *, done: bool = False) -> str:
    """Where a run stands against its budget: ``step 1,200/3,000, epoch 2`` for a step budget
    without an epoch one; else ``step 1,200, epoch 2/10`` (``done``: ``epoch 10/10, 2,000
    optimizer steps``)."""
    s = nitro.settings
    if s.max_epochs is None and s.max_steps is not None:
        return f"step {nitro.step:,}/{s.max_steps:,}, epoch {nitro.epoch}"
    if done:
        return f"epoch {nitro.epoch}/{s.max_epochs}, {nitro.step:,} optimizer steps"
    return f"step {nitro.step:,}, epoch {nitro.epoch}/{s.max_epochs}"


def _how_stopped(nitro, preempted: bool) -> str:
    """The line's first words: ``interrupted`` (Ctrl-C), ``preempted (max_time reached)`` when
    the run's ``stop_reason`` says its time limit ended it, else ``preempted (SIGTERM)``."""
    if not preempted:
        return "interrupted"
    reason = str(getattr(nitro, "stop_reason", None) or "")
    return "preempted (max_time reached)" if reason.startswith("max_time") else "preempted (SIGTERM)"


def _experiment_checkpointer(nitro):
    """The checkpointer ``jn.Nitro(e)`` resolves with no keyword (the experiment's method, the
    framework default), or None (also when it cannot be resolved here)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return resolve_knobs(nitro.experiment, {})["checkpointer"].value
    except Exception:  # only chooses the wording of the line; the run has already ended
        return None


def _no_checkpoint_line(nitro, where: str, prog: list[str], argv: list[str]) -> str:
    """The line for a run that kept no checkpoint: when ``--checkpointer null`` turned off the
    experiment's checkpointer, the command to run again without it (so the next run keeps
    checkpoints); otherwise what to change, and the same command to run again."""
    dropped = _without_option(argv, "--checkpointer")
    if dropped != list(argv) and _experiment_checkpointer(nitro) is not None:
        return (f"{where}; no checkpoint to continue from (`--checkpointer null` turned the experiment's "
                f"checkpointer off); to keep checkpoints, run again without it: "
                f"{continue_command(prog, dropped, resume=False)}")
    return (f"{where}; no checkpoint to continue from (the run's checkpointer is None: give the "
            f"experiment a `checkpointer()` method returning jn.Checkpointer(...)); run again with: "
            f"{continue_command(prog, argv, resume=False)}")


def interrupt_line(nitro, prog: list[str], argv: list[str], *, training: bool = True,
                   preempted: bool = False) -> str:
    """The one line printed after Ctrl-C, or after a preemption with ``preempted`` (see the
    module docstring); ``training=False`` (evaluate, predict): the command to run again."""
    stopped = _how_stopped(nitro, preempted)
    if not training:
        return f"{stopped}; run again with: {continue_command(prog, argv, resume=False)}"
    if nitro is None or nitro.status == "ready":
        return f"{stopped} before training started; run again with: {continue_command(prog, argv, resume=False)}"
    where = f"{stopped} at {position(nitro)}"
    if getattr(nitro.settings, "checkpointer", None) is None:
        return _no_checkpoint_line(nitro, where, prog, argv)
    return f"{where}; continue with: {continue_command(prog, argv)}"


def _say(line: str) -> None:
    """Print ``line`` on stderr after whatever stdout holds."""
    sys.stdout.flush()
    print(line, file=sys.stderr, flush=True)


@contextlib.contextmanager
def on_interrupt(prog: list[str], argv: list[str], ref: list, *, training: bool = True):
    """Turn a ``KeyboardInterrupt`` in the block into :func:`interrupt_line` on stderr and
    ``SystemExit(130)``, and a ``jn.Preempted`` (SIGTERM, ``max_time``) into its line and the
    ``Preempted`` itself (a ``SystemExit`` of code 143). ``ref`` is a list the block puts its
    handle in (``ref[:] = [nitro]``) once it is built; ``training=False`` for a block that
    trains nothing."""
    try:
        yield ref
    except KeyboardInterrupt:
        _say(interrupt_line(ref[0] if ref else None, prog, argv, training=training))
        raise SystemExit(EXIT_INTERRUPTED) from None
    except Preempted:
        _say(interrupt_line(ref[0] if ref else None, prog, argv, training=training, preempted=True))
        raise
