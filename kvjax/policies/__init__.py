"""Attention policies behind one switch: `make_policy(name, **options)`."""

from __future__ import annotations

from kvjax.policies.base import AttentionPolicy
from kvjax.policies.freekv import FreeKVAttention
from kvjax.policies.full import DenseKVCache, FullAttention
from kvjax.policies.quest import QuestAttention
from kvjax.policies.retrieval import RetrievalAttention
from kvjax.policies.streaming import StreamingLLM

_POLICIES = {"full": FullAttention, "quest": QuestAttention, "streaming": StreamingLLM, "retrieval": RetrievalAttention, "freekv": FreeKVAttention}


def policy_names() -> tuple[str, ...]:
  return tuple(sorted(_POLICIES))


def make_policy(name: str | AttentionPolicy, **options) -> AttentionPolicy:
  """Builds a policy by name; an option the policy does not take is an error, not ignored."""
  if isinstance(name, AttentionPolicy):
    if options:
      raise ValueError(f"options {sorted(options)} given with an already built policy {name!r}")
    return name
  if name not in _POLICIES:
    raise ValueError(f"unknown policy={name!r}; known: {', '.join(policy_names())}")
  cls = _POLICIES[name]
  fields = {f for f in cls.__dataclass_fields__ if f != "name"}
  unknown = sorted(set(options) - fields)
  if unknown:
    raise ValueError(f"policy {name!r} does not take {unknown}; it takes {sorted(fields)}")
  return cls(**options)


__all__ = ["AttentionPolicy", "FreeKVAttention", "DenseKVCache", "FullAttention", "RetrievalAttention", "QuestAttention", "StreamingLLM", "make_policy", "policy_names"]
