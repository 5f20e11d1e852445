"""freekv's page selection, pure jnp: group-pooled page scores, the top pages, the recall plan
(which missing pages to fetch into which pool slots), and the tests that decide a speculative
head's correction. kvjax.policies.freekv's module docstring describes the method; the page
summaries these score are kvjax.policies.page_summary's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvjax.policies import page_summary


def page_scores(
    q,  # [B, Hq, D] unscaled
    kmax,  # [B, Hkv, N, D]
    kmin,  # [B, Hkv, N, D]
    num_candidates,  # [B] int32: pages 0 .. num_candidates - 1 are candidates
    *,
    scale: float,
):
  """Group-pooled page scores [B, Hkv, N] float32 from min/max summaries; -inf for non-candidates.

  Per query head: softmax over the candidates of scale · Σ_d max(q_d·max_d, q_d·min_d); then
  the mean over the GQA group of each KV head.
  """
  return pooled_scores(q, (kmax, kmin), num_candidates, scale=scale)


def pooled_scores(
    q,  # [B, Hq, D] unscaled
    summary: tuple,  # one layer's (kmax, kmin) or (codes, lo, step): kvjax.policies.page_summary
    num_candidates,  # [B] int32: pages 0 .. num_candidates - 1 are candidates
    *,
    scale: float,
    implementation: str = "xla",  # key codes: ops.key_page_scores' "pallas" or "xla"
):
  """Group-pooled page scores [B, Hkv, N] float32 (softmax over the candidates per query head,
  mean over the group); -inf for non-candidates."""
  s = page_summary.scores(q, summary, scale=scale, implementation=implementation)  # [B, Hkv, G, N]
  return pool_scores(s, num_candidates)


def pool_scores(
    s,  # [B, Hkv, G, N] float32: per query head page scores (page_summary.scores)
    num_candidates,  # [B] int32: pages 0 .. num_candidates - 1 are candidates
):
  """pooled_scores from the per-head scores: [B, Hkv, N] float32, -inf for non-candidates."""
  N = s.shape[-1]
  cand = jnp.arange(N)[None, :] < num_candidates[:, None]  # [B, N]
  mask = cand[:, None, None, :]
  s = jnp.where(mask, s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  e = jnp.where(mask, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
  probs = e / jnp.maximum(jnp.sum(e, axis=-1, keepdims=True), 1e-30)
  return jnp.where(cand[:, None, :], jnp.mean(probs, axis=2), -jnp.inf)


def top_pages(
    pooled,  # [B, Hkv, N] float32, -inf for non-candidates
    n_sel: int,
):
  """The n_sel best candidates per (seq, KV head), best first: [B, Hkv, n_sel] int32, -1 padded."""
  N = pooled.shape[-1]
  k = min(n_sel, N)
  vals, idx = jax.lax.top_k(pooled, k)
  ids = jnp.where(vals > -jnp.inf, idx, -1).astype(jnp.int32)
  if k < n_sel:
    ids = jnp.pad(ids, ((0, 0), (0, 0), (0, n_sel - k)), constant_values=-1)
  return ids


def member(
    items,  # [B, H, a] int32, -1 = none
    pages,  # [B, H, b] int32, -1 = none
):
  """[B, H, a] bool: items[..., i] >= 0 and listed in pages."""
  hit = (items[..., :, None] == pages[..., None, :]) & (pages[..., None, :] >= 0)
  return jnp.any(hit, axis=-1) & (items >= 0)


def plan_recall(
    pool_ids,  # [B, H, n] int32: store page per slot, -1 empty
    wanted,  # [B, H, m] int32: pages that must be resident, best first, -1 padded (m <= n)
    pooled,  # [B, H, N] float32: current scores (eviction order)
    max_recall: int,
):
  """Which missing pages to fetch and which slots they replace.

  Missing = wanted and not resident, in `wanted` order, at most max_recall. Each goes to a
  slot not holding a wanted page: empty slots first, then the resident page with the lowest
  score (pages that are no candidate any more before all).

  Returns:
    fetch_ids [B, H, max_recall] int32 (compact, -1 padded), fetch_slots [B, H, max_recall]
    int32 (n where nothing is fetched), and the pool's page ids afterwards [B, H, n].
  """
  B, H, n = pool_ids.shape
  missing = (wanted >= 0) & ~member(wanted, pool_ids)  # [B, H, m]
  rank = jnp.cumsum(missing, axis=-1) - 1
  take = missing & (rank < max_recall)
  bh = (jnp.arange(B)[:, None, None], jnp.arange(H)[None, :, None])
  fetch_ids = jnp.full((B, H, max_recall), -1, jnp.int32).at[
      bh + (jnp.where(take, rank, max_recall),)].set(wanted, mode="drop")
  score = jnp.take_along_axis(pooled, jnp.maximum(pool_ids, 0), axis=-1)  # [B, H, n]
  prio = jnp.where(pool_ids < 0, -2.0, jnp.where(jnp.isfinite(score), score, -1.0))
  prio = jnp.where(member(pool_ids, wanted), 2.0, prio)  # softmax scores lie in [0, 1]
  order = jnp.argsort(prio, axis=-1, stable=True)  # [B, H, n]: eviction order
  # There are >= (missing count) unprotected slots, since len(wanted) <= n.
  fetch_slots = jnp.where(fetch_ids >= 0, order[..., :max_recall], n).astype(jnp.int32)
  new_ids = pool_ids.at[bh + (fetch_slots,)].set(fetch_ids, mode="drop")
  return fetch_ids, fetch_slots, new_ids


def listed_slots(
    pool_ids,  # [B, H, n] int32
    selection,  # [B, H, m] int32, -1 padded
):
  """Slots holding a selected page, ascending and compact: ([B, H, n] int32, counts [B, H] int32)."""
  B, H, n = pool_ids.shape
  listed = member(pool_ids, selection)
  rank = jnp.cumsum(listed, axis=-1) - 1
  bh = (jnp.arange(B)[:, None, None], jnp.arange(H)[None, :, None])
  slots = jnp.zeros((B, H, n), jnp.int32).at[bh + (jnp.where(listed, rank, n),)].set(
      jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (B, H, n)), mode="drop")
  return slots, jnp.sum(listed, axis=-1).astype(jnp.int32)


def layer_scores(
    q,  # [L, B, Hq, D] unscaled: each layer's query
    summary: tuple,  # every layer's page summary (leading axis L)
    *,
    scale: float,
    implementation: str,
):
  """page_summary.scores for every layer: [L, B, Hkv, G, N] float32. Min/max bounds are
  vmapped; key codes go to the Pallas kernel in one call (layers folded into the batch: no
  per-layer slice of the codes), or through XLA one layer at a time (lax.map: it unpacks each
  layer's codes to f32 levels, ~0.5 GB a layer at 8B shapes and 128K)."""
  score = functools.partial(page_summary.scores, scale=scale, implementation=implementation)
  if len(summary) == 2:
    return jax.vmap(score)(q, summary)
  if implementation == "pallas":
    L, B = q.shape[:2]
    flat = lambda x: x.reshape((L * B,) + x.shape[2:])
    s = score(flat(q), tuple(flat(x) for x in summary))
    return s.reshape((L, B) + s.shape[1:])
  return jax.lax.map(lambda xs: score(*xs), (q, summary))


@functools.partial(jax.jit, static_argnames=("n_sel", "max_recall", "scale", "implementation"))
def first_selection(
    prev_q,  # [L, B, Hq, D] float32: the prompt's last query per layer
    summary: tuple,  # every layer's page summary (leading axis L)
    pool_ids,  # [L, B, Hkv, n] int32
    num_candidates,  # [B] int32: pages complete before the first decode step's eviction
    *,
    n_sel: int,
    max_recall: int,
    scale: float,
    implementation: str,
):
  """Every layer's first selection and its recall plan: (selection [L, B, Hkv, n_sel],
  fetch [L, B, Hkv, max_recall], slots [L, B, Hkv, max_recall], pool ids after it
  [L, B, Hkv, n])."""

  def one_layer(scores, ids):
    selection, plan = select_and_plan(scores, num_candidates, ids, n_sel=n_sel, max_recall=max_recall)
    return (selection,) + plan

  scores = layer_scores(prev_q, summary, scale=scale, implementation=implementation)
  return jax.vmap(one_layer)(scores, pool_ids)


def select_and_plan(
    scores,  # [B, Hkv, G, N] float32: one layer's per-head page scores (page_summary.scores)
    num_candidates,  # [B] int32
    pool_ids,  # [B, Hkv, n] int32: the pool the plan fills
    *,
    n_sel: int,
    max_recall: int,
):
  """One layer's selection [B, Hkv, n_sel] and its recall plan, plan_recall's (fetch, slots,
  pool ids after it)."""
  pooled = pool_scores(scores, num_candidates)
  selection = top_pages(pooled, n_sel)
  return selection, plan_recall(pool_ids, selection, pooled, max_recall)


@jax.jit
def occupied_slots(
    pool_ids,  # [L, B, Hkv, n] int32, -1 = empty
):
  """Every layer's occupied pool slots, compact ascending, and their counts: ([L, B, Hkv, n],
  [L, B, Hkv]) int32 (what a per_step step attends besides the ring)."""
  return jax.vmap(listed_slots)(pool_ids, pool_ids)


def needs_correction(
    q,  # [B, Hq, D]: this step's query
    prev_q,  # [B, Hq, D] float32: the previous step's
    primed,  # [] bool: the layer has decoded a step
    tau: float,
    kv_heads: int,
):
  """[B, Hkv] bool: heads whose group-mean cos(q_t, q_{t-1}) is below tau (every head of an
  unprimed layer; every head at tau 1)."""
  B, Hq, _ = q.shape
  q32 = q.astype(jnp.float32)
  cos = jnp.sum(q32 * prev_q, -1) / jnp.maximum(jnp.linalg.norm(q32, axis=-1) * jnp.linalg.norm(prev_q, axis=-1),
                                                1e-30)
  group_cos = jnp.mean(cos.reshape(B, kv_heads, Hq // kv_heads), axis=-1)
  return ~primed | (group_cos < tau) | (tau >= 1.0)


def lost_mass(
    pooled,  # [B, Hkv, N] float32: this query's group-pooled page scores (pool_scores; sum 1 over candidates)
    selection,  # [B, Hkv, n] int32: this query's pages, -1 padded
    reused,  # [B, Hkv, n] int32: the pages a speculative step would attend instead
):
  """[B, Hkv] float32: the pooled score mass of the pages this query selects that the reused
  selection lacks: what reusing it would lose, by the page summaries' estimate."""
  new = (selection >= 0) & ~member(selection, reused)
  mass = jnp.take_along_axis(pooled, jnp.maximum(selection, 0), axis=-1)
  return jnp.sum(jnp.where(new, mass, 0.0), axis=-1)
