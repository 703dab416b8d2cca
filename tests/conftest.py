"""Shared test helpers: where llama.cpp's reference fixtures live."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))


VENDORED = ROOT / "tests" / "fixtures"


def fixtures_dir() -> Path:
    """$MTP_FIXTURES, else the `shared/fixtures` folder beside (or inside) the checkout, else the
    small set vendored in `tests/fixtures` (a bare clone still checks llama.cpp parity with it)."""
    env = os.environ.get("MTP_FIXTURES")
    candidates = [Path(env)] if env else []
    candidates += [ROOT.parent / "shared" / "fixtures", ROOT / "shared" / "fixtures", VENDORED]
    for c in candidates:
        if (c / "llamacpp").is_dir():
            return c
    return candidates[0]


FIXTURES = fixtures_dir()
TINY = FIXTURES / "llamacpp"
TRAINED = FIXTURES / "trained"


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


def need(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"fixture not found: {path}")
    return path

# measured device costs (n-max auto) are cached on disk; keep the tests' cache out of $HOME
if "MTP_ENGINE_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["MTP_ENGINE_CACHE_DIR"] = tempfile.mkdtemp(prefix="mtp-engine-test-cache-")
