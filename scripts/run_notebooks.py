"""Runs the ablation notebooks (`docs/notebooks/`) top to bottom on the shipped model and stores
them with their outputs (figures, tables, the finding in words), so they read without running; the
test suite runs each again and checks that it still shows its figures and states its finding
(`tests/test_notebooks.py`). Run it after changing a notebook or what it measures.

    python scripts/run_notebooks.py                      # every notebook
    python scripts/run_notebooks.py a_nmax_pmin_sweep    # one (by its file name's stem)
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import nbclient
import nbformat

NOTEBOOKS = Path(__file__).resolve().parent.parent / "docs" / "notebooks"


def run(path: Path, timeout: int = 600) -> nbformat.NotebookNode:
    """The notebook at `path` executed in its own folder, without per-run metadata (timestamps),
    so a rerun that computes the same changes nothing but its measurements."""
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}}).execute()
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
    return nb


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help="notebooks to run (file name stems; default: all)")
    args = ap.parse_args(argv)
    paths = sorted(NOTEBOOKS.glob("*.ipynb"))
    unknown = set(args.names) - {p.stem for p in paths}
    if unknown:
        print(f"run_notebooks: no notebook named {', '.join(sorted(unknown))} in {NOTEBOOKS}", file=sys.stderr)
        return 2
    for path in paths:
        if args.names and path.stem not in args.names:
            continue
        t = time.perf_counter()
        print(f"{path.name}: running ...", file=sys.stderr, flush=True)
        nbformat.write(run(path), path)
        print(f"{path.name}: stored with its outputs ({time.perf_counter() - t:.0f} s)", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
