"""InfiniteBench's key-value retrieval (Zhang et al. 2024, "∞Bench", task kv_retrieval).

A JSON object of random UUID keys and UUID values; the question names one key and the
answer is its value. The prompt follows InfiniteBench's ("Extract the value corresponding to
the specified key in the JSON object below." / `Key: "<key>"` / "The value associated with
the specified key is:"), the last line becoming the answer prefix. kvjax controls where the
asked pair sits (its depth among the object's tokens) and sizes the object in tokens.
Scored exactly: the value must appear as a whole word (scoring.kv_exact).

RetrievalAttention evaluates this task with top-k 2000 rather than 100 (Liu et al. 2024,
§5): a UUID spreads over ~25 tokens that all need to be attended.
"""

from __future__ import annotations

import dataclasses
import json
import random

from kvjax.eval import layout, niah, sizing
from kvjax.eval.sample import Sample

INSTRUCTION = "Extract the value corresponding to the specified key in the JSON object below.\n\n"
ANSWER_PREFIX = "The value associated with the specified key is:"


def kv_retrieval(tokenizer: sizing.TextTokenizer, *, length: int, seed: int = 0, depth: float | None = None,
                 tolerance: float = sizing.DEFAULT_TOLERANCE) -> Sample:
  """One kv-retrieval sample of `length` tokens; the asked pair at `depth` (random when None)."""
  rng = random.Random(f"kv_retrieval/{seed}")
  where = rng.choice(niah.DEPTHS) if depth is None else depth
  taken: set[str] = set()
  key, value = niah.unique_values(rng, "uuids", 2, taken)

  def pairs():
    while True:
      k, v = niah.unique_values(rng, "uuids", 2, taken)
      yield f"{json.dumps(k)}: {json.dumps(v)}"

  def wrap(context: str) -> tuple[str, int]:
    head = INSTRUCTION + "{"
    return head + context + "}" + f'\n\nKey: "{key}"', len(head)

  built = layout.fit_layout(tokenizer, pairs(), [f"{json.dumps(key)}: {json.dumps(value)}"], [where], wrap,
                            length=length, sep=", ", tolerance=tolerance)
  sample = layout.needle_sample(tokenizer, "kv_retrieval", built, [key], (value,), [0], depth=depth, length=length,
                                seed=seed, answer_prefix=ANSWER_PREFIX, max_new_tokens=50,  # InfiniteBench's
                                meta={"key": key, "pairs": built.units + 1})
  return dataclasses.replace(sample, metric="kv_exact")
