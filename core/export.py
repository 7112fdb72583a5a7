"""Export the trained inference program with ``jax.export``; load it without the experiment.

``nitro.export(path)`` writes a folder:

* ``forward.jaxexport``: the serialized :class:`jax.export.Exported` of the handle's
  ``forward`` in inference mode (the same trace as ``nitro.predict``: the experiment's
  compile view with its GraphConst values, ``eqx.nn.inference_mode``, the eval weights),
  the batch dimension symbolic when the model allows it;
* ``metadata.json``: input fields (shapes with ``"batch"`` for the symbolic dimension,
  dtypes), the compiled width, output structure, how Device values and weights are held,
  the experiment class and GraphConst values, the jax / jaxnitro versions, and what is not
  part of the program (``metrics``, ``loss``, host hooks).

The weights (``nitro.state.eval_params``: the EMA when on; and ``nitro.model_state``)
are baked into the program as constants. Device values are baked too by default, or
become named inputs with ``device_inputs=True`` (their exported values are the defaults).
Every baked constant passes through ``jax.lax.optimization_barrier`` first, so XLA
compiles the operations that read it as it compiles ``predict``'s program, which takes
them as inputs: without the barrier XLA folds the constant weights into a convolution
and rounds it differently (measured ~1e-7 on a small conv net).

The destination is checked before anything is traced: a path that is a file, a folder
that already holds an export (unless ``overwrite=True``) or a location that cannot be
written is an :class:`ExportError` naming the path and the fix. Each file is written
under a temporary name and renamed into place.

``jn.load_exported(path)`` returns an :class:`ExportedForward`: call it with the batch
fields as keywords (``f(x=...)``) to get host NumPy outputs equal to ``nitro.predict`` on
the same batch (bitwise, on the same backend: a batch narrower than the compiled width is
padded to it and sliced back, exactly as ``predict`` does). It needs only jax and NumPy's
view of the artifact: the experiment's module is never imported. A missing, truncated or
corrupted file of the artifact is an :class:`ExportError` naming the file and saying to
export again; a Device value passed to an export that baked it in is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Mapping

import jax
import numpy as np

__all__ = ["export_nitro", "load_exported", "ExportedForward", "ExportError", "PROGRAM_FILE", "METADATA_FILE"]

PROGRAM_FILE = "forward.jaxexport"
METADATA_FILE = "metadata.json"
FORMAT = "jaxnitro-export/1"
BATCH = "batch"
"""The name of the symbolic batch dimension (in the metadata's shapes and in ``jax.export``)."""

_CALLBACK_PRIMITIVES = ("pure_callback", "io_callback", "debug_callback", "callback", "debug_print")

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


def _check_destination(path, overwrite: bool) -> None:
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


def _write_atomically(path: str, data: bytes) -> None:
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


# -- export ------------------------------------------------------------------------------------


def _field_specs_for_export(nitro, example) -> tuple[dict, int]:
    """``({field: (trailing shape, dtype)}, width)`` of forward's fields, from ``example`` or
    from what the handle knows (its data, or its first predicted batch)."""
    from .batches import batch_width, field_specs
    from .evaluation import _check_width, _reference_specs, check_predict_fields

    route = nitro.plan.routes["forward"]
    if example is not None:
        if not isinstance(example, Mapping):
            raise TypeError(
                f"jaxnitro: `export(example=...)` takes one batch dict with the fields `forward` "
                f"declares ({list(route.fields)}), got {type(example).__name__}."
            )
        route.check(example.keys(), "the `example` batch")
        host = {f: np.asarray(example[f]) for f in route.fields if f in example}
        check_predict_fields(nitro, host)  # the same checks predict makes (records it on a bare handle)
        _check_width(nitro, batch_width(host, "the `example` batch"), "the `example` batch")
        specs = field_specs(host)
    else:
        ref = _reference_specs(nitro)
        if ref is None or nitro.plan.width is None:
            raise ExportError(
                f"jaxnitro: cannot export: the shapes and dtypes of `forward`'s batch field(s) "
                f"{list(route.fields)} are unknown, because this handle has no data it can read "
                f"cheaply and has predicted no batch, so there is no input signature to export. "
                f"Fix: pass one batch, `nitro.export(path, example={{...}})`, or call "
                f"`nitro.predict(batch)` once before exporting."
            )
        specs = ref[0]
    specs = {f: specs[f] for f in route.fields if f in specs}
    scalar = [f for f in route.required if f not in specs]
    if scalar:
        raise ExportError(
            f"jaxnitro: cannot export: `forward`'s required field(s) {scalar} have no batch "
            f"dimension in the reference batch, so they cannot be exported as batch inputs. "
            f"Fix: give them a leading batch dimension in the data (one value per row)."
        )
    return specs, nitro.plan.width


def _callbacks_in(jaxpr) -> list[str]:
    """Names of host-callback primitives anywhere in ``jaxpr`` (sub-jaxprs included)."""
    found: list[str] = []

    def walk(j):
        for eqn in j.eqns:
            name = eqn.primitive.name
            if name in _CALLBACK_PRIMITIVES or "callback" in name:
                found.append(name)
            for p in eqn.params.values():
                for v in p if isinstance(p, (tuple, list)) else (p,):
                    inner = getattr(v, "jaxpr", None)
                    if inner is not None and hasattr(inner, "eqns"):
                        walk(inner)
                    elif hasattr(v, "eqns"):
                        walk(v)

    walk(jaxpr.jaxpr)
    return found


def _json_value(v):
    try:
        json.dumps(v)
        return v
    except TypeError:
        if isinstance(v, (np.generic, np.ndarray, jax.Array)):
            return np.asarray(v).tolist()
        return repr(v)


def _dim(d):
    return d if isinstance(d, int) else str(d)


def export_nitro(nitro, path, *, example=None, device_inputs: bool = False, symbolic_batch: bool = True,
                 platforms=None, overwrite: bool = False) -> str:
    """Write ``nitro``'s inference program and metadata to the folder ``path``; return it.

    See :meth:`jaxnitro.Nitro.export`. The destination is checked (:func:`_check_destination`)
    before anything is traced.
    """
    from jax import export as jex

    from .programs import with_key
    from .routing import KEY_COUNT, KEY_DATA

    plan, state = nitro.plan, nitro.state
    progs = plan.programs
    route = plan.routes["forward"]
    _check_destination(path, overwrite)
    specs, width = _field_specs_for_export(nitro, example)
    cls = type(nitro.experiment)

    dev_values = {k: np.asarray(jax.device_get(v)) for k, v in nitro.device_values.items()}
    clash = sorted(set(dev_values) & set(specs)) if device_inputs else []
    if clash:
        raise ExportError(
            f"jaxnitro: cannot export with `device_inputs=True`: Device field(s) {clash} are named "
            f"like batch fields of `forward`, so the exported callable could not tell them apart. "
            f"Fix: export with the Device values baked in (`device_inputs=False`), or rename one."
        )

    # the weights and model state, baked in as constants: rebuilt from flat leaf lists inside
    flatten, unflatten = jax.tree_util.tree_flatten, jax.tree_util.tree_unflatten
    p_leaves, p_def = flatten(state.eval_params)
    s_leaves, s_def = flatten(nitro.model_state)
    p_leaves = [np.asarray(jax.device_get(x)) for x in p_leaves]
    s_leaves = [np.asarray(jax.device_get(x)) for x in s_leaves]
    key_entries = None
    if route.wants_key:  # predict's key: fold_in(run key, 0), baked in
        key_entries = {KEY_DATA: np.asarray(jax.device_get(state.rng)), KEY_COUNT: np.uint32(0)}

    def barrier(tree):  # baked constants stay opaque to XLA, as predict's inputs are
        return jax.lax.optimization_barrier(tree) if jax.tree_util.tree_leaves(tree) else tree

    def forward(batch, dev):
        # the body of ProgramSet.forward: the compile view, inference mode, the routed fields
        if key_entries is not None:
            batch = {**batch, **barrier(key_entries)}
        batch = with_key(batch)
        params = unflatten(p_def, barrier(list(p_leaves)))
        model_state = unflatten(s_def, barrier(list(s_leaves)))
        outputs, _ = progs._forward(progs.view(dev), params, model_state, batch, inference=True)
        return outputs

    if device_inputs:
        fn = forward
        dev_arg = lambda: ({k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in dev_values.items()},)
    else:
        fn = lambda batch: forward(batch, barrier(dev_values))
        dev_arg = lambda: ()

    def batch_args(b):
        return {f: jax.ShapeDtypeStruct((b, *shape), dtype) for f, (shape, dtype) in specs.items()}

    concrete = (batch_args(width),) + dev_arg()
    jaxpr = jax.make_jaxpr(fn)(*concrete)
    callbacks = sorted(set(_callbacks_in(jaxpr)))
    if callbacks:
        raise ExportError(
            f"jaxnitro: cannot export {cls.__name__}: its `forward` calls back into Python on the "
            f"host ({', '.join(callbacks)}: `jax.pure_callback`, `jax.experimental.io_callback` or "
            f"`jax.debug.print`/`jax.debug.callback`). A callback runs Python code that is not part of "
            f"the compiled program, so the exported artifact could not run it in another process. "
            f"Fix: remove the callback from the inference path (e.g. behind a GraphConst flag), or "
            f"serve with `nitro.predict` instead."
        )
    out_tree = jax.tree_util.tree_structure(jax.eval_shape(fn, *concrete))

    symbolic_reason = None
    exported = None
    if symbolic_batch:
        (b,) = jex.symbolic_shape(BATCH)
        try:
            exported = jex.export(jax.jit(fn), platforms=platforms)(batch_args(b), *dev_arg())
            if any(not a.shape or not jex.is_symbolic_dim(a.shape[0]) for a in exported.out_avals):
                symbolic_reason = "an output is not batch-first (its leading dimension is not the batch)"
                exported = None
        except Exception as err:  # the model needs a concrete batch size (a reshape, a fixed size)
            symbolic_reason = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    else:
        symbolic_reason = "symbolic_batch=False"
    if exported is None:
        exported = jex.export(jax.jit(fn), platforms=platforms)(*concrete)
    try:
        blob = exported.serialize()
    except Exception as err:
        raise ExportError(
            f"jaxnitro: cannot serialize the exported `forward` of {cls.__name__}: {err}. The "
            f"outputs' structure ({out_tree}) must be made of dicts, lists, tuples and None (a custom "
            f"pytree such as an Equinox module or a dataclass in the outputs is not serializable). "
            f"Fix: return plain containers of arrays from `forward`."
        ) from err

    symbolic = symbolic_reason is None
    meta = {
        "format": FORMAT,
        "experiment": {
            "class": f"{cls.__module__}.{cls.__qualname__}",
            "graph_const": {k: _json_value(v) for k, v in progs.graph_values.items()},
        },
        "jax_version": jax.__version__,
        "jaxnitro_version": _jaxnitro_version(),
        "platforms": list(exported.platforms),
        "inputs": {
            f: {"shape": [BATCH if symbolic else width, *shape], "dtype": str(np.dtype(dtype)),
                "required": f in route.required}
            for f, (shape, dtype) in specs.items()
        },
        "batch": {
            "symbolic": symbolic,
            "width": width,
            "why_not_symbolic": symbolic_reason,
            "padding": f"a batch narrower than {width} rows is padded to {width} (repeating its last row) "
            f"and sliced back, as nitro.predict does"
            + ("; a wider one runs at its own size" if symbolic else "; a wider one is refused"),
        },
        "outputs": {
            "structure": str(out_tree),
            "leaves": [
                {"path": jax.tree_util.keystr(p), "shape": [_dim(d) for d in a.shape], "dtype": str(a.dtype)}
                for (p, _), a in zip(
                    jax.tree_util.tree_flatten_with_path(jax.tree_util.tree_unflatten(exported.out_tree, exported.out_avals))[0],
                    exported.out_avals,
                )
            ],
        },
        "device": {
            "mode": "inputs" if device_inputs else "baked",
            "values": {
                k: {"value": v.tolist(), "shape": list(v.shape), "dtype": str(v.dtype)} for k, v in dev_values.items()
            },
        },
        "weights": {
            "mode": "baked",
            "source": "ema" if state.ema is not None else "params",
            "arrays": len(p_leaves) + len(s_leaves),
            "parameters": int(sum(x.size for x in p_leaves)),
            "model_state": nitro.model_state is not None,
        },
        "key": "baked: fold_in(run key, 0), as nitro.predict" if key_entries is not None else None,
        "program": {"file": PROGRAM_FILE, "bytes": len(blob), "sha256": hashlib.sha256(bytes(blob)).hexdigest()},
        "not_included": dict(NOT_INCLUDED),
    }
    os.makedirs(path, exist_ok=True)
    _write_atomically(os.path.join(path, PROGRAM_FILE), bytes(blob))
    _write_atomically(os.path.join(path, METADATA_FILE), json.dumps(meta, indent=2).encode())
    return os.fspath(path)


def _jaxnitro_version() -> str:
    from . import __version__

    return __version__


# -- load --------------------------------------------------------------------------------------


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
            from .batches import pad_batch

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
