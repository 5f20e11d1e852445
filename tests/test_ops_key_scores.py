"""ops.key_page_scores (Pallas, interpret mode) against its XLA twin and a NumPy reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ops
from ops.key_scores import split_bf16, unpack_planes


def _case(seed, B=2, Hq=6, H=2, N=37, P=8, D=32, bits=2):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((B, Hq, D)).astype(np.float32)
  codes = rng.integers(0, 256, size=(B, H, N, P, D * bits // 8), dtype=np.uint8)
  lo = rng.standard_normal((B, H, D)).astype(np.float32)
  step = rng.uniform(0.05, 0.5, size=(B, H, D)).astype(np.float32)
  return q, codes, lo, step


# (bits, pages, page size, head_dim). Pages per program: a power of two, at most 8192 code
# bytes / (P * D * bits / 8) and at most N; a partial last block is shifted back over the one
# before. 37 pages of 32 at 2 bits, D 64: 3 blocks of 16 (the third from page 21); 300 pages of
# 16 at 4 bits, D 128: 38 blocks of 8; 5 pages: 2 blocks of 4.
CASES = [(2, 37, 32, 32), (4, 5, 32, 32), (4, 64, 16, 32), (2, 37, 32, 64), (4, 300, 16, 128), (1, 9, 8, 128)]


ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")]


@pytest.mark.parametrize("interpret", [True, pytest.param(False, marks=ON_GPU)])
@pytest.mark.parametrize("bits, N, P, D", CASES)
def test_kernel_matches_numpy_and_xla(bits, N, P, D, interpret):
  if not interpret and not ops.key_scores_pallas_supported(P, D, bits):
    pytest.skip(f"{D * bits // 8}-byte keys: below Triton's dot")
  q, codes, lo, step = _case(bits + N, N=N, P=P, D=D, bits=bits)
  B, Hq, D = q.shape
  H = codes.shape[1]
  levels = np.asarray(unpack_planes(jnp.asarray(codes), bits))  # [B, H, N, P, D]
  per_byte = 8 // bits
  dc = D // per_byte
  # channel d sits in byte d % dc at bits (d // dc) * bits
  d = 7
  np.testing.assert_array_equal(levels[..., d], (codes[..., d % dc] >> ((d // dc) * bits)) & (2**bits - 1))
  k_hat = lo[:, :, None, None] + levels * step[:, :, None, None]
  want = 0.3 * np.einsum("bhgd,bhnpd->bhgnp", q.reshape(B, H, Hq // H, D), k_hat).max(-1)
  got = ops.key_page_scores(jnp.asarray(q), jnp.asarray(codes), jnp.asarray(lo), jnp.asarray(step), bits=bits,
                            scale=0.3, interpret=interpret)
  ref = ops.key_page_scores_reference(jnp.asarray(q), jnp.asarray(codes), jnp.asarray(lo), jnp.asarray(step),
                                      bits=bits, scale=0.3)
  assert got.shape == (B, H, Hq // H, N)
  np.testing.assert_allclose(np.asarray(ref), want, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("interpret", [True, pytest.param(False, marks=ON_GPU)])
@pytest.mark.parametrize("block_bytes", [1, 3 * 32 * 16, 1 << 20])
def test_block_bytes_round_to_whole_pages(block_bytes, interpret):
  # 1 byte: one page per program; 3 pages' bytes: 2 pages; 1 MiB: capped by the 37 pages (32).
  q, codes, lo, step = _case(5, N=37, P=32, D=64, bits=2)
  args = [jnp.asarray(x) for x in (q, codes, lo, step)]
  want = ops.key_page_scores_reference(*args, bits=2, scale=0.5)
  got = ops.key_page_scores(*args, bits=2, scale=0.5, interpret=interpret, block_bytes=block_bytes, num_warps=8)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)


def test_split_bf16_keeps_the_low_part():
  # Under jit, on whichever backend runs the tests: the H200's XLA had simplified an
  # f32 -> bf16 -> f32 round trip away, which left lo = 0.
  x = jnp.asarray(np.random.default_rng(0).standard_normal(4096).astype(np.float32) * 10.0 ** np.arange(-3, 5).repeat(512))
  hi, lo = jax.jit(split_bf16)(x)
  assert hi.dtype == lo.dtype == jnp.bfloat16
  err = np.abs(np.asarray(hi, np.float64) + np.asarray(lo, np.float64) - np.asarray(x, np.float64))
  assert np.all(err <= 2.0**-15 * np.abs(np.asarray(x))), err.max()
  assert np.any(np.asarray(lo) != 0)


def test_pallas_supported():
  assert ops.key_scores_pallas_supported(16, 64, 2) and ops.key_scores_pallas_supported(32, 128, 1)
  assert not ops.key_scores_pallas_supported(16, 64, 1)  # 8 bytes per key
  assert not ops.key_scores_pallas_supported(24, 128, 4)  # pages of 24


def test_unsupported_shape_on_the_gpu_path_names_it():
  q, codes, lo, step = _case(0, P=24, D=64, bits=4)
  with pytest.raises(ValueError, match="page_size=24"):
    ops.key_page_scores(q, codes, lo, step, bits=4, scale=1.0, interpret=False)


@pytest.mark.parametrize("change, message", [
    (dict(implementation="cuda"), "implementation='cuda'"),
    (dict(bits=3), "bits=3"),
    (dict(codes=np.zeros((2, 2, 4, 8, 8), np.int32)), "codes.dtype=int32"),
    (dict(codes=np.zeros((2, 2, 4, 8, 4), np.uint8)), "head_dim 32"),
    (dict(lo=np.zeros((2, 3, 32), np.float32)), "shapes"),
    (dict(q=np.zeros((1, 6, 32), np.float32)), "q batch 1"),  # was broadcast against 2 sequences of codes
    (dict(q=np.zeros((2, 6, 32), np.int32)), "q.dtype=int32"),
])
def test_bad_input(change, message):
  q, codes, lo, step = _case(0)
  args = dict(q=q, codes=codes, lo=lo, step=step, bits=2, scale=1.0, implementation="pallas") | change
  with pytest.raises((ValueError, TypeError), match=message):
    ops.key_page_scores(**args)
