"""Exact top-k of queries over keys by inner product, chunked over both.

The ground truth for the attention-aware index build (each prefill query's
exact top-N_q keys) and for recall studies. Queries are processed in blocks
(`lax.map`); for each block the keys are scanned in chunks and a running top-k
is merged chunk by chunk, so memory is O(Hq * block_q * (block_n + k)) and a
128K x 128K head fits on the device.

Within a chunk the top-k is taken in two stages (`_tiled_top_k`): the chunk's scores are
cut into tiles, the k tiles with the largest maxima are kept, and the top-k of their
scores is exact. A GPU top-k with k in the tens sorts its rows, and a 128K roar build's
key neighbours (ops.nearest_keys, 131,072 rows of 131,072 scores a head) spent 144 of
its 186 s of preparation there on the H200 with whole chunks sorted
(experiments/results/bench_build_smollm2shapes_128k_h200.md, 33.6 s with chunks of 16K
keys). The two stages sort chunk / tile + k * tile values a row instead of chunk, ~2 N sqrt(k /
chunk) over a row of N keys, so the whole row is one chunk by default: a layer's neighbours at
128K took 0.72 / 0.52 / 0.46 s with chunks of 16K / 64K / 128K keys on the H200, and its
training top-100 0.073 / 0.053 / 0.045 s (experiments/results/bench_topk_smollm2shapes_128k_h200.md,
blocks of 1,024 queries). Query blocks shrink instead, so a block's scores stay within
_SCORE_BLOCK floats.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from ops import _checks

_NEG_INF = float("-inf")
_SCORE_BLOCK = 1 << 28  # float32 scores of one (query block, key chunk): 1 GiB


def _tile_width(n: int, k: int) -> int:
  """The power of two near sqrt(n / k): it minimises the values sorted, n / tile + k * tile."""
  return 1 << max(0, round(0.5 * math.log2(max(n / k, 1.0))))


def _tiled_top_k(s, k: int):  # s [..., n] float32
  """lax.top_k(s, k) (scores, int32 positions), equal to it with ties too, sorting
  n / tile + k * tile values a row rather than n.

  Why exact: an element of the top k (value descending, position ascending) lies in a tile
  among the k best by (tile maximum descending, tile position ascending); otherwise k such
  tiles each hold an element ahead of it. The kept tiles are gathered in position order, so
  the second top_k's ties still go to the lower position. A row whose length is not a whole
  number of tiles is padded with -inf after its end: a pad ties at best with a real -inf,
  which comes first, so with n >= k no pad is returned."""
  n = s.shape[-1]
  tile = _tile_width(n, k)
  tiles_n = -(-n // tile)
  if tile == 1 or tiles_n <= k or n < k:
    return lax.top_k(s, k)
  if tiles_n * tile != n:  # prompts of any length: without this, whole rows were sorted
    s = jnp.pad(s, [(0, 0)] * (s.ndim - 1) + [(0, tiles_n * tile - n)], constant_values=_NEG_INF)
  tiles = s.reshape(*s.shape[:-1], tiles_n, tile)
  _, best = lax.top_k(jnp.max(tiles, axis=-1), k)
  best = jnp.sort(best, axis=-1)  # [..., k] tile indices in position order
  candidates = jnp.take_along_axis(tiles, best[..., None], axis=-2)  # [..., k, tile]
  scores, pos = lax.top_k(candidates.reshape(*s.shape[:-1], k * tile), k)
  return scores, jnp.take_along_axis(best, pos // tile, axis=-1) * tile + pos % tile


@functools.partial(jax.jit, static_argnames=("k", "block_q", "block_n"))
def _exact_topk(
    queries,  # [Hq, M, D]
    keys,  # [Hkv, N, D]
    key_lengths,  # [Hkv] int32
    *,
    k: int,
    block_q: int,
    block_n: int,
):
  q_heads, num_q, head_dim = queries.shape
  kv_heads, num_keys, _ = keys.shape
  groups = q_heads // kv_heads
  bq, bn = min(block_q, num_q), min(block_n, num_keys)
  kk = min(k, bn)  # per-chunk candidates
  nq = -(-num_q // bq)
  if nq * bq != num_q:
    queries = jnp.pad(queries, ((0, 0), (0, nq * bq - num_q), (0, 0)))
  precision = lax.Precision.HIGHEST
  # [Hq, nq*bq, D] -> [nq, Hkv, G, bq, D]
  qb = queries.reshape(kv_heads, groups, nq, bq, head_dim).transpose(2, 0, 1, 3, 4)
  n_chunks = -(-num_keys // bn)
  lengths = key_lengths[:, None, None, None]  # [Hkv, 1, 1, 1]

  def q_block(qblk):  # [Hkv, G, bq, D]
    def body(j, carry):
      best_s, best_i = carry  # [Hkv, G, bq, k]
      nominal = j * bn
      start = jnp.minimum(nominal, num_keys - bn)  # last chunk shifted back; overlap masked
      kblk = lax.dynamic_slice_in_dim(keys, start, bn, axis=1)  # [Hkv, bn, D]
      # KGQD,KND->KGQN
      s = jnp.einsum("kgqd,knd->kgqn", qblk, kblk, preferred_element_type=jnp.float32,
                     precision=precision)
      ids = start + jnp.arange(bn, dtype=jnp.int32)
      s = jnp.where((ids >= nominal) & (ids < lengths), s, _NEG_INF)
      cs, ci = _tiled_top_k(s, kk)
      ci = start + ci.astype(jnp.int32)
      # Running best first: on ties top_k keeps the lower index, like lax.top_k.
      ms, mi = lax.top_k(jnp.concatenate([best_s, cs], axis=-1), k)
      mids = jnp.take_along_axis(jnp.concatenate([best_i, ci], axis=-1), mi, axis=-1)
      return ms, mids

    shape = qblk.shape[:-1] + (k,)
    init = (jnp.full(shape, _NEG_INF, jnp.float32), jnp.full(shape, -1, jnp.int32))
    best_s, best_i = lax.fori_loop(0, n_chunks, body, init)
    return best_s, jnp.where(jnp.isneginf(best_s), -1, best_i)

  scores, ids = lax.map(q_block, qb)  # [nq, Hkv, G, bq, k]
  scores = scores.transpose(1, 2, 0, 3, 4).reshape(q_heads, nq * bq, k)[:, :num_q]
  ids = ids.transpose(1, 2, 0, 3, 4).reshape(q_heads, nq * bq, k)[:, :num_q]
  return scores, ids


def _prepare(queries, keys, k, key_lengths):
  for name, x in (("queries", queries), ("keys", keys)):
    _checks.check_float(name, x)
  _checks.check_ndim("queries", queries, (3,), "[q_heads, num_queries, head_dim]")
  _checks.check_ndim("keys", keys, (3,), "[kv_heads, num_keys, head_dim]")
  if queries.shape[-1] != keys.shape[-1]:
    raise ValueError(
        f"queries head_dim {queries.shape[-1]} must equal keys head_dim {keys.shape[-1]}")
  _checks.check_groups(queries.shape[0], keys.shape[0])
  if not isinstance(k, int) or isinstance(k, bool) or k < 0:
    raise ValueError(f"{k=} must be a python int >= 0")
  kv_heads, num_keys, _ = keys.shape
  if key_lengths is None:
    key_lengths = jnp.full((kv_heads,), num_keys, jnp.int32)
  else:
    key_lengths = _checks.index_array(key_lengths)
    _checks.check_int("key_lengths", key_lengths)
    if key_lengths.ndim:
      _checks.check_shape("key_lengths", key_lengths, (kv_heads,), "[kv_heads] or scalar")
    _checks.check_range("key_lengths", key_lengths, 0, num_keys)
  return jnp.broadcast_to(jnp.asarray(key_lengths, jnp.int32), (kv_heads,))


def _blocks(q_heads: int, num_keys: int, block_q, block_n) -> tuple[int, int]:
  """Checked (block_q, block_n), defaults filled: every key a chunk, and query blocks of up to
  1024 that keep a block's scores within _SCORE_BLOCK floats."""
  for name, val in (("block_q", block_q), ("block_n", block_n)):
    if val is not None and val < 1:
      raise ValueError(f"{name}={val} must be >= 1")
  block_n = block_n or max(1, num_keys)
  return block_q or max(1, min(1024, _SCORE_BLOCK // (q_heads * block_n))), block_n


def _pad_k(scores, ids, k):
  """Pads a [..., n] result to [..., k] with score -inf and id -1."""
  extra = k - scores.shape[-1]
  if extra <= 0:
    return scores, ids
  pad = [(0, 0)] * (scores.ndim - 1) + [(0, extra)]
  return (jnp.pad(scores, pad, constant_values=_NEG_INF),
          jnp.pad(ids, pad, constant_values=-1))


def exact_topk(
    queries: jax.Array,  # [Hq, M, D]
    keys: jax.Array,  # [Hkv, N, D]
    k: int,
    *,
    key_lengths: jax.Array | int | None = None,  # [Hkv] int32 or scalar
    block_q: int | None = None,
    block_n: int | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Exact top-k keys by inner product for every query (GQA-aware).

  Args:
    queries: [q_heads, num_queries, head_dim]; query head h searches KV head
      h // (q_heads // kv_heads).
    keys: [kv_heads, num_keys, head_dim].
    k: number of results (python int >= 0).
    key_lengths: [kv_heads] (or scalar) int32: only keys [0, key_lengths) count.
    block_q: queries per block (default: up to 1024, so that q_heads * block_q * block_n
      scores stay within 2^28).
    block_n: keys per chunk (default: all of them).

  Returns:
    scores: [q_heads, num_queries, k] float32 inner products q·key, descending.
    ids: [q_heads, num_queries, k] int32 key indices; -1 (score -inf) where
      fewer than k keys exist.
  """
  key_lengths = _prepare(queries, keys, k, key_lengths)
  q_heads, num_q, _ = queries.shape
  num_keys = keys.shape[1]
  block_q, block_n = _blocks(q_heads, num_keys, block_q, block_n)
  if k == 0 or num_q == 0 or num_keys == 0:
    shape = (q_heads, num_q, k)
    return jnp.full(shape, _NEG_INF, jnp.float32), jnp.full(shape, -1, jnp.int32)
  keff = min(k, num_keys)
  queries = queries.astype(jnp.promote_types(queries.dtype, keys.dtype))
  keys = keys.astype(queries.dtype)
  scores, ids = _exact_topk(queries, keys, key_lengths, k=keff, block_q=block_q, block_n=block_n)
  return _pad_k(scores, ids, k)


def exact_topk_reference(
    queries: jax.Array,  # [Hq, M, D]
    keys: jax.Array,  # [Hkv, N, D]
    k: int,
    *,
    key_lengths: jax.Array | int | None = None,
    **unused,
) -> tuple[jax.Array, jax.Array]:
  """`jax.lax.top_k` of the full float32 (HIGHEST) product; same contract."""
  del unused
  key_lengths = _prepare(queries, keys, k, key_lengths)
  q_heads, num_q, head_dim = queries.shape
  kv_heads, num_keys, _ = keys.shape
  groups = q_heads // kv_heads
  qg = queries.astype(jnp.float32).reshape(kv_heads, groups, num_q, head_dim)
  s = jnp.einsum("kgqd,knd->kgqn", qg, keys.astype(jnp.float32),
                 precision=lax.Precision.HIGHEST).reshape(q_heads, num_q, num_keys)
  valid = jnp.arange(num_keys)[None, :] < jnp.repeat(key_lengths, groups)[:, None]  # [Hq, N]
  s = jnp.where(valid[:, None, :], s, _NEG_INF)
  scores, ids = lax.top_k(s, min(k, num_keys))
  ids = jnp.where(jnp.isneginf(scores), -1, ids.astype(jnp.int32))
  return _pad_k(scores, ids, k)


def nearest_keys(
    keys: jax.Array,  # [H, N, D]
    count: int,
    *,
    key_lengths: jax.Array | int | None = None,  # [H] int32 or scalar
    block_q: int | None = None,
    block_n: int | None = None,
) -> jax.Array:
  """[H, N, count] int32: each key's `count` nearest other keys of its head by L2 distance,
  nearest first; -1 where the head has fewer than count + 1 keys.

  The connectivity candidates of a roar build (host_index.build_index's
  connect_candidates), which then skips searching its graph for every key. Ranking by
  ||a - b||^2 is ranking by a·b - ||b||^2 / 2, an inner product of [a, -1/2] with
  [b, ||b||^2]: exact_topk over those augmented vectors, in float32. With `key_lengths` only
  keys [0, key_lengths) of a head count, and its rows past them are -1: keys padded to a few
  bucket sizes share one compiled program (prompts of any length).
  """
  _checks.check_float("keys", keys)
  _checks.check_ndim("keys", keys, (3,), "[heads, num_keys, head_dim]")
  if not isinstance(count, int) or isinstance(count, bool) or count < 1:
    raise ValueError(f"{count=} must be a python int >= 1")
  key_lengths = _prepare(keys, keys, count, key_lengths)
  heads, num_keys, _ = keys.shape
  block_q, block_n = _blocks(heads, num_keys, block_q, block_n)
  if num_keys == 0:
    return jnp.full((heads, 0, count), -1, jnp.int32)
  return _nearest_keys(keys, key_lengths, count=count, block_q=block_q, block_n=block_n)


@functools.partial(jax.jit, static_argnames=("count", "block_q", "block_n"))
def _nearest_keys(keys, key_lengths, *, count: int, block_q: int, block_n: int):  # [H, N, D], [H] -> [H, N, count]
  k32 = keys.astype(jnp.float32)
  sq = jnp.sum(k32 * k32, axis=-1, keepdims=True)
  queries = jnp.concatenate([k32, jnp.full_like(sq, -0.5)], axis=-1)
  augmented = jnp.concatenate([k32, sq], axis=-1)
  num_keys = keys.shape[1]
  _, ids = _exact_topk(queries, augmented, key_lengths, k=min(count + 1, num_keys), block_q=block_q, block_n=block_n)
  if ids.shape[-1] <= count:  # fewer keys than count + 1
    ids = jnp.pad(ids, ((0, 0), (0, 0), (0, count + 1 - ids.shape[-1])), constant_values=-1)
  # Drop each key itself: first by construction, unless exact duplicates tie ahead of it.
  own = jnp.arange(num_keys, dtype=jnp.int32)[None, :, None]
  order = jnp.argsort(ids == own, axis=-1, stable=True)  # the others first, still nearest first
  ids = jnp.take_along_axis(ids, order, axis=-1)[..., :count]
  return jnp.where(own < key_lengths[:, None, None], ids, -1)
