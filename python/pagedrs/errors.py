"""Exceptions raised by pagedrs.

Every error the Rust core reports maps onto one of these. Bad input is a ``ValueError`` (or,
for an unknown request id, a ``KeyError``), so callers can catch the standard classes;
``PagedrsError`` catches them all.
"""


class PagedrsError(Exception):
    """Base class of every pagedrs error."""


class InvalidArgumentError(PagedrsError, ValueError):
    """An argument is out of range: a zero block size, a negative count, a bad token id."""


class UnknownRequestError(PagedrsError, KeyError):
    """No live request has this id: it was never added, or it was already freed."""

    def __str__(self) -> str:
        # KeyError would quote the whole message; show it as written.
        return str(self.args[0]) if self.args else ""


class DuplicateRequestError(PagedrsError, ValueError):
    """A request with this id is already live."""


class InternalError(PagedrsError, RuntimeError):
    """The core found itself inconsistent. A bug in pagedrs: please report it."""
