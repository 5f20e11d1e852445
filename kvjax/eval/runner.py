"""Decodes task samples under several attention policies and scores them.

Prefill is per policy: the policy decides the state the prompt is prefilled into (a dense
cache, a sink + window ring with a host store, an index...), and kvjax's public API has no
conversion between states. What can be shared is shared: policy specs that differ only in
decode-time options (the policy's `decode_options`, e.g. retrieval's topk / speculative /
tau, freekv's speculative / tau) form one group, prefilled once and copied in memory
(kvjax.copy_context) for each further member (decode consumes a context). So a sample costs
one prefill per group, not per spec; with a ContextStore, one per group across runs.

Decoding is greedy and token by token through kvjax.decode, so every generated token after
the first runs the policy's sparse decode path, not only the prefill.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

import kvjax
from kvjax.eval.context_store import ContextStore
from kvjax.eval.sample import Sample
from kvjax.policies import make_policy


@dataclasses.dataclass(frozen=True)
class PolicySpec:
  """A policy and its options, under a label for tables.

  Attributes:
    policy: the policy name (kvjax.policy_names()).
    options: the policy's keyword options (e.g. dict(index="roar", topk=100)).
    label: the name in records and tables; default: the policy name and its options.
  """

  policy: str
  options: dict[str, Any] = dataclasses.field(default_factory=dict)
  label: str = ""

  def __post_init__(self):
    make_policy(self.policy, **self.options)  # an unknown policy or option fails here, before any work
    if not self.label:
      extra = ",".join(f"{k}={v}" for k, v in sorted(self.options.items()))
      object.__setattr__(self, "label", f"{self.policy}({extra})" if extra else self.policy)

  @classmethod
  def parse(cls, text: str) -> PolicySpec:
    """'retrieval:index=roar:topk=100' -> PolicySpec("retrieval", {"index": "roar", "topk": 100}).

    The form is name[:option=value]...[@label]; values are read as int, float, true/false,
    or else kept as strings; a dense_layers value lists layers with '+' ("0+1").
    """
    body, _, label = text.strip().partition("@")
    name, *parts = body.split(":")
    options: dict[str, Any] = {}
    for part in parts:
      key, sep, raw = part.partition("=")
      if not sep or not key:
        raise ValueError(f"policy spec {text!r}: {part!r} is not option=value")
      options[key] = _parse_value(key, raw)
    return cls(name, options, label)

  def prefill_key(self) -> tuple:
    """Specs with equal keys can share one prefill (they differ only in decode options)."""
    decode_only = set(make_policy(self.policy).decode_options)
    return (self.policy, tuple(sorted((k, repr(v)) for k, v in self.options.items() if k not in decode_only)))


def _parse_value(key: str, raw: str):
  if key == "dense_layers":
    return tuple(int(x) for x in raw.split("+") if x)
  if raw.lower() in ("true", "false"):
    return raw.lower() == "true"
  for kind in (int, float):
    try:
      return kind(raw)
    except ValueError:
      pass
  return raw


def prompt_ids(tokenizer, sample: Sample) -> list[int]:
  """The token ids the model reads: the chat-wrapped user message, then the answer prefix.

  RULER puts its answer prefix at the start of the assistant turn, so the model continues
  "The special magic number for ... is" instead of choosing its own answer form. Models
  without a chat template read the message, a newline, and the prefix.
  """
  if tokenizer.has_chat_template:
    text = tokenizer.apply_chat_template([{"role": "user", "content": sample.text}]) + sample.answer_prefix
    return tokenizer.encode(text, add_bos=False)
  return tokenizer.encode(sample.text + "\n" + sample.answer_prefix)


REFERENCE = "full"  # the label whose logits give the other records' split fields (`split_at_reference`)


def top2_margins(logits: np.ndarray) -> np.ndarray:  # [steps, vocab] -> [steps]
  """Each step's top-1 minus top-2 logit: how near greedy decoding was to another token."""
  top2 = np.partition(np.asarray(logits, np.float32), -2, axis=-1)[..., -2:]
  return top2[..., 1] - top2[..., 0]


def first_split(reference_tokens: Sequence[int], tokens: Sequence[int]) -> int | None:
  """The index of the first token where `tokens` departs from `reference_tokens` (one of them
  ending there counts as departing), None where both are the same."""
  n = min(len(reference_tokens), len(tokens))
  split = next((i for i in range(n) if reference_tokens[i] != tokens[i]), n)
  return None if split == n and len(reference_tokens) == len(tokens) else split


