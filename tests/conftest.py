"""Shared test helpers: where llama.cpp's reference fixtures live, the models every file shares
(loaded once per session), the scripts some tests drive.

Helpers are imported as a package (`from tests.conftest import TINY`, `from tests import
sim_device`); the repository root is on the path through pytest's `pythonpath` setting."""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import settings

# MLX's CUDA backend runs float32 matmuls at TF32 precision unless told otherwise (MLX_ENABLE_TF32,
# default 1; ml-explore/mlx#3860: ~3e-4 relative error). The MLX operations are the reference the
# custom kernels are held to, so on a GPU they must be float32 for the comparisons to mean anything
# (set before the first product; a no-op on the CPU and Metal).
os.environ.setdefault("MLX_ENABLE_TF32", "0")

# Property tests draw the same examples on every run, so the suite's verdict depends on the code,
# not on the day (a random draw in CI once found a real difference and failed a landing that had
# nothing to do with it). `HYPOTHESIS_PROFILE=explore` draws new examples on each run: run it
# when changing a tested module, and turn what it finds into a named test.
settings.register_profile("default", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

ROOT = Path(__file__).resolve().parent.parent


VENDORED = ROOT / "tests" / "fixtures"


def fixtures_dir() -> Path:
    """$MTP_FIXTURES, else the `shared/fixtures` folder beside (or inside) the checkout, else the
    set vendored in `tests/fixtures` (tests/fixtures/README.md says what it holds and how the rest
    is rebuilt)."""
    env = os.environ.get("MTP_FIXTURES")
    candidates = [Path(env)] if env else []
    candidates += [ROOT.parent / "shared" / "fixtures", ROOT / "shared" / "fixtures", VENDORED]
    for c in candidates:
        if (c / "llamacpp").is_dir():
            return c
    return candidates[0]


def _prepare_vendored() -> None:
    """A bare clone's fixtures, made once per checkout (ignored by git): the tiny f32 model from
    its .xz, then the files rebuilt from it (tests/fixture_rebuild.py: the other file types and
    the HF weights, each checked by sha256). Under a lock, as every test worker imports this."""
    import fcntl

    from tests.fixture_rebuild import rebuild, unpack

    with open(VENDORED / "rebuild" / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        unpack(VENDORED / "llamacpp" / "qwen35-mtp-tiny-f32.gguf.xz")
        rebuild(VENDORED)


FIXTURES = fixtures_dir()
if FIXTURES == VENDORED:
    _prepare_vendored()
TINY = FIXTURES / "llamacpp"
TRAINED = FIXTURES / "trained"
MOE = FIXTURES / "llamacpp-moe"
HF_TINY = TINY / "hf" / "qwen35-mtp-tiny"
SHIPPED = ROOT / "models" / "qwen35-mtp-code-Q4_K_M.gguf"  # the model in models/ (me.load()'s default)
TINY_F32 = TINY / "qwen35-mtp-tiny-f32.gguf"
TINY_Q4 = TINY / "qwen35-mtp-tiny-Q4_K_M.gguf"
TINY_Q8 = TINY / "qwen35-mtp-tiny-Q8_0.gguf"
MOE_Q4 = MOE / "qwen35moe-mtp-tiny-Q4_K_M.gguf"
# the trained code model: the full set's, else the byte-identical copy shipped in models/
TRAINED_GGUF = next((p for p in (TRAINED / "qwen35-mtp-code-Q4_K_M.gguf", SHIPPED) if p.exists()),
                    TRAINED / "qwen35-mtp-code-Q4_K_M.gguf")
TINY_TOKENIZER = TINY_F32  # the tiny model's tokenizer and llama.cpp's prompt ids (any of its files has them)


def load_script(path: str) -> ModuleType:
    """scripts/PATH.py (e.g. "fuzz/fuzz_gguf") as a module named by its file (the fuzzers some
    tests run), without putting its folder on the path."""
    name = path.rsplit("/", 1)[-1]
    if name in sys.modules:
        return sys.modules[name]
    file = ROOT / "scripts" / f"{path}.py"
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look a module up by name
    sys.path.insert(0, str(file.parent))  # its siblings, as when it runs as a script (`fuzz_gguf`'s worker)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(file.parent))
    return module


def copy_metadata(src, writer, set_keys: dict | None = None, drop_keys=()) -> dict:
    """Copies a GGUFReader's key/values into a GGUFWriter (all but GGUF.* and the architecture,
    which the writer sets), replacing those in `set_keys` {key: (value, vtype[, subtype])} and
    skipping `drop_keys`; returns the set_keys the source did not have."""
    set_keys = dict(set_keys or {})
    for key, f in src.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in drop_keys:
            continue
        if key in set_keys:
            writer.add_key_value(key, *set_keys.pop(key))
        else:
            writer.add_key_value(key, f.contents(), f.types[0], f.types[1] if len(f.types) > 1 else None)
    return set_keys


def write_gguf_copy(src, path, set_keys: dict | None = None) -> Path:
    """A copy of GGUFReader `src` at `path` (its tensors as they are) with the key/values of
    `set_keys` {key: (value, vtype[, subtype])} set (added when the source lacks them)."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "qwen35")
    for key, args in copy_metadata(src, w, set_keys).items():
        w.add_key_value(key, *args)
    for t in src.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    """Runs `mtp-engine ARGS` in this process; returns (exit status, stdout, stderr)."""
    from mtp_engine.cli.main import main

    try:
        rc = main(list(args))
    except SystemExit as e:
        rc = e.code
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def need(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"fixture not found: {path}")
    return path


# ---- which tests may skip ------------------------------------------------------------------------
# A test skips only for a reason its marker names; with MTP_STRICT_SKIPS=1 (CI sets it) any other
# skip fails the run, so a fixture that stops being found or an import that breaks cannot quietly
# turn tests off. Markers: `gpu` (needs MLX's CUDA backend: scripts/gpu_check.sh runs it),
# `needs_tool` (an optional program outside Python, e.g. Chromium for the page test).
MAY_SKIP = {"gpu": "needs MLX's CUDA backend (a GPU): scripts/gpu_check.sh runs it",
            "needs_tool": "needs an optional program outside Python (e.g. Chromium)"}


def _cuda() -> bool:
    from mtp_engine.model import kernels
    return kernels.cuda()


GPU = _cuda()


# markers that select rather than excuse: `-m "not slow"` is the quick loop while editing
SELECT = {"slow": "among the slowest tests (the trained model's long parity runs, notebooks)"}


def pytest_configure(config) -> None:
    for name, why in MAY_SKIP.items():
        config.addinivalue_line("markers", f"{name}: may skip: {why}")
    for name, why in SELECT.items():
        config.addinivalue_line("markers", f"{name}: {why}")


def pytest_terminal_summary(terminalreporter) -> None:
    """One line for a checkout without the full fixture set: how many tests that skipped, and how
    to run them."""
    missing = [r for r in terminalreporter.stats.get("skipped", [])
               if "fixture not found" in (r.longrepr[2] if isinstance(r.longrepr, tuple) else str(r.longrepr))]
    if missing:
        terminalreporter.write_line(
            f"{len(missing)} tests skipped for fixtures this checkout lacks ({FIXTURES}): point MTP_FIXTURES at "
            "a full fixture set (the shared/fixtures folder); tests/fixtures/README.md says what a bare clone holds")


def pytest_runtest_setup(item) -> None:
    if item.get_closest_marker("gpu") and not GPU:
        pytest.skip(MAY_SKIP["gpu"])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not (report.skipped and os.environ.get("MTP_STRICT_SKIPS") == "1"):
        return
    if any(item.get_closest_marker(m) for m in MAY_SKIP) or hasattr(report, "wasxfail"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = (f"{item.nodeid} skipped in a strict run ({reason}); only tests marked "
                       f"{' or '.join(MAY_SKIP)} may skip (tests/conftest.py)")

# measured device costs (n-max auto) are cached on disk; keep the tests' cache out of $HOME
if "MTP_ENGINE_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["MTP_ENGINE_CACHE_DIR"] = tempfile.mkdtemp(prefix="mtp-engine-test-cache-")


class ModelCache:
    """Models loaded once per test session (per xdist worker), one per (file, load arguments).
    Tests share them: one that changes a model (options, chat template) puts it back."""

    def __init__(self):
        self._loaded: dict = {}

    def __call__(self, path: Path, **load_kwargs):
        from mtp_engine import load

        key = (str(path), tuple(sorted((k, repr(v)) for k, v in load_kwargs.items())))
        if key not in self._loaded:
            self._loaded[key] = load(need(Path(path)), **load_kwargs)
        return self._loaded[key]


# the one cache of the session (per xdist worker): the `models` fixture, and helpers that load
# a file's model inside parametrized tests
MODELS = ModelCache()


@pytest.fixture(scope="session")
def models() -> ModelCache:
    """`models(path, **load_kwargs)`: the session's loaded model of that file."""
    return MODELS


@pytest.fixture(scope="session")
def tiny_f32(models):
    """The tiny f32 fixture model (llama.cpp's references are computed on it)."""
    return models(TINY_F32)


@pytest.fixture(scope="session")
def tiny_any(models):
    """The tiny model where any of its files does (no llama.cpp reference of one file compared)."""
    return models(TINY_TOKENIZER)


@pytest.fixture(scope="session")
def tiny_q8(models):
    """The tiny Q8_0 model (the vendored Q4_K_M one in a bare clone)."""
    return models(TINY_Q8)


@pytest.fixture(scope="session")
def tiny_q4(models):
    """The tiny Q4_K_M model."""
    return models(TINY_Q4)


@pytest.fixture(scope="session")
def shipped_model(models):
    """The trained code model shipped in models/."""
    return models(SHIPPED)
