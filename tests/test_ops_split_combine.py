"""The split-combine kernel (interpret mode) against merge_stacked, the jnp merge."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ops.merge import merge_stacked
from ops.split_combine import combine_splits


@pytest.mark.parametrize("groups,gp,splits", [(4, 16, 8), (3, 16, 4), (1, 16, 2), (8, 8, 16), (4, 16, 64)])
def test_combine_equals_merge_stacked(groups, gp, splits):
  batch, kv_heads, head_dim = 2, 3, 64  # 64 splits x 4 rows: head_dim in two blocks
  ko, kl, ke = jax.random.split(jax.random.key(groups * 100 + splits), 3)
  o = jax.random.normal(ko, (batch, kv_heads, splits, gp, head_dim), jnp.float32)
  lse = 3 * jax.random.normal(kl, (batch, kv_heads, splits, gp), jnp.float32)
  # Empty splits (lse = -inf) with garbage outputs, and one (sequence, head) with no keys at all.
  empty = jax.random.bernoulli(ke, 0.3, lse.shape).at[1, 2].set(True)
  lse = jnp.where(empty, -jnp.inf, lse)
  o = jnp.where(empty[..., None], jnp.nan, o)
  got_o, got_lse = combine_splits(o, lse, groups=groups, interpret=True)
  want_o, want_lse = merge_stacked(o, lse, axis=2)
  want_o = want_o[:, :, :groups].reshape(batch, kv_heads * groups, head_dim)
  want_lse = want_lse[:, :, :groups].reshape(batch, kv_heads * groups)
  assert got_o.shape == (batch, kv_heads * groups, head_dim)
  np.testing.assert_allclose(got_o, want_o, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(got_lse, want_lse, rtol=1e-5, atol=1e-6)
  # the all-empty (sequence, KV head) group: o = 0, lse = -inf, never NaN
  assert np.all(np.asarray(got_o[1, 2 * groups:3 * groups]) == 0)
  assert np.all(np.isneginf(np.asarray(got_lse[1, 2 * groups:3 * groups])))
