"""The notebooks: paired .py/.ipynb in sync, committed executed, executable.

``notebooks/*.py`` (jupytext percent format) is the source of truth, paired
with ``notebooks/*.ipynb`` by ``notebooks/jupytext.toml``. The ``.ipynb`` is
committed *with* its outputs, so that its figures show on a code-hosting
site; ``python -m notebooks.execute [NAME]`` regenerates it. The tests check:

* the ``.ipynb`` holds the ``.py``'s cells (sources);
* the committed ``.ipynb`` is executed: every code cell in order, without
  error, from the code it holds now (``metadata.gbn_jax.code_sha256``) and,
  for ``results``, on the runs ``results/`` holds now
  (``metadata.gbn_jax.results_sha256``), with its figures, without widget
  state;
* executing the ``.py`` headless succeeds (a failing ``assert`` cell of the
  notebook fails the test), gives the committed outputs (text exactly, once
  memory addresses are masked; figures by count, per cell), and the
  interactive widget renders its default figure.
  ``measures``' assert cells check numerical facts against numpy (the
  fraction of zeros after SQD + ReLU, the bPOE identity); ``results`` is also
  run on a made-up results folder (unfinished, failed, half-written and
  recorded runs) and on an empty one.

The kernel (``notebooks/execute.py``'s, shared with the regeneration
command) runs this interpreter on this working tree's packages with
matplotlib's inline backend, which renders every figure to PNG without a
display. Needs the ``notebooks`` extra (``results`` reads runs with
``train.report``, which needs only numpy and matplotlib).
"""

from __future__ import annotations

import copy
import difflib
import importlib.util
import json
import pathlib
import re
import time

import jupytext
import nbformat
import pytest

from tests.helpers.run_folders import curvature_line

REPO = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOK_DIR = REPO / "notebooks"


