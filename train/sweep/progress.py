"""The sweep's status line: runs and epochs done, time elapsed and left.

The estimate of the time left comes from the epochs this sweep has trained
(:func:`eta_seconds`), never from resumed ones, and counts down between them.
"""

from __future__ import annotations

from collections.abc import Callable
import time
from typing import TextIO


def _format_duration(seconds: float) -> str:
  seconds = int(round(seconds))
  hours, rest = divmod(seconds, 3600)
  return (
      f"{hours}h{rest // 60:02d}m"
      if hours
      else f"{rest // 60}m{rest % 60:02d}s"
  )


def eta_seconds(
    epochs_left: int,
    new_epochs: int,
    at_last_epoch: float,
    elapsed: float,
) -> float | None:
  """Seconds left, from the time per epoch this sweep has finished.

  The rate is measured when the last epoch finished (``at_last_epoch``
  seconds into the sweep, after ``new_epochs`` epochs), and the estimate then
  made counts down with the clock until the next one finishes: it never
  rises while nothing finishes, and holds at 0 once overdue.

  Args:
    epochs_left: Epochs still to train.
    new_epochs: Epochs this sweep has trained so far (resumed ones excluded).
    at_last_epoch: Seconds from the sweep's start to the last of them.
    elapsed: Seconds from the sweep's start to now.

  Returns:
    The estimate, or ``None`` before the first epoch has finished.
  """
  if not new_epochs:
    return None
  estimate = epochs_left * at_last_epoch / new_epochs
  return max(0.0, estimate - (elapsed - at_last_epoch))


class Progress:
  """One status line: runs done/total, epochs done/total, ETA."""

  def __init__(
      self,
      stream: TextIO,
      total_runs: int,
      total_epochs: int,
      clock: Callable[[], float] = time.monotonic,
  ):
    self.stream = stream
    self.tty = stream.isatty()
    self.total_runs, self.total_epochs = total_runs, total_epochs
    self.clock = clock
    self.started = clock()
    self.last_text, self.last_print = "", 0.0
    # When the count of new epochs last changed: the ETA's rate is from then.
    self.new_epochs, self.at_last_epoch = 0, 0.0

  def update(
      self,
      runs_done: int,
      epochs_done: int,
      new_epochs: int,
      failed: int,
      force: bool = False,
  ) -> None:
    now = self.clock()
    elapsed = now - self.started
    if new_epochs != self.new_epochs:
      self.new_epochs, self.at_last_epoch = new_epochs, elapsed
    left = self.total_epochs - epochs_done
    seconds = eta_seconds(left, new_epochs, self.at_last_epoch, elapsed)
    eta = (
        "done"
        if not left
        else "ETA ?"
        if seconds is None
        else "ETA " + _format_duration(seconds)
    )
    text = (
        f"sweep: runs {runs_done}/{self.total_runs}, epochs "
        f"{epochs_done}/{self.total_epochs}"
        + (f", {failed} failed" if failed else "")
        + f", {_format_duration(elapsed)} elapsed, {eta}"
    )
    if self.tty:
      self.stream.write("\r" + text.ljust(len(self.last_text)))
      self.stream.flush()
    elif force or (text != self.last_text and now - self.last_print > 60):
      self.stream.write(text + "\n")
      self.stream.flush()
      self.last_print = now
    self.last_text = text

  def message(self, line: str) -> None:
    if self.tty:
      self.stream.write("\r" + " " * len(self.last_text) + "\r")
    self.stream.write(line + "\n")
    self.stream.flush()
    if self.tty:
      self.stream.write(self.last_text)
