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
  logits = logits.astype(jnp.float32) / config.temperature
  if config.top_p < 1.0:
    sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # mass of strictly better tokens
    kept = mass_before < config.top_p  # always keeps the best token
    threshold = jnp.min(jnp.where(kept, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits >= threshold, logits, -jnp.inf)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
