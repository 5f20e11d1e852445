"""Needle-in-a-haystack tasks: RULER's NIAH family, the depth × length grid, the pass key.

RULER (Hsieh et al. 2024, §3.1 and App. B, Table 5) hides needles
"One of the special magic {numbers|words|uuids} for {key} is: {value}." in a haystack and
asks for the value(s) of a key. Its eight variants, reproduced here with its parameters:

| task            | haystack | key   | value  | needles                                   |
|-----------------|----------|-------|--------|-------------------------------------------|
| niah_single_1   | noise    | word  | number | 1                                         |
| niah_single_2   | essay    | word  | number | 1                                         |
| niah_single_3   | essay    | word  | uuid   | 1                                         |
| niah_multikey_1 | essay    | word  | number | 4 keys: 1 asked, 3 distractors            |
| niah_multikey_2 | needles  | word  | number | the haystack is itself distractor needles |
| niah_multikey_3 | needles  | uuid  | uuid   | the haystack is itself distractor needles |
| niah_multivalue | essay    | word  | number | 4 values of the asked key                 |
| niah_multiquery | essay    | word  | number | 4 keys, all asked                         |

Keys are "adjective-noun" words, numbers have 7 digits, UUIDs are version-4 (as in RULER).
Needles at random go to depths drawn without replacement from RULER's 40 evenly spaced
depths (0, 3, 5, ..., 100 %); a single asked needle can be put at a given depth instead,
which is what the needle grid (`needle`, after Kamradt's "needle in a haystack" test:
context length × depth) does with niah_single_2's settings. Scored by RULER's
string_match_all. The answer prefix is RULER's `gen_prefix`.

`passkey` is kvjax's built-in pass-key prompt (kvjax.prompts) sized in tokens: the
"grammar" haystack and the needle "The pass key is N. Remember it. N is the pass key."
"""

from __future__ import annotations

import random
import uuid

from kvjax import prompts
from kvjax.eval import layout, sizing, words
from kvjax.eval.sample import Sample

NEEDLE = "One of the special magic {type_v} for {key} is: {value}."
TEMPLATE = ("Some special magic {type_v} are hidden within the following text. Make sure to memorize it. "
            "I will quiz you about the {type_v} afterwards.\n{context}\n"
            "What are all the special magic {type_v} for {query} mentioned in the provided text?")
DEPTHS = tuple(round(100 * i / 39) / 100 for i in range(40))  # RULER: np.linspace(0, 100, 40), rounded

# (haystack, key type, value type, keys, values per key, keys asked)
VARIANTS = {
    "niah_single_1": ("noise", "words", "numbers", 1, 1, 1),
    "niah_single_2": ("essay", "words", "numbers", 1, 1, 1),
    "niah_single_3": ("essay", "words", "uuids", 1, 1, 1),
    "niah_multikey_1": ("essay", "words", "numbers", 4, 1, 1),
    "niah_multikey_2": ("needle", "words", "numbers", 1, 1, 1),
    "niah_multikey_3": ("needle", "uuids", "uuids", 1, 1, 1),
    "niah_multivalue": ("essay", "words", "numbers", 1, 4, 1),
    "niah_multiquery": ("essay", "words", "numbers", 4, 1, 4),
    "needle": ("essay", "words", "numbers", 1, 1, 1),
}


def random_value(rng: random.Random, kind: str) -> str:
  if kind == "numbers":
    return str(rng.randint(1_000_000, 9_999_999))
  if kind == "words":
    return f"{rng.choice(words.ADJECTIVES)}-{rng.choice(words.NOUNS)}"
  if kind == "uuids":
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))
  raise ValueError(f"unknown value kind {kind!r}; known: numbers, words, uuids")


def unique_values(rng: random.Random, kind: str, count: int, taken: set[str]) -> list[str]:
  out: list[str] = []
  while len(out) < count:
    v = random_value(rng, kind)
    if v not in taken:
      taken.add(v)
      out.append(v)
  return out


def _haystack(kind: str, rng: random.Random, seed: int, key_type: str, value_type: str, taken: set[str]):
  if kind in ("noise", "essay"):
    return layout.cycle_units(lambda n: prompts.haystack_sentences(kind, n, seed=seed))

  def distractors():  # RULER's "needle" haystack: every unit is a needle of another key
    while True:
      key = unique_values(rng, key_type, 1, taken)[0]
      yield NEEDLE.format(type_v=value_type, key=key, value=random_value(rng, value_type))

  return distractors()


