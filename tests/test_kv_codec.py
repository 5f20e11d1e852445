"""kvjax.kv_codec (int8 host rows) against its NumPy reference, and freekv with host_codec="int8"
against freekv with the model's dtype on the host."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import kvjax
from kvjax import kv_codec, row_update
from test_freekv import COVERING, PROMPTS, SMALL, STEPS, exchange_log, prompts, run  # noqa: F401 (fixture)
from test_generate import tiny_model


def rows(shape, seed=0):
  x = np.random.default_rng(seed).normal(size=shape).astype(np.float32)
  x[0, 0] = 0.0  # an all-zero row: scale 0, decoded as zeros
  x[0, 1, :3] = 40.0  # an outlier row
  return x


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_encode_and_decode_match_numpy_bit_for_bit_within_the_bound(dtype):
  x = rows((3, 5, 64)).astype(dtype)
  words = np.asarray(kv_codec.encode(jnp.asarray(x), "int8"))
  assert words.dtype == np.uint16 and words.shape == (3, 5, kv_codec.host_width("int8", 64)) == (3, 5, 34)
  np.testing.assert_array_equal(words, kv_codec.encode_np(x))
  back = np.asarray(kv_codec.decode(jnp.asarray(words), "int8", jnp.float32))
  np.testing.assert_array_equal(back, kv_codec.decode_np(words))
  x32 = x.astype(np.float32)
  bound = np.abs(x32).max(-1, keepdims=True) / 254 * (1 + 1e-6)
  assert np.all(np.abs(back - x32) <= bound)
  assert np.all(back[0, 0] == 0)
  assert np.abs(back - x32).max() > 0  # lossy: the test would notice a pass-through
  # Decoded to bfloat16, the decoded value's own rounding (2^-8 relative) adds to the bound.
  back16 = np.asarray(kv_codec.decode(jnp.asarray(words), "int8", jnp.bfloat16)).astype(np.float32)
  assert np.all(np.abs(back16 - x32) <= np.abs(x32).max(-1, keepdims=True) / 127 * (1 + 1e-6))


def test_none_is_the_identity_and_bad_codecs_are_refused():
  x = jnp.asarray(rows((2, 3, 8)))
  assert kv_codec.encode(x, "none") is x
  assert kv_codec.host_width("none", 8) == 8 and kv_codec.host_dtype("none", jnp.bfloat16) == "bfloat16"
  with pytest.raises(ValueError, match="head_dim 7 is odd"):
    kv_codec.check("int8", 7)
  with pytest.raises(ValueError, match="host_codec='int4'"):
    kv_codec.check("int4", 8)
  with pytest.raises(ValueError, match="host_codec='fp8'"):
    kvjax.policies.make_policy("freekv", host_codec="fp8")
  for fn in (lambda c: kv_codec.encode(x, c), lambda c: kv_codec.decode(x, c, jnp.float32),
             lambda c: kv_codec.host_width(c, 8), lambda c: kv_codec.host_dtype(c, jnp.float32),
             lambda c: kv_codec.wire_dtype(c, jnp.float32)):
    with pytest.raises(ValueError, match="host_codec='INT8'"):  # not quietly taken for int8
      fn("INT8")


def test_rows_too_small_for_a_normal_scale_encode_as_zeros_on_both():
  x = np.zeros((3, 8), np.float32)
  x[0, :3] = [1e-37, -3e-37, 2e-38]  # max|x| / 127 is subnormal: a GPU flushes it, NumPy would not
  x[1] = rows((1, 2, 8))[0, 1]  # an ordinary row beside them
  words = np.asarray(kv_codec.encode(jnp.asarray(x), "int8"))
  np.testing.assert_array_equal(words, kv_codec.encode_np(x))
  back = kv_codec.decode_np(words)
  np.testing.assert_array_equal(back[0], 0.0)
  np.testing.assert_array_equal(back[2], 0.0)
  assert np.abs(back[1] - x[1]).max() <= np.abs(x[1]).max() / 254 * (1 + 1e-6)


def test_scatter_rows_decodes_int8_pages():
  L, H, slots, P, D = 2, 2, 3, 4, 8
  pages = rows((5, P, D), seed=1)
  words = kv_codec.encode_np(pages)  # [5, P, W]
  update = row_update.new_update(row_update.StepBuffers(), 5, 5, P * words.shape[-1], np.uint16)
  dest = np.array([0, 3, 7, 8, 11])
  update.dest[:5], update.ids[:5] = dest, np.arange(5) + 10
  update.k[:5] = words.reshape(5, -1)
  update.v[:5] = kv_codec.encode_np(-pages).reshape(5, -1)
  update.pad(L * H * slots)
  buf = lambda: jnp.zeros((L, H, slots, P, D), jnp.float32)
  k, v, ids = row_update.scatter_rows(buf(), buf(), jnp.full((L, H, slots), -1, jnp.int32),
                                      jnp.asarray(update.packed), codec="int8")
  k, v = np.asarray(k).reshape(-1, P, D), np.asarray(v).reshape(-1, P, D)
  np.testing.assert_array_equal(k[dest], kv_codec.decode_np(words))
  np.testing.assert_array_equal(v[dest], -kv_codec.decode_np(words))  # symmetric: -x encodes as -q
  assert np.asarray(ids).ravel()[dest].tolist() == list(range(10, 15))


@pytest.mark.parametrize("bridge, lag", [("per_layer", 1), ("per_step", 1), ("per_step", 2)])
def test_freekv_int8_host_tracks_the_model_dtype_host_and_stores_fewer_bytes(bridge, lag, exchange_log):
  options = dict(budget=COVERING, bridge=bridge, lag=lag, dense_layers=(0,))
  plain = run(**options)
  coded = run(host_codec="int8", **options)
  scale = np.abs(plain.logits).max()
  gap = np.abs(coded.logits - plain.logits).max()
  assert 0 < gap < 0.02 * scale  # lossy, and close: int8 rows differ from float32 by <= max|row| / 254
  margins = np.sort(plain.logits, axis=-1)  # [steps, B, V]
  clear = (margins[..., -1] - margins[..., -2]) > 4 * gap
  got, want = np.asarray(coded.tokens).T, np.asarray(plain.tokens).T  # [steps, B]
  assert np.array_equal(got[clear], want[clear]) and clear.mean() > 0.5
  D = tiny_model("llama").cfg.head_dim
  # float32 on the CPU: rows of D * 4 bytes against D + 4 (same capacities); the float store's
  # context also counts its flat indexes' few bytes.
  ratio = coded.policy_stats["resident_bytes"] / plain.policy_stats["resident_bytes"]
  assert 0.95 * (D + 4) / (4 * D) < ratio <= (D + 4) / (4 * D)
  assert coded.policy_stats["recalled_bytes_per_step"] < plain.policy_stats["recalled_bytes_per_step"] / 2
  if bridge == "per_step":
    assert all(same for *_, same in exchange_log.landed)  # the pool holds the decoded stored pages