def split_at_reference(reference_tokens: Sequence[int], tokens: Sequence[int], reference_logits: np.ndarray,
                       stop_tokens: Sequence[int]) -> dict:  # reference_logits [steps, vocab]
  """What the greedy reference's own logits say at the first token where `tokens` departs from it.

  Both decoded the same prefix up to that token, so the reference's logits there score the
  policy's choice as the reference saw it:
    full_margin_at_split: the reference's top-1 minus top-2 logit (how near it was to any other token);
    full_gap_at_split: its top-1 minus its logit of the token the policy chose (the best-scored stop
      token where the policy stopped there), >= 0, = the margin where the policy took its runner-up;
    full_rank_at_split: that token's place in its ranking (1: its runner-up).
  A loss at a gap near 0 turns a near-tie of the reference itself, which bfloat16 rounding or another
  batch turns as well; a loss at a wide gap or a far rank is the policy's own. Every field is None
  where the tokens never depart, or the reference has no logits there (it ended by `stop_when` or
  its token budget), or the policy ended with no stop token to score.
  """
  fields = ("full_margin_at_split", "full_gap_at_split", "full_rank_at_split")
  split = first_split(reference_tokens, tokens)
  if split is None or split >= len(reference_logits):
    return dict.fromkeys(fields)
  row = np.asarray(reference_logits[split], np.float32)  # [vocab]
  if split < len(tokens):
    chosen = float(row[tokens[split]])
  elif stop_tokens:  # the policy chose a stop token where the reference went on
    chosen = float(row[list(stop_tokens)].max())
  else:
    return dict.fromkeys(fields)
  margin = float(top2_margins(row[None])[0])
  return dict(zip(fields, (round(margin, 4), round(float(row.max()) - chosen, 4), int((row > chosen).sum()))))


