"""Fuzzing chat-template rendering: templates built at random from Jinja fragments (loops,
filters, attribute access, string arithmetic, macros, captures, sandbox escapes) go through
`compile_chat_template` + `render_chat_template` with the default `RenderLimits`.

Each case runs in a supervised worker process: a worker that dies is a crash, no answer within
--timeout seconds is a hang. Outcomes: `rendered` (a string), `clean_error` (MTPEngineError),
`unexpected` (anything else), `crash`, `hang`. Case i is a pure function of (--seed, i):
`--show I` prints its template.

    python scripts/fuzz/fuzz_chat_template.py --cases 5000 --seed 1 --json fuzz-templates.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections import Counter
from pathlib import Path

from fuzz_gguf import Worker, peak_rss, peak_rss_reset  # the fuzzers' shared worker supervision

ROOT = Path(__file__).resolve().parents[2]

FAILURES = ("unexpected", "crash", "hang")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi, who are you?"},
            {"role": "assistant", "content": "<think>\nhm\n</think>\n\nA model."},
            {"role": "user", "content": "Write 'x' * 3 — naïve 漢字 🙂"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]

_NUMBERS = ["0", "1", "3", "7", "-1", "100", "4096", "100000", "1000000", "10**9", "3000000000", "2**63", "10**18"]
_STRINGS = ["'a'", "'x'", "''", "'ab\\n'", "'{}'", "'{:>9999999999}'", "'%s'", "'%9999999999d'", "'\\t'", "'é漢'",
            "'<|im_start|>'", "'\\ud800'", "'{0.__class__}'", "'%(a)s'"]
_VARS = ["messages", "messages[0]", "messages[-1].content", "messages[0]['role']", "ns.v", "x", "loop.index",
         "tools", "add_generation_prompt", "bos_token", "eos_token", "undefined_name", "messages|length"]
_ATTRS = ["__class__", "__globals__", "__init__", "__mro__", "__subclasses__", "mro", "__dict__", "content",
          "role", "items", "keys", "values", "upper", "split", "format", "__getitem__", "gi_frame", "func_globals"]
_FILTERS = ["join", "join(', ')", "center({n})", "indent({n})", "indent({n}, true)", "replace('a', {s})",
            "format({s})", "batch({n})", "slice({n})", "tojson", "tojson(indent={n})", "list", "sort", "reverse",
            "unique", "map('upper')", "map(attribute='content')", "selectattr('role')", "sum", "length", "string",
            "int", "float", "first", "last", "trim", "title", "wordwrap({n})", "truncate({n})", "wordcount",
            "default({s})", "items", "dictsort", "attr({s})", "safe", "e", "urlencode", "pprint", "filesizeformat",
            "round({n})", "abs", "random", "groupby('role')", "min", "max", "xmlattr", "striptags"]
_METHODS = ["ljust({n})", "rjust({n})", "center({n})", "zfill({n})", "expandtabs({n})", "format({e})",
            "format_map({e})", "replace({s}, {s})", "join({e})", "split({s})", "splitlines()", "startswith({s})",
            "strip()", "upper()", "encode()", "count({s})", "find({s})", "partition({s})", "__len__()",
            "get({s})", "items()", "pop()", "append({e})", "update({e})", "clear()"]
_BINOPS = ["*", "+", "~", "%", "**", "//", "/", "-", "in", "==", "and", "or"]


class _Gen:
    def __init__(self, rng: random.Random):
        self.r = rng

    def num(self) -> str:
        return self.r.choice(_NUMBERS)

    def string(self) -> str:
        return self.r.choice(_STRINGS)

    def expr(self, depth: int = 0) -> str:
        r = self.r
        k = r.randrange(10 if depth < 3 else 4)
        if k == 0:
            return self.num()
        if k == 1:
            return self.string()
        if k in (2, 3):
            return r.choice(_VARS)
        if k == 4:
            return f"({self.expr(depth + 1)} {r.choice(_BINOPS)} {self.expr(depth + 1)})"
        if k == 5:
            f = r.choice(_FILTERS).format(n=self.num(), s=self.string())
            return f"({self.expr(depth + 1)}|{f})"
        if k == 6:
            m = r.choice(_METHODS).format(n=self.num(), s=self.string(), e=self.expr(depth + 1))
            return f"{self.expr(depth + 1)}.{m}"
        if k == 7:
            return f"{self.expr(depth + 1)}.{r.choice(_ATTRS)}"
        if k == 8:
            return f"range({self.num()})"
        return f"[{', '.join(self.expr(depth + 1) for _ in range(r.randrange(4)))}]"

    def stmt(self, depth: int = 0) -> str:
        r = self.r
        k = r.randrange(12 if depth < 3 else 3)
        if k == 0:
            return "{{ " + self.expr() + " }}"
        if k == 1:
            return r.choice(["x", "<|im_start|>user\n", "\n", "{{- '' -}}"])
        if k == 2:
            return "{% set ns.v = " + self.expr() + " %}"
        if k == 3:
            return "{% for x in " + self.expr() + " %}" + self.body(depth + 1) + "{% endfor %}"
        if k == 4:
            return "{% for x in " + self.expr() + " recursive %}" + self.body(depth + 1) + \
                   r.choice(["{{ loop(x) }}", "{{ loop([x, x]) }}", ""]) + "{% endfor %}"
        if k == 5:
            return "{% if " + self.expr() + " %}" + self.body(depth + 1) + "{% else %}" + self.body(depth + 1) + \
                   "{% endif %}"
        if k == 6:
            return "{% set x %}" + self.body(depth + 1) + "{% endset %}{{ x }}"
        if k == 7:
            return ("{% macro f(n) %}" + self.body(depth + 1) +
                    r.choice(["{{ f(n) }}", "{{ f(n - 1) }}{{ f(n - 1) }}", "", "{% if n > 0 %}{{ f(n-1) }}{% endif %}"])
                    + "{% endmacro %}{{ f(" + self.num() + ") }}")
        if k == 8:
            return r.choice(["{% include 'x' %}", "{% import 'x' as y %}", "{% extends 'base' %}",
                             "{{ raise_exception('no') }}", "{% break %}", "{{ strftime_now('%Y') }}",
                             "{{ cycler(1, 2).next() }}", "{{ joiner()() }}", "{{ lipsum(5) }}",
                             "{{ namespace(a=1).a }}", "{{ dict(a=1) }}"])
        if k == 9:
            return "{% filter upper %}" + self.body(depth + 1) + "{% endfilter %}"
        if k == 10:
            return "{% set ns.v = ns.v " + r.choice(["~", "+", "*"]) + " " + r.choice(["ns.v", "'ab'", "2"]) + " %}"
        return "{{ " + self.expr() + " }}"

    def body(self, depth: int = 0) -> str:
        return "".join(self.stmt(depth) for _ in range(self.r.randrange(1, 4)))


def make_template(seed: int, i: int) -> str:
    """Case i of the run with `seed`: a namespace, then 1-5 random statements."""
    g = _Gen(random.Random(f"{seed}:{i}"))
    return "{% set ns = namespace(v='ab') %}" + "".join(g.stmt() for _ in range(g.r.randrange(1, 6)))


def run_case(source: str, limits=None) -> dict:
    """Compiles and renders `source`; returns {"outcome": ...}."""
    from mtp_engine.chat.template import compile_chat_template, render_chat_template
    from mtp_engine.errors import MTPEngineError

    field = "tokenizer.chat_template"
    try:
        t = compile_chat_template(source, file="fuzz.gguf", field=field)
        out = render_chat_template(t, MESSAGES, True, {"tools": TOOLS, "bos_token": "", "eos_token": "<|im_end|>"},
                                   file="fuzz.gguf", field=field, limits=limits)
        if not isinstance(out, str):
            return {"outcome": "unexpected", "detail": f"rendered a {type(out).__name__}"}
        return {"outcome": "rendered", "chars": len(out)}
    except MTPEngineError as e:
        if field not in str(e):
            return {"outcome": "unexpected", "detail": f"error without the field: {e}"[:300]}
        return {"outcome": "clean_error", "kind": _error_kind(str(e)), "detail": str(e)[:200]}
    except BaseException as e:  # noqa: BLE001 - every other kind is a finding
        return {"outcome": "unexpected", "detail": f"{type(e).__name__}: {e}"[:300]}


def _error_kind(message: str) -> str:
    """A clean error's class, for the report: which limit or which failure stopped the template."""
    for needle, kind in (("loop iterations", "budget: steps"), ("characters of output", "budget: output"),
                         ("would build", "budget: value size"), ("took longer", "budget: time"),
                         ("refused the input", "raise_exception"), ("invalid chat template", "compile error"),
                         ("recursion too deep", "recursion")):
        if needle in message:
            return kind
    tail = message.split("chat template failed: ", 1)[-1]
    return "render error: " + (tail.split(":")[0] if tail[:1].isupper() and ":" in tail[:40] else "jinja")


