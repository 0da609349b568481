"""The HTTP error both the server (:mod:`turbo.serve`) and the router (:mod:`turbo.router`) answer with:
:class:`APIError`, sent as ``{"error": {"message", "type", "param", "code"}}`` (OpenAI's error shape).

It imports nothing of the engine (the router imports it); starlette is imported only when a response is built.
"""
from __future__ import annotations

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error", 409: "conflict_error", 413: "invalid_request_error",
                500: "internal_error", 503: "overloaded_error"}


class APIError(Exception):
    """An HTTP error answered as ``{"error": {"message", "type", "param", "code"}}``: ``status`` (the HTTP status; it
    picks ``type``), ``message``, the request field it is about (``param``), a machine-readable ``code`` and extra
    response ``headers`` (``Retry-After``, ``WWW-Authenticate``)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _ERROR_TYPES.get(self.status, "api_error"),
                          "param": self.param, "code": self.code}}

    def response(self):
        """The error as a starlette ``JSONResponse`` (its status and headers)."""
        from starlette.responses import JSONResponse

        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)
