"""host_index.topk_rows (C) against a NumPy reference: each row's k largest scores, largest
first, a tie going to the lower column."""

import numpy as np
import pytest

import host_index


def topk_reference(scores, k):
  """[R, k]: every row sorted by (-score, column), first k."""
  columns = np.broadcast_to(np.arange(scores.shape[1]), scores.shape)
  return np.lexsort((columns, -scores), axis=1)[:, :k]


@pytest.mark.parametrize("R, N, k", [(1, 1, 1), (5, 7, 3), (64, 300, 100), (33, 1000, 1000), (200, 4096, 17)])
@pytest.mark.parametrize("threads", [1, 3])
def test_matches_numpy_on_distinct_scores(R, N, k, threads):
  scores = np.random.default_rng(R * N + k).standard_normal((R, N)).astype(np.float32)
  np.testing.assert_array_equal(host_index.topk_rows(scores, k, threads=threads), topk_reference(scores, k))


@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("N", [500, 2000])  # 32 blocks of 16 scores (fewer than k: no bound), 125 (a bound)
def test_ties_go_to_the_lower_column(threads, N):
  # Few distinct values: most of each row's top k ties with the k-th, and with the bound.
  rng = np.random.default_rng(1)
  scores = rng.integers(-3, 3, size=(50, N)).astype(np.float32)
  scores[7] = 1.0  # one row all equal: its first k columns
  got = host_index.topk_rows(scores, 40, threads=threads)
  np.testing.assert_array_equal(got, topk_reference(scores, 40))
  np.testing.assert_array_equal(got[7], np.arange(40))


def test_extremes_and_empty_shapes():
  scores = np.array([[0.0, np.finfo(np.float32).max, -np.finfo(np.float32).max, 0.0]], np.float32)
  np.testing.assert_array_equal(host_index.topk_rows(scores, 4), [[1, 0, 3, 2]])
  assert host_index.topk_rows(scores, 0).shape == (1, 0)
  assert host_index.topk_rows(np.zeros((0, 5), np.float32), 2).shape == (0, 2)
  np.testing.assert_array_equal(host_index.topk_rows(np.asfortranarray(scores[:, ::-1]), 1), [[2]])  # any layout


def test_bad_input_is_refused():
  scores = np.zeros((3, 5), np.float32)
  with pytest.raises(ValueError, match="k=6 exceeds"):
    host_index.topk_rows(scores, 6)
  with pytest.raises(ValueError, match="k=-1"):
    host_index.topk_rows(scores, -1)
  with pytest.raises(TypeError, match="k=2.0"):
    host_index.topk_rows(scores, 2.0)
  with pytest.raises(ValueError, match=r"expected \[R, N\]"):
    host_index.topk_rows(scores[0], 2)
  for dtype in (np.int32, np.float64, np.float16):  # refused, not rounded
    with pytest.raises(TypeError, match="is not float32"):
      host_index.topk_rows(scores.astype(dtype), 2)
  for bad in (np.nan, np.inf, -np.inf):
    broken = scores.copy()
    broken[2, 4] = bad  # past the first k columns, and within them below
    with pytest.raises(ValueError, match="NaN or inf"):
      host_index.topk_rows(broken, 2)
    broken = scores.copy()
    broken[1, 0] = bad
    with pytest.raises(ValueError, match="NaN or inf"):
      host_index.topk_rows(broken, 2)
