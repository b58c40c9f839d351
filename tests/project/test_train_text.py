"""train/'s text says what the code does, not what was measured or changed.

Figures measured on a machine belong in ``docs/performance.md`` or
``results/``, next to the command and the machine that produced them;
history belongs in the changelog and git. This scans every line of
``train/**/*.py`` and ``train/native/csrc/*`` (code, comments, docstrings,
messages), and each argparse help, description and epilog as one string,
so a figure split over implicitly joined literals is found too.
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
TRAIN = REPO / "train"

# Each pattern names one kind of narration. They are written for prose, so
# identifiers, format strings and constants in the code do not match (the
# cases at the bottom of this file check both ways).
NARRATION: dict[str, re.Pattern[str]] = {
    "hardware": re.compile(
        r"\b(?:[ABHLV]100|H200|GH200|B200|MI\d{3}X?|EPYC|Xeon|Ryzen"
        r"|TPU ?v\d\w*)\b"
        r"|\b\d+-core\b|\bon \d+ cores\b|\bdevelopment machine\b"
    ),
    "timing figure": re.compile(
        # 0.2 s, 52-59 ms, 2-3 minutes, 1m56s; not SHA-256s or 5x5s.
        r"(?<![\w.-])\d+(?:\.\d+)?(?:[-–]\d+(?:\.\d+)?)?"
        r" ?(?:ns|µs|us|ms|s|sec|seconds?|min|minutes?|h|hours?)\b"
        r"|\b\d+m\d+s\b"
    ),
    "speed-up figure": re.compile(
        r"(?i)(?<![\w.-])~?\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)? ?[x×]"
        r" (?:faster|slower|the speed|the cost)\b"
        r"|\b(?:\d+|several|two|three|four) times (?:faster|slower)\b"
        r"|\b(?:about|nearly|almost) (?:half|a third|a quarter) of (?:a|the)"
        r" \w+ (?:step|epoch)\b"
    ),
    "measurement": re.compile(
        r"(?i)\bmeasured (?:on (?:an? |the )?(?:\d+[- ]cores?|[A-Z]+\d\w*"
        r"|\w+ machine)|at \d|no (?:faster|slower))"
        r"|\btook (?:about |~)?\d[\d.-]*"
    ),
    "issue reference": re.compile(
        r"(?i)\b(?:issue|bug|PR)s? #?\d+\b|\(#\d+\)|\bdeliverable \d"
    ),
    # 7 to 40 hex digits holding a letter and a digit: not a 0x literal, not
    # part of a name or a longer hash (a SHA-256), not the digit alphabet.
    "commit hash": re.compile(
        r"(?<![0-9A-Za-z_\\])(?!0123456789abcdef)"
        r"(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![0-9A-Za-z_])"
    ),
    "history": re.compile(
        r"(?i)\b(?:used to|previously|formerly|no longer|as before"
        r"|until now|from now on)\b"
        r"|\bnow (?:defaults?|uses?|runs?|says|returns?|takes?)\b"
        r"|\bwas [^,.;()]{1,40}, now\b"
        r"|\((?:was|formerly) [\w./]+\)"
        r"|\b(?:was|were) (?:renamed|moved) (?:from|to)\b"
    ),
}

_FIGURES = ("hardware", "timing figure", "speed-up figure", "measurement")
# Keywords of argparse's calls (and of the dicts and specs that feed them).
_ARGPARSE_TEXT = {"help", "description", "epilog"}


def _sources() -> list[pathlib.Path]:
  return sorted(TRAIN.rglob("*.py")) + sorted(
      p for p in (TRAIN / "native" / "csrc").iterdir() if p.is_file()
  )


def _narration(text: str, kinds=tuple(NARRATION), end=None) -> list[str]:
  """Each narration in ``text`` as ``'kind: match'``.

  Args:
    text: The text to scan.
    kinds: The keys of :data:`NARRATION` to look for.
    end: Only matches that start before this offset (None: all).

  Returns:
    One entry per match.
  """
  return [
      f"{kind}: {m.group(0)!r}"
      for kind in kinds
      for m in NARRATION[kind].finditer(text)
      if end is None or m.start() < end
  ]


def _lines(path: pathlib.Path) -> list[tuple[int, str, int]]:
  """(number, line and the next one joined, length of the line) per line.

  The next line is joined without its comment marker or indent, so a figure
  wrapped onto it ("1.4-1.8x" / "faster") is one match, reported once, at
  the line where it starts.
  """
  lines = path.read_text().splitlines()
  return [
      (
          number,
          line + " " + nxt.strip().lstrip("#/*").lstrip(),
          len(line),
      )
      for number, (line, nxt) in enumerate(zip(lines, [*lines[1:], ""]), 1)
  ]


def _argparse_texts(tree: ast.AST) -> list[tuple[int, str]]:
  """(line, text) of each literal ``help=``, ``description=``, ``epilog=``.

  Any call's keywords count: argparse's, and those of the dicts and flag
  specs that are passed on to it.

  Args:
    tree: A parsed module.

  Returns:
    Each text with the line of its call: a literal, the module docstring
    for ``__doc__``, an f-string's literal parts joined.
  """
  found = []
  for node in ast.walk(tree):
    if not isinstance(node, ast.Call):
      continue
    for keyword in node.keywords:
      if keyword.arg not in _ARGPARSE_TEXT:
        continue
      value = keyword.value
      if isinstance(value, ast.Constant) and isinstance(value.value, str):
        found.append((node.lineno, value.value))
      elif isinstance(value, ast.Name) and value.id == "__doc__":
        found.append((node.lineno, ast.get_docstring(tree) or ""))
      elif isinstance(value, ast.JoinedStr):
        parts = [
            v.value
            for v in value.values
            if isinstance(v, ast.Constant) and isinstance(v.value, str)
        ]
        found.append((node.lineno, "".join(parts)))
  return found


def test_train_sources_are_scanned():
  paths = {p.relative_to(TRAIN).as_posix() for p in _sources()}
  assert {"main.py", "native/csrc/conv_cpu.cc", "sweep/cli.py"} <= paths
  texts = _argparse_texts(ast.parse((TRAIN / "cli_flags.py").read_text()))
  assert len(texts) >= 5, texts  # the walk sees cli_flags' help strings


def test_train_text_does_not_narrate_measurements_or_history():
  found = [
      f"{path.relative_to(REPO)}:{number}: {hit}"
      for path in _sources()
      for number, text, end in _lines(path)
      for hit in _narration(text, end=end)
  ]
  assert not found, "\n".join(found)


def test_argparse_help_holds_no_measured_figures():
  # Joined, so "2-3 " "minutes" in two literals is one figure.
  found = [
      f"{path.relative_to(REPO)}:{number}: {hit}"
      for path in sorted(TRAIN.rglob("*.py"))
      for number, text in _argparse_texts(ast.parse(path.read_text()))
      for hit in _narration(" ".join(text.split()), _FIGURES)
  ]
  assert not found, "\n".join(found)


# Each command line of train/ (module, its main function), as --help shows it.
CLIS = [
    ("train.cifar", "main"),
    ("train.mnist", "main"),
    ("train.report.cli", "main"),
    ("train.report.plot", "main"),
    ("train.sweep.cli", "main"),
    ("train.gain", "main"),
    ("train.curvature.cli", "main"),
    ("train.data.download", "_main"),
    ("train.data.datasets", "_main"),
]


@pytest.mark.parametrize("module,function", CLIS)
def test_help_output_holds_no_narration(module, function, capsys):
  # What a user reads, after argparse has joined and wrapped it.
  main = getattr(importlib.import_module(module), function)
  with pytest.raises(SystemExit) as exit_info:
    main(["--help"])
  assert exit_info.value.code in (0, None)
  text = " ".join(capsys.readouterr().out.split())
  assert "--help" in text, text
  found = _narration(text)
  assert not found, "\n".join(found)


def test_patterns_catch_narration_and_leave_code_alone():
  caught = {
      "hardware": ["Measured on an H100", "on the 2-core machine", "EPYC"],
      "timing figure": [
          "took 52-59 ms of",
          "~0.2 s and more",
          "takes 2-3 minutes",
          "1m56s against 1m59s",
          "25-45 s per epoch",
      ],
      "speed-up figure": [
          "1.4-1.8x faster train steps",
          "about 3x faster than",
          "ran several times slower",
          "took about a third of a LeNet step",
      ],
      "measurement": ["were measured no faster", "it took 108 s"],
      "issue reference": ["(issue 36: an", "see #12 (#12)", "deliverable 2"],
      "commit hash": ["as in 1f6af19", "fixed by e11dfb7."],
      "history": [
          "jax.make_mesh now defaults to Explicit",
          "runs op by op as before",
          "was a loop, now a scan",
          "train/main.py (was train.py)",
          "it used to copy",
      ],
  }
  for kind, texts in caught.items():
    for text in texts:
      assert _narration(text), (kind, text)
  left_alone = [
      "0x80000000",
      "kGolden = 0.6180339887498949",
      "conv 5x5x20 -> norm",
      "2x2 stride-2 VALID max-pool",
      "6 rows x 2 vectors",
      "Sizes and SHA-256s as tensorflow-datasets publishes them",
      'sha256.strip("0123456789abcdef")',
      "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609",
      "results/benchmarks/h200_methods_e11dfb7.json",
      'f"{seconds:.0f}s"',
      "Nothing was changed; delete that checkpoint",
      "whether a file of that name was replaced",
      "Seconds from the sweep's start to now.",
      "not plotted now",
      "struct Avx512 {};  // AVX-512F",
      "each limited to 0.9 / N of its memory",
      "GBN_HOST_DEVICES=1 turns it off",
  ]
  for text in left_alone:
    assert not _narration(text), (text, _narration(text))
