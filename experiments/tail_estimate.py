"""Output error of sparse attention, and what a cluster estimate of the unselected keys wins back
(issue #6's output-error study).

kvjax's retrieval policy attends, at decode step t, the device part (sinks, window and the decoded
tokens) and a top-k selection of the host part (prompt keys [sinks, N - window)); every other host
key is dropped, so its softmax mass is lost and the output renormalizes over what is attended.
The multiquery losses (README, Open 1) need a selection both fresh and large; this study asks
whether a cheap estimate of the dropped tail does what a larger selection does.

Tail estimate: the host keys of each (layer, KV head) are grouped into C = n_host / size clusters,
by k-means on the keys (`km<size>`) or as contiguous pages of `size` tokens (`pg<size>`: free to
compute at prefill, FreeKV's page layout), each keeping its key sum, value sum, count n_j and
per-channel key variance. At step t the r_j selected keys of cluster j are attended exactly; the other
n_j - r_j enter as one pseudo-key with the mean key c'_j and mean value u'_j of the unselected
members (the selected members' sums subtracted: their scores and values are at hand on the
device), logit scale q.c'_j + log(n_j - r_j), and in the `var` variant plus
scale^2 / 2 * sum_d q_d^2 var_jd, the second-order term of the mean of exp(scale q.k) over keys
spread around c_j (the whole cluster's variance). All partials merge by log-sum-exp, as kvjax
merges its device and host parts. With every key its own cluster the estimate is exact; with
k >= n_host the tail is empty. The summaries' device memory is C (2 D + 1) floats per KV head
(+ C D with `var`), against n_host 2 D for the host part's K and V.

Metric: the relative L2 error ||o - o_full|| / ||o_full|| of each query head's attention output
at each step and full-attention layer, o_full being full causal attention over keys [0, N + t]; the
selection is the exact top-k of q_t (fresh, as lag 0 or per_layer) or of q_{t-2} (as fast's lag 2).
Vectors (post-RoPE q and k, and v) come from experiments/recall.py's capture.

Usage:
  python experiments/tail_estimate.py --model=smollm2 --context_len=8128
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

# recall.py (imported for its capture and cache) defines flags of some of these names; these replace them.
_O = {"allow_override": True}
_MODEL = flags.DEFINE_string("model", "smollm2", "models.registry name (vectors cached by experiments/recall.py)",
                             **_O)
_CONTEXT = flags.DEFINE_integer("context_len", 8128, "prompt tokens N", **_O)
_STEPS = flags.DEFINE_integer("decode_steps", 64, "greedy decode steps captured", **_O)
_TEXT = flags.DEFINE_enum("text", "docs", ["docs", "passkey"], "prompt text (part of the cache key)", **_O)
_LAYERS = flags.DEFINE_list("layers", [], "layers (default: every full-attention layer)", **_O)
_SINKS = flags.DEFINE_integer("sinks", 128, "first tokens kept on the device", **_O)
_WINDOW = flags.DEFINE_integer("window", 512, "last prompt tokens kept on the device", **_O)
_KS = flags.DEFINE_list("ks", ["0", "100", "300", "1000", "2000"], "top-k sizes (0: no selection)", **_O)
_GROUPS = flags.DEFINE_list("groupings", ["km32", "km128", "pg32"],
                            "clusterings of the host keys: km<size> (k-means, n_host / size clusters) or "
                            "pg<size> (contiguous pages of size tokens)")
_ITERS = flags.DEFINE_integer("kmeans_iters", 10, "k-means iterations")
_CACHE = flags.DEFINE_string("cache_dir", "/tmp/kvjax_recall", "recall.py's .npz cache", **_O)
_SEED = flags.DEFINE_integer("seed", 0, "capture and k-means seed (the capture's is part of its cache key)", **_O)
_NAME = flags.DEFINE_string("name", "", "results stem (default tail_estimate_<model>_<N/1024>k)", **_O)
_OUT = flags.DEFINE_string("out_dir", "", "results directory (default experiments/results)", **_O)

SELECTIONS = ("fresh", "lag2")  # top-k of q_t, of q_{t-2}
PCTS = (50, 90)


# ------------------------------------------------------------------ clusters
def kmeans(x, clusters: int, *, iters: int, seed: int):
  """k-means on the rows of x [n, D] -> labels [n] int in [0, clusters).

  k-means++ seeding (each new centre drawn with probability proportional to its squared distance
  to the nearest centre so far), then Lloyd's iterations; a cluster left empty keeps its centre
  (and stays empty: its summary has count 0 and never enters the attention).
  """
  x = np.asarray(x, np.float32)
  if not 1 <= clusters <= len(x):
    raise ValueError(f"{clusters=} must lie in [1, {len(x)}] (the number of keys)")
  rng = np.random.default_rng(seed)
  chosen = [int(rng.integers(len(x)))]
  nearest = np.sum((x - x[chosen[0]]) ** 2, axis=1)
  for _ in range(clusters - 1):
    total = float(nearest.sum())
    pick = int(rng.choice(len(x), p=nearest / total)) if total > 0 else int(rng.integers(len(x)))
    chosen.append(pick)
    nearest = np.minimum(nearest, np.sum((x - x[pick]) ** 2, axis=1))
  centres = x[chosen].copy()
  for _ in range(iters + 1):  # the last pass only assigns
    labels = np.argmax(2.0 * x @ centres.T - np.sum(centres * centres, axis=1), axis=1)
    counts = np.bincount(labels, minlength=clusters)
    sums = np.zeros_like(centres)
    np.add.at(sums, labels, x)
    full = counts > 0
    centres[full] = sums[full] / counts[full, None]
  return labels


class Clusters:
  """The summaries of one (layer, KV head)'s host keys, with keys and values sorted by cluster.

  order [n]: cluster order's source rows; keys / values [n, D] float32 in cluster order; starts [C]
  first row of each cluster; counts [C]; key_sum / value_sum / key_var [C, D].
  """

  def __init__(self, keys, values, labels, clusters: int):
    self.order = order = np.argsort(labels, kind="stable")
    self.labels = np.asarray(labels)[order]
    self.keys = np.asarray(keys, np.float32)[order]
    self.values = np.asarray(values, np.float32)[order]
    self.counts = np.bincount(self.labels, minlength=clusters).astype(np.float64)
    self.starts = np.concatenate([[0], np.cumsum(self.counts)[:-1]]).astype(np.int64)
    self.key_sum = self.sum_rows(self.keys)
    self.value_sum = self.sum_rows(self.values)
    mean = self.key_sum / np.maximum(self.counts, 1)[:, None]
    spread = (self.keys - mean[self.labels]) ** 2  # two passes: no cancellation for tight clusters
    self.key_var = self.sum_rows(spread) / np.maximum(self.counts, 1)[:, None]

  def sum_rows(self, x):
    """Per-cluster sums of rows: x [n, D] in cluster order -> [C, D] float64."""
    return self.per_cluster(np.asarray(x).T).T

  def per_cluster(self, x):
    """Per-cluster sums along the last axis: x [..., n] in cluster order -> [..., C] float64."""
    out = np.zeros(x.shape[:-1] + (len(self.counts),), np.float64)
    nonempty = self.counts > 0
    out[..., nonempty] = np.add.reduceat(np.asarray(x, np.float64), self.starts[nonempty], axis=-1)
    return out


# ------------------------------------------------------------------ partial attention
# float64 NumPy twins of ops.merge_partials' rule: the study separates estimator errors down to
# 1e-4 from rounding, and the singleton-cluster check is exact only without float32's.
def row_logsumexp(logits):
  """[S, M] -> [S] float64; a row of only -inf (nothing attended) gives -inf, not NaN."""
  logits = np.asarray(logits, np.float64)
  top = logits.max(axis=-1)
  safe = np.where(np.isfinite(top), top, 0.0)
  with np.errstate(divide="ignore"):
    return safe + np.log(np.exp(logits - safe[:, None]).sum(axis=-1))


def partial(logits, values):
  """Softmax attention over one part: logits [S, M] (-inf = not attended), values [M, D] ->
  (lse [S], out [S, D]); a row with nothing attended gets lse -inf and out 0."""
  lse = row_logsumexp(logits)
  w = np.exp(np.asarray(logits, np.float64) - np.where(np.isfinite(lse), lse, 0.0)[:, None])
  return lse, np.where(np.isfinite(lse)[:, None], w @ np.asarray(values, np.float64), 0.0)


def merge(*parts):
  """Log-sum-exp merge of (lse [S], out [S, D]) partials -> out [S, D]."""
  lses = np.stack([p[0] for p in parts])  # [P, S]
  top = lses.max(axis=0)
  w = np.exp(lses - top)  # -inf parts weigh 0
  return np.einsum("ps,psd->sd", w, np.stack([p[1] for p in parts])) / w.sum(axis=0)[:, None]


def selection_mask(scores, k: int):
  """[S, n] -> [S, n] bool, True on each row's top-k (none for k = 0, all for k >= n)."""
  mask = np.zeros(scores.shape, bool)
  if k >= scores.shape[1]:
    mask[:] = True
  elif k > 0:
    np.put_along_axis(mask, np.argpartition(-scores, k - 1, axis=1)[:, :k], True, axis=1)
  return mask


