"""ops.block_nearest_keys against brute force: exact when its probes cover every key, a recall
floor when they do not, and always well-formed rows (valid, distinct, never the key itself)."""

import jax.numpy as jnp
import numpy as np
import pytest

import host_index
import ops
from host_index import synthetic


def _sq_dists(keys, ids):  # keys [N, D], ids [N, C] -> [N, C] float64 squared L2 distances
  k = keys.astype(np.float64)
  return np.sum((k[:, None, :] - k[ids]) ** 2, axis=-1)


def _assert_well_formed(ids, n):  # ids [H, N, C]
  assert ids.dtype == np.int32 and np.all((ids >= 0) & (ids < n))
  assert not np.any(ids == np.arange(n)[None, :, None])  # never the key itself
  for row in ids.reshape(-1, ids.shape[-1]):
    assert len(set(row.tolist())) == len(row)


@pytest.mark.parametrize("n, block, probes", [
    (1001, 64, 16),  # 16 leaves of 63 (7 padding rows): every leaf probed
    (512, 32, 40),  # 16 leaves of 32, no padding; probes past the leaves count as all of them
])
def test_probes_covering_every_block_find_the_exact_neighbours(n, block, probes):
  rng = np.random.default_rng(n)
  keys = rng.standard_normal((2, n, 8)).astype(np.float32)
  got = np.asarray(ops.block_nearest_keys(jnp.asarray(keys), 12, block=block, probes=probes))
  assert got.shape == (2, n, 12)
  _assert_well_formed(got, n)
  for h in range(2):
    want = host_index.key_neighbours(keys[h], 12)
    # the same distances, nearest first (ids may differ only between keys at equal distance)
    np.testing.assert_allclose(_sq_dists(keys[h], got[h]), _sq_dists(keys[h], want), rtol=1e-5, atol=1e-5)


def test_few_probes_keep_most_neighbours_of_clustered_keys():
  n = 4096
  keys = np.stack([synthetic.clustered(n, 16, seed=s) for s in range(2)]).astype(np.float32)
  got = np.asarray(ops.block_nearest_keys(jnp.asarray(keys), 16, block=128, probes=4))  # 32 leaves, 4 probed
  _assert_well_formed(got, n)
  for h in range(2):
    want = host_index.key_neighbours(keys[h], 16)
    recall = np.mean([len(set(a) & set(b)) / 16 for a, b in zip(got[h], want)])
    assert recall > 0.8, recall
    d = _sq_dists(keys[h], got[h])
    assert np.all(np.diff(d, axis=-1) >= -1e-4)  # nearest first, up to float32 rounding


def test_one_probe_ranks_the_keys_of_its_own_block_only():
  keys = np.random.default_rng(1).standard_normal((1, 256, 4)).astype(np.float32)
  got = np.asarray(ops.block_nearest_keys(jnp.asarray(keys), 3, block=32, probes=1))[0]
  _assert_well_formed(got[None], 256)
  # a key and its neighbours share one block of 32, so two hops from any key stay within 32 keys
  member = [set(row.tolist()) | {i} for i, row in enumerate(got)]
  assert max(len(set().union(*(member[j] for j in member[i]))) for i in range(256)) <= 32


def test_falls_back_to_exact_neighbours_when_one_block_holds_every_key():
  keys = np.random.default_rng(0).standard_normal((1, 100, 4)).astype(np.float32)
  got = ops.block_nearest_keys(jnp.asarray(keys), 5, block=128, probes=2)
  np.testing.assert_array_equal(got, ops.nearest_keys(jnp.asarray(keys), 5))


@pytest.mark.parametrize("bad, match", [
    (dict(keys=np.zeros((4, 4), np.float32)), "keys"),
    (dict(keys=np.zeros((1, 4, 4), np.int32)), "keys.dtype"),
    (dict(count=0), "count=0"),
    (dict(block=0), "block=0"),
    (dict(probes=2.0), "probes=2.0"),
])
def test_bad_input(bad, match):
  args = dict(keys=np.zeros((1, 8, 4), np.float32), count=2, block=4, probes=2) | bad
  with pytest.raises((ValueError, TypeError), match=match):
    ops.block_nearest_keys(jnp.asarray(args.pop("keys")), args.pop("count"), **args)
