"""The export folder: its file names and format, :class:`ExportError`, the destination check,
atomic writes."""

from __future__ import annotations

import os
import tempfile

__all__ = ["ExportError", "PROGRAM_FILE", "METADATA_FILE", "FORMAT", "BATCH", "NOT_INCLUDED",
           "check_destination", "write_atomically"]

PROGRAM_FILE = "forward.jaxexport"
METADATA_FILE = "metadata.json"
FORMAT = "jaxnitro-export/1"
BATCH = "batch"
"""The name of the symbolic batch dimension (in the metadata's shapes and in ``jax.export``)."""

NOT_INCLUDED = {
    "metrics": "evaluation only: a host-side (or device) `metrics` hook runs after `forward` and is "
    "not part of the exported program; compute metrics from its outputs",
    "loss": "training only",
    "train_metrics": "training only",
    "finalize_metrics": "host-side, evaluation only",
    "optimizer": "no optimizer state is exported",
}


class ExportError(ValueError):
    """What cannot be exported, written or loaded: the message says what, why, and the fix."""


def check_destination(path, overwrite: bool) -> None:
    """Refuse, before tracing, a ``path`` the export could not be written to.

    Raises :class:`ExportError` when ``path`` is an existing file, a folder that already
    holds an export (``forward.jaxexport`` or ``metadata.json``) and ``overwrite`` is False,
    or when its nearest existing folder cannot be written (a parent that is a file, no
    write permission, a read-only file system: probed by creating and removing a temporary
    file there). Creates nothing.
    """
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path) and not os.path.isdir(path):
        raise ExportError(
            f"jaxnitro: cannot export to {path}: it is an existing file, and an export is a folder "
            f"(holding {PROGRAM_FILE} and {METADATA_FILE}). Fix: pass a folder path (new or existing), "
            f"or remove the file."
        )
    present = [f for f in (PROGRAM_FILE, METADATA_FILE) if os.path.exists(os.path.join(path, f))]
    if present and not overwrite:
        raise ExportError(
            f"jaxnitro: cannot export to {path}: the folder already holds an export ({', '.join(present)}). "
            f"Fix: pass `overwrite=True` to replace it, or choose another path."
        )
    parent = path
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ExportError(
            f"jaxnitro: cannot export to {path}: {parent} is a file, so no folder can be made below it. "
            f"Fix: choose a path whose parents are folders."
        )
    try:
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as err:
        raise ExportError(
            f"jaxnitro: cannot export to {path}: the folder {parent} cannot be written "
            f"({type(err).__name__}: {err.strerror or err}). Fix: choose a writable path, or make "
            f"{parent} writable."
        ) from err


def write_atomically(path: str, data: bytes) -> None:
    """Write ``data`` to ``path + ".partial"``, then rename it to ``path`` (a crash mid-write
    leaves no truncated ``path``)."""
    tmp = path + ".partial"
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
