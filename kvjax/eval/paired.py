"""Paired comparison of a sparse policy against a reference (`full`) on the same samples.

Every sample is decoded by each policy from the same prompt, so the right statistic is the
per-sample difference d_i = reference_i - candidate_i (the loss, in score units), not two
independent means. Its mean is bracketed by a percentile bootstrap over the samples (numpy
only, a fixed seed: the same scores give the same interval); "loss" when the interval's lower
end lies above zero.

"No loss beyond the margin" (the issue's criterion: the 95% interval excludes a loss of 2
points) also needs an exact bound, because the bootstrap cannot see a loss that never occurred:
with no sample lost its interval is [0, 0] at any n, where the true rate of lost samples may
still be ~3/n (the rule of three). Scores lie in [0, 1], so the mean loss is at most the share
of samples the candidate scored below the reference; its Clopper-Pearson upper bound (the same
confidence, two-sided: the upper 97.5% at 95%) bounds the mean loss without any assumption
about its distribution, conservatively (it ignores the samples the candidate won and partial
losses). The verdict "no loss > margin" needs both upper ends below the margin: with no sample
lost that takes n >= 183 at 95% and a 2-point margin (0 of 50 lost: bound 0.071).
Until 2026-12-05 the verdict used the bootstrap alone; results files written before say so in
their notes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class PairedLoss:
  n: int  # paired samples
  reference: float  # mean reference score
  candidate: float  # mean candidate score
  loss: float  # mean of reference - candidate
  low: float  # bootstrap interval of the mean loss
  high: float
  confidence: float
  worse: int = 0  # samples the candidate scored below the reference
  better: int = 0  # and above it
  exact_high: float = 1.0  # Clopper-Pearson upper bound of worse / n, which bounds the mean loss

  def verdict(self, margin: float) -> str:
    """"no loss > margin", "loss" or "inconclusive" (see the module docstring)."""
    if self.high < margin and self.exact_high < margin:
      return f"no loss > {margin:g}"
    if self.low > 0:
      return "loss"
    return "inconclusive"


def binomial_upper(k: int, n: int, tail: float) -> float:
  """Clopper-Pearson upper bound of a rate with k of n events: the p at which P(X <= k) = tail
  (1 when k == n). Bisection on the binomial CDF (log-gamma terms; NumPy and math only)."""
  if not 0 <= k <= n or n < 1:
    raise ValueError(f"k={k}, n={n}: need 0 <= k <= n and n >= 1")
  if k == n:
    return 1.0

  def cdf(p: float) -> float:
    logs = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * math.log(p)
            + (n - i) * math.log1p(-p) for i in range(k + 1)]
    top = max(logs)
    return math.exp(top) * sum(math.exp(x - top) for x in logs)

  lo, hi = k / n, 1.0
  for _ in range(60):  # cdf falls as p grows
    mid = (lo + hi) / 2
    if cdf(mid) > tail:
      lo = mid
    else:
      hi = mid
  return hi


def paired_loss(
    reference: Sequence[float],  # [n] scores of the reference policy
    candidate: Sequence[float],  # [n] scores of the candidate on the same samples, same order
    *,
    confidence: float = 0.95,
    resamples: int = 10_000,
    seed: int = 0,
) -> PairedLoss:
  """Mean loss (reference - candidate) and its percentile-bootstrap interval."""
  ref = np.asarray(reference, np.float64)
  cand = np.asarray(candidate, np.float64)
  if ref.ndim != 1 or ref.shape != cand.shape or ref.size == 0:
    raise ValueError(f"reference {ref.shape} and candidate {cand.shape} must be equal non-empty [n] score lists")
  if not (np.all(np.isfinite(ref)) and np.all(np.isfinite(cand))):
    raise ValueError("scores must be finite")
  if not 0.0 < confidence < 1.0:
    raise ValueError(f"confidence={confidence!r} must lie in (0, 1)")
  if not (isinstance(resamples, int) and resamples >= 100):
    raise ValueError(f"resamples={resamples!r} must be an int >= 100")
  diff = ref - cand
  rng = np.random.default_rng(seed)
  means = diff[rng.integers(0, diff.size, size=(resamples, diff.size))].mean(axis=1)
  alpha = (1.0 - confidence) / 2
  low, high = np.quantile(means, [alpha, 1.0 - alpha])
  worse = int(np.sum(diff > 0))
  return PairedLoss(n=int(diff.size), reference=float(ref.mean()), candidate=float(cand.mean()),
                    loss=float(diff.mean()), low=float(low), high=float(high), confidence=confidence, worse=worse,
                    better=int(np.sum(diff < 0)), exact_high=binomial_upper(worse, int(diff.size), alpha))


def compare_to_reference(
    rows: Iterable[dict],
    *,
    cell: tuple[str, ...],
    sample: tuple[str, ...],
    reference: str = "full",
    margin: float = 0.02,
    confidence: float = 0.95,
    seed: int = 0,
) -> list[dict]:
  """Paired loss of every policy against `reference`, per cell.

  Args:
    rows: evaluation records with "policy", "score" and the `cell` and `sample` keys.
    cell: keys of a table cell besides the policy, e.g. ("task", "length").
    sample: keys that identify a sample within a cell, e.g. ("seed",) or ("seed", "depth").
    reference: the reference policy's label.
    margin: loss (in score units: 0.02 = 2 points of a 0-1 score) the verdict tests against.

  Returns one dict per (cell, candidate policy) with both mean scores, the mean loss, its
  interval, n, the samples it lost and won, the exact bound of the loss and the verdict, and,
  where rows carry their "generated" text, `same_text`: the paired samples whose text equals the
  reference's (how often the policy decodes exactly what the reference does, which equal scores hide),
  and, against "full", where rows carry the split fields of kvjax.eval.runner.split_at_reference,
  `lost_margins` / `won_margins` and `lost_gaps` / `won_gaps` (`_split_lists`);
  samples the reference lacks (or the candidate) are left out and counted in "unpaired". A cell
  whose reference scores <= 0.5 is marked (the issue's criterion applies only where the
  reference scores above 50%).
  """
  rows = list(rows)
  scores: dict[tuple, dict[str, dict[tuple, float]]] = {}
  texts: dict[tuple, dict[str, dict[tuple, str]]] = {}
  splits: dict[tuple, dict[str, dict[tuple, dict[str, float | None]]]] = {}
  for r in rows:
    key, at = tuple(r[k] for k in cell), tuple(r[k] for k in sample)
    scores.setdefault(key, {}).setdefault(r["policy"], {})[at] = float(r["score"])
    if r.get("generated") is not None:
      texts.setdefault(key, {}).setdefault(r["policy"], {})[at] = r["generated"]
    if fields := {f: r[f] for f in _SPLIT_LISTS if f in r}:
      splits.setdefault(key, {}).setdefault(r["policy"], {})[at] = fields
  out = []
  for key, by_policy in scores.items():
    ref = by_policy.get(reference)
    if ref is None:
      continue
    for policy, cand in by_policy.items():
      if policy == reference:
        continue
      shared = [s for s in ref if s in cand]
      unpaired = len(set(ref) ^ set(cand))
      row = dict(zip(cell, key)) | {"policy": policy, "n": len(shared), "unpaired": unpaired}
      if not shared:
        out.append(row | {"verdict": "no paired samples"})
        continue
      p = paired_loss([ref[s] for s in shared], [cand[s] for s in shared], confidence=confidence, seed=seed)
      out.append(row | {
          f"{reference}_score": round(p.reference, 4), "score": round(p.candidate, 4), "loss": round(p.loss, 4),
          f"loss_ci{round(100 * confidence)}": f"[{p.low:.4f}, {p.high:.4f}]", "worse": p.worse, "better": p.better,
          "loss_bound_exact": round(p.exact_high, 4), "verdict": p.verdict(margin),
          "criterion_applies": p.reference > 0.5} | _same_text(texts.get(key, {}), reference, policy, shared)
          | (_split_lists(splits.get(key, {}).get(policy, {}), ref, cand, shared) if reference == "full" else {}))  # the fields score full's logits (kvjax.eval.runner.REFERENCE)
  return out


# Row fields of kvjax.eval.runner.split_at_reference (full's logits where a policy's tokens depart
# from full's) -> the stem of the lists compare_to_reference makes of them.
_SPLIT_LISTS = {"full_margin_at_split": "margins", "full_gap_at_split": "gaps"}


def _split_lists(splits: dict[tuple, dict[str, float | None]], ref: dict[tuple, float], cand: dict[tuple, float],
                 shared: list[tuple]) -> dict:
  """{"lost_margins", "won_margins", "lost_gaps", "won_gaps"}: on the samples the policy lost and
  won, ascending, full's top-2 margin and its gap to the policy's token (its top-1 logit minus its
  logit of the token the policy chose) at the first token where the policy departed from it
  (kvjax.eval.runner.split_at_reference); each pair only when every shared sample's row carries
  its field (rows from before it get none rather than partial lists). A loss at a gap near 0 is a
  near-tie of full itself, which any perturbation (bfloat16 rounding, another batch) can turn
  either way; a loss at a wide gap is the policy's own (the margin alone can be small where the
  policy took a token far below full's runner-up)."""
  lost = [s for s in shared if ref[s] > cand[s]]
  won = [s for s in shared if ref[s] < cand[s]]
  out = {}
  for field, stem in _SPLIT_LISTS.items():
    if all(field in splits.get(s, {}) for s in shared):
      out |= {f"lost_{stem}": _ascending(splits[s][field] for s in lost),
              f"won_{stem}": _ascending(splits[s][field] for s in won)}
  return out


