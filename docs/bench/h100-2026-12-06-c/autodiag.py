"""Per-round times of n-max 4 and auto at oracle a=0.8, 9B shape (diagnosis of auto's gap)."""
import sys, time, statistics
sys.path.insert(0, "scripts/bench")
import harness
from harness import config_9b, random_model, decode_tps
layout = sys.argv[1] if len(sys.argv) > 1 else "uniform"
A = float(sys.argv[2]) if len(sys.argv) > 2 else 0.8
BEST_K = int(sys.argv[3]) if len(sys.argv) > 3 else 4
model = random_model(config_9b(False), layout)
prompt = list(range(100, 164))
from bench_gpu import use, BEST
use(model, BEST)
decode_tps(model, prompt, 16)
for k in (1, 2, 3, 4, "auto"):
    decode_tps(model, prompt, 24, "draft-mtp", k, A)
for _ in range(2):
    decode_tps(model, prompt, 128, "draft-mtp", "auto", A)
print("stored costs", {k: round(v, 3) for k, v in harness.STORED.get(id(model), {}).items()}, flush=True)
for rep in range(2):
    plain = decode_tps(model, prompt, 128)[0]
    for k in (BEST_K, "auto"):
        decs = []
        tps, st = decode_tps(model, prompt, 128, "draft-mtp", k, A, decoders=decs)
        rounds = decs[0].clock.rounds
        tot = sum(s for _, s, _ in rounds)
        byk = {}
        for kk, s, f in rounds:
            byk.setdefault(kk, []).append(s * 1e3)
        print(f"rep {rep} n-max {k}: {tps:.1f} tok/s = {tps/plain:.2f}x plain ({plain:.1f}); rounds {len(rounds)}, "
              f"sum {tot*1e3:.1f} ms; per k median ms " + ", ".join(f"{kk}: {statistics.median(v):.2f} (n={len(v)}, max {max(v):.1f})" for kk, v in sorted(byk.items())))
        print("   seq:", " ".join(f"{kk}:{s*1e3:.1f}{'*' if f else ''}" for kk, s, f in rounds))
        sch = getattr(decs[0], "scheduler", None)
        if sch is not None:
            print("   sched:", sch.stats(), "alphas", [round(a, 2) for a in sch.alphas()],
                  "believed rates", [round(sch.expected_rate(j), 3) for j in range(5)],
                  "round steps", [round(sch.round_steps(j), 3) for j in range(5)])
