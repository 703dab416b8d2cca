"""Server overhead and concurrency of `mtp-engine serve`, against `generate()` in this process.

1. Streaming tokens/s through the server vs `stream_generate()` on the same prompt and settings,
   repeats interleaved (server, in-process, server, ...), medians and their ratio. Two rates:
   end-to-end (tokens / time from sending the request to the last token, prefill and HTTP
   included) and decode (tokens after the first chunk / time from the first chunk to the last).
2. C concurrent streaming clients x T tokens (default 16 x 64, greedy, a different prompt each),
   in 3 bursts: errors, answers that differ from `generate()`'s (mixed-up outputs), the server's
   resident memory before (after the warm-up requests of part 1), at its peak and after each
   burst (a plateau, not a climb, is what "no leak" looks like).

The server runs as a subprocess on a free port (`mtp-engine serve --port 0`); only the standard
library talks HTTP, so the client costs little next to the server.

    python scripts/bench/bench_server.py                                  # the model in models/, CPU
    python scripts/bench/bench_server.py -m FILE.gguf -n 256 --spec draft-mtp --n-max auto --out F.json
"""
from __future__ import annotations

import argparse
import http.client
import json
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROMPT = "def parse_args(argv):\n    \"\"\"Parse the command line of the tool.\"\"\"\n"


def start_server(args) -> tuple[subprocess.Popen, str, int]:
    cmd = [sys.executable, "-m", "mtp_engine.cli", "serve", "--port", "0", "--queue-size", str(max(64, args.clients)),
           "--spec-type", args.spec, "--spec-draft-n-max", str(args.n_max)]
    if args.model:
        cmd += ["-m", args.model]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=sys.stderr, text=True, cwd=str(ROOT))
    for line in p.stdout:
        if "http://" in line:
            url = line.split("http://", 1)[1].split("/", 1)[0]
            host, port = url.rsplit(":", 1)
            return p, host.strip("[]"), int(port)
    raise SystemExit("the server did not start")


