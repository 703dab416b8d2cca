"""The ablation notebooks are stored with their outputs (`scripts/run_notebooks.py` writes them) and
still run top to bottom on the shipped model, showing their figures and stating their finding."""
from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "docs" / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stored_with_its_outputs_and_still_states_its_finding(path):
    stored = nbformat.read(path, as_version=4)
    _shows_its_finding(stored, "stored (run scripts/run_notebooks.py)")
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}}).execute()
    _shows_its_finding(nb, "run now")


def _shows_its_finding(nb, which: str) -> None:
    for cell in nb.cells:  # a figure must show in the notebook, not vanish into a non-interactive backend
        if cell.cell_type == "code" and "plt.show()" in cell.source:
            assert any("image/png" in o.get("data", {}) for o in cell.outputs), f"{which}: a plotting cell shows no figure"
    last = nb.cells[-1]
    text = "".join(o.get("text", "") for o in last.outputs if o.output_type == "stream")
    assert len(text.split()) > 15, f"{which}: the last cell must state the finding in words"
