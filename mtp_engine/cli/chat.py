"""`mtp-engine chat`: a conversation in the terminal (llama-cli's conversation mode).

Each turn renders the whole conversation with the chat template and generates the answer,
streamed; a `PromptCache` makes the turn prefill only what is new since the last one. Lines that
start with "/" are commands (/help lists them). Ctrl-C stops an answer (what was written is kept
in the conversation), Ctrl-D or /exit ends the chat. Standard input that is not a terminal is read
line by line, one message per line, so a chat can be scripted.
"""
from __future__ import annotations

import sys
from typing import TextIO

from ..errors import MTPEngineError
from .flags import add_debug_flag, add_sampling_flags, add_spec_flags, positive_int, sampling_kwargs

MAX_LINE_CHARS = 1 << 22  # one message; a longer line is refused without being held in memory
HELP = ("/exit (or Ctrl-D) ends the chat, /reset starts over (the system prompt stays), /stats shows the "
        "last answer's statistics, /help this; Ctrl-C stops an answer")


def add_chat_parser(sub, n_max_type) -> None:
    c = sub.add_parser("chat", help="a conversation in the terminal (each turn prefills only what is new)")
    c.add_argument("-m", "--model", help="GGUF file or HF folder (default: the model in models/)")
    c.add_argument("-sys", "--system-prompt", default=None, help="the conversation's system message")
    c.add_argument("-n", "--n-predict", dest="max_tokens", type=positive_int, default=1024,
                   help="most tokens per answer (fewer when the context is nearly full)")
    c.add_argument("-c", "--ctx-size", dest="max_context", type=positive_int, default=None,
                   help="context length cap (default: the model's, up to 32768)")
    add_sampling_flags(c)
    add_spec_flags(c, n_max_type, "draft-mtp")
    c.add_argument("--exact", action="store_true", help="keep Q6_K tensors in float32 (bit-exact weights)")
    c.add_argument("--stats", action="store_true", help="print each answer's statistics line on stderr")
    add_debug_flag(c)


def run_chat(args, stdin: TextIO | None = None, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    from .. import api
    from ..generation.prompt_cache import PromptCache
    from ..load_progress import load_progress, show_kernel_notices
    from ..request.keywords import request_from_keywords
    from ..request.prepare import chat_template_note, prepare
    from ..text_input import check_text
    from .output import format_stats, model_label

    stdin, stdout, stderr = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
    if stdin is None:  # started with standard input closed (`<&-`): refuse before the model loads
        raise MTPEngineError("standard input is closed: chat reads the user's messages from it", field="stdin")
    show_kernel_notices()
    model = api.load(args.model, exact=args.exact, max_context=args.max_context,
                     progress=load_progress(model_label(args.model)))
    note = chat_template_note(model)
    if note:
        print(f"mtp-engine: {note}", file=stderr)
    kwargs = sampling_kwargs(args)
    if kwargs["spec"] == "draft-mtp" and model.model.mtp is None:
        kwargs["spec"] = "none"
        print(f"mtp-engine: {model.path} has no MTP head: chatting with spec-type none", file=stderr)
    system = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
    if args.system_prompt:
        check_text(args.system_prompt, "system-prompt")
    messages = list(system)
    cache = PromptCache(slots=2)  # the last prompt's state and, ahead of the next turn, the answer's
    tty = stdin.isatty()
    last_stats: dict | None = None
    print(f"mtp-engine: chatting with {model_label(args.model)}; {HELP}", file=stderr)
    while True:
        text = _read_message(stdin, stdout, stderr, tty)
        if text is None:
            return 0
        command = text.strip()
        if not command:
            continue
        if command.startswith("/"):
            if command in ("/exit", "/quit"):
                return 0
            if command == "/reset":
                messages = list(system)
            _command(command, last_stats, stderr)
            continue
        try:
            check_text(text, "message")
            turn = request_from_keywords(messages=messages + [{"role": "user", "content": text}],
                                         max_tokens=args.max_tokens, fit_context=True, prompt_cache=cache, **kwargs)
            prepared = prepare(model, turn)
        except MTPEngineError as e:
            hint = "; /reset starts over" if "context" in str(e) else ""
            print(f"mtp-engine: error: {e}{hint}", file=stderr)
            continue
        messages.append({"role": "user", "content": text})
        answer, last_stats = _answer(api.stream_request(prepared, model), stdout, last_stats)
        messages.append({"role": "assistant", "content": answer})
        if args.stats and last_stats:
            print(format_stats(last_stats), file=stderr)
        _keep_answer(model, messages, cache, kwargs)


def _read_message(stdin: TextIO, stdout: TextIO, stderr: TextIO, tty: bool) -> str | None:
    """The user's next line (without its newline; "" for one to skip), None at the end of input.
    A line longer than MAX_LINE_CHARS is read to its end and dropped: bounded memory."""
    if tty:
        stdout.write("> ")
        stdout.flush()
    line = stdin.readline(MAX_LINE_CHARS + 1)
    if not line:  # end of input (Ctrl-D)
        if tty:
            stdout.write("\n")
        return None
    if len(line) > MAX_LINE_CHARS and not line.endswith("\n"):
        while (rest := stdin.readline(MAX_LINE_CHARS)) and not rest.endswith("\n"):
            pass
        print(f"mtp-engine: error: message: longer than {MAX_LINE_CHARS} characters", file=stderr)
        return ""
    return line.rstrip("\n")


def _command(command: str, last_stats: dict | None, stderr: TextIO) -> None:
    """Says what a slash command other than /exit did (/reset's reset is the caller's)."""
    from .output import format_stats

    if command == "/reset":
        print("mtp-engine: the conversation starts over", file=stderr)
    elif command == "/stats" and last_stats:
        print(format_stats(last_stats), file=stderr)
    elif command == "/stats":
        print("mtp-engine: no answer yet", file=stderr)
    elif command in ("/help", "/?"):
        print(f"mtp-engine: {HELP}", file=stderr)
    else:
        print(f"mtp-engine: unknown command {command.split()[0]!r}: {HELP}", file=stderr)


def _answer(gen, stdout: TextIO, last_stats: dict | None) -> tuple[str, dict | None]:
    """Writes a streamed answer as it comes (Ctrl-C stops it, keeping what came); returns its text
    and the finished generation's stats (the previous ones when it was stopped first)."""
    answer: list[str] = []
    try:
        for chunk in gen:
            if chunk.text:
                answer.append(chunk.text)
                stdout.write(chunk.text)
                stdout.flush()
            if chunk.finish_reason is not None:
                last_stats = chunk.stats
    except KeyboardInterrupt:
        stdout.write(" [stopped]")
    finally:
        gen.close()
    stdout.write("\n")
    stdout.flush()
    return "".join(answer), last_stats


def _keep_answer(model, messages: list[dict], cache, kwargs: dict) -> None:
    """Prefills the answer just given (from the kept prompt state: only its own tokens) and keeps
    the state after it, while the user reads and types: the next turn then prefills only its new
    message. Its one generated token is dropped. A template that renders the history differently
    next turn finds the prompt's state, still kept, instead."""
    from .. import api
    from ..request.prepare import history_ids

    try:
        ids = history_ids(model, messages)
        if len(ids) + 1 > model.model.cfg.context_length:
            return
        # a fixed n-max: this one-round run must not feed n-max auto's stored costs
        for _ in api.stream_generate(ids, model, max_tokens=1, prompt_cache=cache,
                                     **{**kwargs, "n_max": 1, "n_min": 0, "p_min": 0.0}):
            pass
    except MTPEngineError:
        pass  # nothing kept: the next turn prefills what the kept prompt state lacks
