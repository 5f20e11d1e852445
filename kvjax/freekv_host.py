"""The host side of the `freekv` policy: a page store, the recall callback and its counters.

`FreeKVRuntime` owns a host_index.HostContext of kind "flat" used only as a head-major page
store (no index is built or searched): store index i of (seq, layer) is absolute position
sinks + i, and store page j covers store indices j*P .. j*P + P - 1. It is registered in
kvjax.host_runtime under an int id carried in the policy state, as the retrieval runtime is.

The jitted step decides everything (selection, which pages are missing, which slots they go
to); the host only (1) appends the token leaving the device window and (2) copies the
requested pages out of the store. With bridge="per_layer" a callback per sparse layer does
both inside the step (`recall_callback`); errors follow kvjax.host_runtime: logged, a nonzero
status returned with zero pages, raised by `raise_errors()` after the step. With
bridge="per_step" `exchange` does both for every layer between steps, outside any jitted
program (an error raises there), and packs the pages into one kvjax.row_update.RowUpdate.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
import traceback
from typing import Any, Callable

import numpy as np

import host_index
from kvjax import host_runtime, row_update


@dataclasses.dataclass
class FreeKVStats:
  """Per-run counters, summed over layers, sequences and steps.

  Attributes:
    callbacks: callbacks run (per_layer: one per sparse layer per decode step).
    exchanges: per_step host exchanges run (one per decode step).
    decided_heads: (layer, seq, kv head, step) where the correction test ran (speculative
      mode, every step after a layer's first).
    corrected_heads: of those, heads corrected synchronously.
    reused_pages: per_layer: pages of the previous step's selection, over decided heads;
      per_step: pages the step attended from its pool (with lag 2 the selection of two steps
      back), over decided heads.
    reused_hits: of those, pages in the current query's selection (per_layer counts corrected
      heads too: the overlap reuse would have kept; retrieval's hit rate scores only heads
      that reused).
    missed_pages: pages of a head's selection it did not attend (per_layer: more missing than
      max_recall; per_step: pages of the selection the step's own query made (over the pages
      complete after its eviction, the next step's candidates) that the step attended from
      neither its pool nor its ring: the cost of attending an older selection).
    sync_pages: pages recalled before attention (corrections; every recall without
      speculation): on the critical path.
    spec_pages: pages recalled for the next step's speculative selection.
    page_bytes: bytes of one recalled page, K and V together, in the storage dtype.
    callback_bytes: bytes the callbacks' static outputs carried (PCIe traffic whatever the count).
    transfer_bytes: per_step: bytes of the packed page updates copied to the device.
    inserted_tokens: tokens appended to the store during decode.
    insert_seconds, fetch_seconds: host wall time appending and copying pages.
    callback_seconds: wall time inside callbacks (per_layer).
    exchange_seconds: per_step: wall time of the exchanges between steps (fetch, the start of
      the transfer, insert; lag 1 runs them on the critical path, lag 2 on a host thread).
    transfer_seconds: per_step: of that, copying the updates to the device.
    slowest_exchange_ms, slowest_wait_ms: per_step: the longest exchange, and (lag 2) the
      longest wait for one: a mean over the steps hides a few slow ones.
    completed_pages: per_step: fetched pages whose last token was written from the step's
      evicted rows (the store appends it after the fetch).
    rows_seconds, land_seconds: per_step, the decode loop's own part of `after_step`: finishing
      the read of the step's outputs for the host (kvjax.device_read; begun as the step was
      dispatched) and landing the previous update (dispatching the scatter and the slot listing).
  """

  callbacks: int = 0
  exchanges: int = 0
  decided_heads: int = 0
  corrected_heads: int = 0
  reused_pages: int = 0
  reused_hits: int = 0
  missed_pages: int = 0
  sync_pages: int = 0
  spec_pages: int = 0
  page_bytes: int = 0
  callback_bytes: int = 0
  transfer_bytes: int = 0
  inserted_tokens: int = 0
  insert_seconds: float = 0.0
  fetch_seconds: float = 0.0
  callback_seconds: float = 0.0
  exchange_seconds: float = 0.0
  exchange_wait_seconds: float = 0.0  # lag 2: the decode loop waiting for the host thread's exchange
  transfer_seconds: float = 0.0
  slowest_exchange_ms: float = 0.0
  slowest_wait_ms: float = 0.0
  completed_pages: int = 0
  rows_seconds: float = 0.0
  land_seconds: float = 0.0

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


class FreeKVRuntime:
  """One run's host page store, recall settings, counters and error log."""

  def __init__(self, context: host_index.HostContext, *, sinks: int, page_size: int, sync_recall: int,
               sparse_layers: int, step_buffers: int = 1, background_nice: int = 0, reserved_cores: int = 0):
    """Wraps `context` and registers the runtime.

    Args:
      context: the store (kind "flat"; its page_size must equal `page_size`).
      sinks: device-resident first tokens; store index 0 is position `sinks`.
      page_size: tokens per page.
      sync_recall: how many leading entries of each fetch list are recalled before attention
        (the rest prepare the next step); only used to split the counters.
      sparse_layers: layers that call back each step (turns callbacks into steps).
      step_buffers: packed host buffers the per_step exchanges rotate through (2 when one
        exchange runs while the previous one's copy may still be in flight: lag 2).
      background_nice: nice value of the lag-2 exchange thread (host_runtime.background_worker).
      reserved_cores: cores the lag-2 exchange thread and its OpenMP team stay off, for the thread
        launching the step's kernels (host_runtime.worker_cores; 0: none). With cores reserved
        the exchange runs at the caller's priority (it has the other cores to itself).
    """
    self.context = context
    self.sinks, self.page_size, self.sync_recall = sinks, page_size, sync_recall
    self.sparse_layers = sparse_layers
    self.background_nice = background_nice  # checked by background_worker
    self.worker_cores = host_runtime.worker_cores(reserved_cores)
    # the page fetch's OpenMP team: the worker cores when pinned (the default team is every core)
    self.fetch_threads = len(self.worker_cores) if self.worker_cores else None
    self.stats = FreeKVStats()
    self.buffers = row_update.StepBuffers(step_buffers)
    self.errors: list[str] = []
    # lag 2: the exchange running on the host thread (a Future of its packed device update).
    self.pending: concurrent.futures.Future | None = None
    self._worker: concurrent.futures.ThreadPoolExecutor | None = None
    self.id = host_runtime.register(self)

  def worker(self) -> concurrent.futures.ThreadPoolExecutor:
    """The one host thread lag-2 exchanges run on (in order)."""
    if self._worker is None:
      nice = host_runtime.exchange_nice(self.worker_cores, self.background_nice)
      self._worker = host_runtime.background_worker("freekv-exchange", nice, self.worker_cores)
    return self._worker

  def drain(self) -> None:
    """Waits for the pending exchange (its counters then count, whatever the thread timing)."""
    if self.pending is not None:
      self.pending.result()

  def close(self) -> None:
    host_runtime.unregister(self.id)
    if self._worker is not None:
      self._worker.shutdown(wait=True)
    host_runtime.warn_failed([self.pending], "freekv exchange")  # one stats() would have raised

  def raise_errors(self) -> None:
    if self.errors:
      first = self.errors[0]
      self.errors.clear()
      raise RuntimeError(f"freekv host callback failed: {first}")

  def _insert(
      self,
      evicted_k,  # [..., Hkv, D]: the tokens that left a window, leading axes (layer, seq) or (seq,)
      evicted_v,  # [..., Hkv, D]
      evicted_pos,  # [...] int: their positions, -1 = none
      layer: int | None = None,  # the layer when the leading axes are (seq,) only
  ) -> None:
    """Appends every evicted token in one call (a call per token cost ~15 µs); a token stored
    already is skipped, so a repeated call is harmless."""
    where = np.nonzero(evicted_pos >= 0)
    layers, seqs = where if layer is None else (np.full(where[0].size, layer), where[0])
    self.stats.inserted_tokens += self.context.append_tokens(
        seqs, layers, evicted_pos[where] - self.sinks, evicted_k[where], evicted_v[where])

  def _count(self, counters) -> None:
    """Adds [..., 5] per-head counters (decided, corrected, reused, hits, missed). The correction
    test's counters count where it ran (decided); missed pages count at every step, a layer's
    first (undecided, pool empty: usually the largest shortfall of a decode) included."""
    decided = counters[..., 0] > 0
    for i, name in ((1, "corrected_heads"), (2, "reused_pages"), (3, "reused_hits")):
      setattr(self.stats, name, getattr(self.stats, name) + int((counters[..., i] * decided).sum()))
    self.stats.missed_pages += int(counters[..., 4].sum())
    self.stats.decided_heads += int(decided.sum())
    store = self.context.store
    self.stats.page_bytes = 2 * self.page_size * store.head_dim * store.itemsize

  def decode_layer(self, layer: int, evicted_k, evicted_v, evicted_pos, fetch_ids, counters):
    """Appends each sequence's evicted token, then copies the requested pages.

    Args:
      layer: the layer.
      evicted_k, evicted_v: [B, Hkv, D] the token leaving the device window.
      evicted_pos: [B] int32 its absolute position, -1 where no token leaves.
      fetch_ids: [B, Hkv, R] int32 store page ids to copy, -1 for none.
      counters: [B, Hkv, 5] int32 per head: (decided, corrected, reused, hits, missed).

    Returns:
      pages_k, pages_v: [B, Hkv, R, page_size, D] in the storage dtype (zeros where id < 0).
    """
    t0 = time.perf_counter()
    self._insert(evicted_k, evicted_v, evicted_pos, layer=layer)
    t1 = time.perf_counter()
    B, H, R = fetch_ids.shape
    store = self.context.store
    shape = (B, H, R, self.page_size, store.head_dim)
    pages_k, pages_v = np.zeros(shape, store.storage_dtype), np.zeros(shape, store.storage_dtype)
    for b in range(B):
      want = fetch_ids[b] >= 0  # [H, R]
      if not want.any():
        continue
      heads, cols = np.nonzero(want)
      k, v = self.context.fetch_pages(b, layer, heads, fetch_ids[b][want])
      pages_k[b, heads, cols], pages_v[b, heads, cols] = k, v
      sync = cols < self.sync_recall
      self.stats.sync_pages += int(sync.sum())
      self.stats.spec_pages += int((~sync).sum())
    t2 = time.perf_counter()
    self._count(counters)
    self.stats.callback_bytes += pages_k.nbytes + pages_v.nbytes
    self.stats.insert_seconds += t1 - t0
    self.stats.fetch_seconds += t2 - t1
    return pages_k, pages_v

  def exchange(
      self,
      evicted_k,  # [L, B, Hkv, D]: each layer's token that left the window in the step
      evicted_v,  # [L, B, Hkv, D]
      evicted_pos,  # [L, B] int: its position, -1 = none (and every dense layer)
      fetch,  # [L, B, Hkv, R] int: store pages the next step lacks, -1 = none
      slots,  # [L, B, Hkv, R] int: the pool slot of each
      counters,  # [L, B, Hkv, 5] int: the step's per-head counters (see decode_layer)
      *,
      pool_slots: int,
      send: Callable[[row_update.RowUpdate], Any],
  ):
    """per_step, between steps: gathers the pages asked for into one RowUpdate of the flattened
    [L, B, Hkv, pool_slots] pool (a row: one page, [page_size * D]), hands it to `send` (which
    starts its copy to the device), then appends every layer's evicted token to the store;
    returns what `send` returned.

    The store work comes after `send` so the copy, the longest part, starts sooner. A page
    the step's eviction completes may be asked for already: its last token is not stored
    yet, so it is written into the update from the evicted rows.
    """
    t0 = time.perf_counter()
    L, B, H, _ = fetch.shape
    store = self.context.store
    P, D = self.page_size, store.head_dim
    want = fetch >= 0
    layer_of, seq_of, head_of, _ = np.nonzero(want)  # C order: grouped by (layer, seq)
    pages = fetch[want]
    update = row_update.new_update(self.buffers, pages.size, fetch.size, P * D, store.storage_dtype)
    out_k, out_v = (rows[:pages.size].reshape(-1, P, D) for rows in (update.k, update.v))
    # One C call over every (layer, seq) store: a call per store cost ~0.1 ms each.
    groups, group_of = np.unique(layer_of * B + seq_of, return_inverse=True)
    self.context.fetch_pages_many([(int(g) % B, int(g) // B) for g in groups], group_of, head_of, pages,
                                  out_k=out_k, out_v=out_v, threads=self.fetch_threads)
    self._complete_pages(out_k, out_v, layer_of, seq_of, head_of, pages, evicted_k, evicted_v, evicted_pos)
    update.dest[:pages.size] = ((layer_of * B + seq_of) * H + head_of) * pool_slots + slots[want]
    update.ids[:pages.size] = pages
    update.pad(L * B * H * pool_slots)
    self.stats.spec_pages += int(pages.size)
    t1 = time.perf_counter()
    self.stats.fetch_seconds += t1 - t0
    sent = send(update)
    t2 = time.perf_counter()
    self._insert(evicted_k, evicted_v, evicted_pos)
    self.stats.insert_seconds += time.perf_counter() - t2
    self._count(counters)
    self.stats.exchanges += 1
    return sent

  def _complete_pages(
      self,
      out_k,  # [n, P, D] fetched pages (storage dtype), rows past the stored length zero
      out_v,  # [n, P, D]
      layer_of, seq_of, head_of, pages,  # [n] int each: where page i comes from
      evicted_k,  # [L, B, Hkv, D]
      evicted_v,  # [L, B, Hkv, D]
      evicted_pos,  # [L, B] int, -1 = none
  ) -> None:
    """Writes each (layer, seq)'s evicted token into the fetched pages it belongs to: the
    token is appended to the store only after the fetch."""
    if not pages.size:
      return
    index = evicted_pos[layer_of, seq_of] - self.sinks  # [n] store index of that store's evicted token
    hit = (evicted_pos[layer_of, seq_of] >= 0) & (index // self.page_size == pages)
    if not hit.any():
      return
    i, row = np.flatnonzero(hit), index[hit] % self.page_size
    at = (layer_of[i], seq_of[i], head_of[i])
    out_k[i, row] = np.asarray(evicted_k)[at].view(out_k.dtype)
    out_v[i, row] = np.asarray(evicted_v)[at].view(out_v.dtype)
    self.stats.completed_pages += int(i.size)


def recall_callback(runtime_id, layer, evicted_k, evicted_v, evicted_pos, fetch_ids, counters, *, page_size,
                    out_dtype):
  """The function `jax.pure_callback` calls; returns (pages_k, pages_v, status), never raises.

  `page_size` and `out_dtype` (the device dtype, e.g. bfloat16) are bound with
  functools.partial: they fix the output shape when the runtime cannot be found.
  """
  t0 = time.perf_counter()
  B, H, R = fetch_ids.shape
  shape = (B, H, R, page_size, evicted_k.shape[-1])
  runtime = host_runtime.lookup(runtime_id)
  if runtime is None:
    zeros = np.zeros(shape, out_dtype)
    return zeros, zeros, np.int32(host_runtime.STATUS_UNKNOWN_CONTEXT)
  try:
    k, v = runtime.decode_layer(int(layer), np.asarray(evicted_k), np.asarray(evicted_v),
                                np.asarray(evicted_pos), np.asarray(fetch_ids), np.asarray(counters))
    k, v = k.view(out_dtype), v.view(out_dtype)  # bfloat16 travels as its uint16 bits
    status = host_runtime.STATUS_OK
  except Exception:  # reported after the step by raise_errors(), never raised in XLA
    runtime.errors.append(traceback.format_exc(limit=4))
    k = v = np.zeros(shape, out_dtype)
    status = host_runtime.STATUS_HOST_ERROR
  runtime.stats.callbacks += 1
  runtime.stats.callback_seconds += time.perf_counter() - t0
  return k, v, np.int32(status)
