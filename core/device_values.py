"""``set_device`` / ``device_value``: reading and writing Device fields of a live handle.

Writing replaces the field's device array with one of the same shape and
dtype, so every program runs unchanged: zero compiles.
"""

from __future__ import annotations

import difflib

import jax
import numpy as np

from .experiment import ConversionRefused, convert_exactly, fields_of, non_finite

__all__ = ["set_device_values", "get_device_value"]


def _refuse(name: str, case: str) -> None:
    raise TypeError(
        f"jaxnitro: set_device cannot write `{name}`: {case} set_device only writes Device fields "
        f"in place, so that nothing recompiles; for anything else build a new `Nitro` (the "
        f"compile cache is shared, so it recompiles only what changed)."
    )


def set_device_values(nitro, values: dict) -> None:
    """Validate every value first, then write them all (all or nothing)."""
    infos = fields_of(nitro.experiment)
    staged = {}
    for name, value in values.items():
        info = infos.get(name)
        if info is None:
            close = difflib.get_close_matches(name, list(infos), n=1)
            hint = f" Did you mean `{close[0]}`?" if close else ""
            raise KeyError(
                f"jaxnitro: set_device cannot write `{name}`: it is an unknown name, "
                f"{type(nitro.experiment).__name__} has no field `{name}`.{hint} Device fields: "
                f"{sorted(nitro.device_values) or '(none)'}. To add a field, declare it on the "
                f"experiment class and build a new `Nitro`."
            )
        if info.is_graph_const:
            _refuse(name, "it is a GraphConst field, baked into the compiled graph; a new value is a new program.")
        if info.is_host:
            _refuse(name, "it is a Host field, which never reaches the device.")
        if name in nitro.plan.bindings.device:
            _refuse(name, "it is scheduled; the schedule rewrites it every step.")
        current = nitro.device_values[name]
        try:
            new = convert_exactly(value, current.dtype)
        except ConversionRefused as err:
            raise (ValueError if err.out_of_range else TypeError)(
                f"jaxnitro: set_device cannot write `{name}`: the value {value!r} does not convert to "
                f"the field's dtype {current.dtype} ({err}). Pass a value of that dtype; for a "
                f"different dtype build a new `Nitro`."
            ) from None
        why = non_finite(new)
        if why is not None:
            raise ValueError(
                f"jaxnitro: set_device cannot write `{name}`: the value is not finite ({why}). A "
                f"Device value is an input of every program, where a NaN (or an infinite scalar) "
                f"silently turns the outputs, the loss and then the weights into NaN. Pass a finite "
                f"number (an array may hold +-inf, e.g. a mask, but never NaN)."
            )
        if new.shape != current.shape:
            raise ValueError(
                f"jaxnitro: set_device cannot write `{name}`: the new value has shape {new.shape}, "
                f"the field has shape {tuple(current.shape)}. A different shape is a different "
                f"program; build a new `Nitro` with the new value instead."
            )
        staged[name] = new
    for name, new in staged.items():
        nitro.device_values[name] = jax.device_put(new)


def get_device_value(nitro, name: str):
    """The host value (NumPy scalar or array) of Device field ``name``."""
    if name not in nitro.device_values:
        raise KeyError(
            f"jaxnitro: `{name}` is not a Device field of {type(nitro.experiment).__name__}; Device "
            f"fields: {sorted(nitro.device_values) or '(none)'}."
        )
    value = np.asarray(jax.device_get(nitro.device_values[name]))
    return value[()] if value.ndim == 0 else value
