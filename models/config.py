"""Model configurations: one frozen dataclass describes every supported decoder.

The parameter pytree that goes with a config (see `param_shapes`) is layer-stacked so the
decoder runs its layers under `lax.scan`:

    params = {
      "embed":      [vocab, hidden]
      "lm_head":    [hidden, vocab]            (absent when tie_embeddings)
      "final_norm": [hidden]
      "layers": {                              (every leaf has a leading [num_layers] axis)
        "input_norm":     [L, hidden]
        "wq": [L, hidden, num_heads * head_dim]   "bq": [L, num_heads * head_dim]     (bias: qkv_bias only)
        "wk": [L, hidden, num_kv_heads * head_dim] "bk": [L, num_kv_heads * head_dim]
        "wv": [L, hidden, num_kv_heads * head_dim] "bv": [L, num_kv_heads * head_dim]
        "q_norm": [L, head_dim]  "k_norm": [L, head_dim]                          (qk_norm only)
        "wo": [L, num_heads * head_dim, hidden]
        "post_attn_norm": [L, hidden]                                             (sandwich_norms only)
        "pre_mlp_norm":   [L, hidden]
        "post_mlp_norm":  [L, hidden]                                             (sandwich_norms only)
        "w_gate": [L, hidden, intermediate]  "w_up": [L, hidden, intermediate]
        "w_down": [L, intermediate, hidden]
      }
    }

Projections are stored [in, out] (x @ w). Norm weights are stored as the effective
multiplier: Gemma's checkpoints keep `w` and apply `1 + w`; the loaders fold that in, so
the decoder always computes `rmsnorm(x) * weight`. Norm weights stay float32 whatever the
model's dtype (`leaf_dtype`): 1 + w in bfloat16 keeps 8 bits, and a small learned w rounded
away (with w ~ N(0, 0.01), 23% of 100,000 multipliers rounded to exactly 1); they are
a few KiB, and `rms_norm` computes in float32 anyway.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import numbers
from typing import Literal

RopeKind = Literal["linear", "dynamic", "yarn", "llama3"]
DTYPES = ("float32", "bfloat16", "float16")  # the weight and KV dtypes a model runs in
Family = Literal["llama", "qwen2", "gemma3"]


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """RoPE frequency scaling to run past the trained context.

  Attributes:
    kind: "linear" (position interpolation), "dynamic" (NTK-aware base growth, fixed at the
      context length the run is prepared for), "yarn", or "llama3" (Llama-3.1's
      wavelength-dependent interpolation).
    factor: context extension factor (> 1 for extension, 1 for Llama-3.1 style no-op).
    original_max_position: the context the model was trained at.
    low_freq_factor, high_freq_factor: llama3 only.
    beta_fast, beta_slow: yarn only (correction range in rotations).
    attention_factor: yarn only; None means 0.1 * ln(factor) + 1.
  """

  kind: RopeKind
  factor: float
  original_max_position: int
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  attention_factor: float | None = None

  def __post_init__(self):
    if self.kind not in ("linear", "dynamic", "yarn", "llama3"):
      raise ValueError(f"unknown RoPE scaling kind={self.kind!r}; expected linear, dynamic, yarn or llama3")
    if not self.factor > 0:
      raise ValueError(f"RoPE scaling factor={self.factor} must be > 0")
    if self.original_max_position <= 0:
      raise ValueError(f"{self.original_max_position=} must be positive")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture of one decoder-only transformer (Llama 2/3, Mistral, Qwen2, Gemma 3).

  Attributes:
    name: identity used in saved contexts and caches (e.g. "SmolLM2-135M-Instruct").
    family: "llama" (Llama 2/3, Mistral, SmolLM2), "qwen2" or "gemma3".
    layer_windows: per-layer sliding window in tokens, 0 for global attention layers.
    rope_local_theta: RoPE base of sliding-window layers (Gemma 3), None = rope_theta.
    rope_scaling: applied to global layers only (as Gemma 3 does; for other families all
      layers are global).
    attn_scale: multiplier of q·k (head_dim**-0.5, or query_pre_attn_scalar**-0.5 in Gemma).
    embed_scale: multiplier of the token embedding (sqrt(hidden) in Gemma, 1 elsewhere).
    final_logit_softcap: tanh soft cap of the logits, None for none.
    dtype: compute/storage dtype name of the weights ("float32", "bfloat16", "float16").
  """

  name: str
  family: Family
  vocab_size: int
  hidden_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  intermediate_size: int
  max_position: int
  rope_theta: float
  norm_eps: float = 1e-5
  tie_embeddings: bool = False
  qkv_bias: bool = False
  qk_norm: bool = False
  sandwich_norms: bool = False
  activation: Literal["silu", "gelu_tanh"] = "silu"
  embed_scale: float = 1.0
  attn_scale: float | None = None
  layer_windows: tuple[int, ...] | None = None
  rope_local_theta: float | None = None
  rope_scaling: RopeScaling | None = None
  final_logit_softcap: float | None = None
  dtype: str = "float32"

  def __post_init__(self):
    for field in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                  "intermediate_size", "max_position"):
      value = getattr(self, field)
      if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{field}={value!r} must be an int >= 1")
    if self.dtype not in DTYPES:
      raise ValueError(f"dtype={self.dtype!r} must be one of {DTYPES}")
    if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
      raise TypeError(f"rope_scaling={self.rope_scaling!r} must be a RopeScaling (or None)")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"{self.num_heads=} is not a multiple of {self.num_kv_heads=}")
    if self.head_dim % 2:
      raise ValueError(f"{self.head_dim=} must be even for RoPE")
    if self.family not in ("llama", "qwen2", "gemma3"):
      raise ValueError(f"unknown model family={self.family!r}")
    if self.layer_windows is None:
      object.__setattr__(self, "layer_windows", (0,) * self.num_layers)
    if len(self.layer_windows) != self.num_layers:
      raise ValueError(f"{len(self.layer_windows)=} != {self.num_layers=}")
    if self.attn_scale is None:
      object.__setattr__(self, "attn_scale", self.head_dim**-0.5)

  @property
  def group_size(self) -> int:
    return self.num_heads // self.num_kv_heads

  @property
  def global_layers(self) -> tuple[int, ...]:
    return tuple(i for i, w in enumerate(self.layer_windows) if w == 0)

  def with_rope_scaling(self, scaling: RopeScaling | None) -> "ModelConfig":
    return dataclasses.replace(self, rope_scaling=scaling)

  def max_context(self) -> int:
    """Longest prompt + generation this config accepts (trained context × scaling)."""
    if self.rope_scaling is None or self.rope_scaling.kind == "llama3":
      return self.max_position
    return int(math.floor(self.rope_scaling.original_max_position * self.rope_scaling.factor))

  def config_hash(self) -> str:
    """Stable hash of the architecture (name and dtype excluded): saved artefacts check it."""
    fields = dataclasses.asdict(self)
    fields.pop("name")
    fields.pop("dtype")
    blob = json.dumps(fields, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def is_norm(name: str) -> bool:
  """Whether the parameter leaf `name` ("wq", "input_norm", ...) is a norm weight."""
  return name.endswith("norm")


def leaf_dtype(name: str, dtype: str) -> str:
  """The dtype name of the parameter leaf `name` of a `dtype` model: float32 for norm weights
  (see the module docstring), `dtype` for the rest."""
  return "float32" if is_norm(name) else dtype


def param_shapes(cfg: ModelConfig) -> dict:
  """The parameter pytree's shapes for `cfg` (see module docstring)."""
  L, H, I = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
  qd, kvd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  layers = {
      "input_norm": (L, H),
      "wq": (L, H, qd),
      "wk": (L, H, kvd),
      "wv": (L, H, kvd),
      "wo": (L, qd, H),
      "pre_mlp_norm": (L, H),
      "w_gate": (L, H, I),
      "w_up": (L, H, I),
      "w_down": (L, I, H),
  }
  if cfg.qkv_bias:
    layers.update(bq=(L, qd), bk=(L, kvd), bv=(L, kvd))
  if cfg.qk_norm:
    layers.update(q_norm=(L, cfg.head_dim), k_norm=(L, cfg.head_dim))
  if cfg.sandwich_norms:
    layers.update(post_attn_norm=(L, H), post_mlp_norm=(L, H))
  shapes = {"embed": (cfg.vocab_size, H), "final_norm": (H,), "layers": layers}
  if not cfg.tie_embeddings:
    shapes["lm_head"] = (H, cfg.vocab_size)
  return shapes
