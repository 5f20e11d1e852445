"""Attention of each query head over a few rows of its own (jnp, float32 at HIGHEST precision).

Retrieval's per_step decode attends, beside the shared device window, the rows the host
retrieved for each query head ([B, Hq, n, D]: every head its own top-k). This is their XLA
path; `ops.partial_attention(..., rows_k=, rows_v=, rows_ids=)` folds the same rows into its
Pallas kernel instead (one launch a layer, not a handful).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def shared_rows_attention(
    q,  # [B, H, G, D]: G queries sharing each H's rows
    k,  # [B, H, n, D]
    v,  # [B, H, n, D]
    valid,  # [B, H, n] bool
    *,
    scale: float,
):
  """-> (o [B, H, G, D] f32, lse [B, H, G] f32); no valid row: o = 0, lse = -inf (the merge's empty partial)."""
  exact = jax.lax.Precision.HIGHEST  # a few rows per head: no reason to let a GPU drop to TF32
  scores = jnp.einsum("bhgd,bhnd->bhgn", q.astype(jnp.float32), k.astype(jnp.float32), precision=exact) * scale
  scores = jnp.where(valid[:, :, None], scores, -jnp.inf)
  peak = jnp.max(scores, axis=-1, keepdims=True)
  peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
  weights = jnp.exp(scores - peak)  # exactly 0 where invalid
  total = jnp.sum(weights, axis=-1)
  v = jnp.where(valid[..., None], v.astype(jnp.float32), 0.0)  # a zero weight times an empty row's NaN is NaN
  o = (jnp.einsum("bhgn,bhnd->bhgd", weights, v, precision=exact)
       / jnp.maximum(total, 1e-30)[..., None])
  lse = jnp.where(total > 0, jnp.log(jnp.maximum(total, 1e-30)) + peak[..., 0], -jnp.inf)
  return o, lse


def attend_rows(
    q,  # [B, H, D] one query per head
    k,  # [B, H, n, D] each head's own rows
    v,  # [B, H, n, D]
    valid,  # [B, H, n] bool
    *,
    scale: float,
):
  """Attention of each head's query over its own few rows -> (o [B, H, D] f32, lse [B, H] f32);
  a head with no valid row gets o = 0 and lse = -inf (the merge's empty partial)."""
  o, lse = shared_rows_attention(q[:, :, None], k, v, valid, scale=scale)
  return o[:, :, 0], lse[:, :, 0]
