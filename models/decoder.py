"""A functional decoder for the Llama, Qwen2 and Gemma 3 families.

The model is pure functions over the layer-stacked parameter pytree of `models.config`.
Attention is injected: the decoder computes q, k, v (after QK-norm and RoPE) and calls

    out, state = attention_fn(layer, q, k, v, positions, state)

    layer      int32 scalar, traced under lax.scan (a Python int when the layers are unrolled)
    q          [batch, seq, num_heads, head_dim]
    k, v       [batch, seq, num_kv_heads, head_dim]
    positions  [batch, seq] int32 absolute positions
    state      the attention policy's pytree, whole (all layers)
    out        [batch, seq, num_heads, head_dim]

The policy receives its whole state rather than one layer's slice: a slice taken or
written back by `lax.scan` copies it every layer, while a policy that indexes its own
layer-stacked buffers updates them in place (a dense KV cache at 128K is 16 GiB).
The query is not pre-scaled; the policy applies `cfg.attn_scale`.

Decode layout: `decode_layout` concatenates each layer's q/k/v projections into one `wqkv`
[hidden, (Hq + 2 Hkv) D] (biases into `bqkv`) and gate/up into `w_gate_up` [hidden, 2 I], so a
decode step reads them with two GEMVs instead of five (fewer kernel launches, and the small
k/v GEMVs, which ran well below bandwidth, disappear); the decoder accepts either form.

Layer loop: with layer-stacked weights (`params["layers"]` a dict of [L, ...] arrays) the
layers run under `lax.scan`, which compiles one layer body. Under `lax.scan` XLA hands each
layer's weights to the matmuls as a slice it first copies out of the stacked buffer, which
doubles the weight traffic of a memory-bound decode step; `unstack_layers` turns the weights
into a list of per-layer dicts, and the decoder then unrolls the layers in Python (static
layer ids, weights read in place) at the cost of a longer compile.

Tensor parallelism: `partial_sum` (default: none) is applied to the output of `wo` and of
`w_down` before anything else touches them (Gemma's sandwich norms included). Run under
`jax.shard_map` with head-sharded weights (models.tensor_parallel) and a per-device config,
it is `lax.psum` over the mesh axis: each device's rows of `wo` / `w_down` give a partial
sum of the full projection.
"""

from __future__ import annotations

import zlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig
from models.rope import apply_rope

AttentionFn = Callable[..., tuple[jax.Array, Any]]


def rms_norm(
    x,  # [..., dim]
    weight,  # [dim]
    eps: float,
):
  """RMSNorm in float32 (weight already the effective multiplier), cast back to x.dtype."""
  x32 = x.astype(jnp.float32)
  normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (normed * weight.astype(jnp.float32)).astype(x.dtype)


def _activation(cfg: ModelConfig, x):
  if cfg.activation == "silu":
    return jax.nn.silu(x)
  return jax.nn.gelu(x, approximate=True)


def _project(x, w, b=None):
  # x [B, T, in] @ w [in, out]. The output stays in the activation dtype: asking XLA for a
  # float32 result of a bf16 decode GEMV made it read the weights at 2.1 instead of 2.9 TB/s
  # on the H200 (experiments/results/bench_gemv.md); bf16 dots accumulate in f32 regardless.
  y = jnp.einsum("BTI,IO->BTO", x, w)
  if b is not None:
    y = (y.astype(jnp.float32) + b.astype(jnp.float32)).astype(x.dtype)
  return y


