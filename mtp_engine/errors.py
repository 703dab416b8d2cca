"""The engine's one error type for bad input (files, fields, arguments), and the device running
out of memory said in its terms."""
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


# what MLX's allocators say when the device's memory runs out (CUDA, Metal, the CPU backend)
_OUT_OF_MEMORY = ("out of memory", "[metal::malloc]", "insufficient memory", "[malloc]")


def out_of_memory(e: BaseException, what: str) -> MTPEngineError | None:
    """`e` said as the engine's error when it is MLX reporting that the device's memory ran out
    while doing `what` (None for anything else): the memory estimate let through work that did
    not fit, and the caller gets what to change instead of an allocator's message."""
    text = str(e)
    if not isinstance(e, (RuntimeError, MemoryError)) or not any(m in text.lower() for m in _OUT_OF_MEMORY):
        return None
    err = MTPEngineError(f"the device ran out of memory {what} ({text.strip()[:200]}); a shorter prompt, fewer "
                         "streams at once, a smaller prefill chunk (MTP_ENGINE_PREFILL_CHUNK) or a 16-bit KV cache "
                         "(MTP_ENGINE_KV_DTYPE=float16) needs less", field="memory")
    err.__cause__ = e
    return err
