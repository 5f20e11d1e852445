"""Writes the PyTorch `transformers` reference fixtures in tests/fixtures/ (run once, by hand).

CI never installs torch: this script runs in a separate virtual environment and its small
outputs are committed. See tests/fixtures/README.md for the exact commands and the format.

Each fixture is a tiny, randomly initialised float32 model of one family. The script records
the prompt's prefill logits and 16 greedy decode steps taken through HF's KV cache, and checks
its own work: the cached decode must match a cache-free forward pass over the whole sequence,
and for sliding-window models the window must change the logits (it "bites").

Usage (from the repository root):
  /root/torchenv/bin/python tests/make_parity_fixtures.py [--out tests/fixtures] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import json
import math
import os

import numpy as np
import torch
import transformers

BATCH = 2
PROMPT_LEN = 24
DECODE_STEPS = 16

# name -> (model class name, config class name, config kwargs, init options)
_LLAMA = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)
_LLAMA_SMALL = dict(_LLAMA, vocab_size=128, num_hidden_layers=2)

FIXTURES = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", _LLAMA, {}),
    "llama_rope_llama3": (
        "LlamaForCausalLM",
        "LlamaConfig",
        dict(
            _LLAMA_SMALL,
            max_position_embeddings=2048,
            # head_dim 16, theta 1e4: wavelengths 6.3 … 19869; with original 256 and factors 1/4 the
            # bands are: 3 high-frequency pairs kept, 1 smoothed pair, 4 low-frequency pairs ÷ 8.
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=256,
            ),
        ),
        {},
    ),
    "llama_rope_linear": (
        "LlamaForCausalLM",
        "LlamaConfig",
        dict(_LLAMA_SMALL, max_position_embeddings=1024, rope_scaling=dict(rope_type="linear", factor=4.0)),
        {},
    ),
    "llama_rope_yarn": (
        "LlamaForCausalLM",
        "LlamaConfig",
        dict(
            _LLAMA_SMALL,
            max_position_embeddings=256,
            rope_theta=500.0,
            rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64),
        ),
        {},
    ),
    "mistral": (
        "MistralForCausalLM",
        "MistralConfig",
        dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            max_position_embeddings=512,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            sliding_window=16,  # bites inside the 24-token prompt already
            tie_word_embeddings=False,
        ),
        {},
    ),
    "qwen2": (
        "Qwen2ForCausalLM",
        "Qwen2Config",
        dict(
            vocab_size=256,
            hidden_size=96,  # head_dim = 96 / 6 = 16 (Qwen2 derives it)
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=2,
            max_position_embeddings=512,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            tie_word_embeddings=True,
            use_sliding_window=False,
        ),
        {"bias_std": 0.5},
    ),
    "gemma3": (
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=32,  # num_heads * head_dim = 128 != hidden 64, as in real Gemma 3
            max_position_embeddings=1024,
            rms_norm_eps=1e-6,
            query_pre_attn_scalar=24,  # != head_dim on purpose
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            rope_theta=1000000.0,
            rope_local_base_freq=10000.0,
            rope_scaling=dict(rope_type="linear", factor=4.0),  # global layers only
            final_logit_softcapping=10.0,
            attn_logit_softcapping=None,
            hidden_activation="gelu_pytorch_tanh",
            tie_word_embeddings=True,
        ),
        {"gemma_norms": True},
    ),
}

META_KEYS = (
    "input_ids",
    "prefill_logits",
    "decode_tokens",
    "decode_logits",
    "hf_config",
    "transformers_version",
    "torch_version",
    "model_class",
)


def _init_weights(model: torch.nn.Module, *, seed: int, gemma_norms: bool = False, bias_std: float = 0.0):
  """Overwrites HF's tiny-std init with values that give O(1) activations and clear argmaxes."""
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        if gemma_norms:  # stored w, applied as 1 + w
          p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        else:
          p.copy_(0.5 + torch.rand(p.shape, generator=g))
      elif name.endswith(".bias"):
        p.copy_(torch.randn(p.shape, generator=g) * bias_std)
      elif "embed_tokens" in name:
        # Tied embeddings double as the LM head: scale them so the logits have std ~3. (Gemma also
        # multiplies the input embedding by sqrt(hidden); the RMSNorms make that scale harmless.)
        std = 3.0 / math.sqrt(p.shape[1]) if model.config.tie_word_embeddings else 1.0
        p.copy_(torch.randn(p.shape, generator=g) * std)
      elif p.ndim == 2:  # Linear weight [out, in]
        gain = 3.0 if name.startswith("lm_head") else 1.0
        p.copy_(torch.randn(p.shape, generator=g) * gain / math.sqrt(p.shape[1]))
      else:
        raise AssertionError(f"unhandled parameter {name}")


def _logits(out) -> torch.Tensor:
  return out.logits.float()


def _cache_of(out):
  return out.cache if hasattr(out, "cache") else out.past_key_values


