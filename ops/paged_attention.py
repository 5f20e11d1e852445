"""Partial attention over a paged buffer with a page list per (sequence, KV head).

Each KV head may hold different pages (FreeKV recalls pages per KV head), so the
page table is [B, Hkv, max_pages]. Every token of a listed page is valid.
Same structure as `ops.partial_attention`: kernel on refs, a wrapper that builds
the grid and merges the splits' residuals, a validated public function and a
float32 `*_reference`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from ops import _checks
from ops.split_combine import combine_splits
from ops.partial_attention import _MIN_TILE, _NEG_INF, _TARGET_PROGRAMS, _pad_groups, _select_layer


def default_paged_splits(batch: int, kv_heads: int, max_pages: int) -> int:
  """Splits of the page list per (sequence, KV head); at least 4 pages each."""
  splits = pl.cdiv(_TARGET_PROGRAMS, batch * kv_heads)
  return max(1, min(splits, pl.cdiv(max_pages, 4)))


def _kernel(
    layer_ref,  # [1] int32
    counts_ref,  # [] int32: valid entries of this (sequence, KV head)'s page list
    ids_ref,  # [max_pages] int32: slot of each listed page
    q_ref,  # [Gp, D]
    k_ref,  # [L, B, Hkv, N_slots, P, D]: the whole paged buffer, indexed in place
    v_ref,  # [L, B, Hkv, N_slots, P, D]
    o_ref,  # [Gp, D] float32
    lse_ref,  # [Gp] float32
    *,
    scale: float,
    pages_per_split: int,
):
  b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  layer = layer_ref[0]
  count = counts_ref[()]
  first = split * pages_per_split
  last = jnp.maximum(jnp.minimum(count, first + pages_per_split), first)
  gp, head_dim = q_ref.shape
  q = q_ref[...].astype(k_ref.dtype)  # [Gp, D]
  # Triton treats DEFAULT precision as TF32: ask for IEEE f32 when storage is f32.
  precision = lax.Precision.HIGHEST if k_ref.dtype == jnp.float32 else None

  def body(i, carry):
    acc, m_prev, l_prev = carry  # [Gp, D], [Gp], [Gp]
    slot = ids_ref[i]
    k = k_ref[layer, b, h, slot, :, :]  # [P, D]
    v = v_ref[layer, b, h, slot, :, :]  # [P, D]
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                        preferred_element_type=jnp.float32) * scale  # [Gp, P]
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
    alpha = jnp.exp(m_prev - m_next)
    p = jnp.exp(s - m_next[:, None])
    l_next = alpha * l_prev + jnp.sum(p, axis=1)
    pv = jnp.dot(p.astype(v.dtype), v, precision=precision,
                 preferred_element_type=jnp.float32)
    return alpha[:, None] * acc + pv, m_next, l_next

  acc = jnp.zeros((gp, head_dim), jnp.float32)
  m = jnp.full((gp,), _NEG_INF, jnp.float32)
  l = jnp.zeros((gp,), jnp.float32)
  acc, m, l = lax.fori_loop(first, last, body, (acc, m, l))
  nonempty = l > 0
  o_ref[...] = jnp.where(nonempty[:, None], acc / jnp.where(nonempty, l, 1.0)[:, None], 0.0)
  lse_ref[...] = jnp.where(nonempty, m + jnp.log(jnp.where(nonempty, l, 1.0)), _NEG_INF)


@functools.partial(
    jax.jit, static_argnames=("scale", "num_splits", "interpret", "num_warps", "num_stages"))
def _paged_pallas(
    q,  # [B, Hq, D]
    k_pages,  # [L, B, Hkv, N_slots, P, D]
    v_pages,  # [L, B, Hkv, N_slots, P, D]
    page_ids,  # [B, Hkv, max_pages] int32
    page_counts,  # [B, Hkv] int32
    layer,  # [1] int32
    *,
    scale: float,
    num_splits: int | None,
    interpret: bool,
    num_warps: int | None,
    num_stages: int | None,
):
  batch, q_heads, head_dim = q.shape
  _, _, kv_heads, _, page_size, _ = k_pages.shape
  max_pages = page_ids.shape[-1]
  groups = q_heads // kv_heads
  gp = _pad_groups(groups)
  if num_splits is None:
    num_splits = default_paged_splits(batch, kv_heads, max_pages)
  num_splits = max(1, min(num_splits, max_pages))
  pages_per_split = pl.cdiv(max_pages, num_splits)
  num_splits = pl.cdiv(max_pages, pages_per_split)
  qg = q.reshape(batch, kv_heads, groups, head_dim)
  if gp != groups:
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, gp - groups), (0, 0)))
  kernel = functools.partial(_kernel, scale=scale, pages_per_split=pages_per_split)
  compiler_params = None
  if not interpret and jax.default_backend() == "gpu":
    from jax.experimental.pallas import triton as plgpu  # pylint: disable=g-import-not-at-top
    compiler_params = plgpu.CompilerParams(
        num_warps=num_warps or 4, num_stages=num_stages or 3)
  # A power of two for the combine kernel; programs past the last real split find no pages.
  num_splits = pl.next_power_of_2(num_splits)
  o, lse = pl.pallas_call(
      kernel,
      grid=(batch, kv_heads, num_splits),
      in_specs=[
          pl.BlockSpec((1,), lambda b, h, s: (0,)),
          pl.BlockSpec((None, None), lambda b, h, s: (b, h)),
          pl.BlockSpec((None, None, max_pages), lambda b, h, s: (b, h, 0)),
          pl.BlockSpec((None, None, gp, head_dim), lambda b, h, s: (b, h, 0, 0)),
          pl.no_block_spec,
          pl.no_block_spec,
      ],
      out_specs=[
          pl.BlockSpec((None, None, None, gp, head_dim), lambda b, h, s: (b, h, s, 0, 0)),
          pl.BlockSpec((None, None, None, gp), lambda b, h, s: (b, h, s, 0)),
      ],
      out_shape=[
          jax.ShapeDtypeStruct((batch, kv_heads, num_splits, gp, head_dim), jnp.float32),
          jax.ShapeDtypeStruct((batch, kv_heads, num_splits, gp), jnp.float32),
      ],
      compiler_params=compiler_params,
      interpret=interpret,
      name=f"kvjax_paged_attention_p{page_size}_ns{num_splits}",
  )(layer, page_counts, page_ids, qg, k_pages, v_pages)
  return combine_splits(o, lse, groups=groups, interpret=interpret)  # [B, Hq, D], [B, Hq]


@functools.partial(jax.jit, static_argnames=("scale", "highest"))
def _paged_xla(
    q,  # [B, Hq, D]
    k_pages,  # [B, Hkv, N_slots, P, D] or [L, ...] with layer
    v_pages,
    page_ids,  # [B, Hkv, max_pages] int32
    page_counts,  # [B, Hkv] int32
    layer,  # [] int32 or None
    *,
    scale: float,
    highest: bool,
):
  k_pages, v_pages = _select_layer(k_pages, layer), _select_layer(v_pages, layer)
  batch, q_heads, head_dim = q.shape
  _, kv_heads, num_slots, page_size, _ = k_pages.shape
  max_pages = page_ids.shape[-1]
  groups = q_heads // kv_heads
  valid = jnp.arange(max_pages)[None, None, :] < page_counts[..., None]  # [B, Hkv, M]
  ids = jnp.where(valid, page_ids, 0)
  # Gather the listed pages: [B, Hkv, M, P, D] -> [B, Hkv, M*P, D].
  take = jax.vmap(jax.vmap(lambda pages, i: pages[i]))
  k = take(k_pages, ids).reshape(batch, kv_heads, max_pages * page_size, head_dim)
  v = take(v_pages, ids).reshape(batch, kv_heads, max_pages * page_size, head_dim)
  tok_valid = jnp.repeat(valid, page_size, axis=-1)  # [B, Hkv, M*P]
  if highest:
    qg = q.astype(jnp.float32).reshape(batch, kv_heads, groups, head_dim)
    k, v = k.astype(jnp.float32), v.astype(jnp.float32)
    precision, dot_dtype = lax.Precision.HIGHEST, jnp.float32
  else:
    qg = q.reshape(batch, kv_heads, groups, head_dim).astype(k.dtype)
    precision = lax.Precision.HIGHEST if k.dtype == jnp.float32 else None
    dot_dtype = v.dtype
  s = jnp.einsum("bkgd,bksd->bkgs", qg, k, preferred_element_type=jnp.float32,
                 precision=precision) * scale
  s = jnp.where(tok_valid[:, :, None, :], s, _NEG_INF)
  lse = jax.nn.logsumexp(s, axis=-1)  # [B, Hkv, G]
  lse_safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
  p = jnp.where(tok_valid[:, :, None, :], jnp.exp(s - lse_safe[..., None]), 0.0)
  v = jnp.where(tok_valid[..., None], v, jnp.zeros_like(v))
  o = jnp.einsum("bkgs,bksd->bkgd", p.astype(dot_dtype), v,
                 preferred_element_type=jnp.float32, precision=precision)
  return o.reshape(batch, q_heads, head_dim), lse.reshape(batch, q_heads)


def _prepare(q, k_pages, v_pages, page_ids, page_counts, layer, implementation, scale):
  _checks.check_implementation(implementation)
  for name, x in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages)):
    _checks.check_float(name, x)
  _checks.check_ndim("q", q, (3,), "[batch, q_heads, head_dim]")
  _checks.check_ndim("k_pages", k_pages, (5, 6),
                     "[batch, kv_heads, slots, page_size, head_dim] (or with a leading layers axis)")
  if v_pages.shape != k_pages.shape:
    raise ValueError(f"v_pages.shape={tuple(v_pages.shape)} must equal k_pages.shape={tuple(k_pages.shape)}")
  if v_pages.dtype != k_pages.dtype:
    raise TypeError(f"v_pages.dtype={v_pages.dtype} must equal k_pages.dtype={k_pages.dtype}")
  num_layers = k_pages.shape[0] if k_pages.ndim == 6 else None
  batch, kv_heads, num_slots, page_size, head_dim = k_pages.shape[-5:]
  if q.shape[0] != batch:
    raise ValueError(f"q batch {q.shape[0]} must equal k_pages batch {batch}")
  if q.shape[-1] != head_dim:
    raise ValueError(f"q head_dim {q.shape[-1]} must equal k_pages head_dim {head_dim}")
  _checks.check_groups(q.shape[1], kv_heads)
  if implementation == "pallas":
    hint = " for implementation='pallas' (use 'xla')"
    _checks.check_pow2("head_dim", head_dim, _MIN_TILE, hint)
    _checks.check_pow2("page_size", page_size, _MIN_TILE, hint)
  _checks.check_layer(layer, num_layers)
  page_ids, page_counts = _checks.index_array(page_ids), _checks.index_array(page_counts)
  _checks.check_int("page_ids", page_ids)
  _checks.check_int("page_counts", page_counts)
  _checks.check_ndim("page_ids", page_ids, (3,), "[batch, kv_heads, max_pages]")
  _checks.check_shape("page_ids", page_ids, (batch, kv_heads, page_ids.shape[-1]),
                      "[batch, kv_heads, max_pages]")
  _checks.check_shape("page_counts", page_counts, (batch, kv_heads), "[batch, kv_heads]")
  max_pages = page_ids.shape[-1]
  if max_pages == 0:
    raise ValueError(f"page_ids.shape={tuple(page_ids.shape)} lists no pages (max_pages = 0)")
  _checks.check_range("page_counts", page_counts, 0, max_pages)
  ids, counts = _checks.concrete_value(page_ids), _checks.concrete_value(page_counts)
  if ids is not None and counts is not None and ids.size:
    listed = np.arange(max_pages)[None, None, :] < counts[..., None]
    bad = listed & ((ids < 0) | (ids >= num_slots))
    if bad.any():
      idx = tuple(int(i) for i in np.argwhere(bad)[0])
      raise ValueError(f"page_ids{list(idx)}={ids[idx]} is outside [0, {num_slots - 1}] (slots)")
  scale = float(head_dim ** -0.5 if scale is None else scale)
  return jnp.asarray(page_ids, jnp.int32), jnp.asarray(page_counts, jnp.int32), scale


def paged_partial_attention(
    q: jax.Array,  # [B, Hq, D]
    k_pages: jax.Array,  # [B, Hkv, N_slots, P, D] or [L, B, Hkv, N_slots, P, D]
    v_pages: jax.Array,  # same as k_pages
    page_ids: jax.Array,  # [B, Hkv, max_pages] int32
    page_counts: jax.Array,  # [B, Hkv] int32
    *,
    layer: jax.Array | int | None = None,  # [] int32
    scale: float | None = None,
    implementation: str = "pallas",
    interpret: bool = False,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Attention over the pages listed per (sequence, KV head), as (o, lse).

  Args:
    q: [batch, q_heads, head_dim] queries.
    k_pages: [batch, kv_heads, slots, page_size, head_dim] paged keys, or with a
      leading layers axis and `layer`.
    v_pages: paged values, same shape and dtype as k_pages.
    page_ids: [batch, kv_heads, max_pages] int32 slot indices; the first
      page_counts[b, h] entries are attended (entries past the count are ignored).
    page_counts: [batch, kv_heads] int32 in [0, max_pages].
    layer: int32 scalar (may be traced) for a layer-stacked buffer (indexed in
      place by the kernel).
    scale: score scale; default head_dim ** -0.5.
    implementation: "pallas" or "xla" (gather + dense).
    interpret: Pallas interpret mode (CPU tests).
    num_splits: splits of the page list per (sequence, KV head).
    num_warps: Triton warps per program (GPU only).
    num_stages: Triton pipelining stages (GPU only).

  Returns:
    o [batch, q_heads, head_dim] float32 and lse [batch, q_heads] float32;
    o = 0, lse = -inf where no page is listed.
  """
  page_ids, page_counts, scale = _prepare(
      q, k_pages, v_pages, page_ids, page_counts, layer, implementation, scale)
  if num_splits is not None and num_splits < 1:
    raise ValueError(f"{num_splits=} must be >= 1")
  if implementation == "xla":
    layer_arr = None if layer is None else jnp.asarray(layer, jnp.int32)
    return _paged_xla(q, k_pages, v_pages, page_ids, page_counts, layer_arr,
                      scale=scale, highest=False)
  if k_pages.ndim == 5:
    k_pages, v_pages, layer = k_pages[None], v_pages[None], 0
  layer_arr = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
  return _paged_pallas(q, k_pages, v_pages, page_ids, page_counts, layer_arr,
                       scale=scale, num_splits=num_splits, interpret=interpret,
                       num_warps=num_warps, num_stages=num_stages)


def paged_partial_attention_reference(
    q: jax.Array,  # [B, Hq, D]
    k_pages: jax.Array,  # [B, Hkv, N_slots, P, D] or [L, B, Hkv, N_slots, P, D]
    v_pages: jax.Array,  # same as k_pages
    page_ids: jax.Array,  # [B, Hkv, max_pages] int32
    page_counts: jax.Array,  # [B, Hkv] int32
    *,
    layer: jax.Array | int | None = None,
    scale: float | None = None,
    **unused,
) -> tuple[jax.Array, jax.Array]:
  """Gather + dense float32 (HIGHEST) twin of `paged_partial_attention`."""
  del unused
  page_ids, page_counts, scale = _prepare(
      q, k_pages, v_pages, page_ids, page_counts, layer, "xla", scale)
  layer_arr = None if layer is None else jnp.asarray(layer, jnp.int32)
  return _paged_xla(q, k_pages, v_pages, page_ids, page_counts, layer_arr,
                    scale=scale, highest=True)
