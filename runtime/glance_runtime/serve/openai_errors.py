"""Errors as OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}}."""
from __future__ import annotations

from typing import Any


class RequestError(Exception):
    """A request the server refuses, with the HTTP status and OpenAI error fields to answer it with."""

    def __init__(self, message: str, status: int = 400, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.type = message, status, param, code, type
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
