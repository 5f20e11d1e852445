"""Device time from the profiler: kernel intervals read back from a `jax.profiler` trace.

Wall-clock timing of one small op measures launch and dispatch as much as the kernel;
differencing chains of calls is noisy. The trace gives each kernel's own start and end on
the GPU, so a kernel's cost and a step's idle time can be read directly.
"""

from __future__ import annotations

import collections
import glob
import re
import shutil
import tempfile
from typing import Callable, Sequence

import jax


def kernel_group(name: str) -> str:
  """Kernel name without the numeric suffixes XLA adds per instance (fusion.12 -> fusion)."""
  return re.sub(r"([._]\d+)+$", "", name)[:90]


def kernel_events(trace_dir: str) -> list[tuple[str, float, float]]:
  """(name, start_ns, end_ns) of every kernel on the first GPU's streams."""
  paths = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
  if not paths:
    raise RuntimeError(f"no trace written under {trace_dir}")
  profile = jax.profiler.ProfileData.from_file(paths[0])
  events = []
  for plane in profile.planes:
    if not plane.name.startswith("/device:GPU:0"):
      continue
    for line in plane.lines:
      if not line.name.startswith("Stream"):  # skip the XLA op/module summary lines
        continue
      for event in line.events:
        if event.duration_ns > 0:
          events.append((event.name, event.start_ns, event.start_ns + event.duration_ns))
  if not events:
    raise RuntimeError(f"no GPU kernel events in the trace (backend {jax.default_backend()}): this needs a GPU")
  return events


def busy_ns(events) -> float:
  """Length of the union of the events' [start, end) intervals."""
  total, reach = 0.0, -1.0
  for _, start, end in sorted(events, key=lambda e: e[1]):
    if end <= reach:
      continue
    total += end - max(start, reach)
    reach = end
  return total


def traced(run: Callable[[], None]) -> list[tuple[str, float, float]]:
  """Kernel events of everything `run()` puts on the GPU (it must block until done)."""
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir):
      run()
    return kernel_events(trace_dir)


class StepTracer:
  """Traces the steps of a loop from its `first` step on (`on_step` hook: kvjax.decode's), so the
  first step's compilation and autotuning kernels stay out; `events()` after the loop."""

  def __init__(self, first: int = 1):
    self.first, self.steps, self._dir = first, 0, None

  def on_step(self, done: int) -> None:
    if done == self.first:
      self._dir = tempfile.mkdtemp(prefix="kvjax_trace_")
      jax.profiler.start_trace(self._dir)
    elif done > self.first:
      self.steps = done - self.first

  def events(self) -> list[tuple[str, float, float]]:
    if self._dir is None or self.steps == 0:
      raise RuntimeError(f"fewer than {self.first + 1} steps ran: nothing was traced")
    jax.profiler.stop_trace()
    try:
      return kernel_events(self._dir)
    finally:
      shutil.rmtree(self._dir, ignore_errors=True)


def kernel_table(events, steps: int, top: int) -> tuple[dict, list[dict]]:
  """Per-step summary of a traced run of `steps` steps (trace span, GPU busy = union of kernel
  intervals, idle = span - busy, kernels) and the `top` kernel groups by device time."""
  span_ns = max(e[2] for e in events) - min(e[1] for e in events)
  busy = busy_ns(events)
  groups = collections.defaultdict(lambda: [0, 0.0])
  for name, start, end in events:
    groups[kernel_group(name)][0] += 1
    groups[kernel_group(name)][1] += end - start
  kernel_total = sum(g[1] for g in groups.values())
  summary = dict(trace_span_ms_per_step=round(span_ns / steps / 1e6, 3),
                 gpu_busy_ms_per_step=round(busy / steps / 1e6, 3),
                 gpu_idle_ms_per_step=round((span_ns - busy) / steps / 1e6, 3),
                 kernels_per_step=round(len(events) / steps, 1))
  rows = [dict(kernel=name, per_step=round(count / steps, 1), us_per_step=round(ns / steps / 1e3, 1),
               share_pct=round(100 * ns / kernel_total, 1))
          for name, (count, ns) in sorted(groups.items(), key=lambda kv: -kv[1][1])[:top]]
  return summary, rows


def device_seconds_per_call(fn: Callable, arg_sets: Sequence[tuple], calls: int) -> float:
  """Mean GPU kernel time of one `fn(*args)` call, cycling over `arg_sets` (distinct buffers,
  so the L2 cache does not flatter small sizes). `fn` is jitted and warmed up first."""
  jitted = jax.jit(fn)
  jax.block_until_ready(jitted(*arg_sets[0]))

  def run():
    for i in range(calls):
      jax.block_until_ready(jitted(*arg_sets[i % len(arg_sets)]))

  events = traced(run)
  return sum(end - start for _, start, end in events) / calls / 1e9
