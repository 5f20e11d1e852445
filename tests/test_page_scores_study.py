"""experiments/page_scores.py's variants against their definitions, on synthetic vectors."""

from __future__ import annotations

import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "experiments"))

import page_scores as ps  # noqa: E402


def _case(seed=0, g=3, n=12, p=32, d=16):
  rng = np.random.default_rng(seed)
  return rng.standard_normal((g, d)).astype(np.float32), rng.standard_normal((n, p, d)).astype(np.float32)


def test_bounds_lie_above_the_exact_page_maximum_and_sub_pages_are_tighter():
  qg, pages = _case()
  s = ps.variant_scores(qg, pages, scale=0.25)
  exact = 0.25 * np.einsum("gd,npd->gnp", qg, pages).max(-1)
  np.testing.assert_allclose(s["oracle"], exact, rtol=1e-5, atol=1e-6)
  assert np.all(s["minmax"] >= exact - 1e-5)
  assert np.all(s["minmax_sub8"] >= exact - 1e-5) and np.all(s["minmax_sub8"] <= s["minmax"] + 1e-5)


def test_more_key_bits_come_closer_to_the_exact_scores():
  qg, pages = _case(1)
  s = ps.variant_scores(qg, pages, scale=0.25)
  err = {b: np.abs(s[f"keys{b}bit"] - s["oracle"]).mean() for b in (1, 2, 4)}
  assert err[4] < err[2] < err[1]
  # 4-bit rounding moves each channel by at most half a level of its range.
  flat = pages.reshape(-1, pages.shape[-1])
  lo, hi = flat.min(0), flat.max(0)
  assert np.all(np.abs(ps.quantized(flat, 4, lo, hi) - flat) <= (hi - lo) / 15 / 2 + 1e-6)


def test_min_max_pooling_matches_freekv_page_scores():
  qg, pages = _case(2)
  s = ps.variant_scores(qg, pages, scale=0.25)
  ps.check_against_freekv(qg, pages, 0.25, ps.softmax(s["minmax"]).mean(0))  # raises on a mismatch


class _CharTokenizer:
  def decode(self, ids):
    return "".join(chr(i) for i in ids)


def test_answer_token_finds_the_token_that_starts_the_answer():
  ids = [ord(c) for c in "the key is 4711."]
  assert ps.answer_token(_CharTokenizer(), ids, "4711") == 11


def test_score_case_counts_each_answer_page_and_each_budget():
  qg, pages = _case(3, n=12)
  mass = np.zeros((3, 12))
  mass[0, 2], mass[1, 9], mass[2, 5] = 0.6, 0.5, 0.1  # answers on pages 2 and 9 are hot, 5 is not
  tally = ps.new_tally([1, 12])
  ps.score_case(tally, qg, pages, mass, [2, 9, 5, 40], scale=0.25, share=0.3)  # page 40: not a candidate yet
  pooled = ps.softmax(ps.variant_scores(qg, pages, 0.25)["oracle"]).mean(0)
  ranks = [int((pooled > pooled[p]).sum()) for p in (2, 9)]
  assert tally["oracle", 12]["cases"] == 2 and tally["oracle", 12]["missed"] == 0  # every page kept
  assert tally["oracle", 1]["missed"] == sum(r >= 1 for r in ranks) and tally["oracle", 1]["ranks"] == ranks
  top = int(np.argmax(pooled))
  np.testing.assert_allclose(tally["oracle", 1]["recovery"], [mass[:, top].sum() / mass.sum()])
  np.testing.assert_allclose(tally["minmax", 12]["recovery"], [1.0])