def worker_main() -> None:
    import resource

    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    try:  # a runaway allocation fails in the worker (as a crash), not on the host
        resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))
    except (ValueError, OSError):
        pass
    import mtp_engine.chat.template  # noqa: F401
    import jinja2.sandbox  # noqa: F401
    proto.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        req = json.loads(line)
        peak_rss_reset()
        t0 = time.perf_counter()
        out = run_case(make_template(req["seed"], req["i"]))
        out["seconds"] = time.perf_counter() - t0
        out["peak_rss"] = peak_rss()
        proto.write(json.dumps(out) + "\n")


def fuzz(cases: int, seed: int, timeout: float, start: int = 0) -> dict:
    counts: Counter = Counter()
    kinds: Counter = Counter()
    failures = []
    peak = (0, -1)
    slowest = (0.0, -1)
    worker = Worker(None, __file__)
    t0 = time.monotonic()
    try:
        for i in range(start, start + cases):
            out = worker.ask({"seed": seed, "i": i}, timeout)
            counts[out["outcome"]] += 1
            if "kind" in out:
                kinds[out["kind"]] += 1
            if out["outcome"] in FAILURES:
                failures.append({"case": i, **out})
                if worker.proc.poll() is not None:
                    worker = Worker(None, __file__)
            peak = max(peak, (out.get("peak_rss", 0), i))
            slowest = max(slowest, (out.get("seconds", 0.0), i))
            if (i - start + 1) % 500 == 0:
                print(f"{i - start + 1}/{cases} cases: {dict(counts)}", file=sys.stderr, flush=True)
    finally:
        worker.kill()
    return {"cases": cases, "seed": seed, "outcomes": dict(counts), "error_kinds": dict(kinds.most_common()),
            "failures": failures[:50],
            "peak_rss_bytes": peak[0], "peak_rss_case": peak[1], "max_case_seconds": slowest[0],
            "slowest_case": slowest[1], "wall_seconds": time.monotonic() - t0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=1000)
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=15.0, help="seconds before a case counts as a hang "
                    "(the render limit is 5 s)")
    ap.add_argument("--json", help="write the report here")
    ap.add_argument("--show", type=int, help="print the template of this case and exit")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker_main()
        return 0
    if args.show is not None:
        print(make_template(args.seed, args.show))
        return 0
    rep = fuzz(args.cases, args.seed, args.timeout, args.start)
    print(json.dumps({k: v for k, v in rep.items() if k != "failures"}, indent=1))
    for f in rep["failures"][:10]:
        print(f"case {f['case']}: {f['outcome']} {f.get('detail', '')}")
    if args.json:
        Path(args.json).write_text(json.dumps(rep, indent=1))
    return 1 if any(rep["outcomes"].get(k) for k in FAILURES) else 0


if __name__ == "__main__":
    raise SystemExit(main())
