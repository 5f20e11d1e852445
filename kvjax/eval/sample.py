"""One generated task instance: the prompt, what a correct answer contains, how to score it."""

from __future__ import annotations

import dataclasses
from typing import Any

from kvjax.eval import scoring


@dataclasses.dataclass(frozen=True)
class Sample:
  """A prompt with its expected answers.

  Attributes:
    task: the task name (e.g. "niah_single_2").
    text: the user message: instructions, context (haystack with the needles), question.
    answers: strings a correct prediction contains (all of them under metric "all").
    metric: the scorer, "all", "part" or "kv_exact" (see kvjax.eval.scoring).
    answer_prefix: the start of the assistant's reply, put after the prompt (RULER's
      `gen_prefix`): the model continues it, so the answer comes in a fixed form.
    length: the token target of `text`.
    tokens: the tokens `text` really has (model tokenizer, no chat template), within the
      task's tolerance below `length`.
    depth: the requested depth of the asked needle in the haystack, 0 = before its first
      token, 1 = after its last; None where it was drawn at random (then see
      meta["answer_depths"], the measured depths of the needles holding the answers).
    needle_depths: each needle's depth measured in tokens (layout.measured_depths), in order
      of appearance; () for tasks without needles (CWE, FWE).
    context_span: (start, end) characters of the context (haystack and needles) in `text`.
    needle_spans: (start, end) characters of each needle in `text`, in order of appearance.
    max_new_tokens: the generation the answer needs (RULER's tokens_to_generate, shortened
      where the answer is short: decoding on the CPU costs ~0.2 s a token). A UUID gets 64:
      SmolLM2 restates the question (~15 tokens) before the ~30 tokens of a UUID, and at 40
      full attention lost niah_single_3 samples it had answered correctly to the cut.
    seed: the seed that made it; the same (task, length, depth, seed, tokenizer) gives the
      same sample.
    meta: task-specific facts (keys, chain, counts...), JSON-serializable.
  """

  task: str
  text: str
  answers: tuple[str, ...]
  metric: str
  answer_prefix: str
  length: int
  tokens: int
  depth: float | None
  needle_depths: tuple[float, ...]
  context_span: tuple[int, int]
  needle_spans: tuple[tuple[int, int], ...]
  max_new_tokens: int
  seed: int
  meta: dict[str, Any] = dataclasses.field(default_factory=dict)

  def score(self, prediction: str) -> float:
    """The task's metric on `prediction` (the generated text, without the answer prefix)."""
    return scoring.score(prediction, self.answers, self.metric)

  def complete(self, prediction: str) -> bool:
    """Whether more text can no longer change `prediction`'s score: every answer is in it under
    a substring metric ("all", "part"), whose score only grows with the text. Never under
    "kv_exact": a whole-word match can break as the text grows. The runner's early stop."""
    return self.metric in ("all", "part") and self.score(prediction) >= 1.0

  @property
  def context(self) -> str:
    return self.text[self.context_span[0] : self.context_span[1]]
