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


def read_together(arrays: Sequence[jax.Array]) -> list[np.ndarray]:
  """The arrays as NumPy arrays (same shapes and dtypes), copied in one transfer: views of one
  buffer, not to be written to.

  Arrays on several devices (a sharded state) are read with `jax.device_get` instead."""
  arrays = tuple(arrays)
  if not arrays:
    return []
  if not _one_device(arrays):
    return [np.asarray(x) for x in jax.device_get(arrays)]
  # Committed or not, one compiled read serves both (jit's cache tells them apart).
  if not all(x.committed for x in arrays):
    arrays = jax.device_put(arrays, next(iter(arrays[0].devices())))
  # Widest items first: every part starts at a multiple of its item size (aligned views).
  order = tuple(sorted(range(len(arrays)), key=lambda i: -arrays[i].dtype.itemsize))
  packed = np.asarray(_pack(arrays, order))
  out: list[np.ndarray | None] = [None] * len(arrays)
  offset = 0
  for i in order:
    x = arrays[i]
    nbytes = math.prod(x.shape) * x.dtype.itemsize
    part = packed[offset:offset + nbytes]
    out[i] = part.view(np.dtype(x.dtype)).reshape(x.shape)
    offset += nbytes
  return out
