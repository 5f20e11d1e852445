"""The host side of `retrieval(bridge="per_step")`: one host exchange per decode step, outside
the jitted step, instead of one `pure_callback` per layer inside it.

Why: a host callback inside a jitted program costs 0.40-0.57 ms on the H200 even when its
body does nothing (experiments/results/bench_callback.md), and the GPU idles meanwhile; at
32 layers that is 13-18 ms per token, more than the whole dense 8B step at 128K (10.3 ms).
So this bridge keeps the host off the step: the device attends its ring (sinks + window)
plus a buffer of retrieved keys and values the host prepared before the step; the step
exports every layer's query and the token it evicted; between steps the host

  1. waits for the background indexing started by the previous exchange (it ran beside that
     exchange's gather and copy, and the device's step),
  2. stores the tokens evicted by the step that just ended (a copy; indexed in the background),
  3. searches every layer's index with that step's queries, top-k per query head, on every core
     but those reserved for the thread launching the device's kernels,
  4. starts indexing stored tokens on a background thread: each layer's in runs of
     `index_every` every `index_every` exchanges, the layers staggered (the indexes are not read
     again before step 1 of the next exchange),
  5. compares each head's new selection (top-k plus every stored-but-unindexed token, so
     nothing is lost) with what its device slots hold, and gathers only the rows that enter:
     a `RowUpdate` the caller copies to the device and scatters into its [L, B, Hq, slots, D]
     buffers (ids kept from one step to the next keep their slot and are not sent again).

Why only entering rows: the whole [L, B, Hq, slots, D] K and V buffers are 56 MiB per step for
Llama-3-8B shapes, 9.6 ms at the ~6 GB/s of a pageable host->device copy on the H200 machine
(experiments/results/bench_decode_8b_8k_per_step_c.md). Consecutive selections share ids (hit
rate 0.47-0.56 on real SmolLM2 text, 0.22-0.32 on random 8B vectors): the bytes shipped fell by
half and by 28% (bench_decode_*_per_step_packed.md).

The selection used at step t+1 was searched with the query of step t: speculative reuse with
a one-step lag for every head and no synchronous correction (a correction would need the
host inside the step again). `HostStats.hit_rate` measures what the lag costs: the share of
the ids used at a step that the same step's own query would also have selected (retrieved, or
held in its tail as stored but not yet indexed).

With lag 1 steps 1-3 and 5 sit between two device steps, on the critical path. With lag 2 they run on
a background thread while the device computes the next step (`start_prefetch`): the rows used
at step t+1 were searched with the query of step t-1, and the critical path only waits for
the job started one step earlier (`take_prefetched`, counted in `step_wait_seconds`). The
tokens evicted in the last `lag` steps are not in the host rows yet; the device's ring keeps them
(it holds window + lag tokens past the sinks).
"""

from __future__ import annotations

import collections
import concurrent.futures
import time

import numpy as np

import host_index
from kvjax.host_runtime import (HostRuntime, available_cores, background_worker, default_reserved_cores,
                                exchange_nice, group_mean_cosine, index_groups, warn_failed,
                                worker_cores)
from kvjax.row_update import RowUpdate, StepBuffers, new_update