def _ascending(values) -> list:
  """Rounded to 2 decimals and sorted, None (full had no logits at the split) last."""
  values = list(values)
  return sorted(round(v, 2) for v in values if v is not None) + [None] * values.count(None)


def _same_text(texts: dict[str, dict[tuple, str]], reference: str, policy: str, shared: list[tuple]) -> dict:
  """{"same_text": k} over the shared samples when both policies' rows hold their texts, else {}."""
  ref, cand = texts.get(reference, {}), texts.get(policy, {})
  if not all(s in ref and s in cand for s in shared):
    return {}
  return {"same_text": sum(ref[s] == cand[s] for s in shared)}


DISAGREEMENTS = ("worse", "better", "both")


def disagreeing_seeds(rows: Iterable[dict], policy: str, *, reference: str = "full", which: str = "worse") -> list[int]:
  """The seeds whose samples `policy` scored below (`which="worse"`), above ("better") or either
  way ("both") `reference`, to rerun only those (e.g. with other decode options).

  rows: evaluation records with "policy", "score", "seed" and any other keys of a sample (task,
  length, depth): a seed counts when any of its samples disagrees. Returned in increasing order,
  with "both" the lost seeds first (a run cut by its time limit has done those)."""
  if which not in DISAGREEMENTS:
    raise ValueError(f"which={which!r} must be one of {DISAGREEMENTS}")
  if policy == reference:
    raise ValueError(f"policy {policy!r} is the reference")
  rows = list(rows)
  scores: dict[str, dict[tuple, float]] = {reference: {}, policy: {}}  # policy -> sample -> score
  for i, r in enumerate(rows):
    try:
      if r["policy"] in scores:
        sample = (r.get("task"), r.get("length"), r.get("depth"), int(r["seed"]))
        scores[r["policy"]][sample] = float(r["score"])
    except (KeyError, TypeError, ValueError) as e:
      raise ValueError(f"row {i} lacks a policy, an integer seed or a score: {e!r}") from None
  for name, by_sample in scores.items():
    if not by_sample:
      raise ValueError(f"no rows of policy {name!r} (policies: {sorted({r['policy'] for r in rows})})")
  ref = scores[reference]
  worse, better = set(), set()
  for sample, score in scores[policy].items():
    if sample in ref and score != ref[sample]:
      (worse if score < ref[sample] else better).add(sample[-1])
  if which == "worse":
    return sorted(worse)
  if which == "better":
    return sorted(better)
  return sorted(worse) + sorted(better - worse)
