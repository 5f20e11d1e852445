"""The host side of `retrieval(bridge="per_step")`: one host exchange per decode step, outside
the jitted step, instead of one `pure_callback` per layer inside it.

Why: a host callback inside a jitted program costs 0.40-0.57 ms on the H200 even when its
body does nothing (experiments/results/bench_callback.md), and the GPU idles meanwhile; at
32 layers that is 13-18 ms per token, more than the whole dense 8B step at 128K (10.3 ms).
So this bridge keeps the host off the step: the device attends its ring (sinks + window)
plus a buffer of retrieved keys and values the host prepared before the step; the step
exports every layer's query and the token it evicted; between steps the host

  1. waits for the background indexing of the previous step's evicted tokens (it ran while
     the device computed the step that just ended),
  2. stores the tokens evicted by the step that just ended (a copy; indexed in the background),
  3. searches every layer's index with that step's queries, top-k per query head, all cores,
  4. gathers the selected rows, plus every stored-but-unindexed token (so nothing is lost),
     into [L, B, Hq, slots, D] buffers that the caller copies to the device for the next step,
  5. starts the indexing of the new tokens on a background thread.

The selection used at step t+1 was searched with the query of step t: speculative reuse with
a one-step lag for every head and no synchronous correction (a correction would need the
host inside the step again). `HostStats.hit_rate` measures what the lag costs: the share of
the ids used at a step that the same step's own query would also have retrieved.

With lag 1 steps 1-5 sit between two device steps, on the critical path. With lag 2 they run on
a background thread while the device computes the next step (`start_prefetch`): the rows used
at step t+1 were searched with the query of step t-1, and the critical path only waits for
the job started one step earlier (`take_prefetched`, counted in `step_wait_seconds`). The
tokens evicted in the last `lag` steps are not in the host rows yet; the device keeps them.
"""

from __future__ import annotations

import collections
import concurrent.futures
import time

import numpy as np

from kvjax.host_runtime import HostRuntime, available_cores, reuse_hits