def tail_partial(q, host_logits, selected, c: Clusters, *, scale: float, variance: bool):
  """The unselected host keys as one pseudo-key a cluster.

  q [S, D]; host_logits [S, n] (scale q.k, cluster order); selected [S, n] bool -> (lse [S], out [S, D]).
  A device version would keep key_sum, value_sum and counts and subtract the selected members'
  scores and values, which it holds anyway.
  """
  left = c.counts[None, :] - c.per_cluster(selected.astype(np.float64))  # [S, C] unselected members
  sel_logit_sum = c.per_cluster(np.where(selected, host_logits, 0.0))  # [S, C]
  mean_logit = (scale * (q.astype(np.float64) @ c.key_sum.T) - sel_logit_sum) / np.maximum(left, 1)
  logits = mean_logit + np.log(np.maximum(left, 1))
  if variance:
    logits = logits + 0.5 * scale ** 2 * (q.astype(np.float64) ** 2 @ c.key_var.T)
  logits = np.where(left > 0, logits, -np.inf)
  lse = row_logsumexp(logits)
  w = np.exp(logits - np.where(np.isfinite(lse), lse, 0.0)[:, None])  # [S, C] softmax over clusters
  per_key = np.where(left > 0, w / np.maximum(left, 1), 0.0)  # weight of each unselected member's value
  out = per_key @ c.value_sum - np.where(selected, per_key[:, c.labels], 0.0) @ c.values
  return lse, np.where(np.isfinite(lse)[:, None], out, 0.0)


