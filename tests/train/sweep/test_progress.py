"""The sweep's ETA (``train.sweep.progress``): from the work done, fake clock.

The ETA must come from the time per finished epoch and count down (or hold)
while nothing finishes; it once counted up, one second per second.
"""

from __future__ import annotations

import io
import re

import numpy as np

from train.sweep import progress as sweep_progress


class _Clock:
  """A clock that moves only when told."""

  def __init__(self):
    self.now = 1000.0

  def __call__(self) -> float:
    return self.now


class _Terminal(io.StringIO):

  def isatty(self) -> bool:
    return True


def _seconds(duration: str) -> int:
  """``'1m05s'`` or ``'1h02m'`` in seconds (the status line's format)."""
  match = re.fullmatch(r"(\d+)m(\d\d)s", duration)
  if match:
    return 60 * int(match[1]) + int(match[2])
  hours, minutes = re.fullmatch(r"(\d+)h(\d\d)m", duration).groups()
  return 3600 * int(hours) + 60 * int(minutes)


def _last_eta(stream: io.StringIO) -> str:
  line = stream.getvalue().split("\r")[-1].strip()
  return line.rsplit(", ", 1)[1]


def test_eta_counts_down_between_epochs_instead_of_up():
  # The case: 2 runs of 1 epoch, the first done after 30 s.
  clock, stream = _Clock(), _Terminal()
  progress = sweep_progress.Progress(stream, 2, 2, clock=clock)
  progress.update(0, 0, 0, 0)
  assert _last_eta(stream) == "ETA ?"
  clock.now += 30
  etas = []
  for _ in range(30):
    progress.update(1, 1, 1, 0)
    assert "runs 1/2, epochs 1/2" in stream.getvalue().split("\r")[-1]
    etas.append(_seconds(_last_eta(stream).removeprefix("ETA ")))
    clock.now += 1
  # 30 s per epoch, one epoch left: 30 s, then one second less each second.
  assert etas == [30 - i for i in range(30)]
  # Overdue: it holds at zero rather than rising.
  clock.now += 100
  progress.update(1, 1, 1, 0)
  assert _last_eta(stream) == "ETA 0m00s"
  progress.update(2, 2, 2, 0)
  assert _last_eta(stream) == "done"


def test_eta_never_rises_while_nothing_finishes():
  rng = np.random.default_rng(0)
  clock, stream = _Clock(), _Terminal()
  total = 40
  progress = sweep_progress.Progress(stream, 4, total, clock=clock)
  start = clock.now
  done, previous = 0, None
  finished_at = []
  while done < total:
    clock.now += float(rng.uniform(0.1, 5.0))
    if rng.random() < 0.2:
      done += int(rng.integers(1, 3))
      done = min(done, total)
      finished_at.append(clock.now - start)
      previous = None
    progress.update(done // 10, done, done, 0)
    eta = _last_eta(stream)
    if done == total:
      assert eta == "done"
      break
    if not done:
      assert eta == "ETA ?"
      continue
    seconds = _seconds(eta.removeprefix("ETA "))
    # From the definition: the epochs left at the rate of the finished ones,
    # measured when the last one finished, less the time since then.
    rate = finished_at[-1] / done
    want = max(
        0.0, (total - done) * rate - (clock.now - start - finished_at[-1])
    )
    assert abs(seconds - want) <= 0.5 + 1e-9
    if previous is not None:
      assert seconds <= previous
    previous = seconds


def test_eta_seconds_from_the_definition():
  assert sweep_progress.eta_seconds(5, 0, 0.0, 12.0) is None
  # 4 epochs in 40 s: 10 s each; 6 left = 60 s, 15 s after the last = 45 s.
  assert sweep_progress.eta_seconds(6, 4, 40.0, 55.0) == 60.0 - 15.0
  assert sweep_progress.eta_seconds(6, 4, 40.0, 40.0) == 60.0
  # Overdue: holds at 0.
  assert sweep_progress.eta_seconds(1, 4, 40.0, 400.0) == 0.0


def test_status_lines_off_a_terminal_show_the_same_eta():
  clock, stream = _Clock(), io.StringIO()
  progress = sweep_progress.Progress(stream, 1, 3, clock=clock)
  clock.now += 20
  progress.update(0, 1, 1, 0, force=True)
  clock.now += 5
  progress.update(0, 1, 1, 0, force=True)
  lines = stream.getvalue().splitlines()
  assert [line.rsplit(", ", 1)[1] for line in lines] == [
      "ETA 0m40s",
      "ETA 0m35s",
  ]
