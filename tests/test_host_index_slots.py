"""host_index.assign_slots, count_common and select_slots (C) against NumPy references and
against their set semantics."""

import numpy as np
import pytest

import host_index


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
    want_dest, want_ids = assign_repeats_reference(held, wanted)  # ids distinct here
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


def test_repeated_ids_match_the_repeats_reference():
  rng = np.random.default_rng(11)
  held = rng.integers(-1, 12, size=(100, 9))  # repeats in held and wanted
  wanted = rng.integers(-1, 12, size=(100, 9))
  for got, want in zip(host_index.assign_slots(held, wanted), assign_repeats_reference(held, wanted)):
    np.testing.assert_array_equal(got, want)


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


def compose_reference(found, seen, stored, S, *, tail, age, sources, successors, pins, span):
  """NumPy twin of select_slots' composition: each row's wanted ids [T, B, H, S]."""
  n = stored[:, :, None, None]  # [T, B, 1, 1]
  tail_ids = seen[..., None] + np.arange(tail)
  parts = [found, np.where(tail_ids < n, tail_ids, -1)]
  if successors:
    src = found[..., :sources, None]
    ids = src + age[..., None, None] + np.arange(1, successors + 1)
    after = np.where((src >= 0) & (ids < n[..., None]), ids, -1)
    parts.append(after.reshape(*found.shape[:3], -1))
  if pins is not None:
    ids = pins[..., None] + np.arange(span)
    spans = np.where((pins[..., None] >= 0) & (ids < n[..., None]), ids, -1)
    parts.append(spans.reshape(*found.shape[:3], -1))
  wanted = np.concatenate(parts, axis=-1)
  pad = np.full(found.shape[:3] + (S - wanted.shape[-1],), -1, np.int64)
  return np.concatenate([wanted, pad], axis=-1)


def assign_repeats_reference(held, wanted):
  """assign_slots' rules where rows may repeat ids: a held id still wanted keeps its first slot
  (a later copy is freed), a repeated wanted id enters once."""
  R, S = held.shape
  writes = np.full((R, S), -2, np.int64)
  for r in range(R):
    want = list(dict.fromkeys(int(i) for i in wanted[r] if i >= 0))  # distinct, in order
    kept, free = set(), []
    for s in range(S):
      if held[r, s] >= 0 and held[r, s] in want and held[r, s] not in kept:
        kept.add(int(held[r, s]))
      else:
        free.append(s)
    entering = [i for i in want if i not in kept]
    for s, i in zip(free, entering):
      writes[r, s] = i
    for s in free[len(entering):]:
      if held[r, s] >= 0:
        writes[r, s] = -1
  dest = np.flatnonzero(writes >= -1)
  return dest, writes.reshape(-1)[dest]


