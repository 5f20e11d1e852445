"""`generate()`: prompts in, text out, with the timings a long-context user asks for first."""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import engine
from kvjax.policies import AttentionPolicy, make_policy
from kvjax.sampling import SamplingConfig
from models.config import ModelConfig
from models.rope import rope_tables

# Capacity is rounded up so that a few different prompt lengths share one compiled program.
CAPACITY_MULTIPLE = 256


@dataclasses.dataclass
class GenerationResult:
  """What one generate() call produced and what it cost.

  Attributes:
    texts: decoded continuations (None for a model without a tokenizer).
    tokens: generated ids per sequence, stop token excluded.
    prompt_lengths: tokens per prompt.
    prefill_seconds: wall time of the whole prefill (compilation included on a first call).
    decode_seconds: per-step wall times (the first step, which compiles, is dropped when
      there is more than one).
    policy: the policy description.
    kv_bytes: bytes of the policy state on the device.
    peak_device_bytes: the device allocator's peak, where the backend reports it.
    logits: per-step logits [steps, batch, vocab] when asked for (return_logits=True).
    policy_stats: the policy's counters (host time, speculation rates...), {} for device-only.
  """

  texts: list[str] | None
  tokens: list[list[int]]
  prompt_lengths: list[int]
  prefill_seconds: float
  decode_seconds: list[float]
  policy: str
  kv_bytes: int
  peak_device_bytes: int | None
  logits: np.ndarray | None = None
  policy_stats: dict = dataclasses.field(default_factory=dict)

  @property
  def ms_per_token(self) -> float:
    return 1e3 * statistics.median(self.decode_seconds) if self.decode_seconds else math.nan

  @property
  def prefill_tokens_per_second(self) -> float:
    return sum(self.prompt_lengths) / self.prefill_seconds


def _encode_prompts(model, prompts, *, chat: bool | None) -> list[list[int]]:
  if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
    prompts = [prompts]
  if not prompts:
    raise ValueError("prompts is empty")
  encoded = []
  for prompt in prompts:
    if isinstance(prompt, str):
      if model.tokenizer is None:
        raise ValueError(f"model {model.cfg.name!r} has no tokenizer: pass token ids, not text")
      use_chat = model.tokenizer.has_chat_template if chat is None else chat
      if use_chat:
        prompt = model.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        ids = model.tokenizer.encode(prompt, add_bos=False)
      else:
        ids = model.tokenizer.encode(prompt)
    else:
      ids = [int(t) for t in prompt]
    if not ids:
      raise ValueError(f"prompt {len(encoded)} is empty")
    bad = [t for t in ids if not 0 <= t < model.cfg.vocab_size]
    if bad:
      raise ValueError(f"prompt {len(encoded)} has token ids outside [0, {model.cfg.vocab_size}): {bad[:5]}")
    encoded.append(ids)
  return encoded


def check_context(cfg: ModelConfig, prompt_len: int, max_new_tokens: int) -> None:
  """Refuses a run past the trained context unless RoPE scaling extends it."""
  limit = cfg.max_context()
  if prompt_len + max_new_tokens > limit:
    hint = "" if cfg.rope_scaling else " (pass rope_scaling / --rope_scaling to extend it)"
    raise ValueError(
        f"prompt of {prompt_len} tokens + max_new_tokens={max_new_tokens} exceeds the context of "
        f"{cfg.name} ({limit} tokens){hint}")


def _device_peak_bytes() -> int | None:
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use")


def _state_bytes(state) -> int:
  return sum(x.nbytes for x in jax.tree_util.tree_leaves(state))


