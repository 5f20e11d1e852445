"""ops.partial_attention: Pallas kernel (interpret mode on CPU) == float32 reference.

Shapes are small and the (head_dim x group x dtype x layout) product is sampled
so the interpret-mode suite stays fast; the GPU class reruns the same cases
compiled (marked `gpu`, skipped on CPU).
"""

import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ops
from ops.partial_attention import default_config
from ops.rows_attention import attend_rows

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2, jnp.float16: 5e-3}

# (head_dim, group, kv_heads, dtype, seq_len, block_k, num_splits)
CASES = [
    (64, 1, 2, jnp.float32, 83, 16, None),
    (128, 3, 1, jnp.bfloat16, 100, 32, 2),
    (256, 4, 1, jnp.float32, 40, 16, 3),
    (64, 8, 1, jnp.bfloat16, 77, 16, None),
    (256, 8, 1, jnp.float16, 33, 16, 2),
]


def _make_case(seed, batch, q_heads, kv_heads, seq_len, head_dim, dtype, layers=None,
               poison=True):
  """Fresh random q/k/v and ragged lengths/starts (an empty set and a one-token set)."""
  rng = np.random.default_rng(seed)
  lead = () if layers is None else (layers,)
  q = rng.standard_normal((batch, q_heads, head_dim)).astype(np.float32)
  k = rng.standard_normal(lead + (batch, kv_heads, seq_len, head_dim)).astype(np.float32)
  v = rng.standard_normal(lead + (batch, kv_heads, seq_len, head_dim)).astype(np.float32)
  lengths = rng.integers(1, seq_len + 1, size=batch)
  starts = np.zeros(batch, np.int64)
  lengths[0] = 0  # empty set
  if batch > 1:
    lengths[1], starts[1] = 6, 5  # one token, starts > 0
  if batch > 2:
    starts[2] = rng.integers(1, lengths[2]) if lengths[2] > 1 else 0
  if poison:
    # Outside [start, length) the buffer holds NaN: it must never leak.
    pos = np.arange(seq_len)
    outside = (pos[None] < starts[:, None]) | (pos[None] >= lengths[:, None])  # [B, S]
    mask = outside[:, None, :, None]
    k = np.where(mask, np.nan, k)
    v = np.where(mask, np.nan, v)
  cast = lambda x: jnp.asarray(x, dtype)
  return (cast(q), cast(k), cast(v), jnp.asarray(lengths, jnp.int32),
          jnp.asarray(starts, jnp.int32))


def _check_close(o, lse, o_ref, lse_ref, lengths, starts, dtype):
  o, lse, o_ref, lse_ref = map(np.asarray, (o, lse, o_ref, lse_ref))
  assert o.dtype == np.float32 and lse.dtype == np.float32
  assert not np.isnan(o).any() and not np.isnan(lse).any()
  empty = np.asarray(lengths) <= np.asarray(starts)
  assert np.all(o[empty] == 0) and np.all(np.isneginf(lse[empty]))
  assert np.all(np.isfinite(lse[~empty]))
  tol = TOL[dtype]
  np.testing.assert_allclose(o, o_ref, atol=tol, rtol=tol)
  np.testing.assert_allclose(lse, lse_ref, atol=tol, rtol=tol)


