"""The transports' errors: what a caller of any transport catches.

:class:`TransportError` and its kinds are raised by every transport (:mod:`.tcp`,
:mod:`.ofl`) and by :class:`~remote_dspark.transport.FrameChannel`; the caller
reconnects on any of them. Kept apart from the package so that the transports import
them without importing the package that loads the transports.
"""


class TransportError(Exception):
    """The connection failed; the caller reconnects (with back-off)."""


class DeadlineExceeded(TransportError):
    """No (complete) answer before the deadline."""


class Disconnected(TransportError):
    """The peer closed the connection or it broke."""
