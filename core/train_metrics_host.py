"""Host-resident ``train_metrics`` (``metrics_residency("train_metrics") == "host"``).

The training step stays one compiled program. After the gradient of a micro-batch, its
outputs, the batch fields ``train_metrics`` declares and the Device values go to the host
through ``jax.pure_callback``; the hook runs there as ordinary Python on NumPy arrays
(sorting, ``np.add.at``, scikit-learn), and its scalars come back into the step's vector of
per-step values, next to the loss. Everything downstream (the mean over ``accum``
micro-batches, train lines, ``steps_per_dispatch``) is the device-resident path's.

The cost is the one the tutorial names: every micro-batch's outputs cross to the host,
every step, and the step waits for the hook. The hook's names are learned when the step
is traced, by calling it once on zeros of the outputs' shapes (numeric warnings
silenced); a later call returning other names, or a non-scalar, raises naming the hook.
The hook sees the experiment as traced code does (Host fields stripped: the program, and
so the callback, is shared by every handle of the class).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np

from .experiment import make_view

__all__ = ["host_train_metrics"]


def _scalars(cls_name: str, res, names=None) -> np.ndarray:
    if not isinstance(res, dict):
        raise TypeError(
            f"jaxnitro: `train_metrics` of {cls_name} returned {type(res).__name__}; it must return "
            f"a dict {{name: scalar}}."
        )
    if names is not None and tuple(res) != names:
        raise ValueError(
            f"jaxnitro: host-resident `train_metrics` of {cls_name} returned the names {list(res)}, "
            f"but {list(names)} when the training step was traced; its names (and their order) "
            f"are part of the compiled step. Return the same keys for every batch."
        )
    out = []
    for k, v in res.items():
        arr = np.asarray(v)
        if arr.shape != () or arr.dtype.kind not in "biuf":
            raise TypeError(
                f"jaxnitro: train metric `{k}` of {cls_name} is "
                f"{f'an array of shape {arr.shape}' if arr.shape else repr(v)}; `train_metrics` "
                f"returns per-step scalars (arrays belong in `metrics`). Reduce it (e.g. `.mean()`)."
            )
        out.append(arr.astype(np.float32))
    return np.asarray(out, np.float32).reshape(len(out))


def host_train_metrics(progs, dev: dict, outputs, fields: dict):
    """Inside the trace of a training step: ``(names, float32 [len(names)])``, the values
    of the experiment's ``train_metrics`` computed on the host by a ``jax.pure_callback``.

    ``progs`` is the :class:`~jaxnitro.programs.ProgramSet`; ``outputs`` the micro-batch's
    outputs and ``fields`` the batch fields the hook declares (traced arrays)."""
    hook, cls = progs.hooks["train_metrics"].function, progs.cls
    args = jax.lax.stop_gradient((dev, outputs, fields))

    def call(dev, outputs, fields):
        view = make_view(cls, {**progs.host_values, **progs.graph_values, **dev})
        return hook(view, outputs, **fields)

    zeros = jax.tree_util.tree_map(lambda x: np.zeros(x.shape, x.dtype), args)
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        first = call(*zeros)
    _scalars(cls.__name__, first)
    names = tuple(first)

    def on_host(*arrays):  # the callback's arguments arrive as jax arrays on the host: NumPy them
        dev, outputs, fields = jax.tree_util.tree_map(np.asarray, arrays)
        return _scalars(cls.__name__, call(dev, outputs, fields), names)

    result = jax.ShapeDtypeStruct((len(names),), jnp.float32)
    return names, jax.pure_callback(on_host, result, *args)