def generate(
    model,
    prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
    *,
    max_new_tokens: int = 64,
    policy: str | AttentionPolicy = "full",
    policy_options: dict[str, Any] | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    stop_tokens: Sequence[int] | None = None,
    chat: bool | None = None,
    prefill_chunk: int = 1024,
    return_logits: bool = False,
    on_prefill_progress: Callable[[int, int], None] | None = None,
) -> GenerationResult:
  """Generates continuations of one or several prompts.

  Args:
    model: a `models.registry.LoadedModel` (anything with cfg, params, tokenizer).
    prompts: a string, a list of strings, a list of token ids, or a list of such lists.
      Prompts may differ in length (batch with per-sequence lengths).
    max_new_tokens: tokens to generate per sequence (stop tokens end a sequence earlier).
    policy: attention policy name or object (see kvjax.policies).
    policy_options: keyword options of the named policy.
    temperature, top_p: sampling (temperature 0 is greedy).
    seed: PRNG seed of the sampler.
    stop_tokens: ids that end a sequence; default: the tokenizer's end-of-turn ids.
    chat: wrap string prompts in the model's chat template; default: when it has one.
    prefill_chunk: prompt tokens per prefill step (bounds activation memory).
    return_logits: keep every step's logits [steps, batch, vocab] (for tests and studies).
    on_prefill_progress: called with (tokens done, tokens total) after each chunk.
  """
  if max_new_tokens < 1:
    raise ValueError(f"{max_new_tokens=} must be >= 1")
  if prefill_chunk < 1:
    raise ValueError(f"{prefill_chunk=} must be >= 1")
  sampling = SamplingConfig(temperature=temperature, top_p=top_p)
  attention = make_policy(policy, **(policy_options or {}))
  cfg = model.cfg
  encoded = _encode_prompts(model, prompts, chat=chat)
  lengths = [len(ids) for ids in encoded]
  check_context(cfg, max(lengths), max_new_tokens)
  if stop_tokens is None:
    stop_tokens = sorted(model.tokenizer.eos_ids) if model.tokenizer is not None else []
  stop = set(int(t) for t in stop_tokens)

  batch = len(encoded)
  padded_len = -(-max(lengths) // prefill_chunk) * prefill_chunk
  capacity = max(padded_len, max(lengths) + max_new_tokens)
  capacity = -(-capacity // CAPACITY_MULTIPLE) * CAPACITY_MULTIPLE
  dtype = jnp.dtype(cfg.dtype)
  rope = tuple(jnp.asarray(t) for t in rope_tables(cfg, capacity))

  tokens = np.zeros((batch, padded_len), np.int32)
  for b, ids in enumerate(encoded):
    tokens[b, : len(ids)] = ids
  state = attention.init_state(cfg, batch, capacity, dtype)
  release = attention.release_fn(state)
  try:
    return _run(model, attention, sampling, state, tokens, lengths, capacity, rope, stop, max_new_tokens=max_new_tokens,
                seed=seed, prefill_chunk=prefill_chunk, return_logits=return_logits,
                on_prefill_progress=on_prefill_progress)
  finally:
    release()


def _run(model, attention, sampling, state, tokens, lengths, capacity, rope, stop, *, max_new_tokens, seed,
         prefill_chunk, return_logits, on_prefill_progress):
  cfg = model.cfg
  batch, padded_len = tokens.shape
  dtype = jnp.dtype(cfg.dtype)
  last_index = jnp.asarray(np.asarray(lengths, np.int32) - 1)
  state = attention.begin_prefill(cfg, state, np.asarray(lengths, np.int32))
  last_hidden = jnp.zeros((batch, cfg.hidden_size), dtype)

  start = time.perf_counter()
  for begin in range(0, padded_len, prefill_chunk):
    chunk = jnp.asarray(tokens[:, begin : begin + prefill_chunk])
    positions = jnp.broadcast_to(jnp.arange(begin, begin + prefill_chunk, dtype=jnp.int32), chunk.shape)
    last_hidden, state = engine.prefill_chunk(
        model.params, rope, chunk, positions, last_index, last_hidden, state, cfg=cfg, policy=attention)
    if on_prefill_progress is not None:
      jax.block_until_ready(last_hidden)
      on_prefill_progress(min(begin + prefill_chunk, max(lengths)), max(lengths))
  state = attention.finish_prefill(cfg, state)
  key = jax.random.key(seed)
  key, sub = jax.random.split(key)
  next_tokens, logits = engine.first_token(model.params, last_hidden, sub, cfg=cfg, sampling=sampling)
  next_tokens = np.asarray(next_tokens)
  prefill_seconds = time.perf_counter() - start

  generated: list[list[int]] = [[] for _ in range(batch)]
  done = np.zeros(batch, bool)
  step_logits = [np.asarray(logits)] if return_logits else []
  step_seconds = []
  positions = np.asarray(lengths, np.int32)
  for step in range(max_new_tokens):
    for b in range(batch):
      if not done[b]:
        if int(next_tokens[b]) in stop:
          done[b] = True
        else:
          generated[b].append(int(next_tokens[b]))
    if done.all() or step == max_new_tokens - 1:
      break
    t0 = time.perf_counter()
    key, sub = jax.random.split(key)
    out, logits, state = engine.decode_step(
        model.params, rope, jnp.asarray(next_tokens), jnp.asarray(positions), state, sub,
        cfg=cfg, policy=attention, sampling=sampling)
    next_tokens = np.asarray(out)  # waits for the step
    attention.check(state)
    step_seconds.append(time.perf_counter() - t0)
    if return_logits:
      step_logits.append(np.asarray(logits))
    positions = positions + 1

  texts = None
  if model.tokenizer is not None:
    texts = [model.tokenizer.decode(ids) for ids in generated]
  return GenerationResult(
      texts=texts,
      tokens=generated,
      prompt_lengths=lengths,
      prefill_seconds=prefill_seconds,
      decode_seconds=step_seconds[1:] if len(step_seconds) > 1 else step_seconds,
      policy=attention.describe(),
      kv_bytes=_state_bytes(state),
      peak_device_bytes=_device_peak_bytes(),
      logits=np.stack(step_logits) if return_logits else None,
      policy_stats=attention.stats(state),
  )
