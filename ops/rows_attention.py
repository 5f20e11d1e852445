"""Partial attention over a KV-head cache's key intervals plus each query head's own rows.

The retrieval policy's per_step decode attends, per query head, two sets at once: the
device-resident ring of its KV head (sinks and window: `ops.partial_attention`'s two
intervals) and the rows the host retrieved for that query head alone. Composed from
separate ops, that is the ring kernel, its split combine, ~5 XLA fusions for the rows, a
merge and a per-layer slice of the row buffers: ~11 kernels a layer, each a few µs of
launch on a step that is launch-bound (an H200 trace of a SmolLM2-shape step at 32K:
1178 kernels, 2.1 ms of them busy in a 15 ms step with command buffers off;
experiments/results/bench_scale_smollm2shapes_synthetic_32k_trace_cboff_kernels.md).
Here one program per (sequence, KV head) folds the ring blocks into an online softmax
(`partial_attention.fold_interval`), folds each query head's rows into its own state and
merges the two in registers: one kernel, no split, no slice copy (row buffers are indexed
in place by layer). The ring is short (sinks + window), so one program per KV head reads
it in a few µs.

Same contract as the other ops: `(o, lse)`, float32, an empty set gives o = 0 and
lse = -inf; `implementation="xla"` is the composition of the separate ops; a float32
`*_reference` twin.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ops import _checks
from ops.merge import merge_partials
from ops.partial_attention import (_MIN_TILE, _NEG_INF, _in_intervals, _pad_groups, _partial_attention_xla,
                                   _pow2_floor, _prepare, _select_layer, empty_carry, finish_carry, fold_interval)

_BLOCK_K = 64  # ring keys per step of the fold (partial_attention's default)
_BLOCK_ROWS = 128  # rows per step of a head's row fold: a [128, D] tile, reduced on the vector units


def _fold_rows(
    q,  # [D] float32: one query head's query
    k_ref,  # [L, B, Hq, N, D] ref: every head's rows, indexed in place
    v_ref,  # [L, B, Hq, N, D] ref
    ids_ref,  # [L, B, Hq, N] ref int32: a row is valid where its id >= 0
    index,  # (layer, b, query head)
    *,
    num_rows: int,
    block: int,
    scale: float,
):
  """(acc [D], m [], l []): the online-softmax state of one query head over its valid rows.

  A head's rows are its own keys, so the scores are a per-row dot product on the vector units
  in float32 (the rows' own precision), not a tile matmul shared by the group."""
  ragged = num_rows % block != 0
  offsets = lax.broadcasted_iota(jnp.int32, (block,), 0)

  def body(i, carry):
    acc, m_prev, l_prev = carry
    nominal = i * block
    # The last block is shifted back inside the buffer; rows before `nominal` were counted.
    blk = jnp.minimum(nominal, num_rows - block) if ragged else pl.multiple_of(nominal, block)
    k = k_ref[(*index, pl.ds(blk, block), slice(None))].astype(jnp.float32)  # [bn, D]
    v = v_ref[(*index, pl.ds(blk, block), slice(None))].astype(jnp.float32)  # [bn, D]
    valid = (ids_ref[(*index, pl.ds(blk, block))] >= 0) & (blk + offsets >= nominal)  # [bn]
    s = jnp.where(valid, jnp.sum(k * q[None, :], axis=1) * scale, _NEG_INF)  # [bn]
    m_next = jnp.maximum(m_prev, jnp.max(s))
    shift = jnp.where(m_next == _NEG_INF, 0.0, m_next)  # no valid row yet: keep exp() at 0, not NaN
    alpha = jnp.exp(m_prev - shift)
    p = jnp.exp(s - shift)  # [bn], 0 where invalid
    pv = jnp.sum(p[:, None] * jnp.where(valid[:, None], v, 0.0), axis=0)  # a NaN in a free slot stays out
    return alpha * acc + pv, m_next, alpha * l_prev + jnp.sum(p)

  init = (jnp.zeros(q.shape, jnp.float32), jnp.float32(_NEG_INF), jnp.float32(0.0))
  return lax.fori_loop(0, pl.cdiv(num_rows, block), body, init)


def _merge_row(carry, g: int, row_state):
  """Merges one query head's row state into row g of the group's online-softmax carry."""
  acc, m, l = carry  # [Gp, D], [Gp], [Gp]
  acc_g, m_g, l_g = row_state  # [D], [], []
  mine = lax.broadcasted_iota(jnp.int32, m.shape, 0) == g
  m_new = jnp.maximum(m, m_g)
  shift = jnp.where(m_new == _NEG_INF, 0.0, m_new)
  a, c = jnp.exp(m - shift), jnp.exp(m_g - shift)  # [Gp]
  acc = jnp.where(mine[:, None], a[:, None] * acc + c[:, None] * acc_g[None, :], acc)
  return acc, jnp.where(mine, m_new, m), jnp.where(mine, a * l + c * l_g, l)


def _kernel(
    layer_ref,  # [1] int32
    starts_ref,  # [] int32: the cache's first interval [starts, lengths)
    lengths_ref,  # [] int32
    starts2_ref,  # [] int32: its second interval [starts2, lengths2)
    lengths2_ref,  # [] int32
    q_ref,  # [Gp, D]: this KV head's query group, padded to Gp rows
    k_ref,  # [L, B, Hkv, S, D]: the whole cache, indexed in place
    v_ref,  # [L, B, Hkv, S, D]
    rows_k_ref,  # [L, B, Hq, N, D]: every query head's rows, indexed in place
    rows_v_ref,  # [L, B, Hq, N, D]
    rows_ids_ref,  # [L, B, Hq, N] int32
    o_ref,  # [Gp, D] float32
    lse_ref,  # [Gp] float32
    *,
    scale: float,
    groups: int,
    block_k: int,
    seq_len: int,
    block_rows: int,
    num_rows: int,
):
  b, h = pl.program_id(0), pl.program_id(1)
  layer = layer_ref[0]
  fold = functools.partial(fold_interval, q_ref[...].astype(k_ref.dtype), k_ref, v_ref, (layer, b, h), lo=0,
                           hi=seq_len, block_k=block_k, seq_len=seq_len, scale=scale)
  carry = fold(starts_ref[()], lengths_ref[()], empty_carry(*q_ref.shape))
  carry = fold(starts2_ref[()], lengths2_ref[()], carry)
  for g in range(groups):  # static: each query head of the group has its own rows
    rows = _fold_rows(q_ref[g, :].astype(jnp.float32), rows_k_ref, rows_v_ref, rows_ids_ref,
                      (layer, b, h * groups + g), num_rows=num_rows, block=block_rows, scale=scale)
    carry = _merge_row(carry, g, rows)
  o_ref[...], lse_ref[...] = finish_carry(carry)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "num_warps"))
