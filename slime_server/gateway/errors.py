"""The gateway's error: ``APIError`` (status, OpenAI error fields), raised anywhere in the core.

Why apart from ``api/errors.py``: the core (templating, sessions, turns, the engine client) raises
errors without knowing HTTP; ``api/errors.py`` renders them (OpenAI or Anthropic format) and turns
FastAPI's own failures into the same shape.
"""

from __future__ import annotations

from typing import Any

from slime_server.gateway.protocol import ErrorDetail, ErrorResponse

_TYPE_FOR_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    502: "api_error",
    503: "api_error",
}


class APIError(Exception):
    """Raised anywhere in the gateway; rendered as an OpenAI error body with ``status``."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type or _TYPE_FOR_STATUS.get(status, "api_error")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        detail = ErrorDetail(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=detail).model_dump()


def bad_request(message: str, *, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def not_found(message: str, *, code: str = "not_found", param: str | None = None) -> APIError:
    return APIError(404, message, code=code, param=param)