def _attention_block(cfg, lp, x, positions, inv_freq, rope_factor, layer, attention_fn, state, partial_sum):
  B, T, _ = x.shape
  h = rms_norm(x, lp["input_norm"], cfg.norm_eps)
  if "wqkv" in lp:
    q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    qkv = _project(h, lp["wqkv"], lp.get("bqkv"))  # [B, T, q_dim + 2 kv_dim]
    q, k, v = jnp.split(qkv, [q_dim, q_dim + kv_dim], axis=-1)
  else:
    q, k, v = (_project(h, lp[w], lp.get(b)) for w, b in (("wq", "bq"), ("wk", "bk"), ("wv", "bv")))
  q = q.reshape(B, T, cfg.num_heads, cfg.head_dim)
  k = k.reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
  v = v.reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
  if cfg.qk_norm:  # Gemma 3 normalizes each head before RoPE
    q = rms_norm(q, lp["q_norm"], cfg.norm_eps)
    k = rms_norm(k, lp["k_norm"], cfg.norm_eps)
  q = apply_rope(q, positions, inv_freq, rope_factor)
  k = apply_rope(k, positions, inv_freq, rope_factor)
  out, state = attention_fn(layer, q, k, v, positions, state)
  out = partial_sum(_project(out.astype(x.dtype).reshape(B, T, cfg.num_heads * cfg.head_dim), lp["wo"]))
  if cfg.sandwich_norms:
    out = rms_norm(out, lp["post_attn_norm"], cfg.norm_eps)
  return out, state


def _mlp_block(cfg, lp, x, partial_sum):
  h = rms_norm(x, lp["pre_mlp_norm"], cfg.norm_eps)
  if "w_gate_up" in lp:
    gate, up = jnp.split(_project(h, lp["w_gate_up"]), 2, axis=-1)  # [B, T, I] each
  else:
    gate, up = _project(h, lp["w_gate"]), _project(h, lp["w_up"])
  gated = _activation(cfg, gate) * up
  out = partial_sum(_project(gated, lp["w_down"]))
  if cfg.sandwich_norms:
    out = rms_norm(out, lp["post_mlp_norm"], cfg.norm_eps)
  return out


def embed(params, cfg: ModelConfig, tokens):  # tokens [B, T] int32 -> [B, T, hidden]
  x = jnp.take(params["embed"], tokens, axis=0)
  if cfg.embed_scale != 1.0:
    # Gemma multiplies by sqrt(hidden) rounded to the weight dtype, as transformers does.
    x = x * jnp.asarray(cfg.embed_scale, dtype=x.dtype)
  return x


def decoder_layer(
    cfg: ModelConfig,
    lp,  # one layer's parameters
    x,  # [batch, seq, hidden]
    positions,  # [batch, seq] int32
    inv_freq,  # [head_dim // 2] float32: this layer's RoPE frequencies
    rope_factor,  # [] float32
    layer,  # [] int32 (or a Python int)
    *,
    attention_fn: AttentionFn,
    attention_state: Any,
    partial_sum: Callable[[jax.Array], jax.Array] | None = None,
):
  """One decoder layer (attention and MLP blocks with their residuals): (x, state)."""
  partial_sum = partial_sum or (lambda y: y)
  attn, state = _attention_block(cfg, lp, x, positions, inv_freq, rope_factor, layer, attention_fn,
                                 attention_state, partial_sum)
  x = x + attn
  return x + _mlp_block(cfg, lp, x, partial_sum), state


def final_norm(params, cfg: ModelConfig, x):  # x [..., hidden] after the last layer
  return rms_norm(x, params["final_norm"], cfg.norm_eps)


def forward_hidden(
    params,
    tokens,  # [batch, seq] int32
    positions,  # [batch, seq] int32
    *,
    cfg: ModelConfig,
    rope: tuple,  # (inv_freq [L, head_dim // 2], factors [L]) from models.rope.rope_tables
    attention_fn: AttentionFn,
    attention_state: Any,
    partial_sum: Callable[[jax.Array], jax.Array] | None = None,
):
  """Runs all layers; returns final-normed hidden states [batch, seq, hidden] and the state.

  `partial_sum` reduces the partial outputs of head-sharded `wo` and `w_down` (see the module
  docstring); None for an unsharded model."""
  partial_sum = partial_sum or (lambda y: y)
  inv_freqs, factors = (jnp.asarray(t) for t in rope)
  x = embed(params, cfg, tokens)

  def layer_step(carry, xs):
    x, state = carry
    lp, layer, inv_freq, factor = xs
    x, state = decoder_layer(cfg, lp, x, positions, inv_freq, factor, layer, attention_fn=attention_fn,
                             attention_state=state, partial_sum=partial_sum)
    return (x, state), None

  if isinstance(params["layers"], (list, tuple)):  # unstacked: unrolled, weights read in place
    carry = (x, attention_state)
    for layer, lp in enumerate(params["layers"]):
      carry, _ = layer_step(carry, (lp, layer, inv_freqs[layer], factors[layer]))
    x, state = carry
  else:
    layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
    (x, state), _ = jax.lax.scan(layer_step, (x, attention_state),
                                 (params["layers"], layer_ids, inv_freqs, factors))
  return final_norm(params, cfg, x), state