def _rows_attention_pallas(
    q,  # [B, Hq, D]
    k,  # [L, B, Hkv, S, D]
    v,  # [L, B, Hkv, S, D]
    starts,  # [B] int32
    lengths,  # [B] int32
    starts2,  # [B] int32
    lengths2,  # [B] int32
    rows_k,  # [L, B, Hq, N, D]
    rows_v,  # [L, B, Hq, N, D]
    rows_ids,  # [L, B, Hq, N] int32
    layer,  # [1] int32
    *,
    scale: float,
    interpret: bool,
    num_warps: int | None,
):
  batch, q_heads, head_dim = q.shape
  kv_heads, seq_len = k.shape[2], k.shape[3]
  num_rows = rows_k.shape[3]
  if seq_len < _MIN_TILE:  # tiny buffers only (tests): pad so every tile is >= 16
    pad = [(0, 0)] * 3 + [(0, _MIN_TILE - seq_len), (0, 0)]
    k, v, seq_len = jnp.pad(k, pad), jnp.pad(v, pad), _MIN_TILE
  if num_rows < _MIN_TILE:
    pad = [(0, 0)] * 3 + [(0, _MIN_TILE - num_rows)]
    rows_k, rows_v = (jnp.pad(x, pad + [(0, 0)]) for x in (rows_k, rows_v))
    rows_ids, num_rows = jnp.pad(rows_ids, pad, constant_values=-1), _MIN_TILE
  groups = q_heads // kv_heads
  gp = _pad_groups(groups)
  qg = q.reshape(batch, kv_heads, groups, head_dim)
  if gp != groups:
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, gp - groups), (0, 0)))
  block_k = max(_MIN_TILE, min(_BLOCK_K, _pow2_floor(seq_len)))
  block_rows = max(_MIN_TILE, min(_BLOCK_ROWS, _pow2_floor(num_rows)))
  kernel = functools.partial(_kernel, scale=scale, groups=groups, block_k=block_k, seq_len=seq_len,
                             block_rows=block_rows, num_rows=num_rows)
  compiler_params = None
  if not interpret and jax.default_backend() == "gpu":
    from jax.experimental.pallas import triton as plgpu  # pylint: disable=g-import-not-at-top
    compiler_params = plgpu.CompilerParams(num_warps=num_warps or 4, num_stages=2)
  per_sequence = pl.BlockSpec((None,), lambda b, h: (b,))
  o, lse = pl.pallas_call(
      kernel,
      grid=(batch, kv_heads),
      in_specs=[pl.BlockSpec((1,), lambda b, h: (0,)), per_sequence, per_sequence, per_sequence, per_sequence,
                pl.BlockSpec((None, None, gp, head_dim), lambda b, h: (b, h, 0, 0))] + [pl.no_block_spec] * 5,
      out_specs=[pl.BlockSpec((None, None, gp, head_dim), lambda b, h: (b, h, 0, 0)),
                 pl.BlockSpec((None, None, gp), lambda b, h: (b, h, 0))],
      out_shape=[jax.ShapeDtypeStruct((batch, kv_heads, gp, head_dim), jnp.float32),
                 jax.ShapeDtypeStruct((batch, kv_heads, gp), jnp.float32)],
      compiler_params=compiler_params,
      interpret=interpret,
      name=f"kvjax_rows_attention_bk{block_k}_bn{block_rows}",
  )(layer, starts, lengths, starts2, lengths2, qg, k, v, rows_k, rows_v, rows_ids)
  return (o[:, :, :groups].reshape(batch, q_heads, head_dim), lse[:, :, :groups].reshape(batch, q_heads))