def stream(host: str, port: int, body: dict) -> dict:
    """One streaming completion as a client sends it (no `mtp_trace`: its per-token records cost
    the server ~4% a token on a host-bound model, which `generate()` beside it does not pay);
    times measured on this side of the socket, the token count from the final usage."""
    c = http.client.HTTPConnection(host, port, timeout=600)
    t0 = time.perf_counter()
    c.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True,
                                                          "stream_options": {"include_usage": True}}),
              headers={"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
    text, first, last, usage, timings = [], None, None, None, None
    for raw in r:
        line = raw.strip()
        if not line.startswith(b"data: "):
            continue
        if line == b"data: [DONE]":
            break
        ev = json.loads(line[6:])
        if "error" in ev:
            raise RuntimeError(ev["error"]["message"])
        usage, timings = ev.get("usage") or usage, ev.get("timings") or timings
        if ev["choices"] and ev["choices"][0].get("text"):
            last = time.perf_counter()
            first = first or last
            text.append(ev["choices"][0]["text"])
    c.close()
    n = usage["completion_tokens"]
    return {"text": "".join(text), "tokens": n, "e2e": n / (last - t0), "decode": _decode_rate(n, first, last),
            "server_decode": timings["predicted_per_second"]}


def _decode_rate(n: int, first: float, last: float) -> float:
    """Tokens after the first chunk's over the time from it to the last: the first chunk counted as
    one token on both sides (a client without the trace cannot see how many it held; a draft-mtp
    round's first chunk may hold more, the same number on both sides)."""
    return (n - 1) / (last - first) if last > first else 0.0


def local(model, args, prompt: str, max_tokens: int, **kw) -> dict:
    from mtp_engine import stream_generate

    t0 = time.perf_counter()
    text, first, last, n = [], None, None, 0
    for ch in stream_generate(prompt, model, max_tokens=max_tokens, spec=args.spec, n_max=args.n_max, **kw):
        if ch.token_ids:
            n += len(ch.token_ids)
            last = time.perf_counter()
            first = first or last
        text.append(ch.text)
    return {"text": "".join(text), "tokens": n, "e2e": n / (last - t0), "decode": _decode_rate(n, first, last)}


def health(host, port) -> dict:
    c = http.client.HTTPConnection(host, port, timeout=30)
    c.request("GET", "/health")
    h = json.loads(c.getresponse().read())
    c.close()
    return h


def overhead(model, host, port, args) -> dict:
    # no prompt cache: generate() beside it reads the prompt each time, so the server does too
    body = {"prompt": PROMPT, "max_tokens": args.tokens, "ignore_eos": True, "cache_prompt": False}
    stream(host, port, body)  # warm-up both sides (compiled graphs, caches, n-max auto's costs)
    local(model, args, PROMPT, args.tokens, ignore_eos=True)
    srv, loc = [], []
    for i in range(args.repeats):  # interleaved, and which goes first alternates
        if i % 2:
            loc.append(local(model, args, PROMPT, args.tokens, ignore_eos=True))
            srv.append(stream(host, port, body))
        else:
            srv.append(stream(host, port, body))
            loc.append(local(model, args, PROMPT, args.tokens, ignore_eos=True))
        print(f"  repeat {i + 1}/{args.repeats}: server {srv[-1]['e2e']:.1f} tok/s, generate() {loc[-1]['e2e']:.1f}",
              file=sys.stderr)
    same = all(s["text"] == loc[0]["text"] for s in srv)  # greedy: lossless draft-mtp included
    out = {"tokens": args.tokens, "same_text": same}
    for k in ("e2e", "decode"):
        a, b = statistics.median(s[k] for s in srv), statistics.median(s[k] for s in loc)
        out[k] = {"server": a, "generate": b, "ratio": a / b}
        # each repeat's pair ran back to back: their ratio is robust to load that drifts over the run
        out[k]["pair_ratio_median"] = statistics.median(s[k] / g[k] for s, g in zip(srv, loc))
    out["server_side_decode"] = statistics.median(s["server_decode"] for s in srv)
    return out


def concurrency(model, host, port, args) -> dict:
    prompts = [f"def {w}_records(path, limit={i}):\n    " for i, w in enumerate(
        "parse load save merge split join sort count read write open close send fetch clean check".split())]
    prompts = (prompts * (args.clients // len(prompts) + 1))[:args.clients]
    expected = [local(model, args, p, args.client_tokens, ignore_eos=True)["text"] for p in prompts]
    h0 = health(host, port)
    peak = [h0["rss_bytes"]]
    done = threading.Event()

    def watch():
        while not done.is_set():
            peak.append(health(host, port)["rss_bytes"])
            time.sleep(0.2)

    def one(p):
        try:
            return stream(host, port, {"prompt": p, "max_tokens": args.client_tokens, "ignore_eos": True})["text"]
        except Exception as e:  # counted, not raised: the figure is the error count
            print(f"  error: {e}", file=sys.stderr)
            return None

    w = threading.Thread(target=watch, daemon=True)
    w.start()
    errors = mixed = 0
    walls, rss_after = [], []
    for burst in range(args.bursts):  # repeated bursts tell a plateau from a leak
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.clients) as ex:
            got = list(ex.map(one, prompts))
        walls.append(time.perf_counter() - t0)
        time.sleep(0.5)
        rss_after.append(health(host, port)["rss_bytes"])
        errors += sum(g is None for g in got)
        mixed += sum(g is not None and g != e for g, e in zip(got, expected))
        print(f"  burst {burst + 1}/{args.bursts}: {walls[-1]:.1f} s, RSS {rss_after[-1] / 2**20:.1f} MiB", file=sys.stderr)
    done.set()
    w.join()
    return {"clients": args.clients, "tokens_each": args.client_tokens, "bursts": args.bursts, "errors": errors,
            "mixed_up": mixed, "wall_seconds": walls,
            "aggregate_tokens_per_second": args.clients * args.client_tokens / statistics.median(walls),
            "rss_before": h0["rss_bytes"], "rss_peak": max(peak), "rss_after": rss_after[-1],
            "rss_after_each_burst": rss_after, "distinct_answers": len(set(expected))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", default=None, help="GGUF file (default: the model in models/)")
    ap.add_argument("-n", "--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--spec", default="none", choices=["none", "draft-mtp"])
    ap.add_argument("--n-max", default="3", help="auto or an integer (draft-mtp only)")
    ap.add_argument("--clients", type=int, default=16, help="concurrent clients (0: skip that part)")
    ap.add_argument("--client-tokens", type=int, default=64)
    ap.add_argument("--bursts", type=int, default=3, help="rounds of the concurrent clients")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    args.n_max = args.n_max if args.n_max == "auto" else int(args.n_max)
    import mlx.core as mx

    from mtp_engine import load
    model = load(args.model)
    proc, host, port = start_server(args)
    try:
        rss_loaded = health(host, port)["rss_bytes"]
        res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": str(mx.default_device()),
               "model": Path(model.path).name, "spec": args.spec, "n_max": args.n_max, "rss_after_load": rss_loaded}
        print("overhead: server vs generate() ...", file=sys.stderr)
        res["overhead"] = overhead(model, host, port, args)
        if args.clients:
            print(f"concurrency: {args.clients} clients x {args.client_tokens} tokens ...", file=sys.stderr)
            res["concurrency"] = concurrency(model, host, port, args)
    finally:
        proc.terminate()
        proc.wait(20)
    o = res["overhead"]
    c = res.get("concurrency") or {"clients": 0, "tokens_each": 0, "errors": 0, "mixed_up": 0, "rss_before": 0,
                                   "rss_peak": 0, "rss_after": 0}
    mib = 2 ** 20
    print(f"| {res['device']} | {args.spec} n-max {args.n_max} | {o['tokens']} tok | "
          f"e2e {o['e2e']['server']:.1f} vs {o['e2e']['generate']:.1f} tok/s = {o['e2e']['ratio']:.3f}x "
          f"(pairs {o['e2e']['pair_ratio_median']:.3f}x) | "
          f"decode {o['decode']['server']:.1f} vs {o['decode']['generate']:.1f} = {o['decode']['ratio']:.3f}x "
          f"(pairs {o['decode']['pair_ratio_median']:.3f}x) | "
          f"{c['clients']}x{c['tokens_each']}: {c['errors']} errors, {c['mixed_up']} mixed up, RSS "
          f"{c['rss_before'] / mib:.1f} -> peak {c['rss_peak'] / mib:.1f} -> after each burst "
          f"{', '.join(f'{r / mib:.1f}' for r in c.get('rss_after_each_burst', []))} MiB |")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
