"""Exact log-sum-exp merge of partial attention results `(o, lse)`.

This is the only place partials are combined: the splits of one kernel, the
device and host halves of a decode step, and any chunked computation.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp


def merge_stacked(
    o: jax.Array,  # [..., P, ..., D]: P partials along `axis`
    lse: jax.Array,  # [..., P, ...]: same shape as o without the trailing D
    *,
    axis: int,
) -> tuple[jax.Array, jax.Array]:
  """Merges partials stacked along `axis` (of `lse`; o has a trailing D).

  Args:
    o: [..., P, ..., head_dim] outputs, each normalized over its own set.
    lse: [..., P, ...] log-sum-exp of each partial's scaled scores; -inf marks
      an empty partial (its o is ignored, even if it holds NaN).
    axis: the partial axis, counted on `lse`.

  Returns:
    (o [..., head_dim] float32, lse [...] float32), the partial axis removed.
    All-empty gives o = 0 and lse = -inf, never NaN.
  """
  o = o.astype(jnp.float32)
  lse = lse.astype(jnp.float32)
  axis = axis % lse.ndim
  m = jnp.max(lse, axis=axis, keepdims=True)
  # An all-empty row has m = -inf; shift by 0 there so exp() stays 0, not NaN.
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  w = jnp.exp(lse - m_safe)  # [..., P, ...]; 0 for empty partials
  total = jnp.sum(w, axis=axis)
  lse_out = jnp.squeeze(m_safe, axis) + jnp.log(total)  # log(0) = -inf
  o_w = jnp.where(w[..., None] > 0, o, 0.0) * w[..., None]
  o_sum = jnp.sum(o_w, axis=axis)
  o_out = jnp.where(total[..., None] > 0, o_sum / jnp.where(total > 0, total, 1.0)[..., None], 0.0)
  return o_out, lse_out


def merge_partials(
    parts: Sequence[tuple[jax.Array, jax.Array]],
) -> tuple[jax.Array, jax.Array]:
  """Exact LSE merge of any number of partial attention results.

  `o = Σ_i exp(lse_i − lse) · o_i` with `lse = logsumexp_i lse_i`.

  Args:
    parts: a non-empty sequence of (o, lse) pairs, all of the same shapes:
      o [..., head_dim] (normalized over its own set), lse [...] float32.
      Typically o [batch, q_heads, head_dim] and lse [batch, q_heads].
      Empty partials (lse = -inf) contribute nothing.

  Returns:
    (o [..., head_dim] float32, lse [...] float32). If every partial is
    empty, o = 0 and lse = -inf (never NaN).
  """
  parts = list(parts)
  if not parts:
    raise ValueError(f"{parts=} must hold at least one (o, lse) pair")
  o0, lse0 = parts[0]
  for i, (o, lse) in enumerate(parts):
    if o.shape != o0.shape or lse.shape != lse0.shape:
      raise ValueError(
          f"parts[{i}] shapes o={tuple(o.shape)}, lse={tuple(lse.shape)} differ from "
          f"parts[0] o={tuple(o0.shape)}, lse={tuple(lse0.shape)}")
    if o.shape[:-1] != lse.shape:
      raise ValueError(
          f"parts[{i}]: o.shape={tuple(o.shape)} must be lse.shape={tuple(lse.shape)} + (head_dim,)")
  if len(parts) == 1:
    o, lse = parts[0]
    o, lse = o.astype(jnp.float32), lse.astype(jnp.float32)
    # Normalize the empty convention even for a single partial.
    return jnp.where(jnp.isneginf(lse)[..., None], 0.0, o), lse
  o = jnp.stack([p[0] for p in parts], axis=0)  # [P, ..., D]
  lse = jnp.stack([p[1] for p in parts], axis=0)  # [P, ...]
  return merge_stacked(o, lse, axis=0)
