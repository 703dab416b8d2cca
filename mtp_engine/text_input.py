"""Checks for text coming in from users: prompts, stop strings, chat messages, prompt files,
command-line bytes, and the paths results will be written to.

Policy for text that is not valid Unicode (see docs/reliability.md, "Text input"): it is
**refused**, never silently replaced, with `MTPEngineError` naming the argument and where:

* a Python `str` holding a lone surrogate (U+D800..U+DFFF, e.g. from `json.loads('"\\ud800"')`)
  is refused naming the argument and the character index;
* bytes that are not UTF-8 (a prompt file, standard input, a command-line argument) are refused
  naming the argument (or file) and the byte offset.

llama.cpp replaces invalid UTF-8 with U+FFFD while tokenizing, so the model sees a prompt the
user did not write, without being told; transformers (through `tokenizers`) refuses a lone
surrogate with a `TypeError` from the backend, and Python refuses undecodable files by default.
A prompt that means something else than what was sent is worse than an error that says which
byte is wrong, and a caller that wants replacement can do it explicitly in one call
(`data.decode("utf-8", "replace")`).

These functions are what any entry point (API, CLI, server request bodies) calls.
"""
from __future__ import annotations

import os
import stat
import sys
import tempfile
from typing import Any, BinaryIO

from .errors import MTPEngineError

__all__ = ["check_text", "decode_utf8", "argv_text", "check_stop", "check_messages", "read_prompt_file",
           "check_output_file", "check_output_dir", "MAX_PROMPT_FILE_BYTES"]

# A prompt file larger than this is refused before it is decoded or tokenized: 16 MiB is ~4M tokens of
# English, 15x the longest context of the Qwen3.5 family (262,144 positions).
MAX_PROMPT_FILE_BYTES = 16 << 20


def _show_char(ch: str) -> str:
    return f"U+{ord(ch):04X}"


def check_text(value: Any, field: str) -> str:
    """`value` if it is a `str` of valid Unicode (no lone surrogate); else MTPEngineError naming
    `field` and, for a surrogate, its index."""
    if not isinstance(value, str):
        raise MTPEngineError(f"expected a string, found {type(value).__name__}", field=field)
    if value.isascii():
        return value
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise MTPEngineError(
            f"lone surrogate {_show_char(value[e.start])} at index {e.start}: text must be valid Unicode "
            "(surrogates are only valid in pairs in UTF-16, never in a str)", field=field) from None
    return value


