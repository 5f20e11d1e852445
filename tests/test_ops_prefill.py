"""ops.prefill_attention (XLA blockwise and the Pallas kernel in interpret mode) == the dense
masked reference."""

import zlib
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ops

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}

# (head_dim, group, kv_heads, dtype, chunk, seq, offsets, window, block_q, block_k)
CASES = [
    (64, 3, 2, jnp.float32, 37, 300, (100, 250), "traced0", 16, 64),
    (128, 4, 1, jnp.bfloat16, 20, 200, (0, 150), 16, 8, 32),
    (256, 8, 1, jnp.float32, 9, 90, (40, 81), "traced32", 4, 16),
]


def _make(seed, case):
  head_dim, group, kv_heads, dtype, chunk, seq, offsets, window, _, _ = case
  rng = np.random.default_rng(seed)
  batch = len(offsets)
  q = jnp.asarray(rng.standard_normal((batch, chunk, group * kv_heads, head_dim)), dtype)
  k = jnp.asarray(rng.standard_normal((batch, kv_heads, seq, head_dim)), dtype)
  v = jnp.asarray(rng.standard_normal((batch, kv_heads, seq, head_dim)), dtype)
  pos = jnp.asarray(np.stack([np.arange(chunk) + o for o in offsets]), jnp.int32)
  kv_lengths = jnp.asarray([o + chunk for o in offsets], jnp.int32)
  # Beyond kv_lengths the cache holds garbage (NaN): it must not leak.
  valid = np.arange(seq)[None, :] < np.asarray(kv_lengths)[:, None]
  k = jnp.where(valid[:, None, :, None], k, jnp.nan)
  v = jnp.where(valid[:, None, :, None], v, jnp.nan)
  if window == "traced32":
    window = jnp.int32(32)
  elif window == "traced0":
    window = jnp.int32(0)
  return q, k, v, pos, kv_lengths, window


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_reference(case, implementation):
  dtype, block_q, block_k = case[3], case[-2], case[-1]
  q, k, v, pos, kv_lengths, window = _make(zlib.crc32(repr(case).encode()), case)
  if implementation == "pallas":  # tiles are powers of two >= 16
    block_q, block_k = max(16, block_q), max(16, block_k)
  o, lse = ops.prefill_attention(q, k, v, pos, kv_lengths, window=window, block_q=block_q,
                                 block_k=block_k, implementation=implementation,
                                 interpret=implementation == "pallas")
  o_ref, lse_ref = ops.prefill_attention_reference(q, k, v, pos, kv_lengths, window=window)
  assert o.shape == q.shape and lse.shape == q.shape[:3]
  assert not np.isnan(np.asarray(o)).any() and not np.isnan(np.asarray(lse)).any()
  np.testing.assert_allclose(o, o_ref, atol=TOL[dtype], rtol=TOL[dtype])
  np.testing.assert_allclose(lse, lse_ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_chunks_equal_one_pass_and_layer_stacked(implementation):
  """Chunked prefill (two chunks, stacked cache, traced layer) == one dense pass."""
  rng = np.random.default_rng(1)
  layers, batch, hq, hkv, seq, d = 2, 1, 4, 2, 96, 64
  k = jnp.asarray(rng.standard_normal((layers, batch, hkv, seq, d)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((layers, batch, hkv, seq, d)), jnp.float32)
  q = jnp.asarray(rng.standard_normal((batch, seq, hq, d)), jnp.float32)
  pos = jnp.arange(seq, dtype=jnp.int32)[None]
  full_len = jnp.array([seq], jnp.int32)
  o_ref, lse_ref = ops.prefill_attention_reference(q, k[1], v[1], pos, full_len, window=24)
  fn = jax.jit(lambda qc, pc, n, layer: ops.prefill_attention(
      qc, k, v, pc, n, layer=layer, window=24, block_q=16, block_k=16, implementation=implementation,
      interpret=implementation == "pallas"))
  o1, l1 = fn(q[:, :50], pos[:, :50], jnp.array([50], jnp.int32), jnp.int32(1))
  o2, l2 = fn(q[:, 50:], pos[:, 50:], full_len, jnp.int32(1))
  np.testing.assert_allclose(jnp.concatenate([o1, o2], 1), o_ref, atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(jnp.concatenate([l1, l2], 1), lse_ref, atol=2e-5, rtol=2e-5)


def test_reference_matches_partial_attention_for_one_query():
  """Last query of a prefill == decode partial attention over [pos-w+1, pos]."""
  rng = np.random.default_rng(2)
  q = jnp.asarray(rng.standard_normal((1, 1, 6, 64)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((1, 2, 40, 64)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((1, 2, 40, 64)), jnp.float32)
  o, lse = ops.prefill_attention_reference(q, k, v, jnp.array([[30]], jnp.int32),
                                           jnp.array([40], jnp.int32), window=10)
  o2, lse2 = ops.partial_attention_reference(q[:, 0], k, v, jnp.array([31], jnp.int32),
                                             starts=jnp.array([21], jnp.int32))
  np.testing.assert_allclose(o[:, 0], o2, atol=1e-5)
  np.testing.assert_allclose(lse[:, 0], lse2, atol=1e-5)


@pytest.mark.parametrize("bad, err, match", [
    (dict(kv_lengths=[99]), ValueError, r"kv_lengths\[0\]=99"),
    (dict(q_heads=3), ValueError, "q_heads=3"),
    (dict(window=-1), ValueError, "window=-1"),
    (dict(pos_dtype=jnp.float32), TypeError, "q_positions.dtype=float32"),
    (dict(implementation="triton"), ValueError, "implementation='triton'"),
    (dict(implementation="pallas", head_dim=48), ValueError, "head_dim=48"),
    (dict(window=True), TypeError, "window=True"),
    (dict(window=2**31), ValueError, "window=2147483648"),
    (dict(chunk=0), ValueError, r"chunk = 0"),
    (dict(pos=np.array([[2**32 + 3, 0, 1, 2]])), ValueError, r"q_positions\[0, 0\]=4294967299"),
])
def test_bad_input_raises_naming_value(bad, err, match):
  d = bad.get("head_dim", 64)
  chunk = bad.get("chunk", 4)
  q = jnp.ones((1, chunk, bad.get("q_heads", 4), d), jnp.float32)
  k = jnp.ones((1, 2, 16, d), jnp.float32)
  pos = bad.get("pos", jnp.arange(chunk, dtype=bad.get("pos_dtype", jnp.int32))[None])
  with pytest.raises(err, match=match):
    ops.prefill_attention(q, k, k, pos, jnp.asarray(bad.get("kv_lengths", [4]), jnp.int32),
                          window=bad.get("window"),
                          implementation=bad.get("implementation", "xla"))


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("case", CASES, ids=str)
def test_pallas_on_gpu_matches_reference(case):
  dtype = case[3]
  q, k, v, pos, kv_lengths, window = _make(zlib.crc32(repr(case).encode()) + 1, case)
  fn = jax.jit(lambda q, k, v: ops.prefill_attention(q, k, v, pos, kv_lengths, window=window,
                                                     implementation="pallas"))
  assert "kvjax_prefill_attention" in fn.lower(q, k, v).as_text()
  o, lse = fn(q, k, v)
  o_ref, lse_ref = ops.prefill_attention_reference(q, k, v, pos, kv_lengths, window=window)
  np.testing.assert_allclose(o, o_ref, atol=TOL[dtype], rtol=TOL[dtype])
  np.testing.assert_allclose(lse, lse_ref, atol=TOL[dtype], rtol=TOL[dtype])