@functools.partial(jax.jit, static_argnames=("scale",))
def _rows_xla(
    q,  # [B, Hq, D]
    rows_k,  # [B, Hq, N, D] or [L, B, Hq, N, D]
    rows_v,  # same as rows_k
    rows_ids,  # [B, Hq, N] or [L, B, Hq, N] int32
    layer,  # [] int32 or None
    *,
    scale: float,
):
  """(o, lse) of each query head over its own valid rows, in float32 at HIGHEST precision (a few
  rows per head: no reason to let a GPU drop to TF32)."""
  rows_k, rows_v, rows_ids = (_select_layer(x, layer) for x in (rows_k, rows_v, rows_ids))
  exact = lax.Precision.HIGHEST
  valid = rows_ids >= 0
  scores = jnp.einsum("bhd,bhnd->bhn", q.astype(jnp.float32), rows_k.astype(jnp.float32), precision=exact) * scale
  scores = jnp.where(valid, scores, _NEG_INF)
  peak = jnp.max(scores, axis=-1, keepdims=True)
  peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
  weights = jnp.exp(scores - peak)  # exactly 0 where invalid
  total = jnp.sum(weights, axis=-1)
  values = jnp.where(valid[..., None], rows_v.astype(jnp.float32), 0.0)
  o = jnp.einsum("bhn,bhnd->bhd", weights, values, precision=exact) / jnp.maximum(total, 1e-30)[..., None]
  lse = jnp.where(total > 0, jnp.log(jnp.maximum(total, 1e-30)) + peak[..., 0], _NEG_INF)
  return o, lse


