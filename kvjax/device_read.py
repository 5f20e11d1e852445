"""Device -> host reads of a step's small outputs in one copy (the per_step bridges, between steps).

Why: `jax.device_get` of a tuple starts one copy per array and then waits for each on the main
thread, taking the GIL back after every wait, while the host exchange's thread runs beside it. The
retrieval bridge read 7 arrays (~160 KB at SmolLM2 shapes) a step this way, and that read took
1.3-2.0 ms on the H100 host at 128K with the exchange running beside it (0.7 ms at the commit
before 2c3d895; what made it grow was not isolated;
experiments/results/bench_scale_smollm2shapes_synthetic_128k_select_after.md): device-idle time
between two steps. Here a jitted concatenation of the arrays' bytes (a small kernel after the
step) makes them one array, copied once and split into NumPy views: 0.54-1.1 ms a step on the
H100 hosts at 128K (bench_scale_smollm2shapes_synthetic_128k_rounds.md, ..._passive.md).

`start_reading` splits that read in two so that it leaves the device-idle time between steps:
called right after a step is dispatched, it queues the concatenation behind the step and starts
the copy to the host (`copy_to_host_async`), which then runs as soon as the step ends, while the
main thread still waits for the step's token; `PendingRead.result()` after the step only waits
for what is left of that copy. (Reads after the next dispatch are no option: the next step
donates these buffers.) The step's sampled tokens travel in the same copy (`also`): read with a
copy of their own, the main thread's wait for the token grew by about what the early start saved
after it (experiments/results/bench_decode_smollm2_8k_text_hides_early*.md; that their copy waited
behind this one is the likely cause, not traced).
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def _as_bytes(x: jax.Array) -> jax.Array:  # [...] -> [nbytes] uint8
  if x.dtype == jnp.bool_:  # bitcast_convert_type takes no bool; NumPy's bool is a 0/1 byte
    x = x.astype(jnp.uint8)
  return jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(-1)


@functools.partial(jax.jit, static_argnames=("order",))
def _pack(arrays: tuple, order: tuple[int, ...]) -> jax.Array:
  return jnp.concatenate([_as_bytes(arrays[i]) for i in order])


def _one_device(arrays) -> bool:
  devices = set()
  for x in arrays:
    if not isinstance(x, jax.Array):
      return False
    devices |= x.devices()
  return len(devices) == 1


class PendingRead:
  """A read started by `start_reading`: `result()` gives the arrays as NumPy arrays (same shapes and
  dtypes; views of one buffer when they were packed, not to be written to), `also()` the one more
  array read with them."""

  def __init__(self, sources: tuple, packed: jax.Array | None, order: tuple[int, ...], *, count: int):
    self._sources = sources  # the arrays read, then `also` where given
    self._count = count  # how many of them `result()` gives
    self._packed = packed  # [nbytes] uint8, its copy to the host started; None: read one by one
    self._order = order
    self._all: list[np.ndarray] | None = None
    self._result: list[np.ndarray] | None = None

  def reads(self, arrays: Sequence) -> bool:
    """Whether this read, its result not yet taken, is of exactly these arrays (the same objects, in
    order; `also` aside)."""
    arrays = tuple(arrays)
    return (self._result is None and len(arrays) == self._count
            and all(a is b for a, b in zip(arrays, self._sources)))

  def result(self) -> list[np.ndarray]:
    """Waits for the copy (once; later calls return the same arrays)."""
    if self._result is None:
      self._result = self._finished()[:self._count]
      self._sources = ()  # the next step donates them
    return self._result

  def also(self) -> np.ndarray:
    """Waits for the copy and gives the `also` array of `start_reading`."""
    finished = self._finished()
    if len(finished) == self._count:
      raise ValueError("this read was started without an `also` array")
    return finished[self._count]

  def _finished(self) -> list[np.ndarray]:
    if self._all is None:
      self._all = self._finish()
    return self._all

  def _finish(self) -> list[np.ndarray]:
    if self._packed is None:
      return [np.asarray(x) for x in jax.device_get(self._sources)] if self._sources else []
    packed = np.asarray(self._packed)
    out: list[np.ndarray | None] = [None] * len(self._sources)
    offset = 0
    for i in self._order:
      x = self._sources[i]
      nbytes = math.prod(x.shape) * x.dtype.itemsize
      out[i] = packed[offset:offset + nbytes].view(np.dtype(x.dtype)).reshape(x.shape)
      offset += nbytes
    return out


def start_reading(arrays: Sequence[jax.Array], *, also: jax.Array | None = None) -> PendingRead:
  """Starts reading the arrays to the host in one transfer (asynchronous: their computation may
  still be running) and returns the read; `.result()` waits for it. also: one more array read in
  the same transfer and given by `.also()` (a decode step's sampled tokens, which the main thread
  waits for first).

  Arrays on several devices (a sharded state), or values that are not device arrays, are read
  with `jax.device_get` when the result is asked for."""
  count = len(arrays)
  sources = tuple(arrays) + (() if also is None else (also,))
  if not sources or not _one_device(sources):
    return PendingRead(sources, None, (), count=count)
  arrays = sources
  # Committed or not, one compiled read serves both (jit's cache tells them apart).
  if not all(x.committed for x in arrays):
    arrays = jax.device_put(arrays, next(iter(arrays[0].devices())))
  # Widest items first: every part starts at a multiple of its item size (aligned views).
  order = tuple(sorted(range(len(arrays)), key=lambda i: -arrays[i].dtype.itemsize))
  packed = _pack(arrays, order)
  packed.copy_to_host_async()
  return PendingRead(sources, packed, order, count=count)


def read_together(arrays: Sequence[jax.Array]) -> list[np.ndarray]:
  """The arrays as NumPy arrays (same shapes and dtypes), copied in one transfer: views of one
  buffer, not to be written to.

  Arrays on several devices (a sharded state) are read with `jax.device_get` instead."""
  return start_reading(arrays).result()


def finish_reading(started: PendingRead | None, arrays: Sequence[jax.Array]) -> list[np.ndarray]:
  """`read_together(arrays)`, through `started` when given: start_reading's read of these arrays."""
  if started is None:
    return read_together(arrays)
  if not started.reads(arrays):
    raise ValueError("started is not a read of these arrays (start_reading of the same objects, not yet finished)")
  return started.result()
