"""ops.paged_partial_attention: Pallas kernel (interpret on CPU) == gather + dense reference."""

import zlib
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ops

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}

# (head_dim, group, kv_heads, dtype, page_size, slots, max_pages, num_splits)
CASES = [
    (64, 1, 2, jnp.float32, 16, 9, 5, None),
    (64, 3, 2, jnp.bfloat16, 16, 7, 6, 4),
    (256, 8, 1, jnp.float32, 16, 5, 3, 1),
    (128, 4, 2, jnp.bfloat16, 32, 6, 4, 2),
]


def _make_case(seed, batch, q_heads, kv_heads, slots, page_size, head_dim, max_pages, dtype,
               layers=None):
  rng = np.random.default_rng(seed)
  lead = () if layers is None else (layers,)
  shape = lead + (batch, kv_heads, slots, page_size, head_dim)
  q = jnp.asarray(rng.standard_normal((batch, q_heads, head_dim)), dtype)
  k = jnp.asarray(rng.standard_normal(shape), dtype)
  v = jnp.asarray(rng.standard_normal(shape), dtype)
  # Each (sequence, KV head) lists its own distinct pages; one lists none, one lists one.
  ids = np.stack([np.stack([rng.permutation(slots)[:max_pages] for _ in range(kv_heads)])
                  for _ in range(batch)])
  counts = rng.integers(1, max_pages + 1, size=(batch, kv_heads))
  counts[0, 0] = 0
  counts[-1, -1] = 1
  # Entries past the count are garbage (out of range): they must be ignored.
  ids = np.where(np.arange(max_pages) < counts[..., None], ids, 10**6)
  return q, k, v, jnp.asarray(ids, jnp.int32), jnp.asarray(counts, jnp.int32)


def _check(o, lse, o_ref, lse_ref, counts, group, dtype):
  o, lse = np.asarray(o), np.asarray(lse)
  assert not np.isnan(o).any() and not np.isnan(lse).any()
  empty = np.repeat(np.asarray(counts) == 0, group, axis=1)  # [B, Hq]
  assert np.all(o[empty] == 0) and np.all(np.isneginf(lse[empty]))
  np.testing.assert_allclose(o, o_ref, atol=TOL[dtype], rtol=TOL[dtype])
  np.testing.assert_allclose(lse, lse_ref, atol=TOL[dtype], rtol=TOL[dtype])


def _dense_check(q, k, v, ids, counts, o_ref, lse_ref):
  """The reference itself == partial_attention_reference over the gathered pages."""
  b, hkv, _, p, d = k.shape
  for bi in range(b):
    for h in range(hkv):
      c = int(counts[bi, h])
      if c == 0:
        continue
      kk = k[bi, h][ids[bi, h, :c]].reshape(1, 1, c * p, d)
      vv = v[bi, h][ids[bi, h, :c]].reshape(1, 1, c * p, d)
      g = q.shape[1] // hkv
      qq = q[bi:bi + 1, h * g:(h + 1) * g]
      o, lse = ops.partial_attention_reference(qq, kk, vv, jnp.array([c * p], jnp.int32))
      np.testing.assert_allclose(o[0], o_ref[bi, h * g:(h + 1) * g], atol=1e-5, rtol=1e-5)
      np.testing.assert_allclose(lse[0], lse_ref[bi, h * g:(h + 1) * g], atol=1e-5, rtol=1e-5)


