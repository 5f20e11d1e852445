"""One small Pallas kernel that combines a split-K decode kernel's per-split residuals.

The decode kernels (partial_attention, paged_partial_attention) split each (sequence, KV
head) over `ns` programs and write per-split residuals [B, Hkv, ns, Gp, D] / [B, Hkv, ns, Gp]
for a query group padded to Gp rows (Triton's dot needs 16). Combining them with
`merge_stacked` in jnp compiles to about six XLA kernels (max, exp, select, multiply, two
reductions) plus a slice dropping the padded rows: ~10 µs of device time and six launches per
layer and step on the H200 (experiments/results/profile_decode_*.md), as much as the whole
attention of a 2K-token set. This kernel does the same exact LSE merge in one launch, reading
only the group's real rows, as an online merge over the splits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

_NEG_INF = float("-inf")


def _combine_kernel(
    o_ref,  # [ns, Gc, D] float32: per-split outputs, each normalized over its split
    lse_ref,  # [ns, Gc] float32: per-split log-sum-exp (-inf: empty split)
    out_o_ref,  # [Gc, D] float32
    out_lse_ref,  # [Gc] float32
    *,
    num_splits: int,
):
  rows, head_dim = out_o_ref.shape

  def body(i, carry):
    acc, m, l = carry  # [Gc, D], [Gc], [Gc]: acc and l relative to exp(m)
    lse_i = lse_ref[i, :]
    m_next = jnp.maximum(m, lse_i)
    shift = jnp.where(jnp.isfinite(m_next), m_next, 0.0)  # all-empty so far: exp(-inf) = 0
    alpha = jnp.exp(m - shift)
    w = jnp.exp(lse_i - shift)
    # An empty split's o is ignored even if it holds NaN.
    o_i = jnp.where(w[:, None] > 0, o_ref[i, :, :], 0.0)
    return alpha[:, None] * acc + w[:, None] * o_i, m_next, alpha * l + w

  init = (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), _NEG_INF, jnp.float32),
          jnp.zeros((rows,), jnp.float32))
  acc, m, l = lax.fori_loop(0, num_splits, body, init)
  nonempty = l > 0
  safe_l = jnp.where(nonempty, l, 1.0)
  out_o_ref[...] = jnp.where(nonempty[:, None], acc / safe_l[:, None], 0.0)
  out_lse_ref[...] = jnp.where(nonempty, jnp.where(jnp.isfinite(m), m, 0.0) + jnp.log(safe_l), _NEG_INF)


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
  out_o, out_lse = pl.pallas_call(
      functools.partial(_combine_kernel, num_splits=num_splits),
      grid=(batch, kv_heads),
      in_specs=[
          pl.BlockSpec((None, None, num_splits, rows, head_dim), lambda b, h: (b, h, 0, 0, 0)),
          pl.BlockSpec((None, None, num_splits, rows), lambda b, h: (b, h, 0, 0)),
      ],
      out_specs=[
          pl.BlockSpec((None, None, rows, head_dim), lambda b, h: (b, h, 0, 0)),
          pl.BlockSpec((None, None, rows), lambda b, h: (b, h, 0)),
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
