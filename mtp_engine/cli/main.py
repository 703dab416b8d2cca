"""Command line: `mtp-engine generate ...` (llama.cpp's flag names where they exist)."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from ..errors import MTPEngineError
from ..load_progress import load_progress, show_kernel_notices
from .flags import add_debug_flag, add_sampling_flags, add_spec_flags, positive_int, sampling_kwargs
from .output import format_stats, model_label


class HelpFormatter(argparse.HelpFormatter):
    """Every flag's help line ends with its default. (argparse's ArgumentDefaultsHelpFormatter
    also prints "default: None" and "default: False", which say nothing, and repeats defaults a
    help text already states.)"""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        d = action.default
        if (not action.option_strings or "default" in text or d is None or d is False or d == []
                or d is argparse.SUPPRESS or isinstance(action, (argparse._HelpAction, argparse._VersionAction))):
            return text
        if isinstance(d, (list, tuple)):
            d = ",".join(str(x) for x in d)
        return f"{text} (default: {str(d).replace('%', '%%')})"


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

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
    add_ctx_size(g)
    add_sampling_flags(g)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    g.add_argument("--n-probs", dest="logprobs", type=int, default=None,
                   help="with --json: each token's logprob and this many alternatives (0..20)")
    add_spec_flags(g, _n_max, "none")
    con = g.add_mutually_exclusive_group()
    con.add_argument("-j", "--json-schema", default=None, metavar="SCHEMA",
                     help="constrain the output to JSON of this schema (JSON text; {} = any JSON object)")
    con.add_argument("--json-schema-file", default=None, metavar="FILE", help="the same, the schema read from FILE")
    con.add_argument("--grammar", default=None, help="constrain the output to a GBNF grammar (llama.cpp's; Lark too)")
    con.add_argument("--grammar-file", default=None, metavar="FILE", help="the same, the grammar read from FILE")
    g.add_argument("--exact", action="store_true", help="keep Q6_K tensors in float32 (bit-exact weights)")
    g.add_argument("--quantize", default=None, metavar="SPEC",
                   help="HF checkpoint folders: quantize while loading, e.g. 4, 8g32, 4g64,output=8g64,mtp=float")
    g.add_argument("--profile", nargs="?", const="precise", default=None, choices=["round", "precise"],
                   help="print a per-stage time table")
    g.add_argument("--profile-out", default=None, help="write the stage profile to FILE (.json or .csv)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    from ..distributed.cli import add_distributed_flags
    add_distributed_flags(g)
    add_debug_flag(g)


def add_ctx_size(p) -> None:
    """llama.cpp's -c/--ctx-size: the API's `max_context` (generate, bench and serve alike)."""
    p.add_argument("-c", "--ctx-size", dest="max_context", type=positive_int, default=None,
                   help="context length cap (default: the model's, up to 32768)")


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
    add_ctx_size(b)
    b.add_argument("--n-max", type=_ints, default=(0, 1, 2, 3, 4, 5, 6, "auto"),
                   help="comma-separated draft lengths to measure (integers and/or auto)")
    b.add_argument("--p-min", type=_floats, default=(0.0,), help="comma-separated p-min values to measure")
    b.add_argument("-n", "--n-predict", dest="tokens", type=int, default=128, help="tokens generated per prompt")
    b.add_argument("--repeats", type=int, default=3, help="timed runs per configuration (the median is reported)")
    b.add_argument("--prompts", help="a text file (prompts separated by blank-line-free '---' lines) or a JSON "
                                     "list of strings / {'prompts': [{'prompt': ...}]}")
    b.add_argument("--prompt-tokens", type=positive_int, default=None, metavar="N",
                   help="one synthetic prompt of N tokens (code text repeated) instead of the prompts: your model's "
                        "speeds and acceptance at a context of N (with -c when N passes the model's context)")
    b.add_argument("--out", default="bench-out", help="folder for bench.md/.csv/.json/.png")
    b.add_argument("--exact", action="store_true", help="keep Q6_K tensors in float32 (bit-exact weights)")
    add_debug_flag(b)


def _add_convert(sub) -> None:
    c = sub.add_parser("convert", help="HF checkpoint -> quantized MLX folder (mlx-lm layout, MTP kept) or GGUF")
    c.add_argument("src", help="HF checkpoint folder (config.json, safetensors, tokenizer files)")
    c.add_argument("out", help="output folder (or .gguf file with --gguf)")
    c.add_argument("--q-bits", type=int, default=None, choices=[4, 8], help="bits per weight (default 4)")
    c.add_argument("--q-group-size", type=int, default=None, choices=[32, 64, 128],
                   help="weights per scale (default 64)")
    c.add_argument("--q-output", default=None, metavar="BITS[gGROUP]|float", help="output head override")
    c.add_argument("--q-mtp", default=None, metavar="BITS[gGROUP]|float", help="MTP head override")
    c.add_argument("--q-scales", default=None, choices=["float32", "source"],
                   help="scale/bias dtype: float32 (default; equals --quantize on load) or the checkpoint's "
                        "(bf16, as mlx_lm.convert)")
    c.add_argument("--no-quantize", action="store_true", help="copy the float tensors unquantized")
    c.add_argument("--gguf", nargs="?", const="BF16", default=None, metavar="TYPE",
                   help="write one GGUF file instead: F32, F16, BF16 (default), Q8_0, Q4_0, Q4_1, Q5_0, Q5_1")
    c.add_argument("--force", action="store_true", help="overwrite an existing output")
    c.add_argument("--json", action="store_true", help="print the report as one JSON object")
    add_debug_flag(c)


def _convert(args) -> int:
    from dataclasses import asdict

    from ..convert import convert

    given = [f"--{k.replace('_', '-')}" for k in ("q_bits", "q_group_size", "q_output", "q_mtp", "q_scales")
             if getattr(args, k) is not None]
    if given and (args.gguf is not None or args.no_quantize):
        raise MTPEngineError(f"{' '.join(given)} set the MLX folder's quantization; they do not apply with "
                             f"{'--gguf (choose its TYPE)' if args.gguf is not None else '--no-quantize'}",
                             field="convert")
    spec = None
    if not args.no_quantize and args.gguf is None:
        spec = f"{args.q_bits or 4}g{args.q_group_size or 64}"
        if args.q_output:
            spec += f",output={args.q_output}"
        if args.q_mtp:
            spec += f",mtp={args.q_mtp}"

    from ..load_progress import load_progress

    # as a model's load: in place on a terminal, a line per tenth in a log, nothing for a quick one
    progress = load_progress(model_label(args.src), quiet=args.json, verb="converting", unit="tensors")
    report = convert(args.src, args.out, quantize=spec, gguf_type=args.gguf, overwrite=args.force,
                     scales=args.q_scales or "float32", progress=progress)
    if args.json:
        print(json.dumps(asdict(report)))
    else:
        print(f"wrote {report.out}: {report.tensors} tensors ({report.quantized} quantized, {report.mtp_tensors} "
              f"of the MTP head), {report.bytes_written / 2**20:.1f} MiB; peak memory "
              f"{report.peak_memory_bytes / 2**20:.1f} MiB")
    return 0


def _generate(args) -> int:
    from .. import api
    from ..text_input import argv_text, check_output_file, read_prompt_file

    if args.profile_out:  # before any work: a bad path would otherwise lose the whole generation
        check_output_file(args.profile_out, "--profile-out")
    prompt = None if args.prompt is None else argv_text(args.prompt, "prompt")
    args.stop = [argv_text(s, f"stop[{i}]") for i, s in enumerate(args.stop)]
    if args.file:
        prompt = read_prompt_file(args.file, "file")
    if prompt is None:
        raise MTPEngineError("no prompt: give -p TEXT or -f FILE", field="prompt")
    from ..distributed.cli import distributed_kwargs, quiet_rank
    show_kernel_notices(quiet=args.json)
    model = api.load(args.model, exact=args.exact, quantize=args.quantize, max_context=args.max_context,
                     progress=load_progress(model_label(args.model), quiet=args.json), **distributed_kwargs(args))
    from ..request.keywords import request_from_keywords
    from ..request.prepare import chat_template_note, prepare

    text = {"messages": [{"role": "user", "content": prompt}]} if args.chat else {"prompt": prompt}
    request = request_from_keywords(**text, max_tokens=args.max_tokens, stop=args.stop or None,
                                    ignore_eos=args.ignore_eos, profile=args.profile, logprobs=args.logprobs,
                                    constraint=_constraint(args), **sampling_kwargs(args),
                                    progress=load_progress("the prompt", quiet=args.json or quiet_rank(model),
                                                           verb="prefilling", unit="tokens", rate=True))
    note = chat_template_note(model) if args.chat else None
    if note and not quiet_rank(model):
        print(f"mtp-engine: {note}", file=sys.stderr)
    prepared = prepare(model, request)
    chunks = api.stream_request(prepared, model)
    if quiet_rank(model):  # every rank generates the same tokens; rank 0 alone prints
        for _ in chunks:
            pass
        return 0
    if args.json:
        r = api.GenerationResult.collect(chunks, prepared.prompt_ids, args.logprobs is not None)
        print(json.dumps(r.to_json(), ensure_ascii=False))
        _write_profile(r.stats, args.profile_out)
        return 0
    return _stream_out(chunks, args)


def _stream_out(chunks, args) -> int:
    last = None
    for chunk in chunks:
        if chunk.text:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        last = chunk
    sys.stdout.write("\n")
    print(format_stats(last.stats), file=sys.stderr)
    _write_profile(last.stats, args.profile_out)
    if "profile" in last.stats:
        from ..generation.profiler import format_report
        print(format_report(last.stats["profile"]), file=sys.stderr)
    return 0


def _constraint(args):
    """The Constraint of -j/--json-schema(-file) or --grammar(-file), or None."""
    from ..constraint import Constraint
    from ..text_input import read_prompt_file

    if args.json_schema is None and args.json_schema_file is None and args.grammar is None \
            and args.grammar_file is None:
        return None
    if args.grammar is not None or args.grammar_file is not None:
        text = args.grammar if args.grammar is not None else read_prompt_file(args.grammar_file, "grammar-file")
        return Constraint.gbnf(text)
    flag = "json-schema" if args.json_schema is not None else "json-schema-file"
    text = args.json_schema if args.json_schema is not None else read_prompt_file(args.json_schema_file, flag)
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise MTPEngineError(f"not JSON: {e.msg} at line {e.lineno} column {e.colno}", field=flag) from None
    if not isinstance(schema, dict):
        raise MTPEngineError(f"expected a JSON schema object, found {type(schema).__name__}", field=flag)
    return Constraint.json(schema or None)


def _write_profile(stats: dict, path: str | None) -> None:
    if not path or "profile" not in stats:
        return
    from ..generation.profiler import write_report
    write_report(stats["profile"], path)


def _load_prompts(path: str) -> list:
    from ..text_input import read_prompt_file

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
    if args.prompt_tokens and args.prompts:
        raise MTPEngineError("give --prompts or --prompt-tokens, not both", field="prompt-tokens")
    from ..speculative.config import DraftParams

    for k in args.n_max:  # every configuration's knobs, before the model loads
        for p in args.p_min:
            DraftParams(k, 0, p)
    if args.out:
        from ..text_input import check_output_dir

        check_output_dir(args.out, "--out")
    cfg = BenchConfig(model=args.model, n_max=args.n_max, p_min=args.p_min, tokens=args.tokens,
                      repeats=args.repeats, prompts=_load_prompts(args.prompts) if args.prompts else None,
                      out=args.out, exact=args.exact, max_context=args.max_context, prompt_tokens=args.prompt_tokens)
    result = run_bench(cfg, load_progress=load_progress(model_label(args.model)))
    from .bench_report import format_markdown
    print(format_markdown(result))
    print(f"wrote {args.out}/bench.md, bench.csv, bench.json, bench.png", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: generate, bench, convert, serve, chat."""
    from ..version import __version__

    parser = _Parser(prog="mtp-engine", description="MTP speculative decoding for Qwen3.5 GGUF models on MLX")
    parser.add_argument("--version", action="version", version=f"mtp-engine {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_generate(sub)
    _add_bench(sub)
    _add_convert(sub)
    from .flags import add_serve_parser
    add_serve_parser(sub, _n_max)
    from .chat import add_chat_parser
    add_chat_parser(sub, _n_max)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            if args.profile_out and not args.profile:
                args.profile = "precise"
            return _generate(args)
        if args.command == "bench":
            return _bench(args)
        if args.command == "convert":
            return _convert(args)
        if args.command == "serve":
            from .serve import run_serve
            return run_serve(args)
        if args.command == "chat":
            from .chat import run_chat
            return run_chat(args)
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
