"""Errors that carry what the OpenAI error shape needs: a message, a param and a code."""

from __future__ import annotations


class ExpresslaneError(Exception):
    """Base class. `status` is the HTTP status the server maps it to."""

    status = 500
    type = "server_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidRequestError(ExpresslaneError, ValueError):
    status = 400
    type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequestError):
    def __init__(self, message: str, param: str | None = "input"):
        super().__init__(message, param=param, code="context_length_exceeded")


class ModelLoadError(ExpresslaneError, ValueError):
    """The model directory cannot be served (missing files, unsupported architecture)."""
