"""Sources outside the training loop: reading one in order (``predict``), releasing them.

:func:`batches_of` turns what ``predict`` was given into its batches: a foreign
loader is adapted through the ``jaxnitro_adapt_source`` hook first (``split`` is
``"predict"``); an index-addressable source (``batch_at``/``begin_epoch``) is read
as its epoch 0, in index order; anything else is iterated.
:func:`release_sources` calls ``release()`` on every split once, reporting (not
raising) a failing one so the others are still released.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

from .plugin_manager import first_result
from .prefetch import is_addressable

__all__ = ["batches_of", "release_sources"]


def batches_of(source, split: str) -> Iterator:
    """The batches of ``source`` in order (adapted first when a plugin knows its type)."""
    adapted = first_result("jaxnitro_adapt_source", source=source, split=split)
    if adapted is not None:
        source = adapted
    if is_addressable(source) and not isinstance(source, (list, tuple)):
        source.begin_epoch(0)
        return (source.batch_at(i) for i in range(len(source)))
    return iter(source)


def release_sources(data: dict) -> None:
    """``release()`` every split's source; a failure is warned about, naming the split."""
    for split, source in data.items():
        try:
            source.release()
        except Exception as err:  # noqa: BLE001 - release the others; say which failed
            warnings.warn(
                f"jaxnitro: releasing the `{split}` split's source failed: {err!r}.", RuntimeWarning, stacklevel=3
            )
