"""`retrieval`: RetrievalAttention (Liu et al., 2024) — a static set on the device, the rest on
the host behind a vector index, merged by log-sum-exp inside the jitted step.

Device: per layer a ring of `sinks` first tokens and the last `window` tokens
([L, B, Hkv, sinks + window, D] keys and values) and the queries of the window tokens
([L, B, Hq, window, D], which roar uses to link an evicted key into its graph).
Host: every other token in a host_index.HostContext, one index per head.

Prefill is dense (as in the paper): the whole prompt's KV sits in a dense cache while the
prompt runs, together with a strided sample of the prefill queries. `finish_prefill` then
fills the rings, moves the middle of the prompt to the host store, computes the training
queries' exact top-N_q keys on the device (ops.exact_topk) and builds the indexes; only
layers kept dense (`dense_layers`, and every sliding-window layer of the model, which is
local by construction) keep their dense cache for decode. A staged prefill state (layer-major
prefill, synthetic contexts) holds only the dense layers and one staging slot, and each layer is
offloaded and indexed (`offload_layer`) as soon as it is written.

Decode, per retrieval layer and step: the token leaving the window (position p − window) is
read from its ring slot before the new token overwrites it and is handed to the single host
callback of the layer, which inserts it into the store and index and then searches and
attends on the host; nothing is lost as generation outruns the window.

`bridge="per_step"` takes the host out of the jitted step (kvjax.prefetch_runtime): the step
attends the ring plus a device buffer of keys and values the host retrieved with the previous
step's queries, and exports each layer's query and evicted token; between steps the host stores
and searches, and fills the buffer for the next step. One host exchange per step instead of one
callback per layer (each costs 0.4-0.6 ms on the H200 however little the host does).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

import host_index
import ops
from kvjax import checks, device_read, host_runtime, prefetch_runtime, row_update
from kvjax.policies.base import (AttentionPolicy, DenseLayersMixin, HostBackedMixin, layer_window, merged_counters,
                                 set_layer)
from kvjax.policies.full import DenseKVCache, dense_attention, resolve_implementation, write_and_attend, write_dense
from models.config import ModelConfig
from ops.rows_attention import shared_rows_attention

INDEX_KINDS = ("roar", "graph", "ivf", "flat")
BRIDGES = ("per_layer", "per_step")


@flax.struct.dataclass
class RetrievalState:
  ring_k: jax.Array  # [L, B, Hkv, sinks + ring_len, D] (RetrievalAttention.ring_len)
  ring_v: jax.Array  # [L, B, Hkv, sinks + ring_len, D]
  ring_q: jax.Array  # [L, B, Hq, ring_len, D] queries of the ring's non-sink tokens
  dense: DenseKVCache  # [n_dense, B, Hkv, capacity, D]: every layer during prefill, dense layers after
  train_q: jax.Array  # [L, B, Hq, M, D] strided prefill queries (M = 0 after prefill)
  prompt_lengths: jax.Array  # [B] int32
  runtime_id: jax.Array  # [] int32: key of the HostRuntime in kvjax.host_runtime
  status: jax.Array  # [] int32: worst host callback status so far (0 = ok)
  # bridge="per_step" only (leading axis 0 otherwise): the host-retrieved rows for this step and
  # what the step hands back to the host.
  buf_k: jax.Array  # [L, B, Hq, slots, D] rows retrieved with the previous step's queries
  buf_v: jax.Array  # [L, B, Hq, slots, D]
  buf_ids: jax.Array  # [L, B, Hq, slots] int32 store id in each slot, -1 = empty (not attended)
  step_q: jax.Array  # [L, B, Hq, D] float32: this step's queries
  step_evicted_k: jax.Array  # [L, B, Hkv, D]: the token leaving each layer's window this step
  step_evicted_v: jax.Array  # [L, B, Hkv, D]
  step_evicted_q: jax.Array  # [L, B, Hq, D]: its own query
  step_evicted_pos: jax.Array  # [L, B] int32: its position, -1 where none left
  # Prefill only: `dense` holds the dense layers and one staging slot, not every layer
  # (DenseLayersMixin.prefill_slots); cleared by finish_prefill.
  staged: bool = flax.struct.field(pytree_node=False, default=False)

  @property
  def decoding(self) -> bool:
    """Static: finish_prefill empties train_q (M >= 1 before). Not the chunk's length: a
    prefill chunk of one token took the decode path (host rows attended, no dense cache written)."""
    return self.train_q.shape[3] == 0


def _train_topk(
    queries,  # [Hq, M, D]: the prompt's training queries
    keys,  # [Hkv, N, D]: the stored keys they search
    k: int,
    block_scores: int = 1 << 24,
) -> np.ndarray:
  """Each training query's exact top-k keys, best first: [Hq, M, k] int32 (roar's links).

  On an accelerator ops.exact_topk (queries and keys padded to _bucket sizes); on a CPU backend
  BLAS scores, block_scores at a time, and host_index.topk_rows (threaded C; NumPy's
  argpartition had taken 126 of a CPU retrieval prefill's 217 s for Qwen2.5 at 8K). The same
  keys up to exact score ties, which go to the lower key id here."""
  if jax.default_backend() != "cpu":
    num_q, num_keys = queries.shape[1], keys.shape[1]
    ids = ops.exact_topk(_pad_rows(queries, _bucket(num_q)), _pad_rows(keys, _bucket(num_keys)), k,
                         key_lengths=num_keys)[1]
    return np.asarray(ids[:, :num_q])
  q, kv = np.asarray(queries, np.float32), np.asarray(keys, np.float32)
  groups = q.shape[0] // kv.shape[0]
  out = np.empty(q.shape[:2] + (k,), np.int32)
  rows = max(1, block_scores // max(1, kv.shape[1]))
  for h in range(q.shape[0]):
    for start in range(0, q.shape[1], rows):  # [rows, N] scores at a time
      out[h, start:start + rows] = host_index.topk_rows(q[h, start:start + rows] @ kv[h // groups].T, k)
  return out


def _bucket(n: int) -> int:
  """n rounded up to a multiple of 2^(floor(log2 n) - 4): at most 1/16 more, 16 sizes an octave,
  so the device top-k of prompts of nearby lengths share their compiled programs."""
  step = 1 << max(0, n.bit_length() - 5)
  return -(-n // step) * step


def _pad_rows(x, rows: int):  # [H, n, D] -> [H, rows, D], zeros after row n
  return x if x.shape[1] == rows else jnp.pad(x, ((0, 0), (0, rows - x.shape[1]), (0, 0)))


# Each key's nearest keys handed to a roar build, which then links through them instead of
# searching its graph for every key (~90% of a build's time at 31K keys). On real SmolLM2 8K
# vectors 32 and 100 candidates gave the search-built graph's recall at equal keys scanned.
CONNECT_CANDIDATES = 64
# The exact neighbours cost 2 N^2 (D + 1) flops a KV head and a top-k over N scores a key. H200,
# SmolLM2 shapes, clustered synthetic keys (experiments/results/bench_build_smollm2shapes_
# {262144,524288}_{candidates,search}.md): they took 1.3 s a head at 256K and 3.6 s at 512K on
# the device (their C builds after them 4.5 / 7.0 core-seconds a head, overlapping the next
# layer's neighbours), against 32 and 70 core-seconds a head for builds that search for their
# links: for 90 heads on 16 cores, 256K ~120 s against ~180 s, 512K ~325 s against ~390 s. At 1M
# the N^2 term would lose (~1,300 s against ~850 s, arithmetic), so longer heads take their
# candidates from ops.block_nearest_keys: each key ranks the keys of NEIGHBOUR_PROBES blocks of
# NEIGHBOUR_BLOCK nearby keys. They hold fewer of the exact neighbours, which costs graphs trained
# on few queries a head, as long heads are (4,096 training queries for 1M keys): on real Qwen2.5 8K
# vectors with 32 training queries, candidate sets holding 88-98% of the exact neighbours lost
# 0.4-0.7 points of recall@100 (as many as search-built graphs: 0.3-0.8), 65-83% lost 1.8-3.4 and
# 42-54% lost 6-9.5, within 4% of the keys scanned; with every prefill query training, no set lost
# more than 0.13 (experiments/bench_neighbours.py). On clustered synthetic keys at 1M, 16 / 32 / 64
# probed blocks held 87% / 95% / 99% (CPU: 60 / 85 / 123 s a head), hence 32 (3.1% of a 1M head).
# The H200's 1M prefill and index took 149 s with 16 (bench_scale_smollm2shapes_synthetic_1m.md);
# 32 left the neighbours' time as it was (15.1 s for 6 heads, compiling included) and made the C
# builds after them 10.4 core-s a head against 9.1 (bench_build_smollm2shapes_1m_blocks32.md).
# Graph recall at 1M is not measured.
MAX_EXACT_CANDIDATE_KEYS = 524288
NEIGHBOUR_BLOCK = 1024
NEIGHBOUR_PROBES = 32
# On a CPU backend the neighbours take the cores the builds need, and cost more than the searches
# they replace (SmolLM2, 6K-token prompt, 2 cores: prefill and index 165 s with them, 127-129 s
# without): they are computed where an accelerator does the work, unless this is set (tests).
NEIGHBOURS_ON_CPU = False


def _connect_candidates(keys):  # keys: [Hkv, N, D] -> [Hkv, N, C] int32, or None
  """Each stored key's CONNECT_CANDIDATES nearest keys: exact (ops.nearest_keys) up to
  MAX_EXACT_CANDIDATE_KEYS, from nearby blocks (ops.block_nearest_keys) past it; None (the
  builds search instead) on a CPU backend (see NEIGHBOURS_ON_CPU)."""
  if jax.default_backend() == "cpu" and not NEIGHBOURS_ON_CPU:
    return None
  num_keys = keys.shape[1]
  if num_keys <= MAX_EXACT_CANDIDATE_KEYS:
    padded = _pad_rows(keys, _bucket(num_keys))
    return np.asarray(ops.nearest_keys(padded, CONNECT_CANDIDATES, key_lengths=num_keys)[:, :num_keys])
  return np.asarray(ops.block_nearest_keys(keys, CONNECT_CANDIDATES, block=NEIGHBOUR_BLOCK, probes=NEIGHBOUR_PROBES))


DEFAULT_PINNED = 16  # per_step's pinned ids per query head (RetrievalAttention.pinned)
DEFAULT_PIN_WINDOW = 32  # per_step's prompt queries choosing them (RetrievalAttention.pinned_window)
DEFAULT_ROAR_EF_INSERT = 32  # decode-time inserts' candidate list with roar (RetrievalAttention.ef_insert)
DEFAULT_INDEX_EVERY = 8  # per_step's exchanges between two indexings of a layer (RetrievalAttention.index_every)


@dataclasses.dataclass(frozen=True)
class RetrievalAttention(HostBackedMixin, DenseLayersMixin, AttentionPolicy):
  """Options:

  index: host index kind, "roar" (attention-aware), "graph", "ivf" or "flat" (exact).
  topk: keys retrieved per query head per step (100 in the paper; 2000 for key-value retrieval).
  sinks, window: tokens kept on the device (first and most recent).
  ef: search effort (graph candidate list, IVF nprobe); None = the index's default (graph and
    roar: max(64, topk)). A decode option: a saved context takes another. Needles early in a 32K
    prompt are what a narrow beam loses: niah_single_1 on Qwen2.5-0.5B, 50 samples, scored 0.94 /
    0.92 / 0.98 at ef 100 / 200 / 400 for 9.2 / 10.1 / 12.0 ms a token, every miss a needle in the
    first 18% (experiments/results/ruler_qwen_32k_single1_ef.md; roar's hub seeds before f8a5e97,
    whose new seeds kept one such needle at ef 100 on the CPU: ..._single1_seed39_hubs_cpu.md).
  dense_layers: layers attended densely on the device.
  train_queries: prefill queries per head kept to train roar (strided over the prompt).
  train_topk: N_q, each training query's exact top keys linked by roar.
  speculative: per_layer: attend over the previous step's retrieved ids with the current query
    while host threads search for the next step; KV-head groups whose mean query cosine
    similarity to the previous step falls below `tau` are searched again synchronously
    (correction). per_step: a KV-head group keeps its latest search while its query stays within
    `tau` of the query that search used (and its tail slots hold every token stored since), so a
    step searches only the groups that drifted (kvjax.prefetch_runtime).
  tau: correction threshold in [0, 1]; 1.0 corrects every group (= the non-speculative path).
  implementation: device kernel, "auto" | "pallas" | "xla".
  bridge: "per_layer" (one host callback per retrieval layer inside the step: exact current-query
    search, or `speculative`) or "per_step" (one host exchange between steps: every head uses
    the selection of a previous step's query, no synchronous correction; see
    kvjax.prefetch_runtime).
  tail_slots: per_step only: buffer rows for stored tokens a head's latest search could not return
    (not indexed yet, or with `speculative` indexed after that search); with `speculative` a
    group that does not drift is refreshed every tail_slots / 2 steps. 16 (8 until 2026-12-06):
    about 0.85x the time a token of 8 at 128K (SmolLM2 shapes, H100) and the same accuracy
    within a sample or two (Qwen2.5 niah_multiquery / niah_multivalue at 32K, SmolLM2
    niah_single_3 at 4K; experiments/results/*tail16*).
  refresh: per_step `speculative` only: how a KV-head group that has not drifted is refreshed on
    its turn in the rotation that folds in the tokens stored since its latest search (before its
    tail slots fill): "search" (default) searches its index again with the current query;
    "merge" scores those tokens against the query of its latest search and merges them into that
    search's top-k, exactly and with no graph search, so a group searches again only when it
    drifts below `tau` (kvjax.prefetch_runtime.PrefetchRuntime._merge_refresh). At 128K (SmolLM2
    shapes, synthetic) it left ~7 of ~70 searches a step, 1.35x / 1.77x full against 1.41x /
    2.17x on two H100 machines; on real SmolLM2 queries at 4K it saved 22% of the searches and
    scored 0.76 against search's 0.82 on niah_single_3 (50 paired samples, full 0.70): a search
    also re-aligns the group with its current query (experiments/results/*_merge*).
  lag: per_step only: the rows used at step t were searched with the query of step t - lag.
    1: the host works between steps (critical path); 2: it works while the device computes
    the next step (hidden when it takes less than a step), with an older selection. 0: each
    step runs twice, first on the previous step's rows to get its queries, then, after the
    host searched with them, on the rows they found (skipped where no row changed): a lagged
    selection loses answers that move between needles (niah_multiquery at 32K, Qwen2.5: lag 2
    0.58, exact per_layer search 0.71 = full over 12 samples,
    experiments/results/ruler_qwen_32k_multiquery_diag.md; lag 0 0.69 against full's 0.72 over
    25, ruler_qwen_32k_multiquery_lag0.md), at the cost of a second device pass and the
    search and gather on the critical path (21 ms a token there against lag 2 speculative's 10
    and full's 4). A layer's first-pass query was computed from the
    lower layers' older rows, so only the lowest host layer searches with exactly its own query.
  successors: per_step only: the tokens following each of a head's best `successor_sources`
    retrieved ids also attended (default: 2 * `lag`; 0 turns them off), for heads that move one
    position a step through a span the older query found (kvjax.prefetch_runtime.successor_ids).
    Twice the lag, because the older query may have found the token before the one it read: on
    RULER niah_single_2 at 32K (Qwen2.5, lag 2 speculative, 50 paired samples) 4 kept every
    7-digit number whole where 2 cut two short, at the same ms a token
    (experiments/results/ruler_qwen_32k_niah2_variants_50.md);
    the row buffers hold topk + min(successor_sources, topk) * successors + tail_slots rows per
    query head.
  successor_sources: per_step only: how many of each head's best retrieved ids get successors
    (a head reading a span token by token ranks the position it reads first; successors of
    all 100 cost 3.2 ms a step at 128K, SmolLM2 shapes: experiments/results/*_successors*).
  pinned: per_step only: each query head's best `pinned` ids for the prompt's last queries (the
    question; `pinned_window` says how many), each with the `pinned_span - 1` tokens after it,
    stay in every selection of the decode (beyond both papers; in the spirit of SnapKV's
    observation window): a lagged or
    reused selection then still holds the needles the question asked for when the answer turns
    to another one (kvjax.prefetch_runtime.PrefetchRuntime.pin). Default: 16 (at most topk) with
    per_step, 0 (off) otherwise; it costs pinned * pinned_span device rows per query head, copied
    once, and `pinned_window` searches after the prefill. On niah_multiquery at 32K (Qwen2.5, lag 2
    speculative, 25 paired samples) pinned 0 / 8 / 16 / 32 scored 0.42 / 0.59 / 0.63 / 0.63
    against full's 0.72, at 8.4 / 8.9 / 9.5 / 10.3 ms a token
    (experiments/results/ruler_qwen_32k_multiquery_pinned*.md; chosen by the last query then).
  pinned_span: per_step only: tokens kept from each pinned id on (the id itself included).
  pinned_window: per_step only: the last prompt queries that choose the pinned ids (at most the
    window). 1: the last token's, by its search. W > 1: the union of the W queries' searches,
    ranked by the attention the W queries give each id together (each query's softmax over those
    ids and the device keys, summed: SnapKV's observation window). Default: 32 (at most the
    window) with per_step, 1 otherwise. The question and answer prefix name every key asked: on
    niah_multiquery at 8K (exact ranking, 16 pins) the last 64 queries' pins held all four asked
    values in 29% of the heads, the last query's in 15%
    (experiments/results/pin_study_qwen_8k_multiquery.md). On niah_multiquery at 32K (Qwen2.5,
    lag 2 speculative, 16 pins, 25 paired samples, H100) W = 1 / 32 / 64 scored 0.64 / 0.69 /
    0.68 against full's 0.72 (loss 0.08 [0.02, 0.14], 0.03 [-0.01, 0.07], 0.04 [0.00, 0.09]), all
    at 10.4-10.7 ms a token (ruler_qwen_32k_multiquery_pinned_window.md): 32, one sample ahead of
    64 and half its searches after the prefill.
  search_query: per_step only: what searches each query head's rows, "head" (its own query, as
    RetrievalAttention does) or "group_mean" (its KV group's mean query, so a group's heads hold
    the same top-k: on captured Qwen2.5 32K queries a group's top-(G k) by the mean query held more
    of each head's attention than per-head top-k sets of as many rows, experiments/results/
    query_drift_qwen_32k_groups.md, yet on seed 32 of niah_multiquery at lag 0 top-700 and
    top-2100 missed the needle per-head top-2000 finds, ..._s32_group_cpu.md). The slots stay per
    query head, so with topk = G k this measures the accuracy of one selection per group and its
    searches (one a group, in an index per KV head: roar_heads="kv" with roar), not its memory.
  group_rows: per_step only: each query head attends, beside its own rows, the rows its KV group's
    other heads retrieved (each distinct store id once), with no more searches and no more rows
    held or shipped: on captured Qwen2.5 32K queries the union of a group's per-head top-k sets
    held 40.3% of each head's attention at top-100 two steps old against the head's own 27.5%,
    and 87.4% against 75.0% at top-2000 (experiments/results/query_drift_qwen_32k_union.md).
  transfer: per_step only: how each step's row update reaches the device, "page_locked" (the
    default: the packed buffers locked in place for DMA), "pageable" or "pinned" (staged in JAX's
    pinned host memory; kvjax.row_update.to_device).
  roar_heads: "query" (one roar graph per query head) or "kv" (one per KV head, trained on its
    group's queries: 1/G of the memory, builds and inserts, ~25% more keys scanned for the same
    recall on Gemma-3 32K; host_index/NOTES_roar.md).
  background_nice: Linux nice value (0-19) of the host threads that work while the device
    computes (indexing, speculative search, per_step lag 2's exchange) and of their OpenMP
    teams, so they yield the cores to the thread launching the step's kernels
    (kvjax.host_runtime.background_worker); 0 leaves them at the caller's priority.
  index_threads: per_step only: OpenMP threads of the background indexing, which runs beside the
    exchange's gather (default None: every worker core; kvjax.prefetch_runtime.gather_threads says why).
  reserved_cores: per_step only: cores the host's worker threads stay off, for the thread that
    launches the step's kernels (default None: none; kvjax.host_runtime.default_reserved_cores
    says why; kvjax.prefetch_runtime.PrefetchRuntime).
  index_yields: the background indexing pauses while the host's searches, slot selection, row
    gathers and attention run, and works in their gaps (host_index/csrc/hi_gate.h; default off
    until measured on a GPU host).
  ef_insert: graph and roar indexes: the candidate list of each decode-time insert's beam searches
    (roar: one with the key, one with its group's mean query), a decode option. Default None:
    DEFAULT_ROAR_EF_INSERT (32) for roar, the index's own (ef_construction, 200) for graph. Why 32
    and not roar's build-time 64 (the default until session 48): the indexing is the largest host
    load of a long decode (90 inserts a step at SmolLM2 shapes) and the host threads beside the
    jitted step set its length; at 128K on two H100 machines 32 took retrieval per_step lag 2
    --speculative from 1.56x / 1.59x full's time a token to 1.35x / 1.28x
    (experiments/results/bench_scale_smollm2shapes_synthetic_128k_s48_ef_insert*.md). The cost: at
    8K on SmolLM2 vectors with 1024 keys inserted, 2.3-2.4 points less recall@100 of the inserted
    keys (0.90 against 0.92) and 1.3 points less overall (0.91 against 0.92;
    bench_insert_smollm2_8k*.md); 48 loses 0.5 points there but its 128K rows spread (1.26x / 1.59x).
  index_every: per_step only: each (seq, layer)'s evicted tokens are indexed every index_every
    exchanges, in runs (layers staggered), and attended exactly from the tail slots until then;
    1 indexes each at the next exchange. At most tail_slots // 2. Default None: DEFAULT_INDEX_EVERY
    (8, at most tail_slots // 2) with per_step, resolved at use (`index_period`). Why 8: at 128K on
    an H100 (SmolLM2 shapes, lag 2 --speculative, two processes) it ran at 1.30x / 1.29x full's
    time a token against 1.51x / 1.39x with 1 (4: 1.44x / 1.36x), the same searches and
    corrections in every row: the host's searches and gathers ran faster beside an indexing that
    finds each graph in cache (experiments/results/bench_scale_smollm2shapes_synthetic_128k_s49_index_every*.md;
    kvjax.prefetch_runtime.PrefetchRuntime); on the H200, 1.20x against 1.28x (..._s50_default_h200.md).
    Up to 8 more tokens a layer are attended exactly meanwhile.
  """

  index: str = "roar"
  topk: int = 100
  sinks: int = 128
  window: int = 512
  ef: int | None = None
  dense_layers: tuple[int, ...] = ()
  train_queries: int = 4096
  train_topk: int = 100
  speculative: bool = False
  tau: float = 0.8
  implementation: str = "auto"
  bridge: str = "per_layer"
  tail_slots: int = 16
  refresh: str = "search"
  lag: int = 1
  successors: int | None = None
  successor_sources: int = 8
  pinned: int | None = None
  pinned_span: int = 16
  pinned_window: int | None = None
  search_query: str = "head"
  group_rows: bool = False
  transfer: str = "page_locked"
  roar_heads: str = "query"
  background_nice: int = 10
  index_threads: int | None = None
  reserved_cores: int | None = None
  index_yields: bool = False
  ef_insert: int | None = None  # None: DEFAULT_ROAR_EF_INSERT for roar (see `insert_ef`)
  index_every: int | None = None  # None: DEFAULT_INDEX_EVERY with per_step (see `index_period`)
  name: str = "retrieval"
  # per_step's row buffers are sized by topk, the successors, the tail slots and the pinned spans: a load
  # selects the first step's rows again (prepare_attached), into buffers of the new size where these changed.
  decode_options = ("topk", "ef", "speculative", "tau", "implementation", "transfer", "successors",
                    "successor_sources", "pinned", "pinned_span", "pinned_window", "tail_slots", "refresh",
                    "search_query", "group_rows", "background_nice", "index_threads", "reserved_cores", "index_yields",
                    "ef_insert", "index_every")
  takes_written_prompt = True
  reads_prompt_queries = True  # roar's training queries and the window's queries

  def __post_init__(self):
    if self.index not in INDEX_KINDS:
      raise ValueError(f"index={self.index!r}; expected one of {INDEX_KINDS}")
    # Types and ranges (bool is an int; 100.0 would fail deep in a shape); the others' ranges below.
    for field in ("topk", "window", "train_queries", "train_topk", "tail_slots"):
      checks.integer(getattr(self, field), field, low=1)
    checks.integer(self.sinks, "sinks", low=0)
    checks.integer(self.successor_sources, "successor_sources", low=1)
    checks.integer(self.lag, "lag")
    for field, low in (("ef", 1), ("ef_insert", 1), ("successors", 0), ("index_threads", None),
                       ("reserved_cores", None)):
      if getattr(self, field) is not None:
        checks.integer(getattr(self, field), field, low=low)
    checks.boolean(self.speculative, "speculative")
    checks.boolean(self.index_yields, "index_yields")
    checks.boolean(self.group_rows, "group_rows")
    checks.real(self.tau, "tau", low=0.0, high=1.0)
    if self.bridge not in BRIDGES:
      raise ValueError(f"bridge={self.bridge!r}; expected one of {BRIDGES}")
    if self.refresh not in prefetch_runtime.REFRESH_MODES:
      raise ValueError(f"refresh={self.refresh!r}; expected one of {prefetch_runtime.REFRESH_MODES}")
    if self.refresh != "search" and not (self.bridge == "per_step" and self.speculative):
      raise ValueError(f"refresh={self.refresh!r} applies to bridge='per_step' with speculative=True")
    prefetch_runtime.check_search_query(self.search_query, self.refresh,
                                        per_query_head_index=self.index == "roar" and self.roar_heads == "query")
    if self.search_query != "head" and self.bridge != "per_step":
      raise ValueError(f"search_query={self.search_query!r} applies to bridge='per_step'")
    if self.group_rows and self.bridge != "per_step":
      raise ValueError("group_rows=True applies to bridge='per_step' (the rows a group attends are on the device)")
    if self.lag not in (0, 1, 2) or isinstance(self.lag, bool):
      raise ValueError(f"lag={self.lag}; expected 0, 1 or 2")
    if self.lag != 1 and self.bridge != "per_step":
      raise ValueError(f"lag={self.lag} applies to bridge='per_step'")
    if self.reserved_cores:  # this machine must keep a core for the workers: refused before any work
      host_runtime.worker_cores(self.reserved_cores)
    if self.successors is None:  # lag 2's selection is two positions (or more) behind a copying head
      object.__setattr__(self, "successors", 2 * self.lag if self.bridge == "per_step" else 0)
    if self.successors and self.bridge != "per_step":
      raise ValueError(f"successors={self.successors} applies to bridge='per_step'")
    for field, low in (("pinned", 0), ("pinned_span", 1), ("pinned_window", 1)):
      if getattr(self, field) is not None:  # pinned, pinned_window None: their defaults
        checks.integer(getattr(self, field), field, low=low)
    if self.pinned is not None and self.pinned > self.topk:
      raise ValueError(f"pinned={self.pinned} must not exceed topk={self.topk}: the pinned ids are a search's best")
    if self.pinned and self.bridge != "per_step":
      raise ValueError(f"pinned={self.pinned} applies to bridge='per_step'")
    if self.pinned_window not in (None, 1) and (self.bridge != "per_step" or self.pinned_window > self.window):
      raise ValueError(f"pinned_window={self.pinned_window} applies to bridge='per_step' and must not exceed "
                       f"window={self.window} (the ring holds the prompt's last queries)")
    if self.transfer not in row_update.TRANSFERS:
      raise ValueError(f"transfer={self.transfer!r}; expected one of {row_update.TRANSFERS}")
    if self.roar_heads not in ("query", "kv"):
      raise ValueError(f"roar_heads={self.roar_heads!r}; expected 'query' or 'kv'")
    if self.roar_heads == "kv" and self.index != "roar":
      raise ValueError(f"roar_heads='kv' applies to index='roar', not {self.index!r}")
    host_runtime.check_background_nice(self.background_nice)
    if self.index_every is not None:
      prefetch_runtime.check_index_every(self.index_every, self.tail_slots)
      if self.index_every != 1 and self.bridge != "per_step":
        raise ValueError(f"index_every={self.index_every} applies to bridge='per_step'")
    if self.ef_insert is not None and self.index not in ("graph", "roar"):
      raise ValueError(f"ef_insert={self.ef_insert} applies to index='graph' or 'roar', not {self.index!r}")
    if self.index_threads is not None and (self.bridge != "per_step" or self.index_threads < 1):
      raise ValueError(f"index_threads={self.index_threads} must be >= 1 and applies to bridge='per_step'")
    if self.reserved_cores is not None and (self.bridge != "per_step" or self.reserved_cores < 0):
      raise ValueError(f"reserved_cores={self.reserved_cores} must be >= 0 and applies to bridge='per_step'")
    object.__setattr__(self, "dense_layers", checks.layer_ids(self.dense_layers, "dense_layers"))

  @property
  def insert_ef(self) -> int | None:
    """The decode-time inserts' candidate list: `ef_insert`, or DEFAULT_ROAR_EF_INSERT for roar;
    None (each index's own) otherwise. Resolved at use, so a context saved before this default
    changed (session 48) decodes with it too."""
    if self.ef_insert is not None:
      return self.ef_insert
    return DEFAULT_ROAR_EF_INSERT if self.index == "roar" else None

  @property
  def index_period(self) -> int:
    """`index_every`, or its default: DEFAULT_INDEX_EVERY (at most tail_slots // 2) with per_step,
    else 1. Resolved at use, so a context saved with index_every unset, or decoded with other
    tail_slots, gets the default that fits (contexts saved while 1 was the explicit default,
    967d0b8..c2d3b52, keep 1 unless the load overrides it)."""
    if self.index_every is not None:
      return self.index_every
    return max(1, min(DEFAULT_INDEX_EVERY, self.tail_slots // 2)) if self.bridge == "per_step" else 1

  @property
  def pinned_per_head(self) -> int:
    """`pinned`, or its default: DEFAULT_PINNED (at most topk) with per_step, else 0. Resolved
    here, not stored, so a context loaded with another topk gets that topk's default."""
    if self.pinned is not None:
      return self.pinned
    return min(DEFAULT_PINNED, self.topk) if self.bridge == "per_step" else 0

  @property
  def pin_window(self) -> int:
    """`pinned_window`, or its default: DEFAULT_PIN_WINDOW (at most the window) with per_step, else 1."""
    if self.pinned_window is not None:
      return self.pinned_window
    return min(DEFAULT_PIN_WINDOW, self.window) if self.bridge == "per_step" else 1

  def describe(self) -> str:
    dense = f", dense layers {list(self.dense_layers)}" if self.dense_layers else ""
    spec = f", speculative tau={self.tau}" if self.speculative else ""
    if self.bridge == "per_step":
      spec += {0: ", each step run twice (the second on rows its own first-pass queries found)",
               1: ", one host exchange per step (previous step's selection)",
               2: ", host works while the device computes (selection of two steps back)"}[self.lag]
      spec += (f", +{self.successors} following tokens of the best {min(self.successor_sources, self.topk)}"
               if self.successors else "")
      chosen_by = (f"the prompt's last {self.pin_window} queries'" if self.pin_window > 1
                   else "the prompt's last query's")
      spec += (f", +{self.pinned_per_head} spans of {self.pinned_span} tokens from {chosen_by} best ids, kept"
               if self.pinned_per_head else "")
      spec += f", indexing every {self.index_period} steps" if self.index_period != 1 else ""
    index = self.index + (" per KV head" if self.roar_heads == "kv" else "")
    index += f", inserts at ef {self.insert_ef}" if self.insert_ef is not None else ""
    searched_by = " by its KV group's mean query" if self.search_query == "group_mean" else ""
    shared = ", each head attending its KV group's rows" if self.group_rows else ""
    return (f"retrieval(index={index}, device: sinks {self.sinks} + window {self.window}, "
            f"host: top-{self.topk} per query head{searched_by}{shared}{dense}{spec})")

  @property
  def ring_len(self) -> int:
    """Non-sink ring slots. per_step keeps each token `lag` steps past the window: the host
    stores a token leaving the window in the exchange after the step, and its rows reach the
    device `lag` steps later; until then the device attends it in the ring."""
    return self.window + (max(self.lag, 1) if self.bridge == "per_step" else 0)  # lag 0 stores as lag 1

  @property
  def slots_per_head(self) -> int:
    """per_step: device buffer rows per (layer, seq, query head)."""
    return prefetch_runtime.selection_slots(self.topk, self.tail_slots, self.successors, self.successor_sources,
                                            self.pinned_per_head, self.pinned_span)

  # -- state -----------------------------------------------------------------------------

  def init_state(self, cfg: ModelConfig, batch: int, capacity: int, dtype, *, staged: bool = False) -> RetrievalState:
    L, Hkv, Hq, D = cfg.num_layers, cfg.num_kv_heads, cfg.num_heads, cfg.head_dim
    cached = len(self.dense_layer_ids(cfg)) + 1 if staged else L  # layers in the dense prefill cache
    ring = (L, batch, Hkv, self.sinks + self.ring_len, D)
    roar = {"roar_heads": self.roar_heads} if self.index == "roar" else {}
    context = host_index.HostContext(
        batch, L, Hq, Hkv, D, dtype=jnp.dtype(dtype).name, kind=self.index, **roar)
    runtime = self.new_runtime(cfg, context)
    train = min(self.train_queries, capacity)
    n = L if self.bridge == "per_step" else 0
    slots = self.slots_per_head
    return RetrievalState(
        ring_k=jnp.zeros(ring, dtype), ring_v=jnp.zeros(ring, dtype),
        ring_q=jnp.zeros((L, batch, Hq, self.ring_len, D), dtype),
        dense=DenseKVCache(k=jnp.zeros((cached, batch, Hkv, capacity, D), dtype),
                           v=jnp.zeros((cached, batch, Hkv, capacity, D), dtype)),
        train_q=jnp.zeros((L, batch, Hq, train, D), dtype),
        prompt_lengths=jnp.zeros((batch,), jnp.int32),
        runtime_id=jnp.int32(runtime.id), status=jnp.int32(0),
        buf_k=jnp.zeros((n, batch, Hq, slots, D), dtype), buf_v=jnp.zeros((n, batch, Hq, slots, D), dtype),
        buf_ids=jnp.full((n, batch, Hq, slots), -1, jnp.int32), step_q=jnp.zeros((n, batch, Hq, D), jnp.float32),
        step_evicted_k=jnp.zeros((n, batch, Hkv, D), dtype), step_evicted_v=jnp.zeros((n, batch, Hkv, D), dtype),
        step_evicted_q=jnp.zeros((n, batch, Hq, D), jnp.float32),
        step_evicted_pos=jnp.full((n, batch), -1, jnp.int32), staged=staged)

  def begin_prefill(self, cfg, state: RetrievalState, prompt_lengths) -> RetrievalState:
    self.reserve_decode_room(cfg, self.runtime(state).context, state.dense.capacity)
    return state.replace(prompt_lengths=jnp.asarray(prompt_lengths, jnp.int32))

  def new_runtime(self, cfg: ModelConfig, context) -> host_runtime.HostRuntime:
    if context.kind != self.index:
      raise ValueError(f"the host context holds {context.kind!r} indexes, but index={self.index!r}")
    common = dict(sinks=self.sinks, window=self.window, topk=self.topk, ef=self.ef, scale=cfg.attn_scale,
                  background_nice=self.background_nice, index_yields=self.index_yields, ef_insert=self.insert_ef)
    if self.bridge == "per_step":
      return prefetch_runtime.PrefetchRuntime(context, tail_slots=self.tail_slots, successors=self.successors,
                                              successor_sources=self.successor_sources,
                                              pinned=self.pinned_per_head, pinned_span=self.pinned_span,
                                              speculative=self.speculative, tau=self.tau,
                                              background_threads=self.index_threads,
                                              reserved_cores=self.reserved_cores, refresh=self.refresh,
                                              search_query=self.search_query,
                                              index_after_gather=self.lag < 2, index_every=self.index_period,
                                              **common)
    return host_runtime.HostRuntime(context, speculative=self.speculative, tau=self.tau, **common)

  def prepare_attached(self, cfg, state: RetrievalState) -> RetrievalState:
    if self.bridge != "per_step":
      return state
    # A context is saved right after its prefill, so the first step's rows are selected again as
    # finish_prefill did, into new buffers: the runtime's selection history (each head's last query
    # and ids, which speculation compares with) is then the prefill's too, whatever the saved rows
    # held, and the row options (topk, successors, tail slots, pins) may change at load.
    n, B, Hq, _, D = state.buf_k.shape
    rows = (n, B, Hq, self.slots_per_head)
    state = state.replace(buf_k=jnp.zeros(rows + (D,), state.buf_k.dtype, device=state.buf_k.sharding),
                          buf_v=jnp.zeros(rows + (D,), state.buf_v.dtype, device=state.buf_v.sharding),
                          buf_ids=jnp.full(rows, -1, jnp.int32, device=state.buf_ids.sharding))
    return self._first_rows(cfg, state)

  def _reads_after_step(self) -> bool:  # lag 0: the exchange ran between the passes (repeat_step)
    return self.bridge == "per_step" and self.lag != 0

  def start_after_step(self, state: RetrievalState, tokens=None) -> device_read.PendingRead | None:
    if not self._reads_after_step():
      return None
    return device_read.start_reading(self._step_outputs(state), also=tokens)

  def after_step(self, cfg, state: RetrievalState, started: device_read.PendingRead | None = None) -> RetrievalState:
    if not self._reads_after_step():
      self.check(state)
      return state
    runtime, step = self._read_step(state, started)
    if self.lag == 1:
      return self._prefetch(cfg, runtime, state, step)
    # Lag 2: this step's queries select the rows of the step after next, on the prefetch thread
    # while the device computes the next step, which uses the rows selected one step earlier.
    # None pending = the first step after prefill (or a load): its rows were selected by the
    # last prompt token's query, as the current ones.
    update = runtime.take_prefetched()
    if update is None:
      runtime.repeat_selection()
    runtime.start_prefetch(self._update_to_device(runtime, state), self._sparse_layers(cfg), *step)
    return state if update is None else self._land(runtime, state, update)

  def _read_step(self, state: RetrievalState, started: device_read.PendingRead | None = None):
    """(the runtime, checked for errors; the step's queries and evicted tokens (k, v, q,
    positions) as host arrays), all read in one copy (kvjax.device_read says why). started: that
    copy, begun by start_after_step as the step was dispatched, else it begins here. The main
    thread waits for it between steps, the device idle (timed into rows_seconds)."""
    t0 = time.perf_counter()
    runtime_id, status, *step = device_read.finish_reading(started, self._step_outputs(state))
    runtime = self.checked_runtime(runtime_id, status)
    step = _host_arrays(step)
    runtime.stats.rows_seconds += time.perf_counter() - t0
    return runtime, step

  @staticmethod
  def _step_outputs(state: RetrievalState) -> tuple:
    """What a per_step decode step hands to the host (device arrays)."""
    return (state.runtime_id, state.status, state.step_q, state.step_evicted_k, state.step_evicted_v,
            state.step_evicted_q, state.step_evicted_pos)

  @property
  def repeats_steps(self) -> bool:
    return self.bridge == "per_step" and self.lag == 0

  def repeat_step(self, cfg, before: RetrievalState, after: RetrievalState) -> RetrievalState | None:
    """Lag 0: the exchange of lag 1 with the first pass's queries and evicted tokens, its rows
    landed in the state the step started from (a token the second pass evicts again is stored
    once); None when no row changed, so the first pass stands."""
    runtime, step = self._read_step(after)
    update = runtime.prefetch_step(self._sparse_layers(cfg), *step)
    if update.count == 0:
      return None
    runtime.stats.repeated_steps += 1
    return self._land(runtime, before, self._update_to_device(runtime, before)(update))

  def _sparse_layers(self, cfg) -> list[int]:
    dense = set(self.dense_layer_ids(cfg))
    return [l for l in range(cfg.num_layers) if l not in dense]

  def _update_to_device(self, runtime: prefetch_runtime.PrefetchRuntime,
                        state: RetrievalState) -> row_update.TransferTimer:
    """A RowUpdate (numpy) -> its packed bytes on the state's device, copy complete on return
    (the host buffer is rewritten by the next prefetch)."""
    device = next(iter(state.buf_k.devices()))  # explicit: lag 2 copies from another thread
    return row_update.TransferTimer(runtime.stats, device, self.transfer)

  def _prefetch(self, cfg, runtime: prefetch_runtime.PrefetchRuntime, state: RetrievalState, step) -> RetrievalState:
    """Runs the host's per-step work now (kvjax.prefetch_runtime) and lands the resulting row
    update. step: host arrays (queries, evicted k, v, q, positions) of the step that just ended."""
    update = runtime.prefetch_step(self._sparse_layers(cfg), *step)
    return self._land(runtime, state, self._update_to_device(runtime, state)(update))

  def _land(self, runtime: prefetch_runtime.PrefetchRuntime, state: RetrievalState, packed) -> RetrievalState:
    """Scatters a packed RowUpdate (kvjax.row_update), already on the device, into the state's
    row buffers in place (timed into the runtime's land_seconds)."""
    t0 = time.perf_counter()
    buf_k, buf_v, buf_ids = row_update.scatter_rows(state.buf_k, state.buf_v, state.buf_ids, packed, codec="none")
    runtime.stats.land_seconds += time.perf_counter() - t0
    return state.replace(buf_k=buf_k, buf_v=buf_v, buf_ids=buf_ids)

  @staticmethod
  def _warm_scatter(state: RetrievalState) -> RetrievalState:
    """Compiles the row update's scatter for every size an update can take (row_update.warm_scatter)."""
    buf_k, buf_v, buf_ids = row_update.warm_scatter(state.buf_k, state.buf_v, state.buf_ids, most=state.buf_ids.size)
    return state.replace(buf_k=buf_k, buf_v=buf_v, buf_ids=buf_ids)

  def stats(self, state: RetrievalState) -> dict:
    runtime = self.runtime(state)
    if runtime is None:
      return {}
    if self.bridge == "per_step":
      runtime.settle()  # lag 2: the last step's prefetch may still be counting
    resident = {"resident_bytes": runtime.context.nbytes}  # store + indexes
    return runtime.stats.as_dict() | runtime.prefill_times.as_dict() | resident

  def merge_device_stats(self, per_device: list[dict]) -> dict:
    """Counters, bytes and seconds summed, the rates recomputed from the sums. repeated_steps
    (lag 0) is the most any device repeated: a sharded step runs its second pass when any
    device's rows changed, so the steps run twice can be more."""
    stats = merged_counters(host_runtime.HostStats, per_device, maxima=("repeated_steps",))
    summed = {k: sum(d[k] for d in per_device) for k in per_device[0] if k.startswith("prefill_")}
    return stats.as_dict() | summed | {"resident_bytes": sum(d["resident_bytes"] for d in per_device)}

  # -- attention -------------------------------------------------------------------------

  def attend(self, cfg, layer, q, k, v, positions, state: RetrievalState):
    if not state.decoding:
      return self._prefill(cfg, layer, q, k, v, positions, state)
    retrieve = self._retrieve if self.bridge == "per_layer" else self._retrieve_prefetched
    return self.dense_or_sparse(cfg, layer, lambda slot, st: self._dense_decode(cfg, layer, slot, q, k, v, positions, st),
                                lambda st: retrieve(cfg, layer, q, k, v, positions, st), state)

  def _prefill(self, cfg, layer, q, k, v, positions, state: RetrievalState):
    state = self.write_prompt(cfg, layer, q, k, v, positions, state)
    slot = jnp.asarray(self.prefill_slots(cfg, state.staged))[layer]
    o, _ = dense_attention(cfg, slot, q, positions, state.dense.k, state.dense.v,
                           implementation=resolve_implementation(self.implementation), window=layer_window(cfg, layer))
    return o.astype(jnp.float32), state

  def write_prompt(self, cfg, layer, q, k, v, positions, state: RetrievalState) -> RetrievalState:
    slot = jnp.asarray(self.prefill_slots(cfg, state.staged))[layer]
    dense = write_dense(state.dense, slot, k, v, positions)
    B = q.shape[0]
    batch_ids = jnp.arange(B, dtype=jnp.int32)[:, None]
    valid = positions < state.prompt_lengths[:, None]  # [B, T]; padding past a prompt is not stored
    # Strided training queries: position p lands in slot p // stride when p % stride == 0.
    M = state.train_q.shape[3]
    stride = max(1, math.ceil(state.dense.capacity / M))
    train_slot = jnp.where(valid & (positions % stride == 0), positions // stride, M)  # M = dropped
    train_q = state.train_q.at[layer, batch_ids, :, train_slot].set(q.astype(state.train_q.dtype), mode="drop")
    # Queries of the prompt's last `window` tokens (past the sinks) seed the query ring.
    W, S, R = self.window, self.sinks, self.ring_len
    in_window = valid & (positions >= S) & (positions >= state.prompt_lengths[:, None] - W)
    q_slot = jnp.where(in_window, (positions - S) % R, R)
    ring_q = state.ring_q.at[layer, batch_ids, :, q_slot].set(q.astype(state.ring_q.dtype), mode="drop")
    return state.replace(dense=dense, train_q=train_q, ring_q=ring_q)

  def _dense_decode(self, cfg, layer, slot, q, k, v, positions, state: RetrievalState):
    o, dense = write_and_attend(cfg, state.dense, slot, q, k, v, positions, implementation=self.implementation,
                                window=jnp.asarray(cfg.layer_windows, jnp.int32)[layer])
    return o, state.replace(dense=dense)

  def _ring_slots(self, pos):
    """pos [B] -> (the new token's ring slot, its query slot (ring_len for a sink: no query
    kept), the position leaving the window (-1 where none), its ring slot, its query slot),
    each [B]. With ring_len = window (per_layer) the token leaving frees the new one's slot."""
    S, W, R = self.sinks, self.window, self.ring_len
    evicted = pos - W
    evicted_r = (jnp.maximum(evicted, S) - S) % R
    return (jnp.where(pos < S, pos, S + (pos - S) % R), jnp.where(pos >= S, (pos - S) % R, R),
            jnp.where(evicted >= S, evicted, -1), S + evicted_r, evicted_r)

  def _ring_step(self, cfg, layer, q, k, v, positions, state: RetrievalState, evicted_in_rows=None, rows=None):
    """Writes the new token into the ring and attends the ring on the device: the sinks and the
    positions [lo, pos], lo = max(pos - ring_len + 1, prompt length - window, sinks), the
    tokens not yet in the host's rows (the prompt's are from its last `window` on); lag 0's
    `evicted_in_rows` [B] (`_evicted_in_rows`) also leaves out the token leaving the window.
    `rows` (attend_ring's rows_k / rows_v / rows_ids) are attended in the same call.

    Returns (o_dev [B, Hq, D], lse_dev [B, Hq], the state with the updated rings)."""
    S, W, R = self.sinks, self.window, self.ring_len
    pos = positions[:, 0]  # [B]
    b = jnp.arange(q.shape[0], dtype=jnp.int32)
    slot, q_slot, *_ = self._ring_slots(pos)
    ring_k = state.ring_k.at[layer, b, :, slot].set(k[:, 0].astype(state.ring_k.dtype))
    ring_v = state.ring_v.at[layer, b, :, slot].set(v[:, 0].astype(state.ring_v.dtype))
    ring_q = state.ring_q.at[layer, b, :, q_slot].set(q[:, 0].astype(state.ring_q.dtype), mode="drop")
    lo = jnp.maximum(jnp.maximum(pos - R + 1, state.prompt_lengths - W), S)
    if evicted_in_rows is not None:  # lag 0's second pass: the token this step evicts is in the host's rows
      lo = jnp.where(evicted_in_rows, jnp.maximum(lo, pos - W + 1), lo)
    o_dev, lse_dev = attend_ring(q[:, 0], ring_k, ring_v, pos, lo, sinks=S, ring_len=R, layer=layer,
                                 scale=cfg.attn_scale, implementation=resolve_implementation(self.implementation),
                                 **(rows or {}))
    return o_dev, lse_dev, state.replace(ring_k=ring_k, ring_v=ring_v, ring_q=ring_q)

  def _evicted_in_rows(self, state: RetrievalState, layer, pos):
    """lag 0: [B] bool, whether every query head holds the token this step evicts (store id
    pos - window - sinks) in its rows; then the ring leaves it out, else the rows must."""
    leaving = (pos - self.window - self.sinks)[:, None, None]
    return jnp.all(jnp.any(state.buf_ids[layer] == leaving, axis=-1), axis=-1) & (pos - self.window >= self.sinks)

  def _evicted(self, state: RetrievalState, layers, pos):
    """The tokens leaving the window as `pos` [B] enters: (k, v [B, *layers, Hkv, D],
    q [B, *layers, Hq, D], pos [B], -1 where none) for `layers` an int or a slice. per_layer
    reads them before the new token overwrites their slot; per_step (a longer ring) after."""
    b = jnp.arange(pos.shape[0], dtype=jnp.int32)
    _, _, evicted_pos, slot, q_slot = self._ring_slots(pos)
    return (state.ring_k[layers, b, :, slot], state.ring_v[layers, b, :, slot], state.ring_q[layers, b, :, q_slot],
            evicted_pos)

  def after_layers(self, cfg, positions, state: RetrievalState) -> RetrievalState:
    """per_step decode: every layer's token leaving the window, for the host, read from the
    rings at once after the layers' writes (its slot is not the new token's). Read inside each
    layer before that layer's write, it made XLA copy the whole [L, ...] rings every layer
    (~218 MB a layer at 8B shapes; tests/test_retrieval_per_step.py)."""
    if self.bridge != "per_step" or not state.decoding:
      return state
    pos = positions[:, 0]  # [B]
    evicted_k, evicted_v, evicted_q, evicted_pos = self._evicted(state, slice(None), pos)  # [B, L, ...]
    return state.replace(
        step_evicted_k=jnp.swapaxes(evicted_k, 0, 1), step_evicted_v=jnp.swapaxes(evicted_v, 0, 1),
        step_evicted_q=jnp.swapaxes(evicted_q, 0, 1).astype(jnp.float32),
        step_evicted_pos=jnp.broadcast_to(evicted_pos, state.step_evicted_pos.shape))

  def _retrieve_prefetched(self, cfg, layer, q, k, v, positions, state: RetrievalState):
    """bridge="per_step": the ring (window and the last `lag` tokens to leave it) and the rows
    the host retrieved, both on the device."""
    pos = positions[:, 0]  # [B]
    held = self._evicted_in_rows(state, layer, pos) if self.lag == 0 else None  # one answer for ring and rows
    q0 = q[:, 0]  # [B, Hq, D]
    if self.group_rows:
      o_dev, lse_dev, state = self._ring_step(cfg, layer, q, k, v, positions, state, evicted_in_rows=held)
      o_rows, lse_rows = self._attend_buffered_rows(cfg, layer, q0, pos, state, evicted_in_rows=held)
      o, _ = ops.merge_partials([(o_dev, lse_dev), (o_rows, lse_rows)])
    else:
      # Each head's own rows ride in the ring's attention call: on a GPU one kernel a layer instead of
      # the kernel and the XLA ops of a separate row attention and merge (fewer launches, less GPU time).
      rows = dict(rows_k=state.buf_k, rows_v=state.buf_v, rows_ids=state.buf_ids)
      o, _, state = self._ring_step(cfg, layer, q, k, v, positions, state, evicted_in_rows=held, rows=rows)
    return o[:, None], state.replace(step_q=state.step_q.at[layer].set(q0.astype(jnp.float32)))

  def _attend_buffered_rows(self, cfg, layer, q0, pos, state: RetrievalState, evicted_in_rows=None):
    """group_rows: q0 [B, Hq, D], pos [B] -> (o [B, Hq, D], lse [B, Hq]) over the rows of each head's
    KV group in the buffers."""
    ids = state.buf_ids[layer]  # [B, Hq, slots]
    if evicted_in_rows is not None:  # lag 0: the ring attends the evicted token unless every head holds it, so
      leaving = jnp.where(evicted_in_rows, -2, pos - self.window - self.sinks)  # then no row may (-2: no store id)
      ids = jnp.where(ids == leaving[:, None, None], -1, ids)
    return attend_group_rows(q0, state.buf_k[layer], state.buf_v[layer], ids, group=cfg.group_size,
                             scale=cfg.attn_scale)

  def _retrieve(self, cfg, layer, q, k, v, positions, state: RetrievalState):
    evicted_k, evicted_v, evicted_q, evicted_pos = self._evicted(state, layer, positions[:, 0])
    o_dev, lse_dev, state = self._ring_step(cfg, layer, q, k, v, positions, state)
    q0 = q[:, 0]  # [B, Hq, D]
    result_shapes = (jax.ShapeDtypeStruct(q0.shape, jnp.float32), jax.ShapeDtypeStruct(q0.shape[:2], jnp.float32),
                     jax.ShapeDtypeStruct((), jnp.int32))
    o_host, lse_host, status = jax.pure_callback(
        host_runtime.decode_callback, result_shapes, state.runtime_id, layer, q0.astype(jnp.float32),
        evicted_k, evicted_v, evicted_q, evicted_pos, vmap_method="sequential")
    o, _ = ops.merge_partials([(o_dev, lse_dev), (o_host, lse_host)])
    return o[:, None], state.replace(status=jnp.maximum(state.status, status))

  # -- prefill -> decode -----------------------------------------------------------------

  def offload_layer(self, cfg: ModelConfig, state: RetrievalState, layer: int) -> RetrievalState:
    """Fills `layer`'s rings from its written prompt and, for a retrieval layer, moves the
    prompt's middle to the host store and queues its index builds on the host's cores, which
    build while the caller goes on to the next layer (finish_prefill waits for them). A staged
    state's layers are offloaded one by one as they are written; finish_prefill does all of an
    unstaged one."""
    lengths = np.asarray(state.prompt_lengths)
    S, W = self.sinks, self.window
    slot = int(self.prefill_slots(cfg, state.staged)[layer])
    k, v = state.dense.k[slot], state.dense.v[slot]  # [B, Hkv, capacity, D]
    ring_k, ring_v = _rings_from_dense(k[None], v[None], jnp.asarray(lengths), S, self.ring_len)
    state = state.replace(ring_k=set_layer(state.ring_k, layer, ring_k[0]), ring_v=set_layer(state.ring_v, layer, ring_v[0]))
    if layer in self.dense_layer_ids(cfg):
      return state
    runtime = self.runtime(state)
    context, times = runtime.context, runtime.prefill_times
    M = state.train_q.shape[3]
    stride = max(1, math.ceil(state.dense.capacity / M))
    for b, n in enumerate(lengths):
      end = int(n) - W
      if end <= S:
        continue  # the whole prompt fits on the device
      keys, values = k[b, :, S:end], v[b, :, S:end]  # [Hkv, N, D]
      t0 = time.perf_counter()
      context.append(b, layer, 0, np.asarray(keys), np.asarray(values))
      t1 = time.perf_counter()
      times.offload += t1 - t0
      roar = {}
      if self.index == "roar":
        count = -(-int(n) // stride)  # training queries at positions 0, stride, ... < n
        queries = state.train_q[layer, b, :, :count]  # [Hq, count, D]
        ids = _train_topk(queries, keys, min(self.train_topk, end - S))
        t2 = time.perf_counter()
        cand = _connect_candidates(keys)
        times.train_topk += t2 - t1
        times.candidates += time.perf_counter() - t2
        roar = dict(train_queries=np.asarray(queries, np.float32)[None], train_topk=ids[None],
                    connect_candidates=None if cand is None else cand[None])
      t3 = time.perf_counter()
      context.build_layer(layer, seqs=[b], wait=False, **roar)
      times.queue += time.perf_counter() - t3
    return state

  def finish_prefill(self, cfg: ModelConfig, state: RetrievalState, on_progress=None) -> RetrievalState:
    """Offloads and indexes every layer (unless staged: done already), keeps only the dense
    layers' caches, and (per_step) fetches the first decode step's rows."""
    if not state.staged:
      for layer in range(cfg.num_layers):
        state = self.offload_layer(cfg, state, layer)
        if on_progress is not None:
          on_progress(layer + 1, cfg.num_layers)
    t0 = time.perf_counter()
    self.runtime(state).context.wait_builds()
    self.runtime(state).prefill_times.build_wait += time.perf_counter() - t0
    dense_ids = self.dense_layer_ids(cfg)
    keep = jnp.asarray(self.prefill_slots(cfg, state.staged)[list(dense_ids)], jnp.int32)
    state = state.replace(dense=DenseKVCache(k=state.dense.k[keep], v=state.dense.v[keep]),
                          train_q=state.train_q[:, :, :, :0], staged=False)
    return self._first_rows(cfg, state) if self.bridge == "per_step" else state

  def _last_prompt_queries(self, cfg, state: RetrievalState):
    """[L, B, Hq, D]: each layer's query of the last prompt token, from the ring (a context is
    saved right after its prefill, so a loaded ring still holds it)."""
    return self._prompt_window(cfg, state, 1)[0][:, :, :, 0]

  def _prompt_window(self, cfg, state: RetrievalState, size: int):
    return prompt_window(state.ring_q, state.ring_k, state.prompt_lengths, sinks=self.sinks, window=self.window,
                         size=size, scale=cfg.attn_scale)

  def _pin(self, cfg, state: RetrievalState) -> None:
    if not self.pinned_per_head:
      return
    q, lse, valid = jax.device_get(self._prompt_window(cfg, state, self.pin_window))
    self.runtime(state).pin(self._sparse_layers(cfg), np.asarray(q, np.float32), np.asarray(lse), np.asarray(valid))

  def _first_rows(self, cfg, state: RetrievalState) -> RetrievalState:
    """per_step, after a prefill: the first decode step's rows, selected by the last prompt
    token's query (no token has left the window yet), and the pinned spans it chooses."""
    last_q = self._last_prompt_queries(cfg, state)  # [L, B, Hq, D]
    self._pin(cfg, state)
    none = jnp.full((cfg.num_layers, len(state.prompt_lengths)), -1, jnp.int32)
    step = _host_arrays(device_read.read_together((last_q, state.step_evicted_k, state.step_evicted_v,
                                                   state.step_evicted_q, none)))
    state = self._prefetch(cfg, self.runtime(state), state, step)
    device_read.read_together(self._step_outputs(state))  # compiles the read of every step's outputs now
    return self._warm_scatter(state)


@functools.partial(jax.jit, static_argnames=("sinks", "window", "size", "scale"))
def prompt_window(
    ring_q,  # [L, B, Hq, R, D] queries of the ring's non-sink tokens (slot (pos - sinks) % R)
    ring_k,  # [L, B, Hkv, sinks + R, D] the sinks, then the ring's keys
    prompt_lengths,  # [B] int32
    *,
    sinks: int,
    window: int,
    size: int,
    scale: float,
):
  """After a prefill: the prompt's last `size` queries, oldest first -> (q [L, B, Hq, size, D]
  f32, lse [L, B, Hq, size] f32: each one's log-sum-exp over the device keys it attends (the
  sinks and the window's keys at or before its position), valid [B, size]: the query exists (its
  position lies past the sinks)).

  The ring holds R >= window positions; those before the window (lag positions) are in the host
  store too, where the searches find them, so they are left out here: counted once."""
  L, B, Hq, R, D = ring_q.shape
  group = Hq // ring_k.shape[2]
  n = prompt_lengths[:, None]  # [B, 1]
  q_pos = n - size + jnp.arange(size)  # [B, size]
  valid = q_pos >= sinks
  q_slot = jnp.where(valid, (q_pos - sinks) % R, 0)
  q = jnp.take_along_axis(ring_q, q_slot[None, :, None, :, None], axis=3).astype(jnp.float32)
  back = n - 1 - sinks - jnp.arange(R)  # ring slot j holds the latest prompt position p < n, p = sinks + j (mod R)
  k_pos = jnp.concatenate([jnp.broadcast_to(jnp.arange(sinks), (B, sinks)), sinks + jnp.arange(R) + R * (back // R)],
                          axis=1)  # [B, sinks + R]
  in_window = (back >= 0) & (k_pos[:, sinks:] >= n - window)  # older ring keys are in the store
  k_held = jnp.concatenate([jnp.arange(sinks) < n, in_window], axis=1)
  seen = k_held[:, None, :] & (k_pos[:, None, :] <= q_pos[:, :, None])  # [B, size, sinks + R]
  k = jnp.repeat(ring_k, group, axis=2).astype(jnp.float32)  # [L, B, Hq, sinks + R, D]
  scores = scale * jnp.einsum("lbhwd,lbhkd->lbhwk", q, k, precision=jax.lax.Precision.HIGHEST)
  lse = jax.nn.logsumexp(jnp.where(seen[None, :, None], scores, -jnp.inf), axis=-1)
  return q, lse, valid


def _host_arrays(step):
  """(queries, evicted k, v, q, positions) of a step, read from the device, as the host arrays
  kvjax.prefetch_runtime takes."""
  queries, evicted_k, evicted_v, evicted_q, evicted_pos = step
  return (np.asarray(queries, np.float32), np.asarray(evicted_k), np.asarray(evicted_v),
          np.asarray(evicted_q, np.float32), np.asarray(evicted_pos))


def attend_group_rows(
    q,  # [B, Hq, D] one query per head
    k,  # [B, Hq, n, D] each head's own rows (those of one KV head's store for the heads of a group)
    v,  # [B, Hq, n, D]
    ids,  # [B, Hq, n] int32 store id of each row, < 0 = empty
    *,
    group: int,
    scale: float,
):
  """Each query head's attention over the rows of every head of its KV group (the `group`
  consecutive heads), each distinct store id once -> (o [B, Hq, D] f32, lse [B, Hq] f32)."""
  B, Hq, n, D = k.shape
  shared = (B, Hq // group, group * n)
  valid = first_of_each_id(ids.reshape(shared))
  o, lse = shared_rows_attention(q.reshape(B, Hq // group, group, D), k.reshape(*shared, D), v.reshape(*shared, D),
                               valid, scale=scale)
  return o.reshape(B, Hq, D), lse.reshape(B, Hq)


def first_of_each_id(ids):  # ids [..., n] int32 -> [..., n] bool
  """True at the first slot of each id >= 0 along the last axis: a row held by several heads of
  a group is attended once."""
  order = jnp.argsort(ids, axis=-1, stable=True)
  ranked = jnp.take_along_axis(ids, order, axis=-1)
  new = jnp.concatenate([jnp.ones_like(ranked[..., :1], bool), ranked[..., 1:] != ranked[..., :-1]], axis=-1)
  first = jnp.zeros(ids.shape, bool)
  return jnp.put_along_axis(first, order, new & (ranked >= 0), axis=-1, inplace=False)


def attend_ring(
    q,  # [B, Hq, D] one decode query per sequence
    ring_k,  # [L, B, Hkv, sinks + ring_len, D]: slot s < sinks holds position s, slot
    ring_v,  # sinks + (p - sinks) % ring_len holds position p (the latest written)
    pos,  # [B] int32: the newest position, already written
    lo,  # [B] int32, >= sinks: the oldest non-sink position to attend
    *,
    sinks: int,
    ring_len: int,
    layer,
    scale: float,
    implementation: str,
    **rows,
):
  """(o, lse) over the sinks and positions [lo, pos] of a circular ring, in one
  ops.partial_attention call of two intervals: from lo's slot up to the ring's end, and the
  sinks joined to the wrapped rest (freekv's ring and retrieval's); `rows` (ops.partial_attention's
  rows_k, rows_v, rows_ids) join the same call."""
  count = jnp.maximum(pos + 1 - lo, 0)
  a = (lo - sinks) % ring_len
  return ops.partial_attention(
      q, ring_k, ring_v, sinks + jnp.minimum(a + count, ring_len), starts=sinks + a, starts2=jnp.zeros_like(pos),
      lengths2=jnp.where(pos >= sinks, sinks + jnp.maximum(a + count - ring_len, 0), pos + 1), layer=layer,
      scale=scale, implementation=implementation, **rows)


def _rings_from_dense(dense_k, dense_v, lengths, sinks: int, ring_len: int):
  """Rings [L, B, Hkv, sinks + ring_len, D] holding what decode expects after `lengths` tokens.

  Slot s < sinks holds position s; slot sinks + r holds the latest position p < length with
  (p − sinks) % ring_len == r. Slots not reached yet hold zeros (they are masked by length).
  """
  slots = jnp.arange(sinks + ring_len, dtype=jnp.int32)  # [R]
  last = lengths[:, None] - 1  # [B, 1]
  r = slots - sinks
  latest = sinks + r + ring_len * jnp.floor_divide(last - sinks - r, ring_len)  # [B, R]
  pos = jnp.where(slots < sinks, slots, latest)
  pos = jnp.where((pos >= 0) & (pos <= last), pos, 0)
  gather = jax.vmap(lambda k_b, p_b: k_b[:, :, p_b], in_axes=(1, 0), out_axes=1)  # over batch
  return gather(dense_k, pos), gather(dense_v, pos)
