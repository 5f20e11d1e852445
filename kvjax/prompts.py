"""Built-in long-context prompts, generated locally (nothing is downloaded).

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


@dataclasses.dataclass(frozen=True)
class PasskeyPrompt:
  text: str  # the whole user message: filler with the key, then the question
  passkey: str
  depth: float  # where the key sits, as a fraction of the filler


def _filler_sentences(rng: random.Random, count: int) -> list[str]:
  return [f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_ADJECTIVES)} {rng.choice(_TAILS)}"
          for _ in range(count)]


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
  needle = f"The pass key is {passkey}. Remember it. {passkey} is the pass key."
  sentences.insert(at, needle)
  # Asking for a fixed answer form matters for a 135M model: with a bare "What is the pass
  # key?" SmolLM2 often describes the filler instead of quoting the key.
  text = ("There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it.\n\n"
          + " ".join(sentences)
          + "\n\nWhat is the pass key? Reply in the form: The pass key is <number>.")
  return PasskeyPrompt(text=text, passkey=passkey, depth=depth)