def relative_error(out, ref):
  """||out - ref|| / ||ref|| per row: [S, D], [S, D] -> [S]."""
  return np.linalg.norm(out - ref, axis=-1) / np.maximum(np.linalg.norm(ref, axis=-1), 1e-30)


def head_errors(queries, host_keys, host_values, clusterings: dict, device: tuple, *, scale: float, ks, variants):
  """Errors of one query head over the S decode steps -> {name: [S]}.

  queries [S + 2, D]: q at positions N-2 .. N+S-1 (row j + 2 is step j); host_keys / host_values
  [n, D]; clusterings: {grouping: Clusters of those keys}; device: (logits [S, n_dev] with -inf past
  the causal limit, values [n_dev, D]). Names: sparse_<sel>@k, tail_<grouping>_<sel>@k,
  tailvar_<grouping>_<sel>@k.
  """
  q64 = np.asarray(queries, np.float64)  # float64 scores: the singleton-cluster check is exact
  logits = scale * (q64 @ np.asarray(host_keys, np.float64).T)  # [S + 2, n]
  now = logits[2:]
  dev = partial(*device)
  full = merge(dev, partial(now, host_values))
  out = {}
  for sel, ranking in (("fresh", now), ("lag2", logits[:-2])):
    for k in ks:
      selected = selection_mask(ranking, k)
      chosen = partial(np.where(selected, now, -np.inf), host_values)
      out[f"sparse_{sel}@{k}"] = relative_error(merge(dev, chosen), full)
      for grouping, c in clusterings.items():
        for name, variance in variants:
          tail = tail_partial(q64[2:], now[:, c.order], selected[:, c.order], c, scale=scale, variance=variance)
          out[f"{name}_{grouping}_{sel}@{k}"] = relative_error(merge(dev, chosen, tail), full)
  return out


def parse_grouping(grouping: str) -> tuple[str, int]:
  """'km32' -> ('km', 32); ValueError naming anything else."""
  match = re.fullmatch(r"(km|pg)([1-9][0-9]*)", grouping)
  if not match:
    raise ValueError(f"grouping {grouping!r}: expected km<size> or pg<size>, size >= 1")
  return match.group(1), int(match.group(2))


