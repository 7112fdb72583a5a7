"""Loading an export: :func:`load_exported` and the callable it returns, :class:`ExportedForward`;
every missing, truncated or corrupted file is one :class:`ExportError` naming it."""

from __future__ import annotations

import hashlib
import json
import os

import jax
import numpy as np

from jaxnitro.plugin import pad_batch

from .artifact import FORMAT, METADATA_FILE, PROGRAM_FILE, ExportError

__all__ = ["ExportedForward", "load_exported"]


class ExportedForward:
    """An exported inference program: ``f(**fields) -> outputs`` (host NumPy arrays).

    ``metadata`` is the artifact's ``metadata.json``; ``exported`` the
    :class:`jax.export.Exported`. With Device values as inputs, pass them as keywords too
    (a missing one takes its exported value); with Device values baked in, passing one is a
    ``TypeError`` (it could not be applied). Extra keywords that are neither fields nor
    Device values are ignored, as ``nitro.predict`` ignores batch fields ``forward`` does not take.
    Loading raises :class:`ExportError` naming the file when the folder or one of its files
    is missing, truncated or corrupted.
    """

    def __init__(self, path):
        self.path = os.fspath(path)
        self.metadata = _read_metadata(self.path)
        self.exported = _read_program(self.path, self.metadata.get("program"))
        # one jit around the call: `Exported.call` alone wraps a fresh jit per call (measured ~2x slower)
        self.jitted = jax.jit(self.exported.call)
        self.width = self.metadata["batch"]["width"]
        self.symbolic = self.metadata["batch"]["symbolic"]
        self.inputs = self.metadata["inputs"]
        dev = self.metadata["device"]
        self.device_inputs = dev["mode"] == "inputs"
        self._dev_defaults = {k: np.asarray(v["value"], dtype=v["dtype"]) for k, v in dev["values"].items()}

    def __call__(self, **kwargs):
        baked = [k for k in self._dev_defaults if k in kwargs and k not in self.inputs]
        if baked and not self.device_inputs:
            values = ", ".join(f"{k}={self._dev_defaults[k].tolist()!r}" for k in baked)
            raise TypeError(
                f"jaxnitro: Device value(s) {baked} passed to an export that baked them in ({values}, "
                f"`metadata['device']['mode'] == 'baked'`); the program cannot take another value, "
                f"so it would be ignored. Fix: drop the keyword(s), or export again with "
                f"`nitro.export(path, device_inputs=True)` to pass them per call."
            )
        missing = [f for f, s in self.inputs.items() if s["required"] and f not in kwargs]
        if missing:
            raise TypeError(
                f"jaxnitro: the exported forward needs field(s) {missing}; it takes "
                f"{list(self.inputs)} as keywords (see `.metadata['inputs']`)."
            )
        batch = {}
        for f, spec in self.inputs.items():
            if f not in kwargs:
                continue
            v = np.asarray(kwargs[f])
            trailing = tuple(spec["shape"][1:])
            if v.ndim == 0 or v.shape[1:] != trailing:
                raise ValueError(
                    f"jaxnitro: field `{f}` has shape {v.shape}; the exported forward takes "
                    f"(batch, {', '.join(map(str, trailing))}). Pass the batch dimension first."
                )
            if str(v.dtype) != spec["dtype"]:
                raise TypeError(
                    f"jaxnitro: field `{f}` has dtype {v.dtype}; the exported forward takes "
                    f"{spec['dtype']}. Fix: `{f}.astype(np.{spec['dtype']})`."
                )
            batch[f] = v
        ns = {v.shape[0] for v in batch.values()}
        if len(ns) != 1:
            raise ValueError(f"jaxnitro: the fields have different row counts {sorted(ns)}; pass one batch.")
        (n,) = ns
        if n == 0:
            raise ValueError("jaxnitro: the batch has no rows; pass at least one row.")
        w = self.width
        if n > w and not self.symbolic:
            raise ValueError(
                f"jaxnitro: the batch has {n} rows, wider than the exported width {w} (the batch "
                f"dimension is not symbolic: {self.metadata['batch']['why_not_symbolic']}). Split it "
                f"into batches of at most {w} rows."
            )
        if n < w:
            batch = pad_batch(batch, w)
        args = (batch,)
        if self.device_inputs:
            dev = {}
            for k, default in self._dev_defaults.items():
                v = np.asarray(kwargs.get(k, default))
                if v.shape != default.shape:
                    raise ValueError(f"jaxnitro: Device value `{k}` has shape {v.shape}; exported with {default.shape}.")
                dev[k] = v.astype(default.dtype)
            args += (dev,)
        try:
            out = jax.device_get(self.jitted(*args))
        except Exception as err:
            if "deserialize" not in str(err):
                raise
            raise ExportError(
                f"jaxnitro: the export at {self.path} cannot run: XLA failed to deserialize the "
                f"StableHLO program in {os.path.join(self.path, PROGRAM_FILE)} ({str(err).splitlines()[0]}). "
                f"It was written by jax {self.metadata['jax_version']}; this is jax {jax.__version__}. "
                f"Fix: export it again with `nitro.export(path, overwrite=True)` (with this jax version)."
            ) from err
        if n < w:
            out = jax.tree_util.tree_map(lambda x: x[:n], out)
        return out

    def __repr__(self) -> str:
        m = self.metadata
        return (
            f"ExportedForward({m['experiment']['class']}, inputs={ {f: s['shape'] for f, s in self.inputs.items()} }, "
            f"device={m['device']['mode']}, jax {m['jax_version']})"
        )


