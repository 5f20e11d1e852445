"""`full`: dense attention over an on-device KV cache, the reference every policy is judged by.

The cache is layer-stacked and head-major, [layers, batch, kv_heads, capacity, head_dim],
and lives in the decoder's scan carry: new tokens are scattered in place and the attention
kernel reads the selected layer without slicing it out, so a decode step reads each key and
value once and copies nothing.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

import ops
from kvjax.policies.base import AttentionPolicy, layer_window
from models.config import ModelConfig


@flax.struct.dataclass
class DenseKVCache:
  k: jax.Array  # [layers, batch, kv_heads, capacity, head_dim]
  v: jax.Array  # [layers, batch, kv_heads, capacity, head_dim]

  @property
  def capacity(self) -> int:
    return self.k.shape[3]


def write_tokens(
    cache,  # [layers, batch, kv_heads, capacity, head_dim]
    layer,  # [] int32
    new,  # [batch, seq, kv_heads, head_dim]
    positions,  # [batch, seq] int32
):
  """Scatters `new` into `cache[layer, b, :, positions[b, t]]`; out-of-range positions are dropped."""
  batch_ids = jnp.arange(new.shape[0], dtype=jnp.int32)[:, None]
  # Advanced indices separated by a slice put their broadcast shape [B, T] first: the
  # update's shape is [B, T, kv_heads, head_dim], which is `new` as it comes.
  return cache.at[layer, batch_ids, :, positions, :].set(new.astype(cache.dtype), mode="drop")


def dense_attention(
    cfg: ModelConfig,
    layer,  # [] int32
    q,  # [batch, seq, num_heads, head_dim]
    positions,  # [batch, seq] int32
    k_cache,  # [layers, batch, kv_heads, capacity, head_dim]
    v_cache,  # [layers, batch, kv_heads, capacity, head_dim]
    *,
    implementation: str,
    window=None,
):
  """Causal (optionally sliding-window) attention of q over the cache: (o, lse) in f32.

  `layer` indexes the cache; `window` defaults to the sliding window of model layer `layer`
  (pass it when the cache holds a subset of the layers).
  """
  if window is None:
    window = layer_window(cfg, layer)
  if q.shape[1] == 1:  # decode: one query per sequence
    pos = positions[:, 0]
    starts = jnp.where(window > 0, jnp.maximum(pos + 1 - window, 0), 0)
    o, lse = ops.partial_attention(
        q[:, 0], k_cache, v_cache, pos + 1, starts=starts, layer=layer, scale=cfg.attn_scale,
        implementation=implementation)
    return o[:, None], lse[:, None]
  # A prompt chunk: the Pallas flash kernel on a GPU is ~3x the XLA blockwise loop
  # (experiments/results/bench_attention.md, prefill rows).
  return ops.prefill_attention(
      q, k_cache, v_cache, positions, positions[:, -1] + 1, window=window, layer=layer, scale=cfg.attn_scale,
      implementation=implementation)


def write_dense(
    cache: DenseKVCache,  # [cache layers, batch, kv_heads, capacity, head_dim] each
    slot,  # [] int32: the layer's index in `cache`
    k,  # [batch, seq, num_kv_heads, head_dim]
    v,  # [batch, seq, num_kv_heads, head_dim]
    positions,  # [batch, seq] int32; out-of-range positions are dropped
) -> DenseKVCache:
  return DenseKVCache(k=write_tokens(cache.k, slot, k, positions), v=write_tokens(cache.v, slot, v, positions))


def write_and_attend(
    cfg: ModelConfig,
    cache: DenseKVCache,  # [cache layers, batch, kv_heads, capacity, head_dim] each
    slot,  # [] int32: the layer's index in `cache`
    q,  # [batch, seq, num_heads, head_dim]
    k,  # [batch, seq, num_kv_heads, head_dim]
    v,  # [batch, seq, num_kv_heads, head_dim]
    positions,  # [batch, seq] int32
    *,
    implementation: str,
    window=None,
):
  """Writes the new tokens into `cache[slot]` and attends over it: (o [B, T, Hq, D] f32, cache).

  `window` defaults to the sliding window of model layer `slot` (pass it when the cache holds
  a subset of the layers).
  """
  cache = write_dense(cache, slot, k, v, positions)
  o, _ = dense_attention(cfg, slot, q, positions, cache.k, cache.v, implementation=resolve_implementation(implementation),
                         window=window)
  return o.astype(jnp.float32), cache


def resolve_implementation(implementation: str) -> str:
  if implementation == "auto":
    return "pallas" if jax.default_backend() == "gpu" else "xla"
  return implementation


@dataclasses.dataclass(frozen=True)
class FullAttention(AttentionPolicy):
  """Dense attention; `implementation` picks the decode kernel ("pallas", "xla" or "auto").

  "auto" runs the Pallas kernel on a GPU and the XLA reference elsewhere (a compiled Pallas
  GPU kernel cannot run on the CPU; interpret mode is for tests, not for speed).
  """

  implementation: str = "auto"
  name: str = "full"
  takes_written_prompt = True

  def __post_init__(self):
    if self.implementation not in ("auto", "pallas", "xla"):
      raise ValueError(f"implementation={self.implementation!r}; expected auto, pallas or xla")

  def init_state(self, cfg: ModelConfig, batch: int, capacity: int, dtype) -> DenseKVCache:
    shape = (cfg.num_layers, batch, cfg.num_kv_heads, capacity, cfg.head_dim)
    return DenseKVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))

  def write_prompt(self, cfg, layer, q, k, v, positions, state: DenseKVCache) -> DenseKVCache:
    return write_dense(state, layer, k, v, positions)

  def attend(self, cfg, layer, q, k, v, positions, state: DenseKVCache):
    return write_and_attend(cfg, state, layer, q, k, v, positions, implementation=self.implementation)