def slot_stores(
    dest,  # [T] int: flat slot indices into [L, B, Hq, slots] buffers
    batch: int,
    q_heads: int,
    slots: int,
    group: int,  # query heads per KV head
):
  """What each slot reads from: the (seq, layer) stores the slots touch, each slot's index
  into that list [T] and its KV head [T]."""
  per_store = q_heads * slots
  flat, store_of = np.unique(dest // per_store, return_inverse=True)  # layer * batch + seq
  return [(int(f) % batch, int(f) // batch) for f in flat], store_of, (dest % per_store) // slots // group


def selection_slots(topk: int, tail_slots: int, successors: int, sources: int, pinned: int = 0,
                    pinned_span: int = 1) -> int:
  """Device buffer rows per (layer, seq, query head): top-k, tail, the successors of the best
  `sources` of the top-k and `pinned` spans of `pinned_span` tokens."""
  return topk + min(sources, topk) * successors + tail_slots + pinned * pinned_span


def group_mean_queries(queries, group: int) -> np.ndarray:
  """Each query head's query replaced by the mean of its KV group's: [..., Hq, D] -> [..., Hq, D].

  The heads of a group then search the same rows: the top-k of the mean query ranks keys by the sum
  of the group's logits (one search a group would serve them all)."""
  *lead, Hq, D = queries.shape
  grouped = np.asarray(queries, np.float32).reshape(*lead, Hq // group, group, D)
  return np.broadcast_to(grouped.mean(axis=-2, keepdims=True), grouped.shape).reshape(*lead, Hq, D)


def successor_ids(found, stored, count: int, age=None):
  """The `count` store ids after each found one, skipping `age` more (-1 where none was found
  or past the store).

  found [T, B, Hq, k], stored [T, B], age [T, B, Hq] (default 0) -> [T, B, Hq, k * count].

  Why: a selection made with the query of step t - lag serves step t. Heads that read a span
  token by token (copying a number, say) attend one position further at each step, so the
  position they need at step t is up to `lag` past the one the older query found, and `age`
  further when a speculative head reuses a search made `age` exchanges ago. Measured on
  SmolLM2 niah_single_2 at 4K: lag 2 without them found 0.36 of the needles against full's
  0.98, with exact (flat) search too (experiments/results/ruler_smollm2_4k_niah2_step_*).
  The exchange composes them in C (host_index.select_slots); this is their NumPy statement."""
  start = found if age is None else found + age[..., None]
  ids = start[..., None] + np.arange(1, count + 1)
  ok = (found[..., None] >= 0) & (ids < stored[:, :, None, None, None])
  return np.where(ok, ids, -1).reshape(*found.shape[:-1], found.shape[-1] * count)  # (-1 fails on 0 layers)


def span_ids(starts, stored, span: int):
  """Each start id and the `span - 1` store ids after it (-1 where no start or past the store).

  starts [T, B, Hq, p], stored [T, B] -> [T, B, Hq, p * span]. The exchange composes them in C
  (host_index.select_slots); this is their NumPy statement."""
  ids = starts[..., None] + np.arange(span)
  ok = (starts[..., None] >= 0) & (ids < stored[:, :, None, None, None])
  return np.where(ok, ids, -1).reshape(*starts.shape[:-1], starts.shape[-1] * span)


def layer_rows(layers) -> slice | np.ndarray:
  """`layers` (ints, ascending) as an index of an [L, ...] array's first axis: a slice where they
  are consecutive (reads are views and writes basic assignments, not fancy-index copies; the
  exchange indexes its per-layer state a dozen times a step), else an int64 array."""
  if len(layers) and list(layers) == list(range(layers[0], layers[0] + len(layers))):
    return slice(layers[0], layers[0] + len(layers))
  return np.asarray(layers, np.int64)


def gather_threads(cores: int) -> int:
  """OpenMP threads of the exchange's slot assignment and gather on `cores` worker cores: a few.

  The background indexing (every worker core by default, at `background_nice`) runs beside them. With
  both on all 16 cores of the H200 host the gather section took 6.3 ms a step at 128K against
  3.1 with the indexing after it (experiments/results/bench_scale_smollm2shapes_synthetic_128k_insert.md):
  an OpenMP team sharing cores with another busy team stalls whenever one of its threads is
  descheduled. The indexing keeps every core: side by side at 32K, giving it only the 11 cores
  the gather and two other threads left made the gather faster (2.9 against 4.4 ms) but the step
  slower (10.4 against 8.3 ms; one run each, the search differing most:
  bench_scale_smollm2shapes_synthetic_32k_index_threads.md)."""
  return max(1, min(4, (cores - 2) // 4))


REFRESH_MODES = ("search", "merge")
SEARCH_QUERIES = ("head", "group_mean")  # what searches a query head's rows: its own query or its KV group's mean


def check_search_query(search_query: str, refresh: str, *, per_query_head_index: bool) -> None:
  """Refuses an unknown `search_query`; and group_mean with refresh="merge" (which scores the tokens
  stored since a search with the heads' own queries) or with an index per query head (a group's one
  search needs the group's one index: roar with roar_heads="kv", or any other kind)."""
  if search_query not in SEARCH_QUERIES:
    raise ValueError(f"search_query={search_query!r}; expected one of {SEARCH_QUERIES}")
  if search_query != "head" and refresh == "merge":
    raise ValueError(f"search_query={search_query!r} does not combine with refresh='merge'")
  if search_query != "head" and per_query_head_index:
    raise ValueError(f"search_query={search_query!r} needs an index per KV head (roar_heads='kv'), not per query head")


def check_index_every(index_every, tail_slots: int) -> None:
  if isinstance(index_every, bool) or not isinstance(index_every, (int, np.integer)):
    raise TypeError(f"index_every={index_every!r} must be an int")
  if not 1 <= index_every <= max(1, tail_slots // 2):
    raise ValueError(f"index_every={index_every} must lie in [1, tail_slots // 2 = {max(1, tail_slots // 2)}]: "
                     "the refresh rotation keeps a group's unsearched tokens within its tail slots")


class PrefetchRuntime(HostRuntime):
  """A HostRuntime driven once per step (`prefetch_step`) rather than per layer by callbacks.

  tail_slots: buffer rows per query head kept for stored-but-unindexed tokens; when more are
    pending (the background indexing fell behind) they are indexed synchronously first.
  successors: the tokens following each of the best `successor_sources` retrieved ids that the
    selection adds (see `successor_ids`).
  pinned, pinned_span: spans kept in every selection (see `pin`): `pinned` start ids per query
    head, each with the `pinned_span - 1` tokens after it.
  background_threads: the indexing's threads (default: every worker core; see `gather_threads`).
  reserved_cores: cores that lag 2's exchange and the indexing (threads and OpenMP teams) stay
    off, for the thread launching the device's kernels (default `default_reserved_cores`). With
    cores reserved the exchange runs at the caller's priority and only the indexing, which has
    until the next exchange, at `background_nice`; with none both run at `background_nice`.
  refresh: how a speculative group that has not drifted is refreshed on its turn in the rotation
    (see `_heads_to_search`): "search" searches its index again with the current query; "merge"
    scores the tokens stored since its latest search against that search's query and merges them
    into its top-k (`_merge_refresh`: no graph search; the group keeps its query until it drifts).
  search_query: "head" (each query head searches with its own query) or "group_mean" (one search a
    KV group, in its index, with its mean query: the group's heads get the same top-k;
    `group_mean_queries`, `_search_heads`).
  index_after_gather: queue the indexing of the stored tokens after the gather, not beside it:
    for an exchange the device waits for (retrieval per_step lag 0 and 1), so the gather has
    the cores and the indexing overlaps the device's next pass (`gather_threads` has the cost of
    sharing them). Lag 2's exchange runs beside the device, where the two side by side finish
    it sooner.
  index_every: each (seq, layer)'s stored tokens are indexed every `index_every` exchanges, the
    layers staggered so that each exchange indexes about 1 / index_every of them, index_every tokens
    each (1: every token at the next exchange). The same inserts in the same order per index, so
    the indexes come out the same; until indexed, a token is attended exactly from its head's tail
    slots, so nothing is lost. Why: an index's consecutive inserts find its graph's nodes in cache:
    36 roar graphs of 32K random keys, one thread, staggered as here: 0.89x the time an insert in
    runs of 4, 0.81x in runs of 8 (experiments/results/bench_insert_runs_roar_32k_cpu.md, a 2-core
    CPU box); inside decode at 128K on an H100 the indexing took as long, but the searches and
    gathers beside it ran faster and the token with 8 took 1.29-1.30x full's time against
    1.39-1.51x with 1 (bench_scale_smollm2shapes_synthetic_128k_s49_index_every*.md; retrieval's
    default is 8). At most tail_slots // 2, so that the refresh rotation keeps a group's unsearched
    tokens within its tail slots.
  """

  def __init__(self, context, *, tail_slots: int, successors: int = 0, successor_sources: int = 8,
               pinned: int = 0, pinned_span: int = 1, background_threads: int | None = None,
               reserved_cores: int | None = None, refresh: str = "search", search_query: str = "head",
               index_after_gather: bool = False, index_every: int = 1, **kwargs):
    if reserved_cores is None:
      reserved_cores = default_reserved_cores(available_cores())
    cores = worker_cores(reserved_cores)
    workers = len(cores) if cores else available_cores()
    if background_threads is None:
      background_threads = workers
    super().__init__(context, background_threads=background_threads, worker_cores=cores, **kwargs)
    self.gather_threads = gather_threads(workers)
    if tail_slots < 1:
      raise ValueError(f"tail_slots={tail_slots} must be >= 1")
    if successors < 0:
      raise ValueError(f"successors={successors} must be >= 0")
    if successor_sources < 1:
      raise ValueError(f"successor_sources={successor_sources} must be >= 1")
    if not 0 <= pinned <= self.topk:
      raise ValueError(f"pinned={pinned} must lie in [0, topk={self.topk}]")
    if pinned_span < 1:
      raise ValueError(f"pinned_span={pinned_span} must be >= 1")
    if refresh not in REFRESH_MODES:
      raise ValueError(f"refresh={refresh!r}; expected one of {REFRESH_MODES}")
    check_search_query(search_query, refresh, per_query_head_index=context.per_q_head)
    check_index_every(index_every, tail_slots)
    self.refresh = refresh
    self.search_query = search_query
    self.tail_slots = int(tail_slots)
    self.successors = int(successors)
    self.successor_sources = min(int(successor_sources), self.topk)
    self.pinned, self.pinned_span = int(pinned), int(pinned_span)
    # [L, B, Hq, pinned] int64: the start ids `pin` chose (-1 = none); None until pinned.
    self.pinned_ids = None
    self.index_after_gather = bool(index_after_gather)
    self.index_every = int(index_every)
    self.search_threads = workers  # the search runs after the previous indexing, before the next
    self.buffers = StepBuffers()
    self._prefetcher = background_worker("kvjax-prefetch", exchange_nice(cores, self.background_nice), cores)
    self._next = None  # lag 2: the future of the next step's rows
    # [L, B, Hq, slots] int64: the store id in each device buffer slot (-1 = empty), as the
    # updates returned so far leave it (each exchange rewrites it in place); None until the first
    # step (or set from a loaded state).
    self.slot_ids = None
    # Per layer, the top-k and tail ids [B, Hq, topk + tail_slots] of the steps selected for but
    # not scored yet, oldest first: the head is what the step that just ended used.
    self._selections: dict[int, collections.deque] = collections.defaultdict(collections.deque)
    # Per (layer, seq, query head): the query of its latest search [L, B, Hq, D], that search's
    # ids [L, B, Hq, k], the tokens indexed when it ran [L, B, Hq] (it saw ids below that) and
    # the exchange it ran in [L, B, Hq].
    self._last_query = self._last_found = self._seen = self._searched_at = None
    # refresh="merge": [L, B, Hq, k] float32, the scores of _last_found by _last_query as the latest
    # merge left them (NaN until a head's first merge after its search).
    self._found_scores = None
    self._exchanges = 0  # prefetch_step calls: the phase of the rotating refresh

  def close(self) -> None:
    self._prefetcher.shutdown(wait=True, cancel_futures=True)
    warn_failed([self._next], "prefetch")
    super().close()

  def start_prefetch(self, to_device, *step_args) -> None:
    """Lag 2: runs `to_device(prefetch_step(*step_args))` on the prefetch thread; the result
    serves the step after next (see the module docstring)."""
    if self._next is not None:
      raise RuntimeError("a prefetch is already pending: take it first")
    self._next = self._prefetcher.submit(lambda: to_device(self.prefetch_step(*step_args)))

  def take_prefetched(self):
    """The pending prefetch's result (waited for), or None when none was started."""
    pending, self._next = self._next, None
    if pending is None:
      return None
    t0 = time.perf_counter()
    result = pending.result()  # re-raises a failure of the job, outside any jitted program
    self.stats.step_wait_seconds += time.perf_counter() - t0
    return result

  def settle(self) -> None:
    """Waits for the pending prefetch (if any, keeping its result for `take_prefetched`), so
    counters read now do not depend on thread timing; raises its failure (outside any jitted
    program), whose counters would be partial. Also waits for the indexing queued by the last
    exchange, so sizes read now (the index bytes) are not read while it inserts."""
    if self._next is not None:
      concurrent.futures.wait([self._next])  # it may queue indexing: waited for next
    concurrent.futures.wait(list(self._pending.values()))
    if self._next is not None and self._next.exception() is not None:
      raise RuntimeError("the host prefetch failed") from self._next.exception()

  def repeat_selection(self) -> None:
    """Records that the next step reuses the latest selection (lag 2, first step after prefill)."""
    for queue in self._selections.values():
      queue.append(queue[-1])

  @property
  def slots(self) -> int:
    return selection_slots(self.topk, self.tail_slots, self.successors, self.successor_sources, self.pinned,
                           self.pinned_span)

  def pin(self, layers, queries, device_lse=None, valid=None) -> None:
    """Keeps each head's best `pinned` ids for the prompt's last queries, with the tokens after
    them, in every later selection (`prefetch_step`).

    queries: [L, B, Hq, W, D] float32, the last W prompt queries (W = 1: the last token's, the
      question the decode answers), oldest first.
    device_lse: [L, B, Hq, W] float32, each query's log-sum-exp over the device-resident keys
      it attends (the sinks and the ring); needed when W > 1.
    valid: [B, W] bool, the queries that exist (a prompt shorter than W + sinks has fewer).

    W = 1 keeps the search's best ids. W > 1 ranks the union of the W queries' search results by
    the attention the queries give them together (SnapKV's observation window): each query's
    softmax over those ids and the device keys, summed over the queries; exact scores, found ids.

    Why: a lagged or reused selection was searched with an older query, so when the answer moves
    to another needle (niah_multiquery) or starts at a far one, the needed keys are not among
    its rows until a search made after the turn reaches the device. The prompt's question
    already attends the needles it asks for; keeping their spans resident costs device rows
    (copied once: a kept id keeps its slot) and these searches."""
    if not self.pinned:
      return
    rows = layer_rows(layers)
    L, B, Hq, W, _ = queries.shape
    valid = np.ones((B, W), bool) if valid is None else np.asarray(valid, bool)
    found = [self.context.search_layers(layers, queries[rows, :, :, w], k=self.topk, ef=self.ef,
                                        heads=np.broadcast_to(valid[None, :, w, None], (len(layers), B, Hq)).copy(),
                                        threads=self.search_threads)[0] for w in range(W)]  # [T, B, Hq, k] each
    self.pinned_ids = np.full((L, B, Hq, self.pinned), -1, np.int64)
    if W == 1:
      self.pinned_ids[rows] = found[0][..., :self.pinned]
      return
    if device_lse is None:
      raise ValueError("pin: device_lse is needed with more than one query a head")
    group = Hq // self.context.num_kv_heads
    store = self.context.store
    for t, layer in enumerate(np.arange(L)[rows]):
      for b in range(B):
        for h in range(Hq):
          ids = np.unique(np.concatenate([f[t, b, h] for f in found]))
          ids = ids[ids >= 0]
          if not len(ids) or not valid[b].any():
            continue
          keys = store.to_float32(store.gather_rows(b, int(layer), h // group, ids)[0])  # [n, D]
          scores = self.scale * (queries[layer, b, h][valid[b]] @ keys.T)  # [W', n]
          lse = np.logaddexp(np.logaddexp.reduce(scores, axis=-1), device_lse[layer, b, h][valid[b]])
          votes = np.exp(scores - lse[:, None]).sum(0)
          best = ids[np.argsort(-votes, kind="stable")[:self.pinned]]
          self.pinned_ids[layer, b, h, :len(best)] = best

  def prefetch_step(
      self,
      layers,  # the layers served from the host (the others stay dense on the device)
      queries,  # [L, B, Hq, D] float32: each layer's query of the step that just ended
      evicted_k,  # [L, B, Hkv, D]: the token each layer's window evicted in that step
      evicted_v,  # [L, B, Hkv, D]
      evicted_q,  # [L, B, Hq, D]: that token's own query (roar links the new key through it)
      evicted_pos,  # [L, B] int: its absolute position, -1 where none left
  ) -> RowUpdate:
    """Steps 1-5 of the module docstring -> the RowUpdate that turns the device buffers (as
    `slot_ids` records them) into the next step's selection; `slot_ids` is advanced to it."""
    t0 = time.perf_counter()
    self._wait_background(-1)
    t1 = time.perf_counter()
    queries = np.asarray(queries, np.float32)
    L, B, Hq, D = queries.shape
    self._store_evicted(layers, evicted_k, evicted_v, evicted_q, evicted_pos)
    lengths = self.context.store.lengths()  # [num_seqs, L]: fixed for the rest of the step
    indexed_all = self._index_overflow(layers, B, lengths)
    t2 = time.perf_counter()
    self.stats.insert_seconds += t2 - t1

    first = self._last_query is None  # every head searches
    if first:
      self._last_query = np.zeros((L, B, Hq, D), np.float32)
      self._last_found = np.full((L, B, Hq, self.topk), -1, np.int64)
      self._seen = np.zeros((L, B, Hq), np.int64)
      self._searched_at = np.zeros((L, B, Hq), np.int64)
      self._found_scores = np.full((L, B, Hq, self.topk), np.nan, np.float32)
    rows = layer_rows(layers)  # indexes [L, ...] arrays: a slice (views) where the layers are consecutive
    stored = lengths[:, rows].T  # [T, B]
    indexed = indexed_all[:, rows].T
    self._exchanges += 1
    searched, merged = self._heads_to_search(rows, queries, stored, first)  # [T, B, Hq] bool each
    found = np.where(searched[..., None], self._search_heads(layers, queries[rows], searched), self._last_found[rows])
    if self.refresh == "merge":  # a new search's top-k is scored at its first merge
      t, b, h = np.nonzero(searched)
      self._found_scores[np.asarray(layers)[t], b, h] = np.nan
    if merged.any():
      t_merge = time.perf_counter()
      found = self._merge_refresh(layers, found, merged, stored)
      self.stats.merge_seconds += time.perf_counter() - t_merge
    self._last_query[rows] = np.where(searched[..., None], queries[rows], self._last_query[rows])
    self._last_found[rows] = found
    self._seen[rows] = np.where(searched, indexed[..., None], self._seen[rows])
    self._searched_at[rows] = np.where(searched, self._exchanges, self._searched_at[rows])
    t3 = time.perf_counter()
    self.stats.search_seconds += t3 - t2
    if self.slot_ids is None:
      self.slot_ids = np.full((L, B, Hq, self.slots), -1, np.int64)
    self.stats.unindexed_attended += int((stored - indexed).sum())
    # The indexes are not read again until the next exchange (which waits for this job first): the
    # indexing may run beside the gather and the copy to the device, which read only the store.
    update = self._select(layers, rows, found, searched, stored, queue_indexing=not self.index_after_gather)
    if self.index_after_gather:
      self._submit_background(-1, None)
    self.stats.gather_seconds += time.perf_counter() - t3
    self.stats.attend_seconds += time.perf_counter() - t2
    self.stats.callbacks += 1
    self.stats.callback_seconds += time.perf_counter() - t0
    return update

  def _search_heads(self, layers, queries, searched):  # queries [T, B, Hq, D], searched [T, B, Hq] bool
    """The searched heads' top-k ids [T, B, Hq, k] (the others' rows unspecified). group_mean: one
    search a KV group, with its mean query, shared by its heads (`_heads_to_search` decides per group)."""
    if self.search_query == "head":
      found, scanned = self.context.search_layers(layers, queries, k=self.topk, ef=self.ef, heads=searched,
                                                  threads=self.search_threads)
      self._count_scanned(scanned[searched])
      return found
    group = self.context.group
    leaders = searched & (np.arange(searched.shape[-1]) % group == 0)  # each group's first head searches for it
    found, scanned = self.context.search_layers(layers, group_mean_queries(queries, group), k=self.topk, ef=self.ef,
                                                heads=leaders, threads=self.search_threads)
    self._count_scanned(scanned[leaders])
    return np.repeat(found[..., ::group, :], group, axis=2)

  def _store_evicted(self, layers, evicted_k, evicted_v, evicted_q, evicted_pos) -> None:
    """Appends every layer's evicted tokens in one call (a call per token and layer cost ~60 µs:
    1.8 ms a step at SmolLM2's 30 layers) and keeps each new token's query for its indexing; a
    token stored already (a repeated step) is skipped."""
    layer_ids = np.asarray(layers, np.int64)
    rows, seqs = np.nonzero(evicted_pos[layer_ids] >= 0)
    pair_layers = layer_ids[rows]
    starts = evicted_pos[pair_layers, seqs].astype(np.int64) - self.sinks
    stored = self.context.store.lengths()[seqs, pair_layers]
    self.stats.inserted_tokens += self.context.append_tokens(seqs, pair_layers, starts, evicted_k[pair_layers, seqs],
                                                             evicted_v[pair_layers, seqs])
    new = np.flatnonzero(starts == stored)
    new_seqs, new_layers = seqs[new], pair_layers[new]
    # One gather of the new tokens' queries [N, Hq, D], kept as rows of it (a view per pair, not an index of
    # evicted_q with NumPy scalars per pair).
    for b, layer, q in zip(new_seqs.tolist(), new_layers.tolist(), evicted_q[new_layers, new_seqs]):
      self._unindexed_queries.setdefault((b, layer), []).append(q)

  def _select(
      self,
      layers,
      rows,  # layer_rows(layers)
      found,  # [T, B, Hq, k] int64: each head's latest search result, best first
      searched,  # [T, B, Hq] bool: the heads whose search ran in this exchange
      stored,  # [T, B] int: store lengths
      *,
      queue_indexing: bool,
  ) -> RowUpdate:
    """Each head's selection (its latest top-k, every stored token that search could not return,
    the successors of its best ids, its pinned spans; dense layers' slots stay empty) given slots
    against `slot_ids` (rewritten in place; a repeated id takes one slot) -> the RowUpdate of the
    entering rows. Also scores the selection the step that just ended used (`HostStats.hit_rate`)
    and, with `queue_indexing`, queues the background indexing.

    Why one C call (host_index.select_slots) composes, scores and assigns: built in NumPy, the
    selections were [L, B, Hq, slots] temporaries and a dozen whole-array operations holding the
    GIL, which the thread launching the device's next step waits for (2.3 ms a step in long waits
    at SmolLM2 shapes on the H200 host: experiments/results/bench_prefetch_smollm2shapes_32k_pinned16.md).
    Why the indexing is queued just before that call: the call releases the GIL while the job runs
    its Python part. Queued before the inputs were ready, the job took the GIL at their first NumPy
    call that released it, and the selection waited for it (0.5 ms a step on a 2-core box)."""
    seen = self._seen[rows]  # [T, B, Hq]
    if (stored[..., None] - seen > self.tail_slots).any():  # _index_overflow and _heads_to_search prevent it
      raise RuntimeError("retrieval per_step: more stored tokens than tail slots escaped the searches")
    self.slot_ids = np.require(self.slot_ids, np.int64, "CW")  # rewritten in place (a copy only if set read-only)
    used, score = self._scored(layers, searched)
    age = self._exchanges - self._searched_at[rows] if self.successors else None  # 0: searched now
    pins = None if self.pinned_ids is None else self.pinned_ids[rows]
    if queue_indexing:
      self._submit_background(-1, None)
    selection = host_index.select_slots(
        self.slot_ids, layers, found, seen, stored, tail=self.tail_slots, age=age, sources=self.successor_sources,
        successors=self.successors, pins=pins, span=self.pinned_span, used=used, score=score,
        threads=self.gather_threads)
    self.stats.reused_hits += selection.hits
    self.stats.reused_total += selection.total
    for t, layer in enumerate(layers):
      self._selections[layer].append(selection.retrieved[t])
    dest, ids, src = selection.dest, selection.ids, selection.rows
    if np.any(np.diff(layers) < 0):  # the writes in slot order, as the scatter expects
      order = np.argsort(dest)
      dest, ids, src = dest[order], ids[order], src[order]
    return self._gather_update(layers, dest, ids, src)

  def _scored(self, layers, searched):  # searched [T, B, Hq] bool
    """What the step that just ended used, to score against this step's search: its top-k and
    tail ids [T, B, Hq, k + tail] (distinct; successors and pins are additions, not results) and
    the heads scored [T, B, Hq] (those that searched now: a head that reused its search has no
    fresh result); (None, None) when no layer has a selection queued."""
    scored = [t for t, layer in enumerate(layers) if self._selections[layer]]
    if not scored:
      return None, None
    used = np.array([self._selections[layers[t]].popleft() for t in scored])  # np.stack's result (equal shapes)
    if len(scored) == len(layers):
      return used, searched
    full = np.full((len(layers),) + used.shape[1:], -1, np.int64)
    full[scored] = used
    score = np.zeros_like(searched)
    score[scored] = searched[scored]
    return full, score

  def _gather_update(
      self,
      layers,
      dest,  # [n] int64: flat slot indices into slot_ids, increasing
      ids,  # [n] int64: the id each takes (-1 = emptied)
      src,  # [n] int64: each write's (layer, seq, query head) row (t * B + b) * Hq + h of layers
  ) -> RowUpdate:
    """The RowUpdate of the slot writes: entering rows gathered from every (layer, seq) store in
    one threaded C call."""
    L, B, Hq, S = self.slot_ids.shape
    store = self.context.store
    dtype, D = store.storage_dtype, self.context.head_dim
    update = new_update(self.buffers, dest.size, L * B * Hq * S, D, dtype)
    stores = [(b, layer) for layer in layers for b in range(B)]  # store t * B + b
    store.gather_rows_many(stores, src // Hq, src % Hq // self.context.group, ids, out_k=update.k[:dest.size],
                           out_v=update.v[:dest.size], threads=self.gather_threads)  # id -1: a zero row
    update.dest[:dest.size] = dest
    update.ids[:dest.size] = ids
    update.pad(L * B * Hq * S)
    self.stats.shipped_rows += dest.size
    return update

  def _heads_to_search(self, rows, queries, stored, first: bool):  # queries [L, B, Hq, D], stored [T, B]
    """Which (layer, seq, query head)s search at this step and which merge (`_merge_refresh`),
    [T, B, Hq] bool each: every head searches, or with `speculative` the KV-head groups whose
    mean cosine between this query and the query of their latest search fell below `tau`, plus a
    rotating 1 / (tail_slots // 2) of the groups, which with refresh="merge" merge instead. A
    group that keeps its search attends the tokens stored since in its tail slots, so nothing is
    lost; the rotation refreshes each group before its tail fills, spread evenly over the steps
    (refreshing every group when its tail filled searched them all in the same step, all of them
    having started together). Counted in corrected_groups (drifted, or the safety net),
    refreshed_groups (on their turn only: not a correction, so tau's effect reads from the
    correction rate) and speculated_groups."""
    T, B, Hq = stored.shape[0], queries.shape[1], queries.shape[2]
    if first or not self.speculative:
      return np.ones((T, B, Hq), bool), np.zeros((T, B, Hq), bool)
    G = self.context.group
    drift = group_mean_cosine(queries[rows].reshape(T * B, Hq, -1), self._last_query[rows].reshape(T * B, Hq, -1),
                               Hq // G).reshape(T, B, Hq // G) < self.tau
    period = max(1, self.tail_slots // 2)
    # The phase counts (layer, group), not the sequence: a sequence's refreshes, and so its tokens,
    # do not depend on its place in the batch (batch-1 and batch-N runs of it agree). [T, 1, Hq // G],
    # broadcast over the batch below.
    due = (np.arange(T * (Hq // G)).reshape(T, 1, Hq // G) + self._exchanges) % period == 0
    unseen = (stored[..., None] - self._seen[rows]).reshape(T, B, Hq // G, G).max(axis=-1)
    corrected = drift | (unseen > self.tail_slots)  # the last: a safety net the rotation keeps unused
    redo = corrected | due  # [T, B, Hq // G]
    # counts of corrected, redo & ~corrected (corrected lies inside redo) and ~redo
    n_corrected, n_redo = int(np.count_nonzero(corrected)), int(np.count_nonzero(redo))
    self.stats.corrected_groups += n_corrected
    self.stats.refreshed_groups += n_redo - n_corrected
    self.stats.speculated_groups += redo.size - n_redo
    if self.refresh == "merge":
      return np.repeat(corrected, G, axis=-1), np.repeat(redo & ~corrected, G, axis=-1)
    return np.repeat(redo, G, axis=-1), np.zeros((T, B, Hq), bool)

  def _merge_refresh(
      self,
      layers,
      found,  # [T, B, Hq, k] int64: each head's latest top-k, best first
      merged,  # [T, B, Hq] bool: the heads to refresh by merging
      stored,  # [T, B] int: store lengths
  ):
    """`found` with each merged head's row replaced by the top-k, by the query of its latest
    search, of that top-k and every token stored since (the tokens its tail slots hold): exact
    scores, the rows they need gathered in one C call (a head's top-k only at its first merge
    after a search; later merges reuse their scores, `_found_scores`). Advances the merged
    heads' `_seen` to the store's length.

    Why: on their turn a group that has not drifted was searched again, ~0.2 ms of one core a
    head at 128K (experiments/results/bench_op_costs_*), and at the 128K benchmark's ~0.01
    correction rate nearly all of a step's ~70 searches were these refreshes. Their purpose,
    folding the new tokens in before the tail fills, needs only those tokens' scores. Merged by
    the search's own query, so its drift is still measured from it, a drifted group is searched
    as before, and its successors keep their age (the search's)."""
    t, b, h = np.nonzero(merged)  # R heads
    at = (np.asarray(layers)[t], b, h)  # their index into the [L, B, Hq, ...] state
    k, G, B = self.topk, self.context.group, stored.shape[1]
    seen = self._seen[at]
    # [R, tail]: the tokens stored since (at most tail_slots: a group with more is searched, _heads_to_search)
    new = seen[:, None] + np.arange(self.tail_slots)
    new = np.where(new < stored[t, b][:, None], new, -1)
    candidates = np.concatenate([found[t, b, h], new], axis=1)  # [R, n]; found ids < seen <= new ids
    n = candidates.shape[1]
    scores = np.full(candidates.shape, -np.inf, np.float32)
    scores[:, :k] = self._found_scores[at]  # NaN where not scored since the search
    need = np.flatnonzero((candidates >= 0) & ~np.isfinite(scores))  # flat into [R, n]
    store = self.context.store
    keys, _ = store.gather_rows_many([(seq, layer) for layer in layers for seq in range(B)], (t * B + b)[need // n],
                                     (h // G)[need // n], candidates.reshape(-1)[need], threads=self.gather_threads)
    scores.reshape(-1)[need] = np.einsum("md,md->m", store.to_float32(keys), self._last_query[at][need // n])
    scores = np.where(candidates >= 0, scores, -np.inf)  # found ids -1 kept NaN above
    best = np.argsort(-scores, axis=1, kind="stable")[:, :k]  # ties: the search's order, then the store's
    top = np.take_along_axis(scores, best, axis=1)
    found = found.copy()
    found[t, b, h] = np.where(top > -np.inf, np.take_along_axis(candidates, best, axis=1), -1)
    self._found_scores[at] = top
    self._seen[at] = stored[t, b]
    return found

  def _index_overflow(self, layers, batch: int, lengths) -> np.ndarray:  # lengths [num_seqs, L]
    """Indexes now, on the critical path, any (seq, layer) whose unindexed tokens would not
    fit the tail slots (normally never: the background indexing keeps each layer about
    `index_every` <= tail_slots // 2 tokens behind).
    Returns the indexed counts [num_seqs, L] after it."""
    indexed = self.context.indexed_counts()
    behind = (lengths - indexed)[:batch, layers]  # [B, T]
    late = [(int(b), int(layers[t])) for t, b in zip(*np.nonzero(behind.T > self.tail_slots))]
    if not late:
      return indexed
    for pair in late:
      q = np.stack(self._unindexed_queries.pop(pair), axis=1)[None]  # [1, Hq, n, D]
      self.context.index_stored([pair[0]], [pair[1]], queries=q, ef=self.ef_insert, threads=self.background_threads)
    return self.context.indexed_counts()

  def _submit_background(self, layer: int, search_queries) -> None:
    """Queues the indexing of the stored tokens of every (seq, layer) due (`index_every`) as one
    job (key -1)."""
    pairs = sorted(pair for pair, pending in self._unindexed_queries.items()
                   if (pair[1] + self._exchanges) % self.index_every == 0 or len(pending) >= self.index_every)
    if not pairs:
      return
    queries = [self._unindexed_queries.pop(pair) for pair in pairs]  # each a list of [Hq, D]
    if all(len(q) == 1 for q in queries):  # a token per pair (each step): one group, one copy
      block = np.array([q[0] for q in queries])  # [P, Hq, D]: np.stack's copy (equal shapes), at half its cost
      groups = [(pairs, block[:, :, None])]  # [P, Hq, 1, D]
    else:
      groups = index_groups([(pair, np.stack(q, axis=1)) for pair, q in zip(pairs, queries)])  # [Hq, n, D] each
    self._pending[layer] = self._executor.submit(self._background_job, layer, groups, None)