def _corrupt(path: str, file: str, err, what: str) -> ExportError:
    """The load error for a bad ``file`` of the export at ``path`` (``err``: the exception, or a detail)."""
    detail = err if isinstance(err, str) else f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    return ExportError(
        f"jaxnitro: cannot load the export at {path}: {os.path.join(path, file)} {what} "
        f"({detail}). The artifact is "
        f"truncated, corrupted or incomplete. Fix: export it again with `nitro.export(path, "
        f"overwrite=True)`."
    )


_METADATA_KEYS = {
    "batch": ("width", "symbolic"), "inputs": (), "device": ("mode", "values"), "experiment": ("class",),
    "jax_version": (),
}


def _read_metadata(path: str) -> dict:
    """``metadata.json`` of the export at ``path``, checked; :class:`ExportError` naming the file
    when the folder or the file is missing, it is not JSON (e.g. truncated), or it is not a
    jaxnitro export's."""
    if not os.path.isdir(path):
        raise ExportError(
            f"jaxnitro: cannot load the export at {path}: "
            f"{'it is a file' if os.path.exists(path) else 'no such folder'}; an export is the folder "
            f"`nitro.export(path)` wrote (holding {PROGRAM_FILE} and {METADATA_FILE}). Fix: pass that folder."
        )
    file = os.path.join(path, METADATA_FILE)
    try:
        with open(file, encoding="utf-8") as fh:
            meta = json.load(fh)
    except FileNotFoundError as err:
        raise _corrupt(path, METADATA_FILE, err, "is missing") from err
    except (ValueError, OSError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise _corrupt(path, METADATA_FILE, err, "cannot be read as JSON") from err
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ExportError(
            f"jaxnitro: {path} is not a jaxnitro export ({file} has format {found!r}, expected "
            f"{FORMAT!r}); write it with `nitro.export(path)`."
        )
    missing = [
        f"{k}.{sub}" if sub else k
        for k, subs in _METADATA_KEYS.items()
        for sub in (subs or (None,))
        if k not in meta or (sub and not (isinstance(meta[k], dict) and sub in meta[k]))
    ]
    if missing:
        raise _corrupt(path, METADATA_FILE, KeyError(", ".join(missing)), "lacks entries")
    return meta


def _read_program(path: str, recorded: dict | None):
    """The :class:`jax.export.Exported` in ``forward.jaxexport``; :class:`ExportError` naming the
    file when it is missing, differs from the size and SHA-256 ``metadata.json`` recorded
    (``recorded``; exports without that entry skip the check) or does not deserialize."""
    from jax import export as jex

    try:
        with open(os.path.join(path, PROGRAM_FILE), "rb") as fh:
            blob = fh.read()
    except OSError as err:
        raise _corrupt(path, PROGRAM_FILE, err, "is missing" if isinstance(err, FileNotFoundError) else "cannot be read") from err
    if isinstance(recorded, dict) and "sha256" in recorded:
        digest = hashlib.sha256(blob).hexdigest()
        if digest != recorded["sha256"]:
            why = (
                f"{len(blob)} bytes with SHA-256 {digest[:12]}..., where {METADATA_FILE} recorded "
                f"{recorded.get('bytes')} bytes with {recorded['sha256'][:12]}..."
            )
            raise _corrupt(path, PROGRAM_FILE, why, "is not the file that was exported")
    try:
        return jex.deserialize(bytearray(blob))
    except Exception as err:  # struct.error, flatbuffers' errors, "Failed to deserialize StableHLO", ...
        raise _corrupt(path, PROGRAM_FILE, err, f"does not deserialize ({len(blob)} bytes)") from err


def load_exported(path) -> ExportedForward:
    """Load what ``nitro.export(path)`` wrote; see :class:`ExportedForward`.

    Needs neither the experiment's module nor its class: only the folder.
    """
    return ExportedForward(path)