def select_reference(held, layers, found, seen, stored, *, used=None, score=None, **options):
  """select_slots through compose_reference and assign_repeats_reference: (held after, dest, ids,
  rows in slot order, retrieved, hits, total)."""
  L, B, H, S = held.shape
  wanted = compose_reference(found, seen, stored, S, **options)
  composed = held[layers]  # [T, B, H, S] (a copy)
  dest, ids = assign_repeats_reference(composed.reshape(-1, S), wanted.reshape(-1, S))
  rows = dest // S
  flat = (np.asarray(layers)[rows // (B * H)] * B * H + rows % (B * H)) * S + dest % S
  after = held.copy()
  after.reshape(-1)[flat] = ids
  order = np.argsort(flat)  # slot order (layers may come in any order)
  flat, ids, rows = flat[order], ids[order], rows[order]
  hits = total = 0
  if score is not None:  # a hit: a used id the row's own selection holds, a found id or a tail id
    n = np.broadcast_to(np.asarray(stored)[:, :, None, None], used.shape)
    in_tail = (used >= seen[..., None]) & (used < seen[..., None] + options["tail"]) & (used < n)
    in_found = (used[..., :, None] == found[..., None, :]).any(axis=-1) & (used >= 0)
    hits = int((in_found | in_tail)[score].sum())
    total = int((used[score] >= 0).sum())
  return after, flat, ids, rows, wanted[..., :found.shape[-1] + options["tail"]], hits, total


def _selection_case(rng, *, L=4, layers=(0, 2, 3), B=2, H=3, k=6, tail=3, sources=4, successors=2, p=2, span=3,
                    extra=2, stored_max=40):
  """Random inputs of select_slots: -1 and repeated found ids, spans and successors past the
  store, held rows with ids past the store, repeats and -1."""
  T = len(layers)
  S = k + tail + sources * successors + p * span + extra
  stored = rng.integers(0, stored_max, size=(T, B))
  n = stored[:, :, None, None]
  found = (rng.random((T, B, H, k)) * n).astype(np.int64)
  found[(rng.random((T, B, H, k)) < 0.2) | (n == 0)] = -1
  found[..., -1] = np.where(rng.random((T, B, H)) < 0.3, found[..., 0], found[..., -1])  # repeats
  seen = np.maximum(0, stored[..., None] - rng.integers(0, tail + 2, size=(T, B, H)))
  age = rng.integers(0, 3, size=(T, B, H))
  pins = rng.integers(-1, stored_max + 5, size=(T, B, H, p))
  held = rng.integers(-1, stored_max + 5, size=(L, B, H, S))  # repeats and ids past the store too
  options = dict(tail=tail, age=age, sources=sources, successors=successors, pins=pins, span=span)
  return held, list(layers), found, seen, stored, options


@pytest.mark.parametrize("case", [dict(), dict(layers=(1,)), dict(layers=(3, 0)), dict(successors=0, p=0),
                                  dict(B=1, H=1, k=1, tail=1, sources=1), dict(stored_max=2000, k=30)])
def test_select_slots_matches_numpy(case):
  """Compose + assign + score against the NumPy twins, step after step (each step's held is the
  last one's result), for any thread count; dense layers' rows are not touched."""
  rng = np.random.default_rng(len(str(case)))
  held, layers, found, seen, stored, options = _selection_case(rng, **case)
  if case.get("p", 1) == 0:
    options["pins"] = None
  used = score = None
  for step in range(4):
    want = select_reference(held, layers, found, seen, stored, used=used, score=score, **options)
    for threads in (1, 3):
      got_held = held.copy()
      got = host_index.select_slots(got_held, layers, found, seen, stored, used=used, score=score,
                                    threads=threads, **options)
      order = np.argsort(got.dest)  # layers out of order: the writes come in composed-row order
      np.testing.assert_array_equal(got_held, want[0])
      np.testing.assert_array_equal(got.dest[order], want[1])
      for g, w in zip((got.ids[order], got.rows[order], got.retrieved, got.hits, got.total), want[2:]):
        np.testing.assert_array_equal(g, w)
      assert list(layers) != sorted(layers) or np.all(np.diff(got.dest) > 0)
    held, used, score = want[0], want[4], rng.random(seen.shape) < 0.7
    _, _, found, seen, stored, _ = _selection_case(rng, **case)
    stored = np.maximum(stored, want[4].max(axis=(2, 3)) + 1)  # used ids may lie past the new store: not hits


def test_select_slots_keeps_held_ids_in_place_and_each_id_once():
  rng = np.random.default_rng(5)
  held, layers, found, seen, stored, options = _selection_case(rng, stored_max=12)
  held[layers] = -1
  for _ in range(3):
    before = held.copy()
    got = host_index.select_slots(held, layers, found, seen, stored, **options)
    wanted = compose_reference(found, seen, stored, held.shape[-1], **options)
    for t, layer in enumerate(layers):
      for b in range(held.shape[1]):
        for h in range(held.shape[2]):
          row, old = held[layer, b, h], before[layer, b, h]
          assert set(row[row >= 0].tolist()) == set(wanted[t, b, h][wanted[t, b, h] >= 0].tolist())
          assert len(set(row[row >= 0].tolist())) == int((row >= 0).sum())  # each id once
          still = np.isin(old, row) & (old >= 0)
          np.testing.assert_array_equal(row[still], old[still])  # a kept id keeps its slot
    assert got.dest.size == int((held != before).sum())
    _, _, found, seen, stored, _ = _selection_case(rng, stored_max=12)


def test_select_slots_zero_rows():
  held = np.full((2, 1, 3, 5), 7, np.int64)
  for layers, B, H in (([], 1, 3), ([0, 1], 0, 3), ([1], 1, 0)):
    h = np.full((2, B, H, 5), 7, np.int64)
    T = len(layers)
    got = host_index.select_slots(h, layers, np.zeros((T, B, H, 2), np.int64), np.zeros((T, B, H), np.int64),
                                  np.ones((T, B), np.int64), tail=1)
    assert got.dest.size == got.ids.size == got.rows.size == 0 and got.retrieved.shape == (T, B, H, 3)
    assert (h == 7).all() and (got.hits, got.total) == (0, 0)
  assert (held == 7).all()


def _select_call(**change):
  held = np.full((3, 1, 2, 12), -1, np.int64)
  args = dict(held=held, layers=[0, 2], found=np.zeros((2, 1, 2, 4), np.int64),
              seen=np.ones((2, 1, 2), np.int64), stored=np.full((2, 1), 5), tail=2,
              age=np.zeros((2, 1, 2), np.int64), sources=2, successors=1,
              pins=np.zeros((2, 1, 2, 1), np.int64), span=2)
  args.update(change)
  return host_index.select_slots(args.pop("held"), args.pop("layers"), args.pop("found"), args.pop("seen"),
                                 args.pop("stored"), **args)


@pytest.mark.parametrize("change, error, message", [
    (dict(held=np.zeros((3, 1, 2, 12), np.float32)), TypeError, "held must be an int64 ndarray"),
    (dict(held=np.zeros((3, 2, 12), np.int64)), ValueError, "writable C-contiguous"),
    (dict(held=np.zeros((3, 1, 2, 24), np.int64)[..., ::2]), ValueError, "writable C-contiguous"),
    (dict(found=np.zeros((2, 1, 2, 4), np.float64)), TypeError, "found"),
    (dict(found=np.zeros((2, 1, 3, 4), np.int64)), ValueError, "found \\(2, 1, 3, 4\\) must start with"),
    (dict(stored=np.full((1, 1), 5)), ValueError, "stored"),
    (dict(layers=[0, 0]), ValueError, "distinct"),
    (dict(layers=[0, 3]), ValueError, "lie in \\[0, 3\\)"),
    (dict(sources=5), ValueError, "sources=5 must be <= k=4"),
    (dict(age=None), ValueError, "age is needed"),
    (dict(span=5), ValueError, "slots cannot hold"),
    (dict(span=0), ValueError, "span=0"),
    (dict(tail=-1), ValueError, "tail=-1"),
    (dict(used=np.zeros((2, 1, 2, 3), np.int64)), ValueError, "used and score go together"),
    (dict(used=np.zeros((2, 1, 2, 3), np.int64), score=np.ones((2, 1, 2), np.int64)), TypeError, "score"),
    (dict(found=np.full((2, 1, 2, 4), -2)), ValueError, r"ids out of range: found\[0, 0, 0, 0\] = -2"),
    (dict(found=np.full((2, 1, 2, 4), 5)), ValueError, r"found\[0, 0, 0, 0\] = 5 must be in \[-1, stored = 5\)"),
    (dict(held=np.full((3, 1, 2, 12), -2)), ValueError, r"ids out of range: held\[0, 0, 0, 0\] = -2"),
    (dict(pins=np.full((2, 1, 2, 1), -3)), ValueError, r"ids out of range: pins\[0, 0, 0, 0\] = -3"),
    (dict(seen=np.full((2, 1, 2), -1)), ValueError, r"ids out of range: seen\[0, 0, 0\] = -1 must be >= 0"),
    (dict(age=np.full((2, 1, 2), -1)), ValueError, r"ids out of range: age\[0, 0, 0\] = -1"),
    (dict(stored=np.full((2, 1), -1)), ValueError, r"ids out of range: stored\[0, 0\] = -1"),
    (dict(used=np.full((2, 1, 2, 3), -2), score=np.ones((2, 1, 2), bool)), ValueError,
     r"ids out of range: used\[0, 0, 0, 0\] = -2"),
])
def test_select_slots_bad_input(change, error, message):
  with pytest.raises(error, match=message):
    _select_call(**change)


def test_select_slots_writes_nothing_on_a_bad_id():
  """Every row is checked before any is rewritten, whichever thread holds the bad one."""
  held = np.full((3, 1, 2, 12), -1, np.int64)
  found = np.zeros((2, 1, 2, 4), np.int64)
  found[1, 0, 1, 3] = 9  # past the store of 5, in the last row
  with pytest.raises(ValueError, match="ids out of range"):
    _select_call(held=held, found=found, threads=2)
  assert (held == -1).all()
  assert _select_call(held=held).dest.size > 0 and (held[1] == -1).all()  # layer 1 is not composed
