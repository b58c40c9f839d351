"""The notebooks: paired .py/.ipynb in sync, committed clean, and executable.

``notebooks/*.py`` (jupytext percent format) is the source of truth, paired
with ``notebooks/*.ipynb`` by ``notebooks/jupytext.toml``. Executing a notebook
is a test of the library: its ``assert`` cells check numerical facts (the
fraction of zeros after SQD + ReLU, the bPOE identity) against numpy.

The execution test starts a Jupyter kernel on this interpreter (a temporary
kernelspec, so a ``python3`` kernel registered elsewhere cannot hijack it), on
this working tree's ``gbn_jax`` (PYTHONPATH), with matplotlib's inline backend,
which renders every figure to PNG without a display. Needs the ``notebooks``
extra (jupytext, ipykernel, matplotlib) and nbclient (a dependency of nbmake
and of jupyter's nbconvert).
"""

from __future__ import annotations

import difflib
import json
import os
import pathlib
import sys
import time

import jupytext
import nbclient
import nbformat
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = REPO / "notebooks"
NOTEBOOKS = sorted(p.stem for p in NOTEBOOK_DIR.glob("*.py"))
# The notebook must finish well within this (it takes ~40 s on a busy
# 2-core CPU); the limit only stops a hung kernel.
CELL_TIMEOUT_S = 600


def _cells(nb) -> list[tuple[str, str]]:
  return [(cell.cell_type, cell.source.strip()) for cell in nb.cells]


def _render(cells: list[tuple[str, str]]) -> list[str]:
  """Lines of all cells, each cell headed by its type, for a readable diff."""
  lines = []
  for kind, source in cells:
    lines.append(f"# <{kind} cell>\n")
    lines.extend(line + "\n" for line in source.splitlines())
  return lines


def test_notebooks_found():
  assert "measures" in NOTEBOOKS


def test_pairing_is_configured():
  from jupytext.config import find_jupytext_configuration_file
  from jupytext.config import load_jupytext_configuration_file

  path = find_jupytext_configuration_file(str(NOTEBOOK_DIR))
  assert path is not None and pathlib.Path(path).parent == NOTEBOOK_DIR
  formats = ",".join(
      load_jupytext_configuration_file(path).formats
  ).replace(" ", "").split(",")
  assert "ipynb" in formats and "py:percent" in formats, formats


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_ipynb_matches_py(name):
  py_nb = jupytext.read(NOTEBOOK_DIR / f"{name}.py")
  assert py_nb.metadata["jupytext"]["text_representation"]["format_name"] == (
      "percent"
  )
  ipynb_path = NOTEBOOK_DIR / f"{name}.ipynb"
  assert ipynb_path.exists(), f"run: jupytext --sync notebooks/{name}.py"
  ipynb = nbformat.read(ipynb_path, as_version=4)
  nbformat.validate(ipynb)
  expected, actual = _cells(py_nb), _cells(ipynb)
  if expected != actual:
    diff = "".join(difflib.unified_diff(
        _render(expected), _render(actual), f"{name}.py", f"{name}.ipynb"
    ))
    pytest.fail(
        f"notebooks/{name}.ipynb is out of sync with notebooks/{name}.py; run"
        f" `jupytext --sync notebooks/{name}.py`.\n{diff}"
    )
  assert ipynb.metadata.get("kernelspec", {}).get("name") == "python3"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_ipynb_committed_without_outputs(name):
  ipynb = nbformat.read(NOTEBOOK_DIR / f"{name}.ipynb", as_version=4)
  dirty = [
      i for i, cell in enumerate(ipynb.cells)
      if cell.cell_type == "code" and (cell.outputs or cell.execution_count)
  ]
  assert not dirty, (
      f"cells {dirty} of notebooks/{name}.ipynb have outputs; clear them"
      " (e.g. `jupyter nbconvert --clear-output --inplace`)."
  )


@pytest.fixture
def kernel_name(tmp_path, monkeypatch) -> str:
  """A kernelspec for this interpreter, found first through JUPYTER_PATH."""
  name = "gbn-jax-test"
  spec_dir = tmp_path / "jupyter" / "kernels" / name
  spec_dir.mkdir(parents=True)
  (spec_dir / "kernel.json").write_text(json.dumps({
      "argv": [sys.executable, "-m", "ipykernel_launcher", "-f",
               "{connection_file}"],
      "display_name": "gbn-jax tests",
      "language": "python",
  }))
  monkeypatch.setenv(
      "JUPYTER_PATH",
      os.pathsep.join(filter(None, [str(tmp_path / "jupyter"),
                                    os.environ.get("JUPYTER_PATH")])),
  )
  # The inline backend renders figures to PNG with no display, so a broken
  # plot fails here (Agg would only draw on savefig).
  monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
  monkeypatch.setenv(
      "PYTHONPATH",
      os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
  )
  # The notebook's float32 tolerances were set on XLA:CPU; run it there.
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  return name


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_executes(name, kernel_name):
  # The .py and the .ipynb hold the same cells (test_ipynb_matches_py).
  nb = jupytext.read(NOTEBOOK_DIR / f"{name}.py")
  client = nbclient.NotebookClient(
      nb,
      kernel_name=kernel_name,
      timeout=CELL_TIMEOUT_S,
      resources={"metadata": {"path": str(NOTEBOOK_DIR)}},
  )
  start = time.perf_counter()
  # A failing cell (an assert of the notebook) raises CellExecutionError with
  # the cell's source and traceback.
  client.execute()
  print(f"notebooks/{name}: executed in {time.perf_counter() - start:.1f} s")

  plotting = [cell for cell in nb.cells
              if cell.cell_type == "code" and "plt.show()" in cell.source]
  assert plotting
  for cell in plotting:
    kinds = [output.get("data", {}).keys() for output in cell.outputs]
    assert any("image/png" in k for k in kinds), (
        f"no figure rendered by the cell:\n{cell.source[:300]}"
    )
  for cell in nb.cells:
    if cell.cell_type == "code":
      for output in cell.outputs:
        assert output.output_type != "error", output
