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