def _run(model, input_ids: torch.Tensor):
  """Prefill + DECODE_STEPS greedy steps through HF's own DynamicCache."""
  with torch.no_grad():
    out = model(input_ids=input_ids, use_cache=True)
    prefill = _logits(out)
    cache = _cache_of(out)
    tok = prefill[:, -1].argmax(-1)
    tokens, logits, margins = [], [], []
    top2 = prefill[:, -1].topk(2, dim=-1).values
    margins.append((top2[:, 0] - top2[:, 1]).min().item())
    for _ in range(DECODE_STEPS):
      tokens.append(tok)
      out = model(input_ids=tok[:, None], cache=cache, use_cache=True)
      cache = _cache_of(out)
      step = _logits(out)[:, -1]
      logits.append(step)
      top2 = step.topk(2, dim=-1).values
      margins.append((top2[:, 0] - top2[:, 1]).min().item())
      tok = step.argmax(-1)
  return prefill, torch.stack(tokens, 1), torch.stack(logits, 1), min(margins)


def _full_forward(model, ids: torch.Tensor) -> torch.Tensor:
  with torch.no_grad():
    return _logits(model(input_ids=ids, use_cache=False))


def make_fixture(name: str, out_dir: str, seed: int) -> str:
  model_cls_name, cfg_cls_name, cfg_kwargs, init_opts = FIXTURES[name]
  cfg_cls = getattr(transformers, cfg_cls_name)
  model_cls = getattr(transformers, model_cls_name)
  config = cfg_cls(**cfg_kwargs)
  config._attn_implementation = "eager"
  torch.manual_seed(seed)
  model = model_cls(config).float().eval()
  model.config._attn_implementation = "eager"
  _init_weights(model, seed=seed, **init_opts)

  g = torch.Generator().manual_seed(seed + 1)
  input_ids = torch.randint(1, config.vocab_size, (BATCH, PROMPT_LEN), generator=g)
  prefill, dec_tokens, dec_logits, margin = _run(model, input_ids)

  # Self-check 1: cached decode == cache-free forward over prompt + generated tokens.
  full_ids = torch.cat([input_ids, dec_tokens], dim=1)
  full = _full_forward(model, full_ids)
  np.testing.assert_allclose(full[:, :PROMPT_LEN].numpy(), prefill.numpy(), rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(full[:, PROMPT_LEN:].numpy(), dec_logits.numpy(), rtol=1e-4, atol=1e-4)

  # Self-check 2: a sliding window, if any, changes the logits.
  window = getattr(config, "sliding_window", None)
  layer_types = getattr(config, "layer_types", None) or []
  if window is not None and (name == "mistral" or "sliding_attention" in layer_types):
    assert PROMPT_LEN + DECODE_STEPS > window
    saved = model.config.sliding_window
    for mod in model.modules():
      if getattr(mod, "sliding_window", None) == saved:
        mod.sliding_window = 10**6
    model.config.sliding_window = 10**6
    unwindowed = _full_forward(model, full_ids)
    model.config.sliding_window = saved
    for mod in model.modules():
      if getattr(mod, "sliding_window", None) == 10**6:
        mod.sliding_window = saved
    diff = (unwindowed[:, -DECODE_STEPS:] - full[:, -DECODE_STEPS:]).abs().max().item()
    assert diff > 1e-2, f"{name}: sliding window does not change the logits ({diff=})"
    print(f"  {name}: removing the window changes decode logits by up to {diff:.3f}")

  # Self-check 3: RoPE scaling, if any, changes the logits.
  if "rope_scaling" in cfg_kwargs:
    plain_kwargs = {k: v for k, v in cfg_kwargs.items() if k != "rope_scaling"}
    plain = model_cls(cfg_cls(**plain_kwargs)).float().eval()
    plain.config._attn_implementation = "eager"
    plain.load_state_dict(model.state_dict())
    diff = (_full_forward(plain, full_ids) - full).abs().max().item()
    assert diff > 1e-2, f"{name}: RoPE scaling does not change the logits ({diff=})"
    print(f"  {name}: removing the RoPE scaling changes logits by up to {diff:.3f}")

  state = model.state_dict()
  if config.tie_word_embeddings:
    state.pop("lm_head.weight", None)  # as save_pretrained does for tied weights
  arrays = {k: v.detach().float().numpy().copy() for k, v in state.items()}
  assert not set(arrays) & set(META_KEYS)
  hf_config = config.to_dict()
  hf_config.pop("_attn_implementation", None)
  path = os.path.join(out_dir, f"{name}.npz")
  np.savez_compressed(
      path,
      input_ids=input_ids.numpy().astype(np.int32),
      prefill_logits=prefill.numpy().astype(np.float32),
      decode_tokens=dec_tokens.numpy().astype(np.int32),
      decode_logits=dec_logits.numpy().astype(np.float32),
      hf_config=np.array(json.dumps(hf_config, sort_keys=True, default=str)),
      transformers_version=np.array(transformers.__version__),
      torch_version=np.array(torch.__version__),
      model_class=np.array(model_cls_name),
      **arrays,
  )
  print(
      f"{path}: {os.path.getsize(path)} bytes, {len(arrays)} tensors, logits std {prefill.std():.2f}, "
      f"min top-2 margin {margin:.4f}"
  )
  return path


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "fixtures"))
  parser.add_argument("--only", nargs="*", default=None, choices=sorted(FIXTURES))
  parser.add_argument("--seed", type=int, default=1234)
  args = parser.parse_args()
  os.makedirs(args.out, exist_ok=True)
  torch.use_deterministic_algorithms(True)
  torch.set_num_threads(1)
  for i, name in enumerate(sorted(FIXTURES)):
    if args.only and name not in args.only:
      continue
    make_fixture(name, args.out, args.seed + 100 * i)


if __name__ == "__main__":
  main()
