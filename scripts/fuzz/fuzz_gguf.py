"""Fuzzing the GGUF loader: mutated copies of the fixture models go through `mtp_engine.load`
(tokenizer included) and, when they load, a short generation.

Every case runs in a worker process that the driver supervises, so a segfault, an abort or a hang
is seen and counted rather than taking the run down; a dead or stuck worker is replaced, and the
case runs once more in a fresh worker (a hang or crash counts only if it repeats; ones that do not
are listed as flaky). Outcomes:

  clean_error    MTPEngineError from load or from the generation (the only acceptable failure)
  loaded         loaded, logits finite, a few tokens generated
  nonfinite      loaded and generated text from NaN/inf logits (silently broken) -> failure
  unexpected     any other exception                                          -> failure
  crash          the worker died (signal or exit)                             -> failure
  hang           no answer within --timeout seconds                           -> failure

Mutations are structure-aware (the seed's header layout comes from `validate_header`): bit flips
and byte stores (biased to the header), truncation, inflated counts / lengths / offsets, swapped
value and tensor types, dims that do not multiply out, duplicated keys and names, boundary values
for scalar metadata, broken tokenizer strings and NaN/inf/random tensor data. Case i of a run is a
pure function of (--seed, i), so `--replay I --save DIR` rewrites it for debugging.

  python scripts/fuzz/fuzz_gguf.py --cases 10000 --seed 0 --workers 1 --json fuzz.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from mtp_engine.gguf.validate import Header, validate_header

ROOT = Path(__file__).resolve().parents[2]

# ---- structure-aware mutations --------------------------------------------------------------------
# Each mutator takes (rng, data, seed) and edits `data` (a bytearray copy of the seed file) in place,
# using the seed's header layout from `validate_header` to hit real fields: lengths, counts, type ids,
# dims, offsets, metadata values, tokenizer strings and tensor bytes. `make_case` picks one to three
# of them; case i of a run depends only on (run seed, i).

BIG = [0, 1, 2, 3, 255, 256, 65535, 1 << 31, (1 << 32) - 1, 1 << 32, 1 << 40, 1 << 60, (1 << 63) - 1,
       1 << 63, (1 << 64) - 1]


@dataclass
class Seed:
    name: str
    data: bytes
    header: Header


def _put(data: bytearray, off: int, fmt: str, value) -> None:
    if 0 <= off and off + struct.calcsize("<" + fmt) <= len(data):
        struct.pack_into("<" + fmt, data, off, value)


def _interesting(rng: random.Random, current: int, size: int) -> int:
    return rng.choice(BIG + [current + 1, current - 1 if current else 0, current * 2, size, size - 1,
                             size // 2, rng.randrange(1 << 64)]) % (1 << 64)


def _kv_layout(kv) -> dict[str, int]:
    key_len = len(kv.key.encode())
    return {"key_len": kv.offset, "type": kv.offset + 8 + key_len, "value": kv.value_offset}


def _tensor_layout(t) -> dict[str, int]:
    name_len = len(t.name.encode())
    n_dims_at = t.record_offset + 8 + name_len
    dims_at = n_dims_at + 4
    type_at = dims_at + 8 * len(t.dims)
    return {"name_len": t.record_offset, "n_dims": n_dims_at, "dims": dims_at, "type": type_at,
            "offset": type_at + 4}


def m_bit_flips(rng, data, s):
    end = s.header.data_offset if rng.random() < 0.8 else len(data)
    for _ in range(rng.randint(1, 8)):
        i = rng.randrange(end)
        data[i] ^= 1 << rng.randrange(8)
    return "bit flips"


def m_byte_stores(rng, data, s):
    end = s.header.data_offset if rng.random() < 0.8 else len(data)
    for _ in range(rng.randint(1, 4)):
        i = rng.randrange(end)
        data[i] = rng.choice([0x00, 0xFF, 0x7F, 0x80, 0x20, rng.randrange(256)])
    return "byte stores"


def m_truncate(rng, data, s):
    h = s.header
    cut = rng.choice([rng.randrange(len(data)), rng.randrange(h.data_offset + 1),
                      rng.choice(h.tensors).start + rng.randrange(64), len(data) - rng.randint(1, 64)])
    del data[max(cut, 0):]
    return f"truncate at {cut}"


def m_header_counts(rng, data, s):
    which = rng.choice(["tensor_count", "kv_count"])
    off = 8 if which == "tensor_count" else 16
    cur = struct.unpack_from("<Q", data, off)[0]
    v = _interesting(rng, cur, len(data))
    _put(data, off, "Q", v)
    return f"{which} = {v}"


def m_version(rng, data, s):
    v = rng.choice([0, 1, 2, 4, 99, 1 << 16, 0x03000000, (1 << 32) - 1])
    _put(data, 4, "I", v)
    return f"version = {v}"


def m_kv_lengths(rng, data, s):
    kv = rng.choice(list(s.header.kvs.values()))
    lay = _kv_layout(kv)
    if kv.elem_type is not None and rng.random() < 0.6:
        v = _interesting(rng, kv.count, len(data))
        _put(data, lay["value"] + 4, "Q", v)
        return f"array length of {kv.key} = {v}"
    if kv.type.name == "STRING" and rng.random() < 0.5:
        v = _interesting(rng, struct.unpack_from("<Q", data, lay["value"])[0], len(data))
        _put(data, lay["value"], "Q", v)
        return f"string length of {kv.key} = {v}"
    v = _interesting(rng, len(kv.key), len(data))
    _put(data, lay["key_len"], "Q", v)
    return f"key length of {kv.key} = {v}"


def m_string_elements(rng, data, s):
    """A length inside a string array (tokens, merges), or its bytes."""
    arrays = [kv for kv in s.header.kvs.values() if kv.elem_type is not None and kv.elem_type.name == "STRING"
              and kv.count]
    kv = rng.choice(arrays)
    off = kv.value_offset + 12
    j = rng.randrange(kv.count)
    for _ in range(j):
        off += 8 + struct.unpack_from("<Q", data, off)[0]
    n = struct.unpack_from("<Q", data, off)[0]
    r = rng.random()
    if r < 0.4:
        v = _interesting(rng, n, len(data))
        _put(data, off, "Q", v)
        return f"{kv.key}[{j}] length = {v}"
    if n == 0:
        return f"{kv.key}[{j}] empty, unchanged"
    i = off + 8 + rng.randrange(n)
    data[i] = rng.choice([0x80, 0xC0, 0xFF, 0x20, 0x00, ord("<"), rng.randrange(256)])
    return f"{kv.key}[{j}] byte {i - off - 8} = {data[i]:#x}"


def m_value_types(rng, data, s):
    kv = rng.choice(list(s.header.kvs.values()))
    lay = _kv_layout(kv)
    v = rng.choice(list(range(14)) + [99, (1 << 32) - 1])
    if kv.elem_type is not None and rng.random() < 0.5:
        _put(data, lay["value"], "I", v)
        return f"array element type of {kv.key} = {v}"
    _put(data, lay["type"], "I", v)
    return f"value type of {kv.key} = {v}"


def m_scalar_values(rng, data, s):
    scalars = [kv for kv in s.header.kvs.values() if kv.elem_type is None and kv.type.name != "STRING"]
    kv = rng.choice(scalars)
    t = kv.type.name
    off = kv.value_offset
    if t in ("FLOAT32", "FLOAT64"):
        v = rng.choice([0.0, -1.0, float("nan"), float("inf"), -float("inf"), 1e-30, 1e30, 3.4e38])
        _put(data, off, "f" if t == "FLOAT32" else "d", v)
    else:
        fmt = {"UINT8": "B", "INT8": "b", "UINT16": "H", "INT16": "h", "UINT32": "I", "INT32": "i",
               "UINT64": "Q", "INT64": "q", "BOOL": "B"}[t]
        bits = struct.calcsize(fmt) * 8
        raw = rng.choice([0, 1, 2, 3, 7, 64, 513, 4095, 4097, (1 << bits) - 1, 1 << (bits - 1), kv.value * 2
                          if isinstance(kv.value, int) else 0, rng.randrange(1 << bits)]) % (1 << bits)
        v = raw - (1 << bits) if fmt.islower() and raw >= 1 << (bits - 1) else raw
        _put(data, off, fmt, v)
    return f"{kv.key} = {v}"


def m_numeric_arrays(rng, data, s):
    arrays = [kv for kv in s.header.kvs.values() if kv.elem_type is not None and kv.elem_type.name != "STRING"
              and kv.count]
    kv = rng.choice(arrays)
    size = struct.calcsize("<" + {"BOOL": "B", "INT32": "i", "UINT32": "I", "FLOAT32": "f"}.get(kv.elem_type.name, "Q"))
    j = rng.randrange(kv.count)
    off = kv.value_offset + 12 + j * size
    for k in range(size):
        data[off + k] = rng.choice([0x00, 0xFF, 0x7F, 0x80, rng.randrange(256)])
    return f"{kv.key}[{j}] bytes"


def m_tensor_type(rng, data, s):
    t = rng.choice(s.header.tensors)
    v = rng.choice([0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 13, 14, 16, 24, 26, 28, 30, 31, 34, 39, 40, 41, 42, 99,
                    (1 << 32) - 1])
    _put(data, _tensor_layout(t)["type"], "I", v)
    return f"type of {t.name} = {v}"


def m_tensor_shape(rng, data, s):
    t = rng.choice(s.header.tensors)
    lay = _tensor_layout(t)
    r = rng.random()
    if r < 0.2:
        v = rng.choice([0, 1, 2, 3, 5, 8, (1 << 32) - 1])
        _put(data, lay["n_dims"], "I", v)
        return f"n_dims of {t.name} = {v}"
    if r < 0.4 and len(t.dims) > 1:
        dims = list(reversed(t.dims))
        for j, d in enumerate(dims):
            _put(data, lay["dims"] + 8 * j, "Q", d)
        return f"dims of {t.name} swapped"
    j = rng.randrange(len(t.dims))
    v = rng.choice([0, 1, t.dims[j] * 2, t.dims[j] // 2, t.dims[j] + 1, t.dims[j] + 32, t.dims[j] + 256,
                    1 << 31, 1 << 32, 1 << 62, (1 << 64) - 1])
    _put(data, lay["dims"] + 8 * j, "Q", v)
    return f"dim {j} of {t.name} = {v}"


def m_tensor_offset(rng, data, s):
    h = s.header
    t = rng.choice(h.tensors)
    other = rng.choice(h.tensors)
    v = rng.choice([t.offset + 1, t.offset + 32, other.offset, other.offset + 32, len(data) - h.data_offset,
                    len(data), 0, 1 << 40, 1 << 63, (1 << 64) - 1, _interesting(rng, t.offset, len(data))])
    _put(data, _tensor_layout(t)["offset"], "Q", v % (1 << 64))
    return f"offset of {t.name} = {v}"


def m_tensor_name(rng, data, s):
    h = s.header
    t = rng.choice(h.tensors)
    lay = _tensor_layout(t)
    if rng.random() < 0.5:
        v = _interesting(rng, len(t.name), len(data))
        _put(data, lay["name_len"], "Q", v)
        return f"name length of {t.name} = {v}"
    other = rng.choice(h.tensors)
    raw = other.name.encode()[: len(t.name)].ljust(len(t.name), b"x")
    data[lay["name_len"] + 8: lay["name_len"] + 8 + len(raw)] = raw
    return f"name of {t.name} = {raw!r}"


def m_duplicate_key(rng, data, s):
    kvs = list(s.header.kvs.values())
    a, b = rng.sample(kvs, 2)
    ka, kb = a.key.encode(), b.key.encode()
    if len(ka) != len(kb):
        return "duplicate key: lengths differ, unchanged"
    data[b.offset + 8: b.offset + 8 + len(kb)] = ka
    return f"key {b.key} renamed {a.key}"


def m_tensor_data(rng, data, s):
    t = rng.choice(s.header.tensors)
    kind = rng.choice(["nan16", "inf16", "nan32", "random", "ones", "zeros"])
    n = min(t.n_bytes, rng.choice([2, 4, 64, 4096, t.n_bytes]))
    start = t.start + rng.randrange(max(t.n_bytes - n, 0) + 1) // 2 * 2
    if kind == "random":
        data[start:start + n] = rng.randbytes(n)
    else:
        unit = {"nan16": b"\x00\x7e", "inf16": b"\x00\x7c", "nan32": b"\x00\x00\xc0\x7f", "ones": b"\xff",
                "zeros": b"\x00"}[kind]
        data[start:start + n] = (unit * (n // len(unit) + 1))[:n]
    return f"{kind} data in {t.name} ({n} bytes)"


def m_alignment(rng, data, s):
    kv = s.header.kvs.get("general.alignment")
    if kv is None:
        return "no general.alignment, unchanged"
    v = rng.choice([0, 1, 3, 16, 64, 1 << 31, (1 << 32) - 1])
    _put(data, kv.value_offset, "I", v)
    return f"general.alignment = {v}"


MUTATORS = [(m_bit_flips, 12), (m_byte_stores, 8), (m_truncate, 8), (m_header_counts, 4), (m_version, 2),
            (m_kv_lengths, 8), (m_string_elements, 8), (m_value_types, 6), (m_scalar_values, 12),
            (m_numeric_arrays, 4), (m_tensor_type, 6), (m_tensor_shape, 8), (m_tensor_offset, 6),
            (m_tensor_name, 4), (m_duplicate_key, 2), (m_tensor_data, 8), (m_alignment, 1)]


def make_case(seeds: list[Seed], run_seed: int, index: int) -> tuple[bytes, str]:
    """The bytes of case `index` and a description of its mutations."""
    rng = random.Random(run_seed * 1_000_003 + index)
    s = rng.choice(seeds)
    data = bytearray(s.data)
    fns, weights = zip(*MUTATORS)
    steps = []
    for fn in rng.choices(fns, weights, k=rng.choice([1, 1, 1, 2, 3])):
        try:
            steps.append(fn(rng, data, s))
        except Exception as e:  # noqa: BLE001 - a later step read what an earlier one broke
            steps.append(f"{fn.__name__} skipped ({type(e).__name__})")
    return bytes(data), f"{s.name}: " + "; ".join(steps)


# ---- the driver ------------------------------------------------------------------------------------
SEED_NAMES = ("qwen35-mtp-tiny-Q4_K_M.gguf", "qwen35-mtp-tiny-Q8_0.gguf", "qwen35-mtp-tiny-f16.gguf",
              "qwen35-mtp-tiny-Q4_0.gguf", "qwen35-mtp-tiny-Q5_K_M.gguf", "qwen35-mtp-tiny-Q6_K.gguf")
FAILURES = ("nonfinite", "unexpected", "crash", "hang")
PROMPT = "Hello, world"
WORKER_MEMORY_CAP = 8 << 30  # address-space cap: a runaway allocation fails in the worker, not the host


def default_fixtures() -> Path:
    env = os.environ.get("MTP_FIXTURES")
    for c in ([Path(env)] if env else []) + [ROOT.parent / "shared" / "fixtures", ROOT / "shared" / "fixtures",
                                              ROOT / "tests" / "fixtures"]:
        if (c / "llamacpp").is_dir():
            return c / "llamacpp"
    raise SystemExit("fixtures not found: set MTP_FIXTURES")


# ---------------------------------------------------------------------------------------- worker side


def peak_rss_reset() -> None:
    try:  # Linux >= 4.0: "5" resets VmHWM, so each case's own peak is measured
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_rss() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024


def run_case(path: str, inject: bool = False) -> dict:
    """Loads `path` and, if it loads, checks its logits and generates a few tokens. `inject`: a
    library exception raised inside the case (the harness's self-test of its classification)."""
    import traceback

    import mlx.core as mx

    import mtp_engine
    from mtp_engine import MTPEngineError

    stage = "load"
    try:
        if inject:
            raise TypeError("injected by the harness's self-test")
        m = mtp_engine.load(path)
        stage = "generate"
        spec = "draft-mtp" if m.model.mtp is not None else None
        mtp_engine.generate(PROMPT, m, max_tokens=3, spec=spec, ignore_eos=True)
        # the engine produced text without complaint: were its logits numbers at all?
        stage = "logits"
        ids = m.tokenizer.encode(PROMPT)
        if any(not 0 <= i < m.model.cfg.vocab_size for i in ids):
            return {"outcome": "unexpected", "stage": stage,
                    "detail": f"encoded ids {ids} reach past the model's {m.model.cfg.vocab_size} embeddings"}
        if ids:
            cache = m.model.make_cache()
            logits = m.model.logits(m.model.forward(mx.array([ids]), cache)[0, -1])
            if not bool(mx.all(mx.isfinite(logits)).item()):
                return {"outcome": "nonfinite", "detail": "text generated from NaN/inf logits"}
        return {"outcome": "loaded"}
    except MTPEngineError as e:
        return {"outcome": "clean_error", "stage": stage, "detail": str(e)[-300:]}
    except BaseException as e:  # noqa: BLE001 - a Rust panic is a BaseException; every kind is a finding
        tb = traceback.format_exc(limit=-6)
        return {"outcome": "unexpected", "stage": stage, "detail": f"{type(e).__name__}: {e}"[:500],
                "traceback": tb[-2000:]}


def worker_main() -> None:
    """Answers one JSON line per request on the original stdout; everything else goes to stderr."""
    import faulthandler
    import resource

    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    faulthandler.enable()
    try:
        resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY_CAP, WORKER_MEMORY_CAP))
    except (ValueError, OSError):
        pass
    import mtp_engine  # noqa: F401 - imported before "ready" so startup is not timed as a case
    proto.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("op") == "segv":  # self-test of crash detection
            import ctypes
            ctypes.string_at(0)
        if req.get("op") == "sleep":  # self-test of hang detection
            time.sleep(req["seconds"])
        peak_rss_reset()
        t0 = time.perf_counter()
        out = run_case(req["path"], inject=req.get("op") == "raise")
        out["seconds"] = time.perf_counter() - t0
        out["peak_rss"] = peak_rss()
        proto.write(json.dumps(out) + "\n")


