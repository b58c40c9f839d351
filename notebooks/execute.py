"""``python -m notebooks.execute [NAME...]``: execute notebooks, keep outputs.

Run from the repository root. For each notebook NAME (default: all of them,
``measures`` and ``results``), this reads ``notebooks/NAME.py`` (the jupytext
source of truth), executes it headless in a fresh kernel on this interpreter
and this working tree, and writes ``notebooks/NAME.ipynb`` with the outputs
(figures included), so the committed ``.ipynb`` shows them on a code-hosting
site. It replaces ``jupytext --sync`` followed by ``jupyter nbconvert
--execute --inplace`` and is what ``tests/project/test_notebooks.py`` checks against:

* the ``.ipynb`` holds the ``.py``'s cells;
* every code cell has been executed, without error;
* ``metadata.gbn_jax.code_sha256`` is the digest of the code cells that
  produced the outputs, so changed code with stale outputs fails the test
  (a markdown-only edit needs just ``jupytext --sync notebooks/NAME.py``);
* for a notebook that reads ``results/`` (``results``),
  ``metadata.gbn_jax.results_sha256`` is the digest of the runs it read, so
  new or changed runs with stale outputs fail the test too;
* executing the ``.py`` again gives the same outputs (figures compared by
  count, text exactly).

The kernel runs on XLA:CPU (the notebooks' float32 tolerances were set
there), with matplotlib's inline backend. Widget state (``ipywidgets``) is
not stored, nor are the widget views that point to it (a random
``model_id`` per run, which would change the file on every execution): the
interactive cells need a live kernel anyway, and their saved state would only
duplicate figures in the file. Executing twice writes the same bytes.
"""

from __future__ import annotations

import argparse
import base64
from collections.abc import Iterator, Sequence
import contextlib
import hashlib
import io
import json
import os
import pathlib
import sys
import tempfile
import time

import jupytext
import nbclient
import nbformat
from PIL import Image  # a dependency of matplotlib

REPO = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = REPO / "notebooks"
KERNEL_NAME = "gbn-jax-notebooks"
#: Per cell; only stops a hung kernel (a whole notebook takes about a minute).
CELL_TIMEOUT_S = 600
#: The notebooks whose outputs depend on the runs under ``results/``.
READS_RESULTS = frozenset({"results"})
#: The folders of ``results/`` (or of ``$GBN_RESULTS_DIR``) that the results
#: notebook reads: its SWEEPS, ACTIVATIONS and TIMING.
RESULTS_INPUTS = ("sweeps", "activations", "benchmarks/timing")
_PROG = "python -m notebooks.execute"


def is_notebook(path: pathlib.Path) -> bool:
  """Whether ``path`` is a jupytext notebook (a ``jupyter:`` YAML header)."""
  head = path.read_text().splitlines()[:3]
  return head[:1] == ["# ---"] and "# jupyter:" in head


def notebook_names() -> list[str]:
  """The notebooks of ``notebooks/``: its jupytext ``.py`` files."""
  return sorted(p.stem for p in NOTEBOOK_DIR.glob("*.py") if is_notebook(p))


def code_sha256(nb: nbformat.NotebookNode) -> str:
  """Digest of the code cells' sources (what the outputs depend on)."""
  sources = [c.source.strip() for c in nb.cells if c.cell_type == "code"]
  return hashlib.sha256(json.dumps(sources).encode()).hexdigest()


def results_dir() -> pathlib.Path:
  """The results folder the results notebook reads, as it chooses it."""
  return pathlib.Path(
      os.environ.get("GBN_RESULTS_DIR") or REPO / "results"
  ).resolve()


