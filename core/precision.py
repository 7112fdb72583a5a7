"""The ``precision`` and ``remat`` run knobs: the policy the ``jaxnitro_precision_policy`` hook makes.

The policy (a :class:`~jaxnitro.plugin.PrecisionPolicy`: casts and remat around the
experiment's ``forward`` inside the traced programs) is a plugin's: the built-in answer is
the ``precision`` plugin (``jaxnitro.plugins.precision``: bfloat16 compute with float32
masters, ``keep_float32``, ``jax.checkpoint`` block by block). With no answer (the plugin
disabled), the core's :data:`FLOAT32` policy runs the programs as written, and any other
``precision`` or ``remat`` is refused, naming the plugin.
"""

from __future__ import annotations

import numpy as np

from .contracts import PrecisionPolicy
from .plugin_manager import disabled_note, first_result

__all__ = ["FLOAT32", "Float32", "precision_policy"]


class Float32(PrecisionPolicy):
    """float32 compute, no remat: nothing cast, nothing checkpointed (the Protocol's own bodies)."""


FLOAT32 = Float32()


def precision_policy(precision, remat) -> PrecisionPolicy:
    """The run's policy from the resolved ``precision`` and ``remat`` knobs
    (:class:`~jaxnitro.knobs.ResolvedKnob`): the first ``jaxnitro_precision_policy`` answer,
    which checks them; with none, :data:`FLOAT32` for ``"float32"`` without remat, else a
    ``ValueError`` naming the knob and the ``precision`` plugin."""
    policy = first_result("jaxnitro_precision_policy", precision=precision, remat=remat)
    if policy is not None:
        if not isinstance(policy, PrecisionPolicy):
            raise TypeError(f"jaxnitro: `jaxnitro_precision_policy` answered {policy!r}, which is not a "
                            f"jaxnitro.plugin.PrecisionPolicy (its members: see that Protocol).")
        return policy
    for knob, default in ((precision, "float32"), (remat, False)):
        if not (type(knob.value) in (str, bool, np.bool_) and knob.value == default):
            raise ValueError(
                f"jaxnitro: run knob `{knob.name}` = {knob.value!r} ({knob.source}) needs the built-in "
                f"plugin `precision` (entry point `precision` in group `jaxnitro`, module "
                f"jaxnitro.plugins.precision), and it is not loaded{disabled_note()}. Fix: re-enable it "
                f"(drop `precision` from JAXNITRO_DISABLE_PLUGINS), install a plugin implementing "
                f"`jaxnitro_precision_policy`, or leave `precision` at 'float32' and `remat` at False."
            )
    return FLOAT32
