"""Query drift and attention recovery on real decode queries (issue #6's query-similarity and
attention-recovery studies).

What a one- or two-step-old selection costs. kvjax's `retrieval(bridge="per_step")` attends at
step t the keys searched with the query of step t-1 (lag 1) or t-2 (lag 2); `speculative=True`
reuses the t-1 selection of a GQA group unless the group-mean cos(q_t, q_{t-1}) falls below
`tau` (FreeKV's correction test, `kvjax.host_runtime.group_mean_cosine`). On vectors captured
by experiments/recall.py (post-RoPE q and k of every layer, a prompt of N tokens then greedy
decode steps; the .npz cache is reused, or the model is run once), per full-attention layer:

1. Query drift: cos(q_t, q_{t-1}) and cos(q_t, q_{t-2}) per query head, and the group mean;
   percentiles, and the share of (step, group) below each tau: the correction rate.
2. Attention recovery: q_t attends, softmax with the model's attn_scale, over the host part of
   the prompt, keys [sinks, N - window) (what the retrieval policy offloads at prefill). The
   share of that softmax mass on the exact top-k of q_t, of q_{t-1} and of q_{t-2} (and, with
   --roar, on what a roar index per query head returns for q_t, q_{t-1}, q_{t-2} at the default
   ef), and the hit rate |lagged set ∩ exact top-k| / k. "host share" is the host part's share
   of the full causal attention of q_t (keys [0, N + t]), so missed mass in full-context terms
   is host share x (1 - recovered).
3. Speculation with exact search: groups below tau take the exact top-k of q_t, the others that
   of q_{t-1}; the share of lag 1's lost mass those corrections win back, beside the share that
   as many corrections given to the (group, step) that lose the most would win back.

4. Selections shared by a KV group (`group_recovery`): each head's mass on the group's top-(G k) by
   its heads' mean softmax weights, on that score's top-k, on the mean query's top-(G k) and on the
   pooled top-(G k) of q_{t-2}, beside how many distinct rows the per-head top-k sets hold: whether
   one search and one set of slots per group (G times fewer of both) keeps what per-head sets keep.

Decode step t is the capture's query at position N + t; q_{t-1} and q_{t-2} are the queries at
N + t - 1 and N + t - 2 (the prompt's last queries for t < 2). Values were not captured, so
this measures attention mass, not the error of the attention output.

Usage:
  python experiments/query_drift.py --model=smollm2 --context_len=8128
  python experiments/query_drift.py --model=gemma3-270m --context_len=32704
"""

from __future__ import annotations

import json
import pathlib
import re
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from absl import app  # noqa: E402
from absl import flags  # noqa: E402

import recall  # noqa: E402

# recall.py (imported for its capture and cache) defines flags of the same names; these replace them
# (recall's functions used here take arguments, not flags).
_O = {"allow_override": True}
_MODEL = flags.DEFINE_string("model", "smollm2", "models.registry name (vectors cached by experiments/recall.py)",
                             **_O)
_CONTEXT = flags.DEFINE_integer("context_len", 8128, "prompt tokens N", **_O)
_STEPS = flags.DEFINE_integer("decode_steps", 64, "greedy decode steps captured", **_O)
_TEXT = flags.DEFINE_enum("text", "docs", ["docs", "passkey"], "prompt text (part of the cache key)", **_O)
_LAYERS = flags.DEFINE_list("layers", [], "layers (default: every full-attention layer)", **_O)
_SINKS = flags.DEFINE_integer("sinks", 128, "first tokens kept on the device", **_O)
_WINDOW = flags.DEFINE_integer("window", 512, "last prompt tokens kept on the device", **_O)
_KS = flags.DEFINE_list("ks", ["100", "2000"], "top-k sizes")
_TAUS = flags.DEFINE_list("taus", ["0.8", "0.9"], "correction thresholds on the group-mean cosine")
_ROAR = flags.DEFINE_bool("roar", True, "also search a roar index per query head (default ef)")
_TRAIN_Q = flags.DEFINE_integer("train_queries", 4096, "roar: prompt queries per head, strided (kvjax default)",
                                **_O)
_TRAIN_K = flags.DEFINE_integer("train_topk", 100, "roar: exact top keys per training query", **_O)
_THREADS = flags.DEFINE_integer("threads", None, "OpenMP threads of the roar build and search (default: all)",
                                **_O)