class PartialAttentionTest:
  INTERPRET = True

  @pytest.fixture(autouse=True)
  def _backend(self):
    if not self.INTERPRET and jax.default_backend() != "gpu":
      pytest.skip("needs a GPU")

  @pytest.mark.parametrize("case", CASES, ids=lambda c: str(c))
  def test_matches_reference(self, case):
    head_dim, group, kv_heads, dtype, seq_len, block_k, num_splits = case
    q, k, v, lengths, starts = _make_case(
        zlib.crc32(repr(case).encode()), 3, group * kv_heads, kv_heads, seq_len, head_dim, dtype)
    o, lse = ops.partial_attention(q, k, v, lengths, starts=starts, interpret=self.INTERPRET,
                                   block_k=block_k, num_splits=num_splits)
    o_ref, lse_ref = ops.partial_attention_reference(q, k, v, lengths, starts=starts)
    _check_close(o, lse, o_ref, lse_ref, lengths, starts, dtype)
    # Deterministic: a second run is bitwise identical.
    o2, lse2 = ops.partial_attention(q, k, v, lengths, starts=starts, interpret=self.INTERPRET,
                                     block_k=block_k, num_splits=num_splits)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o2))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse2))

  @pytest.mark.parametrize("num_splits", [1, 3])
  def test_second_interval_matches_reference(self, num_splits):
    """Two disjoint intervals in one call (a wrapped ring and its sinks): the union of the sets,
    with keys between and around them NaN; one interval sharing a block with the other, one
    empty, and a sequence with only the second."""
    seq_len, head_dim, dtype = 90, 64, jnp.float32
    q, k, v, _, _ = _make_case(12, 4, 4, 2, seq_len, head_dim, dtype, poison=False)
    starts = jnp.asarray([40, 10, 0, 50], jnp.int32)
    lengths = jnp.asarray([90, 20, 0, 77], jnp.int32)
    starts2 = jnp.asarray([0, 21, 5, 0], jnp.int32)
    lengths2 = jnp.asarray([8, 23, 30, 0], jnp.int32)
    pos = np.arange(seq_len)
    inside = (((pos >= np.asarray(starts)[:, None]) & (pos < np.asarray(lengths)[:, None]))
              | ((pos >= np.asarray(starts2)[:, None]) & (pos < np.asarray(lengths2)[:, None])))
    k = jnp.where(inside[:, None, :, None], k, jnp.nan)
    v = jnp.where(inside[:, None, :, None], v, jnp.nan)
    o, lse = ops.partial_attention(q, k, v, lengths, starts=starts, starts2=starts2, lengths2=lengths2,
                                   interpret=self.INTERPRET, block_k=16, num_splits=num_splits)
    o_ref, lse_ref = ops.partial_attention_reference(q, k, v, lengths, starts=starts, starts2=starts2,
                                                     lengths2=lengths2)
    _check_close(o, lse, o_ref, lse_ref, jnp.asarray(inside.sum(1)), jnp.zeros(4, jnp.int32), dtype)
    # The union equals the two intervals attended apart and merged.
    parts = [ops.partial_attention_reference(q, k, v, e, starts=s0) for s0, e in ((starts, lengths), (starts2, lengths2))]
    o_two, lse_two = ops.merge_partials(parts)
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_two), atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_two), atol=2e-5, rtol=2e-5)

  # (layers, group, kv_heads, seq_len, rows a head, num_splits, dtype): rows fewer than a tile
  # (padded), ragged against the 32-row block, bfloat16 storage
  ROW_CASES = [(None, 3, 1, 40, 37, None, jnp.float32), (3, 3, 2, 100, 70, 4, jnp.float32),
               (None, 4, 2, 33, 8, 2, jnp.float32), (2, 1, 4, 200, 96, 8, jnp.bfloat16)]

  @pytest.mark.parametrize("case", ROW_CASES, ids=str)
  def test_rows_match_reference(self, case):
    """Each query head's own rows in the same call == one softmax over the union (reference) ==
    the shared keys and the rows attended apart and merged. Empty rows hold NaN; sequence 0 has
    no shared keys and its head 0 no rows (empty: o = 0, lse = -inf); its head 1 rows only."""
    layers, group, kv_heads, seq_len, n, num_splits, dtype = case
    batch, head_dim = 2, 64
    q_heads = group * kv_heads
    q, k, v, _, _ = _make_case(zlib.crc32(repr(case).encode()), batch, q_heads, kv_heads, seq_len, head_dim, dtype,
                               layers=layers, poison=False)
    rng = np.random.default_rng(len(repr(case)))
    lead = () if layers is None else (layers,)
    ids = rng.integers(-1, 4, size=lead + (batch, q_heads, n)).astype(np.int32)  # ~1 in 5 empty
    ids[..., 0, 0, :] = -1
    ids[..., 0, 1 % q_heads, 0] = 7
    rows_k = np.where(ids[..., None] < 0, np.nan, rng.standard_normal(lead + (batch, q_heads, n, head_dim)))
    rows_v = np.where(ids[..., None] < 0, np.nan, rng.standard_normal(lead + (batch, q_heads, n, head_dim)))
    rows = dict(rows_k=jnp.asarray(rows_k, dtype), rows_v=jnp.asarray(rows_v, dtype), rows_ids=jnp.asarray(ids))
    lengths = jnp.asarray([0, seq_len - 3], jnp.int32)
    layer = None if layers is None else 1
    o, lse = ops.partial_attention(q, k, v, lengths, layer=layer, interpret=self.INTERPRET, block_k=16,
                                   num_splits=num_splits, **rows)
    o_ref, lse_ref = ops.partial_attention_reference(q, k, v, lengths, layer=layer, **rows)
    o, lse, o_ref, lse_ref = map(np.asarray, (o, lse, o_ref, lse_ref))
    empty = np.zeros((batch, q_heads), bool)
    empty[0, 0] = True
    assert np.array_equal(np.isneginf(lse_ref), empty) and np.array_equal(np.isneginf(lse), empty)
    assert np.all(o[0, 0] == 0) and not np.isnan(o).any()
    tol = TOL[dtype]
    np.testing.assert_allclose(o, o_ref, atol=tol, rtol=tol)
    np.testing.assert_allclose(lse[~empty], lse_ref[~empty], atol=tol, rtol=tol)
    o_xla, lse_xla = ops.partial_attention(q, k, v, lengths, layer=layer, implementation="xla", **rows)
    np.testing.assert_allclose(np.asarray(o_xla), o_ref, atol=tol, rtol=tol)
    np.testing.assert_allclose(np.asarray(lse_xla)[~empty], lse_ref[~empty], atol=tol, rtol=tol)
    shared = ops.partial_attention_reference(q, k, v, lengths, layer=layer)
    pick = (lambda x: x) if layers is None else (lambda x: x[layer])
    own = attend_rows(q, pick(rows["rows_k"]), pick(rows["rows_v"]), pick(rows["rows_ids"]) >= 0, scale=head_dim**-0.5)
    o_two, _ = ops.merge_partials([shared, own])
    np.testing.assert_allclose(o, np.asarray(o_two), atol=tol, rtol=tol)

  def test_layer_stacked_traced_layer_in_scan(self):
    """Stacked cache in a scan carry, traced layer: each layer == its own reference."""
    layers, kv_heads, group, seq_len, head_dim = 3, 2, 2, 48, 64
    q, k, v, lengths, starts = _make_case(7, 2, group * kv_heads, kv_heads, seq_len, head_dim,
                                          jnp.float32, layers=layers)

    @jax.jit
    def run(q, k, v):
      def step(carry, layer):
        ck, cv = carry
        o, lse = ops.partial_attention(q, ck, cv, lengths, starts=starts, layer=layer,
                                       interpret=self.INTERPRET, block_k=16)
        return carry, (o, lse)
      _, out = jax.lax.scan(step, (k, v), jnp.arange(layers, dtype=jnp.int32))
      return out

    o, lse = run(q, k, v)
    for layer in range(layers):
      o_ref, lse_ref = ops.partial_attention_reference(q, k[layer], v[layer], lengths,
                                                       starts=starts)
      _check_close(o[layer], lse[layer], o_ref, lse_ref, lengths, starts, jnp.float32)

  def test_layer_stacked_no_slice_copy(self):
    """The kernel gets the whole stacked cache: no dynamic_slice/gather of a layer."""
    q, k, v, lengths, starts = _make_case(8, 1, 4, 2, 32, 64, jnp.bfloat16, layers=4,
                                          poison=False)
    fn = lambda layer: ops.partial_attention(q, k, v, lengths, layer=layer,
                                             interpret=self.INTERPRET)
    text = str(jax.make_jaxpr(fn)(jnp.int32(1)))
    assert "pallas_call" in text
    # Interpret mode discharges the kernel body into the jaxpr; look only outside it.
    outer = text.split("pallas_call")[0]
    assert "dynamic_slice" not in outer and "gather" not in outer
    assert re.search(r"bf16\[4,1,2,32,64\]", text)


