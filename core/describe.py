"""Describing a handle or an experiment: through the ``jaxnitro_describe`` hook.

``print(nitro)``, a notebook's HTML view, the binding report a run logs and
an experiment's ``repr`` all come from :func:`describe`. A plugin renders
them; without one the core gives a one-line summary, so ``repr`` never fails.
:func:`summarize_value` is the short text of one value those views (and the logged
parameters) show. The experiment module imports this one, never the reverse.
"""

from __future__ import annotations

import html

import numpy as np

from .plugin_manager import first_result

__all__ = ["describe", "FORMATS", "summarize_value"]

FORMATS = ("text", "html", "report")
"""``text``: a terminal (sized to it); ``html``: a notebook; ``report``: plain text of a fixed
width for a log file."""


def summarize_value(value) -> str:
    """A short text for a field value: arrays by shape and dtype, others by repr (truncated)."""
    if hasattr(value, "shape") and hasattr(value, "dtype") and np.ndim(value) > 0:
        return f"{type(value).__name__}{tuple(value.shape)} {value.dtype}"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _summary(subject) -> str:
    if hasattr(subject, "settings") and hasattr(subject, "experiment"):  # a handle
        return f"Nitro({type(subject.experiment).__name__})  status: {subject.status}"
    values = ", ".join(f"{n}={summarize_value(getattr(subject, n, None))}" for n in subject.__jaxnitro_fields__)
    return f"{type(subject).__name__}({values})"


def describe(subject, format: str = "text") -> str:
    """Describe ``subject`` (a ``Nitro`` or an experiment) as ``format`` (see :data:`FORMATS`)."""
    if format not in FORMATS:
        raise ValueError(f"jaxnitro: describe format {format!r}; expected one of {FORMATS}.")
    text = first_result("jaxnitro_describe", subject=subject, format=format)
    if text is not None:
        return text
    summary = _summary(subject)
    return f"<pre>{html.escape(summary)}</pre>" if format == "html" else summary
