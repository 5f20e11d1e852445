"""One small Pallas kernel that combines a split-K decode kernel's per-split residuals.

The decode kernels (partial_attention, paged_partial_attention) split each (sequence, KV
head) over `ns` programs and write per-split residuals [B, Hkv, ns, Gp, D] / [B, Hkv, ns, Gp]
for a query group padded to Gp rows (Triton's dot needs 16). Combining them with
`merge_stacked` in jnp compiles to about six XLA kernels (max, exp, select, multiply, two
reductions) plus a slice dropping the padded rows: ~10 µs of device time and six launches per
layer and step on the H200 (experiments/results/profile_decode_*.md), as much as the whole
attention of a 2K-token set. This kernel does the same exact LSE merge in one launch, reading
only the group's real rows. Its programs split head_dim as well as (sequence, KV head): a
first version with one program per (sequence, KV head) looping over the splits took 18 µs
per call at batch 1 (8 programs, latency-bound), slower than the XLA kernels it replaced.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

_NEG_INF = float("-inf")
# f32 elements of a program's o tile (32 KB: 64 registers per thread at 4 warps), and the
# smallest head_dim block (a power of two; head_dim is one too).
_TILE_ELEMENTS = 8192
_MIN_D_BLOCK = 16


def _combine_kernel(
    o_ref,  # [ns, Gc, Dc] float32: per-split outputs, each normalized over its split
    lse_ref,  # [ns, Gc] float32: per-split log-sum-exp (-inf: empty split)
    out_o_ref,  # [Gc, Dc] float32
    out_lse_ref,  # [Gc] float32 (every head_dim block writes the same values)
):
  lse = lse_ref[...]
  m = jnp.max(lse, axis=0)  # [Gc]
  shift = jnp.where(jnp.isfinite(m), m, 0.0)  # all splits empty: exp(-inf) = 0
  w = jnp.exp(lse - shift[None, :])  # [ns, Gc]
  total = jnp.sum(w, axis=0)
  # An empty split's o is ignored even if it holds NaN.
  o = jnp.where(w[:, :, None] > 0, o_ref[...], 0.0)
  acc = jnp.sum(w[:, :, None] * o, axis=0)  # [Gc, Dc]
  nonempty = total > 0
  safe_total = jnp.where(nonempty, total, 1.0)
  out_o_ref[...] = jnp.where(nonempty[:, None], acc / safe_total[:, None], 0.0)
  out_lse_ref[...] = jnp.where(nonempty, shift + jnp.log(safe_total), _NEG_INF)


def combined_rows(groups: int) -> int:
  """Rows of the query group the combine reads: the group rounded up to a power of two."""
  return pl.next_power_of_2(groups)


@functools.partial(jax.jit, static_argnames=("groups", "interpret"))
def combine_splits(
    o,  # [B, Hkv, ns, Gp, D] float32; ns a power of two
    lse,  # [B, Hkv, ns, Gp] float32
    *,
    groups: int,
    interpret: bool = False,
):
  """Exact LSE merge over the split axis, dropping padded group rows.

  Returns (o [B, Hkv * groups, D] float32, lse [B, Hkv * groups] float32); a (sequence,
  head) whose splits are all empty gets o = 0 and lse = -inf. Same math as
  `ops.merge.merge_stacked(o, lse, axis=2)[..., :groups, ...]`.
  """
  batch, kv_heads, num_splits, gp, head_dim = o.shape
  rows = combined_rows(groups)
  assert rows <= gp and gp % rows == 0, (groups, gp)
  assert num_splits == pl.next_power_of_2(num_splits), num_splits  # Triton block shapes
  assert head_dim == pl.next_power_of_2(head_dim), head_dim
  # head_dim blocks small enough that a program's [ns, Gc, Dc] tile stays in registers.
  d_block = max(_MIN_D_BLOCK, min(head_dim, _TILE_ELEMENTS // (num_splits * rows)))
  out_o, out_lse = pl.pallas_call(
      _combine_kernel,
      grid=(batch, kv_heads, head_dim // d_block),
      in_specs=[
          pl.BlockSpec((None, None, num_splits, rows, d_block), lambda b, h, d: (b, h, 0, 0, d)),
          pl.BlockSpec((None, None, num_splits, rows), lambda b, h, d: (b, h, 0, 0)),
      ],
      out_specs=[
          pl.BlockSpec((None, None, rows, d_block), lambda b, h, d: (b, h, 0, d)),
          pl.BlockSpec((None, None, rows), lambda b, h, d: (b, h, 0)),
      ],
      out_shape=[
          jax.ShapeDtypeStruct((batch, kv_heads, rows, head_dim), jnp.float32),
          jax.ShapeDtypeStruct((batch, kv_heads, rows), jnp.float32),
      ],
      interpret=interpret,
      name=f"kvjax_combine_splits_ns{num_splits}",
  )(o, lse)
  if rows != groups:  # a group that is not a power of two (e.g. SmolLM2's 3): one slice
    out_o, out_lse = out_o[:, :, :groups], out_lse[:, :, :groups]
  return out_o.reshape(batch, kv_heads * groups, head_dim), out_lse.reshape(batch, kv_heads * groups)
