"""Shared test helpers: where llama.cpp's reference fixtures live."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))


def fixtures_dir() -> Path:
    """$MTP_FIXTURES, else the `shared/fixtures` folder beside (or inside) the checkout."""
    env = os.environ.get("MTP_FIXTURES")
    candidates = [Path(env)] if env else []
    candidates += [ROOT.parent / "shared" / "fixtures", ROOT / "shared" / "fixtures", Path("/work/shared/fixtures")]
    for c in candidates:
        if (c / "llamacpp").is_dir():
            return c
    return candidates[0]


FIXTURES = fixtures_dir()
TINY = FIXTURES / "llamacpp"
TRAINED = FIXTURES / "trained"


def need(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"fixture not found: {path}")
    return path

# measured device costs (n-max auto) are cached on disk; keep the tests' cache out of $HOME
if "MTP_ENGINE_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["MTP_ENGINE_CACHE_DIR"] = tempfile.mkdtemp(prefix="mtp-engine-test-cache-")
