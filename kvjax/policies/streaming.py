"""`streaming` (StreamingLLM, Xiao et al. 2024): attend to the first `sinks` tokens and the last `window`.

Semantics (what a long-context comparison expects, as in the RetrievalAttention and FreeKV
tables): the **prompt is prefilled densely** (full causal attention, the layer's own sliding
window on Gemma's local layers) and every **decode step** attends to
`{j < sinks} ∪ {p - window < j <= p}` (the current token included), intersected with the
layer's own sliding window on local layers. Layers in `dense_layers` decode densely.

State. Dense prefill needs the whole prompt's keys, a streaming decode step only a ring of
`sinks + window` slots, and the state's shapes cannot change inside a jitted step. So the
state has two forms, switched by the lifecycle hooks generate() runs:

  * the prefill form (`init_state`; `begin_prefill` records the prompt lengths): a dense
    cache [L, B, Hkv, capacity, D] as in `full`, attended densely by every chunk (a chunk of
    one token included);
  * the decode form (`finish_prefill`): a ring [L, B, Hkv, sinks + window, D] where position
    p lives in slot p if p < sinks, else sinks + (p - sinks) % window, plus a dense cache of
    the `dense_layers` only; the prompt's dense cache is dropped. The ring is gathered from
    the dense cache by prompt length, because prefill pads prompts to whole chunks and the
    padding's keys must not evict real tokens.

Decode reads the ring as two contiguous slot ranges (the window may wrap), so the kernel
visits only valid slots; the two partial results are merged by LSE.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp

import ops
from kvjax import checks
from kvjax.policies.base import AttentionPolicy, layer_window
from kvjax.policies.full import dense_attention, resolve_implementation, write_tokens
from models.config import ModelConfig


@flax.struct.dataclass
class StreamingKVCache:
  k: jax.Array  # [layers, batch, kv_heads, capacity, head_dim], or [.., sinks + window, ..] when ring
  v: jax.Array  # same as k
  dense_k: jax.Array  # [len(dense_layers), batch, kv_heads, capacity, head_dim] when ring, else [0, ...]
  dense_v: jax.Array  # same as dense_k
  prompt_lengths: jax.Array  # [batch] int32, set by begin_prefill
  ring: bool = flax.struct.field(pytree_node=False, default=False)


def normalize_dense_layers(dense_layers) -> tuple[int, ...]:
  """Returns dense_layers as a sorted tuple of distinct non-negative ints, or raises."""
  return checks.layer_ids(dense_layers, "dense_layers", distinct=True)


def check_dense_layers_fit(cfg: ModelConfig, dense_layers: tuple[int, ...]) -> None:
  bad = [i for i in dense_layers if i >= cfg.num_layers]
  if bad:
    raise ValueError(f"dense_layers={dense_layers} names layers {bad} of a {cfg.num_layers}-layer model")


def is_dense_layer(layer, dense_layers: tuple[int, ...]):
  """[] bool: whether the traced `layer` is in the static `dense_layers`."""
  if not dense_layers:
    return jnp.asarray(False)
  return jnp.isin(layer, jnp.asarray(dense_layers, jnp.int32))


def ring_slot(
    positions,  # [...] int32 absolute positions
    *,
    sinks: int,
    window: int,
):
  """[...] int32: the ring slot of each position (p if p < sinks, else sinks + (p - sinks) % window)."""
  return jnp.where(positions < sinks, positions, sinks + (positions - sinks) % window)


def streaming_ranges(
    pos,  # [batch] int32: position of the decoding token (already written)
    layer_win,  # [] int32: the layer's own sliding window, 0 for a global layer
    *,
    sinks: int,
    window: int,
):
  """Two [start, end) ring-slot ranges whose union is exactly the attended set of each sequence.

  The attended positions are `[lo, min(sinks, p + 1))` (sinks) and
  `[max(sinks, p - window + 1, lo), p + 1)` (window), with `lo = p - layer_win + 1` on a
  local layer (else 0). The window's slots may wrap; the wrapped tail [sinks, e) is then
  adjacent to the sink slots and joins them, so two ranges always suffice.

  Returns:
    ((start1, end1), (start2, end2)), each [batch] int32 with start <= end.
  """
  lo = jnp.where(layer_win > 0, jnp.maximum(pos - layer_win + 1, 0), 0)
  sink_end = jnp.minimum(sinks, pos + 1)
  win_lo = jnp.maximum(jnp.maximum(sinks, pos - window + 1), lo)
  has_win = win_lo <= pos
  first_slot = ring_slot(win_lo, sinks=sinks, window=window)
  end_slot = ring_slot(pos, sinks=sinks, window=window) + 1
  wrap = has_win & (first_slot >= end_slot)
  start1 = jnp.where(has_win, first_slot, 0)
  end1 = jnp.where(has_win, jnp.where(wrap, sinks + window, end_slot), 0)
  start2 = jnp.where(wrap, jnp.minimum(lo, sinks), lo)
  end2 = jnp.where(wrap, end_slot, sink_end)
  return (start1, end1), (jnp.minimum(start2, end2), end2)


def _decode_dense(
    cfg: ModelConfig,
    layer,  # [] int32: model layer (for its sliding window)
    cache_layer,  # [] int32: index into the cache's leading axis
    q,  # [batch, num_heads, head_dim]
    pos,  # [batch] int32
    k_cache,  # [n, batch, kv_heads, capacity, head_dim]
    v_cache,  # [n, batch, kv_heads, capacity, head_dim]
    implementation: str,
):
  """Dense (optionally sliding-window) decode attention: o [batch, num_heads, head_dim] f32."""
  win = layer_window(cfg, layer)
  starts = jnp.where(win > 0, jnp.maximum(pos + 1 - win, 0), 0)
  o, _ = ops.partial_attention(q, k_cache, v_cache, pos + 1, starts=starts, layer=cache_layer,
                               scale=cfg.attn_scale, implementation=implementation)
  return o


@dataclasses.dataclass(frozen=True)
class StreamingLLM(AttentionPolicy):
  """Sinks + sliding window (StreamingLLM) with dense prefill; see the module docstring.

  Attributes:
    sinks: first tokens always attended (attention sinks), >= 0.
    window: most recent tokens attended, the current one included, >= 1.
    dense_layers: layer ids that decode densely (kept whole on the device).
    implementation: decode kernel, "auto", "pallas" or "xla" (as in `full`).
  """

  sinks: int = 128
  window: int = 512
  dense_layers: tuple[int, ...] = ()
  implementation: str = "auto"
  name: str = "streaming"

  def __post_init__(self):
    checks.integer(self.sinks, "sinks", low=0)
    checks.integer(self.window, "window", low=1)
    object.__setattr__(self, "dense_layers", normalize_dense_layers(self.dense_layers))
    if self.implementation not in ("auto", "pallas", "xla"):
      raise ValueError(f"implementation={self.implementation!r}; expected auto, pallas or xla")

  def describe(self) -> str:
    dense = f", dense layers {list(self.dense_layers)}" if self.dense_layers else ""
    return (f"streaming(sinks={self.sinks}, window={self.window}, dense prefill; decode budget "
            f"{self.sinks + self.window} tokens = sinks {self.sinks} + window {self.window}{dense})")

  def init_state(self, cfg: ModelConfig, batch: int, capacity: int, dtype) -> StreamingKVCache:
    check_dense_layers_fit(cfg, self.dense_layers)
    shape = (cfg.num_layers, batch, cfg.num_kv_heads, capacity, cfg.head_dim)
    empty = (0, batch, cfg.num_kv_heads, capacity, cfg.head_dim)
    # Four distinct buffers: the engine donates the state, and a buffer donated twice is refused.
    return StreamingKVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                            dense_k=jnp.zeros(empty, dtype), dense_v=jnp.zeros(empty, dtype),
                            prompt_lengths=jnp.zeros((batch,), jnp.int32))

  def begin_prefill(
      self,
      cfg: ModelConfig,
      state: StreamingKVCache,
      prompt_lengths,  # [batch] int32
  ) -> StreamingKVCache:
    return state.replace(prompt_lengths=jnp.asarray(prompt_lengths, jnp.int32))

  def finish_prefill(self, cfg: ModelConfig, state: StreamingKVCache, on_progress=None) -> StreamingKVCache:
    """Turns the prefill form into the decode form (see the module docstring)."""
    del cfg, on_progress
    if state.ring:
      raise ValueError("finish_prefill called twice: the state is already a ring")
    return _to_ring(state, sinks=self.sinks, window=self.window, dense_layers=self.dense_layers)

  def attend(self, cfg, layer, q, k, v, positions, state: StreamingKVCache):
    impl = resolve_implementation(self.implementation)
    if not state.ring:  # prefill is dense
      state = state.replace(k=write_tokens(state.k, layer, k, positions), v=write_tokens(state.v, layer, v, positions))
      o, _ = dense_attention(cfg, layer, q, positions, state.k, state.v, implementation=impl)
      return o, state
    if q.shape[1] != 1:
      raise ValueError(f"streaming decodes one token per step after finish_prefill, got a chunk of {q.shape[1]}")
    pos = positions[:, 0]
    slots = ring_slot(positions, sinks=self.sinks, window=self.window)
    state = state.replace(k=write_tokens(state.k, layer, k, slots), v=write_tokens(state.v, layer, v, slots))
    q1 = q[:, 0]
    if not self.dense_layers:
      return self._window_attention(cfg, layer, q1, pos, state.k, state.v, impl=impl)[:, None], state
    dense = is_dense_layer(layer, self.dense_layers)
    # Index of `layer` among dense_layers; len(dense_layers) (out of range: the write is
    # dropped) when it is not a dense layer.
    dense_ids = jnp.asarray(self.dense_layers, jnp.int32)
    slot = jnp.where(dense, jnp.argmax(dense_ids == layer), len(self.dense_layers)).astype(jnp.int32)
    state = state.replace(dense_k=write_tokens(state.dense_k, slot, k, positions),
                          dense_v=write_tokens(state.dense_v, slot, v, positions))
    o = jax.lax.cond(
        dense,
        lambda: _decode_dense(cfg, layer, jnp.minimum(slot, len(self.dense_layers) - 1), q1, pos,
                              state.dense_k, state.dense_v, impl),
        lambda: self._window_attention(cfg, layer, q1, pos, state.k, state.v, impl=impl))
    return o[:, None], state

  def _window_attention(
      self,
      cfg: ModelConfig,
      layer,  # [] int32
      q,  # [batch, num_heads, head_dim]
      pos,  # [batch] int32
      k_ring,  # [layers, batch, kv_heads, sinks + window, head_dim]
      v_ring,  # same as k_ring
      *,
      impl: str,
  ):
    """Attention over the sinks and the window: o [batch, num_heads, head_dim] f32."""
    (start1, end1), (start2, end2) = streaming_ranges(pos, layer_window(cfg, layer), sinks=self.sinks,
                                                      window=self.window)
    o, _ = ops.partial_attention(q, k_ring, v_ring, end1, starts=start1, starts2=start2, lengths2=end2, layer=layer,
                                 scale=cfg.attn_scale, implementation=impl)
    return o


@functools.partial(jax.jit, static_argnames=("sinks", "window", "dense_layers"))
def _to_ring(state: StreamingKVCache, *, sinks: int, window: int, dense_layers: tuple[int, ...]) -> StreamingKVCache:
  capacity = state.k.shape[3]
  last = state.prompt_lengths[:, None] - 1  # [B, 1]
  slots = jnp.arange(sinks + window, dtype=jnp.int32)
  # Latest prompt position held by each slot: sink slot s holds s; window slot s holds the
  # largest j <= last with j ≡ s (mod window). A slot whose position is not a prompt token
  # holds garbage that decode never reads (its ranges cover valid positions only).
  held = jnp.where(slots < sinks, slots, last - (last - slots) % window)  # [B, S+W]
  held = jnp.clip(held, 0, capacity - 1)
  batch_ids = jnp.arange(state.k.shape[1])[:, None]
  # Advanced indices on axes 1 and 3 come first: [B, S+W, L, Hkv, D] -> [L, B, Hkv, S+W, D].
  gather = lambda x: jnp.transpose(x[:, batch_ids, :, held, :], (2, 0, 3, 1, 4))
  ids = jnp.asarray(dense_layers, jnp.int32)
  return state.replace(k=gather(state.k), v=gather(state.v), dense_k=state.k[ids], dense_v=state.v[ids], ring=True)
