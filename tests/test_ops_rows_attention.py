"""ops.partial_attention_with_rows: the Pallas kernel (interpret mode on CPU) and the XLA path
== the float32 reference (one softmax over a head's cache intervals and its own rows), and
== the composition it replaces (partial_attention, the rows alone, merge_partials)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ops
from ops.rows_attention import partial_attention_with_rows, partial_attention_with_rows_reference

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


def _case(seed, *, batch=3, q_heads=6, kv_heads=2, seq=40, rows=21, head_dim=32, layers=2, dtype=jnp.float32):
  """Random q, cache and rows, with NaN wherever nothing may be read: cache slots outside the
  intervals and rows whose id is -1; sequence 0 has an empty cache set and (head 0) no rows."""
  rng = np.random.default_rng(seed)
  lead = (layers,) if layers else ()
  normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
  q = normal(batch, q_heads, head_dim)
  k, v = normal(*lead, batch, kv_heads, seq, head_dim), normal(*lead, batch, kv_heads, seq, head_dim)
  rows_k, rows_v = normal(*lead, batch, q_heads, rows, head_dim), normal(*lead, batch, q_heads, rows, head_dim)
  ids = np.where(rng.random(lead + (batch, q_heads, rows)) < 0.7, rng.integers(0, 1000, lead + (batch, q_heads, rows)),
                 -1)
  ids[..., 0, 0, :] = -1  # sequence 0, head 0: no row
  starts = rng.integers(4, seq // 2, batch)  # a ring's window from `starts`, its sinks [0, 3)
  lengths = rng.integers(seq // 2, seq + 1, batch)
  starts2, lengths2 = np.zeros(batch, np.int64), np.full(batch, 3)
  lengths[0], lengths2[0] = starts[0], 0  # sequence 0: the cache part is empty
  pos = np.arange(seq)
  inside = ((pos >= starts[:, None]) & (pos < lengths[:, None])) | ((pos >= starts2[:, None]) & (pos < lengths2[:, None]))
  k = np.where(inside[:, None, :, None], k, np.nan)
  v = np.where(inside[:, None, :, None], v, np.nan)
  rows_k, rows_v = (np.where(ids[..., None] >= 0, x, np.nan) for x in (rows_k, rows_v))
  cast = lambda x: jnp.asarray(x, dtype)
  return dict(q=cast(q), k=cast(k), v=cast(v), lengths=jnp.asarray(lengths, jnp.int32), rows_k=cast(rows_k),
              rows_v=cast(rows_v), rows_ids=jnp.asarray(ids, jnp.int32), starts=jnp.asarray(starts, jnp.int32),
              starts2=jnp.asarray(starts2, jnp.int32), lengths2=jnp.asarray(lengths2, jnp.int32))


def _check(o, lse, o_ref, lse_ref, tol):
  o, lse, o_ref, lse_ref = map(np.asarray, (o, lse, o_ref, lse_ref))
  assert o.dtype == np.float32 and lse.dtype == np.float32
  assert not np.isnan(o).any() and not np.isnan(lse).any()
  np.testing.assert_allclose(o, o_ref, atol=tol, rtol=tol)
  np.testing.assert_allclose(lse, lse_ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("implementation", ["pallas", "xla"])
@pytest.mark.parametrize("shape", [
    dict(),  # stacked, rows not a multiple of the row block, group of 3
    dict(layers=0, rows=150, seq=90, q_heads=4, kv_heads=4),  # unstacked, several (ragged) row blocks, group 1
    dict(rows=5, seq=10, q_heads=8, kv_heads=1, head_dim=16),  # fewer rows and keys than a tile: padded
])
def test_matches_reference(implementation, shape):
  case = _case(0, **shape)
  layer = 1 if shape.get("layers", 2) else None
  o, lse = partial_attention_with_rows(**case, layer=layer, scale=0.3, implementation=implementation,
                                       interpret=True)
  _check(o, lse, *partial_attention_with_rows_reference(**case, layer=layer, scale=0.3), TOL[jnp.float32])


@pytest.mark.parametrize("implementation", ["pallas", "xla"])
def test_rows_alone_match_numpy_masked_attention(implementation):
  """An empty cache interval: each head's softmax over its valid rows, against NumPy in float64."""
  case = _case(5, layers=0, rows=37)
  case |= dict(lengths=jnp.zeros_like(case["lengths"]), lengths2=jnp.zeros_like(case["lengths2"]))
  o, lse = partial_attention_with_rows(**case, scale=0.3, implementation=implementation, interpret=True)
  q, k, v, ids = (np.asarray(case[name], np.float64) for name in ("q", "rows_k", "rows_v", "rows_ids"))
  for b in range(q.shape[0]):
    for h in range(q.shape[1]):
      valid = ids[b, h] >= 0
      if not valid.any():
        assert np.all(np.asarray(o[b, h]) == 0) and np.asarray(lse[b, h]) == -np.inf
        continue
      s = 0.3 * k[b, h, valid] @ q[b, h]
      w = np.exp(s - s.max())
      np.testing.assert_allclose(o[b, h], (w / w.sum()) @ v[b, h, valid], rtol=1e-5, atol=1e-5)
      np.testing.assert_allclose(lse[b, h], s.max() + np.log(w.sum()), rtol=1e-5)


