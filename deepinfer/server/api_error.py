"""The error every endpoint answers with: an OpenAI-style body that names the offending field::

    {"error": {"message": "max_tokens: must be an integer >= 1, got -3",
               "type": "invalid_request_error", "param": "max_tokens", "code": null}}
"""

from __future__ import annotations

from ..errors import RequestError


class APIError(Exception):
    """An error answered with an OpenAI-style body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    @classmethod
    def from_request_error(cls, e: RequestError, rename: dict[str, str] | None = None) -> APIError:
        name = (rename or {}).get(e.field, e.field)
        return cls(e.status, f"{name}: {e.message}", param=name)


def bad(param: str | None, message: str) -> APIError:
    return APIError(400, f"{param}: {message}" if param else message, param=param)
