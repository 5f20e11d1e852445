"""ops.merge_partials: random splits merged == dense attention over the whole set."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ops


def _rand(seed, batch=2, q_heads=8, kv_heads=2, seq=90, head_dim=64):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((batch, q_heads, head_dim)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((batch, kv_heads, seq, head_dim)) * 2, jnp.float32)
  v = jnp.asarray(rng.standard_normal((batch, kv_heads, seq, head_dim)), jnp.float32)
  return rng, q, k, v


@pytest.mark.parametrize("seed", [0, 1])
def test_random_splits_equal_dense(seed):
  rng, q, k, v = _rand(seed)
  seq = k.shape[2]
  lengths = jnp.full((q.shape[0],), seq, jnp.int32)
  o_full, lse_full = ops.partial_attention_reference(q, k, v, lengths)
  # Random cut points, including an empty piece (two equal cuts).
  cuts = np.sort(rng.integers(0, seq + 1, size=rng.integers(2, 6)))
  cuts = np.concatenate([[0], cuts, cuts[-1:], [seq]])
  parts = []
  for lo, hi in zip(cuts[:-1], cuts[1:]):
    starts = jnp.full_like(lengths, lo)
    parts.append(ops.partial_attention_reference(q, k, v, jnp.full_like(lengths, hi),
                                                 starts=starts))
  order = rng.permutation(len(parts))
  o, lse = ops.merge_partials([parts[i] for i in order])
  np.testing.assert_allclose(o, o_full, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(lse, lse_full, atol=1e-5, rtol=1e-5)


def test_kernel_splits_merge_with_host_partial():
  """Device kernel over a prefix + 'host' partial over the rest == whole set."""
  _, q, k, v = _rand(3)
  seq = k.shape[2]
  b = q.shape[0]
  cut = 37
  dev = ops.partial_attention(q, k, v, jnp.full((b,), cut, jnp.int32), interpret=True,
                              block_k=16)
  host = ops.partial_attention_reference(q, k, v, jnp.full((b,), seq, jnp.int32),
                                         starts=jnp.full((b,), cut, jnp.int32))
  o, lse = jax.jit(lambda a, c: ops.merge_partials([a, c]))(dev, host)
  o_full, lse_full = ops.partial_attention_reference(q, k, v, jnp.full((b,), seq, jnp.int32))
  np.testing.assert_allclose(o, o_full, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(lse, lse_full, atol=1e-5, rtol=1e-5)


def test_empty_partials():
  rng = np.random.default_rng(4)
  o1 = jnp.asarray(rng.standard_normal((3, 4, 16)), jnp.float32)
  lse1 = jnp.asarray(rng.standard_normal((3, 4)), jnp.float32)
  empty_o = jnp.full((3, 4, 16), jnp.nan)  # garbage in an empty partial is ignored
  empty_lse = jnp.full((3, 4), -jnp.inf)
  o, lse = ops.merge_partials([(empty_o, empty_lse), (o1, lse1), (empty_o, empty_lse)])
  np.testing.assert_allclose(o, o1, rtol=1e-6)
  np.testing.assert_allclose(lse, lse1, rtol=1e-6)
  o, lse = ops.merge_partials([(empty_o, empty_lse)] * 3)
  assert np.all(np.asarray(o) == 0) and np.all(np.isneginf(np.asarray(lse)))
  o, lse = ops.merge_partials([(empty_o, empty_lse)])
  assert np.all(np.asarray(o) == 0) and np.all(np.isneginf(np.asarray(lse)))
  # Mixed rows: some rows empty everywhere, others not.
  lse_mixed = lse1.at[0].set(-jnp.inf)
  o, lse = ops.merge_partials([(o1, lse_mixed), (empty_o, empty_lse)])
  assert np.all(np.asarray(o)[0] == 0) and np.all(np.isneginf(np.asarray(lse)[0]))
  np.testing.assert_allclose(np.asarray(o)[1:], np.asarray(o1)[1:], rtol=1e-6)


def test_merge_weights_by_lse():
  """Two partials: o = (e^a o1 + e^b o2) / (e^a + e^b), lse = logaddexp(a, b)."""
  rng = np.random.default_rng(5)
  o1, o2 = rng.standard_normal((2, 5, 8)).astype(np.float32)
  a, b = (rng.standard_normal((2, 5)) * 30).astype(np.float32)  # large spread: stability
  o, lse = ops.merge_partials([(jnp.asarray(o1), jnp.asarray(a)), (jnp.asarray(o2), jnp.asarray(b))])
  ref_lse = np.logaddexp(a.astype(np.float64), b)
  w1, w2 = np.exp(a - ref_lse), np.exp(b - ref_lse)
  np.testing.assert_allclose(lse, ref_lse, rtol=1e-6)
  np.testing.assert_allclose(o, w1[:, None] * o1 + w2[:, None] * o2, atol=1e-5, rtol=1e-5)


def test_bad_parts():
  o = jnp.ones((2, 4, 8))
  with pytest.raises(ValueError, match="parts="):
    ops.merge_partials([])
  with pytest.raises(ValueError, match=r"parts\[1\]"):
    ops.merge_partials([(o, jnp.ones((2, 4))), (o, jnp.ones((2, 3)))])
