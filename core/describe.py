"""Describing a handle or an experiment: through the ``jaxnitro_describe`` hook.

``print(nitro)``, a notebook's HTML view, the binding report a run logs and
an experiment's ``repr`` all come from :func:`describe`. A plugin renders
them; without one the core gives a one-line summary, so ``repr`` never fails.
"""

from __future__ import annotations

import html

from .experiment import fields_of, summarize_value
from .plugin_manager import first_result

__all__ = ["describe", "FORMATS"]

FORMATS = ("text", "html", "report")
"""``text``: a terminal (sized to it); ``html``: a notebook; ``report``: plain text of a fixed
width for a log file."""


def _summary(subject) -> str:
    if hasattr(subject, "settings") and hasattr(subject, "experiment"):  # a handle
        return f"Nitro({type(subject.experiment).__name__})  status: {subject.status}"
    values = ", ".join(f"{n}={summarize_value(getattr(subject, n, None))}" for n in fields_of(subject))
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