class TestPartialAttentionInterpret(PartialAttentionTest):
  INTERPRET = True


@pytest.mark.gpu
class TestPartialAttentionGpu(PartialAttentionTest):
  INTERPRET = False

  def test_kernel_name_in_hlo(self):
    q, k, v, lengths, starts = _make_case(9, 2, 32, 8, 1024, 128, jnp.bfloat16, poison=False)
    text = jax.jit(lambda q, k, v: ops.partial_attention(q, k, v, lengths)).lower(
        q, k, v).as_text()
    assert "kvjax_partial_attention" in text

  def test_long_set_matches_reference(self):
    q, k, v, lengths, starts = _make_case(10, 2, 32, 8, 8192 + 37, 128, jnp.bfloat16)
    o, lse = ops.partial_attention(q, k, v, lengths, starts=starts)
    o_ref, lse_ref = ops.partial_attention_reference(q, k, v, lengths, starts=starts)
    _check_close(o, lse, o_ref, lse_ref, lengths, starts, jnp.bfloat16)


def test_xla_implementation_matches_reference():
  q, k, v, lengths, starts = _make_case(11, 3, 8, 2, 70, 64, jnp.float32, layers=2,
                                        poison=True)  # NaN outside the set: once gave NaN outputs
  fn = jax.jit(lambda layer: ops.partial_attention(q, k, v, lengths, starts=starts, layer=layer,
                                                   implementation="xla"))
  o, lse = fn(jnp.int32(1))
  o_ref, lse_ref = ops.partial_attention_reference(q, k, v, lengths, starts=starts, layer=1)
  _check_close(o, lse, o_ref, lse_ref, lengths, starts, jnp.float32)


