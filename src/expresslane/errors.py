"""Errors that carry what the OpenAI error shape needs: a message, a param and a code.

A message that names request fields names them as data: written as a template whose
``{field}`` placeholders are the fields (in the engine's names, e.g. ``{max_tokens}``) and
whose other placeholders are the `values` given, so that `text(names)` can say each API's
own name for a field (server/fields.py) without touching the rest of the text."""

from __future__ import annotations

from string import Formatter


class ExpresslaneError(Exception):
    """Base class. `status` is the HTTP status the server maps it to."""

    status = 500
    type = "server_error"

    def __init__(
        self,
        message: str,
        param: str | None = None,
        code: str | None = None,
        values: dict | None = None,
    ):
        """`message` is plain text, or with `values` (possibly empty) a template (above)."""
        self.template = message if values is not None else None
        self.values = dict(values or {})
        self.param = param
        self.code = code
        self.message = message
        self.message = self.text()
        super().__init__(self.message)

    @property
    def fields(self) -> list[str]:
        """The request fields the message names (engine names)."""
        if self.template is None:
            return []
        parsed = Formatter().parse(self.template)
        return [f for _, f, _, _ in parsed if f and f not in self.values]

    def text(self, names: dict[str, str] | None = None) -> str:
        """The message, each field it names renamed by `names` (engine name -> API name)."""
        if self.template is None:
            return self.message
        names = names or {}
        fields = {f: names.get(f, f) for f in self.fields}
        return self.template.format_map({**fields, **self.values})


class InvalidRequestError(ExpresslaneError, ValueError):
    status = 400
    type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequestError):
    def __init__(self, message: str, param: str | None = "input", values: dict | None = None):
        super().__init__(message, param=param, code="context_length_exceeded", values=values)


class ModelLoadError(ExpresslaneError, ValueError):
    """The model directory cannot be served (missing files, unsupported architecture)."""
