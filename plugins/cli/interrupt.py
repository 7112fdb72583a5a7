"""Ctrl-C on the command line: one line saying how to continue, exit status 130.

``train()`` already ends an interrupted run cleanly (the steps computed are logged,
the checkpointer saves the state the run ended with, the logger is finished with
``"interrupted"``) and then raises ``KeyboardInterrupt``. :func:`on_interrupt` turns
that into one line on stderr, the exact command that continues the run (the same
command with ``--resume``), and ``SystemExit(130)`` (128 + SIGINT, what a shell
reports for Ctrl-C), instead of a traceback.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import sys

__all__ = ["continue_command", "interrupt_line", "on_interrupt", "program_words"]

EXIT_INTERRUPTED = 130


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


def interrupt_line(nitro, prog: list[str], argv: list[str], *, training: bool = True) -> str:
    """The one line printed after Ctrl-C (see the module docstring); ``training=False`` (evaluate,
    predict): the command to run again."""
    if not training:
        return f"interrupted; run again with: {continue_command(prog, argv, resume=False)}"
    if nitro is None or nitro.status == "ready":
        return f"interrupted before training started; run again with: {continue_command(prog, argv, resume=False)}"
    where = f"interrupted at {position(nitro)}"
    if getattr(nitro.settings, "checkpointer", None) is None:
        return (f"{where}; no checkpoint to continue from (the experiment keeps none: set a "
                f"checkpointer); run again with: {continue_command(prog, argv, resume=False)}")
    return f"{where}; continue with: {continue_command(prog, argv)}"


@contextlib.contextmanager
def on_interrupt(prog: list[str], argv: list[str], ref: list, *, training: bool = True):
    """Turn a ``KeyboardInterrupt`` in the block into :func:`interrupt_line` on stderr and
    ``SystemExit(130)``. ``ref`` is a list the block puts its handle in (``ref[:] = [nitro]``)
    once it is built; ``training=False`` for a block that trains nothing."""
    try:
        yield ref
    except KeyboardInterrupt:
        nitro = ref[0] if ref else None
        sys.stdout.flush()
        print(interrupt_line(nitro, prog, argv, training=training), file=sys.stderr, flush=True)
        raise SystemExit(EXIT_INTERRUPTED) from None
