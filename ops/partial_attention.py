"""Partial attention of one decode query per sequence over a device-resident set.

Layers, as in jax/experimental/pallas/ops/gpu/decode_attention.py:
  * `_kernel`: one program per (sequence, KV head, split of S); online softmax
    over key blocks; writes the split's normalized o and its lse (flash residuals).
  * `_partial_attention_pallas`: builds the grid, calls `pl.pallas_call`, and
    combines the splits with `ops.split_combine` (one small kernel; the math of
    `merge_partials`).
  * `partial_attention`: the public, validated entry point (`implementation=`
    switches between the Pallas kernel and the XLA path).
  * `partial_attention_reference`: plain jnp in float32, HIGHEST precision.

The cache is head-major [B, Hkv, S, D], or layer-stacked [L, B, Hkv, S, D] with
a (possibly traced) `layer`. The kernel receives the whole stacked buffer and
indexes it with the layer read from a scalar operand, so no per-layer slice is
ever copied (the `full` baseline carries the stacked cache through lax.scan).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
import numpy as np

from ops import _checks
from ops.merge import merge_partials
from ops.rows_attention import attend_rows
from ops.split_combine import combine_splits

_NEG_INF = float("-inf")
# Triton's tl.dot needs every tile dimension >= 16.
_MIN_TILE = 16
# Per-query-head rows read per kernel iteration (at most; fewer rows read fewer).
_ROWS_BLOCK = 32
# Programs to aim for when choosing the number of splits: a few waves of the
# H200's 132 SMs, so batch 1 with one long set still fills the device.
_TARGET_PROGRAMS = 512


def _pow2_floor(n: int) -> int:
  return 1 << (max(n, 1).bit_length() - 1)


def _pad_groups(g: int) -> int:
  return max(_MIN_TILE, pl.next_power_of_2(g))


def default_config(batch: int, kv_heads: int, seq_len: int, head_dim: int,
                   *, block_k: int | None = None, num_splits: int | None = None
                   ) -> tuple[int, int, int]:
  """Returns (block_k, num_splits, split_len) for a [batch, kv_heads, seq_len, head_dim] cache."""
  if block_k is None:
    # 64 measured best on the H200 at d=128 (ops/NOTES.md); at d=256 a K+V tile
    # pair is 64 KB, so two pipeline stages still fit in shared memory.
    block_k = 64
  block_k = max(_MIN_TILE, min(block_k, _pow2_floor(seq_len)))
  num_blocks = pl.cdiv(seq_len, block_k)
  if num_splits is None:
    num_splits = pl.cdiv(_TARGET_PROGRAMS, batch * kv_heads)
    # At least two blocks per split: each split costs a residual write and a prologue.
    num_splits = min(num_splits, pl.cdiv(num_blocks, 2))
  num_splits = max(1, min(num_splits, num_blocks))
  split_len = pl.cdiv(num_blocks, num_splits) * block_k
  num_splits = pl.cdiv(seq_len, split_len)
  return block_k, num_splits, split_len


@dataclasses.dataclass(frozen=True)
class _RowsLayout:
  """Static shape of the per-query-head rows a call folds in: `groups` query heads a KV head,
  `length` rows a head (>= block), read `block` at a time, one block a program from split
  `first_split` on (the splits before it hold the shared keys).

  Why programs of their own: folded into the shared keys' programs (a few blocks each, all of
  a group's heads in turn, float32 dots) the step took more GPU time than with the separate XLA
  ops, not less (H100, SmolLM2 shapes at 4K: 2.22 against 1.94 ms a step; with programs of their
  own 1.67 against 1.93; experiments/results/bench_step_contention_rows_*.md)."""
  groups: int
  length: int
  block: int
  first_split: int


def _visit_rows(
    q_ref,  # [Gp, D]: the KV head's query group (row g < groups: query head h * groups + g)
    rows_k_ref,  # [L, B, Hq, n, D]: every query head's own rows, indexed in place
    rows_v_ref,  # [L, B, Hq, n, D]
    rows_ids_ref,  # [L, B, Hq, n] int32: < 0 = an empty row
    carry,  # (acc [Gp, D], m [Gp], l [Gp]) float32: the online softmax so far
    *,
    layer,
    b,
    h,
    split,
    scale: float,
    rows: _RowsLayout,
):
  """Folds this program's block of the group's own rows (block split - first_split; none for the
  shared keys' splits) into the carry: query row g attends only query head h * groups + g's
  rows, at the shared keys' precision (storage dtype, float32 accumulation; HIGHEST for float32
  storage). A row's m may stay -inf (no valid row): the update shifts by 0 there, not NaN."""
  gp = q_ref.shape[0]
  dtype = rows_k_ref.dtype
  q = q_ref[...].astype(dtype)
  head_row = lax.broadcasted_iota(jnp.int32, (gp,), 0)
  precision = lax.Precision.HIGHEST if dtype == jnp.float32 else None
  n, br = rows.length, rows.block
  num_blocks = pl.cdiv(n, br)
  first = jnp.where(split >= rows.first_split, split - rows.first_split, num_blocks)
  last = jnp.minimum(first + 1, num_blocks)

  def body(i, carry):
    acc, m_prev, l_prev = carry
    nominal = i * br
    # A ragged last block is shifted back inside the buffer; rows before `nominal` were counted.
    blk = jnp.minimum(nominal, n - br) if n % br else pl.multiple_of(nominal, br)
    fresh = blk + lax.broadcasted_iota(jnp.int32, (br,), 0) >= nominal  # [br]
    s = jnp.full((gp, br), _NEG_INF, jnp.float32)
    values = []
    for g in range(rows.groups):  # static: a few heads a group
      head = h * rows.groups + g
      valid = fresh & (rows_ids_ref[layer, b, head, pl.ds(blk, br)] >= 0)  # [br]
      k = rows_k_ref[layer, b, head, pl.ds(blk, br), :]  # [br, D]
      s_g = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32) * scale  # [Gp, br]
      s = jnp.where((head_row == g)[:, None] & valid[None, :], s_g, s)
      v = rows_v_ref[layer, b, head, pl.ds(blk, br), :]
      values.append(jnp.where(valid[:, None], v, jnp.zeros_like(v)))  # an empty row's NaN cannot leak
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
    shift = jnp.where(m_next == _NEG_INF, 0.0, m_next)
    alpha = jnp.exp(m_prev - shift)
    p = jnp.exp(s - shift[:, None])  # [Gp, br]; exactly 0 off each row's own head
    acc = alpha[:, None] * acc
    for g, v in enumerate(values):
      acc = acc + jnp.dot(jnp.where((head_row == g)[:, None], p, 0.0).astype(dtype), v, precision=precision,
                          preferred_element_type=jnp.float32)
    return acc, m_next, alpha * l_prev + jnp.sum(p, axis=1)

  return lax.fori_loop(first, last, body, carry)  # one block, or none