class PagedTest:
  INTERPRET = True

  @pytest.fixture(autouse=True)
  def _backend(self):
    if not self.INTERPRET and jax.default_backend() != "gpu":
      pytest.skip("needs a GPU")

  @pytest.mark.parametrize("case", CASES, ids=str)
  def test_matches_reference(self, case):
    head_dim, group, kv_heads, dtype, page_size, slots, max_pages, splits = case
    q, k, v, ids, counts = _make_case(zlib.crc32(repr(case).encode()), 2, group * kv_heads, kv_heads, slots,
                                      page_size, head_dim, max_pages, dtype)
    o, lse = ops.paged_partial_attention(q, k, v, ids, counts, interpret=self.INTERPRET,
                                         num_splits=splits)
    o_ref, lse_ref = ops.paged_partial_attention_reference(q, k, v, ids, counts)
    _check(o, lse, o_ref, lse_ref, counts, group, dtype)

  def test_layer_stacked_traced_layer(self):
    q, k, v, ids, counts = _make_case(3, 2, 4, 2, 6, 16, 64, 4, jnp.float32, layers=3)
    fn = jax.jit(lambda layer: ops.paged_partial_attention(
        q, k, v, ids, counts, layer=layer, interpret=self.INTERPRET))
    o, lse = fn(jnp.int32(2))
    o_ref, lse_ref = ops.paged_partial_attention_reference(q, k[2], v[2], ids, counts)
    _check(o, lse, o_ref, lse_ref, counts, 2, jnp.float32)


class TestPagedInterpret(PagedTest):
  INTERPRET = True


@pytest.mark.gpu
class TestPagedGpu(PagedTest):
  INTERPRET = False

  def test_kernel_name_in_hlo(self):
    q, k, v, ids, counts = _make_case(4, 1, 32, 8, 80, 32, 128, 64, jnp.bfloat16)
    text = jax.jit(lambda q: ops.paged_partial_attention(q, k, v, ids, counts)).lower(q).as_text()
    assert "kvjax_paged_attention" in text


def test_reference_equals_dense_over_gathered_pages():
  q, k, v, ids, counts = _make_case(5, 2, 6, 2, 7, 16, 64, 4, jnp.float32)
  o_ref, lse_ref = ops.paged_partial_attention_reference(q, k, v, ids, counts)
  _dense_check(q, k, v, ids, counts, o_ref, lse_ref)


def test_xla_implementation_matches_reference():
  q, k, v, ids, counts = _make_case(6, 2, 8, 2, 7, 16, 64, 5, jnp.float32)
  o, lse = ops.paged_partial_attention(q, k, v, ids, counts, implementation="xla")
  o_ref, lse_ref = ops.paged_partial_attention_reference(q, k, v, ids, counts)
  _check(o, lse, o_ref, lse_ref, counts, 4, jnp.float32)


@pytest.mark.parametrize("bad, err, match", [
    (dict(ids_value=9), ValueError, r"page_ids\[0, 1, 0\]=9"),
    (dict(counts_value=5), ValueError, r"page_counts\[0, 0\]=5"),
    (dict(q_heads=5), ValueError, "q_heads=5"),
    (dict(ids_dtype=jnp.float32), TypeError, "page_ids.dtype=float32"),
    (dict(page_size=24), ValueError, "page_size=24"),
    (dict(max_pages=0), ValueError, r"lists no pages"),
    (dict(counts_value=2**32 + 1, counts_int64=True), ValueError, r"page_counts\[0, 0\]=4294967297"),
])
def test_bad_input_raises_naming_value(bad, err, match):
  page_size = bad.get("page_size", 16)
  q = jnp.ones((1, bad.get("q_heads", 4), 64), jnp.float32)
  k = jnp.ones((1, 2, 6, page_size, 64), jnp.float32)
  ids = np.zeros((1, 2, bad.get("max_pages", 4)), np.int32)
  counts = np.full((1, 2), 2 if ids.shape[-1] else 0, np.int64 if bad.get("counts_int64") else np.int32)
  if "ids_value" in bad:
    ids[0, 1, 0] = bad["ids_value"]
  if "counts_value" in bad:
    counts[0, 0] = bad["counts_value"]
  with pytest.raises(err, match=match):
    ops.paged_partial_attention(q, k, k, jnp.asarray(ids, bad.get("ids_dtype", jnp.int32)),
                                counts, interpret=True)  # NumPy counts: int64 stays int64 until checked
