"""kvjax.eval.paired: the paired bootstrap against closed forms and its table per cell."""

import numpy as np
import pytest

from kvjax.eval.paired import binomial_upper, compare_to_reference, disagreeing_seeds, paired_loss


def test_no_sample_lost_shows_no_loss_only_with_enough_samples():
  """The bootstrap interval is [0, 0] whenever no sample is lost; the exact bound is what needs
  n: with 0 of n lost it is 1 - 0.025^(1/n), below 0.02 from n = 183 on."""
  p = paired_loss([1, 0, 1, 1], [1, 0, 1, 1])
  assert (p.loss, p.low, p.high, p.n, p.worse, p.better) == (0.0, 0.0, 0.0, 4, 0, 0)
  assert p.exact_high == pytest.approx(1 - 0.025 ** (1 / 4))
  assert p.verdict(0.02) == "inconclusive"
  assert paired_loss([1] * 50, [1] * 50).exact_high == pytest.approx(0.0711, abs=1e-4)
  assert paired_loss([1] * 182, [1] * 182).verdict(0.02) == "inconclusive"
  assert paired_loss([1] * 183, [1] * 183).verdict(0.02) == "no loss > 0.02"


def test_binomial_upper_matches_clopper_pearson():
  assert binomial_upper(0, 10, 0.025) == pytest.approx(1 - 0.025 ** 0.1)
  assert binomial_upper(3, 10, 0.025) == pytest.approx(0.6525, abs=1e-4)  # published tables
  assert binomial_upper(10, 10, 0.025) == 1.0
  # The bound is where P(X <= k) = tail: checked against the CDF summed directly.
  from math import comb
  p = binomial_upper(2, 40, 0.05)
  assert sum(comb(40, i) * p**i * (1 - p) ** (40 - i) for i in range(3)) == pytest.approx(0.05, rel=1e-6)
  with pytest.raises(ValueError, match="k=5, n=4"):
    binomial_upper(5, 4, 0.025)


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
  assert (p.worse, p.better) == (1, 0)
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
  assert (freekv["worse"], freekv["better"]) == (1, 0) and freekv["loss_bound_exact"] > 0.25
  assert table["niah", "streaming"]["verdict"] == "loss" and table["niah", "streaming"]["loss"] == 1.0
  assert not table["vt", "freekv"]["criterion_applies"]  # full scores 0 there
  assert "same_text" not in freekv  # the rows carry no texts


def test_compare_to_reference_counts_texts_equal_to_the_reference():
  texts = {"full": ["a 1", "b 2", "c 3"], "fast": ["a 1", "b 9", "c 3"], "wide": ["a 1", "b 2", "c 3"]}
  rows = [dict(task="niah", seed=s, policy=p, score=1.0, generated=t[s]) for p, t in texts.items() for s in range(3)]
  rows.append(dict(task="niah", seed=3, policy="fast", score=1.0, generated="d 4"))  # unpaired: not counted
  table = {r["policy"]: r for r in compare_to_reference(rows, cell=("task",), sample=("seed",))}
  assert (table["fast"]["same_text"], table["wide"]["same_text"]) == (2, 3)
  assert table["fast"]["loss"] == 0  # equal scores, different texts
  rows[0] = rows[0] | {"generated": None}  # full's seed 0 without its text: no count rather than a wrong one
  assert all("same_text" not in r for r in compare_to_reference(rows, cell=("task",), sample=("seed",)))


def test_compare_to_reference_lists_fulls_margins_and_gaps_where_lost_and_won():
  scores = {"full": [1, 1, 1, 0, 0], "fast": [0, 0, 1, 1, 0]}
  margin = [0.55, 0.11, None, 3.2, 0.01]  # fast's rows: full's split fields where fast's tokens departed
  gap = [0.55, 4.0, None, 3.2, 0.01]
  rows = [dict(task="niah", seed=s, policy=p, score=float(scores[p][s])) for p in scores for s in range(5)]
  for r in rows[5:]:
    r["full_margin_at_split"], r["full_gap_at_split"] = margin[r["seed"]], gap[r["seed"]]
  fast = compare_to_reference(rows, cell=("task",), sample=("seed",))[0]
  assert fast["lost_margins"] == [0.11, 0.55] and fast["won_margins"] == [3.2]
  assert fast["lost_gaps"] == [0.55, 4.0] and fast["won_gaps"] == [3.2]
  rows[5]["full_margin_at_split"] = None  # full had no logits at the split: listed, last
  assert compare_to_reference(rows, cell=("task",), sample=("seed",))[0]["lost_margins"] == [0.11, None]
  del rows[6]["full_gap_at_split"]  # a row from before the field: no lists rather than partial ones
  table = compare_to_reference(rows, cell=("task",), sample=("seed",))[0]
  assert "lost_gaps" not in table and table["lost_margins"] == [0.11, None]
  # The fields score full's logits: against another reference they would be mislabelled.
  other = [r | {"policy": "ref"} if r["policy"] == "full" else r for r in rows]
  assert "lost_margins" not in compare_to_reference(other, cell=("task",), sample=("seed",), reference="ref")[0]


def test_disagreeing_seeds_by_sample_over_cells():
  rows = [dict(task="niah", length=4096, seed=s, policy="full", score=1.0) for s in range(6)]
  rows += [dict(task="niah", length=4096, seed=s, policy="fast", score=score)
           for s, score in ((0, 1.0), (1, 0.5), (2, 1.0), (3, 0.0), (4, 1.0), (5, 1.0))]
  rows += [dict(task="vt", length=4096, seed=s, policy=p, score=score)  # another cell: fast wins seed 4, loses 2
           for s, p, score in ((4, "full", 0.0), (4, "fast", 1.0), (2, "full", 1.0), (2, "fast", 0.8))]
  rows.append(dict(task="niah", length=4096, seed=9, policy="fast", score=0.0))  # no full counterpart
  assert disagreeing_seeds(rows, "fast") == [1, 2, 3]
  assert disagreeing_seeds(rows, "fast", which="better") == [4]
  assert disagreeing_seeds(rows, "fast", which="both") == [1, 2, 3, 4]  # the lost first
  assert disagreeing_seeds(rows, "full", reference="fast", which="worse") == [4]


def test_disagreeing_seeds_bad_input():
  rows = [dict(seed=0, policy="full", score=1.0), dict(seed=0, policy="fast", score=0.0)]
  with pytest.raises(ValueError, match="which='lost' must be one of"):
    disagreeing_seeds(rows, "fast", which="lost")
  with pytest.raises(ValueError, match="no rows of policy 'slow'"):
    disagreeing_seeds(rows, "slow")
  with pytest.raises(ValueError, match="no rows of policy 'dense'"):
    disagreeing_seeds(rows, "fast", reference="dense")
  with pytest.raises(ValueError, match="policy 'full' is the reference"):
    disagreeing_seeds(rows, "full")
  with pytest.raises(ValueError, match="row 2 lacks"):
    disagreeing_seeds(rows + [dict(policy="fast", score=1.0)], "fast")
