"""Jitted building blocks of generation: chunked prefill, the first token, one decode step.

Each function takes the policy state as a donated argument, so the KV cache is updated in
place across chunks and steps instead of being copied.

With unrolled layers (`models.decoder.decode_layout(..., unroll=True)`) the programs are
compiled with XLA's command buffers (CUDA graphs) off. XLA cannot put the Pallas kernels in a
command buffer, so an unrolled step becomes dozens of small graphs between them, and launching
those cost more than plain kernel launches: on the H200 a Llama-3-8B-shaped step at 128K took
12.7 ms with command buffers and 10.5 ms without; under `lax.scan` (one while loop) they help
instead (SmolLM2 at 32K: 2.8 vs 6.1 ms), so stacked layers keep XLA's default
(experiments/results/command_buffers/README.md). This holds for freekv's per_step step too
since its per-layer work shrank (8B shapes, 8K: 11.3 ms off vs 14.2 on at batch 1, 9.1 vs 12.4
at batch 4), and none of XLA's command-buffer options closed the gap
(experiments/results/bench_compile_modes_8b_8k_cb_knobs.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvjax.policies.base import AttentionPolicy
from kvjax.sampling import SamplingConfig, sample
from models.config import ModelConfig
from models.decoder import decoder_layer, embed, final_norm, logits_from_hidden


_NO_COMMAND_BUFFERS = {"xla_gpu_enable_command_buffer": ""}


def _jit_by_layout(fn, **jit_kwargs):
  """`fn` jitted with XLA defaults for stacked layers and with command buffers off for unrolled
  ones; calls dispatch on the type of params["layers"] (first argument). `call.jits` are the
  two jits (for tests counting compiles)."""
  defaults = jax.jit(fn, **jit_kwargs)
  unrolled = jax.jit(fn, compiler_options=_NO_COMMAND_BUFFERS, **jit_kwargs)

  @functools.wraps(fn)
  def call(params, *args, **kwargs):
    unrolled_layers = isinstance(params["layers"], (list, tuple))
    return (unrolled if unrolled_layers else defaults)(params, *args, **kwargs)

  call.jits = (defaults, unrolled)
  return call


def committed(state):
  """`state` with every array committed to the device(s) it is on (no copy).

  A jitted step's compile key includes whether each argument is committed. Arrays made by
  jnp ops are not; those a policy writes between steps from a `jax.device_put` to a device
  (freekv's and retrieval's row updates) are, and so is what a step computes from them. A
  state mixing the two compiled the decode step a second time at its second step (counted on
  the CPU; on the H200 a freekv per_step decode at 8B shapes, 128K, had one 8.4 s step).
  Committing it before the first step keeps one compile.
  """
  return jax.tree.map(lambda x: jax.device_put(x, x.sharding) if isinstance(x, jax.Array) else x, state)


def prefill_chunk(
    params,
    rope,  # (inv_freq [L, head_dim // 2], factors [L])
    tokens,  # [batch, chunk] int32 (padding past a prompt's end is harmless: see generate)
    positions,  # [batch, chunk] int32
    last_index,  # [batch] int32: position of each prompt's last token
    last_hidden,  # [batch, hidden]: hidden state at last_index, filled by the chunk holding it
    state,
    *,
    cfg: ModelConfig,
    policy: AttentionPolicy,
):
  """Runs one prompt chunk through every layer, writing its keys and values into `state`."""
  hidden, state = policy.forward_hidden(params, tokens, positions, cfg=cfg, rope=rope, state=state)
  picked, in_chunk = _at_last_token(hidden, positions, last_index)
  return jnp.where(in_chunk[:, None], picked, last_hidden), state


def _at_last_token(
    hidden,  # [batch, chunk, hidden]
    positions,  # [batch, chunk] int32
    last_index,  # [batch] int32: position of each prompt's last token
):
  """Each sequence's row at its last prompt token ([batch, hidden]) and whether this chunk holds
  it ([batch] bool; where not, the row is meaningless)."""
  offset = last_index - positions[:, 0]
  in_chunk = (offset >= 0) & (offset < hidden.shape[1])
  return hidden[jnp.arange(hidden.shape[0]), jnp.clip(offset, 0, hidden.shape[1] - 1)], in_chunk


prefill_chunk = _jit_by_layout(prefill_chunk, static_argnames=("cfg", "policy"),
                               donate_argnames=("state", "last_hidden"))


@functools.partial(jax.jit, static_argnames=("cfg",))
def embed_chunk(params, tokens, *, cfg: ModelConfig):  # tokens [batch, chunk] int32 -> [batch, chunk, hidden]
  return embed(params, cfg, tokens)


@functools.partial(jax.jit, static_argnames=("cfg", "policy"), donate_argnames=("hidden", "state"))
def prefill_layer_chunk(
    layer_params,  # one layer's parameters
    inv_freq,  # [head_dim // 2] float32: the layer's RoPE frequencies
    rope_factor,  # [] float32
    layer,  # [] int32
    hidden,  # [batch, chunk, hidden]: the chunk's input to this layer
    positions,  # [batch, chunk] int32
    state,
    *,
    cfg: ModelConfig,
    policy: AttentionPolicy,
):
  """Layer-major prefill: one prompt chunk through one layer -> (its output, state). One
  compile serves every layer and chunk (the layer is traced, its weights an argument)."""
  return decoder_layer(cfg, layer_params, hidden, positions, inv_freq, rope_factor, layer,
                       attention_fn=functools.partial(policy.attend, cfg), attention_state=state)


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("last_hidden",))
def pick_last_hidden(
    params,
    hidden,  # [batch, chunk, hidden]: a chunk's output of the last layer
    positions,  # [batch, chunk] int32
    last_index,  # [batch] int32: position of each prompt's last token
    last_hidden,  # [batch, hidden]
    *,
    cfg: ModelConfig,
):
  """The final-normed hidden state at each prompt's last token, where this chunk holds it."""
  picked, in_chunk = _at_last_token(hidden, positions, last_index)
  return jnp.where(in_chunk[:, None], final_norm(params, cfg, picked), last_hidden)


@functools.partial(jax.jit, static_argnames=("cfg", "sampling"))
def first_token(params, last_hidden, key, *, cfg: ModelConfig, sampling: SamplingConfig):
  """Samples the first generated token from the prompt's last hidden state [batch, hidden]."""
  logits = logits_from_hidden(params, cfg, last_hidden)  # [batch, vocab]
  return sample(logits, key, sampling), logits


def decode_step(
    params,
    rope,
    tokens,  # [batch] int32: the tokens to feed
    positions,  # [batch] int32: their positions
    state,
    key,
    *,
    cfg: ModelConfig,
    policy: AttentionPolicy,
    sampling: SamplingConfig,
):
  """Feeds one token per sequence; returns (next tokens [batch], logits [batch, vocab], state)."""
  hidden, state = policy.forward_hidden(params, tokens[:, None], positions[:, None], cfg=cfg, rope=rope,
                                       state=state)
  logits = logits_from_hidden(params, cfg, hidden[:, 0])
  return sample(logits, key, sampling), logits, state


# The step that keeps its input state: a policy that runs a step twice (AttentionPolicy.repeats_steps)
# runs the second pass from the state the first one started from.
decode_step_kept = _jit_by_layout(decode_step, static_argnames=("cfg", "policy", "sampling"))
decode_step = _jit_by_layout(decode_step, static_argnames=("cfg", "policy", "sampling"),
                             donate_argnames=("state",))
