"""The errors a split's reading raises: a batch that could not be produced, a wrong ``len()``.

In: the exception that ``batch_at``, the source's iterator or ``transfer``
raised, with the batch index and epoch. Out: a :class:`PrefetchError` naming
them, with that exception as its ``__cause__``, for the consumer's thread to
raise (:func:`failure_error`). Raised by setup's reads of a split's first and
last batch, by the serial pass (:mod:`jaxnitro.serial_pass`) and by any
prefetcher (the ``prefetch`` plugin's producer threads hand their exception to
the consumer, which raises this). Public as ``jaxnitro.PrefetchError`` and
``jaxnitro.SourceLengthError``.

This module imports no other part of jaxnitro.
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
    """A source has a different number of batches than its ``len()``.

    ``len()`` fixes the epoch length and the schedule horizon, so a source that
    disagrees with it would silently change both. Raised in the consumer's thread
    when an iterated source ends early (after the batches it did yield were
    delivered) or yields a batch beyond ``len()``, and when an index-addressable
    source's ``batch_at`` raises ``IndexError`` below ``len()``
    (:meth:`from_index_error`) or serves a full batch at ``len()``
    (:meth:`past_end`). ``split`` names the split (None when unknown), ``length``
    is ``len(source)`` and ``count`` the batches it has (``length + 1`` when it
    has too many).
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

    @classmethod
    def _made(cls, split: str | None, length: int, count: int, index: int, epoch: int, text: str,
              subject: str | None = None) -> SourceLengthError:
        """An error whose message is ``subject`` (None: ``jaxnitro: the `<split>` split's len()``)
        then ``text`` (``" is 4, but ..."``), made without :meth:`__init__` (the iterated case)."""
        err = cls.__new__(cls)
        subject = subject or f"jaxnitro: {f'the `{split}` split' if split else 'a data source'}'s len()"
        PrefetchError.__init__(err, f"{subject}{text}", index=index, epoch=epoch)
        err.split, err.length, err.count = split, length, count
        return err

    @classmethod
    def from_index_error(
        cls, split: str | None, length: int, index: int, epoch: int, exc: BaseException, when: str = ""
    ) -> SourceLengthError:
        """``batch_at(index)`` raised ``IndexError`` for an ``index`` below ``len()``: the
        source's ``len()`` claims batches it does not have (``count`` is ``index``, the most
        it can have). ``when`` says what was reading (setup's check of the last batch)."""
        err = cls._made(
            split, length, index, index, epoch,
            f" is {length}, but batch_at({index}) raised IndexError "
            f"({exc}) in epoch {epoch}{when}: len() and the batches disagree, so batches "
            f"0..{length - 1} do not all exist. The epoch length and the schedule horizon are "
            f"computed from len(). Fix: make the source's __len__ return the number of batches "
            f"batch_at serves (with a partial final batch dropped: rows // batch_size), or make "
            f"batch_at serve every index below len().",
        )
        err.__cause__ = exc
        return err

    @classmethod
    def past_end(
        cls, split: str | None, length: int, rows: int, width: int, epoch: int, when: str = "",
        subject: str | None = None,
    ) -> SourceLengthError:
        """``batch_at(length)`` (one past ``len()``) returned a batch of ``rows`` rows, as wide
        as the epoch's batches (``width``): the source has more batches than its ``len()``,
        and those past it would never be read (``count`` is ``length + 1``, the fewest it has).
        ``when`` says what was reading (setup's check of the last batch); ``subject`` as in
        :meth:`_made`."""
        return cls._made(
            split, length, length + 1, length, epoch,
            f" is {length}, but batch_at({length}), one past its last "
            f"batch, returned a full batch ({rows} rows, as wide as its batch of {width}) in epoch "
            f"{epoch}{when}: len() and the batches disagree, so at least {length + 1} batches "
            f"exist and those past len() would never be read (an epoch reads batches "
            f"0..{length - 1} only). Fix: make the source's __len__ return the number of batches "
            f"batch_at serves, or make batch_at raise IndexError for i >= len() (a source that "
            f"serves any index, e.g. generated data, must still bound it).",
            subject,
        )

    @classmethod
    def hidden(
        cls, split: str | None, length: int, epoch: int, detail: str, fix: str, when: str = "",
        subject: str | None = None,
    ) -> SourceLengthError:
        """A source that knows its ``len()`` hides data says so from ``batch_at(length)`` (an
        adapter whose dataset serves an index at its own length): ``detail`` says what it found,
        ``fix`` what to change. Raised with ``split`` None by the source; the core's check one
        past the end (``jaxnitro.serial_pass.check_past_end``) raises it again naming the split
        (or ``subject``, as in :meth:`_made`)."""
        err = cls._made(
            split, length, length + 1, length, epoch,
            f" is {length}, but {detail} (epoch {epoch}{when}): len() and "
            f"the data disagree, the data holds more than the {length} batches len() counts, and "
            f"what lies past them would never be read. Fix: {fix}",
            subject,
        )
        err.detail, err.fix = detail, fix
        return err


def failure_error(
    index: int, exc: BaseException, epoch: int, what: str, split: str | None = None,
    length: int | None = None, when: str = "",
) -> PrefetchError:
    """The :class:`PrefetchError` for ``what`` (e.g. ``"batch_at(3)"``) raising ``exc``, naming
    ``split`` when known. An ``IndexError`` from ``batch_at`` below ``length`` (``len()``) is a
    :class:`SourceLengthError`: the source's ``len()`` and its batches disagree."""
    if isinstance(exc, IndexError) and what.startswith("batch_at") and length is not None and index < length:
        return SourceLengthError.from_index_error(split, length, index, epoch, exc, when)
    where = f"the `{split}` split's " if split else ""
    err = PrefetchError(
        f"jaxnitro: {where}{what} raised {type(exc).__name__} for batch {index} of epoch {epoch}"
        f"{when}: {exc}",
        index=index,
        epoch=epoch,
    )
    err.__cause__ = exc  # as `raise err from exc`, when raised later
    return err
