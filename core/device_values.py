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


def set_device_values(experiment, scheduled, device_values: dict, values: dict) -> None:
    """Write ``values`` into ``device_values`` (the handle's Device values, in place), each as
    a device array of its field's dtype and shape: validate every value first, then write
    them all (all or nothing). ``scheduled``: the fields a schedule rewrites (refused)."""
    infos = fields_of(experiment)
    staged = {}
    for name, value in values.items():
        info = infos.get(name)
        if info is None:
            close = difflib.get_close_matches(name, list(infos), n=1)
            hint = f" Did you mean `{close[0]}`?" if close else ""
            raise KeyError(
                f"jaxnitro: set_device cannot write `{name}`: it is an unknown name, "
                f"{type(experiment).__name__} has no field `{name}`.{hint} Device fields: "
                f"{sorted(device_values) or '(none)'}. To add a field, declare it on the "
                f"experiment class and build a new `Nitro`."
            )
        if info.is_graph_const:
            _refuse(name, "it is a GraphConst field, baked into the compiled graph; a new value is a new program.")
        if info.is_host:
            _refuse(name, "it is a Host field, which never reaches the device.")
        if name in scheduled:
            _refuse(name, "it is scheduled; the schedule rewrites it every step.")
        current = device_values[name]
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
        device_values[name] = jax.device_put(new)


def get_device_value(experiment, device_values: dict, name: str):
    """The host value (NumPy scalar or array) of Device field ``name`` in ``device_values``."""
    if name not in device_values:
        raise KeyError(
            f"jaxnitro: `{name}` is not a Device field of {type(experiment).__name__}; Device "
            f"fields: {sorted(device_values) or '(none)'}."
        )
    value = np.asarray(jax.device_get(device_values[name]))
    return value[()] if value.ndim == 0 else value