def _kernel(
    layer_ref,  # [1] int32: layer of the stacked cache (0 when not stacked)
    starts_ref,  # [] int32: first valid key of this sequence
    lengths_ref,  # [] int32: one past the last valid key of this sequence
    starts2_ref,  # [] int32: a second interval [starts2, lengths2), disjoint from the first
    lengths2_ref,  # [] int32
    q_ref,  # [Gp, D]: this KV head's query group, padded to Gp rows
    k_ref,  # [L, B, Hkv, S, D]: the whole cache, indexed in place
    v_ref,  # [L, B, Hkv, S, D]
    *refs,  # with rows: rows_k_ref, rows_v_ref [L, B, Hq, n, D], rows_ids_ref [L, B, Hq, n]; then
    # o_ref [Gp, D] float32 (this split's normalized output), lse_ref [Gp] float32 (its log-sum-exp)
    scale: float,
    block_k: int,
    split_len: int,
    seq_len: int,
    second: bool,
    rows: _RowsLayout | None,
):
  b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  layer = layer_ref[0]
  o_ref, lse_ref = refs[-2:]

  gp, head_dim = q_ref.shape
  q = q_ref[...].astype(k_ref.dtype)  # [Gp, D]
  # Triton treats DEFAULT precision as TF32: ask for IEEE f32 when storage is f32.
  precision = lax.Precision.HIGHEST if k_ref.dtype == jnp.float32 else None
  ragged_tail = seq_len % block_k != 0

  def body(i, carry, *, start, length, masked: bool):
    acc, m_prev, l_prev = carry  # [Gp, D], [Gp], [Gp]
    nominal = i * block_k
    if masked and ragged_tail:
      # The last block is shifted back inside the buffer (no out-of-bounds
      # reads, no masked loads); keys before `nominal` were counted already.
      blk = jnp.minimum(nominal, seq_len - block_k)
    else:
      blk = pl.multiple_of(nominal, block_k)
    k = k_ref[layer, b, h, pl.ds(blk, block_k), :]  # [bk, D]
    v = v_ref[layer, b, h, pl.ds(blk, block_k), :]  # [bk, D]
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                        preferred_element_type=jnp.float32) * scale  # [Gp, bk]
    if masked:
      pos = blk + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
      valid = (pos >= jnp.maximum(start, nominal)) & (pos < length)  # [bk]
      s = jnp.where(valid[None, :], s, _NEG_INF)
      # Zero invalid rows of V so garbage (even NaN) outside the set cannot leak.
      v = jnp.where(valid[:, None], v, jnp.zeros_like(v))
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
    alpha = jnp.exp(m_prev - m_next)
    p = jnp.exp(s - m_next[:, None])  # [Gp, bk]
    l_next = alpha * l_prev + jnp.sum(p, axis=1)
    pv = jnp.dot(p.astype(v.dtype), v, precision=precision,
                 preferred_element_type=jnp.float32)
    return alpha[:, None] * acc + pv, m_next, l_next

  def visit(start, length, carry):
    """Folds this split's share of the keys [start, length) into the carry."""
    lo = jnp.maximum(start, split * split_len)
    hi = jnp.minimum(jnp.minimum(length, (split + 1) * split_len), seq_len)
    first = lo // block_k
    # Only blocks that hold at least one valid key are visited, so m stays finite.
    last = jnp.where(hi > lo, pl.cdiv(hi, block_k), first)
    masked_body = functools.partial(body, start=start, length=length, masked=True)
    # Only the first and last visited blocks can be partial: they take the masked
    # body; the interior loop runs mask-free (the hot path at long lengths).
    carry = lax.fori_loop(first, jnp.minimum(first + 1, last), masked_body, carry)
    interior_end = jnp.maximum(last - 1, first + 1)
    if ragged_tail:
      # A block that reaches past the buffer end must be shifted: keep it masked.
      interior_end = jnp.minimum(interior_end, seq_len // block_k)
    carry = lax.fori_loop(first + 1, interior_end,
                          functools.partial(body, start=start, length=length, masked=False), carry)
    return lax.fori_loop(jnp.maximum(interior_end, first + 1), last, masked_body, carry)

  acc = jnp.zeros((gp, head_dim), jnp.float32)
  m = jnp.full((gp,), _NEG_INF, jnp.float32)
  l = jnp.zeros((gp,), jnp.float32)
  acc, m, l = visit(starts_ref[()], lengths_ref[()], (acc, m, l))
  if second:  # (static: a one-interval call compiles without it)
    # A block both intervals touch is read twice, each time masked to its own interval.
    acc, m, l = visit(starts2_ref[()], lengths2_ref[()], (acc, m, l))
  if rows is not None:  # after the shared keys: their blocks leave every row's m finite or -inf alike
    acc, m, l = _visit_rows(q_ref, *refs[:3], (acc, m, l), layer=layer, b=b, h=h, split=split, scale=scale,
                            rows=rows)
  nonempty = l > 0
  o_ref[...] = jnp.where(nonempty[:, None], acc / jnp.where(nonempty, l, 1.0)[:, None], 0.0)
  lse_ref[...] = jnp.where(nonempty, m + jnp.log(jnp.where(nonempty, l, 1.0)), _NEG_INF)


@functools.partial(
    jax.jit,
    static_argnames=("scale", "block_k", "num_splits", "interpret", "num_warps", "num_stages", "second"))
def _partial_attention_pallas(
    q,  # [B, Hq, D]
    k,  # [L, B, Hkv, S, D]
    v,  # [L, B, Hkv, S, D]
    starts,  # [B] int32
    lengths,  # [B] int32
    starts2,  # [B] int32
    lengths2,  # [B] int32
    layer,  # [1] int32
    rows_k,  # [L, B, Hq, n, D] or None
    rows_v,  # [L, B, Hq, n, D] or None
    rows_ids,  # [L, B, Hq, n] int32 or None
    *,
    scale: float,
    block_k: int | None,
    num_splits: int | None,
    interpret: bool,
    num_warps: int | None,
    num_stages: int | None,
    second: bool,
):
  batch, q_heads, head_dim = q.shape
  _, _, kv_heads, seq_len, _ = k.shape
  if seq_len < _MIN_TILE:
    # Tiny buffers only (a copy of < 16 rows): pad so every tile is >= 16.
    pad = [(0, 0)] * 3 + [(0, _MIN_TILE - seq_len), (0, 0)]
    k, v = jnp.pad(k, pad), jnp.pad(v, pad)
    seq_len = _MIN_TILE
  groups = q_heads // kv_heads
  gp = _pad_groups(groups)
  block_k, num_splits, split_len = default_config(
      batch, kv_heads, seq_len, head_dim, block_k=block_k, num_splits=num_splits)
  qg = q.reshape(batch, kv_heads, groups, head_dim)
  if gp != groups:
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, gp - groups), (0, 0)))

  # The combine kernel reads all splits as one Triton block: a power of two. Programs past
  # the last real split find no keys and write empty residuals (lse = -inf). Rows get one
  # program a block after the shared keys' splits.
  rows = None
  row_operands, row_specs = (), []
  programs = num_splits
  if rows_k is not None:
    rows_k, rows_v, rows_ids = _pad_rows(rows_k, rows_v, rows_ids)
    n = rows_k.shape[3]
    rows = _RowsLayout(groups=groups, length=n, block=min(_ROWS_BLOCK, _pow2_floor(n)), first_split=num_splits)
    programs += pl.cdiv(n, rows.block)
    row_operands, row_specs = (rows_k, rows_v, rows_ids), [pl.no_block_spec] * 3
  grid_splits = pl.next_power_of_2(programs) if programs > 1 else 1
  kernel = functools.partial(
      _kernel, scale=scale, block_k=block_k, split_len=split_len, seq_len=seq_len, second=second, rows=rows)
  compiler_params = None
  if not interpret and jax.default_backend() == "gpu":
    from jax.experimental.pallas import triton as plgpu  # pylint: disable=g-import-not-at-top
    compiler_params = plgpu.CompilerParams(
        num_warps=num_warps or 4, num_stages=num_stages or 2)
  o, lse = pl.pallas_call(
      kernel,
      grid=(batch, kv_heads, grid_splits),
      in_specs=[
          pl.BlockSpec((1,), lambda b, h, s: (0,)),
          pl.BlockSpec((None,), lambda b, h, s: (b,)),
          pl.BlockSpec((None,), lambda b, h, s: (b,)),
          pl.BlockSpec((None,), lambda b, h, s: (b,)),
          pl.BlockSpec((None,), lambda b, h, s: (b,)),
          pl.BlockSpec((None, None, gp, head_dim), lambda b, h, s: (b, h, 0, 0)),
          pl.no_block_spec,
          pl.no_block_spec,
          *row_specs,
      ],
      out_specs=[
          pl.BlockSpec((None, None, None, gp, head_dim), lambda b, h, s: (b, h, s, 0, 0)),
          pl.BlockSpec((None, None, None, gp), lambda b, h, s: (b, h, s, 0)),
      ],
      out_shape=[
          jax.ShapeDtypeStruct((batch, kv_heads, grid_splits, gp, head_dim), jnp.float32),
          jax.ShapeDtypeStruct((batch, kv_heads, grid_splits, gp), jnp.float32),
      ],
      compiler_params=compiler_params,
      interpret=interpret,
      name=(f"kvjax_partial_attention_bk{block_k}_ns{grid_splits}" + ("_2iv" if second else "")
            + ("" if rows is None else f"_rows{rows.block}")),
  )(layer, starts, lengths, starts2, lengths2, qg, k, v, *row_operands)
  if grid_splits > 1:  # [B, Hkv, ns, Gp, D] -> [B, Hq, D]
    return combine_splits(o, lse, groups=groups, interpret=interpret)
  # One split is already normalized.
  o = o[:, :, 0, :groups].reshape(batch, q_heads, head_dim)
  lse = lse[:, :, 0, :groups].reshape(batch, q_heads)
  return o, lse


