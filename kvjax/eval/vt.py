"""Variable tracking (RULER's multi-hop tracing task, Hsieh et al. 2024, §3.1 and App. B).

A chain "VAR X0 = 12345", "VAR X1 = VAR X0 ", ..., "VAR X{h} = VAR X{h-1} " is hidden, one
statement at a time in order, at random depths of RULER's repeated noise; the question asks
for every variable that holds the chain's value. RULER's defaults, used here: one chain
(`num_chains` = 1; more chains add distractor chains with other values), `num_hops` = 4 (so
5 variables), variable names of 5 random capital letters, values of 5 digits, and one
in-context example of the task (3-letter names, 20 noise sentences) before the prompt.
Scored by string_match_all over the chain's variables.
"""

from __future__ import annotations

import random
import string

from kvjax import prompts
from kvjax.eval import layout, sizing
from kvjax.eval.sample import Sample

TEMPLATE = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
            "Question: Find all variables that are assigned the value {query} in the text above.")
# RULER's prefix, with its typo "assgined" corrected.
ANSWER_PREFIX = ("Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables "
                 "are assigned the value {query}, they are:")
EXAMPLE_NOISE = 20


def chains(rng: random.Random, *, num_chains: int, num_hops: int, name_len: int = 5):
  """[(variables, statements)] per chain; variables[0] holds the chain's value."""
  names: list[str] = []
  while len(names) < num_chains * (num_hops + 1):
    name = "".join(rng.choices(string.ascii_uppercase, k=name_len))
    if name not in names:
      names.append(name)
  out = []
  values: set[int] = set()
  for c in range(num_chains):
    var = names[c * (num_hops + 1) : (c + 1) * (num_hops + 1)]
    value = rng.randint(10000, 99999)
    while value in values:
      value = rng.randint(10000, 99999)
    values.add(value)
    statements = [f"VAR {var[0]} = {value}"] + [f"VAR {var[j + 1]} = VAR {var[j]} " for j in range(num_hops)]
    out.append((var, statements, str(value)))
  return out


def _example(rng: random.Random, num_hops: int) -> str:
  """RULER's in-context example: a short instance with its answer."""
  ((var, statements, value),) = chains(rng, num_chains=1, num_hops=num_hops, name_len=3)
  positions = sorted(rng.sample(range(EXAMPLE_NOISE + 1), len(statements)))
  sentences = prompts.haystack_sentences("noise", EXAMPLE_NOISE)
  for j, (p, s) in enumerate(zip(positions, statements)):
    sentences.insert(p + j, s)
  question = TEMPLATE.format(context=" ".join(sentences), query=value)
  answer = ANSWER_PREFIX.format(num_v=len(var), query=value) + " " + " ".join(var)
  return question + "\n" + answer + "\n\n"


def variable_tracking(tokenizer: sizing.TextTokenizer, *, length: int, seed: int = 0, num_chains: int = 1,
                      num_hops: int = 4, fewshot: bool = True,
                      tolerance: float = sizing.DEFAULT_TOLERANCE) -> Sample:
  """One variable-tracking sample of `length` tokens (see the module docstring)."""
  if num_chains < 1 or num_hops < 1:
    raise ValueError(f"{num_chains=} and {num_hops=} must be >= 1")
  rng = random.Random(f"vt/{seed}")
  example = _example(rng, num_hops) if fewshot else ""
  made = chains(rng, num_chains=num_chains, num_hops=num_hops)
  needles, depths = [], []
  for _, statements, _ in made:  # each chain's statements at sorted random depths, in order
    depths += sorted(rng.random() for _ in statements)
    needles += statements
  variables, _, value = made[0]
  head, tail = TEMPLATE.split("{context}")
  tail = tail.format(query=value)

  def wrap(context: str) -> tuple[str, int]:
    return example + head + context + tail, len(example) + len(head)

  units = layout.cycle_units(lambda n: prompts.haystack_sentences("noise", n))
  built = layout.fit_layout(tokenizer, units, needles, depths, wrap, length=length, tolerance=tolerance)
  asked = list(range(num_hops + 1))  # the first chain's statements
  return layout.needle_sample(
      tokenizer, "vt", built, needles, tuple(variables), asked, depth=None, length=length, seed=seed,
      answer_prefix=ANSWER_PREFIX.format(num_v=len(variables), query=value), max_new_tokens=30,
      meta={"value": value, "chains": [v for v, _, _ in made], "fewshot": fewshot})
