"""kvtier's exceptions: every failure carries its gRPC status code and message.

A failing call raises :class:`KvtierError` or the subclass for its code. The
subclasses also derive from the built-in exception that means the same, so
``except ValueError`` catches a bad argument and ``except TimeoutError`` a
missed deadline::

    try:
        connector.start_load(request_id, pages)
    except kvtier.errors.InvalidArgument as e:
        print(e.code.name, e.message)
"""

from __future__ import annotations

import enum


class StatusCode(enum.IntEnum):
    """gRPC's (and absl's) status codes, value for value."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class KvtierError(Exception):
    """A failed kvtier call: ``code`` (a :class:`StatusCode`) and
    ``message``."""

    def __init__(self, code: int, message: str) -> None:
        try:
            self.code: StatusCode = StatusCode(code)
        except ValueError:
            self.code = StatusCode.UNKNOWN
        self.message: str = message
        super().__init__(f"{self.code.name}: {message}")


class InvalidArgument(KvtierError, ValueError):
    """INVALID_ARGUMENT: the call's arguments were wrong; nothing changed."""


class NotFound(KvtierError, LookupError):
    """NOT_FOUND: e.g. a request that is not open."""


class AlreadyExists(KvtierError):
    """ALREADY_EXISTS."""


class FailedPrecondition(KvtierError):
    """FAILED_PRECONDITION: the call does not fit the object's state."""


class ResourceExhausted(KvtierError):
    """RESOURCE_EXHAUSTED: no staging memory, no store space, ..."""


class DeadlineExceeded(KvtierError, TimeoutError):
    """DEADLINE_EXCEEDED: the operation's deadline passed."""


class Unavailable(KvtierError, ConnectionError):
    """UNAVAILABLE: a store (or router) could not be reached."""


class DataLoss(KvtierError):
    """DATA_LOSS: a block failed its checksum; its bytes must not be used."""


class Internal(KvtierError):
    """INTERNAL: a bug, or an answer the client cannot use."""


_BY_CODE: dict[StatusCode, type[KvtierError]] = {
    StatusCode.INVALID_ARGUMENT: InvalidArgument,
    StatusCode.NOT_FOUND: NotFound,
    StatusCode.ALREADY_EXISTS: AlreadyExists,
    StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    StatusCode.UNAVAILABLE: Unavailable,
    StatusCode.DATA_LOSS: DataLoss,
    StatusCode.INTERNAL: Internal,
}


def from_status(code: int, message: str) -> KvtierError:
    """The exception for a failed status (used by kvtier._native)."""
    try:
        cls = _BY_CODE.get(StatusCode(code), KvtierError)
    except ValueError:
        cls = KvtierError
    return cls(code, message)