class PrefetchRuntime(HostRuntime):
  """A HostRuntime driven once per step (`prefetch_step`) rather than per layer by callbacks.

  tail_slots: buffer rows per query head kept for stored-but-unindexed tokens; when more are
  pending (the background indexing fell behind) they are indexed synchronously first.
  """

  def __init__(self, context, *, tail_slots: int, **kwargs):
    super().__init__(context, **kwargs)
    if tail_slots < 1:
      raise ValueError(f"tail_slots={tail_slots} must be >= 1")
    self.tail_slots = int(tail_slots)
    self.search_threads = available_cores()  # nothing else runs on the host during the search
    self.reuse_buffers = False  # see _step_buffers
    self._buffers = None
    self._prefetcher = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvjax-prefetch")
    self._next = None  # lag 2: the future of the next step's rows
    # Per layer, the ids [B, Hq, slots] of the steps selected for but not scored yet, oldest
    # first: the head is what the step that just ended used.
    self._selections: dict[int, collections.deque] = collections.defaultdict(collections.deque)

  def close(self) -> None:
    self._prefetcher.shutdown(wait=True, cancel_futures=True)
    super().close()

  def start_prefetch(self, to_device, *step_args) -> None:
    """Lag 2: runs `to_device(*prefetch_step(*step_args))` on the prefetch thread; the result
    serves the step after next (see the module docstring)."""
    if self._next is not None:
      raise RuntimeError("a prefetch is already pending: take it first")
    self._next = self._prefetcher.submit(lambda: to_device(*self.prefetch_step(*step_args)))

  def take_prefetched(self):
    """The pending prefetch's result (waited for), or None when none was started."""
    pending, self._next = self._next, None
    if pending is None:
      return None
    t0 = time.perf_counter()
    result = pending.result()  # re-raises a failure of the job, outside any jitted program
    self.stats.step_wait_seconds += time.perf_counter() - t0
    return result

  def repeat_selection(self) -> None:
    """Records that the next step reuses the latest selection (lag 2, first step after prefill)."""
    for queue in self._selections.values():
      queue.append(queue[-1])

  @property
  def slots(self) -> int:
    return self.topk + self.tail_slots

  def prefetch_step(
      self,
      layers,  # the layers served from the host (the others stay dense on the device)
      queries,  # [L, B, Hq, D] float32: each layer's query of the step that just ended
      evicted_k,  # [L, B, Hkv, D]: the token each layer's window evicted in that step
      evicted_v,  # [L, B, Hkv, D]
      evicted_q,  # [L, B, Hq, D]: that token's own query (roar links the new key through it)
      evicted_pos,  # [L, B] int: its absolute position, -1 where none left
  ):
    """Steps 1-5 of the module docstring -> (k [L, B, Hq, slots, D], v, valid [L, B, Hq, slots])
    with k and v in the store's numpy dtype (bfloat16 as uint16 bits), zero where not valid."""
    t0 = time.perf_counter()
    self._wait_background(-1)
    t1 = time.perf_counter()
    queries = np.asarray(queries, np.float32)
    L, B, Hq, D = queries.shape
    for layer in layers:
      for b in np.flatnonzero(evicted_pos[layer] >= 0):
        added = self.context.append(int(b), layer, int(evicted_pos[layer, b]) - self.sinks,
                                    evicted_k[layer, b][:, None], evicted_v[layer, b][:, None])
        if added:
          self._unindexed_queries.setdefault((int(b), layer), []).append(evicted_q[layer, b])
        self.stats.inserted_tokens += added
    self._index_overflow(layers, B)
    t2 = time.perf_counter()
    self.stats.insert_seconds += t2 - t1

    store = self.context.store
    out_k, out_v = self._step_buffers((L, B, Hq, self.slots, D), store.buffers(0, 0)[0].dtype)
    valid = np.zeros((L, B, Hq, self.slots), bool)
    kv_of_q = np.arange(Hq) // self.context.group
    found, scanned = self.context.search_layers(layers, queries[layers], k=self.topk, ef=self.ef,
                                                threads=self.search_threads)  # [T, B, Hq, k]
    self._count_scanned(scanned)
    for layer, ids in zip(layers, found):
      queue = self._selections[layer]
      if queue:  # what the step that just ended used, against that step's own query's result
        hits, total = reuse_hits(queue.popleft(), ids)
        self.stats.reused_hits += hits
        self.stats.reused_total += total
      tail = np.broadcast_to(self._tail_ids(layer, B), (B, Hq, self.tail_slots))
      ids = np.concatenate([ids, tail], axis=-1)  # [B, Hq, slots]
      queue.append(ids)
      for b in range(B):  # one threaded C copy (NumPy fancy indexing took ~50 ms per step at 8B shapes)
        store.gather_rows(b, layer, kv_of_q[:, None], ids[b], out_k=out_k[layer, b], out_v=out_v[layer, b],
                          threads=self.search_threads)
      valid[layer] = ids >= 0
      self.stats.unindexed_attended += int(np.sum(ids[:, 0, self.topk:] >= 0))
    t3 = time.perf_counter()
    self.stats.attend_seconds += t3 - t2
    self._submit_background(-1, None)
    self.stats.callbacks += 1
    self.stats.callback_seconds += time.perf_counter() - t0
    return out_k, out_v, valid

  def _step_buffers(self, shape, dtype):
    """The [L, B, Hq, slots, D] K and V buffers of a step; dense layers' rows stay zero.

    With `reuse_buffers` the same two arrays serve every step: the caller's copy to the device
    of one step's buffers must be complete before the next `prefetch_step` (lag 1: the step
    that reads it has ended; lag 2: the policy's `to_device` blocks until the copy is ready). Fresh buffers cost their page faults each step (~9 ms per 28 MB on the dev box);
    the caller must not reuse them where the device may alias host memory (JAX on the CPU)."""
    if self.reuse_buffers and self._buffers is not None and self._buffers[0].shape == shape:
      return self._buffers
    buffers = np.zeros(shape, dtype), np.zeros(shape, dtype)
    if self.reuse_buffers:
      self._buffers = buffers
    return buffers

  def _tail_ids(self, layer: int, batch: int):
    """Store ids [B, 1, tail_slots] (-1 padded) of each sequence's stored, unindexed tokens."""
    tail = np.full((batch, self.tail_slots), -1, np.int64)
    for b in range(batch):
      done, total = self.context.indexed(b, layer), self.context.store.length(b, layer)
      tail[b, : total - done] = np.arange(done, total)
    return tail[:, None, :]

  def _index_overflow(self, layers, batch: int) -> None:
    """Indexes now, on the critical path, any (seq, layer) whose unindexed tokens would not
    fit the tail slots (normally never: one token per step is indexed in the background)."""
    late = [(b, l) for l in layers for b in range(batch)
            if self.context.store.length(b, l) - self.context.indexed(b, l) > self.tail_slots]
    if late:
      for pair in late:
        q = np.stack(self._unindexed_queries.pop(pair), axis=1)[None]  # [1, Hq, n, D]
        self.context.index_stored([pair[0]], [pair[1]], queries=q)

  def _submit_background(self, layer: int, search_queries) -> None:
    """Queues the indexing of every layer's stored tokens as one job (key -1)."""
    pairs = sorted(self._unindexed_queries)
    to_index = [(pair, np.stack(self._unindexed_queries.pop(pair), axis=1)) for pair in pairs]  # [Hq, n, D]
    if to_index:
      self._pending[layer] = self._executor.submit(self._background_job, layer, to_index, None)
