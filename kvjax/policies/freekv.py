"""`freekv` (FreeKV, ICLR 2026): page selection from device summaries, the full KV on the host,
only missing pages recalled, speculative reuse of the previous step's pages with per-KV-head
correction.

Layout. Positions < `sinks` and the most recent ones stay in a device ring ([L, B, Hkv,
sinks + window + page_size, D]); every older position p lives in the host store
(host_index.HostContext, kind "flat", used as a head-major page store: store index
p - sinks, store page j = positions sinks + j*P .. sinks + j*P + P - 1). The device holds,
per layer, the min/max key of every store page ([L, B, Hkv, max_pages, D]) and a pool of
n_sel = (budget - sinks - window) / page_size page slots per (layer, seq, KV head)
([L, B, Hkv, n_sel, P, D] keys and values, plus the store page in each slot).

Prefill is dense (as in FreeKV); `finish_prefill` fills the rings, appends the prompt's
middle to the host store and computes its page summaries from the dense cache (a staged
state, in a layer-major prefill or a synthetic context, does this per layer as each is written:
`offload_layer`). Decode, per sparse layer and step at position p:

  * the token at p - window leaves the window: it is read from its ring slot, folded into its
    page's min/max, and handed to the layer's single host callback, which appends it. A page
    becomes a candidate once complete. The ring keeps window + page_size tokens so the page
    being filled (and the one that completed this step) is still attended from the ring:
    the device attends to positions [sinks + C*P, p] there, C = complete pages before this
    step's eviction (window + 1 .. window + page_size tokens; so at most budget + page_size
    tokens are attended in all).
  * scores: per KV head, page j scores Σ_d max(q_d·max_d, q_d·min_d) (times the model's
    attention scale) for every query head of the group; a softmax over the C candidates per
    query head, then the mean over the group (group-consistent selection); top n_sel pages.
    With page_summary "keys2" / "keys4" (beyond FreeKV) the device holds every key quantized
    instead, and a page scores the max of q·k̂ over its keys (kvjax.policies.page_summary).
  * without speculation: select with the current query, recall the missing pages (into the
    slots of the lowest-scoring resident pages not selected) and attend.
  * with speculation: heads whose group-mean cos(q_t, q_{t-1}) >= tau attend to the pages
    selected at the previous step (already resident); the others are corrected (select +
    recall for q_t before attending; every head on a layer's first step; tau = 1 corrects
    every head, the exactness check). With `correct_mass` (beyond FreeKV) a head is also
    corrected when the pages q_t selects and the reused selection lacks hold more than that
    share of its group-pooled page scores: a query turning to another needle can keep a high
    cosine. After attention, the selection for the next step (q_t over the candidates
    complete after this step's eviction) is made and its missing pages recalled.

Recall path of bridge="per_layer". Selection, the missing-page lists and the slot
of each recalled page are computed on the device; the one `jax.pure_callback` per sparse
layer per step appends the evicted token and returns the requested pages with static shapes
[B, Hkv, R, P, D] (K and V) with R = max_recall (non-speculative) or 2 * max_recall (the
correction's pages, then the next step's), -1 ids meaning "none"; then a dynamic scatter puts
them into the pool. The correction's pages are attended straight from the callback output
(merged by LSE with the ring and the resident pages), so a speculative head's attention does
not depend on the recall in data-flow terms. If more than max_recall pages are missing, the
rest wait for later steps and the step attends to the resident part of its selection.

PCIe bytes per step: device->host 2·B·Hkv·D·itemsize per sparse layer (the evicted token)
plus the small id/counter arrays; host->device the callback's whole static output,
2·B·Hkv·R·P·D·itemsize per sparse layer (R as above) whatever the number of pages actually
missing. For Llama-3-8B shapes, bf16 and the defaults with speculation that is 8 MiB per layer
and sequence, 256 MiB per token, ≈ 45 ms at the measured 6 GB/s of callback outputs (half
without speculation); `max_recall` bounds it. The stats report both the bytes of the pages
really recalled and the bytes the callbacks carried.

The per_step bridge (bridge="per_step"). A callback inside the step costs 0.4-0.6 ms on the
H200 even when empty, and the GPU idles meanwhile; with one per sparse layer that was most of
the step (8B shapes at 128K: 108 ms per token against 30-34 ms per_step,
experiments/results/bench_scale_8b_synthetic_128k_step_b1.md). So per_step keeps the host out of
the jitted step. Every head attends its whole pool (the previous step's selection and, where that
had fewer than n_sel pages, older resident ones) besides the ring; the one selection made in the
step (q_t over the pages complete after its eviction) serves the next step, and the step exports
its missing pages and their slots (page_selection.plan_recall), the evicted token and the counters. Between
steps (`after_step`) the host gathers the missing pages into one packed
kvjax.row_update.RowUpdate, starts its copy to the device (from page-locked memory by default),
then appends the evicted tokens; the update is scattered into the pool in place. There is no correction (it would need the host inside the
step): `correct` only counts the heads per_layer would correct, and `missed` counts the pages a
selection wanted that were not resident when its step attended (the one-step lag's cost). A
priming exchange after prefill recalls the first selection, made with the prompt's last query.

Where per_step's time goes (H200, 8B shapes, experiments/results/bench_compile_modes_8b_8k.md and
bench_scale_8b_synthetic_128k_step_cb.md). Its step ran ~57 small kernels per sparse layer, so
with unrolled layers the host's launching (~10-14 µs a kernel) outlasted the GPU's work, and
XLA's command buffers helped (24.6 -> 17.8 ms at 8K, batch 1). Since then a sparse layer only
writes its ring and attends (ring and pool); what feeds the host alone (summaries, the next
selection, its plan, the counters) is computed once for all layers after the last one
(`after_layers`), and its ring is one kernel call over two intervals (ops.partial_attention's
starts2/lengths2): in the CPU program of a 6-layer test model, 111 -> 43 operations per layer. The exchange gathers every page in one C call
(`fetch_pages_many`) and does not wait for its copy: the copy overlaps the next step's launch
(`sync_transfer` waits). With the per-layer work this small, command buffers no longer pay
(11.3 ms off vs 14.2 on at 8K, batch 1, lag 2: bench_compile_modes_8b_8k_cb_knobs.md), and the
step is compiled like every other policy's.

lag=2 (per_step): the exchange of step t's outputs runs on a host thread while step t + 1 runs,
and lands (its scatter) before step t + 2, which attends it. The device plans slots against
`promised_ids` (the pool once the pending exchange has landed) and attends `pool_ids` (what has
landed); the ring keeps window + 2 pages so the page that completed at step t - 1, which no
landed selection covers yet, is still attended from the ring. Two priming exchanges: the first
lands before step 1, the second (over one page more) after it. Packed host buffers alternate
(two), so a buffer is packed again only after the copy from it was consumed. Its counters are
those of lag 1 (decide, hit, miss), plus the loop's wait for the thread (exchange_wait).
Correct on the CPU (equals full when the budget covers the context). On the H200 (8B shapes,
128K, experiments/results/bench_scale_8b_synthetic_128k_after_layers_b1.md) it took the step from
23.4 to 15.8 ms at batch 1, at the price of more selected pages not yet resident (2093 vs 1185).

Not done: a pool only for the sparse layers (pools and summaries exist for every layer, dense
ones unused).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import time

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

import host_index
import ops
from kvjax import checks, device_read, freekv_host, host_runtime, kv_codec, row_update
from kvjax.policies import page_selection, page_summary
from kvjax.policies.base import (AttentionPolicy, DenseLayersMixin, HostBackedMixin, layer_window, merged_counters,
                                 set_layer)
from kvjax.policies.full import DenseKVCache, resolve_implementation, write_and_attend, write_dense
from kvjax.policies.retrieval import _rings_from_dense, attend_ring
from models.config import ModelConfig

BRIDGES = ("per_layer", "per_step")


@flax.struct.dataclass
class FreeKVState:
  ring_k: jax.Array  # [L, B, Hkv, sinks + window + page_size, D]
  ring_v: jax.Array  # [L, B, Hkv, sinks + window + page_size, D]
  kmax: jax.Array  # [L, B, Hkv, max_pages, D]: per store page max of the keys
  kmin: jax.Array  # [L, B, Hkv, max_pages, D]: per store page min of the keys
  # page_summary "keys<bits>" (then kmax/kmin have no pages; with "minmax" these are empty):
  # every store key quantized per channel, packed (kvjax.policies.page_summary), and its range.
  kcodes: jax.Array  # [L, B, Hkv, max_pages, P, D // (8 // bits)] uint8
  klo: jax.Array  # [L, B, Hkv, D] float32: a code's zero
  kstep: jax.Array  # [L, B, Hkv, D] float32: one code level
  pool_k: jax.Array  # [L, B, Hkv, n_sel, page_size, D]: recalled pages
  pool_v: jax.Array  # [L, B, Hkv, n_sel, page_size, D]
  pool_ids: jax.Array  # [L, B, Hkv, n_sel] int32: store page in each slot, -1 empty
  selection: jax.Array  # [L, B, Hkv, n_sel] int32: pages to reuse at the next step, -1 padded
  # per_step: the store page each slot will hold once every exchange planned so far has landed
  # (equal to pool_ids between steps with lag 1; one exchange ahead with lag 2).
  promised_ids: jax.Array  # [L, B, Hkv, n_sel] int32
  prev_q: jax.Array  # [L, B, Hq, D] float32: the previous step's query
  # per_step: this step's query of each sparse layer (after_layers moves it to prev_q), and the
  # pool's occupied slots, compact ascending, with their count (set when an exchange lands).
  step_q: jax.Array  # [L, B, Hq, D] float32
  pool_slots: jax.Array  # [L, B, Hkv, n_sel] int32
  pool_counts: jax.Array  # [L, B, Hkv] int32
  primed: jax.Array  # [L] bool: the layer has decoded a step (its selection is valid)
  dense: DenseKVCache  # [n_dense, B, Hkv, capacity, D]: every layer during prefill, dense layers after
  prompt_lengths: jax.Array  # [B] int32
  runtime_id: jax.Array  # [] int32: key of the FreeKVRuntime in kvjax.host_runtime
  status: jax.Array  # [] int32: worst host callback status so far (0 = ok)
  # bridge="per_step": what a step hands to the host between steps (every layer's row is
  # written by its sparse attention; dense layers keep "nothing").
  step_evicted_k: jax.Array  # [L, B, Hkv, D]: the token leaving each layer's window this step
  step_evicted_v: jax.Array  # [L, B, Hkv, D]
  step_evicted_pos: jax.Array  # [L, B] int32: its position, -1 where none left
  step_fetch: jax.Array  # [L, B, Hkv, R] int32: store pages the next step needs and lacks, -1 = none
  step_slots: jax.Array  # [L, B, Hkv, R] int32: the pool slot each goes to
  step_counters: jax.Array  # [L, B, Hkv, 5] int32: (decided, corrected, reused, hits, missed)
  decoding: bool = flax.struct.field(pytree_node=False, default=False)  # set by finish_prefill
  # Prefill only: `dense` holds the dense layers and one staging slot, not every layer
  # (DenseLayersMixin.prefill_slots); cleared by finish_prefill.
  staged: bool = flax.struct.field(pytree_node=False, default=False)


def _done(value):
  """A completed future holding `value`."""
  future = concurrent.futures.Future()
  future.set_result(value)
  return future


def _keep_last_query(
    state: FreeKVState,
    layer,  # [] int32
    q,  # [B, T, Hq, D]: a prompt chunk's queries
    positions,  # [B, T] int32
) -> FreeKVState:
  """Keeps the prompt's last query in prev_q (the per_step bridge selects the first decode
  step's pages with it; the first step's correction test compares against it)."""
  is_last = positions == state.prompt_lengths[:, None] - 1  # [B, T]
  last_q = jnp.sum(jnp.where(is_last[..., None, None], q.astype(jnp.float32), 0.0), axis=1)  # exact: one term
  keep = jnp.any(is_last, axis=1)[:, None, None]
  return state.replace(prev_q=state.prev_q.at[layer].set(jnp.where(keep, last_q, state.prev_q[layer])))


# -- the policy ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FreeKVAttention(HostBackedMixin, DenseLayersMixin, AttentionPolicy):
  """FreeKV; see the module docstring.

  Attributes:
    budget: tokens attended per step, counted as sinks + window + n_sel · page_size (the page
      being filled rides on top of the window: up to page_size - 1 more tokens).
    page_size: tokens per page; divides sinks, window and budget.
    sinks: first tokens kept on the device.
    window: most recent tokens kept on the device.
    speculative: reuse the previous step's pages, correcting heads whose group-mean cosine
      similarity of consecutive queries is below tau.
    tau: correction threshold in [0, 1]; 1 corrects every head.
    correct_mass: also correct heads whose new selection's pages missing from the reused one
      carry more than this share of the group-pooled page scores (the attention reuse would
      lose, as the page summaries estimate it), in [0, 1]; 0 corrects whenever the selection
      gains a page of nonzero score. None (the default): FreeKV's cosine rule alone. A query turning to another
      needle can stay within tau of the previous one: on Qwen2.5 niah_multiquery at 32K tau 0.8
      corrected 2.3% of the heads and freekv lost 0.12 against full
      (experiments/results/ruler_qwen_32k_multiquery_a.md). per_step only counts.
    max_recall: most pages recalled per (seq, KV head) per phase and step (None: n_sel).
    bridge: "per_layer" (one host callback per sparse layer inside the step: synchronous
      correction) or "per_step" (one host exchange between steps, no callback: see "The
      per_step bridge" in the module docstring; needs speculative=True).
    lag: per_step only: 1 (a step's selection is recalled before the next step) or 2 (it is
      recalled while the next step runs, on a host thread, and attended one step later; the
      ring keeps one more page so no page falls between ring and pool).
    transfer: per_step only: how the recalled pages reach the device, "page_locked" (the
      default: the packed buffers locked in place for DMA), "pageable" or "pinned"
      (kvjax.row_update.to_device).
    sync_transfer: per_step only: wait for each exchange's copy to land before the next step is
      launched (the stats then time the copy alone); by default it overlaps that launch.
    dense_layers: layers attended densely on the device (sliding-window layers always are).
    page_summary: what scores a page on the device (kvjax.policies.page_summary): "minmax"
      (FreeKV's per-channel max and min keys; 1/32 of the page's K+V) or "keys2" / "keys4"
      (every key at 2 / 4 bits per channel; 1/16 / 1/8), which keeps the pages a retrieval
      head attends where the min/max bound drops them.
    host_codec: how K/V rows are kept on the host (kvjax.kv_codec): "none" (the model's dtype)
      or "int8" (per token and KV head, with a float32 scale: 0.52x the bytes of bfloat16 at
      head_dim 128 in the host store and on every copy between device and host; encoded and
      decoded on the device). The attended pages are then approximations of the keys and
      values, within max|row| / 254 per element decoded to float32, max|row| / 127 to bfloat16.
    implementation: device kernels, "auto" | "pallas" | "xla".
    background_nice: per_step lag 2: Linux nice value (0-19) of the exchange thread and its
      OpenMP team, so they yield the cores to the thread launching the step's kernels
      (kvjax.host_runtime.background_worker); 0 leaves them at the caller's priority.
    reserved_cores: per_step lag 2: cores the exchange thread and its OpenMP team stay off, for
      the thread launching the step's kernels (default None: none;
      kvjax.host_runtime.default_reserved_cores says why); with cores reserved the exchange runs
      at the caller's priority.
  """

  budget: int = 2048
  page_size: int = 32
  sinks: int = 512
  window: int = 512
  speculative: bool = True
  tau: float = 0.8
  correct_mass: float | None = None
  max_recall: int | None = None
  dense_layers: tuple[int, ...] = (0,)
  implementation: str = "auto"
  bridge: str = "per_layer"
  lag: int = 1
  transfer: str = "page_locked"
  sync_transfer: bool = False
  page_summary: str = "minmax"
  host_codec: str = "none"
  background_nice: int = 10
  reserved_cores: int | None = None
  name: str = "freekv"
  decode_options = ("speculative", "tau", "correct_mass", "implementation", "transfer", "sync_transfer",
                    "background_nice", "reserved_cores")
  takes_written_prompt = True
  reads_prompt_queries = True  # the prompt's last query (prev_q)

  def __post_init__(self):
    for field, low in (("budget", 1), ("page_size", 1), ("sinks", 0), ("window", 1)):
      value = getattr(self, field)
      if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low:
        raise ValueError(f"{field}={value!r} must be an int >= {low}")
    for field in ("sinks", "window", "budget"):
      if getattr(self, field) % self.page_size:
        raise ValueError(f"page_size={self.page_size} must divide {field}={getattr(self, field)}")
    if self.budget <= self.sinks + self.window:
      raise ValueError(f"budget={self.budget} must exceed sinks ({self.sinks}) + window ({self.window}): "
                       "it leaves no page to select")
    if not isinstance(self.speculative, (bool, np.bool_)):
      raise ValueError(f"speculative={self.speculative!r} must be a bool")
    checks.real(self.tau, "tau", low=0.0, high=1.0)
    if self.correct_mass is not None:
      if isinstance(self.correct_mass, bool) or not (
          isinstance(self.correct_mass, (int, float)) and 0.0 <= self.correct_mass <= 1.0):
        raise ValueError(f"correct_mass={self.correct_mass!r} must lie in [0, 1] (or be None)")
      if not self.speculative:
        raise ValueError(f"correct_mass={self.correct_mass} applies to speculative=True only")
      object.__setattr__(self, "correct_mass", float(self.correct_mass))
    if self.max_recall is not None:
      checks.integer(self.max_recall, "max_recall", low=1, high=self.n_sel)
    object.__setattr__(self, "dense_layers", checks.layer_ids(self.dense_layers, "dense_layers"))
    object.__setattr__(self, "tau", float(self.tau))
    if self.implementation not in ("auto", "pallas", "xla"):
      raise ValueError(f"implementation={self.implementation!r}; expected auto, pallas or xla")
    if self.bridge not in BRIDGES:
      raise ValueError(f"bridge={self.bridge!r}; expected one of {BRIDGES}")
    if self.bridge == "per_step" and not self.speculative:
      raise ValueError("bridge='per_step' needs speculative=True: every step attends pages recalled before it")
    if self.bridge == "per_step" and self.page_size < 2:
      # The page completing at a step is gathered before that step's token is stored; with one
      # token a page it holds no stored row yet (larger pages are completed from the evicted rows).
      raise ValueError(f"page_size={self.page_size}: bridge='per_step' needs pages of at least 2 tokens")
    if not isinstance(self.sync_transfer, (bool, np.bool_)):
      raise ValueError(f"sync_transfer={self.sync_transfer!r} must be a bool")
    if self.lag not in (1, 2) or isinstance(self.lag, bool):
      raise ValueError(f"lag={self.lag!r}; expected 1 or 2")
    if self.lag == 2 and self.bridge != "per_step":
      raise ValueError("lag=2 needs bridge='per_step' (per_layer recalls inside the step)")
    if self.transfer not in row_update.TRANSFERS:
      raise ValueError(f"transfer={self.transfer!r}; expected one of {row_update.TRANSFERS}")
    if self.page_summary not in page_summary.SUMMARIES:
      raise ValueError(f"page_summary={self.page_summary!r}; expected one of {page_summary.SUMMARIES}")
    kv_codec.check(self.host_codec)
    host_runtime.check_background_nice(self.background_nice)
    if self.reserved_cores is not None and (self.lag != 2 or self.reserved_cores < 0):
      raise ValueError(f"reserved_cores={self.reserved_cores} must be >= 0 and applies to lag=2")
    if self.reserved_cores:  # this machine must keep a core for the workers: refused before any work
      host_runtime.worker_cores(self.reserved_cores)

  @property
  def n_sel(self) -> int:
    """Pages selected per (seq, KV head)."""
    return (self.budget - self.sinks - self.window) // self.page_size

  @property
  def recall(self) -> int:
    return self.n_sel if self.max_recall is None else int(self.max_recall)

  @property
  def ring_len(self) -> int:
    """Recent tokens the ring holds: the window plus `lag` pages (see `_ring_pages`)."""
    return self.window + self.lag * self.page_size

  def _ring_pages(self, pos):
    """[B] int32: pages before the ring's attended part at position `pos` ([B]). They are those
    complete before the eviction of the step `lag` steps back, whose selection the pool holds
    now (lag 1: before this step's eviction)."""
    return jnp.maximum(pos - self.lag - self.window - self.sinks + 1, 0) // self.page_size

  def _sparse_layer_mask(self, cfg: ModelConfig):
    """[L] bool: the layers freekv attends sparsely."""
    return jnp.asarray([l not in self.dense_layer_ids(cfg) for l in range(cfg.num_layers)])

  def _evicted(self, pos):
    """The token leaving the window at position `pos` ([B]): (its position, whether it is a
    stored one (past the sinks), its ring slot), each [B]."""
    ev_pos = pos - self.window
    return ev_pos, ev_pos >= self.sinks, self.sinks + (ev_pos - self.sinks) % self.ring_len

  def _heads_to_correct(self, q, prev_q, primed, kv_heads: int, selection, prev_sel, pooled):
    """[B, Hkv] bool: the heads to correct, by tau (`page_selection.needs_correction`) and, with
    correct_mass, by the mass their reused selection would lose (`page_selection.lost_mass`;
    pooled [B, Hkv, N])."""
    correct = page_selection.needs_correction(q, prev_q, primed, self.tau, kv_heads)
    if self.correct_mass is None:
      return correct
    return correct | (page_selection.lost_mass(pooled, selection, prev_sel) > self.correct_mass)

  def describe(self) -> str:
    spec = f"speculative tau={self.tau}" if self.speculative else "not speculative"
    if self.correct_mass is not None:
      spec += f" or lost page mass > {self.correct_mass}"
    if self.bridge == "per_step":
      spec += (", one host exchange per step (pages recalled between steps)" if self.lag == 1 else
               ", one host exchange per step overlapping the next step (pages attended two steps after selection)")
    dense = f", dense layers {list(self.dense_layers)}" if self.dense_layers else ""
    scores = "" if self.page_summary == "minmax" else f", pages scored by {self.key_bits}-bit keys"
    codec = "" if self.host_codec == "none" else f", host K/V as {self.host_codec}"
    return (f"freekv(budget={self.budget} tokens = sinks {self.sinks} + window {self.window} + {self.n_sel} "
            f"pages of {self.page_size}{scores}, {spec}, max_recall {self.recall}{dense}{codec})")

  @property
  def key_bits(self) -> int:
    """Bits per key channel of a "keys<bits>" page summary (0 for "minmax")."""
    return page_summary.bits_of(self.page_summary)

  def _summary(self, state: FreeKVState) -> tuple:
    """Every layer's page summary (leading axis L): (kmax, kmin) or (kcodes, klo, kstep)."""
    return (state.kcodes, state.klo, state.kstep) if self.key_bits else (state.kmax, state.kmin)

  def _score_impl(self, cfg) -> str:
    """How key codes are scored: ops.key_page_scores' Pallas kernel on a GPU where it compiles
    for these pages and heads, XLA otherwise."""
    impl = resolve_implementation(self.implementation)
    if impl == "pallas" and self.key_bits and not ops.key_scores_pallas_supported(
        self.page_size, cfg.head_dim, self.key_bits):
      return "xla"
    return impl

  def _num_pages(self, state: FreeKVState) -> int:
    return (state.kcodes if self.key_bits else state.kmax).shape[3]

  def _fold_evicted(self, state: FreeKVState, at: tuple, offset, ev_k, lo, step) -> dict:
    """The summary fields with each evicted key folded into its page: `at` indexes (layer,
    seq, :, page) (page N: dropped), `offset` is the key's token in its page, and lo/step
    are the code range broadcast against ev_k. A min/max page starts empty at (+inf, -inf),
    so a scatter-min/max needs no read."""
    if not self.key_bits:
      return dict(kmax=state.kmax.at[at].max(ev_k, mode="drop"), kmin=state.kmin.at[at].min(ev_k, mode="drop"))
    code = page_summary.quantize(ev_k, lo, step, self.key_bits)
    return dict(kcodes=state.kcodes.at[at + (offset,)].set(code, mode="drop"))

  def _encode(self, x):
    """K or V rows [..., D] as the host keeps them (kvjax.kv_codec), encoded on the device."""
    return kv_codec.encode(x, self.host_codec)

  # -- layout ----------------------------------------------------------------------------

  def _paged_impl(self) -> str:
    impl = resolve_implementation(self.implementation)
    p = self.page_size
    # The Pallas paged kernel needs page_size a power of two >= 16.
    return impl if p >= 16 and p & (p - 1) == 0 else "xla"

  # -- state and lifecycle -----------------------------------------------------------------

  def init_state(self, cfg: ModelConfig, batch: int, capacity: int, dtype, *, staged: bool = False) -> FreeKVState:
    L, H, Hq, D = cfg.num_layers, cfg.num_kv_heads, cfg.num_heads, cfg.head_dim
    cached = len(self.dense_layer_ids(cfg)) + 1 if staged else L  # layers in the dense prefill cache
    S, W, P, n = self.sinks, self.window, self.page_size, self.n_sel
    num_pages = max(1, -(-(capacity - S) // P))
    kv_codec.check(self.host_codec, D)
    W, wire = kv_codec.host_width(self.host_codec, D), kv_codec.wire_dtype(self.host_codec, dtype)
    context = host_index.HostContext(batch, L, Hq, H, W, dtype=kv_codec.host_dtype(self.host_codec, dtype),
                                     kind="flat", page_size=P)
    runtime = self.new_runtime(cfg, context)
    ring = (L, batch, H, S + self.ring_len, D)
    bits = self.key_bits
    if bits and D % (8 // bits):
      raise ValueError(f"page_summary={self.page_summary!r} packs {8 // bits} channels a byte: head_dim {D} "
                       "is not a multiple")
    pages = (L, batch, H, 0 if bits else num_pages, D)
    codes = (L, batch, H, num_pages if bits else 0, P, D // (8 // bits) if bits else 1)
    ranges = (L, batch, H, D if bits else 0)
    pool = (L, batch, H, n, P, D)
    return FreeKVState(
        ring_k=jnp.zeros(ring, dtype), ring_v=jnp.zeros(ring, dtype),
        kmax=jnp.full(pages, -jnp.inf, dtype), kmin=jnp.full(pages, jnp.inf, dtype),  # empty pages
        kcodes=jnp.zeros(codes, jnp.uint8), klo=jnp.zeros(ranges, jnp.float32), kstep=jnp.ones(ranges, jnp.float32),
        pool_k=jnp.zeros(pool, dtype), pool_v=jnp.zeros(pool, dtype),
        pool_ids=jnp.full(pool[:4], -1, jnp.int32), selection=jnp.full(pool[:4], -1, jnp.int32),
        promised_ids=jnp.full(pool[:4], -1, jnp.int32),
        prev_q=jnp.zeros((L, batch, Hq, D), jnp.float32), primed=jnp.zeros((L,), bool),
        step_q=jnp.zeros((L, batch, Hq, D), jnp.float32), pool_slots=jnp.zeros(pool[:4], jnp.int32),
        pool_counts=jnp.zeros(pool[:3], jnp.int32),
        dense=DenseKVCache(k=jnp.zeros((cached, batch, H, capacity, D), dtype),
                           v=jnp.zeros((cached, batch, H, capacity, D), dtype)),
        prompt_lengths=jnp.zeros((batch,), jnp.int32),
        runtime_id=jnp.int32(runtime.id), status=jnp.int32(0),
        step_evicted_k=jnp.zeros((L, batch, H, W), wire), step_evicted_v=jnp.zeros((L, batch, H, W), wire),
        step_evicted_pos=jnp.full((L, batch), -1, jnp.int32),
        step_fetch=jnp.full((L, batch, H, self.recall), -1, jnp.int32),
        step_slots=jnp.full((L, batch, H, self.recall), n, jnp.int32),
        step_counters=jnp.zeros((L, batch, H, 5), jnp.int32), staged=staged)

  def begin_prefill(self, cfg, state: FreeKVState, prompt_lengths) -> FreeKVState:
    self.reserve_decode_room(cfg, self.runtime(state).context, state.dense.capacity)
    return state.replace(prompt_lengths=jnp.asarray(prompt_lengths, jnp.int32))

  def new_runtime(self, cfg: ModelConfig, context) -> freekv_host.FreeKVRuntime:
    sparse = cfg.num_layers - len(self.dense_layer_ids(cfg))
    return freekv_host.FreeKVRuntime(context, sinks=self.sinks, page_size=self.page_size, sync_recall=self.recall,
                                     sparse_layers=sparse, step_buffers=self.lag,
                                     background_nice=self.background_nice, reserved_cores=self._reserved_cores())

  def _reserved_cores(self) -> int:
    """Lag 2's exchange thread runs beside the step: its default reservation. Lag 1 has none."""
    if self.lag != 2:
      return 0
    if self.reserved_cores is None:
      return host_runtime.default_reserved_cores(host_runtime.available_cores())
    return self.reserved_cores

  def stats(self, state: FreeKVState) -> dict:
    """Speculation and recall counters of the run so far (see FreeKVStats)."""
    runtime = self.runtime(state)
    if runtime is None:
      return {}
    runtime.drain()
    s = runtime.stats
    steps = s.exchanges if self.bridge == "per_step" else s.callbacks // max(1, runtime.sparse_layers)
    return _stats_dict(s, steps, runtime.context.nbytes)

  def merge_device_stats(self, per_device: list[dict]) -> dict:
    """Counters, bytes and seconds summed over the devices (each recalls and times its own
    heads), the slowest exchange and wait the slowest of any device, the per-step figures and
    rates computed again from the sums over the steps every device ran."""
    steps = {d["decode_steps"] for d in per_device}
    if len(steps) != 1:
      raise ValueError(f"the devices ran different step counts {sorted(steps)}")
    s = merged_counters(freekv_host.FreeKVStats, per_device, prefix="host_",
                        maxima=("slowest_exchange_ms", "slowest_wait_ms"), shared=("page_bytes",))
    return _stats_dict(s, steps.pop(), sum(d["resident_bytes"] for d in per_device))

  def offload_layer(self, cfg: ModelConfig, state: FreeKVState, layer: int) -> FreeKVState:
    """Fills `layer`'s rings from its written prompt and, for a sparse layer, moves the
    prompt's middle to the host store and summarizes its pages. A staged state's layers are
    offloaded one by one as they are written; finish_prefill does all of an unstaged one."""
    lengths = np.asarray(state.prompt_lengths)
    S, W, P = self.sinks, self.window, self.page_size
    slot = int(self.prefill_slots(cfg, state.staged)[layer])
    k, v = state.dense.k[slot], state.dense.v[slot]  # [B, H, capacity, D]
    ring_k, ring_v = _rings_from_dense(k[None], v[None], jnp.asarray(lengths), S, self.ring_len)
    state = state.replace(ring_k=set_layer(state.ring_k, layer, ring_k[0]), ring_v=set_layer(state.ring_v, layer, ring_v[0]))
    if layer in self.dense_layer_ids(cfg):
      return state  # its summaries stay zero
    context = self.runtime(state).context
    host_len = np.maximum(lengths.astype(np.int64) - W - S, 0)
    # Encoded once for the layer (one shape: ragged prompts compile nothing more), sliced per sequence.
    host_k, host_v = self._encode(k), self._encode(v)
    for b, n in enumerate(host_len):
      if n:
        context.append(b, layer, 0, np.asarray(host_k[b, :, S:S + n]), np.asarray(host_v[b, :, S:S + n]))
    host_len = jnp.asarray(host_len, jnp.int32)
    if self.key_bits:
      codes, lo, step = page_summary.prompt_codes(k, host_len, sinks=S, page_size=P,
                                                  num_pages=self._num_pages(state), bits=self.key_bits)
      return state.replace(kcodes=set_layer(state.kcodes, layer, codes), klo=set_layer(state.klo, layer, lo),
                           kstep=set_layer(state.kstep, layer, step))
    lo, hi = page_summary.prompt_minmax(k, host_len, sinks=S, page_size=P, num_pages=self._num_pages(state))
    return state.replace(kmin=set_layer(state.kmin, layer, lo), kmax=set_layer(state.kmax, layer, hi))

  def finish_prefill(self, cfg: ModelConfig, state: FreeKVState, on_progress=None) -> FreeKVState:
    """Offloads and summarizes every layer (unless staged: done already) and keeps only the
    dense layers' caches."""
    if not state.staged:
      for layer in range(cfg.num_layers):
        state = self.offload_layer(cfg, state, layer)
        if on_progress is not None:
          on_progress(layer + 1, cfg.num_layers)
    keep = jnp.asarray(self.prefill_slots(cfg, state.staged)[list(self.dense_layer_ids(cfg))], jnp.int32)
    state = state.replace(dense=DenseKVCache(k=state.dense.k[keep], v=state.dense.v[keep]), decoding=True,
                          staged=False)
    if self.bridge == "per_step":
      state = self._prime(cfg, state)
    return state

  def _prime(self, cfg: ModelConfig, state: FreeKVState) -> FreeKVState:
    """per_step: selects every sparse layer's first pages with the prompt's last query and
    recalls them, so the first decode step attends pages already resident. With lag 2 a second
    selection (over one page more) is gathered too and lands after the first step, as step t's
    recall lands after step t + 1."""
    sparse = self._sparse_layer_mask(cfg)
    only_sparse = lambda x: jnp.where(sparse[:, None, None, None], x, -1)
    runtime = self.runtime(state)
    ids = state.pool_ids
    for i in range(self.lag):
      candidates = self._ring_pages(state.prompt_lengths + i)  # the pool's pages at decode step i + 1
      selection, fetch, slots, ids = page_selection.first_selection(
          state.prev_q, self._summary(state), ids, candidates, n_sel=self.n_sel, max_recall=self.recall,
          scale=cfg.attn_scale, implementation=self._score_impl(cfg))
      state = state.replace(selection=only_sparse(selection), step_fetch=only_sparse(fetch), step_slots=slots,
                            promised_ids=only_sparse(ids), primed=sparse)
      packed = self._gather(runtime, device_read.read_together(self._step_arrays(state)),
                            next(iter(state.pool_k.devices())))
      if i == 0:
        state = self._land(runtime, state, packed)
      else:
        runtime.pending = _done(packed)
    runtime.stats = freekv_host.FreeKVStats()  # the priming exchanges belong to the prefill
    return state

  def prepare_attached(self, cfg, state: FreeKVState) -> FreeKVState:
    """A loaded context's new runtime: with lag 2 it regathers the second priming exchange (its
    rows are in the saved state), which a fresh runtime lacks and the first step's
    `after_step` lands."""
    if self.bridge == "per_step" and self.lag == 2:
      runtime = self.runtime(state)
      rows = device_read.read_together(self._step_arrays(state))
      runtime.pending = _done(self._gather(runtime, rows, next(iter(state.pool_k.devices()))))
      runtime.stats = freekv_host.FreeKVStats()
    return state

  def _step_outputs(self, state: FreeKVState) -> tuple:
    """What a per_step decode step hands to the host (device arrays): the runtime id and status
    with the step's rows, in one transfer (kvjax.device_read says why)."""
    return (state.runtime_id, state.status) + self._step_arrays(state)

  def start_after_step(self, state: FreeKVState, tokens=None) -> device_read.PendingRead | None:
    if self.bridge != "per_step":
      return None
    return device_read.start_reading(self._step_outputs(state), also=tokens)

  def after_step(self, cfg, state: FreeKVState, started: device_read.PendingRead | None = None) -> FreeKVState:
    if self.bridge != "per_step":
      self.check(state)
      return state
    t0 = time.perf_counter()
    # Read now (the next step donates these buffers): the copy start_after_step began, else one
    # begun here.
    runtime_id, status, *rows = device_read.finish_reading(started, self._step_outputs(state))
    runtime = self.checked_runtime(runtime_id, status)
    runtime.stats.rows_seconds += time.perf_counter() - t0
    device = next(iter(state.pool_k.devices()))
    if self.lag == 1:
      return self._land(runtime, state, self._gather(runtime, rows, device))
    # lag 2: land the previous step's exchange, then run this one's on the host thread while the
    # next step runs (it attends the pool as landed here).
    if runtime.pending is None:
      raise RuntimeError("freekv lag 2: no pending exchange to land (the state was not primed by this runtime)")
    t0 = time.perf_counter()
    packed = runtime.pending.result()
    waited = time.perf_counter() - t0
    runtime.stats.exchange_wait_seconds += waited
    runtime.stats.slowest_wait_ms = max(runtime.stats.slowest_wait_ms, 1e3 * waited)
    state = self._land(runtime, state, packed)
    runtime.pending = runtime.worker().submit(self._gather, runtime, rows, device)
    return state

  @staticmethod
  def _step_arrays(state: FreeKVState) -> tuple:
    """What a step hands to the host (device arrays, read in one copy: kvjax.device_read)."""
    return (state.step_evicted_k, state.step_evicted_v, state.step_evicted_pos, state.step_fetch, state.step_slots,
            state.step_counters)

  def _gather(self, runtime: freekv_host.FreeKVRuntime, rows: tuple, device):
    """Host side of an exchange: gathers the pages the plan lacks, starts their copy to
    `device`, then stores the evicted tokens; returns the packed update on the device."""
    t0 = time.perf_counter()
    # Without sync_transfer the copy overlaps what follows (the store's appends, then the
    # caller's work). Reusing the packed host buffer stays safe: a buffer is packed again only
    # after a step that ran after the scatter consuming this copy (lag 1: the next exchange;
    # lag 2, two buffers: the one after it).
    send = row_update.TransferTimer(runtime.stats, device, self.transfer, wait=self.sync_transfer)
    packed = runtime.exchange(*rows, pool_slots=self.n_sel, send=send)
    seconds = time.perf_counter() - t0
    runtime.stats.exchange_seconds += seconds
    runtime.stats.slowest_exchange_ms = max(runtime.stats.slowest_exchange_ms, 1e3 * seconds)
    return packed

  def _land(self, runtime: freekv_host.FreeKVRuntime, state: FreeKVState, packed) -> FreeKVState:
    """Scatters a packed update into the pool in place (timed into the runtime's land_seconds)."""
    t0 = time.perf_counter()
    pool_k, pool_v, pool_ids = row_update.scatter_rows(state.pool_k, state.pool_v, state.pool_ids, packed,
                                                       codec=self.host_codec)
    # The step_* rows need no reset: every sparse layer rewrites its own at the next step, and
    # a repeated exchange is harmless (stored tokens are skipped, a page is rewritten as is).
    pool_slots, pool_counts = page_selection.occupied_slots(pool_ids)
    runtime.stats.land_seconds += time.perf_counter() - t0
    return state.replace(pool_k=pool_k, pool_v=pool_v, pool_ids=pool_ids, pool_slots=pool_slots,
                         pool_counts=pool_counts)

  # -- attention -------------------------------------------------------------------------

  def attend(self, cfg, layer, q, k, v, positions, state: FreeKVState):
    if not state.decoding:
      return self._prefill(cfg, layer, q, k, v, positions, state)
    if q.shape[1] != 1:
      raise ValueError(f"freekv decodes one token per step after finish_prefill, got a chunk of {q.shape[1]}")
    return self.dense_or_sparse(cfg, layer, lambda slot, st: self._dense_decode(cfg, layer, slot, q, k, v, positions, st),
                                lambda st: self._sparse(cfg, layer, q, k, v, positions, st), state)

  def write_prompt(self, cfg, layer, q, k, v, positions, state: FreeKVState) -> FreeKVState:
    slot = jnp.asarray(self.prefill_slots(cfg, state.staged))[layer]
    return _keep_last_query(state.replace(dense=write_dense(state.dense, slot, k, v, positions)), layer, q, positions)

  def _prefill(self, cfg, layer, q, k, v, positions, state: FreeKVState):
    slot = jnp.asarray(self.prefill_slots(cfg, state.staged))[layer]
    o, dense = write_and_attend(cfg, state.dense, slot, q, k, v, positions, implementation=self.implementation,
                                window=layer_window(cfg, layer))
    return o, _keep_last_query(state.replace(dense=dense), layer, q, positions)

  def _dense_decode(self, cfg, layer, slot, q, k, v, positions, state: FreeKVState):
    o, dense = write_and_attend(cfg, state.dense, slot, q, k, v, positions, implementation=self.implementation,
                                window=jnp.asarray(cfg.layer_windows, jnp.int32)[layer])
    return o, state.replace(dense=dense)

  def after_layers(self, cfg: ModelConfig, positions, state: FreeKVState) -> FreeKVState:
    """per_step decode: what the step hands to the host, for every sparse layer at once. The
    token leaving each window is folded into its page's summary; q_t selects the next step's
    pages over the pages complete after this eviction; the plan lists those the pool (as it
    will be once the pending exchange has landed: lag 2) lacks, and the counters are taken."""
    if not (state.decoding and self.bridge == "per_step"):
      return state
    S, W, P, n, R = self.sinks, self.window, self.page_size, self.n_sel, self.recall
    L, H = cfg.num_layers, cfg.num_kv_heads
    N = self._num_pages(state)
    pos = positions[:, 0]  # [B]
    B = pos.shape[0]
    b = jnp.arange(B, dtype=jnp.int32)
    sparse = self._sparse_layer_mask(cfg)
    by_layer = lambda mask, x: mask.reshape(mask.shape + (1,) * (x.ndim - mask.ndim))

    # The token at p - W left every window; each layer's ring still holds it (only slot p was written).
    ev_pos, has_ev, ev_slot = self._evicted(pos)
    ev_k = jnp.moveaxis(state.ring_k[:, b, :, ev_slot], 0, 1)  # [L, B, H, D]
    ev_v = jnp.moveaxis(state.ring_v[:, b, :, ev_slot], 0, 1)
    stored = sparse[:, None] & has_ev[None, :]  # [L, B]
    ev_page = jnp.where(stored, ((ev_pos - S) // P)[None, :], N)  # N: dropped
    at = (jnp.arange(L)[:, None], b[None, :], slice(None), ev_page)
    state = state.replace(**self._fold_evicted(state, at, (ev_pos - S) % P, ev_k, state.klo, state.kstep))

    c_now = jnp.maximum(pos - W - S + 1, 0) // P  # complete pages after this step's eviction
    c_ring = self._ring_pages(pos)  # pages before the ring's attended part: the pool's

    def one_layer(scores, q, prev_q, primed, prev_sel, pool_ids, promised):
      # select_and_plan's steps, the pooled scores kept for correct_mass
      pooled = page_selection.pool_scores(scores, c_now)
      selection = page_selection.top_pages(pooled, n)
      fetch, fetch_slots, promised = page_selection.plan_recall(promised, selection, pooled, R)
      # Reuse is scored on the pages the step attended, its pool: with lag 2 that holds the
      # selection of two steps back, not prev_sel (scoring prev_sel overstated lag 2's hit rate).
      hits = jnp.sum(page_selection.member(pool_ids, selection), axis=-1)
      reused = jnp.sum(pool_ids >= 0, axis=-1)
      # (A page past c_ring was attended from the ring: not missed.)
      older = (selection >= 0) & (selection < c_ring[:, None, None])
      missed = jnp.sum(older & ~page_selection.member(selection, pool_ids), axis=-1)
      # `correct` only counts the heads per_layer would correct.
      correct = self._heads_to_correct(q, prev_q, primed, H, selection, prev_sel, pooled)
      counters = jnp.stack([jnp.broadcast_to(primed, (B, H)), correct, reused, hits, missed], axis=-1)
      return selection, promised, fetch, fetch_slots, counters.astype(jnp.int32)

    scores = page_selection.layer_scores(state.step_q, self._summary(state), scale=cfg.attn_scale,
                          implementation=self._score_impl(cfg))
    selection, promised, fetch, fetch_slots, counters = jax.vmap(one_layer)(
        scores, state.step_q, state.prev_q, state.primed, state.selection, state.pool_ids, state.promised_ids)
    keep = lambda new, old: jnp.where(by_layer(sparse, new), new, old)  # dense layers keep "nothing"
    return state.replace(
        primed=state.primed | sparse,
        # Swapped: prev_q takes this step's queries; step_q's stale ones are rewritten next step.
        prev_q=state.step_q, step_q=state.prev_q,
        selection=keep(selection, state.selection), promised_ids=keep(promised, state.promised_ids),
        step_evicted_k=self._encode(ev_k), step_evicted_v=self._encode(ev_v),
        step_evicted_pos=jnp.where(stored, ev_pos[None, :], -1),
        step_fetch=keep(fetch, state.step_fetch), step_slots=keep(fetch_slots, state.step_slots),
        step_counters=keep(counters, state.step_counters))

  def _sparse(
      self,
      cfg: ModelConfig,
      layer,  # [] int32
      q,  # [B, 1, Hq, D]
      k,  # [B, 1, Hkv, D]
      v,  # [B, 1, Hkv, D]
      positions,  # [B, 1] int32
      state: FreeKVState,
  ):
    S, W, P, n, R = self.sinks, self.window, self.page_size, self.n_sel, self.recall
    ring_len = self.ring_len  # recent part of the ring
    B, _, Hq, D = q.shape
    H = k.shape[2]
    N = self._num_pages(state)
    b = jnp.arange(B, dtype=jnp.int32)
    pos = positions[:, 0]
    q0 = q[:, 0]  # [B, Hq, D]
    impl = resolve_implementation(self.implementation)

    # Ring: the token leaving the window (p - W) sits in another slot than the new one, so it is
    # read after the write. Neither the ring nor the summaries below are read before their
    # update: a read of the old buffer made XLA copy the whole [L, ...] arrays every layer (in
    # the compiled CPU program, tests/test_freekv.py; the H200 step time did not change
    # measurably when this was removed).
    slot = jnp.where(pos < S, pos, S + (pos - S) % ring_len)
    ring_k = state.ring_k.at[layer, b, :, slot].set(k[:, 0].astype(state.ring_k.dtype), mode="promise_in_bounds")
    ring_v = state.ring_v.at[layer, b, :, slot].set(v[:, 0].astype(state.ring_v.dtype), mode="promise_in_bounds")

    # Attention over the ring from the first position past the pages complete in the pool.
    local_start = S + self._ring_pages(pos) * P  # = c_prev with lag 1
    ring = attend_ring(q0, ring_k, ring_v, pos, local_start, sinks=S, ring_len=ring_len, layer=layer,
                       scale=cfg.attn_scale, implementation=impl)
    state = state.replace(ring_k=ring_k, ring_v=ring_v)

    if self.bridge == "per_step":
      # No correction (it would need the host inside the step): every head attends its whole
      # pool, the previous step's selection (recalled between steps) and, where that had fewer
      # than n_sel pages, older resident ones. Everything else (the evicted token, the
      # summaries, the next step's selection and its recall plan, the counters) feeds only the
      # host, so `after_layers` does it once for all layers: done here it cost ~35 small kernels
      # per layer, and the step was launch-bound.
      resident = ops.paged_partial_attention(q0, state.pool_k, state.pool_v, state.pool_slots[layer],
                                             state.pool_counts[layer], layer=layer, scale=cfg.attn_scale,
                                             implementation=self._paged_impl())
      o, _ = ops.merge_partials([ring, resident])
      return o[:, None], state.replace(step_q=state.step_q.at[layer].set(q0.astype(jnp.float32)))

    ev_pos, has_ev, ev_slot = self._evicted(pos)
    ev_k = ring_k[layer, b, :, ev_slot]  # [B, H, D] (unused where has_ev is false)
    ev_v = ring_v[layer, b, :, ev_slot]
    evicted_pos = jnp.where(has_ev, ev_pos, -1)

    # Fold the evicted key into its page's summary (the page becomes a candidate once complete).
    ev_page = jnp.where(has_ev, (ev_pos - S) // P, N)  # N: dropped
    summary_fields = self._fold_evicted(state, (layer, b, slice(None), ev_page), (ev_pos - S) % P, ev_k,
                                        state.klo[layer], state.kstep[layer])

    c_prev = jnp.maximum(pos - W - S, 0) // P  # complete pages before this step's eviction
    c_now = jnp.maximum(pos - W - S + 1, 0) // P  # ... and after it
    prev_sel = state.selection[layer]
    primed = state.primed[layer]
    pool_ids = state.pool_ids[layer]
    reused = jnp.broadcast_to(jnp.sum(prev_sel >= 0, axis=-1), (B, H))
    prev_q = state.prev_q[layer]
    state = state.replace(**summary_fields, prev_q=state.prev_q.at[layer].set(q0.astype(jnp.float32)),
                          primed=state.primed.at[layer].set(True))
    summary = tuple(x[layer] for x in self._summary(state))

    scores = page_summary.scores(q0, summary, scale=cfg.attn_scale, implementation=self._score_impl(cfg))
    # (the same scores serve the next step's selection below)
    pooled_now = page_selection.pool_scores(scores, c_prev)
    sel_now = page_selection.top_pages(pooled_now, n)  # [B, H, n]
    correct = jnp.ones((B, H), bool)
    if self.speculative:
      correct = self._heads_to_correct(q0, prev_q, primed, H, sel_now, prev_sel, pooled_now)
    hits = jnp.sum(page_selection.member(prev_sel, sel_now), axis=-1)
    if self.speculative:
      sel_cur = jnp.where(correct[..., None], sel_now, prev_sel)
      wanted_now = jnp.where(correct[..., None], sel_now, -1)
    else:
      sel_cur = wanted_now = sel_now
    fetch_a, slots_a, pool_ids_a = page_selection.plan_recall(pool_ids, wanted_now, pooled_now, R)
    fetch, new_ids, sel_next = fetch_a, pool_ids_a, sel_now
    if self.speculative:
      # The next step's selection: q_t over the pages complete after this step's eviction.
      sel_next, (fetch_b, slots_b, new_ids) = page_selection.select_and_plan(scores, c_now, pool_ids_a, n_sel=n,
                                                                             max_recall=R)
      fetch = jnp.concatenate([fetch_a, fetch_b], axis=-1)

    # The resident selected pages; then (below) the pages the callback recalls for a correction.
    slots, counts = page_selection.listed_slots(pool_ids, sel_cur)
    resident = ops.paged_partial_attention(q0, state.pool_k, state.pool_v, slots, counts, layer=layer,
                                           scale=cfg.attn_scale, implementation=self._paged_impl())
    recalled_count = jnp.sum(fetch_a >= 0, axis=-1).astype(jnp.int32)  # [B, H]
    missed = jnp.sum(sel_cur >= 0, axis=-1) - counts - recalled_count  # selected, not attended
    counters = jnp.stack([jnp.broadcast_to(primed, (B, H)), correct, reused, jnp.broadcast_to(hits, (B, H)), missed],
                         axis=-1).astype(jnp.int32)
    dtype = state.pool_k.dtype
    wire = kv_codec.wire_dtype(self.host_codec, dtype)
    out = jax.ShapeDtypeStruct((B, H, fetch.shape[-1], P, kv_codec.host_width(self.host_codec, D)), wire)
    callback = functools.partial(freekv_host.recall_callback, page_size=P, out_dtype=np.dtype(wire))
    pages_k, pages_v, status = jax.pure_callback(
        callback, (out, out, jax.ShapeDtypeStruct((), jnp.int32)), state.runtime_id, layer, self._encode(ev_k),
        self._encode(ev_v), evicted_pos, fetch, counters, vmap_method="sequential")
    pages_k, pages_v = (kv_codec.decode(x, self.host_codec, dtype) for x in (pages_k, pages_v))
    recalled = ops.paged_partial_attention(
        q0, pages_k[:, :, :R], pages_v[:, :, :R], jnp.broadcast_to(jnp.arange(R, dtype=jnp.int32), (B, H, R)),
        recalled_count, scale=cfg.attn_scale, implementation=self._paged_impl())
    o, _ = ops.merge_partials([ring, resident, recalled])

    # Pool update (after attention in data-flow terms): the correction's pages, then the next
    # step's (which may replace a page just recalled: the later write wins).
    idx = (layer, b[:, None, None], jnp.arange(H)[None, :, None])
    pool_k = state.pool_k.at[idx + (slots_a,)].set(pages_k[:, :, :R], mode="drop")
    pool_v = state.pool_v.at[idx + (slots_a,)].set(pages_v[:, :, :R], mode="drop")
    if self.speculative:
      pool_k = pool_k.at[idx + (slots_b,)].set(pages_k[:, :, R:], mode="drop")
      pool_v = pool_v.at[idx + (slots_b,)].set(pages_v[:, :, R:], mode="drop")
    state = state.replace(pool_k=pool_k, pool_v=pool_v, pool_ids=state.pool_ids.at[layer].set(new_ids),
                          selection=state.selection.at[layer].set(sel_next), status=jnp.maximum(state.status, status))
    return o[:, None], state


def _stats_dict(s: freekv_host.FreeKVStats, steps: int, resident_bytes: int) -> dict:
  """FreeKVAttention.stats from the run's counters, its decode steps and the host store's bytes."""
  per_step = lambda x: x / steps if steps else float("nan")
  ratio = lambda a, b: a / b if b else float("nan")
  recalled = s.sync_pages + s.spec_pages
  return dict(
      decode_steps=steps,
      correction_rate=ratio(s.corrected_heads, s.decided_heads),
      hit_rate=ratio(s.reused_hits, s.reused_pages),
      recalled_pages_per_step=per_step(recalled),
      sync_recalled_pages_per_step=per_step(s.sync_pages),
      missed_pages_per_step=per_step(s.missed_pages),
      recalled_bytes_per_step=per_step(recalled * s.page_bytes),
      callback_bytes_per_step=per_step(s.callback_bytes),
      transfer_bytes_per_step=per_step(s.transfer_bytes),
      resident_bytes=resident_bytes,  # host store
      **{f"host_{k}": v for k, v in s.as_dict().items()})
