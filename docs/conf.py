"""Sphinx configuration of the gbn-jax documentation (the flax/optax stack).

Build it with ``python -m sphinx -W -b html docs docs/_build/html`` after
``pip install -e '.[docs]'``. The notebooks render from their committed
outputs; nothing is executed at build time except the measures figure.
"""

import os
from pathlib import Path
import re
import sys

from flax import nnx
from sphinx.ext.autodoc.typehints import record_typehints
from sphinx.util import inspect as sphinx_inspect

# The checkout's gbn_jax (and train, for the training page's references).
sys.path.insert(0, os.path.abspath(".."))

import gbn_jax  # noqa: E402

project = "gbn-jax"
author = "gbn-jax authors"
copyright = "2026, gbn-jax authors"  # noqa: A001
release = gbn_jax.__version__
version = release

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
    "matplotlib.sphinxext.plot_directive",
]

exclude_patterns = ["_build", "**.ipynb_checkpoints"]
source_suffix = {
    ".rst": "restructuredtext",
    ".md": "myst-nb",
    ".ipynb": "myst-nb",
}

# Notebooks: rendered from the outputs committed in notebooks/*.ipynb
# (re-executed with `python -m notebooks.execute NAME`), never run here.
nb_execution_mode = "off"
# Their Markdown outputs (the results notebook's tables) as GitHub renders
# them; CommonMark, myst-nb's default, has no tables.
nb_render_markdown_format = "gfm"
myst_enable_extensions = ["dollarmath", "colon_fence"]
myst_heading_anchors = 3

# API reference: Google docstrings; type hints go to the documented arguments
# (a flax Module's dataclass signature is long enough without them).
autosummary_generate = True
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"
autodoc_default_options = {"members": True, "show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

# The measures figure is drawn from gbn_jax at build time (a second or two).
plot_include_source = True
plot_html_show_formats = False
plot_html_show_source_link = False
plot_formats = [("png", 110)]

html_theme = "sphinx_book_theme"
html_title = f"gbn-jax {release}"
html_theme_options = {
    "show_toc_level": 2,
    "use_download_button": False,
    # One search box, the sidebar's: pydata-sphinx-theme would otherwise put
    # a second one in a header bar above the page.
    "navbar_persistent": [],
}

# results/README.md and results/reports/*/report.md are included as they are
# (one source for the repository and the site). Their relative links and
# images point into results/; on the site a report becomes its page, another
# file a download, and a folder (a sweep) its name in code.
RESULTS = Path(__file__).resolve().parent.parent / "results"
REPORT_PAGES = {
    RESULTS / "reports" / folder / "report.md": page
    for folder, page in (
        ("convergence", "report.md"),
        ("gpu", "report_gpu.md"),
        ("gpu_resnet20", "report_gpu_resnet20.md"),
        ("calibration", "report_calibration.md"),
        ("small_batch", "report_small_batch.md"),
        ("cifar10_lenet_small_batch", "report_cifar10_small_batch.md"),
        ("cifar10_resnet20_subset", "report_resnet20_subset.md"),
    )
}
_LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")


def _results_links(app, relative_path, parent_docname, content):
  """Rewrites an included results/ file's relative links for docs/."""
  del parent_docname
  source = (Path(app.srcdir) / relative_path).resolve()
  if RESULTS not in source.parents:
    return

  def rewrite(match):
    bang, text, target = match.groups()
    if re.match(r"[a-z]+:|#", target):
      return match.group(0)
    path = (source.parent / target).resolve()
    if path in REPORT_PAGES and not bang:
      return f"[{text}]({REPORT_PAGES[path]})"
    if path.is_file():
      return f"{bang}[{text}]({os.path.relpath(path, app.srcdir)})"
    return text

  content[0] = _LINK.sub(rewrite, content[0])


def _nnx_signature(app, what, name, obj, options, signature, return_annotation):
  """An nnx Module's signature and parameter types: its ``__init__``'s.

  flax's nnx metaclass defines ``__call__(*args, **kwargs)``, which autodoc
  (and ``inspect``) take for the constructor's signature.
  """
  if what != "class" or not (
      isinstance(obj, type) and issubclass(obj, nnx.Module)
  ):
    return None
  init = sphinx_inspect.signature(obj.__init__, bound_method=True)
  show = app.config.autodoc_typehints not in ("none", "description")
  # The types of the parameters' descriptions (autodoc_typehints).
  record_typehints(
      app, what, name, obj.__init__, options, signature, return_annotation
  )
  return (
      sphinx_inspect.stringify_signature(
          init, show_annotation=show, show_return_annotation=False
      ),
      return_annotation,
  )


def setup(app):
  app.connect("include-read", _results_links)
  app.connect("autodoc-process-signature", _nnx_signature)