def test_default_config_fills_device_and_respects_shape():
  block_k, splits, split_len = default_config(1, 8, 131072, 128)
  assert 8 * splits >= 256 and split_len % block_k == 0 and splits * split_len >= 131072
  block_k, splits, split_len = default_config(8, 8, 640, 128)
  assert splits * split_len >= 640 and (splits - 1) * split_len < 640


def test_int64_lengths_are_checked_before_narrowing():
  """2**32 + 5 once wrapped to 5 in jnp.asarray (int32) before the range check saw it."""
  q, k = jnp.ones((1, 2, 64), jnp.float32), jnp.ones((1, 1, 20, 64), jnp.float32)
  with pytest.raises(ValueError, match=r"lengths\[0\]=4294967301"):
    ops.partial_attention(q, k, k, np.array([2**32 + 5]), implementation="xla")
  with pytest.raises(ValueError, match=r"starts\[0\]=4294967297"):
    ops.partial_attention(q, k, k, [5], starts=[2**32 + 1], implementation="xla")


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_a_cache_without_slots_is_refused(implementation):
  q, k = jnp.ones((1, 2, 64), jnp.float32), jnp.ones((1, 1, 0, 64), jnp.float32)
  with pytest.raises(ValueError, match=r"no key slots"):
    ops.partial_attention(q, k, k, [0], implementation=implementation, interpret=True)


@pytest.mark.parametrize("bad, err, match", [
    (dict(q_heads=6, kv_heads=4), ValueError, "q_heads=6"),
    (dict(k_dtype=jnp.int32), TypeError, "k.dtype=int32"),
    (dict(lengths=[5, 99]), ValueError, r"lengths\[1\]=99"),
    (dict(lengths_dtype=jnp.float32), TypeError, "lengths.dtype=float32"),
    (dict(starts=[-1, 0]), ValueError, r"starts\[0\]=-1"),
    (dict(q_dim=32), ValueError, "head_dim 32"),
    (dict(layer=5), ValueError, r"layer\[\]=5"),
    (dict(layer=None), ValueError, "pass layer="),
    (dict(implementation="cuda"), ValueError, "implementation='cuda'"),
    (dict(starts2=[0, 1]), ValueError, "starts2 and lengths2 go together"),
    (dict(starts2=[0, 1], lengths2=[3, 21]), ValueError, r"lengths2\[1\]=21"),
    (dict(starts2=[3, 7], lengths2=[6, 9]), ValueError, r"sequence 0: .*\[0, 5\) overlaps .*\[3, 6\)"),
    (dict(rows=("rows_k", "rows_v")), ValueError, r"go together; missing \['rows_ids'\]"),
    (dict(rows_heads=2), ValueError, r"rows_k.shape=\(2, 2, 5, 64\).*\[batch, q_heads, rows, head_dim\]"),
    (dict(rows_ids_dtype=jnp.float32), TypeError, "rows_ids.dtype=float32"),
])
def test_bad_input_raises_naming_value(bad, err, match):
  q_heads, kv_heads = bad.get("q_heads", 4), bad.get("kv_heads", 2)
  layers = 3 if "layer" in bad else None
  lead = () if layers is None else (layers,)
  q = jnp.ones((2, q_heads, bad.get("q_dim", 64)), jnp.float32)
  k = jnp.ones(lead + (2, kv_heads, 20, 64), bad.get("k_dtype", jnp.float32))
  lengths = jnp.asarray(bad.get("lengths", [5, 7]), bad.get("lengths_dtype", jnp.int32))
  kwargs = {}
  for name in ("starts", "starts2", "lengths2"):
    if name in bad:
      kwargs[name] = jnp.asarray(bad[name], jnp.int32)
  if layers is not None:
    kwargs["layer"] = bad["layer"]
  if any(name.startswith("rows") for name in bad):
    rows_k = jnp.ones((2, bad.get("rows_heads", q_heads), 5, 64), jnp.float32)
    given = dict(rows_k=rows_k, rows_v=rows_k, rows_ids=jnp.ones((2, q_heads, 5), bad.get("rows_ids_dtype", jnp.int32)))
    kwargs.update({name: given[name] for name in bad.get("rows", given)})
  with pytest.raises(err, match=match):
    ops.partial_attention(q, k, k, lengths, interpret=True,
                          implementation=bad.get("implementation", "pallas"), **kwargs)
