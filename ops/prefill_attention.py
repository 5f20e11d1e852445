"""Blockwise causal GQA attention for a chunk of prompt queries, as (o, lse).

The XLA path never materializes T x S: each block of queries walks only the key
blocks its positions can see (dynamic loop bounds from the chunk's positions,
the window and kv_lengths) with an online softmax, so a chunked prefill of 128K
tokens runs on the H200 and 8K fits a small CPU. `prefill_attention_reference`
is the dense masked float32 twin for small sizes. `implementation="pallas"` runs the flash
kernel of ops/prefill_pallas.py instead (same contract; tested in interpret mode, not yet
timed on the GPU, so "xla" stays the default).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from ops import _checks
from ops.partial_attention import _NEG_INF
from ops.prefill_pallas import DEFAULT_BLOCK_K as DEFAULT_PALLAS_BLOCK_K
from ops.prefill_pallas import DEFAULT_BLOCK_Q as DEFAULT_PALLAS_BLOCK_Q
from ops.prefill_pallas import prefill_pallas

DEFAULT_BLOCK_Q = 1024
DEFAULT_BLOCK_K = 1024


def _mask(
    kpos,  # [bk] int32 key positions
    qpos,  # [B, bq] int32 query positions
    kv_lengths,  # [B] int32
    window,  # [] int32; 0 = global
    has_window: bool,
):
  """[B, bq, bk] validity: in the buffer, causal, inside the window."""
  valid = (kpos[None, None, :] < kv_lengths[:, None, None]) & (
      kpos[None, None, :] <= qpos[:, :, None])
  if has_window:
    in_window = kpos[None, None, :] > qpos[:, :, None] - window
    valid &= (window <= 0) | in_window
  return valid


def _select_layer_block(x, layer, start, size):
  """[B, Hkv, size, D] keys at [start, start+size) of (layer-stacked) x, no full copy."""
  if layer is None:
    return lax.dynamic_slice_in_dim(x, start, size, axis=2)
  _, b, h, _, d = x.shape
  blk = lax.dynamic_slice(x, (layer, 0, 0, start, 0), (1, b, h, size, d))
  return blk[0]


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "block_k", "has_window"))
def _prefill_xla(
    q,  # [B, T, Hq, D]
    k,  # [B, Hkv, S, D] or [L, B, Hkv, S, D]
    v,  # same as k
    q_positions,  # [B, T] int32
    kv_lengths,  # [B] int32
    window,  # [] int32, 0 = global
    layer,  # [] int32 or None
    *,
    scale: float,
    block_q: int,
    block_k: int,
    has_window: bool,
):
  batch, t_len, q_heads, head_dim = q.shape
  kv_heads, seq_len = k.shape[-3], k.shape[-2]
  groups = q_heads // kv_heads
  bq, bk = min(block_q, t_len), min(block_k, seq_len)
  nq = -(-t_len // bq)
  pad = nq * bq - t_len
  if pad:
    # Padded queries repeat the last position: they widen no loop bound.
    q = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
    q_positions = jnp.pad(q_positions, ((0, 0), (0, pad)), mode="edge")
  dot_dtype = k.dtype
  precision = lax.Precision.HIGHEST if dot_dtype == jnp.float32 else None
  # [B, nq*bq, Hkv, G, D] -> [nq, B, Hkv, G, bq, D]
  qb = q.astype(dot_dtype).reshape(batch, nq, bq, kv_heads, groups, head_dim)
  qb = qb.transpose(1, 0, 3, 4, 2, 5)
  posb = q_positions.reshape(batch, nq, bq).transpose(1, 0, 2)  # [nq, B, bq]
  max_len = jnp.max(kv_lengths)

  def q_block(args):
    qblk, pos = args  # [B, Hkv, G, bq, D], [B, bq]
    hi = jnp.minimum(jnp.max(pos) + 1, max_len)
    lo = jnp.int32(0)
    if has_window:
      lo = jnp.where(window > 0, jnp.maximum(jnp.min(pos) - window + 1, 0), 0)
    first = lo // bk
    last = jnp.where(hi > lo, -(-hi // bk), first)

    def body(j, carry):
      acc, m_prev, l_prev = carry  # [B,Hkv,G,bq,D], [B,Hkv,G,bq], [B,Hkv,G,bq]
      nominal = j * bk
      # Shift the last block back inside the buffer; keys before `nominal` are
      # masked so nothing is counted twice.
      kstart = jnp.minimum(nominal, seq_len - bk)
      kblk = _select_layer_block(k, layer, kstart, bk)  # [B, Hkv, bk, D]
      vblk = _select_layer_block(v, layer, kstart, bk)
      kpos = kstart + jnp.arange(bk, dtype=jnp.int32)
      valid = _mask(kpos, pos, kv_lengths, window, has_window) & (kpos >= nominal)[None, None, :]
      # BKGTD,BKSD->BKGTS
      s = jnp.einsum("bkgtd,bksd->bkgts", qblk, kblk, preferred_element_type=jnp.float32,
                     precision=precision) * scale
      s = jnp.where(valid[:, None, None, :, :], s, _NEG_INF)
      m_next = jnp.maximum(m_prev, jnp.max(s, axis=-1))
      m_safe = jnp.where(jnp.isfinite(m_next), m_next, 0.0)
      alpha = jnp.exp(m_prev - m_safe)
      p = jnp.exp(s - m_safe[..., None])
      l_next = alpha * l_prev + jnp.sum(p, axis=-1)
      # Zero V rows outside the buffer so garbage (even NaN) cannot leak via 0 * NaN.
      key_ok = (kpos[None, :] < kv_lengths[:, None]) & (kpos >= nominal)[None, :]  # [B, bk]
      vblk = jnp.where(key_ok[:, None, :, None], vblk, jnp.zeros_like(vblk))
      # BKGTS,BKSD->BKGTD
      pv = jnp.einsum("bkgts,bksd->bkgtd", p.astype(dot_dtype), vblk,
                      preferred_element_type=jnp.float32, precision=precision)
      return alpha[..., None] * acc + pv, m_next, l_next

    shape = qblk.shape[:-1]
    init = (jnp.zeros(qblk.shape, jnp.float32), jnp.full(shape, _NEG_INF, jnp.float32),
            jnp.zeros(shape, jnp.float32))
    acc, m, l = lax.fori_loop(first, last, body, init)
    nonempty = l > 0
    l_safe = jnp.where(nonempty, l, 1.0)
    o = jnp.where(nonempty[..., None], acc / l_safe[..., None], 0.0)
    lse = jnp.where(nonempty, m + jnp.log(l_safe), _NEG_INF)
    return o, lse

  o, lse = lax.map(q_block, (qb, posb))  # [nq, B, Hkv, G, bq, D], [nq, B, Hkv, G, bq]
  o = o.transpose(1, 0, 4, 2, 3, 5).reshape(batch, nq * bq, q_heads, head_dim)
  lse = lse.transpose(1, 0, 4, 2, 3).reshape(batch, nq * bq, q_heads)
  return o[:, :t_len], lse[:, :t_len]


def _prepare(q, k, v, q_positions, kv_lengths, window, layer, implementation, scale):
  _checks.check_implementation(implementation)
  _, batch, _, seq_len, head_dim = _checks.check_query_and_cache(
      q, k, v, q_layout="[batch, chunk, q_heads, head_dim]", q_head_axis=2, layer=layer)
  if implementation == "pallas":
    _checks.check_pow2("head_dim", head_dim, 16, " for implementation='pallas' (use 'xla')")
  if q.shape[1] == 0:
    raise ValueError(f"q.shape={tuple(q.shape)} is a chunk of no queries (chunk = 0)")
  q_positions, kv_lengths = _checks.index_array(q_positions), _checks.index_array(kv_lengths)
  _checks.check_int("q_positions", q_positions)
  _checks.check_int("kv_lengths", kv_lengths)
  _checks.check_shape("q_positions", q_positions, q.shape[:2], "[batch, chunk]")
  _checks.check_shape("kv_lengths", kv_lengths, (batch,), "[batch]")
  _checks.check_range("kv_lengths", kv_lengths, 0, seq_len)
  _checks.check_range("q_positions", q_positions, 0, 2**31 - 2)
  if window is not None:
    if isinstance(window, bool):
      raise TypeError(f"{window=} must be an int or an int32 array, not a bool")
    if isinstance(window, int):
      if not 0 <= window <= 2**31 - 1:
        raise ValueError(f"{window=} must lie in [0, 2**31 - 1] (0 or None = global)")
    else:
      _checks.check_int("window", window)
      _checks.check_range("window", window, 0, 2**31 - 1)
  scale = float(head_dim ** -0.5 if scale is None else scale)
  return jnp.asarray(q_positions, jnp.int32), jnp.asarray(kv_lengths, jnp.int32), scale


def prefill_attention(
    q: jax.Array,  # [B, T, Hq, D]
    k: jax.Array,  # [B, Hkv, S, D] or [L, B, Hkv, S, D]
    v: jax.Array,  # same as k
    q_positions: jax.Array,  # [B, T] int32
    kv_lengths: jax.Array,  # [B] int32
    *,
    window: int | jax.Array | None = None,
    layer: jax.Array | int | None = None,
    scale: float | None = None,
    implementation: str = "xla",
    interpret: bool = False,
    block_q: int | None = None,
    block_k: int | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Causal GQA attention of a chunk of queries over a head-major cache.

  Query t of sequence b (absolute position q_positions[b, t]) sees key j iff
  j < kv_lengths[b], j <= q_positions[b, t] and, with a window w > 0,
  j > q_positions[b, t] - w.

  Args:
    q: [batch, chunk, q_heads, head_dim] queries of the chunk.
    k: [batch, kv_heads, seq, head_dim] cache (the chunk's own keys already
      written), or [layers, batch, kv_heads, seq, head_dim] with `layer`.
    v: values, same shape and dtype as k.
    q_positions: [batch, chunk] int32 absolute positions of the queries.
    kv_lengths: [batch] int32 valid keys per sequence (<= seq).
    window: sliding window (python int or traced int32 scalar); None or 0 =
      global attention.
    layer: int32 scalar (may be traced) for a stacked cache; only the visited
      key blocks of that layer are sliced.
    scale: score scale; default head_dim ** -0.5.
    implementation: "xla" (blockwise online softmax in jnp) or "pallas" (the flash kernel of
      ops/prefill_pallas.py).
    interpret: run the Pallas kernel in interpret mode (CPU tests).
    block_q: queries per block (each block has its own key range).
    block_k: keys per inner iteration (a power of two >= 16 for "pallas").

  Returns:
    o: [batch, chunk, q_heads, head_dim] float32 (0 where no key is visible).
    lse: [batch, chunk, q_heads] float32 (-inf where no key is visible).
  """
  q_positions, kv_lengths, scale = _prepare(
      q, k, v, q_positions, kv_lengths, window, layer, implementation, scale)
  has_window = window is not None and not (isinstance(window, int) and window == 0)
  window_arr = jnp.asarray(0 if window is None else window, jnp.int32)
  layer_arr = None if layer is None else jnp.asarray(layer, jnp.int32)
  for name, val in (("block_q", block_q), ("block_k", block_k)):
    if val is not None and val < 1:
      raise ValueError(f"{name}={val} must be >= 1")
  if implementation == "pallas":
    for name, val in (("block_q", block_q), ("block_k", block_k)):
      if val is not None:
        _checks.check_pow2(name, val, 16)
    if k.ndim == 4:
      k, v, layer_arr = k[None], v[None], jnp.int32(0)  # a free reshape: L = 1
    return prefill_pallas(
        q, k, v, q_positions, kv_lengths, window_arr, jnp.reshape(layer_arr, (1,)), scale=scale,
        block_q=block_q or DEFAULT_PALLAS_BLOCK_Q, block_k=block_k or DEFAULT_PALLAS_BLOCK_K,
        has_window=has_window, interpret=interpret)
  return _prefill_xla(
      q, k, v, q_positions, kv_lengths, window_arr, layer_arr, scale=scale,
      block_q=block_q or DEFAULT_BLOCK_Q, block_k=block_k or DEFAULT_BLOCK_K,
      has_window=has_window)


