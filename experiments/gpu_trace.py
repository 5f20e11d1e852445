"""Device time from the profiler: kernel intervals read back from a `jax.profiler` trace.

Wall-clock timing of one small op measures launch and dispatch as much as the kernel;
differencing chains of calls is noisy. The trace gives each kernel's own start and end on
the GPU, so a kernel's cost and a step's idle time can be read directly.
"""

from __future__ import annotations

import glob
import re
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
