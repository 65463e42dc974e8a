"""The front end's errors, protocol-neutral: each protocol maps them to its own code.

| error             | gRPC status        | HTTP |
| ----------------- | ------------------ | ---- |
| `InvalidArgument` | INVALID_ARGUMENT   | 400  |
| `QueueFull`       | RESOURCE_EXHAUSTED | 429  |
| `Unavailable`     | UNAVAILABLE        | 503  |
| `RequestFailed`   | INTERNAL           | 500  |

NOTE: every message names the offending field in the protocol's own spelling (the caller passes
the field names it uses).
"""

from __future__ import annotations


class InvalidArgument(ValueError):
    """Bad client input; the message names the offending field, and so does `field` when the
    input is a request field (HTTP sends it as the error's `param`)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class QueueFull(Exception):
    """More sequences in flight than the server admits; retry later."""


class Unavailable(Exception):
    """The engine is not serving: warming up, shutting down, or broken."""


class RequestFailed(Exception):
    """This request failed after admission (its step failed, or building its response raised);
    the other requests carry on."""
