"""kvjax: long-context decoding with a CPU-offloaded, retrieval-based KV cache.

    import kvjax
    model = kvjax.load_model("smollm2")
    result = kvjax.generate(model, "What is the capital of France?", max_new_tokens=16)
    print(result.texts[0], result.ms_per_token)
"""

from kvjax.context_cache import copy_context, load_context, save_context
from kvjax.determinism import use_deterministic_xla
from kvjax.generate import GenerationResult, PrefilledContext, check_context, decode, generate, prefill
from kvjax.policies import AttentionPolicy, make_policy, policy_names
from kvjax.prompts import PasskeyPrompt, passkey_prompt
from kvjax.sampling import SamplingConfig


def load_model(name_or_path: str = "smollm2", *, devices: int | list | None = None, **kwargs):
  """Loads a model by name or path (see models.registry.load_model).

  devices: shard the KV heads (and the weights, tensor-parallel) over this many local devices,
    or these jax.Devices (kvjax.sharding); None or 1 keeps the model on one device. A count that does not divide
    the model's KV heads is a ValueError naming both numbers.
  """
  from models.registry import load_model as _load

  if devices is not None:  # checked before the weights load
    from kvjax.sharding import check_devices, shard_model

    devices = check_devices(devices)
  model = _load(name_or_path, **kwargs)
  return model if devices is None else shard_model(model, devices)


__all__ = [
    "AttentionPolicy",
    "GenerationResult",
    "PrefilledContext",
    "PasskeyPrompt",
    "SamplingConfig",
    "check_context",
    "copy_context",
    "decode",
    "generate",
    "load_context",
    "load_model",
    "make_policy",
    "passkey_prompt",
    "policy_names",
    "prefill",
    "save_context",
    "use_deterministic_xla",
]