def prefill_attention_reference(
    q: jax.Array,  # [B, T, Hq, D]
    k: jax.Array,  # [B, Hkv, S, D] or [L, B, Hkv, S, D]
    v: jax.Array,  # same as k
    q_positions: jax.Array,  # [B, T] int32
    kv_lengths: jax.Array,  # [B] int32
    *,
    window: int | jax.Array | None = None,
    layer: jax.Array | int | None = None,
    scale: float | None = None,
    **unused,
) -> tuple[jax.Array, jax.Array]:
  """Dense masked float32 (HIGHEST) twin of `prefill_attention`; small sizes only."""
  del unused
  q_positions, kv_lengths, scale = _prepare(
      q, k, v, q_positions, kv_lengths, window, layer, "xla", scale)
  if layer is not None:
    k = lax.dynamic_index_in_dim(k, layer, 0, keepdims=False)
    v = lax.dynamic_index_in_dim(v, layer, 0, keepdims=False)
  batch, t_len, q_heads, head_dim = q.shape
  _, kv_heads, seq_len, _ = k.shape
  groups = q_heads // kv_heads
  hp = lax.Precision.HIGHEST
  qg = q.astype(jnp.float32).reshape(batch, t_len, kv_heads, groups, head_dim)
  # BTKGD,BKSD->BKGTS
  s = jnp.einsum("btkgd,bksd->bkgts", qg, k.astype(jnp.float32), precision=hp) * scale
  window_arr = jnp.asarray(0 if window is None else window, jnp.int32)
  valid = _mask(jnp.arange(seq_len, dtype=jnp.int32), q_positions, kv_lengths,
                window_arr, True)  # [B, T, S]
  s = jnp.where(valid[:, None, None], s, _NEG_INF)
  lse = jax.nn.logsumexp(s, axis=-1)  # [B, Hkv, G, T]
  p = jnp.where(valid[:, None, None], jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)
  v32 = jnp.where((jnp.arange(seq_len) < kv_lengths[:, None])[:, None, :, None],
                  v.astype(jnp.float32), 0.0)
  o = jnp.einsum("bkgts,bksd->btkgd", p, v32, precision=hp)
  return (o.reshape(batch, t_len, q_heads, head_dim),
          lse.transpose(0, 3, 1, 2).reshape(batch, t_len, q_heads))
