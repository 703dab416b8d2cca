"""The engine's one error type for bad input (files, fields, arguments)."""
from __future__ import annotations


class MTPEngineError(ValueError):
    """Raised for any input the engine refuses: a malformed or unsupported model file,
    a missing key, an unexpected tensor shape or type, or an invalid generation argument.

    The message always names the file (when there is one), the field or tensor, and what was
    expected versus what was found.
    """

    def __init__(self, message: str, *, file: str | None = None, field: str | None = None):
        self.file = file
        self.field = field
        parts = []
        if file:
            parts.append(str(file))
        if field:
            parts.append(field)
        prefix = ": ".join(parts)
        super().__init__(f"{prefix}: {message}" if prefix else message)
