"""Needles placed at token depths in a haystack, the whole prompt fitted to a token target.

Used by every task that hides statements in filler (NIAH, variable tracking, kv retrieval):
the haystack is a stream of units (sentences, JSON pairs), the needles are inserted between
units at the gap closest in tokens to their requested depth, and the number of units is the
largest whose prompt fits the target (sizing.fit_units).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Sequence

from kvjax.eval import sizing
from kvjax.eval.sample import Sample

@dataclasses.dataclass(frozen=True)
class Layout:
  """A fitted prompt.

  Attributes:
    text: the whole user message.
    context_span: (start, end) characters of the context within `text`.
    spans: (start, end) characters in `text` of each needle, in the order the needles were given.
    tokens: tokens of `text`.
    units: haystack units used.
  """

  text: str
  context_span: tuple[int, int]
  spans: tuple[tuple[int, int], ...]
  tokens: int
  units: int


def _assemble(units: Sequence[str], gaps: Sequence[int], needles: Sequence[str], sep: str):
  """Joins units with needles inserted before unit gaps[i]; returns (context, needle offsets)."""
  order = sorted(range(len(needles)), key=lambda i: (gaps[i], i))  # stable: equal gaps keep the given order
  pieces: list[str] = []
  starts = [0] * len(needles)
  pos = 0
  at = 0

  def put(piece: str) -> int:
    nonlocal pos
    if pieces:
      pieces.append(sep)
      pos += len(sep)
    begin = pos
    pieces.append(piece)
    pos += len(piece)
    return begin

  for i in order:
    for unit in units[at : gaps[i]]:
      put(unit)
    at = max(at, gaps[i])
    starts[i] = put(needles[i])
  for unit in units[at:]:
    put(unit)
  return "".join(pieces), starts


def fit_layout(
    tokenizer: sizing.TextTokenizer,
    unit_stream: Iterable[str],
    needles: Sequence[str],
    depths: Sequence[float],
    wrap: Callable[[str], tuple[str, int]],
    *,
    length: int,
    sep: str = " ",
    tolerance: float = sizing.DEFAULT_TOLERANCE,
) -> Layout:
  """The prompt `wrap(context)` with the most haystack units that fits `length` tokens.

  Args:
    tokenizer: the model's tokenizer.
    unit_stream: haystack units, in order (an endless generator is fine: only as many are
      drawn as the target needs).
    needles: statements to hide; needle i goes at depths[i] of the haystack's tokens.
    depths: in [0, 1], one per needle.
    wrap: context -> (the whole text, the context's start offset in it); it adds the
      instructions and the question around the context.
    length: the token target of the whole text.
    sep: what joins units and needles.
    tolerance: see sizing.fit_units.
  """
  if len(needles) != len(depths):
    raise ValueError(f"{len(needles)} needles but {len(depths)} depths")
  stream = iter(unit_stream)
  units: list[str] = []
  offsets = [0]

  def draw(until: int) -> bool:
    """Draws units until the unit-by-unit token count reaches `until`; False once the stream ends."""
    for unit in stream:
      units.append(unit)
      offsets.append(offsets[-1] + sizing.count_tokens(tokenizer, (sep if len(units) > 1 else "") + unit))
      if offsets[-1] >= until:
        return True
    return False

  def build(n: int):
    gaps = [sizing.boundary_at_depth(offsets[: n + 1], d) for d in depths]
    context, starts = _assemble(units[:n], gaps, needles, sep)
    text, begin = wrap(context)
    return text, (begin, begin + len(context)), tuple((begin + s, begin + s + len(nd)) for s, nd in zip(starts, needles))

  # Draw units until the whole prompt reaches the target: then some n fits. Counting units one
  # by one overestimates where the tokenizer merges across a boundary (Qwen2.5 reads ".\n" as
  # one token: a needle haystack came out ~5% short), so the built prompt is measured too.
  more = draw(length)
  while more:
    short = length - sizing.count_tokens(tokenizer, build(len(units))[0])
    if short <= 0:
      break
    more = draw(offsets[-1] + short)

  (text, span, spans), n, tokens = sizing.fit_units(
      build, lambda b: b[0], tokenizer, target=length, max_units=len(units), min_units=0, tolerance=tolerance)
  return Layout(text=text, context_span=span, spans=spans, tokens=tokens, units=n)


def measured_depths(tokenizer: sizing.TextTokenizer, layout: Layout) -> tuple[float, ...]:
  """Each needle's depth among the haystack's tokens: the haystack tokens before it / all of them.

  Needles are left out of both counts, so a needle after the last haystack unit has depth 1
  (placement works on the same haystack-only offsets).
  """
  text, (begin, end) = layout.text, layout.context_span
  needle_tokens = [sizing.count_tokens(tokenizer, text[s:e]) for s, e in layout.spans]
  haystack = sizing.count_tokens(tokenizer, text[begin:end]) - sum(needle_tokens)
  out = []
  for s, _ in layout.spans:
    before = sizing.count_tokens(tokenizer, text[begin:s])
    before -= sum(n for (o, _), n in zip(layout.spans, needle_tokens) if o < s)
    out.append(before / max(haystack, 1))
  return tuple(out)


def cycle_units(make: Callable[[int], list[str]], chunk: int = 256) -> Iterable[str]:
  """An endless stream from a prefix-stable generator `make(count)` (prompts.haystack_sentences)."""
  for count in itertools.count(chunk, chunk):
    yield from make(count)[count - chunk :]


def needle_sample(tokenizer: sizing.TextTokenizer, task: str, built: Layout, needles: Sequence[str],
                  answers: Sequence[str], asked_needles: Sequence[int], *, depth: float | None, length: int,
                  seed: int, answer_prefix: str, max_new_tokens: int, meta: dict) -> Sample:
  """A Sample (metric "all") from a fitted layout.

  Args:
    needles: the needle texts, in the order given to fit_layout.
    asked_needles: indices into `needles` of those that hold the answers; their measured
      depths go to meta["answer_depths"].
    Others: the Sample fields of the same names.
  """
  for a in answers:
    assert a in built.text, (task, a)
  order = sorted(range(len(needles)), key=lambda i: built.spans[i][0])
  measured = measured_depths(tokenizer, built)
  return Sample(
      task=task, text=built.text, answers=tuple(answers), metric="all", answer_prefix=answer_prefix,
      length=length, tokens=built.tokens, depth=depth,
      needle_depths=tuple(round(measured[i], 4) for i in order), context_span=built.context_span,
      needle_spans=tuple(built.spans[i] for i in order), max_new_tokens=max_new_tokens, seed=seed,
      meta=meta | {"units": built.units, "answer_depths": [round(measured[i], 4) for i in asked_needles]})
