"""host_index.assign_slots (C) against a NumPy reference and against its set semantics."""

import numpy as np
import pytest

import host_index


def assign_slots_reference(held, wanted):
  """NumPy twin of the C routine (ids distinct within a row)."""
  R, S = held.shape
  writes = np.full((R, S), -2, np.int64)
  for r in range(R):
    want = [int(i) for i in wanted[r] if i >= 0]
    keep = [s for s in range(S) if held[r, s] >= 0 and held[r, s] in want]
    free = [s for s in range(S) if s not in keep]
    entering = [i for i in want if i not in set(int(held[r, s]) for s in keep)]
    for s, i in zip(free, entering):
      writes[r, s] = i
    for s in free[len(entering):]:
      if held[r, s] >= 0:
        writes[r, s] = -1
  dest = np.flatnonzero(writes >= -1)
  return dest, writes.reshape(-1)[dest]


def _random_rows(rng, R, S, pool):
  rows = np.full((R, S), -1, np.int64)
  for r in range(R):
    count = int(rng.integers(0, S + 1))
    rows[r, rng.permutation(S)[:count]] = rng.choice(pool, size=count, replace=False)  # -1 anywhere
  return rows


def _row_sets(ids):
  return [set(int(i) for i in row if i >= 0) for row in ids]


@pytest.mark.parametrize("R, S, pool", [(1, 1, 3), (7, 5, 8), (60, 13, 30), (300, 40, 5000)])
def test_matches_numpy_and_keeps_held_ids_in_place(R, S, pool):
  rng = np.random.default_rng(R + S)
  held = _random_rows(rng, R, S, pool)
  for _ in range(4):
    wanted = _random_rows(rng, R, S, pool)
    dest, ids = host_index.assign_slots(held, wanted)
    want_dest, want_ids = assign_slots_reference(held, wanted)
    np.testing.assert_array_equal(dest, want_dest)
    np.testing.assert_array_equal(ids, want_ids)
    after = held.copy()
    after.reshape(-1)[dest] = ids
    assert _row_sets(after) == _row_sets(wanted)
    untouched = np.ones(held.size, bool)
    untouched[dest] = False
    still = np.array([[h in w for h in row] for row, w in zip(held, _row_sets(wanted))])
    assert np.all(untouched.reshape(R, S)[still & (held >= 0)])  # a held id still wanted is not rewritten
    held = after


def test_repeated_ids_count_once_and_threads_do_not_matter():
  rng = np.random.default_rng(9)
  held = _random_rows(rng, 200, 16, 40)
  wanted = rng.integers(-1, 20, size=(200, 16))  # many repeats
  dest, ids = host_index.assign_slots(held, wanted, threads=1)
  after = held.copy()
  after.reshape(-1)[dest] = ids
  assert _row_sets(after) == _row_sets(wanted)
  for row in after:
    valid = row[row >= 0]
    assert len(set(valid.tolist())) == valid.size  # each id in one slot
  again = host_index.assign_slots(held, wanted, threads=4)
  np.testing.assert_array_equal(again[0], dest)
  np.testing.assert_array_equal(again[1], ids)


def test_empty_and_bad_input():
  dest, ids = host_index.assign_slots(np.zeros((0, 4), np.int64), np.zeros((0, 4), np.int64))
  assert dest.size == 0 and ids.size == 0
  with pytest.raises(ValueError, match="one \\[R, S\\] shape"):
    host_index.assign_slots(np.zeros((2, 3), np.int64), np.zeros((2, 4), np.int64))
  with pytest.raises(ValueError, match="wanted: ids must be >= -1"):
    host_index.assign_slots(np.zeros((2, 3), np.int64), np.full((2, 3), -5))
  with pytest.raises(TypeError, match="held"):
    host_index.assign_slots(np.zeros((2, 3), np.float32), np.zeros((2, 3), np.int64))
  with pytest.raises(ValueError, match="held: expected 2 dimensions"):
    host_index.assign_slots(np.zeros(3, np.int64), np.zeros(3, np.int64))


def count_common_reference(a, b):
  return np.array([sum(1 for x in row_a if x >= 0 and x in set(row_b.tolist())) for row_a, row_b in zip(a, b)])


@pytest.mark.parametrize("R, n, m, pool", [(1, 1, 1, 2), (9, 7, 5, 12), (300, 108, 100, 400)])
def test_count_common_matches_numpy(R, n, m, pool):
  rng = np.random.default_rng(R + n)
  a = rng.integers(-1, pool, size=(R, n))  # repeats in a count each time
  b = _random_rows(rng, R, m, pool)
  np.testing.assert_array_equal(host_index.count_common(a, b), count_common_reference(a, b))
  np.testing.assert_array_equal(host_index.count_common(a, b, threads=1), count_common_reference(a, b))


def test_count_common_bad_input():
  assert host_index.count_common(np.zeros((0, 3), np.int64), np.zeros((0, 2), np.int64)).shape == (0,)
  with pytest.raises(ValueError, match="same number of rows"):
    host_index.count_common(np.zeros((2, 3), np.int64), np.zeros((3, 3), np.int64))
  with pytest.raises(ValueError, match="b: ids must be >= -1"):
    host_index.count_common(np.zeros((2, 3), np.int64), np.full((2, 3), -2))
  with pytest.raises(TypeError, match="a"):
    host_index.count_common(np.zeros((2, 3)), np.zeros((2, 3), np.int64))
