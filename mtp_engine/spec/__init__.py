"""Compatibility alias: the speculative loop's package was `mtp_engine.spec` until it was renamed
`mtp_engine.speculative` ("spec" read as "specification", and tools take `spec/` folders for test
suites). Code written against the old name (`from mtp_engine.spec.draft_mtp import ...`) keeps
working: each old submodule name is the new module itself (one class identity, not a copy)."""
from __future__ import annotations

import importlib
import sys

from ..speculative import *  # noqa: F401,F403

_MOVED = ("accept", "calibration", "draft_mtp", "scheduler")

for _name in _MOVED:
    _module = importlib.import_module(f"mtp_engine.speculative.{_name}")
    sys.modules[f"{__name__}.{_name}"] = _module
    globals()[_name] = _module
