"""ops.exact_topk (chunked over queries and keys) == jax.lax.top_k of the full product."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ops


@pytest.mark.parametrize("hq, hkv, m, n, d, k, block_q, block_n, dtype", [
    (8, 2, 50, 1000, 64, 17, 16, 128, jnp.float32),
    (3, 1, 33, 257, 128, 100, 8, 64, jnp.float32),
    (4, 4, 10, 300, 256, 5, 16, 100, jnp.bfloat16),
    (2, 1, 7, 12, 64, 20, 4, 5, jnp.float32),  # k > N: padded with -1 / -inf
])
def test_matches_lax_top_k(hq, hkv, m, n, d, k, block_q, block_n, dtype):
  rng = np.random.default_rng(hq * 1000 + n)
  queries = jnp.asarray(rng.standard_normal((hq, m, d)), dtype)
  keys = jnp.asarray(rng.standard_normal((hkv, n, d)), dtype)
  scores, ids = ops.exact_topk(queries, keys, k, block_q=block_q, block_n=block_n)
  ref_s, ref_i = ops.exact_topk_reference(queries, keys, k)
  assert scores.shape == (hq, m, k) and ids.shape == (hq, m, k) and ids.dtype == jnp.int32
  # Independent check of the reference: lax.top_k over the full f32 product.
  g = hq // hkv
  full = jnp.einsum("hmd,hnd->hmn", queries.astype(jnp.float32),
                    jnp.repeat(keys.astype(jnp.float32), g, axis=0),
                    precision=jax.lax.Precision.HIGHEST)
  top_s, top_i = jax.lax.top_k(full, min(k, n))
  np.testing.assert_array_equal(np.asarray(ref_i)[..., :min(k, n)], np.asarray(top_i))
  np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_i))
  np.testing.assert_allclose(scores, ref_s, atol=1e-4, rtol=1e-5)
  if k > n:
    assert np.all(np.asarray(ids)[..., n:] == -1)
    assert np.all(np.isneginf(np.asarray(scores)[..., n:]))
  assert np.all(np.diff(np.asarray(scores)[..., :min(k, n)], axis=-1) <= 0)


def test_ties_go_to_the_lower_index_as_in_lax_top_k():
  """Integer-valued vectors tie often; the chunks' two-stage top-k (tiles by their maxima,
  then the kept tiles' scores) must pick the same ids as lax.top_k over the whole product."""
  rng = np.random.default_rng(7)
  queries = jnp.asarray(rng.integers(-2, 3, (2, 40, 8)), jnp.float32)
  keys = jnp.asarray(rng.integers(-2, 3, (1, 3000, 8)), jnp.float32)
  _, ids = ops.exact_topk(queries, keys, 12, block_q=16, block_n=1024)
  full = jnp.einsum("hmd,hnd->hmn", queries, jnp.repeat(keys, 2, axis=0), precision=jax.lax.Precision.HIGHEST)
  np.testing.assert_array_equal(np.asarray(ids), np.asarray(jax.lax.top_k(full, 12)[1]))


@pytest.mark.parametrize("n", [3001, 3008, 2990])
def test_tiled_top_k_equals_lax_top_k_for_rows_of_any_length(n):
  """Rows that are not a whole number of tiles are padded with -inf; ties (integer scores) and
  masked (-inf) stretches, down to fewer finite scores than k, must come out as lax.top_k's."""
  from ops.topk import _tile_width, _tiled_top_k

  k = 12
  assert _tile_width(n, k) == 16 and -(-n // 16) > k  # the tiled path, padded unless n = 3008
  rng = np.random.default_rng(n)
  s = rng.integers(-3, 4, (5, n)).astype(np.float32)
  s[1, : n - 40] = -np.inf  # 40 finite scores, at the end
  s[2, 7:] = -np.inf  # fewer finite scores than k
  s[3] = -np.inf
  got_s, got_i = _tiled_top_k(jnp.asarray(s), k)
  want_s, want_i = jax.lax.top_k(jnp.asarray(s), k)
  np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i))
  np.testing.assert_array_equal(np.asarray(got_s), np.asarray(want_s))


def test_key_lengths_and_empty():
  rng = np.random.default_rng(0)
  queries = jnp.asarray(rng.standard_normal((4, 9, 64)), jnp.float32)
  keys = jnp.asarray(rng.standard_normal((2, 40, 64)), jnp.float32)
  lens = jnp.array([30, 3], jnp.int32)
  s, i = ops.exact_topk(queries, keys, 6, key_lengths=lens, block_n=16)
  rs, ri = ops.exact_topk_reference(queries, keys, 6, key_lengths=lens)
  np.testing.assert_array_equal(np.asarray(i), np.asarray(ri))
  assert np.all(np.asarray(i)[:2] < 30) and np.all(np.asarray(i)[2:, :, 3:] == -1)
  s, i = ops.exact_topk(queries, keys, 0)
  assert s.shape == (4, 9, 0) and i.shape == (4, 9, 0)


