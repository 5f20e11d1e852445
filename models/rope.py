"""Rotary position embeddings (rotate-half convention) with the common scalings.

Frequencies are computed once per layer in NumPy (float64, then float32, as transformers
does in float32) and passed to the decoder as a [num_layers, head_dim // 2] table, so
Gemma 3's local and global layers can use different bases inside one `lax.scan`.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig, RopeScaling


def _base_inv_freq(theta: float, head_dim: int) -> np.ndarray:
  exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim
  return (1.0 / (theta ** exponents)).astype(np.float32)  # [head_dim // 2]


def _yarn(theta: float, head_dim: int, s: RopeScaling) -> tuple[np.ndarray, float]:
  def correction_dim(rotations: float) -> float:
    return head_dim * math.log(s.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))

  low = max(math.floor(correction_dim(s.beta_fast)), 0)
  high = min(math.ceil(correction_dim(s.beta_slow)), head_dim - 1)
  if low == high:
    high += 0.001  # avoid a zero-width ramp
  ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
  extrapolation_weight = 1 - ramp
  base = _base_inv_freq(theta, head_dim)
  inv_freq = (base / s.factor) * (1 - extrapolation_weight) + base * extrapolation_weight
  attention_factor = s.attention_factor
  if attention_factor is None:
    attention_factor = 0.1 * math.log(s.factor) + 1.0 if s.factor > 1 else 1.0
  return inv_freq.astype(np.float32), float(attention_factor)


def _llama3(theta: float, head_dim: int, s: RopeScaling) -> np.ndarray:
  inv_freq = _base_inv_freq(theta, head_dim)
  low_freq_wavelen = s.original_max_position / s.low_freq_factor
  high_freq_wavelen = s.original_max_position / s.high_freq_factor
  wavelen = 2 * math.pi / inv_freq
  scaled = np.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
  smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
  smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
  medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def inv_freq_for(theta: float, head_dim: int, scaling: RopeScaling | None, context_len: int) -> tuple[np.ndarray, float]:
  """Inverse frequencies [head_dim // 2] and the cos/sin multiplier for one layer.

  Args:
    theta: RoPE base.
    head_dim: rotated dimension.
    scaling: None for plain RoPE.
    context_len: the longest sequence the run is prepared for; only "dynamic" uses it
      (the NTK base grows once, for this length, instead of per step as in transformers,
      so the jitted decode step keeps static frequencies).
  """
  if scaling is None:
    return _base_inv_freq(theta, head_dim), 1.0
  if scaling.kind == "linear":
    return _base_inv_freq(theta, head_dim) / np.float32(scaling.factor), 1.0
  if scaling.kind == "dynamic":
    if context_len <= scaling.original_max_position:
      return _base_inv_freq(theta, head_dim), 1.0
    growth = scaling.factor * context_len / scaling.original_max_position - (scaling.factor - 1)
    return _base_inv_freq(theta * growth ** (head_dim / (head_dim - 2)), head_dim), 1.0
  if scaling.kind == "yarn":
    return _yarn(theta, head_dim, scaling)
  return _llama3(theta, head_dim, scaling), 1.0


def rope_tables(cfg: ModelConfig, context_len: int) -> tuple[np.ndarray, np.ndarray]:
  """Per-layer inverse frequencies [num_layers, head_dim // 2] and multipliers [num_layers]."""
  freqs, factors = [], []
  for window in cfg.layer_windows:
    local = window > 0 and cfg.rope_local_theta is not None
    theta = cfg.rope_local_theta if local else cfg.rope_theta
    inv_freq, factor = inv_freq_for(theta, cfg.head_dim, None if local else cfg.rope_scaling, context_len)
    freqs.append(inv_freq)
    factors.append(factor)
  return np.stack(freqs), np.asarray(factors, np.float32)


def apply_rope(
    x,  # [batch, seq, heads, head_dim]
    positions,  # [batch, seq] int32
    inv_freq,  # [head_dim // 2] float32
    factor,  # [] float32: yarn's attention factor, 1 otherwise
):
  """Rotates `x` by its absolute positions (rotate-half layout: pairs (i, i + D/2))."""
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
  cos = (jnp.cos(angles) * factor)[:, :, None, :]
  sin = (jnp.sin(angles) * factor)[:, :, None, :]
  x32 = x.astype(jnp.float32)
  x1, x2 = jnp.split(x32, 2, axis=-1)
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return rotated.astype(x.dtype)
