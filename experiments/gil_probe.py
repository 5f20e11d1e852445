"""How long a thread that needs the GIL waits while another thread works: a stand-in for the
decode loop's main thread, which must take the GIL to launch each jitted step and to read its
token while the per_step exchange runs on a host thread.

A probe thread releases and retakes the GIL in a loop (`time.sleep(0)`) and times each retake;
after a wait over `threshold` it records where the watched thread then stood (the first frame in
kvjax or host_index code), which is where that thread gave the GIL up: just after the code that
held it. On the H200, one thread running pure Python stretched the jitted step of a retrieval
per_step decode 14-34x (experiments/results/bench_step_contention_h200.md).
"""

from __future__ import annotations

import collections
import sys
import threading
import time

_OWN_CODE = ("/kvjax/", "/host_index/")


class GilProbe:
  """Use as a context manager around the watched thread's work (watched: its `threading.get_ident()`)."""

  def __init__(self, watched: int, threshold: float = 0.0005):
    self.watched, self.threshold = watched, threshold
    self.waits: list[float] = []
    self.by_line: collections.Counter = collections.Counter()  # "file:line function" -> seconds waited
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name="gil-probe", daemon=True)

  def __enter__(self) -> "GilProbe":
    self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    self._stop.set()
    self._thread.join()

  def _run(self) -> None:
    while not self._stop.is_set():
      t0 = time.perf_counter()
      time.sleep(0)  # releases the GIL and takes it back
      waited = time.perf_counter() - t0
      self.waits.append(waited)
      if waited > self.threshold:
        self.by_line[self._where()] += waited

  def _where(self) -> str:
    frame = sys._current_frames().get(self.watched)
    while frame is not None and not any(part in frame.f_code.co_filename for part in _OWN_CODE):
      frame = frame.f_back
    if frame is None:
      return "(outside kvjax and host_index)"
    return f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno} {frame.f_code.co_name}"

  def summary(self, steps: int) -> dict:
    """Per watched step: ms the probe waited in all (its own sleep calls included, so it tracks
    the wall time: the long waits are the signal), in waits over the threshold, and their
    count; and the longest wait."""
    long = [w for w in self.waits if w > self.threshold]
    return dict(gil_wait_ms_per_step=round(1e3 * sum(self.waits) / steps, 3),
                gil_long_wait_ms_per_step=round(1e3 * sum(long) / steps, 3),
                gil_long_waits_per_step=round(len(long) / steps, 1),
                gil_longest_wait_ms=round(1e3 * max(self.waits, default=0.0), 3))
