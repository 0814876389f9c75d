"""moe errors: one exception class per stable wire code (docs/PROTOCOL.md,
"Stable error codes"), all subclasses of moe.Error.

    try:
        c.forward("m", 0, x)
    except moe.BusyError:
        ...                      # queue full: retry later
    except moe.Error as e:
        print(e.code, e)         # any other failure: e.code is the wire code
"""
from typing import Dict, Optional, Type


class Error(Exception):
    """A failed call. .code is the stable wire code ("busy", "not_found", ...),
    .number the C enum value (moe_err in base/moe.h) and .message the
    server's (or the library's) human-readable reason."""

    code = "internal"
    number = 14

    def __init__(self, err: Optional[int] = None, message: str = ""):
        if err is not None:
            self.number = int(err)
            self.code = _CODES.get(self.number, "internal")
        self.message = message
        super().__init__("%s: %s" % (self.code, message) if message else self.code)

    @classmethod
    def closed(cls) -> "Error":
        """The error of a call on a closed client."""
        return ClosedError(15, "the client is closed")


class InvalidArgumentError(Error):
    """invalid_argument: a parameter is missing, of the wrong value or inconsistent."""


class UnauthenticatedError(Error):
    """unauthenticated: the auth token is missing or wrong."""


class BusyError(Error):
    """busy: a bounded queue is full; retry later with backoff."""


class DeadlineExceededError(Error):
    """deadline_exceeded: the request's deadline (or the client's timeout) passed."""


class UnavailableError(Error):
    """unavailable: workers missing or unhealthy, or the server is draining."""


class NotFoundError(Error):
    """not_found: unknown model, layer or handle."""


class ResourceExhaustedError(Error):
    """resource_exhausted: out of host or GPU memory or another resource."""


class TooLargeError(Error):
    """too_large: the message is over the size cap."""


class MalformedError(Error):
    """malformed: not msgpack, not a request, or a field of the wrong type."""


class UnknownMethodError(Error):
    """unknown_method: no such method."""


class ExpiredError(Error):
    """expired: a training handle timed out (or the cluster re-formed) and was freed."""


class FailedPreconditionError(Error):
    """failed_precondition: valid, but not now (e.g. step with no gradients, a
    handle already used, expect_step not matching)."""


class IoError(Error):
    """io_error: a file system error (checkpoints)."""


class InternalError(Error):
    """internal: a bug or an unexpected failure; the server log has the details.
    Also the class of a code this client does not know."""


class ClosedError(Error):
    """closed: the client (or the connection) is closed."""


# enum value -> (wire code, class); never renumbered (base/moe.h)
_TABLE = {
    1: ("invalid_argument", InvalidArgumentError),
    2: ("unauthenticated", UnauthenticatedError),
    3: ("busy", BusyError),
    4: ("deadline_exceeded", DeadlineExceededError),
    5: ("unavailable", UnavailableError),
    6: ("not_found", NotFoundError),
    7: ("resource_exhausted", ResourceExhaustedError),
    8: ("too_large", TooLargeError),
    9: ("malformed", MalformedError),
    10: ("unknown_method", UnknownMethodError),
    11: ("expired", ExpiredError),
    12: ("failed_precondition", FailedPreconditionError),
    13: ("io_error", IoError),
    14: ("internal", InternalError),
    15: ("closed", ClosedError),
}
_CODES: Dict[int, str] = {n: code for n, (code, _) in _TABLE.items()}

#: wire code -> exception class
ERROR_CLASSES: Dict[str, Type[Error]] = {code: cls for code, cls in _TABLE.values()}

for _n, (_code, _cls) in _TABLE.items():
    _cls.code = _code
    _cls.number = _n


def error_from(err: int, message: str = "") -> Error:
    """The exception for a moe_err value: the subclass of its wire code."""
    cls = _TABLE.get(int(err), ("internal", InternalError))[1]
    return cls(err, message)


def error_from_code(code: str, message: str = "") -> Error:
    """The exception for a wire code string (unknown codes: InternalError)."""
    cls = ERROR_CLASSES.get(code, InternalError)
    return cls(cls.number, message)