_CACHE = flags.DEFINE_string("cache_dir", "/tmp/kvjax_recall", "recall.py's .npz cache", **_O)
_SEED = flags.DEFINE_integer("seed", 0, "capture seed (part of the cache key)", **_O)
_NAME = flags.DEFINE_string("name", "", "results stem (default query_drift_<model>_<N/1024>k)", **_O)
_OUT = flags.DEFINE_string("out_dir", "", "results directory (default experiments/results)", **_O)
_PLOT = flags.DEFINE_bool("plot", True, "write <name>.png when matplotlib is installed", **_O)

PCTS = (5, 25, 50, 75, 95)


# ------------------------------------------------------------------ metrics
def cosine(a, b):
  """cos(a, b) along the last axis: [..., D], [..., D] -> [...] (float32)."""
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  norms = np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1)
  return np.sum(a * b, axis=-1) / np.maximum(norms, 1e-30)


def group_mean(x, kv_heads: int):
  """Mean over each GQA group of the leading query-head axis: [Hq, ...] -> [Hkv, ...]."""
  x = np.asarray(x)
  if x.shape[0] % kv_heads:
    raise ValueError(f"{x.shape[0]=} query heads is not a multiple of {kv_heads=}")
  return x.reshape(kv_heads, x.shape[0] // kv_heads, *x.shape[1:]).mean(axis=1)


def softmax(scores):
  """Softmax over the last axis (float64 accumulation): [Q, N] -> [Q, N]."""
  s = np.asarray(scores, np.float64)
  e = np.exp(s - s.max(axis=-1, keepdims=True))
  return e / e.sum(axis=-1, keepdims=True)


def logsumexp(scores):
  """[Q, N] -> [Q] (float64); -inf entries are masked keys."""
  s = np.asarray(scores, np.float64)
  m = s.max(axis=-1, keepdims=True)
  return (m + np.log(np.exp(s - m).sum(axis=-1, keepdims=True)))[..., 0]


def topk_ids(scores, k: int):
  """[Q, N] -> [Q, min(k, N)] ids of the largest scores (as a set: order not guaranteed)."""
  scores = np.asarray(scores)
  k = min(k, scores.shape[-1])
  return np.argpartition(-scores, k - 1, axis=-1)[..., :k]


def recovered_mass(weights, ids):
  """Share of each row's weight on its ids: weights [Q, N] (rows sum to 1), ids [Q, k] distinct
  per row, -1 = none -> [Q]."""
  ids = np.asarray(ids, np.int64)
  taken = np.take_along_axis(np.asarray(weights), np.maximum(ids, 0), axis=-1)
  return np.where(ids >= 0, taken, 0.0).sum(axis=-1)


def hit_rate(used, exact, n: int):
  """|used ∩ exact| / k per row: used [Q, k'] (-1 ignored), exact [Q, k] -> [Q]."""
  return recall.recall_matrix(np.asarray(used, np.int64), np.asarray(exact, np.int64), n)


def head_recovery(
    queries,  # [S + 2, D]: q at positions N-2 .. N+S-1; row j + 2 is decode step j
    host_keys,  # [n_host, D]: keys [sinks, N - window)
    device_keys,  # [n_dev, D]: keys [0, sinks) then [N - window, N + S)
    device_pos,  # [n_dev] int: their positions
    *,
    n: int,
    scale: float,
    ks,
    index=None,
    threads=None,
):
  """Attention recovery of one query head over the S decode steps -> dict of [S] arrays.

  host_share: the host part's share of q_t's full causal attention. Per k: rec_exact, rec_lag1,
  rec_lag2 (mass on the exact top-k of q_t, q_{t-1}, q_{t-2}), hit_lag1, hit_lag2; with
  `index` (a host_index.Index over host_keys) rec_roar / rec_roar_lag1 / rec_roar_lag2 and
  hit_roar (against the exact top-k of q_t) likewise for its search results.
  """
  q32 = np.asarray(queries, np.float32)
  steps = len(q32) - 2
  scores = scale * (q32 @ np.asarray(host_keys, np.float32).T)  # [S + 2, n_host]
  cur, lag1, lag2 = scores[2:], scores[1:-1], scores[:-2]
  weights = softmax(cur)  # [S, n_host]
  dev = scale * (q32[2:] @ np.asarray(device_keys, np.float32).T)  # [S, n_dev]
  dev = np.where(np.asarray(device_pos)[None, :] <= n + np.arange(steps)[:, None], dev, -np.inf)  # causal
  lse_host, lse_dev = logsumexp(cur), logsumexp(dev)
  out = {"host_share": 1.0 / (1.0 + np.exp(lse_dev - lse_host))}
  n_host = len(host_keys)
  for k in ks:
    exact = topk_ids(cur, k)
    sets = {"exact": exact, "lag1": topk_ids(lag1, k), "lag2": topk_ids(lag2, k)}
    if index is not None:
      for name, rows in (("roar", q32[2:]), ("roar_lag1", q32[1:-1]), ("roar_lag2", q32[:-2])):
        sets[name] = index.search(rows, k, threads=threads)[0]
    for name, ids in sets.items():
      out[f"rec_{name}@{k}"] = recovered_mass(weights, ids)
      if name != "exact":
        out[f"hit_{name}@{k}"] = hit_rate(ids, exact, n_host)
  return out


def group_recovery(
    queries,  # [G, S + 2, D]: one GQA group's query heads, rows as in head_recovery
    host_keys,  # [n_host, D]: the group's keys [sinks, N - window)
    *,
    scale: float,
    ks,
):
  """What one selection shared by a KV group keeps of each head's attention -> dict of [G, S] arrays.

  Per-head selection holds G sets of k rows per group (searched G times); a shared one is searched
  once per group and held once. Per k, each head's share of its host attention mass on:
  rec_group: the group's top-(G k) by the mean of its heads' softmax weights (FreeKV's
    group-consistent score, per token): as many rows as the per-head sets together;
  rec_group_small: that score's top-k (1 / G of the rows);
  rec_group_meanq: the top-(G k) of the group's mean query (what one inner-product search per
    group ranks);
  rec_group_lag2: the top-(G k) of the pooled weights of q_{t-2} (a shared selection two steps old);
  union: |union of the heads' exact top-k| / (G k), the same for every head of the group: the rows
    the per-head sets hold that are distinct;
  rec_union / rec_union_lag2: the head's mass on that union (each head attends its group-mates'
    rows too: at most G k rows, searched per head, held once), of q_t's and of q_{t-2}'s sets.
  """
  q32 = np.asarray(queries, np.float32)
  group, steps = q32.shape[0], q32.shape[1] - 2
  keys = np.asarray(host_keys, np.float32)
  scores = scale * (q32 @ keys.T)  # [G, S + 2, n_host]
  weights = softmax(scores[:, 2:])  # [G, S, n_host]
  pooled = weights.mean(axis=0)  # [S, n_host]
  pooled_lag2 = softmax(scores[:, :-2]).mean(axis=0)
  mean_query = scale * (q32[:, 2:].mean(axis=0) @ keys.T)  # [S, n_host]
  n_host = len(keys)
  out = {}
  for k in ks:
    wide = min(group * k, n_host)
    shared = {"group": topk_ids(pooled, wide), "group_small": topk_ids(pooled, k),
              "group_meanq": topk_ids(mean_query, wide), "group_lag2": topk_ids(pooled_lag2, wide)}
    for name, ids in shared.items():
      out[f"rec_{name}@{k}"] = np.stack([recovered_mass(weights[h], ids) for h in range(group)])
    own = np.stack([topk_ids(scores[h, 2:], k) for h in range(group)], axis=1)  # [S, G, k]
    distinct = np.asarray([len(np.unique(own[t])) for t in range(steps)], np.float64)
    out[f"union@{k}"] = np.broadcast_to(distinct / (group * min(k, n_host)), (group, steps)).copy()
    own_lag2 = np.stack([topk_ids(scores[h, :-2], k) for h in range(group)], axis=1)
    for name, sets in (("union", own), ("union_lag2", own_lag2)):
      held = np.zeros((steps, n_host), bool)
      held[np.arange(steps)[:, None], sets.reshape(steps, -1)] = True
      out[f"rec_{name}@{k}"] = (weights * held).sum(axis=-1)  # [G, S]
  return out


def layer_study(q, k, layer, *, n, steps, sinks, window, scale, ks, roar=False, train_queries=4096,
                train_topk=100, seed=0, threads=None):
  """Drift and recovery of one layer -> dict of arrays: cos1 / cos2 [Hq, S] per query head,
  gcos1 / gcos2 [Hkv, S] group means, and head_recovery's keys stacked to [Hq, S].

  q [L, Hq, N+S', D], k [L, Hkv, N+S', D] with S' >= steps.
  """
  import host_index as hi

  Hq, Hkv = q.shape[1], k.shape[1]
  group = Hq // Hkv
  if n - window - sinks < max(ks):
    raise ValueError(f"only {n - window - sinks} host keys (N={n}, {sinks=}, {window=}) < k={max(ks)}")
  qs = q[layer, :, n - 2:n + steps].astype(np.float32)  # [Hq, S + 2, D]
  cos1 = cosine(qs[:, 2:], qs[:, 1:-1])
  cos2 = cosine(qs[:, 2:], qs[:, :-2])
  out = {"cos1": cos1, "cos2": cos2, "gcos1": group_mean(cos1, Hkv), "gcos2": group_mean(cos2, Hkv)}
  dev_pos = np.concatenate([np.arange(sinks), np.arange(n - window, n + steps)])
  stride = recall.train_stride(n, train_queries)
  per_head = []
  for h in range(Hq):
    g = h // group
    host = np.ascontiguousarray(k[layer, g, sinks:n - window])
    index = None
    if roar:
      tq = q[layer, h, 0:n:stride].astype(np.float32)
      index = hi.build_index(host, kind="roar", train_queries=tq,
                             train_topk=recall.exact_topk_np(tq, host, train_topk), seed=seed, threads=threads)
    per_head.append(head_recovery(qs[h], host, k[layer, g, dev_pos], dev_pos, n=n, scale=scale, ks=ks,
                                  index=index, threads=threads))
  for key in per_head[0]:
    out[key] = np.stack([r[key] for r in per_head])
  per_group = [group_recovery(qs[g * group:(g + 1) * group], k[layer, g, sinks:n - window], scale=scale, ks=ks)
               for g in range(Hkv)]
  for key in per_group[0]:
    out[key] = np.concatenate([r[key] for r in per_group])  # [Hq, S], heads in order
  return out


def summarize(m, *, taus):
  """One flat row of statistics from layer_study's arrays (or several layers' concatenated)."""
  row = {"cos1_med": float(np.median(m["cos1"]))}
  for p, v in zip(PCTS, np.percentile(m["gcos1"], PCTS)):
    row[f"gcos1_p{p}"] = float(v)
  for tau in taus:
    row[f"corr@{tau:g}"] = float(np.mean(m["gcos1"] < tau))
  row["cos2_med"] = float(np.median(m["cos2"]))
  row["gcos2_med"] = float(np.median(m["gcos2"]))
  for tau in taus:
    row[f"corr2@{tau:g}"] = float(np.mean(m["gcos2"] < tau))
  row["host_share"] = float(np.mean(m["host_share"]))
  for key in m:
    if key.startswith(("rec_", "hit_", "union@")):  # (miss_* and the spec columns are added from them)
      row[key] = float(np.mean(m[key]))
      if key.startswith(("rec_exact", "rec_lag")):
        row[key.replace("@", "_p10@")] = float(np.percentile(m[key], 10))
      if key.startswith("rec_"):  # missed share of q_t's full causal attention
        row["miss" + key[3:]] = float(np.mean(m["host_share"] * (1.0 - m[key])))
  # Speculation with exact search: a group below tau is searched again (exact), the others reuse t-1.
  # gain: the share of lag 1's lost mass that those corrections win back; oracle: the same number of
  # (group, step) corrections given to the ones that lose the most.
  hq, kv = m["cos1"].shape[0], m["gcos1"].shape[0]
  for tau in taus:
    correct = m["gcos1"] < tau  # [Hkv, S] (one layer) or [Hkv*L', S]
    for key in [x for x in m if x.startswith("rec_lag1@")]:
      kk = key.split("@")[1]
      exact, lag1 = m[f"rec_exact@{kk}"], m[key]
      row[f"rec_spec{tau:g}@{kk}"] = float(np.mean(np.where(np.repeat(correct, hq // kv, axis=0), exact, lag1)))
      loss = group_mean(exact - lag1, kv)  # [Hkv, S]
      total = float(loss.sum())
      best = np.sort(loss.ravel())[::-1][:int(correct.sum())]
      row[f"gain_spec{tau:g}@{kk}"] = float(loss[correct].sum()) / total if total > 0 else None
      row[f"gain_oracle{tau:g}@{kk}"] = float(best.sum()) / total if total > 0 else None
  return row


def spearman(x, y) -> float:
  """Rank correlation of two 1-D samples (ties broken by order)."""
  rx, ry = (np.argsort(np.argsort(np.asarray(v))) for v in (x, y))
  return float(np.corrcoef(rx, ry)[0, 1])


def concat_layers(per_layer: dict) -> dict:
  """Arrays of several layers joined along the head axis (layers keep their own groups)."""
  first = next(iter(per_layer.values()))
  return {key: np.concatenate([m[key] for m in per_layer.values()]) for key in first}


# ------------------------------------------------------------------ the study
def table_rows(summaries: dict, ks) -> list[dict]:
  """Rows (layer, k) with the drift columns and that k's recovery columns, rounded."""
  rows = []
  for layer, s in summaries.items():
    drift = {c: v for c, v in s.items() if "@" not in c or c.startswith(("corr", "gcos"))}
    for k in ks:
      rec = {c.replace(f"@{k}", ""): v for c, v in s.items() if c.endswith(f"@{k}")}
      cells = {c: None if v is None else round(v, 4) for c, v in (drift | rec).items()}
      rows.append({"layer": layer, "k": k} | cells)
  return rows


def summary_markdown(rows, taus, roar: bool) -> str:
  """The short table of the notes: per (layer, k) medians, correction rates, mean masses, hit rates."""
  cols = (["gcos1_p5", "gcos1_p50"] + [f"corr@{t:g}" for t in taus] + ["gcos2_med"]
          + [f"corr2@{t:g}" for t in taus] + ["host_share", "rec_exact", "rec_lag1", "rec_lag2"]
          + (["rec_roar", "rec_roar_lag1"] if roar else []) + [f"rec_spec{t:g}" for t in taus]
          + [f"gain_spec{taus[0]:g}", f"gain_oracle{taus[0]:g}"]
          + ["miss_exact", "miss_lag1", "hit_lag1", "hit_lag2"] + (["hit_roar", "hit_roar_lag1"] if roar else [])
          + ["union", "rec_union", "rec_union_lag2", "rec_group", "rec_group_small", "rec_group_meanq",
             "rec_group_lag2"])
  text = ["| layer | k | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
  for r in rows:
    text.append(f"| {r['layer']} | {r['k']} | " + " | ".join(
        "-" if r.get(c) is None else f"{r[c]:.3f}" for c in cols) + " |")
  return "\n".join(text) + "\n"


def interpret(summaries: dict, ks, taus, roar: bool) -> str:
  """A few plain sentences read off the numbers (no judgement beyond them)."""
  a = summaries["all"]
  layers = {x: s for x, s in summaries.items() if x != "all"}
  k0, k1 = ks[0], ks[-1]
  out = [f"Over all studied layers the median group-mean cos(q_t, q_t-1) is {a['gcos1_p50']:.3f} "
         f"(5th percentile {a['gcos1_p5']:.3f}); {100 * a[f'corr@{taus[0]:g}']:.1f}% of (step, group) fall "
         f"below tau = {taus[0]:g}"
         + "".join(f" and {100 * a[f'corr@{t:g}']:.1f}% below {t:g}" for t in taus[1:])
         + ", which is the share of groups speculation would search again synchronously. Two steps apart the "
         f"median is {a['gcos2_med']:.3f}; per query head (no group mean) the medians are {a['cos1_med']:.3f} one "
         f"step apart and {a['cos2_med']:.3f} two steps apart."]
  for k in (k0, k1) if k0 != k1 else (k0,):
    e, l1, l2 = a[f"rec_exact@{k}"], a[f"rec_lag1@{k}"], a[f"rec_lag2@{k}"]
    s = (f"Top-{k}: the exact set holds {100 * e:.1f}% of the host part's attention mass; the top-{k} of q_t-1 "
         f"holds {100 * l1:.1f}% ({100 * (e - l1):.1f} points less) and of q_t-2 {100 * l2:.1f}% "
         f"({100 * (e - l2):.1f} less); hit rates {100 * a[f'hit_lag1@{k}']:.1f}% / {100 * a[f'hit_lag2@{k}']:.1f}%. "
         f"10th percentiles over (head, step): exact {100 * a[f'rec_exact_p10@{k}']:.1f}%, lag 1 "
         f"{100 * a[f'rec_lag1_p10@{k}']:.1f}%, lag 2 {100 * a[f'rec_lag2_p10@{k}']:.1f}%.")
    if roar:
      s += (f" roar (default ef) for q_t: {100 * a[f'rec_roar@{k}']:.1f}% (hit {100 * a[f'hit_roar@{k}']:.1f}%), "
            f"for q_t-1 (what per_step lag 1 attends): {100 * a[f'rec_roar_lag1@{k}']:.1f}%, q_t-2: "
            f"{100 * a[f'rec_roar_lag2@{k}']:.1f}%.")
    s += (f" One selection shared by each KV group (searched once a group, held once): the group's top-{k} x G "
          f"by its heads' mean softmax weights holds {100 * a[f'rec_group@{k}']:.1f}% of each head's mass (the "
          f"per-head sets together hold {100 * a[f'union@{k}']:.1f}% distinct rows of that count), its top-{k} "
          f"alone {100 * a[f'rec_group_small@{k}']:.1f}%, the mean query's top-{k} x G "
          f"{100 * a[f'rec_group_meanq@{k}']:.1f}%, and the pooled top-{k} x G of q_t-2 "
          f"{100 * a[f'rec_group_lag2@{k}']:.1f}%. Each head attending the union of its group's per-head top-{k} "
          f"sets holds {100 * a[f'rec_union@{k}']:.1f}% (sets of q_t-2: {100 * a[f'rec_union_lag2@{k}']:.1f}%).")
    for t in taus:
      g, o = a[f"gain_spec{t:g}@{k}"], a[f"gain_oracle{t:g}@{k}"]
      if g is not None:
        s += (f" Speculation at tau = {t:g} (corrections by exact search) recovers "
              f"{100 * a[f'rec_spec{t:g}@{k}']:.1f}%:"
              f" correcting {100 * a[f'corr@{t:g}']:.1f}% of (group, step) wins back {100 * g:.1f}% of lag 1's lost "
              f"mass (a random choice of as many: {100 * a[f'corr@{t:g}']:.1f}% on average; as many given to the "
              f"(group, step) that lose the most: {100 * o:.1f}%).")
    out.append(s)
  if len(layers) > 1:
    by = sorted(layers, key=lambda x: layers[x]["gcos1_p50"])
    worst = ", ".join(f"{x} ({layers[x]['gcos1_p50']:.2f})" for x in by[:3])
    loss = sorted(layers, key=lambda x: layers[x][f"rec_exact@{k0}"] - layers[x][f"rec_lag1@{k0}"], reverse=True)
    lossy = ", ".join(f"{x} ({100 * (layers[x][f'rec_exact@{k0}'] - layers[x][f'rec_lag1@{k0}']):.1f} pts)"
                      for x in loss[:3])
    out.append(f"Layers by median group cosine, lowest first: {worst}. By top-{k0} mass lost at lag 1, largest "
               f"first: {lossy}.")
    if len(layers) >= 5:
      t = taus[0]
      rate = np.asarray([layers[x][f"corr@{t:g}"] for x in layers])
      loss = np.asarray([layers[x][f"rec_exact@{k0}"] - layers[x][f"rec_lag1@{k0}"] for x in layers])
      r = spearman(rate, loss)
      gains = [layers[x][f"gain_spec{t:g}@{k0}"] for x in layers if layers[x][f"gain_spec{t:g}@{k0}"] is not None]
      out.append(f"Across the {len(layers)} layers, Spearman's rank correlation between a layer's correction rate "
                 f"at tau = {t:g} and its top-{k0} lag-1 loss is {r:.2f}"
                 + (": the layers whose queries drift most are not the ones that lose the most mass, so one tau "
                    "for every layer spends corrections where they win little" if r < 0 else "")
                 + f". Within a layer, corrections win back {100 * np.mean(gains):.1f}% of the loss on average "
                 f"against a mean correction rate of {100 * rate.mean():.1f}%.")
  out.append(f"The host part takes {100 * a['host_share']:.1f}% of q_t's full causal attention on average; of that "
             f"full attention, the host keys left out miss {100 * a[f'miss_exact@{k0}']:.1f}% with the exact "
             f"top-{k0}, {100 * a[f'miss_lag1@{k0}']:.1f}% at lag 1 and {100 * a[f'miss_lag2@{k0}']:.1f}% at lag 2"
             + (f" ({100 * a[f'miss_exact@{k1}']:.1f} / {100 * a[f'miss_lag1@{k1}']:.1f} / "
                f"{100 * a[f'miss_lag2@{k1}']:.1f}% at top-{k1})." if k1 != k0 else "."))
  return " ".join(out)


def run(model_name, *, n, steps, text, layers, sinks, window, ks, taus, roar, train_queries, train_topk, threads,
        cache_dir, seed, name, out_dir, make_plot, model=None, log=print):
  """The whole study; returns (rows, summary rows, notes)."""
  from experiments.results_io import write_results, write_text_atomic

  t0 = time.perf_counter()
  data = recall.load_or_capture(model_name, n, decode_steps=steps, text=text, seed=seed, cache_dir=cache_dir,
                                model=model)
  meta = data["meta"]
  q, k = data["q"], data["k"]
  if q.shape[2] < n + steps:
    raise ValueError(f"capture holds {q.shape[2]} positions < N + steps = {n + steps}")
  windows = meta.get("layer_windows") or [0] * q.shape[0]
  if not layers:
    layers = [i for i, w in enumerate(windows) if w == 0]
  bad = [x for x in layers if not 0 <= x < q.shape[0] or windows[x] != 0]
  if bad:
    raise ValueError(f"layers {bad}: outside [0, {q.shape[0]}) or sliding-window")
  scale = float(meta.get("attn_scale") or q.shape[-1] ** -0.5)
  log(f"vectors q {q.shape} k {k.shape} from {meta['from_cache'] or 'a fresh capture'} "
      f"({time.perf_counter() - t0:.1f} s); layers {layers}; scale {scale}")
  t1 = time.perf_counter()
  per_layer = {}
  for layer in layers:
    tl = time.perf_counter()
    per_layer[layer] = layer_study(q, k, layer, n=n, steps=steps, sinks=sinks, window=window, scale=scale, ks=ks,
                                   roar=roar, train_queries=train_queries, train_topk=train_topk, seed=seed,
                                   threads=threads)
    log(f"layer {layer}: {time.perf_counter() - tl:.1f} s")
  study_s = time.perf_counter() - t1
  Hq, Hkv = q.shape[1], k.shape[1]
  del q, k, data
  summaries = {layer: summarize(m, taus=taus) for layer, m in per_layer.items()}
  summaries["all"] = summarize(concat_layers(per_layer), taus=taus)
  rows = table_rows(summaries, ks)
  n_host = n - window - sinks
  source = pathlib.Path(meta["from_cache"]).name if meta["from_cache"] else "a fresh run"
  notes = (
      f"{meta['model']} ({meta['source']}), prompt N = {n} tokens of `{text}` text then {steps} greedy decode "
      f"steps, vectors from experiments/recall.py's capture ({source}). "
      f"Layers {layers} (every full-attention layer studied unless --layers), {Hq} query heads / {Hkv} KV heads, "
      f"all {steps} steps and all heads (no subsampling). Host part = prompt keys [{sinks}, {n - window}) = "
      f"{n_host} keys per KV head, softmax scale {scale:g} (the model's attn_scale). q_t = decode query at N+t, "
      f"t = 0..{steps - 1}; lags reach back into the prompt's last two queries for t < 2. "
      f"gcos = group mean over the {Hq // Hkv} query heads of a KV head of cos(q_t, q_t-1) (gcos1) or "
      f"cos(q_t, q_t-2) (gcos2), as kvjax's speculative correction computes it; corr@tau / corr2@tau = share of "
      f"(step, group) with gcos1 / gcos2 below tau. rec_* = mean over (head, step) of the share of q_t's "
      f"host-part softmax mass on a top-k set: exact top-k of q_t, of q_t-1 (lag1), of q_t-2 (lag2)"
      + (f"; roar* = one roar index per query head (kvjax defaults: {train_queries} strided prompt queries, "
         f"their exact top-{train_topk}, default ef = max(64, k)) searched with q_t, q_t-1, q_t-2" if roar else "")
      + f"; rec_spec<tau> = speculation with exact search: groups below tau take the exact set, the others "
      f"the lag-1 set; gain_spec<tau> = the share of lag 1's lost mass (exact - lag1) that those corrections "
      f"win back, gain_oracle<tau> = the same for as many corrections given to the (group, step) that lose the "
      f"most. hit_* = |set ∩ exact top-k of q_t| / k. host_share = the host part's share of q_t's full "
      f"causal softmax (keys [0, N+t]); miss_* = mean of host_share x (1 - rec): the share of the full "
      f"attention left out. The "
      f"tokens that leave the device window during decode (at most {steps}) are counted on the device side "
      f"here (kvjax attends them exactly until indexed). Values were not captured: this is attention mass, "
      f"not output error. Study time {study_s:.0f} s (threads={threads}).\n\n"
      + interpret(summaries, ks, taus, roar) + "\n\n"
      + summary_markdown([r for r in rows if r["layer"] == "all"] + [r for r in rows if r["layer"] != "all"],
                         taus, roar)
      + "\nRows below: every statistic per (layer, k); _p10 = 10th percentile over (head, step).\n")
  if not name:
    name = f"query_drift_{re.sub(r'[^a-z0-9]+', '', model_name.lower())}_{round(n / 1024)}k"
  doc = write_results(name, rows, out_dir=out_dir or None, notes=notes)
  doc["meta"] = {key: v for key, v in meta.items() if key != "from_cache"} | {
      "study_s": round(study_s, 1), "layers": layers, "ks": list(ks), "taus": list(taus), "sinks": sinks,
      "window": window, "scale": scale, "roar": roar, "threads": threads}
  directory = pathlib.Path(out_dir) if out_dir else pathlib.Path(__file__).resolve().parent / "results"
  write_text_atomic(directory / f"{name}.json", json.dumps(doc, indent=1) + "\n")
  if make_plot:
    plot(summaries, ks, roar, directory / f"{name}.png",
         f"{meta['model']}, N={n}, {steps} decode steps: query drift and attention recovery")
  return rows, summaries, notes


def plot(summaries, ks, roar, path, title):
  """Per layer: median group cosine (lag 1, lag 2) and mean recovered mass per k."""
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib not installed: no plot", flush=True)
    return
  layers = [x for x in summaries if x != "all"]
  fig, axes = plt.subplots(1, 1 + len(ks), figsize=(4.2 * (1 + len(ks)), 3.6), squeeze=False)
  ax = axes[0][0]
  ax.plot(layers, [summaries[x]["gcos1_p50"] for x in layers], "o-", label="median gcos(q_t, q_t-1)")
  ax.fill_between(layers, [summaries[x]["gcos1_p5"] for x in layers], [summaries[x]["gcos1_p95"] for x in layers],
                  alpha=0.2, label="p5..p95")
  ax.plot(layers, [summaries[x]["gcos2_med"] for x in layers], "s--", label="median gcos(q_t, q_t-2)")
  ax.axhline(0.8, color="grey", lw=0.6, ls=":")
  ax.set_xlabel("layer")
  ax.set_title("query drift (GQA group mean)", fontsize=9)
  ax.legend(fontsize=7)
  for j, k in enumerate(ks):
    ax = axes[0][1 + j]
    for key, style, label in (("rec_exact", "o-", "exact top-k(q_t)"), ("rec_lag1", "s-", "top-k(q_t-1)"),
                              ("rec_lag2", "^-", "top-k(q_t-2)"), ("rec_roar", "x--", "roar(q_t)"),
                              ("rec_roar_lag1", "+--", "roar(q_t-1)")):
      if f"{key}@{k}" in summaries[layers[0]]:
        ax.plot(layers, [summaries[x][f"{key}@{k}"] for x in layers], style, ms=4, label=label)
    ax.set_xlabel("layer")
    ax.set_ylim(0, 1.01)
    ax.set_title(f"host attention mass recovered, k={k}", fontsize=9)
    ax.legend(fontsize=7)
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv):
  del argv
  try:
    ks = [int(x) for x in _KS.value]
    taus = [float(x) for x in _TAUS.value]
    layers = [int(x) for x in _LAYERS.value]
  except ValueError as e:
    raise app.UsageError(f"--ks, --taus, --layers: {e}")
  _, _, notes = run(_MODEL.value, n=_CONTEXT.value, steps=_STEPS.value, text=_TEXT.value, layers=layers,
                    sinks=_SINKS.value, window=_WINDOW.value, ks=ks, taus=taus, roar=_ROAR.value,
                    train_queries=_TRAIN_Q.value, train_topk=_TRAIN_K.value, threads=_THREADS.value,
                    cache_dir=_CACHE.value, seed=_SEED.value, name=_NAME.value, out_dir=_OUT.value,
                    make_plot=_PLOT.value)
  print(notes)


if __name__ == "__main__":
  app.run(main)
