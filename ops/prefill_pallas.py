"""Pallas flash-attention kernel for a chunk of prompt queries over a head-major cache.

Same contract as the XLA blockwise path in ops/prefill_attention.py (which validates and
dispatches here with implementation="pallas"): query t of sequence b, at absolute position
q_positions[b, t], sees key j iff j < kv_lengths[b], j <= q_positions[b, t] and, with a window
w > 0, j > q_positions[b, t] - w. One program per (sequence, query head, block of queries)
walks only the key blocks its positions can see, with an online softmax, and writes the flash
residuals (o normalized, lse). The key and value tiles are read from the (layer-stacked) cache
in place, as the decode kernel does.

Why a kernel: JAX's bundled Pallas `mha` ran an 8K causal prefill ~4.5x faster than the XLA
blockwise path on the H200 (ops/NOTES.md), but it cannot attend a chunk at an offset into a
longer cache, a sliding window or a stacked cache, which chunked prefill needs.
Not yet timed on the GPU: the XLA path stays the default until experiments/bench_attention.py
shows this one faster.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

_NEG_INF = float("-inf")
DEFAULT_BLOCK_Q = 64
DEFAULT_BLOCK_K = 64


def _kernel(
    layer_ref,  # [1] int32: layer of the stacked cache (0 when not stacked)
    length_ref,  # [] int32: valid keys of this sequence
    window_ref,  # [1] int32: sliding window, 0 = global
    pos_ref,  # [bq] int32: absolute positions of this block's queries
    q_ref,  # [bq, D]: this query head's block of queries
    k_ref,  # [L, B, Hkv, S, D]: the whole cache, indexed in place
    v_ref,  # [L, B, Hkv, S, D]
    o_ref,  # [bq, D] float32
    lse_ref,  # [bq] float32
    *,
    scale: float,
    block_k: int,
    seq_len: int,
    groups: int,
    has_window: bool,
):
  b, head = pl.program_id(0), pl.program_id(1)
  kv_head = head // groups
  layer = layer_ref[0]
  length = length_ref[()]
  window = window_ref[0]
  pos = pos_ref[...]
  q = q_ref[...].astype(k_ref.dtype)
  block_q, head_dim = q_ref.shape
  precision = lax.Precision.HIGHEST if k_ref.dtype == jnp.float32 else None

  hi = jnp.minimum(jnp.max(pos) + 1, length)
  lo = jnp.int32(0)
  if has_window:
    lo = jnp.where(window > 0, jnp.maximum(jnp.min(pos) - window + 1, 0), 0)
  first = lo // block_k
  last = jnp.where(hi > lo, pl.cdiv(hi, block_k), first)

  def body(j, carry):
    acc, m_prev, l_prev = carry  # [bq, D], [bq], [bq]
    nominal = j * block_k
    # A block reaching past the buffer is shifted back inside it; keys before `nominal`
    # were counted by the previous block and are masked here.
    start = jnp.minimum(nominal, seq_len - block_k)
    k = k_ref[layer, b, kv_head, pl.ds(start, block_k), :]  # [bk, D]
    v = v_ref[layer, b, kv_head, pl.ds(start, block_k), :]
    kpos = start + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
    key_ok = (kpos >= nominal) & (kpos < length)  # [bk]
    valid = key_ok[None, :] & (kpos[None, :] <= pos[:, None])  # [bq, bk]
    if has_window:
      valid &= (window <= 0) | (kpos[None, :] > pos[:, None] - window)
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                        preferred_element_type=jnp.float32) * scale  # [bq, bk]
    s = jnp.where(valid, s, _NEG_INF)
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
    shift = jnp.where(m_next > _NEG_INF, m_next, 0.0)  # a row with nothing visible yet
    alpha = jnp.exp(m_prev - shift)
    p = jnp.exp(s - shift[:, None])
    # Zero V rows outside the set so garbage (even NaN) cannot leak through 0 * NaN.
    v = jnp.where(key_ok[:, None], v, jnp.zeros_like(v))
    pv = jnp.dot(p.astype(v.dtype), v, precision=precision, preferred_element_type=jnp.float32)
    return alpha[:, None] * acc + pv, m_next, alpha * l_prev + jnp.sum(p, axis=1)

  init = (jnp.zeros((block_q, head_dim), jnp.float32), jnp.full((block_q,), _NEG_INF, jnp.float32),
          jnp.zeros((block_q,), jnp.float32))
  acc, m, l = lax.fori_loop(first, last, body, init)
  nonempty = l > 0
  safe_l = jnp.where(nonempty, l, 1.0)
  o_ref[...] = jnp.where(nonempty[:, None], acc / safe_l[:, None], 0.0)
  lse_ref[...] = jnp.where(nonempty, m + jnp.log(safe_l), _NEG_INF)


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "block_k", "has_window", "interpret"))
def prefill_pallas(
    q,  # [B, T, Hq, D]
    k,  # [L, B, Hkv, S, D]
    v,  # same as k
    q_positions,  # [B, T] int32
    kv_lengths,  # [B] int32
    window,  # [] int32, 0 = global
    layer,  # [1] int32
    *,
    scale: float,
    block_q: int,
    block_k: int,
    has_window: bool,
    interpret: bool,
):
  """(o [B, T, Hq, D] f32, lse [B, T, Hq] f32); inputs already validated by the caller."""
  batch, t_len, q_heads, head_dim = q.shape
  _, _, kv_heads, seq_len, _ = k.shape
  block_q = max(16, min(block_q, pl.next_power_of_2(t_len)))
  block_k = max(16, min(block_k, 1 << (seq_len.bit_length() - 1)))
  if seq_len < 16:  # tiny buffers only: every tile needs >= 16 rows
    pad = [(0, 0)] * 3 + [(0, 16 - seq_len), (0, 0)]
    k, v, seq_len = jnp.pad(k, pad), jnp.pad(v, pad), 16
  num_q_blocks = pl.cdiv(t_len, block_q)
  padded = num_q_blocks * block_q
  qh = jnp.swapaxes(q, 1, 2)  # [B, Hq, T, D]
  pos = q_positions
  if padded != t_len:
    # Padded queries repeat the last position: they widen no loop bound and are dropped.
    qh = jnp.pad(qh, ((0, 0), (0, 0), (0, padded - t_len), (0, 0)))
    pos = jnp.pad(pos, ((0, 0), (0, padded - t_len)), mode="edge")
  kernel = functools.partial(_kernel, scale=scale, block_k=block_k, seq_len=seq_len,
                             groups=q_heads // kv_heads, has_window=has_window)
  compiler_params = None
  if not interpret and jax.default_backend() == "gpu":
    from jax.experimental.pallas import triton as plgpu  # pylint: disable=g-import-not-at-top
    compiler_params = plgpu.CompilerParams(num_warps=4, num_stages=2)
  o, lse = pl.pallas_call(
      kernel,
      grid=(batch, q_heads, num_q_blocks),
      in_specs=[
          pl.BlockSpec((1,), lambda b, h, i: (0,)),
          pl.BlockSpec((None,), lambda b, h, i: (b,)),
          pl.BlockSpec((1,), lambda b, h, i: (0,)),
          pl.BlockSpec((None, block_q), lambda b, h, i: (b, i)),
          pl.BlockSpec((None, None, block_q, head_dim), lambda b, h, i: (b, h, i, 0)),
          pl.no_block_spec,
          pl.no_block_spec,
      ],
      out_specs=[
          pl.BlockSpec((None, None, block_q, head_dim), lambda b, h, i: (b, h, i, 0)),
          pl.BlockSpec((None, None, block_q), lambda b, h, i: (b, h, i)),
      ],
      out_shape=[
          jax.ShapeDtypeStruct((batch, q_heads, padded, head_dim), jnp.float32),
          jax.ShapeDtypeStruct((batch, q_heads, padded), jnp.float32),
      ],
      compiler_params=compiler_params,
      interpret=interpret,
      name=f"kvjax_prefill_attention_bq{block_q}_bk{block_k}",
  )(layer, kv_lengths, jnp.reshape(window, (1,)), pos, qh, k, v)
  return jnp.swapaxes(o[:, :, :t_len], 1, 2), jnp.swapaxes(lse[:, :, :t_len], 1, 2)
