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
from .plugin_manager import policy_answer

__all__ = ["FLOAT32", "Float32", "precision_policy"]


class Float32(PrecisionPolicy):
    """float32 compute, no remat: nothing cast, nothing checkpointed (the Protocol's own bodies)."""


FLOAT32 = Float32()


def precision_policy(precision, remat) -> PrecisionPolicy:
    """The run's policy from the resolved ``precision`` and ``remat`` knobs
    (:class:`~jaxnitro.knobs.ResolvedKnob`): the first ``jaxnitro_precision_policy`` answer,
    which checks them; with none, :data:`FLOAT32` for ``"float32"`` without remat, else a
    ``ValueError`` naming the knob and the ``precision`` plugin."""
    at_default = tuple((k, type(k.value) in (str, bool, np.bool_) and k.value == d)
                       for k, d in ((precision, "float32"), (remat, False)))
    policy = policy_answer("jaxnitro_precision_policy", PrecisionPolicy, "precision", at_default,
                           "leave `precision` at 'float32' and `remat` at False", precision=precision, remat=remat)
    return FLOAT32 if policy is None else policy
