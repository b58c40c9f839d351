"""README.md: short, its code runs, its links lead somewhere.

The README is the first page a newcomer reads: at most 80 lines (the
details live in docs/), its Python blocks run as written (in order, in one
fresh process on the CPU, as a reader pastes them), every relative link
resolves to a file of the repository (and an anchor into a Markdown page to
one of its headings), and the versions it names as tested are CI's pins.
"""

from __future__ import annotations

import pathlib
import re

import pytest

from tests.helpers.process import run_python_result

REPO = pathlib.Path(__file__).resolve().parents[2]
README = REPO / "README.md"
MAX_LINES = 80

_BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
# [text](target), not an image's; the target up to whitespace or ')'.
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _text() -> str:
  return README.read_text(encoding="utf-8")


def code_blocks(text: str, language: str) -> list[str]:
  return [body for lang, body in _BLOCK.findall(text) if lang == language]


def relative_links(text: str) -> list[str]:
  return [
      target
      for target in _LINK.findall(text)
      if not re.match(r"[a-z][a-z0-9+.-]*:", target)  # http:, mailto:, ...
  ]


def heading_anchors(markdown: str) -> set[str]:
  """GitHub's (and MyST's) anchors of a page's headings: lower case,
  punctuation dropped, spaces to hyphens (code blocks' lines skipped)."""
  outside_code = _BLOCK.sub("", markdown)
  anchors = set()
  for title in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", outside_code, re.MULTILINE):
    slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
    anchors.add(slug)
  return anchors


def broken_links(text: str, base: pathlib.Path) -> list[str]:
  """The relative links of ``text`` (a file in ``base``) that lead nowhere."""
  broken = []
  for target in relative_links(text):
    path, _, anchor = target.partition("#")
    file = (base / path).resolve() if path else base / README.name
    if not file.is_relative_to(REPO) or not file.exists():
      broken.append(target)
    elif anchor and file.suffix == ".md":
      if anchor not in heading_anchors(file.read_text(encoding="utf-8")):
        broken.append(target)
  return broken


def test_readme_is_at_most_80_lines():
  lines = _text().splitlines()
  assert len(lines) <= MAX_LINES, (
      f"README.md has {len(lines)} lines, at most {MAX_LINES}: move details"
      " to docs/"
  )


def test_readme_python_blocks_run():
  blocks = code_blocks(_text(), "python")
  assert blocks, "README.md shows no Python"
  code = "\n".join(blocks)
  finished = run_python_result(code, timeout=300)
  assert finished.returncode == 0, (
      f"README's Python failed:\n{code}\n--- stderr ---\n"
      + finished.stderr[-3000:]
  )


def test_readme_relative_links_resolve():
  links = relative_links(_text())
  assert links, "README.md links to nothing of the repository"
  assert broken_links(_text(), REPO) == []


def test_readme_shows_the_ci_test_command():
  """The README's full test command is the one .ci/run runs; the quick one
  is beside it."""
  full = "python -m pytest -q -n auto"
  quick = f'{full} -m "not slow"'
  shell = "\n".join(code_blocks(_text(), "bash"))
  readme = [line.split("#")[0].strip() for line in shell.splitlines()]
  assert quick in readme and full in readme
  ci = (REPO / ".ci" / "run").read_text().splitlines()
  assert full in [line.strip() for line in ci]


def test_readme_names_the_pinned_versions():
  pins = dict(
      line.split("==", 1)
      for line in (REPO / ".ci" / "constraints.txt").read_text().splitlines()
      if "==" in line
  )
  tested = re.search(
      r"Tested\s+with\s+Python\s+[\d.]+,\s+jax\s+(\S+),\s+flax\s+(\S+)", _text()
  )
  assert tested, "README.md has no 'Tested with' line"
  assert (tested.group(1), tested.group(2)) == (pins["jax"], pins["flax"])


@pytest.mark.parametrize(
    "text, broken",
    [
        ("[a](README.md) [b](docs/no_such_page.md)", ["docs/no_such_page.md"]),
        (
            "[a](docs/index.md#no-such-heading)",
            ["docs/index.md#no-such-heading"],
        ),
        ("[a](https://example.org/x.md) ![i](missing.png)", []),
        ("[a](../outside.md)", ["../outside.md"]),
    ],
)
def test_link_check_sees_broken_links(text, broken):
  assert broken_links(text, REPO) == broken


def test_anchors_follow_github():
  page = "# Getting started\n## What a distribution contains\n```\n# not one\n```\n"
  assert heading_anchors(page) == {
      "getting-started",
      "what-a-distribution-contains",
  }
