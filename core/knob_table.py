"""The run knobs' names and defaults: a leaf module (it imports nothing of jaxnitro).

The experiment decorator checks member names against :data:`RUN_KNOBS` (a method named
like a knob is kept as its accessor), the plugin manager warns for a method named close to
one, and :mod:`jaxnitro.knobs` resolves them against an experiment. Keeping the table here
lets those modules share it without importing each other.
"""

from __future__ import annotations

__all__ = ["DEFAULT_LOGGER", "KNOB_DEFAULTS", "RUN_KNOBS", "PLUGIN_KNOBS"]


class _DefaultLogger:
    """The ``logger`` knob's default: whatever the ``jaxnitro_default_logger`` hook names."""

    def __repr__(self) -> str:
        return "<default logger>"


DEFAULT_LOGGER = _DefaultLogger()

KNOB_DEFAULTS: dict[str, object] = {
    "seed": 0,
    "run_dir": "runs",
    "n_devs": None,
    "accum": 1,
    "steps_per_dispatch": "auto",
    "max_epochs": 10,
    "max_steps": None,
    "val_every_n_steps": None,
    "max_time": None,
    "schedule_horizon": None,
    "schedules": None,
    "gradient_clip_norm": 0.0,
    "check_divergence": True,
    "autolog_schedules": True,
    "log_every_n_steps": 1,
    "logger": DEFAULT_LOGGER,
    "checkpointer": None,
    "early_stop": None,
    "ema": None,
    "profile": None,
    "precision": "float32",
    "remat": False,
    "device_peak_flops": None,
    "sharding": "replicated",
    "mesh_shape": None,
    "compilation_cache": None,
}
RUN_KNOBS = tuple(KNOB_DEFAULTS)

PLUGIN_KNOBS = ("early_stop", "checkpointer", "profile", "compilation_cache", "device_peak_flops")
"""Knobs the core does not act on itself: a plugin must accept them (``jaxnitro_accept_knob``)."""
