"""Scorers of the synthetic tasks: one prediction against its expected answers, in [0, 1].

- `string_match_all` (RULER, Hsieh et al. 2024, used by NIAH, variable tracking, CWE and
  FWE): the share of the expected answers that occur in the prediction, case-insensitive.
- `string_match_part` (RULER's QA metric): 1 when any expected answer occurs.
- `kv_exact` (InfiniteBench's kv_retrieval scorer, Zhang et al. 2024, "∞Bench"): the
  prediction, with punctuation turned into spaces, must contain the expected value as a
  whole word: a UUID that is only a prefix of another token does not count.

RULER first strips the prediction and turns control characters into newlines; so does
`postprocess`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

_CONTROL = re.compile(r"[\x00-\x1f]")
_KV_PUNCTUATION = ("\n", ":", '"', "'", ".", ",", "?", "!", "{", "}")


def postprocess(prediction: str) -> str:
  return _CONTROL.sub("\n", prediction.strip()).strip()


def string_match_all(prediction: str, answers: Sequence[str]) -> float:
  if not answers:
    raise ValueError("answers is empty")
  pred = postprocess(prediction).lower()
  return sum(a.lower() in pred for a in answers) / len(answers)


def string_match_part(prediction: str, answers: Sequence[str]) -> float:
  if not answers:
    raise ValueError("answers is empty")
  pred = postprocess(prediction).lower()
  return float(any(a.lower() in pred for a in answers))


def kv_exact(prediction: str, answers: Sequence[str]) -> float:
  if len(answers) != 1:
    raise ValueError(f"kv retrieval has exactly one expected value, got {len(answers)}")
  pred = prediction
  for c in _KV_PUNCTUATION:
    pred = pred.replace(c, " ")
  return float(answers[0] in pred.split())


METRICS: dict[str, Callable[[str, Sequence[str]], float]] = {
    "all": string_match_all,
    "part": string_match_part,
    "kv_exact": kv_exact,
}


def score(prediction: str, answers: Sequence[str], metric: str) -> float:
  """Scores `prediction` with the named metric ("all", "part" or "kv_exact")."""
  if metric not in METRICS:
    raise ValueError(f"unknown {metric=}; known: {', '.join(METRICS)}")
  return METRICS[metric](prediction, answers)
