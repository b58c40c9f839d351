"""A progress bar that follows the train steps that completed.

:class:`StepProgress` counts the steps of the training loop
(``train.loop.trainer``) whose loss is ready, rather than those dispatched.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any


class StepProgress:
  """Advances a progress bar as train steps complete.

  Steps are dispatched asynchronously, ahead of the device: a bar that
  counted dispatches would run ahead, then stall whenever the loop waits.
  This one counts the steps whose loss is ready. After each dispatch the
  ready ones are collected without waiting, and the loop waits for the
  oldest only when more than ``ahead`` are pending: enough for the device
  never to wait for the host, few enough that the bar lags by at most that
  many steps. Each collection reads only the newest loss, which feeds
  ``check`` and the bar's postfix: steps complete in order (each needs the
  previous state), so the older ones are done too.
  """

  def __init__(
      self,
      bar: Any,
      check: Callable[[float], None],
      ahead: int = 3,
  ):
    """Initializes the count.

    Args:
      bar: A ``tqdm.tqdm`` bar, updated by the steps completed.
      check: Called with each loss read (raises to stop the run).
      ahead: How many steps may be pending before the loop waits.
    """
    self._bar = bar
    self._check = check
    self._ahead = ahead
    self._pending: collections.deque[Any] = collections.deque()

  def dispatched(self, loss: Any) -> None:
    """Counts a step just dispatched, ``loss`` its (future) loss."""
    self._pending.append(loss)
    self._collect(self._ahead)

  def finish(self) -> None:
    """Waits for every pending step."""
    self._collect(0)

  def _collect(self, keep: int) -> None:
    done, newest = 0, None
    while self._pending and (
        len(self._pending) > keep or self._pending[0].is_ready()
    ):
      newest = self._pending.popleft()
      done += 1
    if done:
      loss = float(newest)
      self._check(loss)
      self._bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
      self._bar.update(done)
