"""Sizing prompts in tokens and placing text at a depth, with the model's own tokenizer.

A task builds its prompt from n haystack units (sentences, list items, JSON pairs); more
units make a longer prompt. `fit_units` finds the largest n whose prompt fits a token
target, as RULER does (Hsieh et al. 2024 grow the haystack until the tokenized input reaches
`max_seq_length`); here by bisection, because tokenizing a few thousand tokens costs
milliseconds. `boundary_at_depth` picks, among the gaps between units, the one whose token
offset is closest to a requested fraction of the haystack's tokens.

The tokenizer is anything with `encode(text, add_bos=False) -> list[int]`
(`models.tokenizer.Tokenizer`).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar


class TextTokenizer(Protocol):
  def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]: ...


T = TypeVar("T")

# A built prompt must be within this share of the target, below it (never above it).
DEFAULT_TOLERANCE = 0.03


def count_tokens(tokenizer: TextTokenizer, text: str) -> int:
  """Tokens of `text` alone (no BOS, no chat template)."""
  return len(tokenizer.encode(text, add_bos=False))


def fit_units(
    build: Callable[[int], T],
    text_of: Callable[[T], str],
    tokenizer: TextTokenizer,
    *,
    target: int,
    max_units: int,
    min_units: int = 1,
    tolerance: float = DEFAULT_TOLERANCE,
) -> tuple[T, int, int]:
  """The largest prompt `build(n)`, n in [min_units, max_units], with at most `target` tokens.

  Args:
    build: n -> a built prompt (anything; `text_of` gives its text). Its token count must
      grow with n (not strictly: bisection only needs it monotone).
    text_of: the prompt text of a built prompt.
    tokenizer: the model's tokenizer.
    target: the token budget of the prompt text.
    max_units, min_units: the search range of n.
    tolerance: the prompt must have at least (1 - tolerance) * target tokens, or be
      within one unit of the target where a unit is larger than that.

  Returns:
    (built, n, tokens).

  Raises:
    ValueError: even `min_units` exceeds the target, or `max_units` is too few to come
      within the tolerance.
  """
  if target < 1:
    raise ValueError(f"{target=} must be >= 1")
  if not 0.0 <= tolerance < 1.0:
    raise ValueError(f"{tolerance=} must be in [0, 1)")
  cache: dict[int, tuple[T, int]] = {}

  def measure(n: int) -> int:
    if n not in cache:
      built = build(n)
      cache[n] = (built, count_tokens(tokenizer, text_of(built)))
    return cache[n][1]

  lo, hi = min_units, max_units
  if measure(lo) > target:
    raise ValueError(f"even {lo} units make {measure(lo)} tokens > {target=}")
  if measure(hi) <= target:
    lo = hi
  while hi - lo > 1:  # invariant: measure(lo) <= target < measure(hi)
    mid = (lo + hi) // 2
    if measure(mid) <= target:
      lo = mid
    else:
      hi = mid
  built, tokens = cache[lo]
  # Short of the tolerance with units to spare means one more unit overshoots: units coarser
  # than the tolerance (a kv-retrieval pair is ~70 tokens); that is the best fit there is.
  if tokens < (1.0 - tolerance) * target and lo == max_units:
    raise ValueError(f"the prompt reaches only {tokens} tokens with {lo} units, short of {target=} "
                     f"(tolerance {tolerance}); the task's unit supply is exhausted")
  return built, lo, tokens


def unit_offsets(tokenizer: TextTokenizer, units: Sequence[str], *, sep: str = " ") -> list[int]:
  """Approximate token offsets of the gaps between `units` joined by `sep`.

  Returns n + 1 offsets: offsets[i] is the token count of the first i units. Each unit is
  tokenized with its separator, which matches the joined text's tokenization up to a token
  at a boundary (measured: within one token per unit on SmolLM2's byte-level BPE).
  """
  offsets = [0]
  for i, unit in enumerate(units):
    offsets.append(offsets[-1] + count_tokens(tokenizer, (sep if i else "") + unit))
  return offsets


def boundary_at_depth(offsets: Sequence[int], depth: float) -> int:
  """The gap index i in [0, n] whose token offset is closest to depth * offsets[-1]."""
  if not 0.0 <= depth <= 1.0:
    raise ValueError(f"{depth=} must be in [0, 1]")
  want = depth * offsets[-1]
  i = bisect.bisect_left(offsets, want)
  candidates = [j for j in (i - 1, i) if 0 <= j < len(offsets)]
  return min(candidates, key=lambda j: abs(offsets[j] - want))