def fuse_projections(params):
  """Layer weights with q/k/v (and their biases) and gate/up concatenated along the output axis.

  Works on stacked ([L, in, out]) and unstacked layers; already fused layers pass through."""
  def fuse(lp):
    if "wqkv" in lp:
      return lp
    lp = dict(lp)
    lp["wqkv"] = jnp.concatenate([lp.pop("wq"), lp.pop("wk"), lp.pop("wv")], axis=-1)
    if "bq" in lp:
      lp["bqkv"] = jnp.concatenate([lp.pop("bq"), lp.pop("bk"), lp.pop("bv")], axis=-1)
    lp["w_gate_up"] = jnp.concatenate([lp.pop("w_gate"), lp.pop("w_up")], axis=-1)
    return lp

  layers = params["layers"]
  layers = [fuse(lp) for lp in layers] if isinstance(layers, (list, tuple)) else fuse(layers)
  return dict(params, layers=layers)


# Per layer, the weights whose leading columns read the same in every layout: the never-fused ones,
# and the first of each fused group (wq leads wqkv, w_gate leads w_gate_up).
_FINGERPRINT_WEIGHTS = (("input_norm",), ("wq", "wqkv"), ("wo",), ("w_gate", "w_gate_up"), ("w_down",))


def weights_fingerprint(params) -> str:
  """A short hex digest of the weights' values that does not depend on their layout (stacked or
  unrolled, fused or not): crc32 of the first row's first 64 entries of the embedding, the final
  norm, an untied lm_head and the first and last layers' weights in _FINGERPRINT_WEIGHTS. Tells
  two checkpoints of one architecture apart (a fine-tune, another quantization, another seed)."""
  head = lambda x: x[(0,) * (x.ndim - 1)][:64]  # the first row's first 64 entries
  layers = params["layers"]
  stacked = not isinstance(layers, (list, tuple))
  count = jax.tree.leaves(layers)[0].shape[0] if stacked else len(layers)
  samples = [head(params[k]) for k in ("embed", "final_norm", "lm_head") if k in params]
  for l in sorted({0, count - 1}):
    lp = layers if stacked else layers[l]
    for names in _FINGERPRINT_WEIGHTS:
      name = next((n for n in names if n in lp), None)
      if name is not None:
        samples.append(head(lp[name][l] if stacked else lp[name]))
  host = jax.device_get(samples)  # one transfer, not one per sample
  return f"{zlib.crc32(b''.join(np.asarray(x, np.float32).tobytes() for x in host)) & 0xFFFFFFFF:08x}"


def decode_layout(params, *, unroll: bool):
  """The parameter layout decoding runs fastest with: fused projections, and on a GPU
  (`unroll=True`) per-layer weights so the unrolled layers read them in place."""
  params = fuse_projections(params)
  return unstack_layers(params) if unroll else params


def unstack_layers(params):
  """Layer-stacked params -> the same params with "layers" a list of per-layer dicts."""
  layers = params["layers"]
  if isinstance(layers, (list, tuple)):
    return params
  count = jax.tree.leaves(layers)[0].shape[0]
  return dict(params, layers=[jax.tree.map(lambda w, i=i: w[i], layers) for i in range(count)])


def logits_from_hidden(params, cfg: ModelConfig, hidden):  # hidden [..., hidden] -> [..., vocab] f32
  if cfg.tie_embeddings:
    logits = jnp.einsum("...H,VH->...V", hidden, params["embed"], preferred_element_type=jnp.float32)
  else:
    logits = jnp.einsum("...H,HV->...V", hidden, params["lm_head"], preferred_element_type=jnp.float32)
  if cfg.final_logit_softcap:
    logits = jnp.tanh(logits / cfg.final_logit_softcap) * cfg.final_logit_softcap
  return logits
