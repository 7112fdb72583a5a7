"""Built-in defaults of the experiment hooks, registered last so that anything else wins.

Every method here receives the experiment as ``self`` (the convention for all
experiment-hook implementations), so a default can read the experiment.
"""

from __future__ import annotations

import optax

__all__ = ["Defaults", "DEFAULT_LEARNING_RATE"]

DEFAULT_LEARNING_RATE = 1e-3


class Defaults:
    """The framework's answer when neither the experiment nor a plugin implements a hook."""

    def metrics_residency(self, hook):
        return "device" if hook == "train_metrics" else "host"

    def finalize_metrics(self, acc, split):
        return acc

    def param_group(self, keypath):
        return "default"

    def learning_rate(self):
        return DEFAULT_LEARNING_RATE

    def learning_rate_ratio(self, group):
        return 1.0

    def weight_decay(self, group):
        return 0.0

    def optimizer(self, group):
        return optax.radam

    def decay_anchor(self, group):
        return "zero"

    def keep_float32(self, path):
        return False