def _validate_rows(q, k, rows_k, rows_v, rows_ids) -> None:
  """The rows must match q's heads and head_dim and the cache's layer stacking."""
  for name, x in (("rows_k", rows_k), ("rows_v", rows_v)):
    _checks.check_float(name, x)
  _checks.check_int("rows_ids", rows_ids)
  lead = k.shape[:-4]  # (L,) for a stacked cache, () otherwise
  batch, q_heads, head_dim = q.shape
  layout = "[layers, batch, q_heads, rows, head_dim]" if lead else "[batch, q_heads, rows, head_dim]"
  _checks.check_ndim("rows_k", rows_k, (len(lead) + 4,), layout + " (stacked as k is)")
  want = lead + (batch, q_heads, rows_k.shape[-2], head_dim)
  _checks.check_shape("rows_k", rows_k, want, layout)
  _checks.check_shape("rows_v", rows_v, want, layout)
  if rows_v.dtype != rows_k.dtype:
    raise TypeError(f"rows_v.dtype={rows_v.dtype} must equal rows_k.dtype={rows_k.dtype}")
  if want[-2] == 0:
    raise ValueError(f"rows_k.shape={tuple(rows_k.shape)} holds no row slots (rows = 0)")
  _checks.check_shape("rows_ids", rows_ids, want[:-1], layout.replace(", head_dim", ""))


def _prepare_rows(q, k, v, lengths, starts, starts2, lengths2, rows_k, rows_v, rows_ids, layer, implementation,
                  scale):
  lengths, starts, starts2, lengths2, scale = _prepare(q, k, v, lengths, starts, layer, implementation, scale,
                                                       starts2, lengths2)  # an absent second interval: empty
  _validate_rows(q, k, rows_k, rows_v, rows_ids)
  return lengths, starts, starts2, lengths2, jnp.asarray(rows_ids, jnp.int32), scale


