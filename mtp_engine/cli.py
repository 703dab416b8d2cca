"""Command line: `mtp-engine generate ...` (llama.cpp's flag names where they exist)."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from .errors import MTPEngineError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, no usage dump
        print(f"mtp-engine: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def _add_generate(sub) -> None:
    g = sub.add_parser("generate", help="generate text from a prompt")
    g.add_argument("-m", "--model", help="GGUF file (default: the model in models/)")
    src = g.add_mutually_exclusive_group()
    src.add_argument("-p", "--prompt", help="prompt text")
    src.add_argument("-f", "--file", help="read the prompt from this file (UTF-8, at most 16 MiB; - reads standard input)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    g.add_argument("-n", "--n-predict", dest="max_tokens", type=int, default=256, help="tokens to generate")
    g.add_argument("--temp", type=float, default=0.0, help="temperature (0 = greedy)")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("-s", "--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--spec-type", default="none", help="none or draft-mtp")
    g.add_argument("--spec-draft-n-max", type=_n_max, default="auto",
                   help="drafts per round, or auto (default): chosen each round from measured costs")
    g.add_argument("--spec-draft-n-min", type=int, default=0)
    g.add_argument("--spec-draft-p-min", type=float, default=0.0)
    g.add_argument("--exact", action="store_true", help="keep Q6_K tensors in float32 (bit-exact weights)")
    g.add_argument("--profile", nargs="?", const="precise", default=None, choices=["round", "precise"],
                   help="print a per-stage time table")
    g.add_argument("--profile-out", default=None, help="write the stage profile to FILE (.json or .csv)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    _add_debug(g)


def _add_debug(p) -> None:
    p.add_argument("--debug", action="store_true", help="show the Python traceback of an unexpected error")


def _n_max(text: str):
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or auto, found {text!r}") from None


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, found {text!r}") from None


def _ints(text: str) -> tuple:
    """Comma-separated n-max values: integers and/or auto."""
    try:
        return tuple(x.strip() if x.strip() == "auto" else int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers or auto, found {text!r}") from None


def _add_bench(sub) -> None:
    b = sub.add_parser("bench", help="plain decoding vs draft-mtp at each n-max / p-min, with a stage breakdown")
    b.add_argument("-m", "--model", help="GGUF file (default: the model in models/)")
    b.add_argument("--n-max", type=_ints, default=(0, 1, 2, 3, 4, 5, 6, "auto"))
    b.add_argument("--p-min", type=_floats, default=(0.0,))
    b.add_argument("-n", "--n-predict", dest="tokens", type=int, default=128)
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--prompts", help="a text file (prompts separated by blank-line-free '---' lines) or a JSON "
                                     "list of strings / {'prompts': [{'prompt': ...}]}")
    b.add_argument("--out", default="bench-out", help="folder for bench.md/.csv/.json/.png")
    b.add_argument("--exact", action="store_true")
    _add_debug(b)


def _generate(args) -> int:
    from . import api

    from .text_input import argv_text, check_output_file, read_prompt_file

    if args.profile_out:  # before any work: a bad path would otherwise lose the whole generation
        check_output_file(args.profile_out, "--profile-out")
    prompt = None if args.prompt is None else argv_text(args.prompt, "prompt")
    args.stop = [argv_text(s, f"stop[{i}]") for i, s in enumerate(args.stop)]
    if args.file:
        prompt = read_prompt_file(args.file, "file")
    if prompt is None:
        raise MTPEngineError("no prompt: give -p TEXT or -f FILE", field="prompt")
    model = api.load(args.model, exact=args.exact)
    kwargs = dict(max_tokens=args.max_tokens, spec=args.spec_type, n_max=args.spec_draft_n_max,
                  n_min=args.spec_draft_n_min, p_min=args.spec_draft_p_min, temperature=args.temp,
                  top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed, stop=args.stop or None,
                  ignore_eos=args.ignore_eos, profile=args.profile)
    if args.chat:
        kwargs["messages"] = [{"role": "user", "content": prompt}]
    else:
        kwargs["prompt"] = prompt
    if args.json:
        r = api.generate(model=model, **kwargs)
        print(json.dumps(r.to_json(), ensure_ascii=False))
        _write_profile(r.stats, args.profile_out)
        return 0
    last = None
    for chunk in api.stream_generate(model=model, **kwargs):
        if chunk.text:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        last = chunk
    sys.stdout.write("\n")
    print(format_stats(last.stats), file=sys.stderr)
    _write_profile(last.stats, args.profile_out)
    if "profile" in last.stats:
        from .profiler import format_report
        print(format_report(last.stats["profile"]), file=sys.stderr)
    return 0


def _write_profile(stats: dict, path: str | None) -> None:
    if not path or "profile" not in stats:
        return
    from .profiler import write_report
    write_report(stats["profile"], path)


def _load_prompts(path: str) -> list:
    from .text_input import read_prompt_file

    text = read_prompt_file(path, "prompts")
    if path.endswith(".json"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise MTPEngineError(f"invalid JSON: {e}", file=path) from None
        if isinstance(data, dict):
            data = data.get("prompts", [])
        prompts = [d.get("token_ids") or d.get("prompt") if isinstance(d, dict) else d for d in data]
    else:
        prompts = [p.strip("\n") for p in text.split("\n---\n")]
    prompts = [p for p in prompts if p]
    if not prompts:
        raise MTPEngineError("no prompts found", file=path)
    return prompts


def _bench(args) -> int:
    from .bench import BenchConfig, run_bench

    if args.tokens < 2 or args.repeats < 1:
        raise MTPEngineError("expected -n >= 2 and --repeats >= 1", field="bench")
    if any(k != "auto" and k < 0 for k in args.n_max):
        raise MTPEngineError(f"expected n-max values >= 0, found {args.n_max}", field="n-max")
    if args.out:
        from .text_input import check_output_dir

        check_output_dir(args.out, "--out")
    cfg = BenchConfig(model=args.model, n_max=args.n_max, p_min=args.p_min, tokens=args.tokens,
                      repeats=args.repeats, prompts=_load_prompts(args.prompts) if args.prompts else None,
                      out=args.out, exact=args.exact)
    result = run_bench(cfg)
    from .bench import format_markdown
    print(format_markdown(result))
    print(f"wrote {args.out}/bench.md, bench.csv, bench.json, bench.png", file=sys.stderr)
    return 0


def format_stats(s: dict) -> str:
    line = (f"prompt: {s['prompt_tokens']} tok, {s['prompt_tokens_per_second']:.1f} tok/s | "
            f"decode: {s['generated_tokens']} tok, {s['decode_tokens_per_second']:.1f} tok/s | "
            f"peak memory: {s['peak_memory_bytes'] / 2**20:.1f} MiB")
    if "rounds" in s:
        line += (f" | draft-mtp: {s['accepted']}/{s['drafted']} accepted ({s['acceptance_rate']:.1%}), "
                 f"{s['tokens_per_round']:.2f} tok/round")
    return line


def main(argv: Sequence[str] | None = None) -> int:
    parser = _Parser(prog="mtp-engine", description="MTP speculative decoding for Qwen3.5 GGUF models on MLX")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_generate(sub)
    _add_bench(sub)
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            if args.profile_out and not args.profile:
                args.profile = "precise"
            return _generate(args)
        if args.command == "bench":
            return _bench(args)
    except MTPEngineError as e:
        msg = str(e).replace("\r", "\\r").replace("\n", "\\n")  # always one line
        print(f"mtp-engine: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # a bug or an unforeseen input: one line, never a traceback (unless --debug)
        if getattr(args, "debug", False):
            raise
        msg = f"{type(e).__name__}: {e}".replace("\r", "\\r").replace("\n", "\\n")
        msg = msg if len(msg) <= 500 else msg[:500] + "..."
        print(f"mtp-engine: error: unexpected {msg} (rerun with --debug for the traceback)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