def niah(tokenizer: sizing.TextTokenizer, task: str, *, length: int, seed: int = 0, depth: float | None = None,
         tolerance: float = sizing.DEFAULT_TOLERANCE) -> Sample:
  """One sample of a RULER NIAH variant (see VARIANTS) of `length` tokens.

  Args:
    tokenizer: the model's tokenizer (sizes the prompt).
    task: a key of VARIANTS.
    length: token target of the prompt text.
    seed: sample seed.
    depth: where the asked needle goes, in [0, 1] of the haystack's tokens; None draws it
      from RULER's depths. Only for variants with one asked needle; required for `needle`.
    tolerance: the prompt has between (1 - tolerance) * length and length tokens.
  """
  if task not in VARIANTS:
    raise ValueError(f"unknown NIAH {task=}; known: {', '.join(VARIANTS)}")
  hay, key_type, value_type, num_keys, num_values, num_queries = VARIANTS[task]
  if depth is not None and num_values * num_queries != 1:
    raise ValueError(f"{task} hides several asked needles: depth must be None, got {depth}")
  if task == "needle" and depth is None:
    raise ValueError("the needle grid task needs a depth")
  rng = random.Random(f"{task}/{seed}")
  taken: set[str] = set()
  keys = unique_values(rng, key_type, num_keys, taken)
  values = [unique_values(rng, value_type, num_values, taken) for _ in keys]
  needles = [(k, v) for k, vs in zip(keys, values) for v in vs]
  rng.shuffle(needles)  # RULER shuffles the needles before placing them
  asked = sorted(rng.sample(range(num_keys), num_queries))
  asked_keys = [keys[i] for i in asked]
  depths = list(rng.sample(DEPTHS, len(needles)))
  if depth is not None:  # the single asked needle goes where it was asked to
    depths[next(i for i, (k, _) in enumerate(needles) if k == asked_keys[0])] = depth

  one = num_values * num_queries == 1
  type_v = value_type[:-1] if one else value_type
  query = asked_keys[0] if len(asked_keys) == 1 else ", ".join(asked_keys[:-1]) + ", and " + asked_keys[-1]
  template = TEMPLATE
  if one:  # RULER's singular form of the template
    template = template.replace("Some", "A").replace("are all", "is").replace("are", "is")
  head, tail = template.split("{context}")
  head = head.format(type_v=type_v)
  tail = tail.format(type_v=type_v, query=query)

  def wrap(context: str) -> tuple[str, int]:
    return head + context + tail, len(head)

  texts = [NEEDLE.format(type_v=value_type, key=k, value=v) for k, v in needles]
  units = _haystack(hay, rng, seed, key_type, value_type, taken)
  built = layout.fit_layout(tokenizer, units, texts, depths, wrap, length=length,
                            sep="\n" if hay == "needle" else " ", tolerance=tolerance)
  answers = tuple(v for k in asked_keys for v in values[keys.index(k)])
  asked_needles = [i for i, (k, _) in enumerate(needles) if k in asked_keys]
  prefix = f"The special magic {type_v} for {query} mentioned in the provided text {'is' if one else 'are'}"
  return layout.needle_sample(
      tokenizer, task, built, texts, answers, asked_needles, depth=depth, length=length, seed=seed,
      answer_prefix=prefix, max_new_tokens=(64 if value_type == "uuids" else 16) * num_values * num_queries,
      meta={"haystack": hay, "keys": keys, "asked": asked_keys})


def passkey(tokenizer: sizing.TextTokenizer, *, length: int, seed: int = 0, depth: float | None = None,
            tolerance: float = sizing.DEFAULT_TOLERANCE) -> Sample:
  """kvjax's pass-key prompt (kvjax.prompts.passkey_prompt) sized to `length` tokens."""
  rng = random.Random(f"passkey/{seed}")
  where = rng.choice(DEPTHS) if depth is None else depth
  key = str(rng.randint(10000, 99999))
  needle = prompts.PASSKEY_NEEDLE.format(passkey=key)

  def wrap(context: str) -> tuple[str, int]:
    return prompts.PASSKEY_INTRO + context + prompts.PASSKEY_QUESTION, len(prompts.PASSKEY_INTRO)

  units = layout.cycle_units(lambda n: prompts.haystack_sentences("grammar", n, seed=seed))
  built = layout.fit_layout(tokenizer, units, [needle], [where], wrap, length=length, tolerance=tolerance)
  return layout.needle_sample(tokenizer, "passkey", built, [needle], (key,), [0], depth=depth, length=length,
                              seed=seed, answer_prefix="The pass key is", max_new_tokens=16, meta={})