def test_empty_union_gives_zero_and_neg_inf():
  case = _case(1)
  o, lse = partial_attention_with_rows(**case, layer=0, interpret=True)
  assert np.all(np.asarray(o)[0, 0] == 0) and np.asarray(lse)[0, 0] == -np.inf  # seq 0, head 0: nothing at all
  assert np.isfinite(np.asarray(lse)[0, 1])  # head 1 of seq 0 has rows only


def test_bf16_traced_layer_in_scan_matches_reference_and_composition():
  case = _case(2, layers=3, dtype=jnp.bfloat16)

  def run(fn):
    def body(carry, layer):
      return carry, fn(**case, layer=layer)
    return jax.lax.scan(body, 0, jnp.arange(3, dtype=jnp.int32))[1]

  o, lse = jax.jit(lambda: run(lambda **kw: partial_attention_with_rows(**kw, interpret=True)))()
  o_ref, lse_ref = run(partial_attention_with_rows_reference)
  _check(o, lse, o_ref, lse_ref, TOL[jnp.bfloat16])

  def composed(layer, **kw):  # what the retrieval step did before this op
    ring = ops.partial_attention(kw["q"], kw["k"], kw["v"], kw["lengths"], starts=kw["starts"],
                                 starts2=kw["starts2"], lengths2=kw["lengths2"], layer=layer, interpret=True)
    rows = partial_attention_with_rows_reference(  # rows alone: an empty cache interval
        kw["q"], kw["k"], kw["v"], jnp.zeros_like(kw["lengths"]), kw["rows_k"], kw["rows_v"], kw["rows_ids"],
        layer=layer)
    return ops.merge_partials([ring, rows])
  _check(o, lse, *run(composed), TOL[jnp.bfloat16])


def test_kernel_indexes_stacked_buffers_in_place():
  case = _case(3, layers=4, dtype=jnp.bfloat16)
  text = str(jax.make_jaxpr(lambda layer: partial_attention_with_rows(**case, layer=layer, interpret=True))(
      jnp.int32(2)))
  assert "pallas_call" in text
  outer = text.split("pallas_call")[0]  # interpret mode discharges the body into the jaxpr: look before it
  assert "dynamic_slice" not in outer and "gather" not in outer
  assert "bf16[4,3,6,21,32]" in text  # the stacked rows reach the kernel whole


@pytest.mark.parametrize("change, err, match", [
    (dict(rows_k=jnp.zeros((2, 2, 6, 21, 32))), ValueError, "rows_k"),  # a batch of 3 expected
    (dict(rows_ids=jnp.zeros((2, 3, 6, 21), jnp.float32)), TypeError, "rows_ids"),
    (dict(rows_v=jnp.zeros((2, 3, 6, 21, 32), jnp.bfloat16)), TypeError, "rows_v.dtype"),
    (dict(rows_k=jnp.zeros((3, 6, 21, 32)), rows_v=jnp.zeros((3, 6, 21, 32))), ValueError, "stacked as k is"),
    (dict(rows_k=jnp.zeros((2, 3, 6, 0, 32)), rows_v=jnp.zeros((2, 3, 6, 0, 32)),
          rows_ids=jnp.zeros((2, 3, 6, 0), jnp.int32)), ValueError, "no row slots"),
    (dict(starts2=None), ValueError, "starts2 and lengths2 go together"),
])
def test_bad_input_raises_naming_value(change, err, match):
  case = _case(4) | change
  with pytest.raises(err, match=match):
    partial_attention_with_rows(**case, layer=0, interpret=True)


@pytest.mark.gpu
def test_compiled_kernel_matches_reference_on_gpu():
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU")
  for seed, shape in enumerate([dict(dtype=jnp.bfloat16), dict(rows=396, seq=768, q_heads=9, kv_heads=3, head_dim=64,
                                                                dtype=jnp.bfloat16, layers=4)]):
    case = _case(seed, **shape)
    o, lse = jax.jit(lambda layer: partial_attention_with_rows(**case, layer=layer))(jnp.int32(1))
    _check(o, lse, *partial_attention_with_rows_reference(**case, layer=1), TOL[jnp.bfloat16])
