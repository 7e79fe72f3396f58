"""What the server answers besides a prediction. Each error knows its HTTP status; the routes
write its message in their API's error body ({"detail": ...} for v1, {"error": ...} for v2)."""

from __future__ import annotations

import math

from kiln.preprocessing.errors import InputError


class ServingError(Exception):
    """An answer other than 200. `headers` are sent with it (e.g. Retry-After)."""

    status = 500

    def __init__(self, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.headers = headers or {}


class BadRequest(ServingError):
    """The request itself is malformed (JSON, the protocol's fields): v1 422, v2 400."""

    status = 400


class PayloadTooLarge(ServingError):
    """The body is larger than server.max_body_bytes."""

    status = 413


class ModelFailed(ServingError):
    """The model raised on this request's inputs alone (the rest of its batch was answered)."""

    status = 500


class Unavailable(ServingError):
    """Not now: the queue is full, or the server is starting or draining. Retry later."""

    status = 503

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message, {"Retry-After": str(max(1, math.ceil(retry_after_s)))})


class QueueFull(Unavailable):
    """More inputs are waiting than server.max_queue_size allows."""


class DecodeQueueFull(Unavailable):
    """More image files are waiting to be decoded than server.max_decode_queue_size allows."""


class BatcherClosed(Unavailable):
    """The server is shutting down (or not started): the request was not run."""


class DeadlineExceeded(ServingError):
    """server.timeout_ms (or the request's own timeout) passed before the answer was ready."""

    status = 504


class ClientGone(ServingError):
    """The client closed the connection before its answer: nothing is sent (counted as 499,
    the status nginx logs for it)."""

    status = 499


class RefusedFile(InputError):
    """An image file the decode pool refused (more pixels than the limit, damaged): a 422 as any
    InputError, answered after server.refusal_delay_ms (ServingState.pace)."""