def decode_utf8(data: bytes, field: str, *, file: str | None = None) -> str:
    """`data` decoded as UTF-8 (a leading byte-order mark is kept as U+FEFF, as Python and
    llama.cpp do); MTPEngineError naming the first bad byte and its offset otherwise."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        bad = data[e.start:e.end]
        raise MTPEngineError(
            f"not valid UTF-8: byte{'s' if len(bad) > 1 else ''} {bad.hex(' ')} at byte offset {e.start} "
            f"({e.reason})", file=file, field=field) from None


def argv_text(value: str, field: str) -> str:
    """A command-line argument as text. Python decodes argv with `surrogateescape`, so bytes that
    are not UTF-8 arrive as surrogates U+DC80..U+DCFF: turn those back into bytes to report the
    byte offset the user can find."""
    if value.isascii():
        return value
    try:
        raw = os.fsencode(value)
    except UnicodeEncodeError:
        return check_text(value, field)
    return decode_utf8(raw, field)


# every generated token is checked against every stop string: bounded, so that a request cannot
# multiply the decode time (200k stops once made a 128-token generation take 21 s instead of 3)
MAX_STOPS = 64
MAX_STOP_CHARS = 1000


def check_stop(stop: Any, field: str = "stop") -> list[str]:
    """`stop` as a list of strings: None, one string, or a list/tuple of strings, each valid
    Unicode (an empty string is allowed and never matches); at most MAX_STOPS of at most
    MAX_STOP_CHARS characters each."""
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if isinstance(stop, (list, tuple)):
        if len(stop) > MAX_STOPS:
            raise MTPEngineError(f"{len(stop)} stop strings: at most {MAX_STOPS}", field=field)
        for i, s in enumerate(stop):
            if not isinstance(s, str):
                raise MTPEngineError(f"stop[{i}]: expected a string, found {type(s).__name__} {s!r:.40}",
                                     field=field)
            check_text(s, f"{field}[{i}]")
            if len(s) > MAX_STOP_CHARS:
                raise MTPEngineError(f"stop[{i}] is {len(s)} characters long: at most {MAX_STOP_CHARS}", field=field)
        return list(stop)
    raise MTPEngineError(f"expected a string or a list of strings, found {type(stop).__name__}", field=field)


def check_messages(messages: Any, field: str = "messages") -> None:
    """A chat is a non-empty list of dicts whose `role` and `content` are strings of valid
    Unicode (other keys, such as tool calls, pass through to the template, whose output is
    checked in turn)."""
    if not isinstance(messages, (list, tuple)):
        raise MTPEngineError(f"expected a list of {{'role': str, 'content': str}} dicts, found "
                             f"{type(messages).__name__}", field=field)
    if not messages:
        raise MTPEngineError("expected at least one message, found an empty list", field=field)
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise MTPEngineError(f"messages[{i}]: expected a dict with 'role' and 'content', found "
                                 f"{type(msg).__name__}", field=field)
        for key in ("role", "content"):
            if not isinstance(msg.get(key), str):
                what = "missing" if key not in msg else f"{type(msg[key]).__name__}"
                raise MTPEngineError(f"messages[{i}].{key}: expected a string, found {what}", field=field)
            check_text(msg[key], f"{field}[{i}].{key}")


def _read_limited(f: BinaryIO, limit: int, name: str, field: str) -> bytes:
    data = f.read(limit + 1)  # one byte more than allowed tells "too large" without reading it all
    if len(data) > limit:
        raise MTPEngineError(f"the prompt is larger than the limit of {limit} bytes ({limit >> 20} MiB)",
                             file=name, field=field)
    return data


def read_prompt_file(path: str, field: str = "file", *, limit: int = MAX_PROMPT_FILE_BYTES,
                     stdin: BinaryIO | None = None) -> str:
    """The text of prompt file `path` ("-": standard input), at most `limit` bytes of UTF-8;
    MTPEngineError naming the file and the problem otherwise (missing, a directory, too large,
    not UTF-8 with the byte offset)."""
    if path == "-":
        src = stdin if stdin is not None else getattr(sys.stdin, "buffer", None)
        if src is None:  # started with standard input closed (`<&-`)
            raise MTPEngineError("standard input is closed: nothing to read the prompt from", file="<stdin>",
                                 field=field)
        return decode_utf8(_read_limited(src, limit, "<stdin>", field), field, file="<stdin>")
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise MTPEngineError(f"cannot read prompt file: {e.strerror or e}", file=path, field=field) from None
    if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
        # a FIFO nobody writes to would block forever (a pipe is read with "-")
        raise MTPEngineError("not a regular file (a FIFO, socket or device): pipe it to '-f -' instead",
                             file=path, field=field)
    try:
        with open(path, "rb") as f:  # a directory fails here (IsADirectoryError)
            data = _read_limited(f, limit, path, field)
    except OSError as e:
        raise MTPEngineError(f"cannot read prompt file: {e.strerror or e}", file=path, field=field) from None
    return decode_utf8(data, field, file=path)


def _writable_dir(d: str, path: str, field: str) -> None:
    if not os.path.isdir(d):
        raise MTPEngineError(f"cannot write here: the folder {d!r} does not exist", file=path, field=field)
    if not os.access(d, os.W_OK | os.X_OK):
        raise MTPEngineError(f"cannot write here: the folder {d!r} is not writable", file=path, field=field)


def check_output_file(path: str, field: str) -> None:
    """Refuses, before any work, an output file that could not be written: a directory, a file
    in a missing or read-only folder, or an existing read-only file."""
    if os.path.isdir(path):
        raise MTPEngineError("expected a file path, found a directory", file=path, field=field)
    if os.path.exists(path):
        if not os.access(path, os.W_OK):
            raise MTPEngineError("cannot write here: the file is not writable", file=path, field=field)
        return
    _writable_dir(os.path.dirname(os.path.abspath(path)), path, field)
    _probe(os.path.dirname(os.path.abspath(path)), path, field)


def check_output_dir(path: str, field: str) -> None:
    """Refuses, before any work, an output folder that could not be created or written: an
    existing file, or a folder whose nearest existing parent is not a writable folder."""
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise MTPEngineError("expected a folder, found a file", file=path, field=field)
        if not os.access(path, os.W_OK | os.X_OK):
            raise MTPEngineError("cannot write here: the folder is not writable", file=path, field=field)
        _probe(path, path, field)
        return
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent) and parent != os.path.dirname(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise MTPEngineError(f"cannot create the folder: {parent!r} is not a folder", file=path, field=field)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise MTPEngineError(f"cannot create the folder: {parent!r} is not writable", file=path, field=field)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise MTPEngineError(f"cannot create the folder: {e.strerror or e}", file=path, field=field) from None
    _probe(path, path, field)


def _probe(folder: str, path: str, field: str) -> None:
    """Permissions do not say everything (root passes every check; /proc, full or read-only mounts
    refuse anyway): a file is written and removed, before the work whose results it will hold."""
    try:
        with tempfile.TemporaryFile(dir=folder) as f:
            f.write(b"x")
    except OSError as e:
        raise MTPEngineError(f"cannot write here: {e.strerror or e}", file=path, field=field) from None