def results_sha256(root: pathlib.Path) -> str:
  """Digest of every file under ``root``'s :data:`RESULTS_INPUTS` folders.

  Each file counts by its path relative to ``root`` and its bytes; a missing
  folder counts as missing. Reading order and timestamps do not matter.
  """
  digest = hashlib.sha256()
  for folder in RESULTS_INPUTS:
    top = root / folder
    digest.update(f"{folder}\0{top.is_dir()}\0".encode())
    files = (
        sorted(p for p in top.rglob("*") if p.is_file()) if top.is_dir() else []
    )
    for path in files:
      digest.update(path.relative_to(root).as_posix().encode() + b"\0")
      digest.update(hashlib.sha256(path.read_bytes()).digest())
  return digest.hexdigest()


@contextlib.contextmanager
def kernel_environment() -> Iterator[str]:
  """Yields the name of a kernelspec for this interpreter, set up to run.

  The kernelspec lives in a temporary folder first on ``JUPYTER_PATH`` (so a
  ``python3`` kernel registered elsewhere cannot take over); the kernel gets
  this working tree first on ``PYTHONPATH``, matplotlib's inline backend
  (every figure rendered to PNG, no display needed) and ``JAX_PLATFORMS=cpu``.
  The environment is restored on exit.
  """
  with tempfile.TemporaryDirectory(prefix="gbn-jax-kernel-") as tmp:
    spec_dir = pathlib.Path(tmp) / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [
                    sys.executable,
                    "-m",
                    "ipykernel_launcher",
                    "-f",
                    "{connection_file}",
                ],
                "display_name": "gbn-jax notebooks",
                "language": "python",
            }
        )
    )

    def prepend(path: str, old: str | None) -> str:
      return os.pathsep.join(filter(None, [path, old]))

    changes = {
        "JUPYTER_PATH": prepend(tmp, os.environ.get("JUPYTER_PATH")),
        "PYTHONPATH": prepend(str(REPO), os.environ.get("PYTHONPATH")),
        "MPLBACKEND": "module://matplotlib_inline.backend_inline",
        "JAX_PLATFORMS": "cpu",
    }
    saved = {k: os.environ.get(k) for k in changes}
    os.environ.update(changes)
    try:
      yield KERNEL_NAME
    finally:
      for key, value in saved.items():
        if value is None:
          os.environ.pop(key, None)
        else:
          os.environ[key] = value


def execute(name: str, kernel_name: str) -> nbformat.NotebookNode:
  """Executes ``notebooks/NAME.py`` in the kernel; returns the notebook.

  The kernel starts in ``notebooks/``, as Jupyter starts it for a notebook
  there. The ipywidgets models (the outputs of ``interactive_output``
  included) are in ``metadata.widgets``; :func:`write` drops them.

  Raises:
    nbclient.exceptions.CellExecutionError: A cell raised; the message holds
      its source and traceback.
  """
  nb = jupytext.read(NOTEBOOK_DIR / f"{name}.py")
  client = nbclient.NotebookClient(
      nb,
      kernel_name=kernel_name,
      timeout=CELL_TIMEOUT_S,
      record_timing=False,
      # nbclient routes Output widgets' outputs into this state (and fails
      # without it).
      store_widget_state=True,
      resources={"metadata": {"path": str(NOTEBOOK_DIR)}},
  )
  client.execute()
  return nb


def smaller_png(data: str) -> str:
  """A base64 PNG as a 256-colour palette PNG, if that is smaller.

  Matplotlib's figures have few colours (anti-aliasing aside), so this
  looks the same at a third to a quarter of the bytes.
  """
  raw = base64.b64decode(data)
  image = Image.open(io.BytesIO(raw))
  if image.mode == "RGBA" and image.getextrema()[3][0] == 255:
    image = image.convert("RGB")  # opaque: MEDIANCUT needs RGB
  if image.mode not in ("RGB", "RGBA"):
    return data
  method = (
      Image.Quantize.MEDIANCUT
      if image.mode == "RGB"
      else Image.Quantize.FASTOCTREE
  )
  out = io.BytesIO()
  image.quantize(256, method=method).save(out, "PNG", optimize=True)
  if out.tell() >= len(raw):
    return data
  return base64.b64encode(out.getvalue()).decode("ascii")


