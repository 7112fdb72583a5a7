"""Checkpointer plugins (entry points in group ``jaxnitro``).

* ``orbax`` (:mod:`jaxnitro.checkpointers.orbax`): ``jn.Checkpointer``, ``jn.Best``,
  ``jn.Last``, ``jn.Average``; checkpoints saved with orbax-checkpoint at epoch ends, and
  read back for ``weights=`` and ``resume=`` (``docs/checkpoints.md``).

The core never imports these modules (an import-linter contract in CI); it reaches them
through the hooks in :mod:`jaxnitro.hookspecs` (``jaxnitro_accept_knob``, the lifecycle
hooks, ``jaxnitro_load_weights``).
"""
