"""Built-in long-context prompts and haystack text, generated locally (nothing is downloaded).

Haystacks (`haystack_sentences`), shared with the evaluation tasks of `kvjax.eval`:

- "grammar": the pass-key filler below.
- "noise": RULER's repeated noise, "The grass is green. The sky is blue. The sun is yellow.
  Here we go. There and back again." (Hsieh et al. 2024, the `repeat` haystack of
  niah_single_1 and of variable tracking), one sentence per item.
- "essay": first-person, essay-like prose from a larger sentence grammar. RULER uses Paul
  Graham's essays here; kvjax cannot ship them, and the tasks only need natural, varied
  prose in which a needle sentence is not trivially the odd one out.

The pass-key prompt follows the classic pass-key retrieval test (Mohtashami & Jaggi, 2023):
filler text with one sentence that states a random five-digit key, then a question.
The filler is drawn from a small sentence grammar with a seeded generator rather than one
repeated line, so the model cannot locate the key merely as the one odd line out of a
perfectly periodic text.
"""

from __future__ import annotations

import dataclasses
import random

_SUBJECTS = ["The grass", "The sky", "The river", "The old house", "A small bird", "The market", "The north wind",
             "The library", "A quiet street", "The mountain", "The harbour", "The garden"]
_VERBS = ["is", "looks", "seems", "stays", "feels", "remains"]
_ADJECTIVES = ["green", "blue", "calm", "bright", "empty", "busy", "cold", "warm", "still", "golden", "grey", "wide"]
_TAILS = ["today.", "in the morning.", "after the rain.", "as always.", "this season.", "at noon.", "for now.",
          "under the clouds.", "near the bridge.", "once again."]


PASSKEY_INTRO = "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it.\n\n"
PASSKEY_NEEDLE = "The pass key is {passkey}. Remember it. {passkey} is the pass key."
# Asking for a fixed answer form matters for a 135M model: with a bare "What is the pass
# key?" SmolLM2 often describes the filler instead of quoting the key.
PASSKEY_QUESTION = "\n\nWhat is the pass key? Reply in the form: The pass key is <number>."


@dataclasses.dataclass(frozen=True)
class PasskeyPrompt:
  text: str  # the whole user message: filler with the key, then the question
  passkey: str
  depth: float  # where the key sits, as a fraction of the filler


def _filler_sentences(rng: random.Random, count: int) -> list[str]:
  return [f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_ADJECTIVES)} {rng.choice(_TAILS)}"
          for _ in range(count)]


_NOISE = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")

_ESSAY_OPENERS = ["", "", "", "In practice, ", "Most of the time, ", "Oddly enough, ", "At first, ", "Looking back, ",
                  "For a long time, ", "In the end, ", "Surprisingly, ", "Usually, ", "As far as I can tell, "]
_ESSAY_SUBJECTS = ["founders", "most people", "good writers", "small companies", "students", "investors",
                   "the best programmers", "new startups", "my friends", "large organizations", "early users",
                   "young scientists", "teachers", "painters", "committees", "beginners"]
_ESSAY_VERBS = ["underestimate", "learn", "care about", "ignore", "worry about", "discover", "build", "reconsider",
                "write about", "misjudge", "depend on", "search for", "argue about", "return to"]
_ESSAY_OBJECTS = ["how long things take", "the value of simple ideas", "what users actually want",
                  "the cost of meetings", "their own taste", "the problems nobody talks about", "the work itself",
                  "small details", "the first version", "the advice they are given", "questions that seem obvious",
                  "the edges of a field", "the habits of their peers", "old notebooks", "unfashionable problems"]
_ESSAY_ENDINGS = ["", "", " because it is easier", " when they are busy", " until it is too late",
                  " more than they admit", " without noticing", " in the first year", " once they see the results",
                  " if nobody stops them", " for surprisingly long"]
_ESSAY_ADJECTIVES = ["strange", "useful", "sad", "funny", "common", "rare", "worth noticing", "easy to miss"]
_ESSAY_ABSTRACT = ["ambition", "curiosity", "a deadline", "a good question", "an unfinished draft", "money",
                   "a long walk", "a second opinion", "boredom", "a small audience"]


def _essay_sentence(rng: random.Random) -> str:
  form = rng.randrange(5)
  s, v, o = rng.choice(_ESSAY_SUBJECTS), rng.choice(_ESSAY_VERBS), rng.choice(_ESSAY_OBJECTS)
  if form == 0:
    opener = rng.choice(_ESSAY_OPENERS)
    clause = f"{s} {v} {o}{rng.choice(_ESSAY_ENDINGS)}"
    return f"{opener}{clause}." if opener else f"{clause[0].upper()}{clause[1:]}."
  if form == 1:
    return f"It is {rng.choice(_ESSAY_ADJECTIVES)} how often {s} {v} {o}."
  if form == 2:
    return f"I think {s} {v} {o}{rng.choice(_ESSAY_ENDINGS)}."
  if form == 3:
    return f"That is why {rng.choice(_ESSAY_ABSTRACT)} matters more than {rng.choice(_ESSAY_ABSTRACT)}."
  return f"What {s} rarely see is that {rng.choice(_ESSAY_ABSTRACT)} changes {o}."


HAYSTACKS = ("essay", "grammar", "noise")


def haystack_sentences(kind: str, count: int, *, seed: int = 0) -> list[str]:
  """`count` haystack sentences of `kind` (see the module docstring), deterministic per seed.

  Prefix-stable: the first n sentences do not depend on `count`, so a prompt can be grown
  or shrunk to a token target without changing the text it already has.
  """
  if count < 0:
    raise ValueError(f"{count=} must be >= 0")
  if kind == "noise":  # RULER repeats one fixed line; the seed does not matter
    return [_NOISE[i % len(_NOISE)] for i in range(count)]
  rng = random.Random(seed)
  if kind == "grammar":
    return _filler_sentences(rng, count)
  if kind == "essay":
    return [_essay_sentence(rng) for _ in range(count)]
  raise ValueError(f"unknown haystack {kind=}; known: {', '.join(HAYSTACKS)}")


def passkey_prompt(*, num_sentences: int = 700, depth: float | None = None, seed: int = 0) -> PasskeyPrompt:
  """A pass key hidden at `depth` (random when None) in `num_sentences` filler sentences.

  About 8.5 SmolLM2 tokens per sentence: 700 sentences make a prompt of about 6K tokens.
  """
  if num_sentences < 1:
    raise ValueError(f"{num_sentences=} must be >= 1")
  rng = random.Random(seed)
  if depth is None:
    depth = rng.uniform(0.05, 0.95)
  if not 0.0 <= depth <= 1.0:
    raise ValueError(f"{depth=} must be in [0, 1]")
  passkey = str(rng.randint(10000, 99999))
  sentences = _filler_sentences(rng, num_sentences)
  at = round(depth * num_sentences)
  sentences.insert(at, PASSKEY_NEEDLE.format(passkey=passkey))
  text = PASSKEY_INTRO + " ".join(sentences) + PASSKEY_QUESTION
  return PasskeyPrompt(text=text, passkey=passkey, depth=depth)