def cluster_labels(keys, grouping: str, *, iters: int, seed: int):
  """Cluster of each host key [n, D] by `grouping` -> (labels [n], clusters)."""
  method, size = parse_grouping(grouping)
  if method == "pg":  # the last page may be short
    return np.arange(len(keys)) // size, -(-len(keys) // size)
  clusters = max(1, len(keys) // size)
  return kmeans(keys, clusters, iters=iters, seed=seed), clusters


def layer_errors(q, k, v, layer, *, n, steps, sinks, window, scale, ks, groupings, iters, seed, variants):
  """head_errors for every query head of one layer -> {name: [Hq, S]}."""
  Hq, Hkv = q.shape[1], k.shape[1]
  group = Hq // Hkv
  dev_pos = np.concatenate([np.arange(sinks), np.arange(n - window, n + steps)])
  causal = dev_pos[None, :] <= n + np.arange(steps)[:, None]  # [S, n_dev]
  per_head = []
  for g in range(Hkv):
    keys = k[layer, g, sinks:n - window].astype(np.float32)
    values = v[layer, g, sinks:n - window].astype(np.float32)
    clusterings = {name: Clusters(keys, values, *cluster_labels(keys, name, iters=iters, seed=seed))
                   for name in groupings}
    dev_k, dev_v = k[layer, g, dev_pos].astype(np.float32), v[layer, g, dev_pos].astype(np.float32)
    for h in range(g * group, (g + 1) * group):
      qs = q[layer, h, n - 2:n + steps].astype(np.float64)
      dev_logits = np.where(causal, scale * (qs[2:] @ dev_k.T), -np.inf)
      per_head.append(head_errors(qs, keys, values, clusterings, (dev_logits, dev_v), scale=scale, ks=ks,
                                  variants=variants))
  return {key: np.stack([r[key] for r in per_head]) for key in per_head[0]}


# ------------------------------------------------------------------ the study
def summary_rows(per_layer: dict, *, ks, groupings, variants) -> list[dict]:
  """One row per (layer or 'all', selection, k): the percentiles of every estimator's error."""
  rows = []
  everything = {key: np.concatenate([m[key].ravel() for m in per_layer.values()]) for key in
                next(iter(per_layer.values()))}
  for layer, m in [*per_layer.items(), ("all", everything)]:
    for sel in SELECTIONS:
      for k in ks:
        row = {"layer": layer, "selection": sel, "k": k}
        names = [f"sparse_{sel}@{k}"] + [f"{name}_{g}_{sel}@{k}" for g in groupings for name, _ in variants]
        for key in names:
          errs = np.asarray(m[key]).ravel()
          label = key.split("@")[0].replace(f"_{sel}", "")
          row[f"{label}_mean"] = float(errs.mean())
          for p in PCTS:
            row[f"{label}_p{p}"] = float(np.percentile(errs, p))
        rows.append(row)
  return rows


def interpret(rows, *, ks, groupings, n_host: int, dim: int) -> str:
  """What the 'all' rows say, in sentences."""
  get = {(r["selection"], r["k"]): r for r in rows if r["layer"] == "all"}
  lines = []
  for sel in SELECTIONS:
    for g in groupings:
      parts = [f"top-{k}: {get[(sel, k)]['sparse_mean']:.4f} -> {get[(sel, k)][f'tail_{g}_mean']:.4f} "
               f"(var {get[(sel, k)][f'tailvar_{g}_mean']:.4f})" for k in ks]
      lines.append(f"Mean relative error, {sel} selection, without -> with the tail estimate {g}: "
                   + "; ".join(parts) + ".")
  mem = ", ".join(f"{g}: {(2 * dim + 1) / (parse_grouping(g)[1] * 2 * dim):.3f}" for g in groupings)
  lines.append(f"Summary memory (key and value sums, count) per KV head, as a share of the host part's K+V "
               f"({n_host} keys): {mem}.")
  return " ".join(lines)


def run(model_name, *, n, steps, text, layers, sinks, window, ks, groupings, iters, cache_dir, seed, name, out_dir,
        model=None, log=print):
  """The whole study; returns (rows, notes)."""
  from experiments.results_io import write_results, write_text_atomic

  n_host = n - window - sinks
  sizes = [parse_grouping(g)[1] for g in groupings]  # ValueError on a bad one, before any work
  if n_host < max(max(ks), max(sizes)):
    raise ValueError(f"only {n_host} host keys (N={n}, {sinks=}, {window=}) for ks={ks}, groupings={groupings}")
  if min(ks) < 0:
    raise ValueError(f"ks={ks} must be >= 0")
  t0 = time.perf_counter()
  data = recall.load_or_capture(model_name, n, decode_steps=steps, text=text, seed=seed, cache_dir=cache_dir,
                                model=model, need_values=True)
  meta = data["meta"]
  q, k, v = data["q"], data["k"], data["v"]
  if q.shape[2] < n + steps:
    raise ValueError(f"capture holds {q.shape[2]} positions < N + steps = {n + steps}")
  windows = meta.get("layer_windows") or [0] * q.shape[0]
  if not layers:
    layers = [i for i, w in enumerate(windows) if w == 0]
  bad = [x for x in layers if not 0 <= x < q.shape[0] or windows[x] != 0]
  if bad:
    raise ValueError(f"layers {bad}: outside [0, {q.shape[0]}) or sliding-window")
  scale = float(meta.get("attn_scale") or q.shape[-1] ** -0.5)
  log(f"vectors q {q.shape} k {k.shape} v {v.shape} from {meta['from_cache'] or 'a fresh capture'} "
      f"({time.perf_counter() - t0:.1f} s); layers {layers}; scale {scale}")
  variants = (("tail", False), ("tailvar", True))
  t1 = time.perf_counter()
  per_layer = {}
  for layer in layers:
    tl = time.perf_counter()
    per_layer[layer] = layer_errors(q, k, v, layer, n=n, steps=steps, sinks=sinks, window=window, scale=scale,
                                    ks=ks, groupings=groupings, iters=iters, seed=seed, variants=variants)
    log(f"layer {layer}: {time.perf_counter() - tl:.1f} s")
  study_s = time.perf_counter() - t1
  Hq, Hkv, dim = q.shape[1], k.shape[1], q.shape[-1]
  del q, k, v, data
  rows = summary_rows(per_layer, ks=ks, groupings=groupings, variants=variants)
  source = pathlib.Path(meta["from_cache"]).name if meta["from_cache"] else "a fresh run"
  notes = (
      f"{meta['model']} ({meta['source']}), prompt N = {n} tokens of `{text}` text then {steps} greedy decode steps, "
      f"vectors (post-RoPE q, k and v) from experiments/recall.py's capture ({source}). Layers {layers}, "
      f"{Hq} query heads / {Hkv} KV heads, every step and head. Device part: keys [0, {sinks}) and "
      f"[{n - window}, N + t] (causal); host part: keys [{sinks}, {n - window}) = {n_host} a KV head. "
      f"Per (layer, query head, step): relative L2 error of the attention output against full causal attention, "
      f"for the device part + the exact top-k of q_t (fresh) or of q_t-2 (lag2) [sparse], and the same plus the "
      f"tail estimate of each grouping [tail_<grouping>: mean key and value of each cluster's unselected members, "
      f"logit + log(count); km<size> = k-means, {iters} iterations, pg<size> = contiguous pages] and with the "
      f"key-variance term [tailvar_<grouping>]; "
      f"seed {seed}. Columns: mean, p50 and p90 over (layer, head, step). Study time {study_s:.0f} s.\n\n"
      + interpret(rows, ks=ks, groupings=groupings, n_host=n_host, dim=dim) + "\n")
  if not name:
    name = f"tail_estimate_{re.sub(r'[^a-z0-9]+', '', model_name.lower())}_{round(n / 1024)}k"
  doc = write_results(name, rows, out_dir=out_dir or None, notes=notes)
  doc["meta"] = {key: val for key, val in meta.items() if key != "from_cache"} | {
      "study_s": round(study_s, 1), "layers": layers, "ks": list(ks), "groupings": list(groupings),
      "kmeans_iters": iters, "sinks": sinks, "window": window, "scale": scale}
  directory = pathlib.Path(out_dir) if out_dir else pathlib.Path(__file__).resolve().parent / "results"
  write_text_atomic(directory / f"{name}.json", json.dumps(doc, indent=1) + "\n")
  return rows, notes


def main(argv):
  del argv
  try:
    ks = [int(x) for x in _KS.value]
    layers = [int(x) for x in _LAYERS.value]
  except ValueError as e:
    raise app.UsageError(f"--ks, --layers: {e}")
  _, notes = run(_MODEL.value, n=_CONTEXT.value, steps=_STEPS.value, text=_TEXT.value, layers=layers,
                 sinks=_SINKS.value, window=_WINDOW.value, ks=ks, groupings=_GROUPS.value, iters=_ITERS.value,
                 cache_dir=_CACHE.value, seed=_SEED.value, name=_NAME.value, out_dir=_OUT.value)
  print(notes)


if __name__ == "__main__":
  app.run(main)
