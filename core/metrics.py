"""Reducing ``metrics`` results over a whole split.

``metrics`` returns ``{name: (value, mode)}`` per batch:

* ``(value, count)`` with a number (or numeric array) as ``count``: values and
  counts are summed over the split and divided once at the end;
* ``(value, "sum")``: summed, never divided (a confusion matrix);
* ``(value, "max")`` / ``(value, "min")``: elementwise extreme over batches;
* ``(value, "concat")``: concatenated along axis 0 (per-example outputs).
"""

from __future__ import annotations

import numbers

import numpy as np

__all__ = ["MetricAccumulator", "MODES", "check_metric_entry"]

MODES = ("count", "sum", "max", "min", "concat")


def check_metric_entry(name: str, entry) -> str:
    """Validate one ``metrics`` entry and return its mode name.

    Raises ``TypeError`` when the entry is not a ``(value, mode)`` pair and
    ``ValueError`` naming the metric for an unknown mode string.
    """
    if not (isinstance(entry, tuple) and len(entry) == 2):
        raise TypeError(
            f"jaxnitro: metric `{name}` is {type(entry).__name__}, not a (value, mode) pair. "
            f"Return `{{'{name}': (value, count)}}` for a mean with its own denominator, or "
            f"`(value, 'sum' | 'max' | 'min' | 'concat')`."
        )
    mode = entry[1]
    if isinstance(mode, str):
        if mode not in MODES[1:]:
            raise ValueError(
                f"jaxnitro: metric `{name}` has unknown mode {mode!r}. Known modes: a count "
                f"(a number: summed and divided once), 'sum', 'max', 'min', 'concat'."
            )
        return mode
    if isinstance(mode, (numbers.Number, np.ndarray, np.generic)) or hasattr(mode, "dtype"):
        return "count"
    raise ValueError(
        f"jaxnitro: metric `{name}` has mode of type {type(mode).__name__}. The mode is a count "
        f"(a number) or one of 'sum', 'max', 'min', 'concat'."
    )


def _check_count(name: str, count) -> np.ndarray:
    """A batch's count as float64; ``ValueError`` naming the metric for a negative or NaN count."""
    c = np.asarray(count, dtype=np.float64)
    if np.any(np.isnan(c)) or np.any(c < 0):
        raise ValueError(
            f"jaxnitro: metric `{name}` returned the count {c.tolist()!r} for a batch; a count is "
            f"the number of examples its value sums over (>= 0, not NaN): a negative count would "
            f"give a negative mean. Return `(value_sum, n)` with n the rows counted, e.g. "
            f"`label.shape[0]`."
        )
    return c


class MetricAccumulator:
    """Accumulates per-batch ``metrics`` results on the host and reduces them once.

    ``add(results)`` takes one batch's ``{name: (value, mode)}`` (host values);
    ``result()`` returns ``{name: reduced value}`` with counted metrics divided
    and ``"sum"`` metrics as raw totals. A metric's mode may not change between
    batches.
    """

    def __init__(self) -> None:
        self._modes: dict[str, str] = {}
        self._totals: dict[str, object] = {}
        self._counts: dict[str, object] = {}

    def add(self, results: dict) -> None:
        if not isinstance(results, dict):
            raise TypeError(
                f"jaxnitro: `metrics` returned {type(results).__name__}; it must return a dict "
                f"{{name: (value, mode)}}."
            )
        for name, entry in results.items():
            mode = check_metric_entry(name, entry)
            value = np.asarray(entry[0])
            known = self._modes.setdefault(name, mode)
            if known != mode:
                raise ValueError(
                    f"jaxnitro: metric `{name}` changed mode from {known!r} to {mode!r} between "
                    f"batches; a metric keeps one mode for the whole split."
                )
            count = _check_count(name, entry[1]) if mode == "count" else None
            if name not in self._totals:
                self._totals[name] = [value] if mode == "concat" else value.astype(
                    np.result_type(value.dtype, np.float64) if mode == "count" else value.dtype
                )
                if mode == "count":
                    self._counts[name] = count
                continue
            if mode == "count":
                self._totals[name] = self._totals[name] + value
                self._counts[name] = self._counts[name] + count
            elif mode == "sum":
                self._totals[name] = self._totals[name] + value
            elif mode == "max":
                self._totals[name] = np.maximum(self._totals[name], value)
            elif mode == "min":
                self._totals[name] = np.minimum(self._totals[name], value)
            else:
                self._totals[name].append(value)

    @classmethod
    def merged(cls, shares: list) -> "MetricAccumulator":
        """One accumulator from several processes' shares of a split, in process order.

        Counted, ``"sum"``, ``"max"`` and ``"min"`` metrics combine their totals; ``"concat"``
        values are interleaved batch by batch (process 0's part of batch 0, process 1's part
        of batch 0, ..., then batch 1), which is the one-process order when every process
        reads its part of each batch (``jn.ArraySource`` in a multi-process job)."""
        out = cls()
        for share in shares:
            for name, mode in share._modes.items():
                known = out._modes.setdefault(name, mode)
                if known != mode:
                    raise ValueError(
                        f"jaxnitro: metric `{name}` has mode {known!r} on one process and {mode!r} on "
                        f"another; a metric keeps one mode for the whole split."
                    )
                theirs = share._totals[name]
                if mode == "concat":
                    out._totals.setdefault(name, []).append(theirs)
                elif name not in out._totals:
                    out._totals[name] = theirs
                    if mode == "count":
                        out._counts[name] = share._counts[name]
                elif mode == "count":
                    out._totals[name] = out._totals[name] + theirs
                    out._counts[name] = out._counts[name] + share._counts[name]
                elif mode == "sum":
                    out._totals[name] = out._totals[name] + theirs
                elif mode == "max":
                    out._totals[name] = np.maximum(out._totals[name], theirs)
                else:
                    out._totals[name] = np.minimum(out._totals[name], theirs)
        for name, mode in out._modes.items():
            if mode == "concat":  # [per process: [per batch]] -> batch-major
                lists = out._totals[name]
                out._totals[name] = [ls[i] for i in range(max(map(len, lists))) for ls in lists if i < len(ls)]
        return out

    def result(self, check_counts: bool = True) -> dict:
        """``{name: reduced value}``. A counted metric whose total count is 0 raises (its mean
        would be NaN or inf), unless ``check_counts`` is False: setup's check of the first
        `val` batch feeds the hooks zeros, whose counts mean nothing (the value is then NaN)."""
        out = {}
        for name, mode in self._modes.items():
            total = self._totals[name]
            if mode == "count":
                counts = self._counts[name]
                if check_counts and counts.ndim == 0 and counts <= 0:  # per-entry counts may be 0 (a class absent: NaN)
                    raise ValueError(
                        f"jaxnitro: metric `{name}` has a total count of {float(counts):g} over the "
                        f"split; a counted metric is divided by its total count, so the result "
                        f"would be NaN or inf. The count is the number of examples the value sums "
                        f"over: return `(value_sum, n)` with n > 0 over the split (e.g. "
                        f"`label.shape[0]`), or use the 'sum' mode for a plain total."
                    )
                if check_counts:
                    value = total / counts
                else:
                    with np.errstate(divide="ignore", invalid="ignore"):
                        value = total / counts
            elif mode == "concat":
                value = np.concatenate([np.atleast_1d(v) for v in total], axis=0)
            else:
                value = total
            value = np.asarray(value)
            out[name] = value.item() if value.ndim == 0 else value
        return out
