"""Each key's nearest keys among the keys of nearby blocks: kNN candidates that scale.

`ops.nearest_keys` is exact and costs a top-k over every key for every key (N^2): 3.6 s a head
at 512K keys on the H200, so ~15 s at 1M (arithmetic), for each of SmolLM2's 90 KV heads. A
roar build only needs good link candidates (it prunes them), so past that length the keys are
first partitioned into blocks of nearby keys and each key ranks only the keys of the `probes`
blocks nearest to its own (1M keys, blocks of 1,024, 16 probed: 15.0 s for 6 heads on the H200,
compile included; experiments/results/bench_build_smollm2shapes_1m_blocks.md):

1. Balanced bisection: at each level every node's keys are sorted by their projection on the
   node's principal direction (a few power iterations) and cut in halves, until the leaves hold
   <= `block` keys. Static shapes throughout: the keys are padded to 2^levels equal leaves.
2. Each block's mean; each block probes the `probes` blocks with the nearest means (itself
   first).
3. Each key's `count` nearest keys by L2 among its probed blocks' keys (the augmented inner
   product of ops.nearest_keys, float32), mapped back to original positions.

With probes covering every block it is ops.nearest_keys (up to the order of exact ties).
Recall of the true neighbours and of the graphs built from them: experiments/bench_neighbours.py.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from ops import _checks
from ops.topk import _tiled_top_k
from ops.topk import nearest_keys

_SCORE_BLOCK = 1 << 27  # float32 scores of one group of query blocks: 512 MiB
_POWER_ITERATIONS = 4


def _principal_direction(x, valid, key):  # x [nodes, size, D], valid [nodes, size] -> [nodes, D]
  """Each node's top principal direction of its valid rows, by power iteration."""
  w = valid[..., None].astype(x.dtype)
  mean = jnp.sum(x * w, axis=1, keepdims=True) / jnp.maximum(jnp.sum(w, axis=1, keepdims=True), 1.0)
  xc = (x - mean) * w
  v = jax.random.normal(key, (x.shape[0], x.shape[2]), x.dtype)
  for _ in range(_POWER_ITERATIONS):
    v = jnp.einsum("nsd,ns->nd", xc, jnp.einsum("nsd,nd->ns", xc, v))
    v = v / jnp.maximum(jnp.linalg.norm(v, axis=-1, keepdims=True), 1e-30)
  return v


def _bisect(keys, valid, levels: int, key):  # keys [T, D], valid [T] -> perm [T] int32
  """Positions ordered so that each run of T / 2^levels is one leaf of the bisection."""
  total = keys.shape[0]
  perm = jnp.arange(total, dtype=jnp.int32)
  for level in range(levels):
    nodes, size = 1 << level, total >> level
    p = perm.reshape(nodes, size)
    x, ok = keys[p], valid[p]
    v = _principal_direction(x, ok, jax.random.fold_in(key, level))
    proj = jnp.where(ok, jnp.einsum("nsd,nd->ns", x, v), jnp.inf)  # padding sorts last
    perm = jnp.take_along_axis(p, jnp.argsort(proj, axis=-1), axis=-1).reshape(total)
  return perm


@functools.partial(jax.jit, static_argnames=("count", "block", "probes", "levels"))
def _block_neighbours(keys, *, count: int, block: int, probes: int, levels: int):
  # keys [H, N, D] float32 -> [H, N, count] int32
  _, n, d = keys.shape
  leaves = 1 << levels
  total = leaves * block
  padded = jnp.pad(keys, ((0, 0), (0, total - n), (0, 0)))
  valid = jnp.arange(total) < n  # [T]

  def head(x):  # [T, D] -> [T, count]
    perm = _bisect(x, valid, levels, jax.random.key(0))
    xs, ok, ids = x[perm].reshape(leaves, block, d), valid[perm].reshape(leaves, block), perm.reshape(leaves, block)
    w = ok[..., None].astype(x.dtype)
    means = jnp.sum(xs * w, axis=1) / jnp.maximum(jnp.sum(w, axis=1), 1.0)  # [leaves, D]
    probed = jnp.arange(leaves, dtype=jnp.int32)[:, None]  # [leaves, probes]: each block first
    if probes > 1:
      probed = jnp.concatenate([probed, nearest_keys(means[None], probes - 1)[0]], axis=-1)
    # ||a - b||^2 ranks as -(a.b - ||b||^2 / 2): [a, -1/2] . [b, ||b||^2], as in ops.nearest_keys
    sq = jnp.sum(xs * xs, axis=-1, keepdims=True)
    as_query = jnp.concatenate([xs, jnp.full_like(sq, -0.5)], axis=-1)  # [leaves, block, D + 1]
    as_key = jnp.concatenate([xs, sq], axis=-1)

    def group(blocks):  # [g] leaf ids -> [g, block, count + 1] original positions
      p = probed[blocks]  # [g, probes]
      g = blocks.shape[0]
      s = jnp.einsum("gqd,gkd->gqk", as_query[blocks], as_key[p].reshape(g, probes * block, d + 1),
                     preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST)
      s = jnp.where(ok[p].reshape(g, 1, -1), s, -jnp.inf)  # padding never ranks
      scores, pos = _tiled_top_k(s, count + 1)
      found = jnp.take_along_axis(ids[p].reshape(g, 1, -1), pos, axis=-1)
      return jnp.where(jnp.isneginf(scores), -1, found)

    per_group = max(1, _SCORE_BLOCK // (block * probes * block))
    groups = -(-leaves // per_group)
    order = jnp.minimum(jnp.arange(groups * per_group, dtype=jnp.int32), leaves - 1)
    rows = lax.map(group, order.reshape(groups, per_group))  # [groups, per_group, block, count + 1]
    rows = rows.reshape(groups * per_group, block, count + 1)[:leaves].reshape(total, count + 1)
    own = perm[:, None]
    drop = jnp.argsort(rows == own, axis=-1, stable=True)  # the others first, still nearest first
    rows = jnp.take_along_axis(rows, drop, axis=-1)[:, :count]
    return jnp.zeros_like(rows).at[perm].set(rows)[:n]

  return lax.map(head, padded)


def block_nearest_keys(
    keys: jax.Array,  # [H, N, D]
    count: int,
    *,
    block: int = 1024,
    probes: int = 16,
) -> jax.Array:
  """[H, N, count] int32: each key's `count` nearest keys of its head by L2 among the keys of
  the `probes` blocks (of <= `block` nearby keys) nearest its own, nearest first; -1 where fewer
  than count were found. Exact (ops.nearest_keys) when the probes cover every key."""
  _checks.check_float("keys", keys)
  _checks.check_ndim("keys", keys, (3,), "[heads, num_keys, head_dim]")
  for name, value in (("count", count), ("block", block), ("probes", probes)):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ValueError(f"{name}={value!r} must be a python int >= 1")
  n = keys.shape[1]
  levels = max(0, math.ceil(math.log2(max(n / block, 1.0))))
  leaf = -(-n // (1 << levels)) if n else 0
  probes = min(probes, 1 << levels)
  if levels == 0 or leaf * probes <= count:  # one block, or too few keys probed: rank them all
    return nearest_keys(keys, count)
  return _block_neighbours(keys.astype(jnp.float32), count=count, block=leaf, probes=probes, levels=levels)

