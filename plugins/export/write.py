"""Writing an export: an :class:`~jaxnitro.plugin.InferenceProgram` through ``jax.export``, plus
``metadata.json``."""

from __future__ import annotations

import hashlib
import json
import os

import jax
import numpy as np

import jaxnitro
from jaxnitro.plugin import InferenceProgram

from .artifact import BATCH, FORMAT, METADATA_FILE, NOT_INCLUDED, PROGRAM_FILE, ExportError, check_destination, write_atomically

__all__ = ["export_program"]

_CALLBACK_PRIMITIVES = ("pure_callback", "io_callback", "debug_callback", "callback", "debug_print")


def _signature(program: InferenceProgram, example) -> tuple[dict, int]:
    """``({field: (trailing shape, dtype)}, width)`` of forward's fields (``program.signature``),
    refusing an unknown signature and a required field without a batch dimension."""
    signature = program.signature(example)
    if signature is None:
        raise ExportError(
            f"jaxnitro: cannot export: the shapes and dtypes of `forward`'s batch field(s) "
            f"{list(program.fields)} are unknown, because this handle has no data it can read "
            f"cheaply and has predicted no batch, so there is no input signature to export. "
            f"Fix: pass one batch, `nitro.export(path, example={{...}})`, or call "
            f"`nitro.predict(batch)` once before exporting."
        )
    specs, width = signature
    scalar = [f for f in program.required if f not in specs]
    if scalar:
        raise ExportError(
            f"jaxnitro: cannot export: `forward`'s required field(s) {scalar} have no batch "
            f"dimension in the reference batch, so they cannot be exported as batch inputs. "
            f"Fix: give them a leading batch dimension in the data (one value per row)."
        )
    return specs, width


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


def _host(tree) -> list:
    """The leaves of ``tree`` as host NumPy arrays, and its treedef."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return [np.asarray(jax.device_get(x)) for x in leaves], treedef


def _barrier(tree):
    """``tree`` behind ``jax.lax.optimization_barrier``: baked constants stay opaque to XLA, as
    predict's inputs are (without it XLA folds constant weights into a convolution and rounds
    it differently)."""
    return jax.lax.optimization_barrier(tree) if jax.tree_util.tree_leaves(tree) else tree


def _check_callbacks(fn, concrete, cls) -> None:
    callbacks = sorted(set(_callbacks_in(jax.make_jaxpr(fn)(*concrete))))
    if callbacks:
        raise ExportError(
            f"jaxnitro: cannot export {cls.__name__}: its `forward` calls back into Python on the "
            f"host ({', '.join(callbacks)}: `jax.pure_callback`, `jax.experimental.io_callback` or "
            f"`jax.debug.print`/`jax.debug.callback`). A callback runs Python code that is not part of "
            f"the compiled program, so the exported artifact could not run it in another process. "
            f"Fix: remove the callback from the inference path (e.g. behind a GraphConst flag), or "
            f"serve with `nitro.predict` instead."
        )


def _exported(fn, batch_args, dev_arg, width, symbolic_batch: bool, platforms):
    """``(jax.export.Exported, why the batch is not symbolic or None)``: symbolic in the batch
    dimension when asked and the model allows it, else at the compiled ``width``."""
    from jax import export as jex

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
        exported = jex.export(jax.jit(fn), platforms=platforms)(batch_args(width), *dev_arg())
    return exported, symbolic_reason


def export_program(program: InferenceProgram, path, *, example=None, device_inputs: bool = False,
                   symbolic_batch: bool = True, platforms=None, overwrite: bool = False) -> str:
    """Write ``program`` and its metadata to the folder ``path``; return it.

    See :meth:`jaxnitro.Nitro.export` and docs/export.md. The destination is checked
    (:func:`~jaxnitro.plugins.export.artifact.check_destination`) before anything is traced.
    """
    check_destination(path, overwrite)
    specs, width = _signature(program, example)
    cls = program.experiment_class

    dev_values = {k: np.asarray(jax.device_get(v)) for k, v in program.device_values.items()}
    clash = sorted(set(dev_values) & set(specs)) if device_inputs else []
    if clash:
        raise ExportError(
            f"jaxnitro: cannot export with `device_inputs=True`: Device field(s) {clash} are named "
            f"like batch fields of `forward`, so the exported callable could not tell them apart. "
            f"Fix: export with the Device values baked in (`device_inputs=False`), or rename one."
        )

    # the weights and model state, baked in as constants: rebuilt from flat leaf lists inside
    p_leaves, p_def = _host(program.params)
    s_leaves, s_def = _host(program.model_state)
    key_entries = None
    if program.key_entries is not None:  # predict's key: fold_in(run key, 0), baked in
        key_entries = {k: np.asarray(jax.device_get(v)) for k, v in program.key_entries.items()}
    unflatten = jax.tree_util.tree_unflatten

    def forward(batch, dev):
        if key_entries is not None:
            batch = {**batch, **_barrier(key_entries)}
        params = unflatten(p_def, _barrier(list(p_leaves)))
        model_state = unflatten(s_def, _barrier(list(s_leaves)))
        return program.apply(params, model_state, dev, batch)

    if device_inputs:
        fn = forward
        dev_arg = lambda: ({k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in dev_values.items()},)
    else:
        fn = lambda batch: forward(batch, _barrier(dev_values))
        dev_arg = lambda: ()

    def batch_args(b):
        return {f: jax.ShapeDtypeStruct((b, *shape), dtype) for f, (shape, dtype) in specs.items()}

    concrete = (batch_args(width),) + dev_arg()
    _check_callbacks(fn, concrete, cls)
    out_tree = jax.tree_util.tree_structure(jax.eval_shape(fn, *concrete))
    exported, symbolic_reason = _exported(fn, batch_args, dev_arg, width, symbolic_batch, platforms)
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
            "graph_const": {k: _json_value(v) for k, v in program.graph_values.items()},
        },
        "jax_version": jax.__version__,
        "jaxnitro_version": jaxnitro.__version__,
        "platforms": list(exported.platforms),
        "inputs": {
            f: {"shape": [BATCH if symbolic else width, *shape], "dtype": str(np.dtype(dtype)),
                "required": f in program.required}
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
            "source": program.weights_source,
            "arrays": len(p_leaves) + len(s_leaves),
            "parameters": int(sum(x.size for x in p_leaves)),
            "model_state": program.model_state is not None,
        },
        "key": "baked: fold_in(run key, 0), as nitro.predict" if key_entries is not None else None,
        "program": {"file": PROGRAM_FILE, "bytes": len(blob), "sha256": hashlib.sha256(bytes(blob)).hexdigest()},
        "not_included": dict(NOT_INCLUDED),
    }
    os.makedirs(path, exist_ok=True)
    write_atomically(os.path.join(path, PROGRAM_FILE), bytes(blob))
    write_atomically(os.path.join(path, METADATA_FILE), json.dumps(meta, indent=2).encode())
    return os.fspath(path)
