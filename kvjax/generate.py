"""Prompts in, text out: `prefill()` builds a context, `decode()` continues it, `generate()`
does both. A prefilled context can be saved and loaded (kvjax.context_cache), so decode
never waits for a second prefill."""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import checks, engine
from kvjax.policies import AttentionPolicy, make_policy
from kvjax.sampling import SamplingConfig
from kvjax.sharding import ShardedPolicy, replicated
from models.config import ModelConfig
from models.decoder import weights_fingerprint
from models.rope import rope_tables

# Capacity is rounded up so that a few different prompt lengths share one compiled program.
CAPACITY_MULTIPLE = 256


def round_capacity(tokens: int, policy: AttentionPolicy) -> int:
  """`tokens` rounded up to a multiple of CAPACITY_MULTIPLE and of the policy's `capacity_multiple`
  (a quest page of 48 tokens never divided a multiple of 256 alone)."""
  multiple = math.lcm(CAPACITY_MULTIPLE, policy.capacity_multiple)
  return -(-tokens // multiple) * multiple


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
    decode_steps: the decode steps that ran (the policy's counters cover all of them).
    after_step_seconds: the part of each of those steps spent in the policy's host work
      between steps (`after_step`), the rest being the jitted step up to its sampled token.
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
  after_step_seconds: list[float] = dataclasses.field(default_factory=list)
  decode_steps: int = 0

  @property
  def ms_per_token(self) -> float:
    return 1e3 * statistics.median(self.decode_seconds) if self.decode_seconds else math.nan

  @property
  def prefill_tokens_per_second(self) -> float:
    return sum(self.prompt_lengths) / self.prefill_seconds


def _encode_prompts(model, prompts, *, chat: bool | None) -> list[list[int]]:
  if isinstance(prompts, np.ndarray):  # [T] one prompt or [B, T] a batch of ids
    prompts = [prompts] if prompts.ndim == 1 else list(prompts)
  if isinstance(prompts, str) or (len(prompts) and isinstance(prompts[0], (int, np.integer))):
    prompts = [prompts]
  if not len(prompts):
    raise ValueError("prompts is empty")
  if chat is not None:
    checks.boolean(chat, "chat")
  encoded = []
  for prompt in prompts:
    if isinstance(prompt, str):
      if not prompt:  # refused here: a chat template would wrap it into a prompt of template tokens alone
        raise ValueError(f"prompt {len(encoded)} is an empty string")
      if model.tokenizer is None:
        raise ValueError(f"model {model.cfg.name!r} has no tokenizer: pass token ids, not text")
      use_chat = model.tokenizer.has_chat_template if chat is None else chat
      if use_chat:
        prompt = model.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        ids = model.tokenizer.encode(prompt, add_bos=False)
      else:
        ids = model.tokenizer.encode(prompt)
    else:
      ids = checks.token_ids(prompt, f"prompt {len(encoded)}")
    if not ids:
      raise ValueError(f"prompt {len(encoded)} is empty")
    bad = [t for t in ids if not 0 <= t < model.cfg.vocab_size]
    if bad:
      raise ValueError(f"prompt {len(encoded)} has token ids outside [0, {model.cfg.vocab_size}): {bad[:5]}")
    encoded.append(ids)
  return encoded


def _check_decode_args(model, stop_tokens, stop_when, seed, return_logits) -> set[int]:
  """decode's options besides sampling, checked (generate checks them before its prefill); the stop ids."""
  _check_stop_when(stop_when)
  checks.integer(seed, "seed", low=-2**63, high=2**63 - 1)
  checks.boolean(return_logits, "return_logits")
  return _stop_tokens(model, stop_tokens)


def _stop_tokens(model, stop_tokens) -> set[int]:
  """The ids that end a sequence: given ints in the vocabulary, or the tokenizer's EOS ids."""
  if stop_tokens is None:
    return set(model.tokenizer.eos_ids) if model.tokenizer is not None else set()
  if isinstance(stop_tokens, (str, bytes)) or not hasattr(stop_tokens, "__iter__"):
    raise TypeError(f"stop_tokens={stop_tokens!r} must be a sequence of token ids")
  ids = checks.token_ids(list(stop_tokens), "stop_tokens")
  bad = [t for t in ids if not 0 <= t < model.cfg.vocab_size]
  if bad:
    raise ValueError(f"stop_tokens {bad[:5]} lie outside the vocabulary [0, {model.cfg.vocab_size})")
  return set(ids)


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


@dataclasses.dataclass
class PrefilledContext:
  """A batch of prompts run through the model, ready to decode.

  Decoding consumes it (the policy state is donated to the decode steps and the host store
  grows): decode it once, or copy it first (kvjax.copy_context, in memory) or save it and load a
  fresh copy per decode.

  Attributes:
    model_name, config_hash, dtype, weights: the identity of the model that made it (weights:
      models.decoder.weights_fingerprint; "" for a context saved before it was recorded).
    policy: the attention policy the state belongs to.
    state: the policy state after `finish_prefill` (decode layout).
    prompt_lengths: tokens per prompt.
    capacity: positions the state holds (prompt + the generation it was sized for).
    last_hidden: [batch, hidden] hidden state of each prompt's last token.
    prefill_seconds: wall time of the prefill (compilation included on a first call).
    setup_times: a copy's wall seconds by part (kvjax.copy_context): "host_s" the host store and
      indexes, "device_s" the state arrays, "attach_s" the new runtime and what the policy prepares
      (retrieval per_step: the first step's rows, their copy, the scatter compiles); empty otherwise.
  """

  model_name: str
  config_hash: str
  dtype: str
  policy: AttentionPolicy
  state: Any
  prompt_lengths: list[int]
  capacity: int
  last_hidden: Any
  prefill_seconds: float = 0.0
  metadata: dict = dataclasses.field(default_factory=dict)  # the caller's notes, saved with the context
  setup_times: dict = dataclasses.field(default_factory=dict)
  weights: str = ""
  spent: bool = False
  _release: Callable[[], None] = lambda: None

  def close(self) -> None:
    """Frees the host side (store and indexes) of the context."""
    self._release()
    self.spent = True


def prefill(
    model,
    prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
    *,
    max_new_tokens: int = 256,
    policy: str | AttentionPolicy = "full",
    policy_options: dict[str, Any] | None = None,
    chat: bool | None = None,
    prefill_chunk: int = 1024,
    on_prefill_progress: Callable[[int, int], None] | None = None,
    on_index_progress: Callable[[int, int], None] | None = None,
    layer_major: bool = False,
) -> PrefilledContext:
  """Runs the prompts through the model and prepares the policy's decode state.

  Args:
    model: a `models.registry.LoadedModel` (anything with cfg, params, tokenizer); one with a
      `mesh` (kvjax.sharding.shard_model, `load_model(..., devices=N)`) runs the policy on each
      device with its share of the KV heads.
    prompts: a string, a list of strings, a list of token ids, or a list of such lists.
      Prompts may differ in length (batch with per-sequence lengths).
    max_new_tokens: generation the context is sized for (dense caches reserve room for it).
    policy: attention policy name or object (see kvjax.policies).
    policy_options: keyword options of the named policy.
    chat: wrap string prompts in the model's chat template; default: when it has one.
    prefill_chunk: prompt tokens per prefill step (bounds activation memory).
    on_prefill_progress: called with (tokens done, tokens total) after each chunk.
    on_index_progress: called with (layers done, layers total) while the policy offloads and
      indexes the prompt (policies with a host side).
    layer_major: run every chunk through one layer before the next (one device), instead of
      each chunk through every layer. A host-backed policy (retrieval, freekv) then holds one
      layer's prompt KV on the device at a time and offloads it before the next layer: device
      memory for the prompt is one layer's KV plus the hidden states [batch, prompt, hidden],
      not every layer's KV (128 GiB for 8B shapes at 1M tokens). Same results; progress is
      then reported in prompt tokens times the share of layers done.
  """
  checks.integer(max_new_tokens, "max_new_tokens", low=1)
  checks.integer(prefill_chunk, "prefill_chunk", low=1)
  mesh = getattr(model, "mesh", None)  # kvjax.sharding.shard_model: heads over several devices
  if layer_major and mesh is not None:
    raise ValueError("layer_major prefill runs on one device; this model is sharded")
  attention = make_policy(policy, **(policy_options or {}))
  if mesh is not None and not isinstance(attention, ShardedPolicy):
    attention = ShardedPolicy(attention, mesh)
  cfg = model.cfg
  encoded = _encode_prompts(model, prompts, chat=chat)
  lengths = [len(ids) for ids in encoded]
  check_context(cfg, max(lengths), max_new_tokens)

  batch = len(encoded)
  padded_len = -(-max(lengths) // prefill_chunk) * prefill_chunk
  capacity = max(padded_len, max(lengths) + max_new_tokens)
  capacity = round_capacity(capacity, attention)
  dtype = jnp.dtype(cfg.dtype)
  rope = tuple(jnp.asarray(t) for t in rope_tables(cfg, capacity))
  tokens = np.zeros((batch, padded_len), np.int32)
  for b, ids in enumerate(encoded):
    tokens[b, : len(ids)] = ids

  staged = layer_major and attention.stages_prefill

  start = time.perf_counter()
  state = attention.prefill_state(cfg, batch, capacity, dtype, staged=staged)
  release = attention.release_fn(state)  # taken before the state is donated
  try:
    state = attention.begin_prefill(cfg, state, np.asarray(lengths, np.int32))
    last_index = jnp.asarray(np.asarray(lengths, np.int32) - 1)
    last_hidden = jnp.zeros((batch, cfg.hidden_size), dtype)
    if mesh is not None:  # placed as the chunks return it, so the second chunk does not recompile
      last_hidden = replicated(last_hidden, mesh)
    chunks = [(jnp.asarray(tokens[:, begin : begin + prefill_chunk]),
               jnp.broadcast_to(jnp.arange(begin, begin + prefill_chunk, dtype=jnp.int32), (batch, prefill_chunk)))
              for begin in range(0, padded_len, prefill_chunk)]
    if layer_major:
      last_hidden, state = _layer_major(model, attention, rope, chunks, last_index, last_hidden, state,
                                        staged=staged, on_prefill_progress=on_prefill_progress,
                                        on_index_progress=on_index_progress, prompt_tokens=max(lengths))
    else:
      for i, (chunk, positions) in enumerate(chunks):
        last_hidden, state = engine.prefill_chunk(
            model.params, rope, chunk, positions, last_index, last_hidden, state, cfg=cfg, policy=attention)
        if on_prefill_progress is not None:
          jax.block_until_ready(last_hidden)
          on_prefill_progress(min((i + 1) * prefill_chunk, max(lengths)), max(lengths))
    state = attention.finish_prefill(cfg, state, on_progress=None if staged else on_index_progress)
    jax.block_until_ready(last_hidden)
  except BaseException:
    release()
    raise
  return PrefilledContext(
      model_name=cfg.name, config_hash=cfg.config_hash(), dtype=cfg.dtype, policy=attention, state=state,
      prompt_lengths=lengths, capacity=capacity, last_hidden=last_hidden,
      prefill_seconds=time.perf_counter() - start, weights=weights_fingerprint(model.params), _release=release)


def _layer_major(model, attention, rope, chunks, last_index, last_hidden, state, *, staged, on_prefill_progress,
                 on_index_progress, prompt_tokens):
  """Every chunk through layer 0, then layer 1, ...: the hidden states of the whole prompt
  ([batch, chunk, hidden] per chunk) stay on the device between layers; a staged state's layer
  is offloaded as soon as its last chunk has run."""
  cfg, params = model.cfg, model.params
  inv_freqs, factors = rope
  layers = params["layers"]
  hidden = [engine.embed_chunk(params, chunk, cfg=cfg) for chunk, _ in chunks]
  for layer in range(cfg.num_layers):
    # Stacked weights: this layer's slice (a copy of one layer); unrolled ones: its own dict.
    lp = layers[layer] if isinstance(layers, (list, tuple)) else jax.tree.map(lambda w: w[layer], layers)
    for i, (_, positions) in enumerate(chunks):
      hidden[i], state = engine.prefill_layer_chunk(lp, inv_freqs[layer], factors[layer], jnp.int32(layer), hidden[i],
                                                    positions, state, cfg=cfg, policy=attention)
    if staged:
      state = attention.offload_layer(cfg, state, layer)
      if on_index_progress is not None:
        on_index_progress(layer + 1, cfg.num_layers)
    if on_prefill_progress is not None:
      jax.block_until_ready(hidden[-1])
      on_prefill_progress(prompt_tokens * (layer + 1) // cfg.num_layers, prompt_tokens)
  for h, (_, positions) in zip(hidden, chunks):
    last_hidden = engine.pick_last_hidden(params, h, positions, last_index, last_hidden, cfg=cfg)
  return last_hidden, state


def check_model(model, context: PrefilledContext) -> None:
  """Refuses a context made by another model (name, architecture hash, dtype or weights)."""
  cfg = model.cfg
  theirs = (context.model_name, context.config_hash, context.dtype)
  ours = (cfg.name, cfg.config_hash(), cfg.dtype)
  if theirs != ours:
    raise ValueError(f"context was made by model {theirs} (name, config hash, dtype), not by {ours}")
  fingerprint = weights_fingerprint(model.params) if context.weights else ""
  if fingerprint != context.weights:
    raise ValueError(f"context was made by model {ours} with other weights (fingerprint {context.weights}, this "
                     f"model's {fingerprint}): another checkpoint of the same architecture")


def check_mesh(model, context: PrefilledContext) -> None:
  """Refuses to decode a context on other devices than it was prefilled on: a sharded model's
  weights and state only make sense to the sharded program over the same mesh."""
  ours = getattr(model, "mesh", None)
  theirs = context.policy.mesh if isinstance(context.policy, ShardedPolicy) else None
  if ours != theirs:
    describe = lambda mesh: "one device" if mesh is None else f"{mesh.size} devices {list(mesh.devices.flat)}"
    raise ValueError(f"the context was prefilled on {describe(theirs)} but the model is on {describe(ours)}: "
                     "decode it with the model that prefilled it")


def decode(
    model,
    context: PrefilledContext,
    *,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    stop_tokens: Sequence[int] | None = None,
    stop_when: Callable[[list[int]], bool] | None = None,
    return_logits: bool = False,
    on_step: Callable[[int], None] | None = None,
) -> GenerationResult:
  """Generates from a prefilled context, which it consumes (see PrefilledContext).

  Args:
    model: the model that prefilled the context.
    context: from `prefill()` or `kvjax.load_context()`.
    max_new_tokens: tokens to generate per sequence (stop tokens end a sequence earlier).
    temperature, top_p: sampling (temperature 0 is greedy).
    seed: PRNG seed of the sampler.
    stop_tokens: ids that end a sequence; default: the tokenizer's end-of-turn ids.
    stop_when: called with a sequence's generated ids after each new token (kept); True ends
      that sequence, e.g. once its text holds a task's answer (kvjax.eval's early stop).
    return_logits: keep every step's logits [steps, batch, vocab] (for tests and studies).
    on_step: called with the number of decode steps done after each one (and its host work).
  """
  if context.spent:
    raise ValueError("this context was decoded already: load it again from disk to decode it anew")
  check_model(model, context)
  check_mesh(model, context)
  checks.integer(max_new_tokens, "max_new_tokens", low=1)
  room = context.capacity - max(context.prompt_lengths)
  if max_new_tokens > room:
    raise ValueError(f"{max_new_tokens=} exceeds the {room} positions the context was prefilled for")
  check_context(model.cfg, max(context.prompt_lengths), max_new_tokens)  # the room is rounded up past it
  sampling = SamplingConfig(temperature=temperature, top_p=top_p)
  stop = _check_decode_args(model, stop_tokens, stop_when, seed, return_logits)
  if on_step is not None and not callable(on_step):
    raise TypeError(f"on_step={on_step!r} must be callable")
  try:
    return _decode(model, context, sampling, stop, stop_when, max_new_tokens=max_new_tokens, seed=seed,
                   return_logits=return_logits, on_step=on_step)
  finally:
    context.close()


def _check_stop_when(stop_when) -> None:
  if stop_when is not None and not callable(stop_when):
    raise TypeError(f"stop_when={stop_when!r} must be callable (generated ids -> bool)")


def _decode(model, context, sampling, stop, stop_when, *, max_new_tokens, seed, return_logits,
            on_step) -> GenerationResult:
  cfg, attention, state = model.cfg, context.policy, engine.committed(context.state)
  context.state = None  # donated below
  batch = len(context.prompt_lengths)
  rope = tuple(jnp.asarray(t) for t in rope_tables(cfg, context.capacity))
  key = jax.random.key(seed)
  key, sub = jax.random.split(key)
  next_tokens, logits = engine.first_token(model.params, context.last_hidden, sub, cfg=cfg, sampling=sampling)
  next_tokens = np.asarray(next_tokens)

  generated: list[list[int]] = [[] for _ in range(batch)]
  done = np.zeros(batch, bool)
  step_logits = [np.asarray(logits)] if return_logits else []
  step_seconds, after_seconds = [], []
  positions = np.asarray(context.prompt_lengths, np.int32)
  for step in range(max_new_tokens):
    for b in range(batch):
      if not done[b]:
        if int(next_tokens[b]) in stop:
          done[b] = True
        else:
          generated[b].append(int(next_tokens[b]))
          done[b] = stop_when is not None and bool(stop_when(generated[b]))
    if done.all() or step == max_new_tokens - 1:
      break
    t0 = time.perf_counter()
    key, sub = jax.random.split(key)
    step_args = (model.params, rope, jnp.asarray(next_tokens), jnp.asarray(positions))
    step_options = dict(cfg=cfg, policy=attention, sampling=sampling)
    if attention.repeats_steps:
      before = state
      out, logits, state = engine.decode_step_kept(*step_args, before, sub, **step_options)
      again = attention.repeat_step(cfg, before, state)
      if again is not None:  # the second pass replaces the first (same sampling key)
        out, logits, state = engine.decode_step(*step_args, again, sub, **step_options)
    else:
      out, logits, state = engine.decode_step(*step_args, state, sub, **step_options)
    # The policy's read of the step's outputs, begun now, carries the token too: one copy, as soon as the step ends.
    started = attention.start_after_step(state, out)
    next_tokens = np.asarray(out) if started is None else started.also()  # waits for the step
    t1 = time.perf_counter()
    state = attention.after_step(cfg, state, started)
    step_seconds.append(time.perf_counter() - t0)
    after_seconds.append(time.perf_counter() - t1)
    if return_logits:
      step_logits.append(np.asarray(logits))
    positions = positions + 1
    if on_step is not None:
      on_step(step + 1)

  texts = None
  if model.tokenizer is not None:
    texts = [model.tokenizer.decode(ids) for ids in generated]
  return GenerationResult(
      texts=texts,
      tokens=generated,
      prompt_lengths=list(context.prompt_lengths),
      prefill_seconds=context.prefill_seconds,
      decode_seconds=step_seconds[1:] if len(step_seconds) > 1 else step_seconds,
      policy=attention.describe(),
      kv_bytes=_state_bytes(state),
      peak_device_bytes=_device_peak_bytes(),
      logits=np.stack(step_logits) if return_logits else None,
      policy_stats=attention.stats(state),
      after_step_seconds=after_seconds[1:] if len(after_seconds) > 1 else after_seconds,
      decode_steps=len(step_seconds),
  )


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
    stop_when: Callable[[list[int]], bool] | None = None,
    chat: bool | None = None,
    prefill_chunk: int = 1024,
    return_logits: bool = False,
    on_prefill_progress: Callable[[int, int], None] | None = None,
) -> GenerationResult:
  """Prefills the prompts and generates their continuations (`prefill` then `decode`).

  Args: see `prefill` and `decode`; `max_new_tokens` serves both.
  """
  SamplingConfig(temperature=temperature, top_p=top_p)  # bad decode options fail before any work
  _check_decode_args(model, stop_tokens, stop_when, seed, return_logits)
  context = prefill(model, prompts, max_new_tokens=max_new_tokens, policy=policy, policy_options=policy_options,
                    chat=chat, prefill_chunk=prefill_chunk, on_prefill_progress=on_prefill_progress)
  return decode(model, context, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                stop_tokens=stop_tokens, stop_when=stop_when, return_logits=return_logits)
