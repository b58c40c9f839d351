"""The documentation site: built as CI builds it, read as a person reads it.

The site is built once for this module with the README's command
(``python -m sphinx -W -b html docs OUT``, warnings as errors) and its HTML
checked where the configuration decides what a reader sees:

* the API page shows ``gbn_jax.nnx.GBatchNorm``'s constructor parameters in
  its summary table and class header (not the ``(*args, **kwargs)`` of nnx's
  metaclass), with their types in the parameter list;
* every page has one search box, the sidebar's, and no header bar with a
  second one;
* the notebook pages show the committed notebooks (``docs/notebooks/*`` are
  links to ``notebooks/*.ipynb``, rendered without executing them;
  ``tests/project/test_notebooks.py`` checks that those outputs are current), their
  Markdown tables as tables.

Needs the ``docs`` extra; skipped without it, unless ``GBN_EXPECT_DOCS=1``
(CI, whose only build of the site this is). Slow: one build of the site.
"""

from __future__ import annotations

import html
import importlib
import os
import pathlib
import re

import nbformat
import pytest

from tests.helpers.process import run_module

REPO = pathlib.Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
NOTEBOOKS = sorted(p.stem for p in (REPO / "notebooks").glob("*.ipynb"))


def _text(fragment: str) -> str:
  """The text a browser shows for an HTML fragment, whitespace collapsed."""
  text = html.unescape(re.sub(r"<[^>]+>", "", fragment))
  return " ".join(text.split())


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> pathlib.Path:
  for module in ("sphinx", "sphinx_book_theme", "myst_nb"):
    if os.environ.get("GBN_EXPECT_DOCS") == "1":
      importlib.import_module(module)  # CI builds the site here: no skip
    else:
      pytest.importorskip(module, reason="needs the docs extra")
  out = tmp_path_factory.mktemp("docs") / "html"
  build = run_module("sphinx", "-W", "-q", "-b", "html", str(DOCS), str(out))
  assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
  return out


def test_notebook_pages_are_the_committed_notebooks():
  """What the site renders is what notebooks/ commits, executed there."""
  conf = (DOCS / "conf.py").read_text()
  assert re.search(r'^nb_execution_mode = "off"$', conf, re.MULTILINE)
  assert NOTEBOOKS
  for name in NOTEBOOKS:
    page = DOCS / "notebooks" / f"{name}.ipynb"
    assert page.is_symlink(), f"docs/notebooks/{name}.ipynb is no link"
    assert page.resolve() == REPO / "notebooks" / f"{name}.ipynb"


@pytest.mark.slow
def test_nnx_layer_shows_its_constructor(site):
  page = (site / "api.html").read_text()
  rows = re.findall(r'<tr class="row-[a-z]+">(.*?)</tr>', page, re.DOTALL)
  summary = [
      _text(row) for row in rows if 'title="gbn_jax.nnx.GBatchNorm"' in row
  ]
  assert len(summary) == 1, summary
  assert summary[0].startswith("nnx.GBatchNorm(num_features, *[, measure,")
  header = re.search(
      r'<dt class="sig sig-object py" id="gbn_jax\.nnx\.GBatchNorm">(.*?)</dt>',
      page,
      re.DOTALL,
  )
  assert header, "no class entry for gbn_jax.nnx.GBatchNorm"
  signature = _text(header.group(1))
  for parameter in ("num_features, *, measure='sd'", "alpha=None", "rngs"):
    assert parameter in signature, signature
  assert "*args" not in signature, signature
  # The constructor's parameters are documented with their types.
  end = page.index('id="gbn_jax.nnx.GBatchNorm.__call__"', header.end())
  entry = _text(page[header.end() : end])
  assert "num_features (int) – the number of input features" in entry, entry


@pytest.mark.slow
@pytest.mark.parametrize("page", ["index.html", "api.html"])
def test_one_search_box(site, page):
  text = (site / page).read_text()
  boxes = re.findall(r'<button class="[^"]*\bsearch-button-field\b', text)
  assert len(boxes) == 1, f"{page}: {len(boxes)} search boxes"
  header = re.search(r"<header\b[^>]*>(.*?)</header>", text, re.DOTALL)
  assert header is None or "search" not in header.group(1), header.group(1)


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_page_shows_committed_outputs(site, name):
  page = _text((site / "notebooks" / f"{name}.html").read_text())
  nb = nbformat.read(REPO / "notebooks" / f"{name}.ipynb", as_version=4)
  printed = [
      line
      for cell in nb.cells
      if cell.cell_type == "code"
      for output in cell.outputs
      if output.output_type == "stream"
      for line in output.text.splitlines()
      if line.strip()
  ]
  assert printed, f"notebooks/{name}.ipynb prints nothing"
  for line in printed[:5]:
    assert " ".join(line.split()) in page, line


@pytest.mark.slow
def test_notebook_markdown_tables_render(site):
  """The results notebook's Markdown tables are HTML tables on the site."""
  nb = nbformat.read(REPO / "notebooks" / "results.ipynb", as_version=4)
  tables = sum(
      output.get("data", {}).get("text/markdown", "").count("\n|---")
      for cell in nb.cells
      if cell.cell_type == "code"
      for output in cell.outputs
  )
  assert tables
  page = (site / "notebooks" / "results.html").read_text()
  assert page.count("<table") >= tables
