"""experiments/pin_study.py's ranking and coverage against their definitions, on small inputs."""

from __future__ import annotations

import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "experiments"))

import page_scores  # noqa: E402
import pin_study  # noqa: E402


class _PieceTokenizer:
  PIECES = ["the key", " is", " 47", "1", "1", "."]

  def decode(self, ids):
    return "".join(self.PIECES[i] for i in ids)


def test_answer_span_covers_every_token_of_the_answer():
  ids = list(range(6))
  assert page_scores.answer_span(_PieceTokenizer(), ids, "4711") == (2, 5)
  assert page_scores.answer_span(_PieceTokenizer(), ids, "is") == (1, 2)
  assert page_scores.answer_token(_PieceTokenizer(), ids, "4711") == 2


def test_window_votes_sum_each_causal_query_softmax():
  rng = np.random.default_rng(0)
  n, W, D = 20, 4, 8
  q, k = rng.standard_normal((W, D)), rng.standard_normal((n, D))
  votes = pin_study.window_votes(q, k, 0.5, [1, 4])
  expect = np.zeros(n)
  for i in range(W):  # query i sits at position n - W + i and sees keys 0 .. n - W + i
    seen = 0.5 * k[:n - W + i + 1] @ q[i]
    w = np.exp(seen - seen.max())
    expect[:n - W + i + 1] += w / w.sum()
    if i == W - 1:
      np.testing.assert_allclose(votes[1][:n - W + i + 1], w / w.sum(), rtol=1e-12)
  np.testing.assert_allclose(votes[4], expect, rtol=1e-12)
  assert np.isclose(votes[4].sum(), W) and votes[4][-1] == votes[1][-1]  # only the last query sees the last key


def test_held_needs_every_token_of_a_value_inside_the_spans():
  values = [(10, 14), (30, 33), (50, 52)]
  host = np.zeros(60, bool)
  # 8 + span 4 covers 8..11 only; 11 + 4 covers 11..14 -> the first value whole; 30..33 by 29 + 4.
  np.testing.assert_array_equal(pin_study.held([8, 11, 29], 4, values, host), [True, True, False])
  np.testing.assert_array_equal(pin_study.held([9], 4, values, host), [False, False, False])
  np.testing.assert_array_equal(pin_study.held([48, 49], 4, values, host), [False, False, True])
  window = np.arange(60) >= 52  # a value partly in the window and partly pinned is held
  np.testing.assert_array_equal(pin_study.held([48], 4, values, window), [False, False, True])
  np.testing.assert_array_equal(pin_study.held([], 4, [(51, 54)], window), [False])
