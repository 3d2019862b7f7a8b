"""The client's exceptions: one base class, a few kinds a trainer can act on."""

from __future__ import annotations


class WeightstreamError(Exception):
    """Base class of every error this package raises."""


class DaemonUnavailable(WeightstreamError):
    """The daemon cannot be reached: not running, wrong socket, or it stopped."""


class RequestRejected(WeightstreamError):
    """The daemon refused a request; the message names the field and the limit. It reads as
    that message alone: the gRPC code (``"NOT_FOUND"``) is ``code``, for programs."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class SessionFault(WeightstreamError):
    """The daemon refused one acquire or release of a session: it reads as the ticket and the
    message; the fault's code (``"FAULT_RESOURCE_EXHAUSTED"``) is ``code``."""

    def __init__(self, ticket: int, code: str, message: str):
        super().__init__(f"ticket {ticket}: {message}")
        self.ticket = ticket
        self.code = code
        self.message = message
