"""experiments/quickstart.ipynb runs top to bottom at its small size (KVJAX_NOTEBOOK_SMALL=1), on the CPU."""

import pathlib

import nbclient
import nbformat

REPO = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "experiments" / "quickstart.ipynb"


def test_quickstart_notebook_runs_small(monkeypatch):
  monkeypatch.setenv("KVJAX_NOTEBOOK_SMALL", "1")
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  nb = nbformat.read(NOTEBOOK, as_version=4)
  client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                   resources={"metadata": {"path": str(NOTEBOOK.parent)}})
  client.execute()  # raises CellExecutionError, with the cell and its traceback, on any failing cell
  outputs = "\n".join(o.get("text", "") for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", []))
  assert "kvjax from" in outputs and "ms/token" in outputs
  images = [o for cell in nb.cells for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]
  assert len(images) == 2  # the needle heatmap and the recall curve
