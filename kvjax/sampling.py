"""Token sampling: greedy, temperature and nucleus (top-p), reproducible from a seed."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax import checks


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """temperature 0 is greedy; top_p 1 disables nucleus filtering."""

  temperature: float = 0.0
  top_p: float = 1.0

  def __post_init__(self):
    checks.real(self.temperature, "temperature", low=0.0)  # inf would sample uniformly
    if not 0 < checks.real(self.top_p, "top_p") <= 1:
      raise ValueError(f"top_p={self.top_p} must be in (0, 1]")


def sample(
    logits,  # [batch, vocab] float32
    key,  # PRNG key
    config: SamplingConfig,
):
  """Returns [batch] int32 token ids."""
  if config.temperature == 0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  # Shifted to a best of 0 and multiplied by 1 / T, a Python float: a tiny T overflowed the raw
  # logits to tied infinities, and float32 flushes a T below 1.2e-38 to 0 (0 / 0 = NaN).
  shifted = logits.astype(jnp.float32) - jnp.max(logits, axis=-1, keepdims=True).astype(jnp.float32)
  logits = jnp.where(shifted == 0, 0.0, shifted * (1.0 / config.temperature))
  if config.top_p < 1.0:
    order = jnp.argsort(-logits, axis=-1, stable=True)  # best first; ties by id
    probs = jax.nn.softmax(jnp.take_along_axis(logits, order, axis=-1), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # mass of the tokens ranked before
    kept = mass_before < config.top_p  # always keeps the best token
    # Kept by rank, not by a logit threshold: tokens tied with the last one kept stay out.
    kept = jnp.take_along_axis(kept, jnp.argsort(order, axis=-1), axis=-1)
    logits = jnp.where(kept, logits, -jnp.inf)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
