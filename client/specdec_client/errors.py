"""Client exceptions: each carries the server's (or the transport's) message."""


class SpecDecClientError(Exception):
    """Base class of the client's errors."""


class ClientConnectionError(SpecDecClientError):
    """The server could not be reached."""


class RequestTimeoutError(SpecDecClientError):
    """No response arrived within the timeout."""


class ServerError(SpecDecClientError):
    """The server answered with an error (e.g. a bad request field); str() is its message."""
