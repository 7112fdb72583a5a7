"""How a failure to produce or transfer a batch reaches the consumer.

In: the exception that ``batch_at``, the source's iterator or ``transfer``
raised, with the batch index and epoch. Out: a :class:`PrefetchError` naming
them, with that exception as its ``__cause__``, for the consumer's thread to
raise. A producer thread hands its exception over as a :class:`Failure` in
place of a batch.
"""

from __future__ import annotations


class PrefetchError(RuntimeError):
    """A batch could not be produced or transferred.

    Raised in the consumer's thread. ``index`` is the batch's position in the
    epoch, ``epoch`` the epoch, and ``__cause__`` the exception the source (or
    ``transfer``) raised, with its original traceback.
    """

    def __init__(self, message: str, *, index: int, epoch: int):
        super().__init__(message)
        self.index = index
        self.epoch = epoch


class SourceLengthError(PrefetchError, ValueError):
    """An iterated source yielded a different number of batches than its ``len()``.

    ``len()`` fixes the epoch length and the schedule horizon, so a source that
    disagrees with it would silently change both. Raised in the consumer's thread
    when the source ends early (after the batches it did yield were delivered) or
    yields a batch beyond ``len()``. ``split`` names the split (None when unknown),
    ``length`` is ``len(source)`` and ``count`` the batches yielded (``length + 1``
    when it yielded too many).
    """

    def __init__(self, split: str | None, length: int, count: int, epoch: int):
        where = f"the `{split}` split" if split else "a data source"
        if count > length:
            what = f"yielded more than its len() of {length} batches (batch {length} arrived)"
        else:
            what = f"yielded {count} batches, but its len() is {length}"
        super().__init__(
            f"jaxnitro: {where} {what} in epoch {epoch}. The epoch length and the schedule "
            f"horizon are computed from len(), so they would silently be wrong. Fix: make the "
            f"source's __len__ return the number of batches one pass yields (with a partial final "
            f"batch dropped: len(dataset) // batch_size), or make the pass yield len() batches.",
            index=min(count, length),
            epoch=epoch,
        )
        self.split, self.length, self.count = split, length, count


class Failure:
    """A producer's exception, carried to the consumer in place of a batch."""

    __slots__ = ("index", "exc")

    def __init__(self, index: int, exc: BaseException):
        self.index = index
        self.exc = exc


def failure_error(index: int, exc: BaseException, epoch: int, what: str) -> PrefetchError:
    """The :class:`PrefetchError` for ``what`` (e.g. ``"batch_at(3)"``) raising ``exc``."""
    err = PrefetchError(
        f"{what} raised {type(exc).__name__} for batch {index} of epoch {epoch}: {exc}",
        index=index,
        epoch=epoch,
    )
    err.__cause__ = exc  # as `raise err from exc`, when raised later
    return err