@pytest.mark.parametrize("bad, err, match", [
    (dict(k=-1), ValueError, "k=-1"),
    (dict(hq=3), ValueError, "q_heads=3"),
    (dict(d=32), ValueError, "head_dim 32"),
    (dict(kdtype=jnp.int8), TypeError, "keys.dtype=int8"),
])
def test_bad_input(bad, err, match):
  queries = jnp.ones((bad.get("hq", 4), 5, bad.get("d", 64)), jnp.float32)
  keys = jnp.ones((2, 20, 64), bad.get("kdtype", jnp.float32))
  with pytest.raises(err, match=match):
    ops.exact_topk(queries, keys, bad.get("k", 3))


# -- nearest_keys: each key's nearest other keys (roar's connectivity candidates) -----------


def brute_neighbours(keys, count):
  """[N, count] by a full float64 sort of every pairwise L2 distance (-1 padded)."""
  k = keys.astype(np.float64)
  d = ((k[:, None, :] - k[None, :, :]) ** 2).sum(-1)
  np.fill_diagonal(d, np.inf)
  out = np.full((len(k), count), -1)
  c = min(count, len(k) - 1)
  out[:, :c] = np.argsort(d, axis=1, kind="stable")[:, :c]
  return out


@pytest.mark.parametrize("n,count,block_n", [(300, 8, 64), (40, 12, 16), (5, 7, 8)])
def test_nearest_keys_matches_brute_force_and_numpy(n, count, block_n):
  import host_index

  rng = np.random.default_rng(n)
  keys = rng.standard_normal((2, n, 16)).astype(np.float32)
  got = np.asarray(ops.nearest_keys(jnp.asarray(keys), count, block_q=32, block_n=block_n))
  assert got.shape == (2, n, count) and got.dtype == np.int32
  for h in range(2):
    want = brute_neighbours(keys[h], count)
    np.testing.assert_array_equal(got[h], want)  # random floats: no ties
    np.testing.assert_array_equal(host_index.key_neighbours(keys[h], count, block=37), want)


def test_nearest_keys_of_padded_keys_equal_those_of_the_keys_within_their_lengths():
  rng = np.random.default_rng(5)
  keys = rng.standard_normal((2, 300, 16)).astype(np.float32)
  lengths = np.array([257, 40], np.int32)
  got = np.asarray(ops.nearest_keys(jnp.asarray(keys), 8, key_lengths=jnp.asarray(lengths), block_q=64))
  for h, n in enumerate(lengths):
    np.testing.assert_array_equal(got[h, :n], np.asarray(ops.nearest_keys(jnp.asarray(keys[h:h + 1, :n]), 8))[0])
    assert np.all(got[h, n:] == -1)
  scalar = np.asarray(ops.nearest_keys(jnp.asarray(keys), 8, key_lengths=257))
  np.testing.assert_array_equal(scalar[0], got[0])


def test_nearest_keys_never_lists_a_key_as_its_own_neighbour_with_duplicates():
  keys = np.repeat(np.arange(6, dtype=np.float32)[:, None], 4, axis=1)[None]  # [1, 6, 4]
  keys = np.concatenate([keys, keys], axis=1)  # every key twice: ties at distance 0
  got = np.asarray(ops.nearest_keys(jnp.asarray(keys), 3))[0]
  for i, row in enumerate(got):
    assert i not in row and row[0] == (i + 6) % 12  # the duplicate is nearest


@pytest.mark.parametrize("bad,match", [
    (dict(keys=np.zeros((4, 8), np.float32), count=2), "keys"),
    (dict(keys=np.zeros((1, 4, 8), np.int32), count=2), "keys"),
    (dict(keys=np.zeros((1, 4, 8), np.float32), count=0), "count=0"),
    (dict(keys=np.zeros((1, 4, 8), np.float32), count=True), "count=True"),
    (dict(keys=np.zeros((1, 4, 8), np.float32), count=2, key_lengths=5), "key_lengths")])
def test_nearest_keys_bad_input(bad, match):
  with pytest.raises((ValueError, TypeError), match=match):
    ops.nearest_keys(jnp.asarray(bad["keys"]), bad["count"], key_lengths=bad.get("key_lengths"))