def _load_execute():
  """``notebooks/execute.py`` as a module (``notebooks`` is no package)."""
  spec = importlib.util.spec_from_file_location(
      "gbn_notebooks_execute", NOTEBOOK_DIR / "execute.py"
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


execute = _load_execute()
NOTEBOOKS = execute.notebook_names()
#: Their outputs depend on what results/ holds now, not only on the code.
DEPENDS_ON_RESULTS = execute.READS_RESULTS
REGENERATE = "python -m notebooks.execute {name}"
#: A committed notebook must stay reviewable and cheap to clone.
MAX_IPYNB_BYTES = 2 * 2**20
#: Code cells that draw a figure at their top level (not inside a def).
_SHOWS = re.compile(r"^(plt\.show\(\)|display\(Image\()", re.MULTILINE)


def _cells(nb) -> list[tuple[str, str]]:
  return [(cell.cell_type, cell.source.strip()) for cell in nb.cells]


def _render(cells: list[tuple[str, str]]) -> list[str]:
  """Lines of all cells, each cell headed by its type, for a readable diff."""
  lines = []
  for kind, source in cells:
    lines.append(f"# <{kind} cell>\n")
    lines.extend(line + "\n" for line in source.splitlines())
  return lines


def _code(nb) -> list[nbformat.NotebookNode]:
  return [cell for cell in nb.cells if cell.cell_type == "code"]


def _has_png(outputs) -> bool:
  return any("image/png" in output.get("data", {}) for output in outputs)


def _errors(outputs) -> list[str]:
  return [
      f"{o.get('ename')}: {o.get('evalue')}"
      for o in outputs
      if o.get("output_type") == "error"
  ]


def _committed(name: str) -> nbformat.NotebookNode:
  return nbformat.read(NOTEBOOK_DIR / f"{name}.ipynb", as_version=4)


def test_notebooks_found():
  assert {"measures", "results"} <= set(NOTEBOOKS)
  assert "execute" not in NOTEBOOKS  # the script is no notebook


def test_pairing_is_configured():
  from jupytext.config import find_jupytext_configuration_file
  from jupytext.config import load_jupytext_configuration_file

  path = find_jupytext_configuration_file(str(NOTEBOOK_DIR))
  assert path is not None and pathlib.Path(path).parent == NOTEBOOK_DIR
  formats = (
      ",".join(load_jupytext_configuration_file(path).formats)
      .replace(" ", "")
      .split(",")
  )
  assert "ipynb" in formats and "py:percent" in formats, formats


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_ipynb_matches_py(name):
  py_nb = jupytext.read(NOTEBOOK_DIR / f"{name}.py")
  assert py_nb.metadata["jupytext"]["text_representation"]["format_name"] == (
      "percent"
  )
  ipynb_path = NOTEBOOK_DIR / f"{name}.ipynb"
  assert ipynb_path.exists(), f"run: {REGENERATE.format(name=name)}"
  ipynb = nbformat.read(ipynb_path, as_version=4)
  nbformat.validate(ipynb)
  expected, actual = _cells(py_nb), _cells(ipynb)
  if expected != actual:
    diff = "".join(
        difflib.unified_diff(
            _render(expected), _render(actual), f"{name}.py", f"{name}.ipynb"
        )
    )
    pytest.fail(
        f"notebooks/{name}.ipynb is out of sync with notebooks/{name}.py; run"
        f" `{REGENERATE.format(name=name)}` (or, after a markdown-only"
        f" change, `jupytext --sync notebooks/{name}.py`).\n{diff}"
    )
  assert ipynb.metadata.get("kernelspec", {}).get("name") == "python3"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_ipynb_committed_executed(name):
  ipynb = _committed(name)
  fix = f"; run `{REGENERATE.format(name=name)}`"
  code = _code(ipynb)
  counts = [cell.execution_count for cell in code]
  assert counts == list(range(1, len(code) + 1)), (
      f"notebooks/{name}.ipynb is not executed top to bottom in one kernel"
      f" (execution counts {counts}){fix}"
  )
  errors = {i: _errors(cell.outputs) for i, cell in enumerate(code)}
  assert not any(errors.values()), (errors, fix)
  stamp = ipynb.metadata.get("gbn_jax", {}).get("code_sha256")
  assert stamp == execute.code_sha256(ipynb), (
      f"the outputs of notebooks/{name}.ipynb come from other code than its"
      f" cells hold now{fix}"
  )
  if name in DEPENDS_ON_RESULTS:
    stamp = ipynb.metadata["gbn_jax"].get("results_sha256")
    assert stamp == execute.results_sha256(REPO / "results"), (
        f"the outputs of notebooks/{name}.ipynb come from other runs than"
        f" results/ holds now{fix}"
    )
  assert any(
      _has_png(cell.outputs) for cell in code
  ), f"notebooks/{name}.ipynb has no figure{fix}" + (
      " where results/ holds runs" if name in DEPENDS_ON_RESULTS else ""
  )
  for cell in code:
    if _SHOWS.search(cell.source):
      assert _has_png(
          cell.outputs
      ), f"no figure in the committed cell{fix}:\n{cell.source[:300]}"
  assert (
      "widgets" not in ipynb.metadata
  ), f"notebooks/{name}.ipynb stores widget state{fix}"
  size = (NOTEBOOK_DIR / f"{name}.ipynb").stat().st_size
  assert size <= MAX_IPYNB_BYTES, (
      f"notebooks/{name}.ipynb has {size / 2**20:.1f} MiB; make its figures"
      " smaller"
  )


def _widget_notebook() -> nbformat.NotebookNode:
  """A small executed notebook with widget views and widget state."""
  nb = nbformat.v4.new_notebook()
  cell = nbformat.v4.new_code_cell("display(slider)")
  cell.outputs = [
      nbformat.v4.new_output(
          "display_data",
          data={
              execute.WIDGET_VIEW: {
                  "model_id": "dd353ed5e9ea4897889d093f1f39f8aa",
                  "version_major": 2,
                  "version_minor": 0,
              },
              "text/plain": "IntSlider(value=3)",
          },
      ),
      nbformat.v4.new_output(
          "display_data",
          data={
              execute.WIDGET_VIEW: {
                  "model_id": "0123",
                  "version_major": 2,
                  "version_minor": 0,
              }
          },
      ),
      nbformat.v4.new_output("stream", text="3\n"),
  ]
  nb.cells = [nbformat.v4.new_markdown_cell("# x", id="cell-a"), cell]
  cell.id = "cell-b"  # random by default; write() derives them from content
  nb.metadata["widgets"] = {
      "application/vnd.jupyter.widget-state+json": {
          "state": {"dd353ed5e9ea4897889d093f1f39f8aa": {"model_name": "x"}},
          "version_major": 2,
          "version_minor": 0,
      }
  }
  return nb


def test_drop_widget_state_removes_every_model_id_idempotently():
  nb = execute.drop_widget_state(_widget_notebook())
  text = nbformat.writes(nb)
  assert "model_id" not in text and "widget-" not in text
  outputs = nb.cells[1].outputs
  assert outputs[0].data == {"text/plain": "IntSlider(value=3)"}
  assert list(outputs[1].data) == ["text/plain"]  # never an empty bundle
  assert outputs[2].text == "3\n"
  nbformat.validate(nb)
  assert nbformat.writes(execute.drop_widget_state(nb)) == text
  # Two executions differ only in their random model ids: same result.
  other = _widget_notebook()
  other.cells[1].outputs[0].data[execute.WIDGET_VIEW]["model_id"] = "f" * 32
  other.metadata.widgets["application/vnd.jupyter.widget-state+json"][
      "state"
  ] = {"f" * 32: {"model_name": "x"}}
  assert nbformat.writes(execute.drop_widget_state(other)) == text


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_ipynb_holds_no_widget_ids(name):
  """What `python -m notebooks.execute` writes: no per-run model id."""
  path = NOTEBOOK_DIR / f"{name}.ipynb"
  assert "model_id" not in path.read_text(), (
      f"notebooks/{name}.ipynb holds a widget model_id; run "
      f"`{REGENERATE.format(name=name)}`"
  )
  committed = _committed(name)
  before = nbformat.writes(committed)
  assert nbformat.writes(execute.drop_widget_state(committed)) == before


@pytest.fixture(scope="module")
def kernel_name():
  with execute.kernel_environment() as name:
    yield name


def _execute(name: str, kernel_name: str) -> nbformat.NotebookNode:
  start = time.perf_counter()
  # A failing cell (an assert of the notebook) raises CellExecutionError with
  # the cell's source and traceback.
  nb = execute.execute(name, kernel_name)
  print(f"notebooks/{name}: executed in {time.perf_counter() - start:.1f} s")
  for cell in _code(nb):
    assert not _errors(cell.outputs), (cell.source[:300], cell.outputs)
  return nb


def _widget_outputs(nb) -> list[list[dict]]:
  """The outputs held by each Output widget (interactive_output's)."""
  state = (
      nb.metadata.get("widgets", {})
      .get("application/vnd.jupyter.widget-state+json", {})
      .get("state", {})
  )
  return [
      model["state"].get("outputs", [])
      for model in state.values()
      if model.get("model_name") == "OutputModel"
  ]


#: What legitimately differs between two executions of the same cell.
_ADDRESS = re.compile(r"\b0x[0-9a-fA-F]+\b")


def _comparable(nb) -> list[list[str]]:
  """Per code cell, its outputs as lines to compare between executions.

  The outputs as :func:`execute.write` stores them (no widget views), with
  consecutive stream outputs of one stream joined (the kernel may flush a
  cell's prints in several messages), memory addresses masked (object
  reprs) and images stood for by their MIME type and display metadata:
  their bytes depend on the matplotlib, freetype and Pillow builds, and
  what they plot is in the text outputs beside them. Every other MIME type
  (``text/plain``, ``text/markdown``, ``text/html``, ...) is kept whole.
  """
  nb = execute.drop_widget_state(copy.deepcopy(nb))
  cells = []
  for cell in _code(nb):
    lines = []
    stream = None
    for output in cell.outputs:
      kind = output.output_type
      if kind == "stream":
        if stream != output.name:
          lines.append(f"[{output.name}]")
        stream = output.name
        lines.extend(_ADDRESS.sub("0x…", output.text).splitlines())
        continue
      stream = None
      lines.append(f"[{kind}]")
      if kind == "error":
        lines.append(f"{output.ename}: {output.evalue}")
        continue
      for mime, value in sorted(output.get("data", {}).items()):
        if mime.startswith("image/"):
          meta = output.get("metadata", {}).get(mime, {})
          lines.append(f"<{mime} {json.dumps(meta, sort_keys=True)}>")
        else:
          if not isinstance(value, str):
            value = json.dumps(value, sort_keys=True, indent=1)
          lines.append(f"<{mime}>")
          lines.extend(_ADDRESS.sub("0x…", value).splitlines())
    cells.append(lines)
  return cells


def _output_diff(name: str, committed, executed) -> str:
  """A unified diff of the cells whose outputs differ, the first ones."""
  parts = []
  cells = zip(_code(committed), _comparable(committed), _comparable(executed))
  for index, (cell, old, new) in enumerate(cells):
    if old != new:
      parts.append(
          f"code cell {index}: {cell.source.strip().splitlines()[0][:70]}\n"
      )
      parts.extend(
          difflib.unified_diff(
              [line + "\n" for line in old],
              [line + "\n" for line in new],
              f"notebooks/{name}.ipynb",
              "executed now",
              n=1,
          )
      )
  text = "".join(parts)
  return text if len(text) < 6000 else text[:6000] + "\n[...]"


def test_comparable_masks_only_what_varies():
  nb = _widget_notebook()
  cell = nb.cells[1]
  cell.outputs += [
      nbformat.v4.new_output("stream", text="4\n"),
      nbformat.v4.new_output(
          "display_data",
          data={
              "text/plain": "[<matplotlib.lines.Line2D at 0x7f2a1c>]",
              "image/png": "iVBORw0KGgo=",
          },
          metadata={"image/png": {"width": 900}},
      ),
  ]
  other = copy.deepcopy(nb)
  figure = other.cells[1].outputs[4].data
  figure["text/plain"] = "[<matplotlib.lines.Line2D at 0x55d0e8>]"
  figure["image/png"] = "other bytes"
  other.cells[1].outputs[0].data[execute.WIDGET_VIEW]["model_id"] = "f" * 32
  assert (
      _comparable(other)
      == _comparable(nb)
      == [
          [
              "[display_data]",
              "<text/plain>",
              "IntSlider(value=3)",
              "[display_data]",
              "<text/plain>",
              "(an interactive widget: run the notebook)",
              "[stdout]",
              "3",
              "4",
              "[display_data]",
              '<image/png {"width": 900}>',
              "<text/plain>",
              "[<matplotlib.lines.Line2D at 0x…>]",
          ]
      ]
  )
  # A changed number, a missing figure, another figure size: all differ.
  for change in (
      lambda outputs: outputs[2].update(text="5\n"),
      lambda outputs: outputs.pop(),
      lambda outputs: outputs[4].metadata.update({"image/png": {}}),
  ):
    changed = copy.deepcopy(nb)
    change(changed.cells[1].outputs)
    assert _comparable(changed) != _comparable(nb)
    assert "code cell 0: display(slider)" in _output_diff("x", nb, changed)


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_executes(name, kernel_name):
  nb = _execute(name, kernel_name)
  committed_nb = _committed(name)
  committed = _code(committed_nb)
  code = _code(nb)
  assert len(code) == len(committed)  # test_ipynb_matches_py says which

  for cell in code:
    if _SHOWS.search(cell.source):
      assert _has_png(
          cell.outputs
      ), f"no figure rendered by the cell:\n{cell.source[:300]}"
  # The committed outputs are what executing the notebook gives now (for
  # results, on the runs results/ holds now): the site and a code-hosting
  # site show them as they are.
  if _comparable(committed_nb) != _comparable(nb):
    pytest.fail(
        f"notebooks/{name}.ipynb does not hold the outputs that executing it"
        f" gives now; run `{REGENERATE.format(name=name)}`.\n"
        + _output_diff(name, committed_nb, nb)
    )

  # interactive_output ran its function once, with the widgets' defaults,
  # into its Output widget (an exception there fails no cell).
  widget_outputs = _widget_outputs(nb)
  for outputs in widget_outputs:
    assert not _errors(outputs), outputs
  if any("interactive_output(" in cell.source for cell in code):
    assert any(
        _has_png(outputs) for outputs in widget_outputs
    ), "the interactive panel rendered no figure for its default values"


# --- the results notebook on made-up results -------------------------------

_CONFIG = {
    "dataset": "fashion_mnist",
    "model": "lenet",
    "norm": "bn",
    "epochs": 3,
    "batch_size": 1000,
    "learning_rate": 0.01,
    "momentum": 0.0,
    "weight_decay": 0.0005,
    "augment": False,
    "seed": 0,
    "eval_every": 1,
    "norm_momentum": 0.9,
    "norm_epsilon": 1e-05,
}


def _run(folder: pathlib.Path, errors: list[float], **config) -> pathlib.Path:
  """A run directory as train.mnist writes it, with these test errors."""
  folder.mkdir(parents=True)
  (folder / "config.json").write_text(json.dumps({**_CONFIG, **config}))
  rows, elapsed = [], 0.0
  for epoch, error in enumerate(errors, start=1):
    elapsed += 20.0 + epoch
    rows.append(
        {
            "epoch": epoch,
            "train_loss": 1.0 / epoch + error,
            "test_error": error,
            "seconds": 20.0 + epoch,
            "elapsed_seconds": elapsed,
        }
    )
  (folder / "metrics.jsonl").write_text(
      "".join(json.dumps(row) + "\n" for row in rows)
  )
  return folder


def _activations(folder: pathlib.Path) -> None:
  percentiles = [10, 50, 90]
  with open(folder / "activations.jsonl", "w") as f:
    for step in range(0, 30, 10):
      f.write(
          json.dumps(
              {
                  "step": step,
                  "epoch": 1 + step // 20,
                  "layer": "norm1",
                  "feature": 0,
                  "percentiles": percentiles,
                  "before": [-1.0 - step / 30, 0.1, 1.0 + step / 30],
                  "after": [-1.2, 0.0, 1.2],
              }
          )
          + "\n"
      )


@pytest.fixture
def made_up_results(tmp_path) -> pathlib.Path:
  """Two settings (two learning rates) of a sweep and a recorded run."""
  sweep = tmp_path / "results" / "sweeps" / "fmnist"
  for lr, worse in ((0.01, 0.0), (0.1, 0.05)):
    for seed in (0, 1):
      _run(
          sweep / f"bn-lr{lr}-seed{seed}",
          [0.3, 0.25, 0.2 + seed / 100 + worse],
          learning_rate=lr,
          seed=seed,
      )
      _run(
          sweep / f"sqd1-lr{lr}-seed{seed}",
          [0.28, 0.22, 0.19 - seed / 100 + worse],
          norm="sqd1",
          learning_rate=lr,
          seed=seed,
      )
  # Curvature measured at the last epoch of sqd1's lr 0.1 runs.
  for seed, (top, trace) in enumerate(((10.0, 300.0), (12.0, 500.0))):
    line = curvature_line(
        3, top, trace, parameters=100, weight_decay=_CONFIG["weight_decay"]
    )
    (sweep / f"sqd1-lr0.1-seed{seed}" / "curvature.jsonl").write_text(
        json.dumps(line) + "\n"
    )
  _run(sweep / "rsd-lr0.01-seed0", [0.3], norm="rsd")  # unfinished
  failed = _run(sweep / "rsd-lr0.01-seed1", [0.5], norm="rsd", seed=1)
  (failed / "sweep_status.json").write_text(
      json.dumps({"status": "failed", "error": "training loss became nan"})
  )
  _run(sweep / "mad-lr0.01-seed0", [], norm="mad")  # started: no epoch yet
  half = _run(sweep / "mad-lr0.01-seed1", [0.3], norm="mad", seed=1)
  with open(half / "metrics.jsonl", "a") as f:  # a line being written
    f.write('{"epoch": 2, "train_lo')
  for norm in ("bn", "sqd1"):
    _activations(
        _run(
            tmp_path / "results" / "activations" / norm,
            [0.3],
            norm=norm,
            epochs=1,
        )
    )
  return tmp_path / "results"


def _text(nb) -> str:
  """Everything the notebook printed or rendered as text."""
  parts = []
  for cell in _code(nb):
    for output in cell.outputs:
      parts.append("".join(output.get("text", "")))
      data = output.get("data", {})
      parts.append("".join(data.get("text/markdown", "")))
  return "\n".join(parts)


@pytest.mark.slow
def test_results_notebook_on_partial_results(
    made_up_results, kernel_name, monkeypatch
):
  monkeypatch.setenv("GBN_RESULTS_DIR", str(made_up_results))
  nb = _execute("results", kernel_name)
  text = _text(nb)
  pngs = sum(
      output.get("data", {}).keys() >= {"image/png"}
      for cell in _code(nb)
      for output in cell.outputs
  )
  # Curves of the two settings, the curvature figure, one activations figure.
  assert pngs == 4
  # The curvature of sqd1's two seeds: mean ± std, the penalty taken off.
  assert "| 3 | 2 | 11.00 ± 1.41 | 400.0 ± 141.4 |" in text
  assert "| setting | bn | mad | rsd | sqd1 |" in text
  assert "1 unfinished (1/3 epochs); 1 failed (1/3 epochs)" in text  # rsd
  assert "1 unfinished (0/3 epochs)" in text  # mad: no epoch yet
  assert "| sqd1 | 18.50 ± 0.71 | 0.01 |" in text  # its best learning rate
  # The half-written run is skipped, with find_runs' warning.
  assert "warning: skipped" in text and "mad-lr0.01-seed1" in text


@pytest.mark.slow
def test_results_notebook_without_results(tmp_path, kernel_name, monkeypatch):
  monkeypatch.setenv("GBN_RESULTS_DIR", str(tmp_path / "nothing"))
  nb = _execute("results", kernel_name)
  text = _text(nb)
  assert "sweeps/ does not exist" in text
  assert "activations/ does not exist" in text
  assert not any(_has_png(cell.outputs) for cell in _code(nb))
