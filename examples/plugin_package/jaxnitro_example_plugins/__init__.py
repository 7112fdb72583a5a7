"""Example third-party plugins for jaxnitro (distribution ``jaxnitro-example-plugins``).

Installing the distribution registers two entry points in group ``jaxnitro``:

* ``csv`` (:mod:`jaxnitro_example_plugins.csv_logger`): ``logger="csv"`` writes
  ``run_dir/metrics.csv`` (one row per logged line, a header naming the
  columns) and ``run_dir/run.json`` (params, other values, final status);
* ``array_loader`` (:mod:`jaxnitro_example_plugins.array_loader`): a split given
  as an :class:`ArrayLoader` (a dict of arrays plus a batch size) becomes an
  index-addressable jaxnitro source, shuffled per epoch for ``"train"``.

The plugins use only jaxnitro's public ``jaxnitro.hookimpl``.
"""

from .array_loader import ArrayLoader, ArraySource
from .csv_logger import CSVLogger

__all__ = ["ArrayLoader", "ArraySource", "CSVLogger"]
__version__ = "0.1.0"