def partial_attention_with_rows(
    q: jax.Array,  # [B, Hq, D]
    k: jax.Array,  # [B, Hkv, S, D] or [L, B, Hkv, S, D]
    v: jax.Array,  # same as k
    lengths: jax.Array,  # [B] int32
    rows_k: jax.Array,  # [B, Hq, N, D] or [L, B, Hq, N, D] (stacked as k is)
    rows_v: jax.Array,  # same as rows_k
    rows_ids: jax.Array,  # [B, Hq, N] or [L, B, Hq, N] int32
    *,
    starts: jax.Array | None = None,  # [B] int32
    starts2: jax.Array | None = None,  # [B] int32
    lengths2: jax.Array | None = None,  # [B] int32
    layer: jax.Array | int | None = None,  # [] int32
    scale: float | None = None,
    implementation: str = "pallas",
    interpret: bool = False,
    num_warps: int | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Attention of each query head over its KV head's keys in [starts, lengths) (and
  [starts2, lengths2)), as `ops.partial_attention`, together with its own rows, as (o, lse).

  Args:
    q: [batch, q_heads, head_dim] queries (bf16/f16/f32).
    k, v: the KV-head cache, [batch, kv_heads, seq, head_dim] or [layers, ...] with `layer`.
    lengths, starts, starts2, lengths2: [batch] int32 key intervals of the cache, as in
      `ops.partial_attention` (disjoint; the second optional).
    rows_k, rows_v: [batch, q_heads, rows, head_dim] (or [layers, ...]): query head h's own
      keys and values, any float dtype (attended in float32).
    rows_ids: [batch, q_heads, rows] (or [layers, ...]) int32: row r of head h is attended
      where rows_ids >= 0 (an empty slot holds -1; its k and v are never read into the result).
    layer: int32 scalar (may be traced) selecting the layer of stacked buffers; the Pallas
      path indexes them in place.
    scale: score scale; default head_dim ** -0.5.
    implementation: "pallas" (one kernel) or "xla" (`partial_attention`'s XLA path, the rows in
      XLA and `merge_partials`).
    interpret: run the Pallas kernel in interpret mode (CPU tests).
    num_warps: Triton warps per program (GPU only).

  Returns:
    o: [batch, q_heads, head_dim] float32, normalized over the union of both sets.
    lse: [batch, q_heads] float32. An empty union gives o = 0 and lse = -inf.
  """
  lengths, starts, starts2, lengths2, rows_ids, scale = _prepare_rows(
      q, k, v, lengths, starts, starts2, lengths2, rows_k, rows_v, rows_ids, layer, implementation, scale)
  if implementation == "xla":
    layer_arr = None if layer is None else jnp.asarray(layer, jnp.int32)
    ring = _partial_attention_xla(q, k, v, starts, lengths, starts2, lengths2, layer_arr, scale=scale)
    return merge_partials([ring, _rows_xla(q, rows_k, rows_v, rows_ids, layer_arr, scale=scale)])
  if k.ndim == 4:  # free reshapes: L = 1
    k, v, rows_k, rows_v, rows_ids, layer = k[None], v[None], rows_k[None], rows_v[None], rows_ids[None], 0
  layer_arr = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
  return _rows_attention_pallas(q, k, v, starts, lengths, starts2, lengths2, rows_k, rows_v, rows_ids, layer_arr,
                                scale=scale, interpret=interpret, num_warps=num_warps)


def partial_attention_with_rows_reference(
    q: jax.Array,  # [B, Hq, D]
    k: jax.Array,  # [B, Hkv, S, D] or [L, B, Hkv, S, D]
    v: jax.Array,  # same as k
    lengths: jax.Array,  # [B] int32
    rows_k: jax.Array,  # [B, Hq, N, D] or [L, B, Hq, N, D]
    rows_v: jax.Array,  # same as rows_k
    rows_ids: jax.Array,  # [B, Hq, N] or [L, B, Hq, N] int32
    *,
    starts: jax.Array | None = None,  # [B] int32
    starts2: jax.Array | None = None,  # [B] int32
    lengths2: jax.Array | None = None,  # [B] int32
    layer: jax.Array | int | None = None,  # [] int32
    scale: float | None = None,
    **unused,
) -> tuple[jax.Array, jax.Array]:
  """Dense float32 (HIGHEST) twin of `partial_attention_with_rows`: one softmax per query head
  over its KV head's keys and its own rows laid side by side. Kernel options are ignored."""
  del unused
  lengths, starts, starts2, lengths2, rows_ids, scale = _prepare_rows(
      q, k, v, lengths, starts, starts2, lengths2, rows_k, rows_v, rows_ids, layer, "xla", scale)
  k, v, rows_k, rows_v, rows_ids = (_select_layer(x, layer) for x in (k, v, rows_k, rows_v, rows_ids))
  batch, q_heads, head_dim = q.shape
  groups = q_heads // k.shape[1]
  per_head = lambda x: jnp.repeat(x.astype(jnp.float32), groups, axis=1)  # [B, Hkv, S, D] -> [B, Hq, S, D]
  keys = jnp.concatenate([per_head(k), rows_k.astype(jnp.float32)], axis=2)  # [B, Hq, S + N, D]
  values = jnp.concatenate([per_head(v), rows_v.astype(jnp.float32)], axis=2)
  in_cache = jnp.broadcast_to(_in_intervals(k.shape[2], starts, lengths, starts2, lengths2)[:, None], (batch, q_heads,
                                                                                                        k.shape[2]))
  valid = jnp.concatenate([in_cache, rows_ids >= 0], axis=2)  # [B, Hq, S + N]
  s = jnp.einsum("bhd,bhnd->bhn", q.astype(jnp.float32), keys, precision=lax.Precision.HIGHEST) * scale
  s = jnp.where(valid, s, _NEG_INF)
  lse = jax.nn.logsumexp(s, axis=-1)  # -inf for an empty union
  p = jnp.where(valid, jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)
  o = jnp.einsum("bhn,bhnd->bhd", p, jnp.where(valid[..., None], values, 0.0), precision=lax.Precision.HIGHEST)
  return o, lse
