"""notebooks/quickstart.ipynb runs top to bottom on CPU (8 fake devices) and is committed clean."""

import os
import pathlib

import pytest
from param_utils import single_device_env

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

REPO = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "notebooks" / "quickstart.ipynb"


def test_committed_without_outputs():
  """Outputs would go stale as the code changes: the notebook is committed stripped."""
  nb = nbformat.read(NOTEBOOK, as_version=4)
  for i, cell in enumerate(nb.cells):
    if cell.cell_type == "code":
      assert cell.outputs == [] and cell.execution_count is None and (
          "execution" not in cell.metadata), (
          f"cell {i} has outputs; strip them: python tools/strip_notebooks.py")


def test_the_sites_copy_has_the_notebooks_cells_and_outputs():
  """docs/notebooks/quickstart.ipynb, the run the documentation site shows, is this notebook's
  cells with their outputs (`python tools/render_notebook.py` makes it: rerun it when the
  notebook changes)."""
  site = nbformat.read(REPO / "docs" / "notebooks" / "quickstart.ipynb", as_version=4)
  source = nbformat.read(NOTEBOOK, as_version=4)
  cells = lambda nb: [(c.cell_type, c.source) for c in nb.cells]
  assert cells(site) == cells(source), "stale: run python tools/render_notebook.py"
  outputs = [o for c in site.cells if c.cell_type == "code" for o in c.outputs]
  text = "\n".join(o.get("text", "") for o in outputs)
  assert "speculative K=3: same text" in text and "served:" in text
  assert any("image/png" in o.get("data", {}) for o in outputs)  # the acceptance plot
  assert not any(o.get("output_type") == "error" for o in outputs)


@pytest.mark.slow
def test_runs_top_to_bottom(monkeypatch):
  nb = nbformat.read(NOTEBOOK, as_version=4)
  # The kernel inherits this environment: this checkout's packages, 8 fake CPU devices, and the
  # kernel's own (inline) matplotlib backend so the plot is an output.
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
      p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 "
                     + single_device_env()["XLA_FLAGS"])
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.delenv("MPLBACKEND", raising=False)
  client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                   resources={"metadata": {"path": str(NOTEBOOK.parent)}})
  client.execute()  # raises CellExecutionError with the failing cell's traceback
  text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                   for o in c.outputs)
  assert "speculative K=3: same text" in text
  assert "converted checkpoint generates" in text
  assert "identical to one device" in text and "'data'" in text
  images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if "image/png" in o.get("data", {})]
  assert len(images) == 1  # the acceptance-per-position plot
  assert "image features); answer ids" in text  # the image cell (the multimodal tiny model)
  assert "served:" in text  # the server cell got an answer from scripts/serve.py
