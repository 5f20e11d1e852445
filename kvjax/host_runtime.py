"""The host side of a decode run and its bridge from jitted code (`jax.pure_callback`).

A jitted step cannot hold Python objects, so each `HostRuntime` (a host_index.HostContext
plus the retrieval settings, counters and error log of one run) is registered under an
integer id; the id travels in the policy state as a traced int32 and the callback looks the
runtime up. One compiled decode step therefore serves every context of the same shapes.

Callbacks never raise inside the jitted program: an exception is logged on the runtime,
the callback returns a nonzero status (and o = 0, lse = -inf so the step stays finite), and
`HostRuntime.raise_errors()` raises it after the step.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
import traceback

import numpy as np

import host_index

_RUNTIMES: dict[int, "HostRuntime"] = {}
_NEXT_ID = itertools.count(1)
_LOCK = threading.Lock()

STATUS_OK = 0
STATUS_HOST_ERROR = 1
STATUS_UNKNOWN_CONTEXT = 2


@dataclasses.dataclass
class HostStats:
  """Per-run counters (seconds are host wall time inside callbacks)."""

  callbacks: int = 0
  insert_seconds: float = 0.0
  attend_seconds: float = 0.0
  callback_seconds: float = 0.0
  inserted_tokens: int = 0
  scanned: int = 0
  searched_heads: int = 0

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


class HostRuntime:
  """One run's host context, retrieval settings and error log."""

  def __init__(self, context: host_index.HostContext, *, sinks: int, window: int, topk: int, ef: int | None,
               scale: float):
    self.context = context
    self.sinks, self.window, self.topk, self.ef, self.scale = sinks, window, topk, ef, scale
    self.stats = HostStats()
    self.errors: list[str] = []
    with _LOCK:
      self.id = next(_NEXT_ID)
      _RUNTIMES[self.id] = self

  def close(self) -> None:
    with _LOCK:
      _RUNTIMES.pop(self.id, None)

  def raise_errors(self) -> None:
    if self.errors:
      first = self.errors[0]
      self.errors.clear()
      raise RuntimeError(f"host callback failed: {first}")

  # -- the decode callback -------------------------------------------------------------

  def decode_layer(self, layer: int, queries, evicted_k, evicted_v, evicted_q, evicted_pos):
    """Inserts each sequence's evicted token (if any), then attends over the host store.

    Args:
      layer: the layer.
      queries: [B, Hq, D] float32 current queries (post-RoPE).
      evicted_k, evicted_v: [B, Hkv, D] the token leaving the device window.
      evicted_q: [B, Hq, D] that token's own query (roar links the new key through it).
      evicted_pos: [B] int32 its absolute position, -1 where no token leaves.

    Returns:
      o [B, Hq, D] float32, lse [B, Hq] float32.
    """
    t0 = time.perf_counter()
    for b in np.flatnonzero(evicted_pos >= 0):
      start = int(evicted_pos[b]) - self.sinks  # store index: host tokens start after the sinks
      added = self.context.insert(int(b), layer, start, evicted_k[b][:, None], evicted_v[b][:, None],
                                  queries=evicted_q[b][:, None])
      self.stats.inserted_tokens += added
    t1 = time.perf_counter()
    o, lse, scanned = self.context.attend(layer, queries, k=self.topk, ef=self.ef, scale=self.scale)
    t2 = time.perf_counter()
    self.stats.insert_seconds += t1 - t0
    self.stats.attend_seconds += t2 - t1
    self.stats.scanned += int(scanned.sum())
    self.stats.searched_heads += scanned.size
    return o, lse


def lookup(runtime_id: int) -> HostRuntime | None:
  return _RUNTIMES.get(int(runtime_id))


def decode_callback(runtime_id, layer, queries, evicted_k, evicted_v, evicted_q, evicted_pos):
  """The function `jax.pure_callback` calls; returns (o, lse, status) and never raises."""
  t0 = time.perf_counter()
  batch, heads, dim = queries.shape
  runtime = lookup(runtime_id)
  if runtime is None:
    return (np.zeros((batch, heads, dim), np.float32), np.full((batch, heads), -np.inf, np.float32),
            np.int32(STATUS_UNKNOWN_CONTEXT))
  try:
    o, lse = runtime.decode_layer(int(layer), np.asarray(queries, np.float32), np.asarray(evicted_k),
                                  np.asarray(evicted_v), np.asarray(evicted_q, np.float32),
                                  np.asarray(evicted_pos))
    status = STATUS_OK
  except Exception:  # reported after the step by raise_errors(), never raised in XLA
    runtime.errors.append(traceback.format_exc(limit=4))
    o = np.zeros((batch, heads, dim), np.float32)
    lse = np.full((batch, heads), -np.inf, np.float32)
    status = STATUS_HOST_ERROR
  runtime.stats.callbacks += 1
  runtime.stats.callback_seconds += time.perf_counter() - t0
  return o.astype(np.float32), lse.astype(np.float32), np.int32(status)