#: The MIME type of an ipywidgets view: a reference (``model_id``, random per
#: run) to widget state that is not stored.
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def drop_widget_state(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
  """Removes widget state and widget views from ``nb``, in place; returns it.

  The views' ``model_id`` is a fresh random id on every execution, so kept
  it would rewrite the ``.ipynb`` each time; without the state it points to
  it renders nothing anyway. The view's ``text/plain`` stays (what a
  notebook viewer shows instead). Idempotent, and the result holds nothing
  that depends on a model id.
  """
  nb.metadata.pop("widgets", None)
  for cell in nb.cells:
    for output in cell.get("outputs", []):
      data = output.get("data")
      if data is not None and WIDGET_VIEW in data:
        del data[WIDGET_VIEW]
        if not data:
          data["text/plain"] = "(an interactive widget: run the notebook)"
  return nb


def write(name: str, nb: nbformat.NotebookNode) -> pathlib.Path:
  """Writes the executed ``nb`` to ``notebooks/NAME.ipynb``; returns the path.

  The ``.py`` is touched afterwards: Jupyter's jupytext integration refuses
  to open a pair whose ``.ipynb`` is newer than its text file.
  """
  drop_widget_state(nb)
  for cell in nb.cells:
    for output in cell.get("outputs", []):
      if "image/png" in output.get("data", {}):
        output.data["image/png"] = smaller_png(output.data["image/png"])
  nb.metadata.get("language_info", {}).pop("version", None)
  nb.metadata["gbn_jax"] = {"code_sha256": code_sha256(nb)}
  if name in READS_RESULTS:
    nb.metadata["gbn_jax"]["results_sha256"] = results_sha256(results_dir())
  # Ids from the cells' contents: re-executing does not rewrite them all.
  seen = set()
  for cell in nb.cells:
    digest = hashlib.sha256(
        f"{cell.cell_type}\0{cell.source.strip()}".encode()
    ).hexdigest()
    cell.id = next(
        digest[i : i + 8] for i in range(0, 57) if digest[i : i + 8] not in seen
    )
    seen.add(cell.id)
  path = NOTEBOOK_DIR / f"{name}.ipynb"
  # jupytext writes the ipynb as `jupytext --sync` would (its metadata
  # filters from notebooks/jupytext.toml), outputs included.
  jupytext.write(nb, path, fmt="ipynb")
  os.utime(NOTEBOOK_DIR / f"{name}.py")
  return path


def main(argv: Sequence[str] | None = None) -> int:
  names = notebook_names()
  parser = argparse.ArgumentParser(
      prog=_PROG,
      description="Executes notebooks/NAME.py and writes "
      "notebooks/NAME.ipynb with its outputs.",
  )
  parser.add_argument(
      "names",
      nargs="*",
      metavar="NAME",
      help="notebooks to run (default: all: " f"{', '.join(names)})",
  )
  args = parser.parse_args(argv)
  unknown = sorted(set(args.names) - set(names))
  if unknown:
    parser.error(
        f"no notebook {', '.join(unknown)}; notebooks: " f"{', '.join(names)}"
    )
  with kernel_environment() as kernel_name:
    for name in args.names or names:
      start = time.perf_counter()
      try:
        nb = execute(name, kernel_name)
      except nbclient.exceptions.CellExecutionError as e:
        print(
            f"{_PROG}: error: notebooks/{name}.py failed; notebooks/"
            f"{name}.ipynb left as it was.\n{e}",
            file=sys.stderr,
        )
        return 1
      path = write(name, nb)
      print(
          f"{path.relative_to(REPO)}: executed in "
          f"{time.perf_counter() - start:.0f} s, "
          f"{path.stat().st_size / 1024:.0f} KiB"
      )
  return 0


if __name__ == "__main__":
  sys.exit(main())
