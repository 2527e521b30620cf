"""The small exception tree shared by service logic and clients.

Logic below the gRPC boundary raises these plain exceptions; servicers map them onto
canonical gRPC status codes (see ``amprl.common.grpcutil.map_errors``), and clients map
status codes back onto them, so callers never parse status strings.
"""


class AmprlError(Exception):
    """Base class of every error AMP-RL raises on purpose."""


class InvalidArgument(AmprlError, ValueError):
    """The request itself is wrong (shape, dtype, NaN, unknown name): INVALID_ARGUMENT."""


class FailedPrecondition(AmprlError):
    """The request is well formed but the system is not in a state to accept it
    (e.g. a gradient too stale for the parameter server): FAILED_PRECONDITION."""

    def __init__(self, message: str, current_version: int | None = None):
        super().__init__(message)
        self.current_version = current_version


class NotFound(AmprlError):
    """What the request asks for does not exist (yet), e.g. best weights before the first
    evaluation: NOT_FOUND."""


class ResourceExhausted(AmprlError):
    """A size limit was exceeded: RESOURCE_EXHAUSTED."""


class DeadlineExceeded(AmprlError, TimeoutError):
    """A wait (rate limiter, minimum size) outlasted the caller's deadline."""


class Unavailable(AmprlError, ConnectionError):
    """The service could not be reached (after retries)."""


class UsageError(AmprlError):
    """A mistake of the person running a command (a missing file, a bad config, a service
    that cannot start with the settings given): ``amprl`` prints the message as one line
    and exits with status 2, with the traceback only under ``--debug`` (``amprl.cli``)."""


class ConfigError(UsageError, ValueError):
    """An experiment config has an unknown key or a bad value; the message names the key."""
