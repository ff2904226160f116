"""kvroute's one error tree. Library exceptions become these in one place; each carries an
OpenAI-style `type` and an HTTP status (also the status of an ext_proc immediate response).

`message` goes to the client; `detail` (worker addresses, upstream texts) only to the log:
client error bodies never carry internal addresses. `headers()` are response headers both
doors add to the error (Retry-After on a 429)."""

from __future__ import annotations

from typing import Any


class KvrouteError(Exception):
    status = 500
    type = "internal_error"
    code: str | None = None

    def __init__(
        self, message: str, *, param: str | None = None, detail: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.detail = detail

    def body(self) -> dict[str, Any]:
        """OpenAI's error body (vLLM uses the same shape)."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code or self.status,
            }
        }

    def headers(self) -> list[tuple[str, str]]:
        """Extra response headers for this error (lower-case names)."""
        return []


class BadRequest(KvrouteError):
    status = 400
    type = "invalid_request_error"


class Forbidden(KvrouteError):
    status = 403
    type = "permission_error"


class NotFound(KvrouteError):
    status = 404
    type = "not_found_error"


class MethodNotAllowed(KvrouteError):
    status = 405
    type = "invalid_request_error"


class RequestTimeout(KvrouteError):
    status = 408
    type = "invalid_request_error"


class PayloadTooLarge(KvrouteError):
    status = 413
    type = "invalid_request_error"


class Overloaded(KvrouteError):
    """Every endpoint is past its busy bound and shedding is on: the client should retry
    (OpenAI's clients retry a 429 after Retry-After)."""

    status = 429
    type = "rate_limit_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        detail: str | None = None,
        retry_after_s: int = 1,
    ) -> None:
        super().__init__(message, param=param, detail=detail)
        self.retry_after_s = retry_after_s

    def headers(self) -> list[tuple[str, str]]:
        return [("retry-after", str(self.retry_after_s))]


class ShuttingDown(KvrouteError):
    """The router stopped (SIGTERM) before the request finished: the client may retry it, on
    another replica."""

    status = 503
    type = "service_unavailable"


class UpstreamError(KvrouteError):
    status = 502
    type = "upstream_error"


class NoWorkerAvailable(KvrouteError):
    status = 503
    type = "service_unavailable"


class UpstreamTimeout(KvrouteError):
    status = 504
    type = "timeout_error"


class ConfigError(KvrouteError):
    """Bad configuration found at start: names the field and the fix."""

    status = 500
    type = "config_error"
