"""Hugging Face checkpoints → kvjax: config, layer-stacked parameters, safetensors without torch.

Three entry points:

  cfg = config_from_hf(hf_config, name="Qwen2.5-0.5B")      # dict (config.json) or PretrainedConfig
  params = params_from_hf_state_dict(state, cfg)            # {HF name: np.ndarray} -> pytree
  cfg, params = load_hf_directory("/path/to/checkpoint")    # config.json + *.safetensors

Supported `model_type`s: llama, mistral, qwen2, gemma3_text and gemma3 (its `text_config`; the
vision tower's tensors are ignored). The configs go through transformers' own config classes
(which import without torch), so missing fields get HF's defaults and both the legacy
(`rope_theta`/`rope_scaling`/`rope_local_base_freq`) and the current (`rope_parameters`)
spellings are understood. Anything the decoder does not implement (biases on o_proj or the
MLP, attention-logit soft-capping, partial rotary, longrope, ...) raises ValueError instead of
being silently dropped.

The parameter pytree is the one documented in models/config.py: Linear weights transposed to
[in, out], layers stacked on a leading axis, Gemma's norm weights folded to 1 + w (computed in
float32, then cast), no "lm_head" when the embeddings are tied. Every array is a NumPy array of
`cfg.dtype`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np

from models.config import ModelConfig, RopeScaling, param_shapes

_SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "gemma3_text", "gemma3")

# --------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------


def _hf_config_object(hf_config: Any):
  """A transformers PretrainedConfig for `hf_config` (a dict is built with its family's class)."""
  if isinstance(hf_config, Mapping):
    model_type = hf_config.get("model_type")
    if model_type not in _SUPPORTED_MODEL_TYPES:
      raise ValueError(f"unsupported {model_type=}; expected one of {_SUPPORTED_MODEL_TYPES}")
    import transformers  # deferred: heavy, and only needed here (config classes need no torch)

    cls = transformers.CONFIG_MAPPING[model_type]
    return cls.from_dict(dict(hf_config))
  if not hasattr(hf_config, "model_type"):
    raise ValueError(f"hf_config must be a dict or a transformers PretrainedConfig, got {type(hf_config)}")
  return hf_config


def _rope_scaling_from_hf(params: Mapping[str, Any], *, max_position: int, where: str) -> RopeScaling | None:
  """models.config.RopeScaling from one (standardized) HF `rope_parameters` dict."""
  kind = params.get("rope_type", params.get("type", "default"))
  if params.get("partial_rotary_factor", 1.0) != 1.0:
    raise ValueError(f"{where}: partial_rotary_factor={params['partial_rotary_factor']} is not supported")
  if kind == "default":
    return None
  factor = params.get("factor")
  if kind == "linear":
    # HF's max_position_embeddings is the extended context; it divides inv_freq by `factor`.
    original = params.get("original_max_position_embeddings") or max(1, round(max_position / factor))
    return RopeScaling("linear", float(factor), int(original))
  if kind == "dynamic":
    # HF grows the base once the sequence passes max_position_embeddings (not
    # original_max_position_embeddings), using max_position_embeddings as the trained length.
    return RopeScaling("dynamic", float(factor), int(max_position))
  if kind == "llama3":
    return RopeScaling(
        "llama3",
        float(factor),
        int(params["original_max_position_embeddings"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
    )
  if kind == "yarn":
    original = int(params.get("original_max_position_embeddings") or max_position)
    if factor is None:
      factor = max_position / original
    if params.get("truncate", True) is False:
      raise ValueError(f"{where}: yarn with truncate=False is not supported")
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")

    def get_mscale(scale, m=1.0):
      return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
      if mscale and mscale_all_dim:
        attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
      elif factor <= 1:
        attention_factor = 1.0
    return RopeScaling(
        "yarn",
        float(factor),
        original,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=None if attention_factor is None else float(attention_factor),
    )
  raise ValueError(f"{where}: RoPE type {kind!r} is not supported (linear, dynamic, yarn, llama3)")


def config_from_hf(hf_config: Mapping[str, Any] | Any, *, name: str, dtype: str = "float32") -> ModelConfig:
  """The kvjax ModelConfig of a Hugging Face config.

  Args:
    hf_config: a config.json dict (or `PretrainedConfig.to_dict()`), or a transformers
      PretrainedConfig. model_type llama, mistral, qwen2, gemma3_text, or gemma3 (whose
      text_config is used).
    name: ModelConfig.name.
    dtype: ModelConfig.dtype ("float32", "bfloat16" or "float16").

  Raises:
    ValueError: an unsupported model type or feature.
  """
  if dtype not in _NP_DTYPES:
    raise ValueError(f"{dtype=} must be one of {sorted(_NP_DTYPES)}")
  outer = _hf_config_object(hf_config)
  hf = outer
  tie = getattr(outer, "tie_word_embeddings", None)
  if outer.model_type == "gemma3":
    hf = outer.text_config
    if isinstance(hf, Mapping):
      hf = _hf_config_object({**hf, "model_type": "gemma3_text"})
  model_type = hf.model_type
  if model_type not in _SUPPORTED_MODEL_TYPES:
    raise ValueError(f"unsupported {model_type=}; expected one of {_SUPPORTED_MODEL_TYPES}")
  if tie is None or outer is hf:
    tie = hf.tie_word_embeddings
  gemma = model_type == "gemma3_text"

  num_heads = hf.num_attention_heads
  num_kv_heads = getattr(hf, "num_key_value_heads", None) or num_heads
  head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
  num_layers = hf.num_hidden_layers
  max_position = hf.max_position_embeddings

  # Unsupported features fail loudly.
  act = hf.hidden_activation if gemma else hf.hidden_act
  activations = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
  if act not in activations or (not gemma and activations[act] != "silu"):
    raise ValueError(f"{model_type}: activation {act!r} is not supported")
  if model_type in ("llama", "gemma3_text") and getattr(hf, "attention_bias", False):
    raise ValueError(f"{model_type}: attention_bias=True (biases on q/k/v/o) is not supported")
  if getattr(hf, "mlp_bias", False):
    raise ValueError(f"{model_type}: mlp_bias=True is not supported")
  if gemma and hf.attn_logit_softcapping is not None:
    raise ValueError(f"gemma3: attn_logit_softcapping={hf.attn_logit_softcapping} is not supported")
  if gemma and getattr(hf, "use_bidirectional_attention", False):
    raise ValueError("gemma3: use_bidirectional_attention=True is not supported")

  # Attention windows (0 = global).
  if model_type == "llama":
    windows = (0,) * num_layers
  elif model_type == "mistral":
    windows = (int(hf.sliding_window or 0),) * num_layers
  else:  # qwen2, gemma3_text: per-layer layer_types (HF derives them from the legacy fields)
    layer_types = list(hf.layer_types)
    if len(layer_types) != num_layers:
      raise ValueError(f"{model_type}: {len(layer_types)=} != {num_layers=}")
    unknown = set(layer_types) - {"full_attention", "sliding_attention"}
    if unknown:
      raise ValueError(f"{model_type}: unsupported layer_types {sorted(unknown)}")
    window = int(hf.sliding_window or 0)
    windows = tuple(window if t == "sliding_attention" else 0 for t in layer_types)

  # RoPE.
  rope_params = hf.rope_parameters
  if gemma:
    global_params = rope_params["full_attention"]
    local_params = rope_params["sliding_attention"]
    if _rope_scaling_from_hf(local_params, max_position=max_position, where="gemma3 sliding layers") is not None:
      raise ValueError(f"gemma3: RoPE scaling of the sliding layers ({local_params}) is not supported")
    rope_local_theta = float(local_params["rope_theta"])
  else:
    if set(rope_params) & {"full_attention", "sliding_attention"}:
      raise ValueError(f"{model_type}: per-layer-type rope_parameters are not supported: {rope_params}")
    global_params, rope_local_theta = rope_params, None
  rope_scaling = _rope_scaling_from_hf(global_params, max_position=max_position, where=model_type)
  if rope_scaling is not None and not gemma and any(windows):
    # kvjax applies rope_scaling to global layers only (Gemma 3's rule); HF scales every layer.
    raise ValueError(f"{model_type}: RoPE scaling together with sliding-window layers is not supported")

  return ModelConfig(
      name=name,
      family="gemma3" if gemma else ("qwen2" if model_type == "qwen2" else "llama"),
      vocab_size=hf.vocab_size,
      hidden_size=hf.hidden_size,
      num_layers=num_layers,
      num_heads=num_heads,
      num_kv_heads=num_kv_heads,
      head_dim=head_dim,
      intermediate_size=hf.intermediate_size,
      max_position=max_position,
      rope_theta=float(global_params["rope_theta"]),
      norm_eps=float(hf.rms_norm_eps),
      tie_embeddings=bool(tie),
      qkv_bias=model_type == "qwen2",
      qk_norm=gemma,
      sandwich_norms=gemma,
      activation=activations[act],
      embed_scale=float(hf.hidden_size**0.5) if gemma else 1.0,
      attn_scale=float(hf.query_pre_attn_scalar) ** -0.5 if gemma else None,
      layer_windows=windows,
      rope_local_theta=rope_local_theta,
      rope_scaling=rope_scaling,
      final_logit_softcap=float(hf.final_logit_softcapping) if gemma and hf.final_logit_softcapping else None,
      dtype=dtype,
  )


# --------------------------------------------------------------------------------------
# State dict → layer-stacked pytree
# --------------------------------------------------------------------------------------

_NP_DTYPES = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
}

# Prefixes under which the text decoder's tensors appear (Gemma 3 multimodal checkpoints nest it).
_TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
_LM_HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight")
_IGNORED_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def _layer_map(cfg: ModelConfig) -> dict[str, tuple[str, bool]]:
  """kvjax layer leaf -> (HF name inside `layers.{i}.`, is a Linear weight to transpose)."""
  m = {
      "input_norm": ("input_layernorm.weight", False),
      "wq": ("self_attn.q_proj.weight", True),
      "wk": ("self_attn.k_proj.weight", True),
      "wv": ("self_attn.v_proj.weight", True),
      "wo": ("self_attn.o_proj.weight", True),
      "w_gate": ("mlp.gate_proj.weight", True),
      "w_up": ("mlp.up_proj.weight", True),
      "w_down": ("mlp.down_proj.weight", True),
  }
  if cfg.sandwich_norms:  # Gemma: post_attention_layernorm really is after attention
    m.update(
        post_attn_norm=("post_attention_layernorm.weight", False),
        pre_mlp_norm=("pre_feedforward_layernorm.weight", False),
        post_mlp_norm=("post_feedforward_layernorm.weight", False),
    )
  else:  # Llama/Qwen2: "post_attention_layernorm" is the norm in front of the MLP
    m["pre_mlp_norm"] = ("post_attention_layernorm.weight", False)
  if cfg.qkv_bias:
    m.update(
        bq=("self_attn.q_proj.bias", False),
        bk=("self_attn.k_proj.bias", False),
        bv=("self_attn.v_proj.bias", False),
    )
  if cfg.qk_norm:
    m.update(q_norm=("self_attn.q_norm.weight", False), k_norm=("self_attn.k_norm.weight", False))
  return m


def _is_ignored(name: str) -> bool:
  return name.endswith("inv_freq") or name.startswith(_IGNORED_PREFIXES)


def _text_prefix(state: Mapping[str, Any]) -> str:
  for prefix in _TEXT_PREFIXES:
    if f"{prefix}embed_tokens.weight" in state:
      return prefix
  raise ValueError(f"missing tensor: no embed_tokens.weight under any of {_TEXT_PREFIXES}")


def params_from_hf_state_dict(state: Mapping[str, np.ndarray], cfg: ModelConfig) -> dict:
  """The layer-stacked parameter pytree (models/config.py) of a Hugging Face state dict.

  Args:
    state: HF tensor name -> array (NumPy or anything `np.asarray` takes), e.g.
      "model.layers.0.self_attn.q_proj.weight" [out, in]. Gemma 3 multimodal names
      ("model.language_model.*", "language_model.model.*") are accepted; vision tensors and
      rotary `inv_freq` buffers are ignored.
    cfg: the model's config (see `config_from_hf`); its dtype is the output dtype.

  Returns:
    {"embed", "final_norm", ["lm_head"], "layers": {...}} of NumPy arrays in cfg.dtype.

  Raises:
    ValueError: naming the first missing, mis-shaped or unexpected tensor, or a tied
      checkpoint whose lm_head.weight differs from its embeddings.
  """
  if cfg.dtype not in _NP_DTYPES:
    raise ValueError(f"{cfg.dtype=} must be one of {sorted(_NP_DTYPES)}")
  out_dtype = _NP_DTYPES[cfg.dtype]
  shapes = param_shapes(cfg)
  gemma_norms = cfg.family == "gemma3"
  prefix = _text_prefix(state)
  used: set[str] = set()

  def fetch(hf_name: str, kv_shape: tuple[int, ...], transpose: bool, norm: bool) -> np.ndarray:
    if hf_name not in state:
      raise ValueError(f"missing tensor {hf_name!r} (expected shape {kv_shape[::-1] if transpose else kv_shape})")
    used.add(hf_name)
    x = np.asarray(state[hf_name])
    hf_shape = kv_shape[::-1] if transpose else kv_shape
    if x.shape != tuple(hf_shape):
      raise ValueError(f"tensor {hf_name!r} has shape {x.shape}, expected {tuple(hf_shape)}")
    if norm and gemma_norms:
      x = 1.0 + x.astype(np.float32)  # Gemma applies (1 + w) in float32
    dtype = np.float32 if norm else out_dtype  # norm weights stay float32 (models.config.leaf_dtype)
    return np.array(x.T if transpose else x, dtype=dtype, order="C")  # a copy, never a memmap view

  params: dict[str, Any] = {
      "embed": fetch(f"{prefix}embed_tokens.weight", shapes["embed"], False, False),
      "final_norm": fetch(f"{prefix}norm.weight", shapes["final_norm"], False, True),
  }
  lm_head_name = next((n for n in _LM_HEAD_NAMES if n in state), None)
  if cfg.tie_embeddings:
    if lm_head_name is not None:
      used.add(lm_head_name)
      if not np.array_equal(np.asarray(state[lm_head_name]), np.asarray(state[f"{prefix}embed_tokens.weight"])):
        raise ValueError(f"{lm_head_name!r} differs from the embeddings but the config ties them")
  else:
    params["lm_head"] = fetch(lm_head_name or "lm_head.weight", shapes["lm_head"], True, False)

  layers = {}
  for leaf, (suffix, transpose) in _layer_map(cfg).items():
    per_layer = shapes["layers"][leaf][1:]
    norm = leaf.endswith("norm")
    layers[leaf] = np.stack([
        fetch(f"{prefix}layers.{i}.{suffix}", per_layer, transpose, norm) for i in range(cfg.num_layers)
    ])
  assert set(layers) == set(shapes["layers"]), (sorted(layers), sorted(shapes["layers"]))
  params["layers"] = layers

  unexpected = sorted(n for n in state if n not in used and not _is_ignored(n))
  if unexpected:
    more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
    raise ValueError(f"unexpected tensor {unexpected[0]!r}{more} for a {cfg.family} config")
  return params


# --------------------------------------------------------------------------------------
# safetensors, read with NumPy
# --------------------------------------------------------------------------------------

_SAFETENSORS_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype(ml_dtypes.bfloat16)}
_MAX_HEADER_BYTES = 100 * 1024 * 1024


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
  """All tensors of one .safetensors file as read-only NumPy arrays (memory-mapped).

  The format: an 8-byte little-endian header length N, N bytes of JSON
  {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}, then the
  raw little-endian data, offsets relative to its start. F32, F16 and BF16 are supported.

  Raises:
    ValueError: naming the file, when it is truncated or its header is corrupt, or when a
      tensor has another dtype.
  """
  path = os.fspath(path)
  size = os.path.getsize(path)
  if size < 8:
    raise ValueError(f"{path}: truncated safetensors file ({size} bytes, no header length)")
  with open(path, "rb") as f:
    header_len = int.from_bytes(f.read(8), "little")
    if header_len > min(size - 8, _MAX_HEADER_BYTES):
      raise ValueError(f"{path}: corrupt or truncated safetensors file (header length {header_len}, file {size} bytes)")
    raw_header = f.read(header_len)
  try:
    header = json.loads(raw_header.decode("utf-8"))
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f"{path}: corrupt safetensors header ({e})") from None
  if not isinstance(header, dict):
    raise ValueError(f"{path}: corrupt safetensors header (not a JSON object)")
  data_start = 8 + header_len
  data_len = size - data_start
  data = np.memmap(path, dtype=np.uint8, mode="r", offset=data_start, shape=(data_len,)) if data_len else None
  tensors = {}
  for name, info in header.items():
    if name == "__metadata__":
      continue
    try:
      dtype_name, shape, (begin, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
    except (KeyError, TypeError, ValueError):
      raise ValueError(f"{path}: corrupt safetensors header entry for {name!r}: {info!r}") from None
    if dtype_name not in _SAFETENSORS_DTYPES:
      raise ValueError(f"{path}: tensor {name!r} has dtype {dtype_name}; only F32, F16 and BF16 are supported")
    dtype = _SAFETENSORS_DTYPES[dtype_name]
    nbytes = math.prod(shape) * dtype.itemsize
    if not (0 <= begin <= end <= data_len) or end - begin != nbytes:
      raise ValueError(
          f"{path}: corrupt or truncated safetensors file: tensor {name!r} {dtype_name}{list(shape)} "
          f"needs bytes [{begin}, {end}) of {data_len}"
      )
    if nbytes == 0:
      tensors[name] = np.zeros(shape, dtype)
    else:
      tensors[name] = data[begin:end].view(dtype).reshape(shape)
  return tensors


def _checkpoint_files(path: str) -> list[str]:
  index = os.path.join(path, "model.safetensors.index.json")
  if os.path.exists(index):
    try:
      with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
      raise ValueError(f"{index}: corrupt safetensors index ({e!r})") from None
    files = sorted(set(weight_map.values()))
  else:
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
  if not files:
    raise ValueError(f"{path}: no *.safetensors files")
  return [os.path.join(path, f) for f in files]


def load_hf_directory(
    path: str | os.PathLike, *, dtype: str = "float32", name: str | None = None
) -> tuple[ModelConfig, dict]:
  """Config and parameters of a Hugging Face checkpoint directory, without torch.

  Args:
    path: a directory with config.json and model.safetensors, or several shards listed by
      model.safetensors.index.json.
    dtype: the parameters' dtype ("float32", "bfloat16", "float16").
    name: ModelConfig.name; defaults to the directory's name.

  Returns:
    (ModelConfig, params) as `config_from_hf` and `params_from_hf_state_dict` give them.
  """
  path = os.fspath(path)
  config_path = os.path.join(path, "config.json")
  if not os.path.exists(config_path):
    raise ValueError(f"{path}: no config.json")
  with open(config_path) as f:
    try:
      hf_config = json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"{config_path}: not valid JSON ({e})") from None
  cfg = config_from_hf(hf_config, name=name or os.path.basename(os.path.normpath(path)), dtype=dtype)
  state: dict[str, np.ndarray] = {}
  for file in _checkpoint_files(path):
    if not os.path.exists(file):
      raise ValueError(f"{file}: listed in the index but missing")
    for tensor_name, array in read_safetensors(file).items():
      if tensor_name in state:
        raise ValueError(f"{file}: tensor {tensor_name!r} also appears in another shard")
      state[tensor_name] = array
  return cfg, params_from_hf_state_dict(state, cfg)
