"""One table from the logs `scripts/gpu_check.sh` leaves in its output folder: the GPU suite's
counts, start-up in a first and a second process, the server's ratio to `generate()`, with issue
24's targets beside them. Sections that did not run say so.

    python3 scripts/gpu_summary.py OUT_DIR
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path


def _json(p: Path) -> dict | None:
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def tests_row(out: Path) -> list[str]:
    logs = [p for p in (out / "tests.log", out / "tests1.log", out / "tests2.log") if p.is_file()]
    if not logs:
        return ["GPU suite", "not run", "0 failed"]
    counts = {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
    for p in logs:
        lines = [ln for ln in p.read_text(errors="replace").splitlines() if re.search(r"\d+ (passed|failed)", ln)]
        for n, what in re.findall(r"(\d+) (passed|failed|skipped|error)", lines[-1] if lines else ""):
            counts[what] += int(n)
    failed = [ln.split(" ", 1)[1] for p in logs for ln in p.read_text(errors="replace").splitlines()
              if ln.startswith(("FAILED ", "ERROR "))]
    cell = f"{counts['passed']} passed, {counts['failed'] + counts['error']} failed, {counts['skipped']} skipped"
    if failed:
        cell += ": " + "; ".join(f[:90] for f in failed[:4])
    return ["GPU suite", cell, "0 failed"]


def startup_rows(out: Path) -> list[list[str]]:
    rows = []
    for i, name in ((1, "first process"), (2, "second process")):
        d = _json(out / f"startup{i}.json")
        if d is None:
            rows.append([f"start-up, {name}", "not run", ""])
            continue
        plain, mtp = d.get("gen0_none", {}), d.get("gen1_draft-mtp", {})
        kc = d.get("kernel_cache", {})
        total = d["import"] + d["load"] + d.get("first_forward", 0.0) + plain.get("wall", 0.0)
        first = f"first forward {d['first_forward']:.2f} s, " if "first_forward" in d else ""
        cell = (f"import {d['import']:.2f} s, load {d['load']:.2f} s, {first}first plain TTFT "
                f"{plain.get('time_to_first_token_seconds', 0):.2f} s (total {total:.1f} s), first draft-mtp "
                f"compile {mtp.get('compile_seconds', 0):.2f} s; kernels compiled {kc.get('compiled', '?')}, "
                f"found {kc.get('found', '?')}")
        # a long prompt alone, a server's batches (`--long`, `--batch`): the first of each pays its compiles
        firsts = {k: v["wall"] for k, v in d.items() if k.startswith(("long_", "batch")) and isinstance(v, dict)}
        if firsts:
            cell += "; " + ", ".join(f"{k} {v:.2f} s" for k, v in firsts.items())
        st = d.get("self_test_seconds") or {}
        if st:
            cell += "; self-tests " + ", ".join(f"{k} {v:.1f} s" for k, v in st.items())
        jit = d.get("compiled_modules") or {}
        if any(v.get("count") for v in jit.values()):  # what each phase compiled (MLX's JIT and ours)
            cell += "; modules compiled by phase " + ", ".join(f"{k} {v['count']}" for k, v in jit.items())
            costly = _costliest(jit)
            if costly:
                cell += "; costliest kinds (gap seconds, modules) " + costly
        if kc.get("compile_wall"):
            cell += f"; our kernels compiled ahead in {kc['compile_wall']:.1f} s wall ({kc.get('compile_seconds', 0):.1f} s of compiles)"
        target = "TTFT <= 1 s, total <= 3 s" if i == 2 else "total <= 20 s"
        rows.append([f"start-up, {name}", cell, target])
    return rows


def _costliest(jit: dict, top: int = 6) -> str:
    """The module kinds whose writes followed the longest gaps, over all phases (the gap before a
    module is about its compile where nothing else ran between)."""
    kinds: dict[str, list[float]] = {}
    for v in jit.values():
        for name, _, gap in v.get("written", []):
            kind = "_".join(name.split("_")[:2])
            kinds.setdefault(kind, []).append(gap)
    ranked = sorted(kinds.items(), key=lambda kv: -sum(kv[1]))[:top]
    return ", ".join(f"{k} {sum(g):.1f} s ({len(g)})" for k, g in ranked)


def server_rows(out: Path) -> list[list[str]]:
    rows = []
    for spec in ("none", "draft-mtp"):
        d = _json(out / f"server-{spec}.json")
        if d is None:
            rows.append([f"server / generate(), {spec}", "not run", ">= 0.97x"])
            continue
        o, c = d["overhead"], d.get("concurrency", {})
        cell = (f"e2e {o['e2e']['ratio']:.3f}x (pairs {o['e2e']['pair_ratio_median']:.3f}x), decode "
                f"{o['decode']['ratio']:.3f}x; {c.get('clients', '?')} clients: {c.get('errors', '?')} errors, "
                f"{c.get('mixed_up', '?')} mixed up")
        rows.append([f"server / generate(), {spec}", cell, ">= 0.97x"])
    return rows


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(sys.argv[1])
    rows = [tests_row(out), *startup_rows(out), *server_rows(out)]
    skipped = out / "skipped.txt"
    print("| check | measured | target |\n|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} |")
    if skipped.is_file():
        for line in skipped.read_text().splitlines():
            print(f"\n{line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
