"""The package's shape, read from its own imports (every `import`, module-level or inside a
function): no import circles, every import goes down the layers below, few modules directly under
`mtp_engine/`, and Jinja (chat templates) only in `chat/`."""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "mtp_engine"

# lowest first: a unit (a package under mtp_engine/, or a module directly in it) may import units
# of lower layers only; the package itself (`mtp_engine/__init__.py`, the public API) sits on top
LAYERS = [
    ("errors",),
    ("output_files", "load_progress", "text_input", "threads", "version"),
    ("options", "constraint"),
    ("gguf",),  # GGUF files: read, validate, write
    ("chat",),  # chat templates and their budget, tool calls
    ("tokenizer",),  # text <-> ids (renders templates through chat/)
    ("model",),  # the network, its caches and kernels, loading
    ("generation",),  # sampling, penalties, prompt cache, plain decoding, the token loop
    ("speculative",),  # drafters, the round, acceptance, n-max auto
    ("convert", "request"),  # checkpoint conversion; a request, checked and prepared
    ("batching",),  # continuous batching: many sequences in one forward per step
    ("distributed",),
    ("api",),
    ("server",),  # HTTP only
    ("cli",),
]
RANK = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}
MAX_TOP_LEVEL_MODULES = 12


def _modules(root: Path = ROOT) -> dict[str, Path]:
    mods = {}
    for p in root.rglob("*.py"):
        parts = list(p.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = p
    return mods


def _graph(root: Path = ROOT) -> dict[str, set[str]]:
    mods = _modules(root)
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in mods.items():
        pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")[:len(pkg.split(".")) - (node.level - 1)]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in mods]
                # `from pkg import submodule` imports the submodule; any other name, the module `mod`
                targets = subs + ([mod] if len(subs) < len(node.names) else [])
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for t in targets:
                if t in mods and t != name:
                    edges[name].add(t)
    return edges


def _unit(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None  # None: the package itself


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    assert _cycles(_graph()) == []


def test_every_unit_has_a_layer():
    units = {_unit(m) for m in _modules()} - {None}
    assert sorted(units - set(RANK)) == [], "add the new package or module to LAYERS"
    assert sorted(set(RANK) - units) == [], "LAYERS names a unit that no longer exists"


def _upward(edges: dict[str, set[str]]) -> list[str]:
    wrong = []
    for src, targets in edges.items():
        a = _unit(src)
        if a is None:
            continue  # the package's __init__: the public API, on top of everything
        for dst in targets:
            b = _unit(dst)
            if b is None:
                wrong.append(f"{src} -> {dst} (the package root)")
            elif b != a and RANK[b] >= RANK[a]:
                wrong.append(f"{src} -> {dst}")
    return wrong


def test_imports_go_down_the_layers():
    assert _upward(_graph()) == []


def test_few_modules_directly_in_the_package():
    top = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


def test_jinja_only_in_chat():
    users = []
    for name, path in _modules().items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            mods = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if any(m == "jinja2" or m.startswith("jinja2.") for m in mods) and _unit(name) != "chat":
                users.append(name)
    assert users == []


def test_one_module_renders_chat_templates_for_requests():
    """Requests' chats are rendered in request/prepare.py alone (the ChatML fallback, tools and
    the context check with them): no front end calls the template itself."""
    callers = set()
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            f = node.func if isinstance(node, ast.Call) else None
            called = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if called in ("apply_chat_template", "render_chat_template"):
                callers.add(name)
    # the tokenizer renders its own template; prepare is the one caller for requests
    assert callers == {"mtp_engine.tokenizer.tokenizer", "mtp_engine.request.prepare"}, callers


def test_the_checker_catches_a_circle_and_an_upward_import(tmp_path):
    # the checks above must be able to fail: a made-up package with one of each, one of them lazy
    pkg = tmp_path / "mtp_engine"
    (pkg / "model").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .api import x\n")
    (pkg / "api.py").write_text("from .model.cache import y\n")
    (pkg / "model" / "__init__.py").write_text("")
    (pkg / "model" / "cache.py").write_text("def f():\n    from .. import api\n")
    edges = _graph(pkg)
    assert _cycles(edges) == [["mtp_engine.api", "mtp_engine.model.cache"]]
    assert _upward(edges) == ["mtp_engine.model.cache -> mtp_engine.api"]


def test_no_import_hook():
    """Old module paths are not mapped onto new ones (an import hook on `sys.meta_path`): one
    module, one name."""
    import importlib
    import sys

    import mtp_engine  # noqa: F401
    assert not any(type(f).__module__.startswith("mtp_engine") for f in sys.meta_path)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("mtp_engine.sampling")


def test_scripts_are_few_and_run_without_path_edits():
    """scripts/ stays a room a newcomer can use: benchmarks in `bench/`, fuzzers in `fuzz/`, tools
    beside them, at most 25 files, and no script edits `sys.path` (each imports the installed
    package, and in `bench/` the harness beside it)."""
    scripts = ROOT.parent / "scripts"
    files = [p for p in scripts.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    assert len(files) <= 25, sorted(str(p.relative_to(scripts)) for p in files)
    edits = [str(p.relative_to(scripts)) for p in files if p.suffix == ".py" and "sys.path." in p.read_text()]
    assert edits == []
    assert {p.parent.name for p in files} == {"scripts", "bench", "fuzz"}