def _pad_rows(rows_k, rows_v, rows_ids):
  """Fewer rows a head than the smallest tile (16): padded with empty rows (a copy; tiny sets only)."""
  n = rows_k.shape[3]
  if n >= _MIN_TILE:
    return rows_k, rows_v, rows_ids
  pad = [(0, 0)] * 3 + [(0, _MIN_TILE - n)]
  return (jnp.pad(rows_k, pad + [(0, 0)]), jnp.pad(rows_v, pad + [(0, 0)]),
          jnp.pad(rows_ids, pad, constant_values=-1))


def _select_layer(x, layer):
  """x[layer] for a stacked cache; x unchanged otherwise."""
  if layer is None:
    return x
  return lax.dynamic_index_in_dim(x, layer, axis=0, keepdims=False)


@functools.partial(jax.jit, static_argnames=("scale",))
def _partial_attention_xla(
    q,  # [B, Hq, D]
    k,  # [B, Hkv, S, D] or [L, B, Hkv, S, D]
    v,  # same as k
    starts,  # [B] int32
    lengths,  # [B] int32
    starts2,  # [B] int32
    lengths2,  # [B] int32
    layer,  # [] int32 or None
    rows_k,  # [B, Hq, n, D] or [L, B, Hq, n, D], or None
    rows_v,  # same as rows_k
    rows_ids,  # [B, Hq, n] or [L, B, Hq, n] int32, or None
    *,
    scale: float,
):
  o, lse = _interval_attention_xla(q, _select_layer(k, layer), _select_layer(v, layer), starts, lengths, starts2,
                                   lengths2, scale=scale)
  if rows_k is None:
    return o, lse
  own = attend_rows(q, _select_layer(rows_k, layer), _select_layer(rows_v, layer), _select_layer(rows_ids, layer) >= 0,
                    scale=scale)
  return merge_partials([(o, lse), own])


