"""The host side of a decode run and its bridge from jitted code (`jax.pure_callback`).

A jitted step cannot hold Python objects, so each `HostRuntime` (a host_index.HostContext
plus the retrieval settings, counters and error log of one run) is registered under an
integer id; the id travels in the policy state as a traced int32 and the callback looks the
runtime up. One compiled decode step therefore serves every context of the same shapes.

Tokens leaving the device window are copied into the host store on the critical path and
indexed off it: each layer's callback hands the indexing of its new tokens (and, speculative,
the next step's search) to a background thread, and waits for that job at the same layer's
callback of the next step, after every other layer had its turn. Tokens stored but not yet
indexed are attended exactly, by store id, beside the retrieved ones (one or two per layer
in steady state), so deferring the insert loses nothing. Indexing is a large share of the host
work: with 8B shapes at 32K on random vectors, 53 ms per step against 87 ms of search and
attention (experiments/results/bench_decode_8b_32k.md).

Callbacks never raise inside the jitted program: an exception is logged on the runtime,
the callback returns a nonzero status (and o = 0, lse = -inf so the step stays finite), and
`HostRuntime.raise_errors()` raises it after the step.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import os
import sys
import threading
import time
import traceback
import warnings

import numpy as np

import host_index

_RUNTIMES: dict[int, object] = {}
_NEXT_ID = itertools.count(1)
_LOCK = threading.Lock()


def register(runtime) -> int:
  """Registers any host-side runtime object; returns the id to carry in a policy state."""
  with _LOCK:
    runtime_id = next(_NEXT_ID)
    _RUNTIMES[runtime_id] = runtime
  return runtime_id


def unregister(runtime_id: int) -> None:
  with _LOCK:
    _RUNTIMES.pop(int(runtime_id), None)


def lookup(runtime_id: int):
  return _RUNTIMES.get(int(runtime_id))

STATUS_OK = 0
STATUS_HOST_ERROR = 1
STATUS_UNKNOWN_CONTEXT = 2


@dataclasses.dataclass
class HostStats:
  """Per-run counters (seconds are host wall time inside callbacks)."""

  callbacks: int = 0
  insert_seconds: float = 0.0  # storing evicted tokens (a copy) on the critical path
  attend_seconds: float = 0.0  # search + attention (+ waits) on the critical path
  wait_seconds: float = 0.0  # waiting for the previous step's background job of a layer
  index_seconds: float = 0.0  # background: indexing stored tokens
  # background, index_yields: the indexing's threads waiting for the exchange's C calls (summed over threads)
  index_yield_seconds: float = 0.0
  background_seconds: float = 0.0  # speculative: search time in the background thread
  callback_seconds: float = 0.0
  step_wait_seconds: float = 0.0  # bridge="per_step", lag 2: waiting for the background prefetch
  search_seconds: float = 0.0  # bridge="per_step": the step's searches (inside attend_seconds)
  merge_seconds: float = 0.0  # bridge="per_step", refresh="merge": merging refreshed heads (inside search_seconds)
  gather_seconds: float = 0.0  # bridge="per_step": slot assignment + gathering entering rows (inside attend_seconds)
  transfer_seconds: float = 0.0  # bridge="per_step": copying the step's row update to the device (lag 2: off the critical path)
  transfer_bytes: int = 0  # bridge="per_step": host -> device bytes of those updates
  shipped_rows: int = 0  # bridge="per_step": (slot, row) writes sent, padding excluded
  rows_seconds: float = 0.0  # bridge="per_step", after each step: finishing the read of its queries and evicted tokens
  land_seconds: float = 0.0  # bridge="per_step", after each step: dispatching the row update's scatter
  inserted_tokens: int = 0
  unindexed_attended: int = 0  # stored-not-yet-indexed tokens attended exactly, summed over layers
  scanned: int = 0
  searched_heads: int = 0
  speculated_groups: int = 0  # (seq, layer, kv head, step) served from the previous selection
  corrected_groups: int = 0  # ... corrected synchronously (query drifted below tau)
  refreshed_groups: int = 0  # bridge="per_step": ... refreshed (searched or merged) only on their turn in the rotation
  # Ids a step used from an older search that the step's own search returns too. per_layer: over
  # the heads that reused; per_step: over the heads that searched at the next exchange (a group
  # that keeps its search has no fresh result to score against), so drifted groups weigh in more.
  reused_hits: int = 0
  reused_total: int = 0
  repeated_steps: int = 0  # bridge="per_step", lag 0: steps run again on rows searched with their own queries

  def as_dict(self) -> dict:
    out = dataclasses.asdict(self)
    decided = self.speculated_groups + self.corrected_groups + self.refreshed_groups
    out["correction_rate"] = self.corrected_groups / decided if decided else None
    out["hit_rate"] = self.reused_hits / self.reused_total if self.reused_total else None
    return out


@dataclasses.dataclass
class PrefillTimes:
  """Where a retrieval prefill's offload and index builds spend host wall time (seconds, once
  per prefill: not per decode step, hence not in HostStats; zeros for a loaded context)."""

  offload: float = 0.0  # waiting for each layer's KV and copying it into the store
  train_topk: float = 0.0  # roar: the training queries' exact top keys
  candidates: float = 0.0  # roar: each key's nearest keys (link candidates)
  queue: float = 0.0  # handing the builds to the build workers
  build_wait: float = 0.0  # after the last layer: waiting for the builds still running

  def as_dict(self) -> dict:
    return {f"prefill_{k}_s": round(v, 4) for k, v in dataclasses.asdict(self).items()}


def available_cores() -> int:
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:  # not Linux
    return os.cpu_count() or 1


def background_worker(name: str, nice: int, cores: frozenset[int] | None = None) -> concurrent.futures.ThreadPoolExecutor:
  """A one-thread executor for host work that runs while the device computes a step.

  Its thread runs at Linux nice value `nice` (0: unchanged) and, given `cores`, only on those
  cores (`worker_cores`); so does every OpenMP thread it starts (a thread inherits its creator's
  nice value and CPU affinity). Both keep the thread launching the step's kernels running.
  Measured on the H200 host: 16 busy threads stretched an isolated 8B-shaped per_step step (879
  kernels) from 7.4 to 11.9 ms, and nice 10 won back little of that (11.3); inside decode, nice
  10 took the jitted step from 21.4 to 17.5 ms (8B, 8K) and freekv per_step lag 2 from 7.6 to 6.6
  ms a token (128K) (experiments/results/bench_step_contention_h200.md).
  """
  check_background_nice(nice)
  return concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name,
                                               initializer=_lower_priority, initargs=(nice, cores))


def default_reserved_cores(cores: int) -> int:
  """Cores kept free of worker threads for the thread launching the device's kernels: none, on
  any number of cores. Reserving 2 of the H200 host's 16 took retrieval's jitted step at 128K
  from 6.7-7.0 to 4.5-4.9 ms (full: 4.3-4.5), but its lag-2 exchange, then the critical path, had
  14 cores and the token took 10.5 / 11.6 / 10.1 ms against 10.0 / 10.8 / 10.3 with none (three
  runs: within noise; freekv lag 2: 7.8 against 7.3, one run;
  experiments/results/bench_scale_smollm2shapes_synthetic_128k_reserved.md, _exchange_cores.md,
  _default_r0.md). Again on an H100 after the selection moved into C (2026-12-05): 9.56 ms with 2
  reserved (jitted step 4.52, full's 4.85) against 9.87 with none, one run each, the exchange (8.7-9
  ms) still the critical path (bench_scale_smollm2shapes_synthetic_128k_select_after.md). Measure
  again once the exchange is shorter than the step."""
  del cores
  return 0


def worker_cores(reserved: int) -> frozenset[int] | None:
  """The cores this process may use minus the `reserved` lowest-numbered; None (no pinning)
  when nothing is reserved or the platform has no CPU affinity. Raises when none would be left."""
  if reserved < 0:
    raise ValueError(f"reserved_cores={reserved} must be >= 0")
  if reserved == 0 or not hasattr(os, "sched_getaffinity"):
    return None
  allowed = sorted(os.sched_getaffinity(0))
  if len(allowed) - reserved < 1:
    raise ValueError(f"reserved_cores={reserved} leaves no core of the {len(allowed)} this process may use")
  return frozenset(allowed[reserved:])


def exchange_nice(cores: frozenset[int] | None, background_nice: int) -> int:
  """The nice value of a lag-2 exchange thread: the caller's (0) where it has worker cores to itself
  (the launching thread keeps the reserved ones), else `background_nice`."""
  return 0 if cores else background_nice


def _lower_priority(nice: int, cores: frozenset[int] | None = None) -> None:
  """Raises the calling thread's nice value to `nice` (never lowers it: that needs privileges)
  and, given `cores`, restricts it to them. Linux only (elsewhere both calls would act on the
  whole process)."""
  if not sys.platform.startswith("linux"):
    return
  tid = threading.get_native_id()
  try:  # a seccomp sandbox may refuse either: the thread then keeps its priority or cores
    if nice > 0:
      os.setpriority(os.PRIO_PROCESS, tid, max(nice, os.getpriority(os.PRIO_PROCESS, tid)))
    if cores:
      os.sched_setaffinity(tid, cores)
  except OSError:
    pass


def check_background_nice(nice) -> None:
  if isinstance(nice, bool) or not isinstance(nice, (int, np.integer)) or not 0 <= nice <= 19:
    raise ValueError(f"background_nice={nice!r} must be an int in [0, 19]")


def default_background_threads() -> int:
  """Half the cores this process may run on (at least 1): the background jobs (indexing,
  speculative search) leave the other half to the critical path (insert, corrections,
  attention, feeding the device)."""
  return max(1, available_cores() // 2)


def warn_failed(futures, what: str) -> None:
  """A background job that failed after the last step has no step left to raise its error: it
  is reported as a warning when its runtime closes (close may run while another error unwinds)."""
  for future in futures:
    if future is not None and future.done() and not future.cancelled() and future.exception() is not None:
      warnings.warn(f"a host {what} job failed after the last decode step: {future.exception()!r}", RuntimeWarning,
                    stacklevel=3)


class HostRuntime:
  """One run's host context, retrieval settings and error log.

  background_threads: OpenMP threads of the background jobs (indexing, speculative search;
  default half the cores, `default_background_threads`); the critical path gets the other
  cores. The two thread teams run at the same time and must not share cores: an OpenMP team
  whose threads are descheduled by the other team's spinning threads stalls for a time slice.
  background_nice: nice value of the background threads (`background_worker`).
  worker_cores: the cores the background threads run on (as `worker_cores` returns them; None: any).
  index_yields: the background indexing pauses (between its per-index tasks) while a search, slot
    selection, row gather or host attention runs (host_index/csrc/hi_gate.h): it then runs in the
    critical path's gaps instead of beside its C calls.
  ef_insert: the candidate list of the decode-time inserts' beam searches (None: the indexes' own
    ef_insert, 64 for roar; `host_index.HostContext.insert_many`).
  """

  def __init__(self, context: host_index.HostContext, *, sinks: int, window: int, topk: int, ef: int | None,
               scale: float, speculative: bool = False, tau: float = 0.8, background_threads: int | None = None,
               background_nice: int = 0, worker_cores: frozenset[int] | None = None, index_yields: bool = False,
               ef_insert: int | None = None):
    self.context = context
    self.sinks, self.window, self.topk, self.ef, self.scale = sinks, window, topk, ef, scale
    self.ef_insert = ef_insert
    self.speculative, self.tau = speculative, tau
    self.background_threads = default_background_threads() if background_threads is None else int(
        background_threads)
    if self.background_threads < 1:
      raise ValueError(f"background_threads={background_threads} must be >= 1")
    self.critical_threads = max(1, available_cores() - self.background_threads)
    self.background_nice = background_nice
    self.worker_cores = worker_cores
    self.index_yields = bool(index_yields)
    self.stats = HostStats()
    self.prefill_times = PrefillTimes()
    self.errors: list[str] = []
    # Speculation: per layer, the previous step's query [B, Hq, D] and the background search
    # launched with it, whose ids [B, Hq, k] serve the next step.
    self._previous_query: dict[int, np.ndarray] = {}
    self._pending: dict[int, concurrent.futures.Future] = {}  # per layer: its background job
    self._unindexed_queries: dict[tuple[int, int], list] = {}  # (seq, layer): stored tokens' queries
    # Per layer: the ids [B, Hq, k] its last step used and which heads [B, Hq] reused a search for them.
    self._used: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    self._executor = background_worker("kvjax-search", self.background_nice, self.worker_cores)
    self.id = register(self)

  def close(self) -> None:
    unregister(self.id)
    # Queued jobs still run: one may index tokens already stored, and cancelling it left the
    # index behind its store (seen once the thread ran at background_nice and started late).
    self._executor.shutdown(wait=True)
    warn_failed(self._pending.values(), "indexing or search")

  def raise_errors(self) -> None:
    if self.errors:
      first = self.errors[0]
      self.errors.clear()
      raise RuntimeError(f"host callback failed: {first}")

  # -- the decode callback -------------------------------------------------------------

  def decode_layer(self, layer: int, queries, evicted_k, evicted_v, evicted_q, evicted_pos):
    """Stores each sequence's evicted token (if any), attends over the host store, and leaves
    the indexing (and, speculative, the next step's search) to the background thread.

    Args:
      layer: the layer.
      queries: [B, Hq, D] float32 current queries (post-RoPE).
      evicted_k, evicted_v: [B, Hkv, D] the token leaving the device window.
      evicted_q: [B, Hq, D] that token's own query (roar links the new key through it).
      evicted_pos: [B] int32 its absolute position, -1 where no token leaves.

    Returns:
      o [B, Hq, D] float32, lse [B, Hq] float32.
    """
    background = self._wait_background(layer)  # this layer's host state is ours from here
    t0 = time.perf_counter()
    for b in np.flatnonzero(evicted_pos >= 0):
      # Store index: host tokens start after the sinks. A repeated call stores nothing.
      added = self.context.append(int(b), layer, int(evicted_pos[b]) - self.sinks, evicted_k[b][:, None],
                                  evicted_v[b][:, None])
      if added:
        self._unindexed_queries.setdefault((int(b), layer), []).append(evicted_q[b])
      self.stats.inserted_tokens += added
    unindexed = self._unindexed_ids(layer, queries.shape[0])  # [B, n]
    self.stats.unindexed_attended += int(np.sum(unindexed >= 0))
    t1 = time.perf_counter()
    self.stats.insert_seconds += t1 - t0
    if self.speculative:
      o, lse = self._speculative_layer(layer, queries, unindexed, background)
    else:
      ids, scanned = self._search(layer, queries)
      self._count_scanned(scanned)
      o, lse = self._attend_ids(layer, queries, _with_unindexed(ids, unindexed))
    self._submit_background(layer, queries.copy() if self.speculative else None)
    self.stats.attend_seconds += time.perf_counter() - t1
    return o, lse

  # -- the background thread --------------------------------------------------------------

  def _wait_background(self, layer: int):
    """Waits for the job the previous step left for this layer; returns its search result
    (speculative) or None. It had every other layer's callback to finish."""
    pending = self._pending.pop(layer, None)
    if pending is None:
      return None
    t0 = time.perf_counter()
    result = pending.result()  # re-raises a failure of the job, reported after the step
    waited = time.perf_counter() - t0
    self.stats.wait_seconds += waited
    self.stats.attend_seconds += waited
    return result

  def _unindexed_ids(self, layer: int, batch: int):
    """Store ids [batch, n] (-1 padded) of each sequence's stored but not yet indexed tokens."""
    spans = [(self.context.indexed(b, layer), self.context.store.length(b, layer)) for b in range(batch)]
    width = max(total - done for done, total in spans)
    ids = np.full((batch, width), -1, np.int64)
    for b, (done, total) in enumerate(spans):
      ids[b, : total - done] = np.arange(done, total)
    return ids

  def _submit_background(self, layer: int, search_queries) -> None:
    """Queues the indexing of this layer's stored tokens and, with `search_queries`
    [B, Hq, D], the search whose ids the next step reuses."""
    pairs = sorted(key for key in self._unindexed_queries if key[1] == layer)
    to_index = [(pair, np.stack(self._unindexed_queries.pop(pair), axis=1)) for pair in pairs]  # [Hq, n, D]
    if to_index or search_queries is not None:
      self._pending[layer] = self._executor.submit(self._background_job, layer, index_groups(to_index),
                                                   search_queries)

  def _background_job(self, layer: int, groups, search_queries):
    """Indexes the stored tokens of `groups` [(pairs, queries [P, Hq, n, D])] (an index_stored call
    each) and, with `search_queries`, returns that search's (ids, scanned)."""
    t0 = time.perf_counter()
    for pairs, queries in groups:
      self.stats.index_yield_seconds += self.context.index_stored(
          [seq for seq, _ in pairs], [l for _, l in pairs], queries=queries, ef=self.ef_insert,
          threads=self.background_threads, yield_to_foreground=self.index_yields)
    t1 = time.perf_counter()
    self.stats.index_seconds += t1 - t0
    if search_queries is None:
      return None
    result = self._search(layer, search_queries, threads=self.background_threads)
    self.stats.background_seconds += time.perf_counter() - t1
    return result

  # -- speculative retrieval (FreeKV's reuse applied to the vector index) ----------------

  def _count_scanned(self, scanned) -> None:
    self.stats.scanned += int(np.sum(scanned))
    self.stats.searched_heads += int(np.size(scanned))

  def _search(self, layer: int, queries, heads=None, threads=None):
    """Top-k store ids [B, Hq, k] and scanned [B, Hq] of every (seq, query head) in `heads`
    ([B, Hq] bool, default all; the others get -1 / 0): one GIL-free C call, on the critical
    path's cores unless `threads` says otherwise."""
    return self.context.search(layer, queries, k=self.topk, ef=self.ef, heads=heads,
                               threads=threads or self.critical_threads)

  def _speculative_layer(self, layer: int, queries, unindexed, background):
    """background: the (ids, scanned) of the search launched with the previous step's query,
    already waited for, or None. `unindexed` [B, n]: store ids no search can return yet."""
    B, Hq, _ = queries.shape
    Hkv = self.context.num_kv_heads
    previous = self._previous_query.get(layer)
    if previous is None or background is None:
      # No earlier query or search to reuse (the layer's first step): searched, but no
      # speculation was decided, so neither a reuse nor a correction is counted (as freekv).
      ids, scanned = self._search(layer, queries)
      self._count_scanned(scanned)
      correct = np.ones((B, Hkv), bool)
    else:
      ids, scanned = background  # ids of the previous query: the speculative selection
      self._count_scanned(scanned)  # that search (every head, on the background thread)
      self._score_reuse(layer, ids)
      correct = group_mean_cosine(queries, previous, Hkv) < self.tau  # [B, Hkv]
      if correct.any():
        heads = np.repeat(correct, Hq // Hkv, axis=1)  # [B, Hq]
        fresh, fresh_scanned = self._search(layer, queries, heads=heads)
        ids = np.where(heads[..., None], fresh, ids)
        self._count_scanned(fresh_scanned[heads])  # and the corrections' own searches
      self.stats.corrected_groups += int(correct.sum())
      self.stats.speculated_groups += int((~correct).sum())
    o, lse = self._attend_ids(layer, queries, _with_unindexed(ids, unindexed))
    self._used[layer] = (ids, np.repeat(~correct, Hq // Hkv, axis=1))
    self._previous_query[layer] = queries.copy()
    return o, lse

  def _score_reuse(self, layer: int, fresh_ids) -> None:
    """Hit rate: the ids the heads that reused a search used at the previous step against that
    step's own search. A corrected head used that very search: scored, it counted a hit for every
    id (a run correcting every head reported 0.98)."""
    used, reused = self._used.get(layer, (None, None))
    if used is None or not reused.any():
      return
    hits, total = reuse_hits(used[reused], fresh_ids[reused])
    self.stats.reused_hits += hits
    self.stats.reused_total += total

  def _attend_ids(self, layer: int, queries, ids):
    """Attention of queries [B, Hq, D] over given store ids [B, Hq, n] (-1 = none) -> (o, lse):
    one C call on the critical path's cores (small layers stay on this thread)."""
    return self.context.attend_ids(layer, queries, ids, scale=self.scale, threads=self.critical_threads)


def reuse_hits(
    used,  # [..., k] int: ids used (-1 = none), distinct within a row
    fresh,  # [..., k'] int: the exact search result of the same query (-1 = none)
):
  """(valid used ids found in the same row of `fresh`, valid used ids), in one C call."""
  used, fresh = np.asarray(used, np.int64), np.asarray(fresh, np.int64)
  rows_count = int(np.prod(used.shape[:-1]))
  used, fresh = used.reshape(rows_count, used.shape[-1]), fresh.reshape(rows_count, fresh.shape[-1])
  return int(host_index.count_common(used, fresh).sum()), int(np.count_nonzero(used >= 0))


def index_groups(to_index) -> list:
  """[((seq, layer), queries [Hq, n, D])] -> [(pairs, queries [P, Hq, n, D])], one group per token
  count n (index_stored takes pairs with equally many new tokens), in order of first appearance."""
  by_count: dict[int, list] = {}
  for pair, q in to_index:
    by_count.setdefault(q.shape[1], []).append((pair, q))
  return [([pair for pair, _ in group], np.stack([q for _, q in group])) for group in by_count.values()]


def _with_unindexed(
    ids,  # [B, Hq, k] int64 retrieved store ids (-1 = none)
    unindexed,  # [B, n] int64 store ids not in any index yet (-1 = none)
):
  """Every query head's ids followed by its sequence's unindexed ids -> [B, Hq, k + n]."""
  if unindexed.shape[1] == 0:
    return ids
  tail = np.broadcast_to(unindexed[:, None, :], ids.shape[:2] + unindexed.shape[1:])
  return np.concatenate([ids, tail], axis=-1)


def group_mean_cosine(
    queries,  # [B, Hq, D]
    previous,  # [B, Hq, D]
    kv_heads: int,
):
  """Mean over each GQA group of cos(q_t, q_{t-1}) -> [B, kv_heads]."""
  dot = np.sum(queries * previous, axis=-1)
  # np.linalg.norm(x, axis=-1) of a real array, without its Python checks and conj copy (the same bits)
  norms = np.sqrt(np.add.reduce(queries * queries, axis=-1)) * np.sqrt(np.add.reduce(previous * previous, axis=-1))
  cosine = dot / np.maximum(norms, 1e-30)
  return cosine.reshape(cosine.shape[0], kv_heads, -1).mean(axis=-1)


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
