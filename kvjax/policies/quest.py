"""`quest` (Quest, Tang et al. 2024): page selection from min/max key summaries, all on the device.

The dense KV cache of `full` stays whole on the device; next to it, per-page key summaries
`kmax`, `kmin` [L, B, Hkv, capacity / page_size, D] are kept up to date as tokens are written.
Prefill is dense (as in Quest). At each decode step at position p, per sequence and KV head:

  * kept pages: the sink pages (the first ceil(sinks / page_size)) and the window pages
    (every page holding one of the last `window` positions, the current partial page included);
  * candidates: the other pages before the current one, scored per query head with
    `Σ_d max(q_d·max_d, q_d·min_d)` (an upper bound of q·k on the page), turned into a
    softmax over the candidates (scaled by the model's attention scale) and pooled over the
    GQA group as their mean (group-consistent selection, as FreeKV does);
  * the top candidates fill the rest of the budget: kept + selected <= budget // page_size
    pages, i.e. <= `budget` tokens (FreeKV's defaults: 2048 = sinks 512 + window 512 (16-17
    pages) + 31-32 selected pages of 32).

The listed complete pages are attended with `ops.paged_partial_attention` over the dense cache
viewed as pages ([L, B, Hkv, pages, page_size, D], a free reshape), the current partial page
with `ops.partial_attention` over [page start, p], and the two are merged by LSE.

Sliding-window layers (Gemma 3's local layers) and `dense_layers` decode densely: a local
layer's own window already bounds what it reads. Every prefill chunk (a one-token chunk
included) is dense until `finish_prefill` marks the state as decoding.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

import ops
from kvjax import checks
from kvjax.policies.base import AttentionPolicy, layer_window
from kvjax.policies.full import dense_attention, resolve_implementation, write_tokens
from kvjax.policies.streaming import normalize_dense_layers, check_dense_layers_fit, is_dense_layer
from models.config import ModelConfig


@flax.struct.dataclass
class QuestKVCache:
  k: jax.Array  # [layers, batch, kv_heads, capacity, head_dim]
  v: jax.Array  # [layers, batch, kv_heads, capacity, head_dim]
  kmax: jax.Array  # [layers, batch, kv_heads, capacity // page_size, head_dim]: per-page max of k
  kmin: jax.Array  # [layers, batch, kv_heads, capacity // page_size, head_dim]: per-page min of k
  decoding: bool = flax.struct.field(pytree_node=False, default=False)  # set by finish_prefill


def max_window_pages(window: int, page_size: int) -> int:
  """Most pages that `window` consecutive positions can touch."""
  return (window + page_size - 2) // page_size + 1


def update_page_summaries(
    k_cache,  # [layers, batch, kv_heads, capacity, head_dim], the new tokens already written
    kmax,  # [layers, batch, kv_heads, pages, head_dim]
    kmin,  # [layers, batch, kv_heads, pages, head_dim]
    layer,  # [] int32
    positions,  # [batch, seq] int32: consecutive positions just written
    *,
    page_size: int,
):
  """Recomputes the summaries of the pages the new tokens touch, over positions <= the last one.

  Recomputing from the cache (rather than a running max) matters: prefill pads prompts to
  whole chunks, and the padding's keys sit past a prompt's end until decode overwrites them.
  Counting only positions <= the newest one keeps them out of every page that can be
  selected (pages past the current one are never candidates).

  Returns:
    (kmax, kmin), updated in place at `layer`.
  """
  batch, seq = positions.shape
  num_pages = kmax.shape[3]
  n_touch = (seq + page_size - 2) // page_size + 1  # static bound on pages a chunk spans
  pages = jnp.minimum(positions[:, :1] // page_size + jnp.arange(n_touch), num_pages - 1)  # [B, n]
  tok = pages[..., None] * page_size + jnp.arange(page_size)  # [B, n, P]
  batch_ids = jnp.arange(batch)[:, None, None]
  # Advanced indices on axes 1 and 3 come first: [B, n, P, Hkv, D].
  keys = k_cache[layer, batch_ids, :, tok, :]
  valid = (tok <= positions[:, -1, None, None])[..., None, None]  # [B, n, P, 1, 1]
  hi = jnp.max(jnp.where(valid, keys, -jnp.inf), axis=2)  # [B, n, Hkv, D]
  lo = jnp.min(jnp.where(valid, keys, jnp.inf), axis=2)
  any_valid = jnp.any(valid, axis=2)  # [B, n, 1, 1]
  hi = jnp.where(any_valid, hi, 0).astype(kmax.dtype)
  lo = jnp.where(any_valid, lo, 0).astype(kmin.dtype)
  # Clipped duplicates of the last page carry identical values, so the scatter is well defined.
  page_ids = jnp.arange(batch)[:, None]
  return (kmax.at[layer, page_ids, :, pages, :].set(hi), kmin.at[layer, page_ids, :, pages, :].set(lo))


def select_pages(
    q,  # [batch, num_heads, head_dim], unscaled
    kmax,  # [batch, kv_heads, pages, head_dim]: one layer's summaries
    kmin,  # [batch, kv_heads, pages, head_dim]
    pos,  # [batch] int32: position of the decoding token (already written)
    *,
    page_size: int,
    sinks: int,
    window: int,
    budget: int,
    scale: float,
):
  """The pages each (sequence, KV head) attends; see the module docstring for the rule.

  Returns:
    page_ids [batch, kv_heads, budget // page_size] int32, ascending; the first
    page_counts[b, h] entries are valid and the last valid one is the current page.
    page_counts [batch, kv_heads] int32.
  """
  batch, num_heads, head_dim = q.shape
  _, kv_heads, num_pages, _ = kmax.shape
  max_pages = budget // page_size
  sink_pages = -(-sinks // page_size)
  page = jnp.arange(num_pages)
  cur = pos // page_size  # [B]
  exists = page[None] <= cur[:, None]  # [B, N]
  first_win = jnp.maximum(pos - window + 1, 0) // page_size
  kept = exists & ((page[None] < sink_pages) | (page[None] >= first_win[:, None]))  # [B, N]
  cand = exists & ~kept

  # Σ_d max(q_d·max_d, q_d·min_d) = relu(q)·max + min(q, 0)·min: two matmuls, no [.., N, D] temporary.
  qg = q.astype(jnp.float32).reshape(batch, kv_heads, num_heads // kv_heads, head_dim)
  hp = jax.lax.Precision.HIGHEST
  s = (jnp.einsum("BHGD,BHND->BHGN", jnp.maximum(qg, 0), kmax.astype(jnp.float32), precision=hp)
       + jnp.einsum("BHGD,BHND->BHGN", jnp.minimum(qg, 0), kmin.astype(jnp.float32), precision=hp)) * scale
  mask = cand[:, None, None, :]  # [B, 1, 1, N]
  s = jnp.where(mask, s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  e = jnp.where(mask, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
  probs = e / jnp.maximum(jnp.sum(e, axis=-1, keepdims=True), 1e-30)  # softmax over candidates
  pooled = jnp.where(cand[:, None, :], jnp.mean(probs, axis=2), -jnp.inf)  # [B, Hkv, N]

  top = min(max_pages, num_pages)
  vals, idx = jax.lax.top_k(pooled, top)  # [B, Hkv, top]
  room = max_pages - jnp.sum(kept, axis=-1)  # [B]: pages left for the selection
  chosen = (jnp.arange(top) < room[:, None, None]) & (vals > -jnp.inf)
  hb = (jnp.arange(batch)[:, None, None], jnp.arange(kv_heads)[None, :, None])
  selected = jnp.zeros((batch, kv_heads, num_pages), bool).at[hb + (jnp.where(chosen, idx, num_pages),)].set(
      True, mode="drop")
  listed = selected | kept[:, None, :]  # [B, Hkv, N]

  # Compact the listed pages, ascending, into the first page_counts entries.
  slot = jnp.cumsum(listed, axis=-1) - 1
  page_ids = jnp.zeros((batch, kv_heads, max_pages), jnp.int32).at[
      hb + (jnp.where(listed, slot, max_pages),)].set(jnp.broadcast_to(page, listed.shape), mode="drop")
  return page_ids, jnp.sum(listed, axis=-1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class QuestAttention(AttentionPolicy):
  """Quest page selection over an on-device cache; see the module docstring.

  Attributes:
    budget: tokens attended per decode step, counted as listed pages × page_size (sinks,
      window and selected pages together; the current page counts whole).
    page_size: tokens per page; must divide the cache capacity.
    sinks: first tokens always kept (rounded up to whole pages).
    window: most recent tokens always kept (the pages holding them).
    dense_layers: layer ids that decode densely (FreeKV keeps layer 0; Quest's paper 0 and 1).
    implementation: decode kernels, "auto", "pallas" or "xla" (as in `full`).
  """

  budget: int = 2048
  page_size: int = 32
  sinks: int = 512
  window: int = 512
  dense_layers: tuple[int, ...] = (0,)
  implementation: str = "auto"
  name: str = "quest"

  def __post_init__(self):
    for field, low in (("budget", 1), ("page_size", 1), ("sinks", 0), ("window", 1)):
      checks.integer(getattr(self, field), field, low=low)
    need = (-(-self.sinks // self.page_size) + max_window_pages(self.window, self.page_size)) * self.page_size
    if self.budget < max(need, self.sinks + self.window):
      raise ValueError(
          f"budget={self.budget} is smaller than the sinks ({self.sinks}) + window ({self.window}) it must hold: "
          f"in pages of {self.page_size} they need up to {need} tokens")
    object.__setattr__(self, "dense_layers", normalize_dense_layers(self.dense_layers))
    if self.implementation not in ("auto", "pallas", "xla"):
      raise ValueError(f"implementation={self.implementation!r}; expected auto, pallas or xla")

  def describe(self) -> str:
    p = self.page_size
    sink_pages = -(-self.sinks // p)
    dense = f", dense layers {list(self.dense_layers)}" if self.dense_layers else ""
    return (f"quest(budget={self.budget} tokens = sinks {sink_pages * p} ({sink_pages} pages) + window "
            f"{self.window} (<= {max_window_pages(self.window, p)} pages) + selected pages of {p} up to "
            f"{self.budget // p} pages, dense prefill{dense})")

  @property
  def capacity_multiple(self) -> int:
    return self.page_size

  def init_state(self, cfg: ModelConfig, batch: int, capacity: int, dtype) -> QuestKVCache:
    check_dense_layers_fit(cfg, self.dense_layers)
    if capacity % self.page_size:
      raise ValueError(f"page_size={self.page_size} must divide the cache {capacity=}")
    shape = (cfg.num_layers, batch, cfg.num_kv_heads, capacity, cfg.head_dim)
    pages = (cfg.num_layers, batch, cfg.num_kv_heads, capacity // self.page_size, cfg.head_dim)
    return QuestKVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                        kmax=jnp.zeros(pages, dtype), kmin=jnp.zeros(pages, dtype))

  def finish_prefill(self, cfg: ModelConfig, state: QuestKVCache, on_progress=None) -> QuestKVCache:
    """Marks the state as decoding: from here on, steps select pages."""
    del cfg, on_progress
    return state.replace(decoding=True)

  def attend(self, cfg, layer, q, k, v, positions, state: QuestKVCache):
    impl = resolve_implementation(self.implementation)
    k_cache, v_cache = write_tokens(state.k, layer, k, positions), write_tokens(state.v, layer, v, positions)
    kmax, kmin = update_page_summaries(k_cache, state.kmax, state.kmin, layer, positions, page_size=self.page_size)
    state = state.replace(k=k_cache, v=v_cache, kmax=kmax, kmin=kmin)
    if not state.decoding:  # prefill is dense
      o, _ = dense_attention(cfg, layer, q, positions, k_cache, v_cache, implementation=impl)
      return o, state
    if q.shape[1] != 1:
      raise ValueError(f"quest decodes one token per step after finish_prefill, got a chunk of {q.shape[1]}")
    dense = is_dense_layer(layer, self.dense_layers) | (layer_window(cfg, layer) > 0)
    o = jax.lax.cond(
        dense,
        lambda: dense_attention(cfg, layer, q, positions, k_cache, v_cache, implementation=impl)[0][:, 0],
        lambda: self._sparse_decode(cfg, layer, q[:, 0], positions[:, 0], state, impl))
    return o[:, None], state

  def _sparse_decode(
      self,
      cfg: ModelConfig,
      layer,  # [] int32
      q,  # [batch, num_heads, head_dim]
      pos,  # [batch] int32
      state: QuestKVCache,
      impl: str,
  ):
    """Attention over the selected pages: o [batch, num_heads, head_dim] f32."""
    p = self.page_size
    page_ids, counts = select_pages(
        q, state.kmax[layer], state.kmin[layer], pos, page_size=p, sinks=self.sinks, window=self.window,
        budget=self.budget, scale=cfg.attn_scale)
    n_layers, batch, kv_heads, capacity, head_dim = state.k.shape
    paged = (n_layers, batch, kv_heads, capacity // p, p, head_dim)
    # The current page is the last listed one and may be partial (its tail holds no token
    # yet, or prefill padding): the paged kernel takes whole pages, so it gets the complete
    # pages and partial_attention the current one.
    paged_impl = impl
    if self.implementation == "auto" and (p < 16 or p & (p - 1)):
      paged_impl = "xla"  # the Pallas paged kernel takes power-of-two pages of >= 16 tokens
    whole = ops.paged_partial_attention(
        q, state.k.reshape(paged), state.v.reshape(paged), page_ids, counts - 1, layer=layer,
        scale=cfg.attn_scale, implementation=paged_impl)
    current = ops.partial_attention(
        q, state.k, state.v, pos + 1, starts=(pos // p) * p, layer=layer, scale=cfg.attn_scale,
        implementation=impl)
    o, _ = ops.merge_partials([whole, current])
    return o
