"""Sources outside the training loop: reading one in order (``predict``), releasing them.

:func:`batches_of` turns what ``predict`` was given into its batches: a foreign
loader is adapted through the ``jaxnitro_adapt_source`` hook first (``split`` is
``"predict"``); an index-addressable source (``batch_at``/``begin_epoch``) is read
as its epoch 0, in index order, by the loop's own serial pass
(:func:`jaxnitro.serial_pass.host_items`: a failing ``batch_at`` named, the check one past
its end); anything else is iterated.
:func:`release_sources` calls ``release()`` on every split once, reporting (not
raising) a failing one so the others are still released.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence

import numpy as np

from .plugin_manager import first_result
from .serial_pass import host_items
from .source_contract import adapted, is_addressable, use_adapter

__all__ = ["adapt_source", "as_batch", "batches_of", "check_fields", "release_sources"]


def adapt_source(source, split: str | None):
    """What a plugin's ``jaxnitro_adapt_source`` makes of ``source`` (a foreign loader), or None.

    Installed as the split wrappers' adapter (``jaxnitro.source_contract.use_adapter``), so
    ``PrefetchIterator(loader)`` and ``NoPrefetch(loader)`` adapt the loader too."""
    return first_result("jaxnitro_adapt_source", source=source, split=split)


use_adapter(adapt_source)


def batches_of(source, split: str) -> Iterator:
    """The batches of ``source`` in order (adapted first when a plugin knows its type)."""
    source = adapted(source, split)
    if is_addressable(source) and not isinstance(source, (list, tuple)):
        return (batch for _, batch in host_items(source, True, 0, split))
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


def check_fields(fields) -> tuple[str, ...] | None:
    """``fields`` (names for the parts of a tuple element) as a tuple of str, or None.

    Raises ``TypeError`` for a bare string or non-string names."""
    if fields is None:
        return None
    if isinstance(fields, str) or not all(isinstance(f, str) for f in fields):
        raise TypeError(f"fields must be a tuple of field names, got {fields!r}")
    return tuple(fields)


def as_batch(value, fields: Sequence[str] | None, what: str, fix: str,
             to_array: Callable = np.asarray) -> dict:
    """A loader's element as a jaxnitro batch, a dict of arrays (``to_array`` per field).

    A mapping keeps its keys; a tuple/list is named by ``fields``. Anything else raises
    ``TypeError`` saying what ``what`` is and ``fix``; a tuple of the wrong length raises
    ``ValueError``. Used by the loader adapters (grain, torch).
    """
    if isinstance(value, Mapping):
        return {str(k): to_array(v) for k, v in value.items()}
    if fields is not None and isinstance(value, (tuple, list)):
        if len(value) != len(fields):
            raise ValueError(f"{what} has {len(value)} parts but fields={tuple(fields)} names {len(fields)}")
        return {name: to_array(v) for name, v in zip(fields, value)}
    shape = f" of {len(value)}" if isinstance(value, (tuple, list)) else ""
    raise TypeError(
        f"{what} is a {type(value).__name__}{shape}, not a dict; a jaxnitro batch is a dict "
        f"{{field: array}}. Fix: {fix}"
    )
