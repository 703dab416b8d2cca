"""Flags the commands share (llama.cpp's names): sampling, penalties and draft-mtp, which
`generate`, `chat` and `serve` (as its defaults) all take, and `serve`'s own. Kept free of heavy
imports so that the command line parses fast."""
from __future__ import annotations


def positive_int(text: str) -> int:
    """argparse type: an integer > 0 (the flag's name is in argparse's message)."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, found {text!r}")
    return value


def add_sampling_flags(p) -> None:
    """Temperature, top-k/p, min-p, seed and llama.cpp's penalties."""
    p.add_argument("--temp", type=float, default=0.0, help="temperature (0 = greedy)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the K most likely tokens (0 = all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: smallest set with this probability "
                                                            "mass (1 = off)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below this fraction of the most likely "
                                                            "one's probability (0 = off)")
    p.add_argument("-s", "--seed", type=int, default=None, help="sampling seed (default: random)")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="subtracted once from a seen token's logit")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="subtracted per occurrence of a seen token")
    p.add_argument("--repeat-penalty", type=float, default=1.0, help="divides a seen token's logit (1 = off)")
    p.add_argument("--repeat-last-n", type=int, default=64, help="window of the penalties (0 off, -1 whole context)")


def add_spec_flags(p, n_max_type, spec_type: str) -> None:
    """--spec-type (default `spec_type`) and llama.cpp's draft knobs."""
    p.add_argument("--spec-type", default=spec_type,
                   help="none, draft-mtp (the model's MTP head drafts) or ngram (prompt lookup); default "
                        + spec_type + ("" if spec_type == "none" else ", none for a model without an MTP head"))
    p.add_argument("--spec-draft-n-max", type=n_max_type, default="auto",
                   help="drafts per round, or auto: chosen each round from measured costs")
    p.add_argument("--spec-draft-n-min", type=int, default=0, help="fewest drafts per round")
    p.add_argument("--spec-draft-p-min", type=float, default=0.0,
                   help="stop drafting when the draft's probability falls below this")


def sampling_kwargs(args) -> dict:
    """The `generate` keywords of the flags above."""
    return dict(spec=args.spec_type, n_max=args.spec_draft_n_max, n_min=args.spec_draft_n_min,
                p_min=args.spec_draft_p_min, temperature=args.temp, top_k=args.top_k, top_p=args.top_p,
                min_p=args.min_p, seed=args.seed, presence_penalty=args.presence_penalty,
                frequency_penalty=args.frequency_penalty, repeat_penalty=args.repeat_penalty,
                repeat_last_n=args.repeat_last_n)


def add_debug_flag(p) -> None:
    """`--debug`, on every command: an unexpected error shows its traceback instead of one line."""
    p.add_argument("--debug", action="store_true", help="show the Python traceback of an unexpected error")


def add_serve_parser(sub, n_max_type) -> None:
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (chat/completions, SSE) with a live page")
    s.add_argument("-m", "--model", help="GGUF file (default: the model in models/)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--port", type=int, default=8080, help="TCP port (0: any free port; the URL printed says which)")
    s.add_argument("-np", "--parallel", type=positive_int, default=1,
                   help="requests decoded together in one batched forward per step (llama-server's slots); "
                        "the MTP head drafts for all of them in one call and one verify checks them all")
    s.add_argument("--queue-size", type=int, default=64,
                   help="requests allowed to wait while one generates; more are answered 503")
    s.add_argument("--alias", default=None, help="model id reported by /v1/models (default: the file name)")
    s.add_argument("-c", "--ctx-size", dest="max_context", type=positive_int, default=None,
                   help="context length cap (default: the model's, up to 32768)")
    s.add_argument("-n", "--n-predict", dest="max_tokens", type=int, default=256,
                   help="max_tokens when a request gives none (capped by the context left)")
    add_sampling_flags(s)
    add_spec_flags(s, n_max_type, "draft-mtp")
    s.add_argument("--exact", action="store_true", help="keep Q6_K tensors in float32 (bit-exact weights)")
    add_debug_flag(s)
    s.add_argument("--cache-slots", type=positive_int, default=4,
                   help="prompts whose state is kept for a next request that starts with them (a chat's next "
                        "turn prefills only what is new); several interleaved conversations each keep theirs")
    s.add_argument("--cache-ram", type=positive_int, default=4096, metavar="MIB",
                   help="memory the kept prompt states may hold, in MiB (the least recently used go first)")
    s.add_argument("--idle-release", type=float, default=5.0,
                   help="seconds without requests after which MLX's cached buffers and the heap's free pages "
                        "are handed back, so memory returns after a burst (0: never)")
    s.add_argument("--metrics", action="store_true",
                   help="GET /metrics: Prometheus text (requests, tokens, latency histograms, queue depth, busy "
                        "slots, drafted and accepted tokens per position; behind --api-key when one is set)")
    s.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                   help="server log verbosity (stderr)")
    _value_or_file(s, "--chat-template", "JINJA", "the chat template for /v1/chat/completions, replacing the "
                   "model's (llama-server's flag)", "read from FILE (UTF-8)")
    s.add_argument("--header-timeout", type=float, default=10.0, metavar="S",
                   help="close a connection whose request headers are not in within S seconds")
    _value_or_file(s, "--api-key", "KEY", "require 'Authorization: Bearer KEY' on every route but the page and a "
                   "bare /health (401 otherwise)",
                   "the key read from the first line of FILE (not shown in ps)")


def _value_or_file(parser, flag: str, metavar: str, help: str, file_help: str) -> None:
    """`flag VALUE` or `flag-file FILE`, one of them at most."""
    g = parser.add_mutually_exclusive_group()
    g.add_argument(flag, default=None, metavar=metavar, help=help)
    g.add_argument(f"{flag}-file", default=None, metavar="FILE", help=f"as {flag}, {file_help}")