# ---------------------------------------------------------------------------------------- driver side


class Worker:
    """One supervised worker process: `script --worker` answering one JSON line per request (the
    fuzzers' shared supervision: `fuzz_chat_template.py` runs its cases through it too); its
    stderr to `log_path` (None: discarded)."""

    def __init__(self, log_path: str | None, script: str = __file__):
        self.log = open(log_path, "ab") if log_path else None
        self.proc = subprocess.Popen([sys.executable, str(Path(script).resolve()), "--worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log or subprocess.DEVNULL, start_new_session=True)
        self.buf = b""
        ready = self._read(120.0)
        if not ready or not ready.get("ready"):
            raise RuntimeError(f"fuzz worker did not start (see {log_path or 'its stderr'})")

    def _read(self, timeout: float) -> dict | None:
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            r, _, _ = select.select([fd], [], [], left)
            if r:
                chunk = os.read(fd, 65536)
                if not chunk:
                    return None
                self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def ask(self, request: dict, timeout: float) -> dict:
        t0 = time.monotonic()
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
            out = self._read(timeout)
        except TimeoutError:
            _, peak = self.kill()
            return {"outcome": "hang", "detail": f"no answer within {timeout} s", "seconds": timeout,
                    "peak_rss": peak}
        except BrokenPipeError:
            out = None
        if out is None:
            rc, peak = self._reap()
            detail = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit status {rc}"
            return {"outcome": "crash", "detail": detail, "seconds": time.monotonic() - t0, "peak_rss": peak}
        return out

    def _reap(self) -> tuple[int, int]:
        """Waits for the worker; returns (Popen-style return code, its peak RSS in bytes), so a
        killed worker's memory is still counted."""
        _, status, usage = os.wait4(self.proc.pid, 0)
        rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        self.proc.returncode = rc
        return rc, usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024)

    def kill(self) -> tuple[int, int]:
        if self.proc.poll() is not None:
            return self.proc.returncode, 0
        os.killpg(self.proc.pid, signal.SIGKILL)
        return self._reap()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.log:
            self.log.close()


@dataclass
class Report:
    cases: int = 0
    outcomes: Counter = field(default_factory=Counter)
    stages: Counter = field(default_factory=Counter)
    peak_rss: int = 0
    peak_rss_case: int = -1
    max_seconds: float = 0.0
    fallback_errors: int = 0  # clean errors that only GGUFReader's generic catch turned clean
    error_kinds: Counter = field(default_factory=Counter)  # clean errors by field and message shape
    retried: int = 0  # hangs and crashes run a second time
    flaky: list = field(default_factory=list)  # ...that did not repeat (counted by their second run)
    failures: list = field(default_factory=list)
    wall_seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not any(self.outcomes[k] for k in FAILURES)

    def to_json(self) -> dict:
        return {"cases": self.cases, "outcomes": dict(self.outcomes), "stages": dict(self.stages),
                "peak_rss_bytes": self.peak_rss, "peak_rss_case": self.peak_rss_case,
                "max_case_seconds": self.max_seconds, "fallback_errors": self.fallback_errors,
                "retried": self.retried, "flaky": self.flaky,
                "wall_seconds": self.wall_seconds, "error_kinds": dict(self.error_kinds.most_common()),
                "failures": self.failures}


def load_seeds(fixtures: Path | None = None, seed_names=SEED_NAMES, files: list[Path] = ()) -> list[Seed]:
    """The seed models: `files` when given, else `seed_names` in `fixtures` (default: the
    llama.cpp fixture folder)."""
    paths = [Path(p) for p in files] or [(fixtures or default_fixtures()) / n for n in seed_names]
    return [Seed(p.name, p.read_bytes(), validate_header(p)) for p in paths]


def fuzz(n_cases: int, run_seed: int = 0, workers: int = 1, timeout: float = 5.0, fixtures: Path | None = None,
         seed_names=SEED_NAMES, keep_dir: Path | None = None, recycle: int = 500, start: int = 0,
         progress=None, seed_files: list[Path] = ()) -> Report:
    """Runs cases start..start+n_cases-1 of run `run_seed`; returns the counts."""
    seeds = load_seeds(fixtures, seed_names, seed_files)
    tmp = Path(tempfile.mkdtemp(prefix="fuzz_gguf_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    report = Report()
    lock = threading.Lock()
    next_case = iter(range(start, start + n_cases))
    t_start = time.monotonic()

    def loop(wid: int) -> None:
        worker, served = None, 0
        try:
            while True:
                with lock:
                    i = next(next_case, None)
                if i is None:
                    return
                data, desc = make_case(seeds, run_seed, i)
                path = tmp / f"case{i}.gguf"
                path.write_bytes(data)
                if worker is None or worker.proc.poll() is not None or served >= recycle:
                    if worker is not None:
                        worker.close()
                    worker, served = Worker(str(tmp / f"worker{wid}.log")), 0
                out = worker.ask({"path": str(path)}, timeout)
                served += 1
                if out["outcome"] in ("hang", "crash"):
                    # once more in a fresh worker: on a shared machine a slow case can be contention,
                    # and a killed worker can be the host's doing; a real hang or crash repeats
                    worker.close()
                    worker, served = Worker(str(tmp / f"worker{wid}.log")), 0
                    again = worker.ask({"path": str(path)}, timeout)
                    with lock:
                        report.retried += 1
                    if again["outcome"] not in ("hang", "crash"):
                        with lock:
                            report.flaky.append({"case": i, "first": out, "retry": again["outcome"]})
                        out = again
                with lock:
                    _record(report, i, desc, out, path, keep_dir)
                    if progress:
                        progress(report)
                path.unlink(missing_ok=True)
        finally:
            if worker is not None:
                worker.close()

    errors: list[BaseException] = []

    def guarded(wid: int) -> None:
        try:
            loop(wid)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread below
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(w,)) for w in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        shutil.rmtree(tmp, ignore_errors=True)
        raise errors[0]
    report.wall_seconds = time.monotonic() - t_start
    shutil.rmtree(tmp, ignore_errors=True)
    return report


def _record(report: Report, i: int, desc: str, out: dict, path: Path, keep_dir: Path | None) -> None:
    report.cases += 1
    kind = out["outcome"]
    report.outcomes[kind] += 1
    if "stage" in out:
        report.stages[f"{kind}@{out['stage']}"] += 1
    if out.get("peak_rss", 0) > report.peak_rss:
        report.peak_rss, report.peak_rss_case = out["peak_rss"], i
    report.max_seconds = max(report.max_seconds, out.get("seconds", 0.0))
    if kind == "clean_error":
        detail = out.get("detail", "")
        report.fallback_errors += "corrupt or truncated GGUF (" in detail
        report.error_kinds[_error_kind(detail, str(path))] += 1
    if kind in FAILURES:
        report.failures.append({"case": i, "mutation": desc, **out})
        if keep_dir is not None:
            keep_dir.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, keep_dir / f"case{i}.gguf")


def _error_kind(message: str, path: str) -> str:
    """The message with the file, numbers and quoted text blanked, so that alike errors count together."""
    m = message.replace(path + ": ", "")
    m = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", m)
    m = re.sub(r"\[[^\]]*\]", "[…]", m)
    m = re.sub(r"-?\d+(\.\d+)?(e[-+]?\d+)?", "N", m)
    m = re.sub(r"blk\.N\.", "blk.N.", m)
    return m[:120]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=200)
    ap.add_argument("--start", type=int, default=0, help="first case index")
    ap.add_argument("--seed", type=int, default=0, help="run seed (case i is a function of seed and i)")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=5.0, help="seconds before a case counts as a hang")
    ap.add_argument("--fixtures", type=Path, default=None, help="folder with the seed GGUF files")
    ap.add_argument("--seed-file", type=Path, action="append", default=[],
                    help="seed GGUF file (repeatable) instead of the default tiny fixtures, e.g. a qwen35moe model")
    ap.add_argument("--keep", type=Path, default=None, help="copy failing cases into this folder")
    ap.add_argument("--json", type=Path, default=None, help="write the report here")
    ap.add_argument("--replay", type=int, default=None, help="write case N to --save and describe it")
    ap.add_argument("--save", type=Path, default=Path("."))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker_main()
        return 0
    if args.replay is not None:
        seeds = load_seeds(args.fixtures, files=args.seed_file)
        data, desc = make_case(seeds, args.seed, args.replay)
        out = args.save / f"case{args.replay}.gguf"
        out.write_bytes(data)
        print(f"{out}: {desc}")
        return 0

    def progress(r: Report) -> None:
        if r.cases % 100 == 0:
            print(f"{r.cases} cases {dict(r.outcomes)} peak {r.peak_rss / 2**20:.0f} MiB", file=sys.stderr, flush=True)

    r = fuzz(args.cases, args.seed, args.workers, args.timeout, args.fixtures, keep_dir=args.keep,
             start=args.start, progress=progress, seed_files=args.seed_file)
    summary = r.to_json()
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "failures"}, indent=1))
    for f in r.failures[:20]:
        print(f"case {f['case']}: {f['outcome']}: {f['mutation']}: {f.get('detail', '')}")
    return 0 if r.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
