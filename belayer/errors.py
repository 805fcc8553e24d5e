"""The project's one exception tree.

::

    BelayerError
    ├── EngineError                  anything between the gateway and an inference worker
    │   ├── EngineUnavailable        connection refused/reset, worker died, no healthy worker
    │   ├── EngineTimeout            no answer (or no token) within a deadline
    │   └── EngineRejected           the engine answered 4xx: bad input, never retried
    ├── RequestError                 the client's request cannot be served as sent (-> 4xx)
    │   ├── InvalidRequest           malformed body, wrong type, unsupported parameter
    │   ├── NotFound                 unknown session, model or route
    │   ├── ContextLengthExceeded    prompt + completion over the model's context window
    │   ├── Conflict                 e.g. a request on a closed session
    │   └── Forbidden                an admin endpoint without the admin token
    └── StoreError                   the trajectory store failed

Transport errors (httpx) are translated into this tree at one boundary, ``engine_pool.client``;
the gateway maps the tree to OpenAI error JSON in one table, ``gateway.errors``.
"""

from __future__ import annotations


class BelayerError(Exception):
    """Root of every error raised by Belayer."""


class EngineError(BelayerError):
    """Something went wrong talking to an inference worker."""


class EngineUnavailable(EngineError):
    """The worker cannot be reached or died mid-request; another worker may serve the request."""


class EngineTimeout(EngineError, TimeoutError):
    """The worker did not answer within the deadline."""


class EngineRejected(EngineError):
    """The worker rejected the request (HTTP 4xx). Retrying elsewhere would fail the same way."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class RequestError(BelayerError):
    """The client's request is wrong; ``param`` names the offending field when there is one."""

    status = 400
    error_type = "invalid_request_error"
    code: str | None = None

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        if code is not None:
            self.code = code


class InvalidRequest(RequestError):
    """Malformed body, wrong type or unsupported parameter."""


class NotFound(RequestError):
    """An unknown session, model or resource."""

    status = 404
    code = "not_found"


class ContextLengthExceeded(RequestError):
    """Prompt plus requested completion do not fit in the model's context window."""

    code = "context_length_exceeded"


class Conflict(RequestError):
    """The request conflicts with the resource's state (e.g. the session is closed)."""

    status = 409
    code = "conflict"


class Forbidden(RequestError):
    """An admin endpoint called without (or with a wrong) admin token."""

    status = 403
    error_type = "permission_error"
    code = "forbidden"


class StoreError(BelayerError):
    """The trajectory store failed."""
