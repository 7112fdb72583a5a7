"""Built-in jaxnitro feature plugins, each its own entry point in group ``jaxnitro``.

* ``progress``: the progress display and the tqdm / silent reporters;
* ``early_stopping``: ``jn.EarlyStopping`` and the ``early_stop`` knob;
* ``history_table``: a history as a terminal table, HTML, CSV or pandas;
* ``report``: ``print(nitro)``, the binding report and an experiment's repr;
* ``staleness``: the stale-handle report before each verb.

The core never imports these modules (an import-linter contract in CI); it
reaches them through the hooks in :mod:`jaxnitro.hookspecs`.
"""