def _jsonable(value):
  if isinstance(value, dict):
    return {str(k): _jsonable(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_jsonable(v) for v in value]
  if isinstance(value, np.generic):
    return value.item()
  if isinstance(value, float) and not math.isfinite(value):
    return None
  return value


def _record(sample: Sample, spec: PolicySpec, result, ids: list[int], *, shared: bool, copy_seconds: float,
            copy_times: dict, decode_seconds: float) -> dict:
  text = result.texts[0] if result.texts is not None else ""
  return _jsonable({
      "task": sample.task,
      "length": sample.length,
      "prompt_tokens": len(ids),
      "depth": sample.depth,
      "answer_depths": sample.meta.get("answer_depths"),
      "seed": sample.seed,
      "policy": spec.label,
      "policy_name": spec.policy,
      "options": dict(spec.options),
      "score": sample.score(text),
      "metric": sample.metric,
      "answers": list(sample.answers),
      "generated": text,
      "generated_tokens": len(result.tokens[0]),
      "ms_per_token": result.ms_per_token,
      "prefill_seconds": result.prefill_seconds,
      "prefill_shared": shared,
      "copy_seconds": copy_seconds,
      **{f"copy_{part}": seconds for part, seconds in copy_times.items()},
      "decode_seconds": decode_seconds,
      "policy_stats": result.policy_stats,
  })


def run_sample(
    model,
    sample: Sample,
    policies: Sequence[PolicySpec],
    *,
    max_new_tokens: int | None = None,
    prefill_chunk: int = 1024,
    early_stop: bool = False,
    contexts: ContextStore | None = None,
) -> list[dict]:
  """Decodes `sample` under every spec in `policies`; one record per spec, in their order.

  Args:
    model: from kvjax.load_model; it needs a tokenizer (the sample is text).
    sample: from kvjax.eval.make_sample, made with this model's tokenizer.
    policies: the specs to compare.
    max_new_tokens: generation per decode; default: the sample's own.
    prefill_chunk: prompt tokens per prefill step.
    early_stop: also stop a decode once its text is `Sample.complete` (every answer in it, for
      the substring metrics): the score is the one the whole generation would get, in fewer
      steps; kv_retrieval (whole-word match) always decodes in full.
    contexts: load each group's prefilled context from this store when a run before saved it,
      and save it there otherwise (kvjax.eval.ContextStore); None: prefill every time.

  Returns:
    Flat-ish dicts: task, length, prompt_tokens, depth, answer_depths, seed, policy (label),
    policy_name, options, score, metric (the scorer: kvjax.eval.scoring), answers, generated,
    generated_tokens, ms_per_token, prefill_seconds, prefill_shared, copy_seconds (the in-memory
    copy of a shared prefill this decode started from; 0 for the group's first member), on copies
    copy_host_s, copy_device_s and copy_attach_s (its parts: PrefilledContext.setup_times),
    decode_seconds (the whole decode call's wall time), policy_stats, and with a store
    context_loaded, context_load_seconds and context_made_by (the group's prefill_seconds are then
    those of the run that made it). Where a spec is labelled "full" the other records also
    carry full_margin_at_split, full_gap_at_split and full_rank_at_split (`split_at_reference`:
    full's logits where their tokens first depart from full's, None where they never do); full's
    decode_seconds then include copying its logits to the host each step (its ms_per_token do not).
  """
  if model.tokenizer is None:
    raise ValueError(f"model {model.cfg.name!r} has no tokenizer; attach one to run text tasks")
  if not policies:
    raise ValueError("policies is empty")
  labels = [p.label for p in policies]
  if len(set(labels)) != len(labels):
    raise ValueError(f"policy labels must be unique: {labels}")
  new_tokens = max_new_tokens or sample.max_new_tokens
  ids = prompt_ids(model.tokenizer, sample)
  stop = sorted(model.tokenizer.eos_ids)
  # Early stop ends a decode once its text holds every answer: the score is then final.
  stop_when = (lambda generated: sample.complete(model.tokenizer.decode(generated))) if early_stop else None
  groups: dict[tuple, list[int]] = {}
  for i, spec in enumerate(policies):
    groups.setdefault(spec.prefill_key(), []).append(i)

  records: list[dict | None] = [None] * len(policies)
  tokens: list[list[int]] = [[] for _ in policies]
  reference_logits = None  # [steps, vocab] float32, kept until every member has decoded
  for members in groups.values():
    first = policies[members[0]]
    stored = None
    if contexts is None:
      context = kvjax.prefill(model, ids, max_new_tokens=new_tokens, policy=first.policy,
                              policy_options=first.options, prefill_chunk=prefill_chunk)
    else:
      stored = contexts.prefill(model, ids, first.policy, first.options, max_new_tokens=new_tokens,
                                prefill_chunk=prefill_chunk)
      context = stored.context
    # Decode consumes a context: the later members decode copies of it, each copied just before
    # (two contexts held at a time) with every decode option given explicitly (unset ones must
    # not inherit the first spec's), and the first member decodes the prefilled one last.
    for i in members[1:] + members[:1]:
      copy_seconds, member_context = 0.0, context
      if i != members[0]:
        member_policy = make_policy(policies[i].policy, **policies[i].options)
        t0 = time.perf_counter()
        member_context = kvjax.copy_context(context, model, policy_options=member_policy.decode_option_values())
        copy_seconds = time.perf_counter() - t0
      t1 = time.perf_counter()
      is_reference = policies[i].label == REFERENCE
      result = kvjax.decode(model, member_context, max_new_tokens=new_tokens, temperature=0.0, stop_tokens=stop,
                            stop_when=stop_when, return_logits=is_reference)
      tokens[i] = result.tokens[0]
      if is_reference:
        reference_logits = np.asarray(result.logits[:, 0], np.float32)
      records[i] = _record(sample, policies[i], result, ids, shared=len(members) > 1, copy_seconds=copy_seconds,
                           copy_times=member_context.setup_times,
                           decode_seconds=time.perf_counter() - t1) | {"early_stop": early_stop}
      if stored is not None:
        records[i] |= {"context_loaded": stored.loaded, "context_load_seconds": stored.load_seconds,
                       "context_made_by": stored.made_by}
  if reference_logits is not None:
    ref = labels.index(REFERENCE)
    for i, record in enumerate(records):
      if i != ref:
        record |= split_at_reference(tokens[ref], tokens[i], reference_logits, stop)
  return records  # type: ignore[return-value]


def run_samples(model, samples: Iterable[Sample], policies: Sequence[PolicySpec], *,
                on_record: Callable[[dict], None] | None = None, **kwargs) -> list[dict]:
  """run_sample over `samples`; `on_record` sees each record as it is made (progress, logs)."""
  out = []
  for sample in samples:
    for record in run_sample(model, sample, policies, **kwargs):
      if on_record is not None:
        on_record(record)
      out.append(record)
  return out
