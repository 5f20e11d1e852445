"""kvjax.eval.paired: the paired bootstrap against closed forms and its table per cell."""

import numpy as np
import pytest

from kvjax.eval.paired import compare_to_reference, paired_loss


def test_identical_scores_have_no_loss():
  p = paired_loss([1, 0, 1, 1], [1, 0, 1, 1])
  assert (p.loss, p.low, p.high, p.n) == (0.0, 0.0, 0.0, 4)
  assert p.verdict(0.02) == "no loss > 0.02"


def test_interval_matches_the_normal_approximation_for_many_samples():
  rng = np.random.default_rng(3)
  ref = rng.random(2000) < 0.9
  cand = ref & (rng.random(2000) < 0.95)  # loses ~4.5% of the reference's passes
  p = paired_loss(ref, cand, seed=1)
  d = ref.astype(float) - cand
  half = 1.96 * d.std(ddof=1) / np.sqrt(d.size)
  assert p.loss == pytest.approx(d.mean())
  assert p.low == pytest.approx(d.mean() - half, abs=0.15 * half)
  assert p.high == pytest.approx(d.mean() + half, abs=0.15 * half)
  assert p.verdict(0.02) == "loss"  # ~0.043 +- 0.009
  assert paired_loss(ref, cand, seed=1) == p  # a seed reproduces the interval


def test_pairing_matters():
  # Same means; paired, every sample agrees except one: a narrow interval.
  ref = np.array([1.0] * 25 + [0.0] * 25)
  cand = ref.copy()
  cand[0] = 0.0
  p = paired_loss(ref, cand)
  assert p.loss == pytest.approx(0.02) and p.low == 0.0 and p.high <= 0.06
  assert p.verdict(0.02) == "inconclusive"


def test_bad_input():
  with pytest.raises(ValueError, match="equal non-empty"):
    paired_loss([1, 0], [1])
  with pytest.raises(ValueError, match="equal non-empty"):
    paired_loss([], [])
  with pytest.raises(ValueError, match="finite"):
    paired_loss([1, np.nan], [1, 0])
  with pytest.raises(ValueError, match="confidence"):
    paired_loss([1], [1], confidence=1.0)


def test_compare_to_reference_pairs_by_sample_and_cell():
  rows = []
  for seed in range(4):
    for policy, score in (("full", 1.0), ("freekv", 1.0 if seed else 0.0), ("streaming", 0.0)):
      rows.append(dict(task="niah", length=4096, seed=seed, policy=policy, score=score))
  rows.append(dict(task="niah", length=4096, seed=9, policy="freekv", score=1.0))  # no full counterpart
  rows += [dict(task="vt", length=4096, seed=0, policy=p, score=0.0) for p in ("full", "freekv")]
  table = {(r["task"], r["policy"]): r for r in compare_to_reference(rows, cell=("task", "length"), sample=("seed",))}
  freekv = table["niah", "freekv"]
  assert (freekv["n"], freekv["unpaired"], freekv["loss"], freekv["full_score"]) == (4, 1, 0.25, 1.0)
  assert freekv["criterion_applies"] and freekv["verdict"] == "inconclusive"
  assert table["niah", "streaming"]["verdict"] == "loss" and table["niah", "streaming"]["loss"] == 1.0
  assert not table["vt", "freekv"]["criterion_applies"]  # full scores 0 there