def _interval_attention_xla(q, k, v, starts, lengths, starts2, lengths2, *, scale: float):  # k, v [B, Hkv, S, D]
  batch, q_heads, head_dim = q.shape
  _, kv_heads, seq_len, _ = k.shape
  groups = q_heads // kv_heads
  precision = lax.Precision.HIGHEST if k.dtype == jnp.float32 else None
  qg = q.reshape(batch, kv_heads, groups, head_dim).astype(k.dtype)
  # BKGD,BKSD->BKGS in the storage dtype, f32 accumulation (what the kernel does).
  s = jnp.einsum("bkgd,bksd->bkgs", qg, k, preferred_element_type=jnp.float32,
                 precision=precision) * scale
  valid = _in_intervals(seq_len, starts, lengths, starts2, lengths2)  # [B, S]
  s = jnp.where(valid[:, None, None, :], s, _NEG_INF)
  m = jnp.max(s, axis=-1)
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(s - m_safe[..., None])
  l = jnp.sum(p, axis=-1)
  v = jnp.where(valid[:, None, :, None], v, 0)  # a zero weight times a NaN / inf left in a free slot is NaN
  o = jnp.einsum("bkgs,bksd->bkgd", p.astype(v.dtype), v,
                 preferred_element_type=jnp.float32, precision=precision)
  o = jnp.where(l[..., None] > 0, o / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
  lse = jnp.where(l > 0, m_safe + jnp.log(jnp.where(l > 0, l, 1.0)), _NEG_INF)
  return o.reshape(batch, q_heads, head_dim), lse.reshape(batch, q_heads)


def _in_intervals(seq_len: int, starts, lengths, starts2, lengths2):
  """[B, seq_len] bool: position in [starts, lengths) or in [starts2, lengths2)."""
  pos = jnp.arange(seq_len, dtype=jnp.int32)[None, :]
  return (((pos >= starts[:, None]) & (pos < lengths[:, None]))
          | ((pos >= starts2[:, None]) & (pos < lengths2[:, None])))


def _check_rows(q, k, rows_k, rows_v, rows_ids) -> None:
  """The per-query-head rows: all three or none; [*lead, B, Hq, n, D] with k's leading axes."""
  given = [x is not None for x in (rows_k, rows_v, rows_ids)]
  if not any(given):
    return
  if not all(given):
    missing = [name for name, g in zip(("rows_k", "rows_v", "rows_ids"), given) if not g]
    raise ValueError(f"rows_k, rows_v and rows_ids go together; missing {missing}")
  _checks.check_float("rows_k", rows_k)
  _checks.check_float("rows_v", rows_v)
  _checks.check_int("rows_ids", rows_ids)
  lead = tuple(k.shape[:-3])  # (L, B) or (B,)
  layout = "[layers, batch, q_heads, rows, head_dim]" if len(lead) == 2 else "[batch, q_heads, rows, head_dim]"
  _checks.check_ndim("rows_k", rows_k, (k.ndim,), layout)
  n = rows_k.shape[-2]
  shape = lead + (q.shape[1], n, k.shape[-1])
  if n < 1:
    raise ValueError(f"rows_k.shape={tuple(rows_k.shape)}: needs at least one row a head")
  _checks.check_shape("rows_k", rows_k, shape, layout)
  _checks.check_shape("rows_v", rows_v, shape, layout)
  _checks.check_shape("rows_ids", rows_ids, shape[:-1], layout.replace(", head_dim]", "]"))


def _validate(q, k, v, lengths, starts, layer, implementation, starts2=None, lengths2=None):
  """Boundary checks; returns (num_layers or None, seq_len)."""
  _checks.check_implementation(implementation)
  num_layers, batch, _, seq_len, head_dim = _checks.check_query_and_cache(
      q, k, v, q_layout="[batch, q_heads, head_dim]", q_head_axis=1, layer=layer)
  if implementation == "pallas":
    _checks.check_pow2("head_dim", head_dim, _MIN_TILE, " for implementation='pallas' (use 'xla')")
  if (starts2 is None) != (lengths2 is None):
    raise ValueError("starts2 and lengths2 go together (a second key interval); got only "
                     f"{'starts2' if lengths2 is None else 'lengths2'}")
  for name, x in (("lengths", lengths), ("starts", starts), ("starts2", starts2), ("lengths2", lengths2)):
    if x is None:
      continue
    _checks.check_int(name, x)
    _checks.check_shape(name, x, (batch,), "[batch]")
    _checks.check_range(name, x, 0, seq_len)
  _check_disjoint(starts, lengths, starts2, lengths2)
  return num_layers, seq_len


def _check_disjoint(starts, lengths, starts2, lengths2) -> None:
  """The two intervals must not overlap (checked when concrete): the kernel counts a key in both
  twice, the XLA path and the reference once."""
  if starts2 is None:
    return
  values = [np.zeros((), np.int64) if starts is None else _checks.concrete_value(starts)]
  values += [_checks.concrete_value(x) for x in (lengths, starts2, lengths2)]
  if any(x is None for x in values):  # traced
    return
  s1, e1, s2, e2 = np.broadcast_arrays(*values)
  overlap = np.maximum(s1, s2) < np.minimum(e1, e2)
  if overlap.any():
    b = int(np.argmax(overlap))
    raise ValueError(f"sequence {b}: [starts, lengths) = [{s1[b]}, {e1[b]}) overlaps [starts2, lengths2) = "
                     f"[{s2[b]}, {e2[b]}): the two key intervals must be disjoint")


def _prepare(q, k, v, lengths, starts, layer, implementation, scale, starts2=None, lengths2=None):
  """Validated int32 (lengths, starts, starts2, lengths2) and the scale; an absent second
  interval is empty."""
  as_array = lambda x: None if x is None else _checks.index_array(x)
  lengths, starts, starts2, lengths2 = map(as_array, (lengths, starts, starts2, lengths2))
  _validate(q, k, v, lengths, starts, layer, implementation, starts2, lengths2)
  zeros = jnp.zeros((q.shape[0],), jnp.int32)
  as_int32 = lambda x: zeros if x is None else jnp.asarray(x, jnp.int32)
  scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
  return as_int32(lengths), as_int32(starts), as_int32(starts2), as_int32(lengths2), scale


def partial_attention(
    q: jax.Array,  # [B, Hq, D]
    k: jax.Array,  # [B, Hkv, S, D] or [L, B, Hkv, S, D]
    v: jax.Array,  # same as k
    lengths: jax.Array,  # [B] int32
    *,
    starts: jax.Array | None = None,  # [B] int32
    starts2: jax.Array | None = None,  # [B] int32
    lengths2: jax.Array | None = None,  # [B] int32
    layer: jax.Array | int | None = None,  # [] int32
    rows_k: jax.Array | None = None,  # [B, Hq, n, D] or [L, B, Hq, n, D]
    rows_v: jax.Array | None = None,  # same as rows_k
    rows_ids: jax.Array | None = None,  # [B, Hq, n] or [L, B, Hq, n] int32
    scale: float | None = None,
    implementation: str = "pallas",
    interpret: bool = False,
    block_k: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Attention of each sequence's query heads over its valid keys, as (o, lse).

  Keys at positions [starts[b], lengths[b]) (and [starts2[b], lengths2[b])) of sequence b are
  attended; query
  head h uses KV head h // G with G = Hq // Hkv. The Pallas kernel loads each
  KV block once for its whole query group and splits S across programs
  (flash-decoding), then merges the splits exactly.

  Args:
    q: [batch, q_heads, head_dim] queries (bf16/f16/f32).
    k: [batch, kv_heads, seq, head_dim] keys, or [layers, batch, kv_heads, seq,
      head_dim] with `layer`.
    v: values, same shape and dtype as k.
    lengths: [batch] int32, one past the last valid key (<= seq).
    starts: [batch] int32 first valid key (default 0), e.g. a sliding window.
    starts2, lengths2: [batch] int32, optional together: a second interval of keys
      [starts2, lengths2), disjoint from the first (checked when concrete), e.g. the
      sinks of a ring whose window wraps. One call instead of two and a merge.
    layer: int32 scalar (may be traced) selecting the layer of a stacked cache;
      the Pallas path indexes the stacked buffer in place (no slice copy).
    rows_k, rows_v, rows_ids: optional together: rows of each query head's own
      (retrieval's host-retrieved keys and values, [batch, q_heads, rows, head_dim],
      layer-stacked like k), attended beside the shared keys and merged exactly;
      a row whose id is < 0 is empty. The kernel splits them over its programs
      (no extra launch); the XLA path attends them apart (ops.rows_attention) and
      merges.
    scale: score scale; default head_dim ** -0.5.
    implementation: "pallas" (the kernel) or "xla" (fused jnp).
    interpret: run the Pallas kernel in interpret mode (CPU tests).
    block_k: keys per kernel iteration (power of two >= 16).
    num_splits: splits of seq per (sequence, KV head); default fills the GPU.
    num_warps: Triton warps per program (GPU only).
    num_stages: Triton software-pipelining stages (GPU only).

  Returns:
    o: [batch, q_heads, head_dim] float32, normalized over the set.
    lse: [batch, q_heads] float32 log-sum-exp of the scaled scores.
    An empty set gives o = 0 and lse = -inf.
  """
  second = starts2 is not None
  lengths, starts, starts2, lengths2, scale = _prepare(q, k, v, lengths, starts, layer, implementation, scale,
                                                       starts2, lengths2)
  _check_rows(q, k, rows_k, rows_v, rows_ids)
  if block_k is not None:
    _checks.check_pow2("block_k", block_k, _MIN_TILE)
  if num_splits is not None and num_splits < 1:
    raise ValueError(f"{num_splits=} must be >= 1")
  if implementation == "xla":
    layer_arr = None if layer is None else jnp.asarray(layer, jnp.int32)
    return _partial_attention_xla(q, k, v, starts, lengths, starts2, lengths2, layer_arr, rows_k, rows_v, rows_ids,
                                  scale=scale)
  if k.ndim == 4:
    k, v = k[None], v[None]  # a free reshape: L = 1
    if rows_k is not None:
      rows_k, rows_v, rows_ids = rows_k[None], rows_v[None], rows_ids[None]
    layer = 0
  layer_arr = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
  if rows_ids is not None:
    rows_ids = jnp.asarray(rows_ids, jnp.int32)
  return _partial_attention_pallas(
      q, k, v, starts, lengths, starts2, lengths2, layer_arr, rows_k, rows_v, rows_ids, scale=scale, block_k=block_k,
      num_splits=num_splits, interpret=interpret, num_warps=num_warps,
      num_stages=num_stages, second=second)


def partial_attention_reference(
    q: jax.Array,  # [B, Hq, D]
    k: jax.Array,  # [B, Hkv, S, D] or [L, B, Hkv, S, D]
    v: jax.Array,  # same as k
    lengths: jax.Array,  # [B] int32
    *,
    starts: jax.Array | None = None,  # [B] int32
    starts2: jax.Array | None = None,  # [B] int32
    lengths2: jax.Array | None = None,  # [B] int32
    layer: jax.Array | int | None = None,  # [] int32
    rows_k: jax.Array | None = None,  # [B, Hq, n, D] or [L, B, Hq, n, D]
    rows_v: jax.Array | None = None,  # same as rows_k
    rows_ids: jax.Array | None = None,  # [B, Hq, n] or [L, B, Hq, n] int32
    scale: float | None = None,
    implementation: str = "xla",
    interpret: bool = False,
    block_k: int | None = None,
    num_splits: int | None = None,
    **unused,
) -> tuple[jax.Array, jax.Array]:
  """Dense float32 (HIGHEST precision) twin of `partial_attention`; same contract.

  The kernel options (implementation, interpret, block_k, num_splits, ...)
  are accepted and ignored so both functions can be called with one kwargs dict.
  """
  del implementation, interpret, block_k, num_splits, unused
  lengths, starts, starts2, lengths2, scale = _prepare(q, k, v, lengths, starts, layer, "xla", scale,
                                                       starts2, lengths2)
  _check_rows(q, k, rows_k, rows_v, rows_ids)
  k, v = _select_layer(k, layer), _select_layer(v, layer)
  batch, q_heads, head_dim = q.shape
  _, kv_heads, seq_len, _ = k.shape
  groups = q_heads // kv_heads
  hp = lax.Precision.HIGHEST
  qg = q.astype(jnp.float32).reshape(batch, kv_heads, groups, head_dim)
  s = jnp.einsum("bkgd,bksd->bkgs", qg, k.astype(jnp.float32), precision=hp) * scale
  valid = _in_intervals(seq_len, starts, lengths, starts2, lengths2)[:, None, None, :]  # [B, 1, 1, S]
  v32 = v.astype(jnp.float32)[:, :, None]  # [B, Hkv, 1, S, D]: shared by the group
  if rows_k is not None:  # each query head's own rows join its set: one softmax over the union
    rk, rv, rids = (_select_layer(x, layer) for x in (rows_k, rows_v, rows_ids))
    own_shape = (batch, kv_heads, groups, rk.shape[2])
    s_own = jnp.einsum("bkgd,bkgnd->bkgn", qg, rk.astype(jnp.float32).reshape(*own_shape, head_dim),
                       precision=hp) * scale
    s = jnp.concatenate([s, s_own], axis=-1)
    valid = jnp.concatenate([jnp.broadcast_to(valid, own_shape[:3] + (seq_len,)), (rids >= 0).reshape(own_shape)],
                            axis=-1)
    v32 = jnp.concatenate([jnp.broadcast_to(v32, own_shape[:3] + (seq_len, head_dim)),
                           rv.astype(jnp.float32).reshape(*own_shape, head_dim)], axis=-2)
  s = jnp.where(valid, s, _NEG_INF)
  lse = jax.nn.logsumexp(s, axis=-1)  # -inf for an empty set
  p = jnp.where(valid, jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)
  v32 = jnp.where(valid[..., None], v32, 0.0)
  o = jnp.einsum("bkgs,bkgsd->bkgd", p, v32, precision=hp)  # g broadcasts when v32's is 1
  return o.reshape(batch, q_heads, head_dim), lse.reshape(batch, q_heads)
