"""Recall@k against scanned fraction for every host index kind, on synthetic or real vectors.

The paper's Figures 3 and 6: per index kind and search effort, mean recall@k of
decode queries (Q->K) and of keys used as queries (K->K) against the share of
keys scanned.

Real vectors (`--model=...`): the model reads `--context_len` tokens of text and
then generates `--decode_steps` tokens greedily; every layer's post-RoPE queries
and keys are captured on the way, by an injected attention function that writes
them into layer-stacked buffers and computes plain causal attention over the
growing cache (`ops.prefill_attention`). The decode queries are therefore real
decode-step queries (what RetrievalAttention searches with), not prompt queries.
The index of each head holds the prompt keys at positions [sinks, N - window),
what RetrievalAttention offloads to the host at prefill; roar's training queries
are the prompt's queries (all of them by default, or strided to at most `--train_queries`) with their exact
top-`--train_topk` keys among the indexed ones (NumPy, no causal mask, as
kvjax's retrieval policy does with `ops.exact_topk`). Captured vectors are cached
as an .npz under `--cache_dir` and reused.

Text (nothing is downloaded): `docs` (default) is the docstrings of a fixed list
of Python standard-library modules -- varied English technical prose;
`passkey` is kvjax.passkey_prompt's filler, a small sentence grammar (repetitive).
The model continues the text (no chat template), so the decode steps write more
of the same kind of text.

Usage:
  python experiments/recall.py --model=smollm2 --context_len=4096
  python experiments/recall.py --model=gemma3-270m --context_len=16384 --layers=5,11,17
  python experiments/recall.py --data=synthetic --n_keys=32768 --out_dir=/tmp/recall
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import json
import os
import pathlib
import re
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
from absl import app  # noqa: E402
from absl import flags  # noqa: E402

import host_index as hi  # noqa: E402
from host_index import synthetic  # noqa: E402

_DATA = flags.DEFINE_string("data", "synthetic", "synthetic, or ignored when --model is given")
_MODEL = flags.DEFINE_string("model", "", "real model (models.registry name); empty = synthetic data")
_CONTEXT = flags.DEFINE_integer("context_len", 4096, "prompt tokens N (real mode)")
_STEPS = flags.DEFINE_integer("decode_steps", 64, "greedy decode steps whose queries are the Q->K queries")
_TEXT = flags.DEFINE_enum("text", "docs", ["docs", "passkey", "needle"], "prompt text (real mode); needle: "
                          "the passkey filler with its pass key at --needle_depth and its question kept at the end")
_NEEDLE_DEPTH = flags.DEFINE_float("needle_depth", 0.03, "--text=needle: where the pass key sits (share of the prompt)")
_LAYERS = flags.DEFINE_list("layers", [], "layers to study (default: every ~4th and the last; "
                            "Gemma 3: its global layers)")
_SINKS = flags.DEFINE_integer("sinks", 128, "first tokens kept on the device (not indexed)")
_WINDOW = flags.DEFINE_integer("window", 512, "last prompt tokens kept on the device (not indexed)")
_TRAIN_Q = flags.DEFINE_integer("train_queries", 0, "max prefill queries per head for roar (strided); "
                                "0 = every prompt query")
_TRAIN_K = flags.DEFINE_integer("train_topk", 100, "N_q: exact top keys per training query")
_KK_Q = flags.DEFINE_integer("kk_queries", 256, "keys sampled as K->K queries per KV head")
_CACHE = flags.DEFINE_string("cache_dir", "/tmp/kvjax_recall", "where captured vectors (.npz) are cached")
_NAME = flags.DEFINE_string("name", "", "results stem (default recall_<model>_<N/1024>k)")
_PLOT = flags.DEFINE_bool("plot", True, "write <name>.png when matplotlib is installed")
_THREADS = flags.DEFINE_integer("threads", None, "OpenMP threads for build/search (default: all)")
_N = flags.DEFINE_integer("n_keys", 32768, "keys per head (synthetic)")
_D = flags.DEFINE_integer("dim", 128, "head_dim (synthetic)")
_Q = flags.DEFINE_integer("n_queries", 200, "decode queries evaluated (synthetic)")
_M = flags.DEFINE_integer("n_train", 8192, "prefill (training) queries for roar (synthetic)")
_K = flags.DEFINE_integer("k", 100, "recall@k")
_KINDS = flags.DEFINE_list("kinds", ["flat", "ivf64", "ivf256", "graph", "graph_ip", "roar"],
                           "flat | ivf (nlist 4*sqrt(N)) | ivf<nlist> | graph (l2) | graph_ip | roar | roar_rg | "
                           "roar_ip; a roar kind + _kv (roar_kv): one index per KV head trained on its group's "
                           "queries (HostContext roar_heads='kv') instead of one per query head; + _knn (roar_knn): "
                           "the build links through each key's nearest keys (as kvjax's prefill) instead of "
                           "searching for them")
_EFS = flags.DEFINE_list("efs", ["40", "50", "60", "70", "80", "90", "100", "120", "150", "200", "250", "300", "400", "500", "650", "800",
                                 "1000", "1300", "1600", "2000"],
                        "graph/roar ef values (below k: a beam of ef, the best k of every key scanned)")
_NPROBE_FRACS = flags.DEFINE_list("nprobe_fracs", ["0.016", "0.03", "0.05", "0.08", "0.12", "0.17",
                                                   "0.25", "0.35", "0.5", "0.7"],
                                  "ivf nprobe as fractions of nlist")
_OUT = flags.DEFINE_string("out_dir", "", "results directory (default experiments/results)")
_SEED = flags.DEFINE_integer("seed", 0, "data / sampling seed")
_PEERS = flags.DEFINE_list("peers", [], "outside references instead of kvjax's kinds (bench extra: faiss-cpu, "
                           "hnswlib), e.g. faiss_hnsw16_ip,faiss_hnsw32_l2,faiss_ivf256_ip,hnswlib_ip,hnswlib_l2ip")
_PEERS_CMP = flags.DEFINE_string("peers_compare", "", "kvjax recall JSON on the same vectors to set beside the peers")
_PEERS_CMP_KINDS = flags.DEFINE_list("peers_compare_kinds", ["graph", "graph_ip", "roar"],
                                     "kvjax kinds copied from --peers_compare")
_REPLAY_Q = flags.DEFINE_integer("replay_queries", 0, "hnswlib scanned: replay this many queries per mode and head "
                                 "(0 = all)")
_HUBS = flags.DEFINE_list("hub_variants", [], "roar kinds: also search each built index with these hub seed sets "
                          "(same graph, only the seeds swapped; rows as kind '<kind>:<variant>'): q4 (the last "
                          "quarter's most frequent keys: the C default until tail64strat8), tail<T> (half from the "
                          "last T training rows' top lists, half q4), strat<S> (S position strata, n_hubs/S each "
                          "by last-quarter frequency), tail<T>strat<S>; suffix _h<N> for N hubs (default 32)")
_RERENDER = flags.DEFINE_string("rerender", "", "remake <json>'s summary, .md and .png from its rows, then exit")

TARGETS = (0.90, 0.95)


# ------------------------------------------------------------------ index kinds and curves
def kv_shared(kind: str) -> bool:
  """Whether a kind keeps one roar index per KV head: `roar_kv`, `roar_rg_kv`, ... (a roar kind + '_kv').

  That index trains on every query head of its GQA group (rows interleaved in prompt order) and serves them
  all, as HostContext(kind="roar", roar_heads="kv") does; the plain roar kinds keep one index per query head."""
  return kind.endswith("_kv") and parse_kind(kind)[0] == "roar"


CONNECT_KNN = 64  # `_knn` kinds: each key's nearest keys handed to the roar build (kvjax's retrieval default)


def parse_kind(kind: str) -> tuple[str, dict]:
  """'ivf256' -> ('ivf', {'nlist': 256}); 'graph_ip' -> ('graph', {'metric': 'ip'}); 'roar_kv' -> ('roar', {});
  'roar_knn' -> ('roar', {'connect_knn': 64}) (see build)."""
  if kind.endswith("_knn"):
    base, params = parse_kind(kind[:-4])
    if base != "roar":
      raise ValueError(f"unknown kind {kind!r}: only roar kinds take _knn (nearest-key connect candidates)")
    return base, params | {"connect_knn": CONNECT_KNN}
  if kind.endswith("_kv"):
    base, params = parse_kind(kind[:-3])
    if base != "roar":
      raise ValueError(f"unknown kind {kind!r}: only roar kinds take _kv (one index per KV head)")
    return base, params
  if kind in ("flat", "graph", "roar"):
    return kind, {}
  if kind == "graph_ip":
    return "graph", {"metric": "ip"}
  if kind == "roar_ip":
    return "roar", {"metric": "ip"}
  if kind == "roar_rg":  # RoarGraph's own shape: M 35, no co-occurrence links (kvjax's roar before them)
    return "roar", {"M": 35, "n_cooc": 0}
  m = re.fullmatch(r"ivf(\d*)", kind)
  if m:
    return "ivf", ({"nlist": int(m.group(1))} if m.group(1) else {})
  raise ValueError(f"unknown kind {kind!r}: flat | ivf | ivf<nlist> | graph | graph_ip | roar | roar_ip | roar_rg"
                   " (roar kinds + _kv: one index per KV head; + _knn: the build links through each key's "
                   f"{CONNECT_KNN} nearest keys instead of searching for them)")


def build(keys, base: str, params: dict, **kwargs):
  """(hi.build_index with parse_kind's params, its build seconds). `connect_knn` becomes connect_candidates,
  computed first with NumPy (on the device in kvjax's prefill) and not counted in the build's seconds."""
  params = dict(params)
  count = params.pop("connect_knn", None)
  if count:
    kwargs["connect_candidates"] = hi.key_neighbours(np.asarray(keys, np.float32), count)
  t0 = time.perf_counter()
  return hi.build_index(keys, kind=base, **kwargs, **params), time.perf_counter() - t0


def efforts_for(base: str, index, *, k: int, efs, nprobe_fracs) -> list:
  if base == "flat":
    return [None]
  if base == "ivf":
    nlist = index.params["nlist"] or int(4.0 * np.sqrt(len(index)) + 0.5)
    nlist = max(1, min(nlist, len(index)))
    return sorted({max(1, min(nlist, round(f * nlist))) for f in nprobe_fracs})
  return list(efs)  # ef < k: a beam of ef, results the best k of every key scanned


def recall_matrix(ids: np.ndarray, truth: np.ndarray, n: int) -> np.ndarray:
  """[Q] recall of each row: |ids ∩ truth| / k; ids [Q, >=k] (-1 ignored, unique per row)."""
  member = np.zeros((truth.shape[0], n + 1), bool)  # column n absorbs the -1 padding
  np.put_along_axis(member, truth, True, axis=1)
  hit = np.take_along_axis(member, np.where(ids >= 0, ids, n), axis=1)
  return hit.sum(1) / truth.shape[1]


POS_BINS = 10  # key-position buckets of the recall breakdown: deciles of the prompt


def position_recall(ids: np.ndarray, truth: np.ndarray, positions: np.ndarray, *, n_prompt: int,
                    bins: int = POS_BINS) -> tuple[np.ndarray, np.ndarray]:
  """Recall of the true top-k broken down by where the true keys sit in the prompt.

  ids [Q, >=k] returned ids (-1 ignored, unique per row); truth [Q, k] true top-k ids; positions [n] each
  indexed key's prompt position. A true key at position p falls in bucket min(bins - 1, p * bins // n_prompt)
  (prompt deciles by default; a decode query sits just after the prompt, so bucket 0 is the farthest keys).
  Returns (hits [bins], true [bins]) int64 counts summed over the queries: `true` = true top-k keys in the
  bucket, `hits` = how many of them `ids` holds. hits.sum() / true.sum() is recall_matrix's mean."""
  n = len(positions)
  member = np.zeros((truth.shape[0], n + 1), bool)
  np.put_along_axis(member, np.where(ids >= 0, ids, n), True, axis=1)
  member[:, n] = False
  hit = np.take_along_axis(member, truth, axis=1)
  b = np.minimum(bins - 1, np.asarray(positions, np.int64)[truth] * bins // n_prompt)
  true = np.bincount(b.ravel(), minlength=bins)[:bins]
  hits = np.bincount(b[hit], minlength=bins)[:bins]
  return hits.astype(np.int64), true.astype(np.int64)


def mass_recall(ids: np.ndarray, scores: np.ndarray, truth_scores: np.ndarray, scale: float) -> np.ndarray:
  """[Q] attention-mass recall: the softmax mass of the returned keys over that of the true top-k,
  sum_ret exp(scale s) / sum_true exp(scale s) (the normaliser over all keys cancels; <= 1 since the true
  top-k are the k largest scores). scores [Q, >=k] the returned keys' q.k (ids -1: ignored); truth_scores
  [Q, k] the true top-k's q.k."""
  mx = truth_scores.max(1, keepdims=True).astype(np.float64)
  num = np.where(ids >= 0, np.exp(scale * (np.where(ids >= 0, scores, 0) - mx)), 0.0).sum(1)
  den = np.exp(scale * (truth_scores - mx)).sum(1)
  return num / den


def curve_rows(index, base, query_sets, truths, n, *, k, efs, nprobe_fracs, threads=None, detail=None):
  """Rows (mode, effort, recall, scanned_frac) of one built index over its query sets.

  detail (optional): {"positions": [n] prompt position of each indexed key, "n_prompt": N, "scale": attention
  scale, "truth_scores": {mode: [Q, k] true top-k q.k}}; the rows then also hold mass_recall (mean of
  `mass_recall`) and pos_hits / pos_true (`position_recall`'s counts, as lists); with "focus": (a, b) a position
  span, also focus_hits / focus_true (true top-k keys at positions [a, b) found / present)."""
  rows = []
  for ef in efforts_for(base, index, k=k, efs=efs, nprobe_fracs=nprobe_fracs):
    for mode, queries in query_sets.items():
      ids, scores, scanned = index.search(queries, k, ef=ef, threads=threads)
      rows.append({"mode": mode, "effort": "exact" if ef is None else ef,
                   "recall": float(recall_matrix(ids, truths[mode], n).mean()),
                   "scanned_frac": float(scanned.mean()) / n, "queries": len(queries)})
      if detail is not None:
        hits, true = position_recall(ids, truths[mode], detail["positions"], n_prompt=detail["n_prompt"])
        rows[-1] |= {"mass_recall": float(mass_recall(ids, scores, detail["truth_scores"][mode],
                                                      detail["scale"]).mean()),
                     "pos_hits": hits.tolist(), "pos_true": true.tolist()}
        if detail.get("focus"):  # a position span (the needle): its true keys found / present
          a, b = detail["focus"]
          pos = np.asarray(detail["positions"])
          inside = ((pos >= a) & (pos < b)).astype(np.int64)  # bucket 1 = inside the span
          fh, ft = position_recall(ids, truths[mode], inside, n_prompt=2, bins=2)
          rows[-1] |= {"focus_hits": int(fh[1]), "focus_true": int(ft[1])}
  return rows


# ------------------------------------------------------------------ hub seed variants (study only)
def parse_hub_variant(v: str) -> dict:
  """'q4' | 'tail<T>' | 'strat<S>' | 'tail<T>strat<S>', optional '_h<N>' (N hubs, default 32)."""
  m = re.fullmatch(r"(q4|(?:tail(\d+))?(?:strat(\d+))?)(?:_h(\d+))?", v)
  if not m or not m.group(1):
    raise ValueError(f"unknown hub variant {v!r}: q4 | tail<T> | strat<S> | tail<T>strat<S> [+ _h<N>]")
  return {"tail": int(m.group(2) or 0), "strat": int(m.group(3) or 0), "n_hubs": int(m.group(4) or 32)}


def study_hubs(train_topk: np.ndarray, n: int, variant: str) -> np.ndarray:
  """Hub seeds of a hub variant from the training rows' top lists [m, N_q] (prompt order), by
  host_index.synthetic.hub_seeds (the C build's rule is tail64strat8).

  q4: the n_hubs keys most frequent in the last quarter of the rows. tail<T>: n_hubs/2 most frequent in the
  last T rows, the rest q4. strat<S>: the key range (prompt order) cut into S equal strata, the n_hubs/S most
  frequent (last quarter) of each. Both: tail half, strat the rest. Short strata/tails are filled from q4."""
  p = parse_hub_variant(variant)
  return synthetic.hub_seeds(train_topk, n, p["n_hubs"], tail_rows=p["tail"], strata=p["strat"])


def set_hubs(index, hubs: np.ndarray) -> None:
  """Swap a built roar index's hub seeds (export / restore: the graph and entry stay as built)."""
  e = index._c.export()
  index._c.restore(e["n"], e["entry"], e["nlist"], e["adj"], e["deg"], e["centroids"], e["assign"],
                   np.ascontiguousarray(hubs, np.int32).tobytes())


def recall_rows(keys, queries, *, k, kinds, efs, nprobes, train_queries=None, train_topk=None,
                mode="Q->K", label=""):
  """Recall@k and scanned fraction per (kind, effort) for one head (synthetic driver).

  Args:
    keys: [N, D] float32/float16/bfloat16 keys of one head.
    queries: [Q, D] queries (decode queries for Q->K, keys for K->K).
    k: recall@k.
    kinds: names accepted by `parse_kind`.
    efs: graph/roar candidate-list sizes; nprobes: ivf probes.
    train_queries: [M, D] prefill queries (roar), or train_topk [M, N_q].
    mode, label: copied into the rows.

  Returns:
    List of flat dicts: kind, effort, recall, scanned_frac, build_s, ...
  """
  k32 = np.asarray(keys).astype(np.float32)
  n = len(k32)
  truth = synthetic.exact_topk(np.asarray(queries, np.float32), k32, k)
  rows = []
  for kind in kinds:
    base, params = parse_kind(kind)
    train = {}
    if base == "roar":
      train = {"train_topk": train_topk} if train_topk is not None else {"train_queries": train_queries}
    ix, build_s = build(keys, base, params, **train)
    efforts = {"flat": [None], "ivf": nprobes}.get(base, efs)
    if base == "ivf":  # past nlist a probe count repeats the full scan under a new label
      nlist = ix.params["nlist"] or int(4.0 * np.sqrt(len(ix)) + 0.5)
      efforts = sorted({min(p, max(1, min(nlist, len(ix)))) for p in efforts})
    for ef in efforts:
      if ef is not None and base != "ivf" and ef < k:
        continue
      ids, _, scanned = ix.search(queries, k, ef=ef)
      rows.append({"data": label, "mode": mode, "kind": kind, "n_keys": n, "k": k,
                   "effort": ef if ef is not None else "exact",
                   "recall": round(float(recall_matrix(ids, truth, n).mean()), 4),
                   "scanned_frac": round(float(scanned.mean()) / n, 5),
                   "build_s": round(build_s, 2)})
      print(json.dumps(rows[-1]), flush=True)
  return rows


def scanned_at(points, target: float):
  """Scanned fraction where a curve first reaches `target` recall, linearly interpolated.

  points: [(scanned_frac, recall)] in increasing effort. None when never reached; the first
  point's fraction when the least effort already reaches it.
  """
  prev = None
  for s, r in points:
    if r >= target:
      if prev is None or r == prev[1]:
        return s  # the least effort already reaches it: an upper bound
      return prev[0] + (target - prev[1]) * (s - prev[0]) / (r - prev[1])
    prev = (s, r)
  return None


# ------------------------------------------------------------------ text and capture
DOC_MODULES = (
    "textwrap", "argparse", "collections", "functools", "itertools", "json", "logging", "pathlib", "re",
    "string", "subprocess", "threading", "unittest", "email", "http.client", "urllib.request", "asyncio",
    "decimal", "fractions", "statistics", "random", "datetime", "calendar", "heapq", "bisect", "contextlib",
    "dataclasses", "enum", "typing", "inspect", "pickle", "shutil", "tempfile", "zipfile", "tarfile", "csv",
    "configparser", "difflib", "doctest", "pdb", "socket", "ssl", "sqlite3", "codecs", "locale", "gettext",
    "io", "os",
)


def docs_text(min_chars: int) -> str:
  """Docstrings of a fixed list of stdlib modules (module, then its public classes and functions)."""
  parts = []
  for name in DOC_MODULES:
    try:
      mod = importlib.import_module(name)
    except ImportError:
      continue
    docs = [inspect.getdoc(mod) or ""]
    for attr, obj in sorted(vars(mod).items()):
      if attr.startswith("_"):
        continue
      if (inspect.isclass(obj) or inspect.isfunction(obj)) and getattr(obj, "__module__", "") == mod.__name__:
        docs.append(inspect.getdoc(obj) or "")
    parts += [d for d in docs if d]
    if sum(map(len, parts)) >= min_chars:
      break
  return "\n\n".join(parts)


def needle_tokens(tokenizer, n: int, depth: float, seed: int) -> tuple[list[int], tuple[int, int]]:
  """(n token ids, the needle's token span [start, end)): kvjax.passkey_prompt's intro and filler with its pass
  key sentence spliced in at token depth * n, cut to n tokens with the question kept as the last tokens."""
  from kvjax.prompts import PASSKEY_INTRO, PASSKEY_NEEDLE, PASSKEY_QUESTION, passkey_prompt

  pk = passkey_prompt(num_sentences=n // 4 + 50, depth=0.0, seed=seed)  # ~6-9 tokens a sentence: enough
  needle = PASSKEY_NEEDLE.format(passkey=pk.passkey)
  filler = pk.text[len(PASSKEY_INTRO) + len(needle) + 1:-len(PASSKEY_QUESTION)]  # depth 0 put the needle first
  head, tail = tokenizer.encode(PASSKEY_INTRO), tokenizer.encode(PASSKEY_QUESTION)
  body, mid = tokenizer.encode(filler), tokenizer.encode(" " + needle + " ")
  at = max(0, round(depth * n) - len(head))
  ids = (head + body[:at] + mid + body[at:])[:n - len(tail)] + tail
  if len(ids) < n:
    raise ValueError(f"the needle text gives {len(ids)} tokens, fewer than context_len={n}")
  return ids, (len(head) + at, len(head) + at + len(mid))


def prompt_tokens(tokenizer, n: int, text: str, seed: int) -> list[int]:
  """Exactly n token ids of the chosen text (BOS first when the model uses one)."""
  chars = 6 * n + 1000
  if text == "docs":
    body = docs_text(chars)
  else:
    from kvjax.prompts import passkey_prompt

    body = passkey_prompt(num_sentences=n // 8 + 50, seed=seed).text
  ids = tokenizer.encode(body)
  if len(ids) < n:
    raise ValueError(f"the {text!r} text gives {len(ids)} tokens, fewer than context_len={n}")
  return ids[:n]


def capture_vectors(model, tokens, *, decode_steps: int):
  """Runs the prompt, then `decode_steps` greedy steps, capturing post-RoPE q and k, and v.

  Returns:
    q: [L, Hq, N + steps, D] float16 queries, k: [L, Hkv, N + steps, D] float16 keys,
    v: [L, Hkv, N + steps, D] float16 values, generated: [steps] int32 greedy tokens,
    seconds: {"prefill", "decode"}.
  """
  import jax
  import jax.numpy as jnp

  import ops
  from models.decoder import forward_hidden, logits_from_hidden
  from models.rope import rope_tables

  cfg = model.cfg
  n, cap = len(tokens), len(tokens) + decode_steps
  L, Hq, Hkv, D = cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  dtype = jnp.dtype(cfg.dtype)
  rope = rope_tables(cfg, cap)
  windowed = any(w > 0 for w in cfg.layer_windows)
  windows = jnp.asarray(cfg.layer_windows, jnp.int32)

  def attention_fn(layer, q, k, v, positions, state):
    # q [1, T, Hq, D], k/v [1, T, Hkv, D]; caches [L, 1, Hkv, cap, D], qcap [L, Hq, cap, D]
    kc, vc, qc = state
    start = positions[0, 0]
    kc = jax.lax.dynamic_update_slice(kc, k.transpose(0, 2, 1, 3)[None].astype(kc.dtype), (layer, 0, 0, start, 0))
    vc = jax.lax.dynamic_update_slice(vc, v.transpose(0, 2, 1, 3)[None].astype(vc.dtype), (layer, 0, 0, start, 0))
    qc = jax.lax.dynamic_update_slice(qc, q[0].transpose(1, 0, 2)[None].astype(qc.dtype), (layer, 0, start, 0))
    o, _ = ops.prefill_attention(q, kc, vc, positions, positions[:, -1] + 1, layer=layer, scale=cfg.attn_scale,
                                 window=windows[layer] if windowed else None)
    return o.astype(q.dtype), (kc, vc, qc)

  @functools.partial(jax.jit, donate_argnums=(2,))
  def step(params, toks, state, positions):
    hidden, state = forward_hidden(params, toks, positions, cfg=cfg, rope=rope, attention_fn=attention_fn,
                                   attention_state=state)
    return jnp.argmax(logits_from_hidden(params, cfg, hidden[:, -1]), axis=-1).astype(jnp.int32), state

  state = (jnp.zeros((L, 1, Hkv, cap, D), dtype), jnp.zeros((L, 1, Hkv, cap, D), dtype),
           jnp.zeros((L, Hq, cap, D), dtype))
  t0 = time.perf_counter()
  nxt, state = step(model.params, jnp.asarray([tokens], jnp.int32), state, jnp.arange(n, dtype=jnp.int32)[None])
  nxt.block_until_ready()
  t_prefill = time.perf_counter() - t0
  generated = []
  t0 = time.perf_counter()
  for i in range(decode_steps):
    generated.append(int(nxt[0]))
    nxt, state = step(model.params, nxt[:, None], state, jnp.full((1, 1), n + i, jnp.int32))
  jax.block_until_ready(state)
  t_decode = time.perf_counter() - t0
  kc, vc, qc = state
  q = np.asarray(qc, np.float16)
  k, v = np.asarray(kc[:, 0], np.float16), np.asarray(vc[:, 0], np.float16)
  return q, k, v, np.asarray(generated, np.int32), {"prefill": t_prefill, "decode": t_decode}


def load_or_capture(model_name: str, n: int, *, decode_steps: int, text: str, seed: int, cache_dir: str,
                    model=None, need_values: bool = False):
  """Captured vectors from the .npz cache, or from a model run (then cached).

  Returns a dict: q [L, Hq, N+S, D] f16, k and v [L, Hkv, N+S, D] f16, tokens [N+S], generated
  text, capture seconds, group size, and whether it came from the cache. A cache file written
  before values were captured has no v: with `need_values` it is captured again (and replaced).
  """
  tag = hashlib.sha1(f"{model_name}|{n}|{decode_steps}|{text}|{seed}".encode()).hexdigest()[:10]
  path = os.path.join(cache_dir, f"{re.sub(r'[^A-Za-z0-9_.-]', '_', model_name)}_{n}_{tag}.npz")
  if os.path.isfile(path):
    with np.load(path) as z:
      out = {key: z[key] for key in z.files}
    if "v" in out or not need_values:
      out["meta"] = json.loads(str(out["meta"]))
      out["meta"]["from_cache"] = path
      return out
  if model is None:
    from models.registry import load_model

    model = load_model(model_name)
  from kvjax.generate import check_context

  check_context(model.cfg, n, decode_steps)  # no silent run past the trained context
  needle_span = None
  if model.tokenizer is None:
    tokens = np.random.default_rng(seed).integers(0, model.cfg.vocab_size, n).tolist()
  elif text.startswith("needle"):  # "needle<depth>"
    tokens, needle_span = needle_tokens(model.tokenizer, n, float(text[len("needle"):]), seed)
  else:
    tokens = prompt_tokens(model.tokenizer, n, text, seed)
  q, k, v, gen, secs = capture_vectors(model, tokens, decode_steps=decode_steps)
  meta = {"model": model.cfg.name, "source": model.source, "n": n, "decode_steps": decode_steps, "text": text,
          "capture_s": {key: round(v, 2) for key, v in secs.items()},
          "generated": model.tokenizer.decode(gen.tolist()) if model.tokenizer is not None else gen.tolist(),
          "layer_windows": list(model.cfg.layer_windows), "attn_scale": model.cfg.attn_scale}
  if needle_span is not None:
    meta["needle_span"] = list(needle_span)
  os.makedirs(cache_dir, exist_ok=True)
  tmp = path + f".tmp{os.getpid()}.npz"
  all_tokens = np.asarray(list(tokens) + gen.tolist(), np.int32)
  np.savez(tmp, q=q, k=k, v=v, tokens=all_tokens, meta=json.dumps(meta))
  os.replace(tmp, path)
  meta["from_cache"] = None
  return {"q": q, "k": k, "v": v, "tokens": all_tokens, "meta": meta}


# ------------------------------------------------------------------ the real-vector study
def exact_topk_np(queries, keys, k, *, block=2048):
  """[Q, k] ids of the largest q.k (float32 scores), best first; queries in blocks (bounded memory)."""
  keys32 = keys.astype(np.float32)
  k = min(k, keys.shape[0])
  out = []
  for i in range(0, len(queries), block):
    s = queries[i:i + block].astype(np.float32) @ keys32.T  # [block, N]
    part = np.argpartition(-s, k - 1, axis=1)[:, :k]
    order = np.argsort(-np.take_along_axis(s, part, axis=1), axis=1, kind="stable")
    out.append(np.take_along_axis(part, order, axis=1))
  return np.concatenate(out) if out else np.zeros((0, k), np.int64)


def train_stride(n: int, train_queries: int) -> int:
  """Stride over the n prompt queries that keeps at most `train_queries` of them (0: all, stride 1)."""
  return 1 if train_queries <= 0 else max(1, -(-n // train_queries))


def pivot_stats(train_topk: np.ndarray, n: int) -> dict:
  """How concentrated the training queries' nearest keys (pivots) are."""
  piv = train_topk[:, 0]
  counts = np.bincount(piv, minlength=n)
  top = int(counts.argmax())
  return {"pivot_keys_frac": float((counts > 0).mean()), "top_pivot_share": float(counts[top] / len(piv)),
          "top_pivot_pos": top}


def layer_study(q, k, layer, *, n, sinks, window, decode_steps, kinds, k_top, efs, nprobe_fracs, train_queries,
                train_topk, kk_queries, seed, threads=None, log=print, hub_variants=(), scale=None, focus=None):
  """Curve rows (one per head, kind, mode, effort) for one layer.

  q [L, Hq, N+S, D], k [L, Hkv, N+S, D]; the index holds keys [sinks, n - window). Rows carry
  `curve_rows`' position breakdown and attention-mass recall (softmax scale `scale`, default D^-0.5).
  hub_variants: each roar index is searched again with each variant's hub seeds (`study_hubs` over the rows
  it was trained on), rows as kind '<kind>:<variant>'.
  """
  lo, hi_ = sinks, n - window
  if hi_ - lo < k_top:
    raise ValueError(f"only {hi_ - lo} keys to index (N={n}, sinks={sinks}, window={window}) < k={k_top}")
  Hq, Hkv = q.shape[1], k.shape[1]
  group = Hq // Hkv
  stride = train_stride(n, train_queries)
  rng = np.random.default_rng(seed + layer)
  rows = []
  for g in range(Hkv):
    keys = np.ascontiguousarray(k[layer, g, lo:hi_])  # [n_idx, D] float16, as the host store keeps them
    n_idx = len(keys)
    kk = keys[rng.choice(n_idx, min(kk_queries, n_idx), replace=False)].astype(np.float32)
    heads = range(g * group, (g + 1) * group)
    dec = {h: q[layer, h, n:n + decode_steps].astype(np.float32) for h in heads}
    truth_kk = exact_topk_np(kk, keys, k_top)
    truth_dec = {h: exact_topk_np(dec[h], keys, k_top) for h in heads}
    keys32 = keys.astype(np.float32)
    def true_scores(qs, tr):
      return np.einsum("qd,qkd->qk", qs, keys32[tr])
    detail = {"positions": np.arange(lo, hi_), "n_prompt": n,
              "scale": float(scale) if scale else keys.shape[1] ** -0.5, "focus": focus}
    train_cache = {}
    def head_train(h):  # one exact top-k per query head, shared by every roar variant
      if h not in train_cache:
        tq = q[layer, h, 0:n:stride].astype(np.float32)
        train_cache[h] = (tq, exact_topk_np(tq, keys, train_topk))
      return train_cache[h]

    for kind in kinds:
      base, params = parse_kind(kind)
      per_head = base == "roar" and not kv_shared(kind)
      for h in (heads if per_head else [None]):
        train = {}
        extra = {}
        if per_head:
          tq, tk = head_train(h)
          train = {"train_queries": tq, "train_topk": tk}
          extra = pivot_stats(tk, n_idx)
          extra["top_pivot_pos"] += lo
        elif base == "roar":  # one index for the group: its heads' rows interleaved, row m*G + j = head j's m-th
          parts = [head_train(x) for x in heads]
          train = {name: np.stack([p[i] for p in parts], axis=1).reshape(-1, parts[0][i].shape[1])
                   for i, name in enumerate(("train_queries", "train_topk"))}
        index, build_s = build(keys, base, params, seed=seed, threads=threads, **train)
        extra["index_bytes"] = int(index._c.nbytes)  # the index structure, not its keys
        qs = {"Q->K": np.concatenate([dec[x] for x in (heads if h is None else [h])]), "K->K": kk}
        tr = {"Q->K": np.concatenate([truth_dec[x] for x in (heads if h is None else [h])]), "K->K": truth_kk}
        det = detail | {"truth_scores": {m: true_scores(qs[m], tr[m]) for m in qs}}
        for r in curve_rows(index, base, qs, tr, n_idx, k=k_top, efs=efs, nprobe_fracs=nprobe_fracs,
                            threads=threads, detail=det):
          rows.append({"layer": layer, "kv_head": g, "q_head": "group" if h is None else h, "kind": kind,
                       "n_keys": n_idx, **r, "build_s": round(build_s, 3), **extra})
        for v in (hub_variants if base == "roar" and train else ()):
          set_hubs(index, study_hubs(np.asarray(train["train_topk"]), n_idx, v))
          for r in curve_rows(index, base, qs, tr, n_idx, k=k_top, efs=efs, nprobe_fracs=nprobe_fracs,
                              threads=threads, detail=det):
            rows.append({"layer": layer, "kv_head": g, "q_head": "group" if h is None else h,
                         "kind": f"{kind}:{v}", "n_keys": n_idx, **r, "build_s": round(build_s, 3), **extra})
      log(f"layer {layer} kv_head {g} {kind}: built and searched")
  return rows


def aggregate(rows):
  """Mean over heads per (layer, kind, mode, effort); plus layer 'all' (mean over layers)."""
  groups = {}
  for r in rows:
    groups.setdefault((r["layer"], r["kind"], r["mode"], r["effort"]), []).append(r)
  out = []
  for (layer, kind, mode, effort), rs in groups.items():
    # Heads weigh by their query count (a group index serves all its query heads).
    w = np.asarray([r["queries"] for r in rs], float)
    out.append({"layer": layer, "kind": kind, "mode": mode, "effort": effort, "n_keys": rs[0]["n_keys"],
                "recall": round(float(np.average([r["recall"] for r in rs], weights=w)), 4),
                "scanned_frac": round(float(np.average([r["scanned_frac"] for r in rs], weights=w)), 5),
                "build_s": round(float(np.mean([r["build_s"] for r in rs])), 3)} | _detail_agg(rs, w))
  layers = sorted({r["layer"] for r in out})
  by = {}
  for r in out:
    by.setdefault((r["kind"], r["mode"], r["effort"]), []).append(r)
  for (kind, mode, effort), rs in by.items():
    if len(rs) == len(layers) and len(layers) > 1:
      out.append({"layer": "all", "kind": kind, "mode": mode, "effort": effort,
                  "n_keys": rs[0]["n_keys"], "recall": round(float(np.mean([r["recall"] for r in rs])), 4),
                  "scanned_frac": round(float(np.mean([r["scanned_frac"] for r in rs])), 5),
                  "build_s": round(float(np.mean([r["build_s"] for r in rs])), 3)} | _detail_agg(rs))
  return out


def _detail_agg(rs, w=None) -> dict:
  """mass_recall (weighted mean) and pos_hits / pos_true (summed: position recall pools the true keys of every
  head and layer) of rows that carry them."""
  if not all("pos_true" in r for r in rs):
    return {}
  out = {"mass_recall": round(float(np.average([r["mass_recall"] for r in rs], weights=w)), 4),
         "pos_hits": np.sum([r["pos_hits"] for r in rs], axis=0).tolist(),
         "pos_true": np.sum([r["pos_true"] for r in rs], axis=0).tolist()}
  if all("focus_true" in r for r in rs):
    out |= {"focus_hits": int(sum(r["focus_hits"] for r in rs)), "focus_true": int(sum(r["focus_true"] for r in rs))}
  return out


def pos_recall(r, buckets=None):
  """Recall of the true keys in `buckets` (default all) from a row's pos_hits / pos_true; None without any."""
  b = slice(None) if buckets is None else buckets
  t = np.sum(np.asarray(r["pos_true"])[b])
  return None if t == 0 else float(np.sum(np.asarray(r["pos_hits"])[b]) / t)


POSITION_MARK = "**Recall by key position**"


def position_markdown(curves, kinds, fracs=(0.03, 0.05, 0.10), mode="Q->K") -> str:
  """Two tables from rows with the position breakdown: (1) at equal scanned fractions, per layer and kind,
  recall / recall of the true keys in the prompt's first 10% / attention-mass recall; (2) layer 'all' (or the
  only layer) per kind and ef: scanned, recall, mass recall and the recall of each prompt decile."""
  det = [r for r in curves if r["mode"] == mode and "pos_true" in r]
  present = [x for x in kinds if x != "flat" and any(r["kind"] == x for r in det)]
  if not present:
    return ""
  metrics = (("all", lambda r: r["recall"]), ("first 10%", lambda r: pos_recall(r, [0])),
             ("mass", lambda r: r["mass_recall"]))
  focus = all("focus_true" in r for r in det)
  if focus:
    metrics += (("needle", lambda r: r["focus_hits"] / r["focus_true"] if r["focus_true"] else None),)
  k = det[0].get("k", 100)
  text = [f"{POSITION_MARK} ({mode}): recall@{k} / recall of the true top-{k} keys at prompt positions < 10% "
          "(the farthest from the decode queries) / attention-mass recall (softmax mass of the returned keys over "
          f"that of the true top-{k})" + (f" / recall of the true top-{k} keys inside the needle's token span"
                                          if focus else "") + ", at equal scanned fraction " + " / ".join(f"{100 * f:g}%" for f in fracs)
          + " (log-linear along the ef sweep; -: outside the curve)\n",
          "| layer | kind | " + " | ".join(f"{100 * f:g}% scanned" for f in fracs) + " |",
          "|---|---|" + "---|" * len(fracs)]
  layers = list(dict.fromkeys(r["layer"] for r in det))
  for layer in layers:
    for kind in present:
      rs = sorted((r for r in det if r["kind"] == kind and r["layer"] == layer), key=lambda r: _effort_key(r["effort"]))
      cells = []
      for f in fracs:
        vals = []
        for _, fn in metrics:
          pts = [(r["scanned_frac"], fn(r)) for r in rs if fn(r) is not None]
          v = recall_at(pts, f) if pts else None
          vals.append("-" if v is None else f"{v:.3f}")
        cells.append(" / ".join(vals))
      text.append(f"| {layer} | {kind} | " + " | ".join(cells) + " |")
  last = "all" if "all" in layers else layers[-1]
  rs = [r for r in det if r["layer"] == last]
  true = next(r["pos_true"] for r in rs)
  if focus:
    text += ["", "True top-100 keys inside the needle's span (summed over heads and queries), per layer: "
             + ", ".join(f"{layer}: {next(r['focus_true'] for r in det if r['layer'] == layer)}" for layer in layers)]
  text += ["", f"Layer {last}, per ef: recall of the true top-100 keys by prompt decile of the key's position "
           f"(decile 0 = the first 10% of the prompt; true keys per decile, summed over heads and queries: "
           f"{', '.join(map(str, true))})\n",
           "| kind | ef | scanned % | recall | mass | " + " | ".join(f"d{i}" for i in range(len(true)))
           + (" | needle" if focus else "") + " |",
           "|---|---|---|---|---|" + "---|" * (len(true) + focus)]
  for kind in present:
    for r in sorted((r for r in rs if r["kind"] == kind), key=lambda r: _effort_key(r["effort"])):
      dec = [pos_recall(r, [i]) for i in range(len(true))]
      text.append(f"| {kind} | {r['effort']} | {100 * r['scanned_frac']:.2f} | {r['recall']:.4f} | "
                  f"{r['mass_recall']:.4f} | " + " | ".join("-" if v is None else f"{v:.3f}" for v in dec)
                  + (f" | {r['focus_hits'] / r['focus_true']:.3f}" if focus and r["focus_true"] else
                     " | -" if focus else "") + " |")
  return "\n".join(text) + "\n"


def _effort_key(e):
  return -1 if e == "exact" else e


def summarize(curves, kinds):
  """Scanned fraction at recall 0.90 / 0.95 per (layer, kind, mode)."""
  keyed = {}
  for r in curves:
    keyed.setdefault((r["layer"], r["kind"], r["mode"]), []).append(r)
  out = []
  for (layer, kind, mode), rs in keyed.items():
    rs = sorted(rs, key=lambda r: _effort_key(r["effort"]))
    pts = [(r["scanned_frac"], r["recall"]) for r in rs]
    row = {"layer": layer, "kind": kind, "mode": mode}
    for t in TARGETS:
      s = scanned_at(pts, t)
      row[f"scan@{t:.2f}"] = None if s is None else round(s, 4)
    # The least effort (the smallest ef, or the fewest probes) already reaches the target: only a bound.
    row["at_least_effort"] = [t for t in TARGETS if pts[0][1] >= t]
    row["max_recall"] = max(r for _, r in pts)
    row["scan_at_max"] = max(s for s, _ in pts)
    row["build_s"] = rs[0]["build_s"]
    out.append(row)
  order = {k: i for i, k in enumerate(kinds)}
  out.sort(key=lambda r: (r["mode"] != "Q->K", r["layer"] == "all", str(r["layer"]).zfill(3),
                          order.get(r["kind"], 99)))
  return out


def recall_at(points, frac: float):
  """Recall of a curve [(scanned_frac, recall)] at `frac` scanned (log-linear interpolation); None outside it."""
  pts = sorted(points)
  for (s0, r0), (s1, r1) in zip(pts, pts[1:]):
    if s0 <= frac <= s1:
      return r0 if s1 == s0 else r0 + (r1 - r0) * np.log(frac / s0) / np.log(s1 / s0)
  return None


def equal_scan_markdown(curves, kinds, fracs=(0.05, 0.10, 0.20)) -> str:
  """Recall@k at equal scanned fractions, rows = (mode, layer), columns = kinds: the curves compared point for
  point (the summary's scan@0.90 / 0.95 says nothing where a curve never reaches the target)."""
  present = [k for k in kinds if k != "flat" and any(r["kind"] == k for r in curves)]
  text = ["**Recall@100 at equal scanned fraction** " + " / ".join(f"{100 * f:g}%" for f in fracs)
          + " (-: outside the curve's range)\n", "| mode | layer | " + " | ".join(present) + " |",
          "|---|---|" + "---|" * len(present)]
  for mode in ("Q->K", "K->K"):
    layers = list(dict.fromkeys(r["layer"] for r in curves if r["mode"] == mode))
    for layer in layers:
      cells = []
      for kind in present:
        pts = [(r["scanned_frac"], r["recall"]) for r in curves
               if r["kind"] == kind and r["mode"] == mode and r["layer"] == layer]
        vals = [recall_at(pts, f) if pts else None for f in fracs]
        cells.append(" / ".join("-" if v is None else f"{v:.2f}" for v in vals))
      text.append(f"| {mode} | {layer} | " + " | ".join(cells) + " |")
  return "\n".join(text) + "\n"


BUILD_MARK = "**Build cost per layer**"
REAL_FRACS = (0.03, 0.05, 0.10)  # equal-scan columns of a real-vector study


def build_cost(rows):
  """Per (layer, kind): indexes built, build seconds (sum and mean per index), index MB (sum), from per-head rows."""
  seen = {}
  for r in rows:  # a row per (index, mode, effort): one entry per index
    seen.setdefault((r["layer"], r["kind"], r["kv_head"], r["q_head"]), (r["build_s"], r.get("index_bytes", 0)))
  out = {}
  for (layer, kind, _, _), (b, nb) in seen.items():
    e = out.setdefault((layer, kind), {"layer": layer, "kind": kind, "indexes": 0, "build_s": 0.0, "index_mb": 0.0})
    e["indexes"] += 1
    e["build_s"] += b
    e["index_mb"] += nb / 2**20
  res = list(out.values())
  for e in res:
    e["build_s_per_index"] = round(e["build_s"] / e["indexes"], 2)
    e["build_s"], e["index_mb"] = round(e["build_s"], 2), round(e["index_mb"], 2)
  return res


def build_markdown(rows, kinds, threads) -> str:
  """Table: rows = layers, columns = kinds, cells 'build s per layer (indexes x s each), index MB per layer'."""
  cost = build_cost(rows)
  present = [k for k in kinds if k != "flat" and any(e["kind"] == k for e in cost)]
  layers = list(dict.fromkeys(e["layer"] for e in cost))
  text = [f"{BUILD_MARK} (threads={threads}): build seconds for all the layer's indexes (indexes × mean s each); "
          "index structure MB (keys not counted, they are shared)\n", "| layer | " + " | ".join(present) + " |",
          "|---|" + "---|" * len(present)]
  for layer in layers:
    cells = []
    for kind in present:
      e = next((e for e in cost if e["layer"] == layer and e["kind"] == kind), None)
      cells.append("" if e is None else f"{e['build_s']:.1f} s ({e['indexes']} × {e['build_s_per_index']:.2f}), "
                   f"{e['index_mb']:.1f} MB")
    text.append(f"| {layer} | " + " | ".join(cells) + " |")
  return "\n".join(text) + "\n"


def summary_markdown(summary, kinds) -> str:
  """Two tables (Q->K, K->K): rows = layers, columns = kinds, cells 'scan@0.90 / scan@0.95' in %."""
  def cell(r):
    if r is None:
      return ""
    def pct(t):
      v = r[f"scan@{t:.2f}"]
      if v is None:
        return f">{100 * r['scan_at_max']:.0f}"
      return ("≤" if t in r["at_least_effort"] else "") + f"{100 * v:.1f}"
    return " / ".join(pct(t) for t in TARGETS)

  text = []
  for mode in ("Q->K", "K->K"):
    rs = [r for r in summary if r["mode"] == mode]
    layers = list(dict.fromkeys(r["layer"] for r in rs))
    present = [k for k in kinds if any(r["kind"] == k for r in rs) and k != "flat"]
    text.append(f"**{mode}**: % of indexed keys scanned for mean recall (of the true top-k) 0.90 / 0.95 "
                f"(>x: never reached, x = most scanned; ≤x: the least effort, smallest ef or fewest probes, already "
                f"reaches it)\n")
    text.append("| layer | " + " | ".join(present) + " |")
    text.append("|---|" + "---|" * len(present))
    for layer in layers:
      cells = [cell(next((r for r in rs if r["layer"] == layer and r["kind"] == k), None)) for k in present]
      text.append(f"| {layer} | " + " | ".join(cells) + " |")
    text.append("")
  return "\n".join(text)


def plot(curves, kinds, path, title):
  """recall vs scanned fraction; rows Q->K / K->K, one column per layer (and 'all')."""
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
  except ImportError:
    print("matplotlib not installed (bench extra): no plot", flush=True)
    return None
  layers = list(dict.fromkeys(r["layer"] for r in curves))
  fig, axes = plt.subplots(2, len(layers), figsize=(3.2 * len(layers), 6.2), squeeze=False, sharey=True)
  shown = [x for x in kinds if x != "flat"]
  cmap = plt.get_cmap("tab10" if len(shown) <= 10 else "tab20")
  # kvjax's own kinds solid; outside references (--peers) dashed (faiss) or dotted (hnswlib).
  style = {x: {"color": cmap(i % cmap.N), "ls": "--" if x.startswith("faiss") else ":" if x.startswith("hnswlib")
               else "-"} for i, x in enumerate(shown)}
  for i, mode in enumerate(("Q->K", "K->K")):
    for j, layer in enumerate(layers):
      ax = axes[i][j]
      for kind in kinds:
        if kind == "flat":
          continue
        rs = sorted((r for r in curves if r["layer"] == layer and r["kind"] == kind and r["mode"] == mode),
                    key=lambda r: _effort_key(r["effort"]))
        if rs:
          ax.plot([r["scanned_frac"] for r in rs], [r["recall"] for r in rs], marker=".", ms=3, label=kind,
                  **style[kind])
      ax.set_xscale("log")
      ax.set_xlim(0.01, 1.05)
      ax.set_xticks([0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0], ["1%", "2%", "5%", "10%", "20%", "50%", "100%"],
                    fontsize=7)
      ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
      ax.axhline(0.95, color="grey", lw=0.5, ls="--")
      ax.set_ylim(0.4, 1.01)
      ax.set_title(f"{mode} layer {layer}", fontsize=9)
      if i == 1:
        ax.set_xlabel("scanned fraction")
      if j == 0:
        ax.set_ylabel(f"recall@{curves[0].get('k', 100)}")
  axes[0][0].legend(fontsize=7)
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=90, bbox_inches="tight")  # a long title is not cut off
  plt.close(fig)
  return path


def default_layers(cfg_windows, n_layers):
  glob = [i for i, w in enumerate(cfg_windows) if w == 0]
  if len(glob) < n_layers:
    return glob
  return sorted(set(range(0, n_layers, 4)) | {n_layers - 1})


def run_real(model_name, *, n, decode_steps, text, layers, sinks, window, kinds, k_top, efs, nprobe_fracs,
             train_queries, train_topk, kk_queries, seed, cache_dir, name, out_dir, make_plot, threads=None,
             model=None, log=print, hub_variants=()):
  """The whole real-vector study; returns (curve rows, summary rows, notes)."""
  for v in hub_variants:
    parse_hub_variant(v)
  from experiments.results_io import write_results, write_text_atomic

  t0 = time.perf_counter()
  data = load_or_capture(model_name, n, decode_steps=decode_steps, text=text, seed=seed, cache_dir=cache_dir,
                         model=model)
  capture_s = time.perf_counter() - t0
  meta = data["meta"]
  q, k = data["q"], data["k"]
  L = q.shape[0]
  if not layers:
    layers = default_layers(meta["layer_windows"], L)
  bad = [x for x in layers if not 0 <= x < L]
  if bad:
    raise ValueError(f"layers {bad} outside [0, {L})")
  log(f"vectors: q {q.shape} k {k.shape}, {'cache ' + meta['from_cache'] if meta['from_cache'] else 'captured'} "
      f"in {capture_s:.1f} s; layers {layers}")
  t1 = time.perf_counter()
  rows = []
  for layer in layers:
    tl = time.perf_counter()
    rows += layer_study(q, k, layer, n=n, sinks=sinks, window=window, decode_steps=decode_steps, kinds=kinds,
                        k_top=k_top, efs=efs, nprobe_fracs=nprobe_fracs, train_queries=train_queries,
                        train_topk=train_topk, kk_queries=kk_queries, seed=seed, threads=threads,
                        log=lambda s: None, hub_variants=hub_variants, scale=meta.get("attn_scale"),
                        focus=meta.get("needle_span"))
    log(f"layer {layer}: {time.perf_counter() - tl:.1f} s")
  study_s = time.perf_counter() - t1
  kinds = list(kinds) + [f"{x}:{v}" for x in kinds if parse_kind(x)[0] == "roar" for v in hub_variants]
  curves = aggregate(rows)
  summary = summarize(curves, kinds)
  piv = [r for r in rows if r["kind"] == "roar" and r["mode"] == "Q->K"]
  piv_by_layer = {}
  for r in piv:
    piv_by_layer.setdefault(r["layer"], {})[r["q_head"]] = (r["pivot_keys_frac"], r["top_pivot_share"],
                                                             r["top_pivot_pos"])
  piv_lines = [f"layer {layer}: pivot keys {100 * min(v[0] for v in hs.values()):.0f}–"
               f"{100 * max(v[0] for v in hs.values()):.0f}% of indexed keys; top pivot takes "
               f"{100 * min(v[1] for v in hs.values()):.0f}–{100 * max(v[1] for v in hs.values()):.0f}% "
               f"of training queries"
               for layer, hs in sorted(piv_by_layer.items())]
  n_idx = n - window - sinks
  notes = (
      f"Real vectors: {meta['model']} ({meta['source']}), prompt N = {n} tokens of `{text}` text, then "
      f"{decode_steps} greedy decode steps; post-RoPE q/k captured in one run "
      f"(prefill {meta['capture_s']['prefill']} s, decode {meta['capture_s']['decode']} s on this machine"
      f"{', reused from ' + meta['from_cache'] if meta['from_cache'] else ''}). Index per head: keys at "
      f"[{sinks}, {n - window}) = {n_idx} keys (float16); Q->K queries: the {decode_steps} decode-step "
      f"queries of every query head; K->K: {kk_queries} indexed keys per KV head. roar: training queries = "
      f"prompt queries with stride {train_stride(n, train_queries)}, exact top-{train_topk} over the indexed "
      f"keys (no causal mask), one index per query head"
      + (" (`_kv` kinds: one per KV head, trained on the group's training rows interleaved in prompt order, "
         "searched by every query head of the group)" if any(kv_shared(x) for x in kinds) else "")
      + f". recall@{k_top}; scanned = distance computations / "
      f"indexed keys (IVF centroids included). Study time {study_s:.0f} s for {len(layers)} layers.\n\n"
      f"Generated continuation: {json.dumps(meta['generated'])[:300]}\n\n"
      + summary_markdown(summary, kinds) + "\n" + equal_scan_markdown(curves, kinds, REAL_FRACS) + "\n"
      + ("Pivot concentration (roar training queries' nearest indexed key):\n\n"
         + "\n".join(f"- {s}" for s in piv_lines) + "\n" if piv_lines else "")
      + "\n" + build_markdown(rows, kinds, threads)
      + ("\n" + position_markdown(curves, kinds, REAL_FRACS) if any("pos_true" in r for r in curves) else "")
      + ("\nHub variants (`<kind>:<variant>`): the same built index searched again with other hub seeds "
         "(see `study_hubs`); " + ", ".join(hub_variants) + ".\n" if hub_variants else "")
      + "\nRows below: curves, mean over the heads of each layer (layer 'all' = mean over layers; pos_hits / "
      "pos_true: true top-k keys found / present per prompt decile, summed over heads and layers).\n")
  if not name:
    name = f"recall_{re.sub(r'[^a-z0-9]+', '', model_name.lower())}_{n // 1024}k"
  doc = write_results(name, curves, out_dir=out_dir or None, notes=notes)
  doc["summary"] = summary
  doc["per_head_rows"] = rows
  doc["meta"] = {key: v for key, v in meta.items() if key != "from_cache"} | {"study_s": round(study_s, 1)}
  doc["build"] = build_cost(rows)
  directory = pathlib.Path(out_dir) if out_dir else pathlib.Path(__file__).resolve().parent / "results"
  write_text_atomic(directory / f"{name}.json", json_text(doc))
  if make_plot:
    plot(curves, kinds, directory / f"{name}.png",
         f"{meta['model']}, N={n} ({n_idx} indexed keys/head), recall@{k_top} vs scanned fraction")
  return curves, summary, notes


def json_text(doc) -> str:
  """json.dumps(doc, indent=1), with lists of integers (the position counts) kept on one line."""
  text = json.dumps(doc, indent=1)
  return re.sub(r"\[\n\s*(-?\d+(?:,\n\s*-?\d+)*)\n\s*\]",
                lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]", text) + "\n"


def rerender(path, *, make_plot=True):
  """Remakes the summary, markdown and plot of a results JSON from its curve rows (no search)."""
  from experiments.results_io import markdown_table, write_text_atomic

  path = pathlib.Path(path)
  doc = json.loads(path.read_text())
  own = doc["rows"]
  curves = doc.get("kvjax_rows", []) + own  # a --peers file: kvjax's curves beside the outside ones
  kinds = doc.get("meta", {}).get("kinds") or list(dict.fromkeys(r["kind"] for r in curves))
  doc["summary"] = summarize(curves, kinds)
  notes = doc.get("notes", "")
  head, sep, _ = notes.partition("**Q->K**")
  tail = next(notes[notes.find(mark):] for mark in ("Pivot concentration", BUILD_MARK, "\nRows below")
              if mark in notes)
  if sep:
    tables = summary_markdown(doc["summary"], kinds) + "\n"
    if "kvjax_rows" in doc:
      tables += equal_scan_markdown(curves, kinds)
    elif "**Recall@100 at equal scanned fraction**" in notes:
      tables += equal_scan_markdown(curves, kinds, REAL_FRACS) + "\n"
    doc["notes"] = notes = head + tables + tail
  write_text_atomic(path, json.dumps(doc, indent=1) + "\n")
  header = f"# {path.stem}\n\n" + "".join(f"- {k}: `{doc[k]}`\n" for k in ("device", "jax", "commit", "date",
                                                                          "command"))
  write_text_atomic(path.with_suffix(".md"), header + f"\n{notes}\n\n" + markdown_table(own))
  if make_plot:
    m = doc.get("meta", {})
    plot(curves, kinds, path.with_suffix(".png"),
         f"{m.get('model', '?')}, N={m.get('n', '?')} ({curves[0]['n_keys']} indexed keys/head), "
         f"recall@{curves[0].get('k', 100)} vs scanned fraction" + (": kvjax vs faiss / hnswlib" if "kvjax_rows" in doc else ""))
  return doc


# ------------------------------------------------------------------ outside references (bench extra)
# faiss-cpu and hnswlib, imported only when --peers is given. Kinds:
#   faiss_hnsw<M>_ip / _l2   IndexHNSWFlat, inner-product or L2 metric (build and search), efConstruction 200
#   faiss_hnsw<M>_l2ip       the _l2 index searched by inner product (its storage's metric switched after
#                            the build): an L2-built HNSW searched as kvjax's `graph` searches
#   faiss_ivf<nlist>_ip      IndexIVFFlat, inner product, IndexFlatIP quantizer (faiss's k-means then
#                            assigns by inner product)
#   hnswlib_ip / _l2 / _l2ip hnswlib M 16, ef_construction 200; _l2ip: the l2 graph searched by inner product
# scanned: faiss HNSW -- faiss.cvar.hnsw_stats.ndis per query batch (upper-level greedy steps included, which
# may re-count a node); faiss IVF -- nlist centroids + the sizes of the nprobe lists the quantizer picks for each
# query; hnswlib has no counter in its Python binding, so its saved graph is read back and its search
# (searchKnn: greedy descent, then searchBaseLayerST) replayed in NumPy, counting distinct distance
# computations; recall is hnswlib's own knn_query's, and the replay's agreement with it is recorded.
PEER_EFS_DEFAULT = [100, 120, 150, 200, 250, 300, 400, 500, 650, 800, 1000, 1300, 1600, 2000]


def parse_peer(kind: str) -> tuple[str, dict]:
  m = re.fullmatch(r"faiss_hnsw(\d+)_(ip|l2|l2ip)", kind)
  if m:
    return "faiss_hnsw", {"M": int(m.group(1)), "metric": m.group(2)}
  m = re.fullmatch(r"faiss_ivf(\d+)_ip", kind)
  if m:
    return "faiss_ivf", {"nlist": int(m.group(1))}
  m = re.fullmatch(r"hnswlib(\d*)_(ip|l2|l2ip)", kind)
  if m:
    return "hnswlib", {"M": int(m.group(1) or 16), "metric": m.group(2)}
  raise ValueError(f"unknown peer {kind!r}: faiss_hnsw<M>_(ip|l2|l2ip) | faiss_ivf<nlist>_ip | "
                   f"hnswlib[<M>]_(ip|l2|l2ip)")


def _hnswlib_graph(index, n: int):
  """hnswlib's graph (entry point, per-node level-0 and upper-level links) from its saved file."""
  import tempfile

  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "g.bin")
    index.save_index(path)
    buf = pathlib.Path(path).read_bytes()
  hdr = np.frombuffer(buf, np.uint64, 6, 0)  # offsetLevel0, max_elements, count, size/elem, label_off, data_off
  _, _, count, size_elem, _, off_data = (int(x) for x in hdr)
  maxlevel, enter = np.frombuffer(buf, np.int32, 1, 48)[0], np.frombuffer(buf, np.uint32, 1, 52)[0]
  max_m, max_m0 = (int(x) for x in np.frombuffer(buf, np.uint64, 2, 56))
  pos = 56 + 8 * 3 + 8 + 8  # maxM_, maxM0_, M_, mult_, ef_construction_
  assert count == n, (count, n)
  lvl0 = np.frombuffer(buf, np.uint8, count * size_elem, pos).reshape(count, size_elem)
  pos += count * size_elem
  cnt0 = lvl0[:, :4].copy().view(np.uint32)[:, 0] & 0xFFFF
  links0 = lvl0[:, 4:4 + 4 * max_m0].copy().view(np.uint32).astype(np.int64)
  assert off_data == 4 + 4 * max_m0
  nbrs0 = [links0[i, :cnt0[i]] for i in range(count)]
  upper = {}  # node -> [links at level 1, 2, ...]
  per = 4 + 4 * max_m
  for i in range(count):
    size = int(np.frombuffer(buf, np.uint32, 1, pos)[0])
    pos += 4
    if size:
      lv = []
      for j in range(size // per):
        c = int(np.frombuffer(buf, np.uint32, 1, pos + j * per)[0]) & 0xFFFF
        lv.append(np.frombuffer(buf, np.uint32, c, pos + j * per + 4).astype(np.int64))
      upper[i] = lv
      pos += size
  return {"enter": int(enter), "maxlevel": int(maxlevel), "nbrs0": nbrs0, "upper": upper}


def _replay_search(graph, keys32, sqn, x, ef: int, metric: str):
  """hnswlib's searchKnn on its graph, distances in NumPy; (ids best first, distinct distance computations)."""
  import heapq

  xx = float(x @ x)

  def dist(ids):  # hnswlib's distances: squared L2, or 1 - inner product
    return sqn[ids] - 2.0 * (keys32[ids] @ x) + xx if metric == "l2" else 1.0 - keys32[ids] @ x

  seen = set()
  cur = graph["enter"]
  cur_d = float(dist(np.asarray([cur]))[0])
  seen.add(cur)
  for level in range(graph["maxlevel"], 0, -1):
    changed = True
    while changed:
      changed = False
      nb = graph["upper"][cur][level - 1]
      if len(nb):
        d = dist(nb)
        seen.update(nb.tolist())
        j = int(np.argmin(d))
        if d[j] < cur_d:
          cur_d, cur, changed = float(d[j]), int(nb[j]), True
  visited = {cur}
  top = [(-cur_d, cur)]  # max-heap of results by distance
  cand = [(cur_d, cur)]
  lower = cur_d
  while cand:
    cd, c = heapq.heappop(cand)
    if cd > lower:
      break
    nb = [v for v in graph["nbrs0"][c].tolist() if v not in visited]
    if not nb:
      continue
    visited.update(nb)
    d = dist(np.asarray(nb)).tolist()
    for v, dv in zip(nb, d):
      if len(top) < ef or lower > dv:
        heapq.heappush(cand, (dv, v))
        heapq.heappush(top, (-dv, v))
        if len(top) > ef:
          heapq.heappop(top)
        lower = -top[0][0]
  ids = [v for _, v in sorted(((-nd, v) for nd, v in top))]
  return np.asarray(ids, np.int64), len(visited | seen)


def _peer_curves(kind, keys, query_sets, truths, n, *, k, efs, nprobe_fracs, threads, replay_queries, cache):
  """Rows (mode, effort, recall, scanned_frac, queries, build_s, ...) of one outside index over its query sets.

  `cache` (a dict per head) lets the _l2 and _l2ip kinds share one build."""
  base, p = parse_peer(kind)
  keys32 = np.ascontiguousarray(keys, np.float32)
  dim = keys32.shape[1]
  rows = []
  t0 = time.perf_counter()
  if base == "faiss_hnsw":
    import faiss

    faiss.omp_set_num_threads(threads or os.cpu_count())
    build_metric = "ip" if p["metric"] == "ip" else "l2"
    key = ("faiss_hnsw", p["M"], build_metric)
    if key in cache and not (p["metric"] == "l2" and cache[key][0].metric_type != faiss.METRIC_L2):
      index, build_s = cache[key]
    else:
      index = faiss.IndexHNSWFlat(dim, p["M"], faiss.METRIC_INNER_PRODUCT if build_metric == "ip" else
                                  faiss.METRIC_L2)
      index.hnsw.efConstruction = 200
      index.add(keys32)
      build_s = time.perf_counter() - t0
      cache[key] = (index, build_s)
    if p["metric"] == "l2ip":  # search the L2-built graph by inner product (faiss 1.15: three switches)
      index.metric_type = faiss.METRIC_INNER_PRODUCT
      index.storage.metric_type = faiss.METRIC_INNER_PRODUCT
      index.hnsw.is_similarity = True
    for ef in [e for e in efs if e >= k]:
      for mode, qs in query_sets.items():
        faiss.cvar.hnsw_stats.reset()
        _, ids = index.search(np.ascontiguousarray(qs, np.float32), k,
                              params=faiss.SearchParametersHNSW(efSearch=ef))
        ndis = faiss.cvar.hnsw_stats.ndis
        rows.append({"mode": mode, "effort": ef, "recall": float(recall_matrix(ids, truths[mode], n).mean()),
                     "scanned_frac": ndis / len(qs) / n, "queries": len(qs), "build_s": round(build_s, 3)})
  elif base == "faiss_ivf":
    import faiss

    faiss.omp_set_num_threads(threads or os.cpu_count())
    nlist = p["nlist"]
    quantizer = faiss.IndexFlatIP(dim)
    index = faiss.IndexIVFFlat(quantizer, dim, nlist, faiss.METRIC_INNER_PRODUCT)
    index.train(keys32)
    index.add(keys32)
    build_s = time.perf_counter() - t0
    sizes = np.asarray([index.invlists.list_size(i) for i in range(nlist)], np.int64)
    for nprobe in sorted({max(1, min(nlist, round(f * nlist))) for f in nprobe_fracs}):
      index.nprobe = nprobe
      for mode, qs in query_sets.items():
        qs32 = np.ascontiguousarray(qs, np.float32)
        _, ids = index.search(qs32, k)
        _, lists = quantizer.search(qs32, nprobe)
        scanned = nlist + np.where(lists >= 0, sizes[np.maximum(lists, 0)], 0).sum(1)
        rows.append({"mode": mode, "effort": nprobe, "recall": float(recall_matrix(ids, truths[mode], n).mean()),
                     "scanned_frac": float(scanned.mean()) / n, "queries": len(qs), "build_s": round(build_s, 3)})
  else:
    import hnswlib

    key = ("hnswlib", p["M"], "ip" if p["metric"] == "ip" else "l2")
    if key in cache:
      index, build_s, graph = cache[key]
    else:
      index = hnswlib.Index(space=key[2], dim=dim)
      index.init_index(max_elements=n, M=p["M"], ef_construction=200, random_seed=100)
      index.set_num_threads(threads or os.cpu_count())
      index.add_items(keys32, np.arange(n))
      build_s = time.perf_counter() - t0
      graph = _hnswlib_graph(index, n)
      cache[key] = (index, build_s, graph)
    sqn = (keys32 * keys32).sum(1)
    search_metric = "ip" if p["metric"] in ("ip", "l2ip") else "l2"
    for ef in [e for e in efs if e >= k]:
      index.set_ef(ef)
      for mode, qs in query_sets.items():
        qs32 = np.ascontiguousarray(qs, np.float32)
        sub = np.arange(len(qs32)) if replay_queries <= 0 else np.unique(
            np.linspace(0, len(qs32) - 1, min(replay_queries, len(qs32))).astype(int))
        rep = [_replay_search(graph, keys32, sqn, qs32[i], ef, search_metric) for i in sub]
        rep_ids = np.full((len(sub), k), -1, np.int64)
        for j, (ids_j, _) in enumerate(rep):
          rep_ids[j, :min(k, len(ids_j))] = ids_j[:k]
        scanned = np.asarray([s for _, s in rep], float)
        rep_recall = recall_matrix(rep_ids, truths[mode][sub], n)
        row = {"mode": mode, "effort": ef, "scanned_frac": float(scanned.mean()) / n, "queries": len(qs),
               "build_s": round(build_s, 3), "replayed_queries": len(sub)}
        if p["metric"] == "l2ip":  # hnswlib cannot search an l2 graph by inner product: the replay is the result
          row["recall"] = float(rep_recall.mean())
        else:
          ids, _ = index.knn_query(qs32, k=k)
          ids = ids.astype(np.int64)
          row["recall"] = float(recall_matrix(ids, truths[mode], n).mean())
          same = [len(set(ids[i].tolist()) & set(rep_ids[j].tolist())) / k for j, i in enumerate(sub)]
          row["replay_agree"] = round(float(np.mean(same)), 4)
          row["replay_recall"] = round(float(rep_recall.mean()), 4)
        rows.append(row)
  return rows


def peer_layer_study(q, k, layer, *, n, sinks, window, decode_steps, peers, k_top, efs, nprobe_fracs, kk_queries,
                     seed, threads=None, replay_queries=0, log=print):
  """Per-head rows for the outside indexes: same indexed keys, queries (the K->K sample drawn exactly as
  layer_study draws it) and exact top-k as kvjax's own curves. One index per KV head."""
  lo, hi_ = sinks, n - window
  Hq, Hkv = q.shape[1], k.shape[1]
  group = Hq // Hkv
  rng = np.random.default_rng(seed + layer)
  rows = []
  for g in range(Hkv):
    keys = np.ascontiguousarray(k[layer, g, lo:hi_])
    n_idx = len(keys)
    kk = keys[rng.choice(n_idx, min(kk_queries, n_idx), replace=False)].astype(np.float32)
    heads = range(g * group, (g + 1) * group)
    dec = np.concatenate([q[layer, h, n:n + decode_steps].astype(np.float32) for h in heads])
    qs = {"Q->K": dec, "K->K": kk}
    tr = {"Q->K": exact_topk_np(dec, keys, k_top), "K->K": exact_topk_np(kk, keys, k_top)}
    cache = {}
    for kind in sorted(peers, key=lambda x: x.endswith("_l2ip")):  # plain l2 before its metric is switched
      t0 = time.perf_counter()
      for r in _peer_curves(kind, keys, qs, tr, n_idx, k=k_top, efs=efs, nprobe_fracs=nprobe_fracs,
                            threads=threads, replay_queries=replay_queries, cache=cache):
        rows.append({"layer": layer, "kv_head": g, "q_head": "group", "kind": kind, "n_keys": n_idx, **r})
      log(f"layer {layer} kv_head {g} {kind}: {time.perf_counter() - t0:.1f} s")
  return rows


def run_peers(model_name, *, n, decode_steps, text, layers, sinks, window, peers, compare, compare_kinds, k_top,
              efs, nprobe_fracs, kk_queries, seed, cache_dir, name, out_dir, make_plot, threads=None,
              replay_queries=0, log=print):
  """Outside-reference curves on cached real vectors, set beside kvjax's own from `compare` (a recall JSON)."""
  from experiments.results_io import write_results, write_text_atomic

  data = load_or_capture(model_name, n, decode_steps=decode_steps, text=text, seed=seed, cache_dir=cache_dir)
  meta = data["meta"]
  q, k = data["q"], data["k"]
  ref = json.loads(pathlib.Path(compare).read_text()) if compare else {"rows": []}
  if not layers:
    layers = sorted({r["layer"] for r in ref["rows"] if r["layer"] != "all"}) or default_layers(
        meta["layer_windows"], q.shape[0])
  t1 = time.perf_counter()
  rows = []
  for layer in layers:
    rows += peer_layer_study(q, k, layer, n=n, sinks=sinks, window=window, decode_steps=decode_steps, peers=peers,
                             k_top=k_top, efs=efs, nprobe_fracs=nprobe_fracs, kk_queries=kk_queries, seed=seed,
                             threads=threads, replay_queries=replay_queries, log=log)
  study_s = time.perf_counter() - t1
  del q, k, data
  curves = aggregate(rows)
  n_idx = n - window - sinks
  own = [r for r in ref["rows"] if r["kind"] in compare_kinds and r["layer"] in set(layers) | {"all"}]
  if own and own[0]["n_keys"] != n_idx:
    raise ValueError(f"{compare} indexed {own[0]['n_keys']} keys per head, this run {n_idx}")
  kinds = list(compare_kinds) + list(peers)
  both = own + curves
  summary = summarize(both, kinds)
  agree = [r["replay_agree"] for r in rows if "replay_agree" in r]
  notes = (
      f"Outside references on the same real vectors as `{pathlib.Path(compare).name if compare else '-'}`: "
      f"{meta['model']}, N = {n}, layers {layers}, keys [{sinks}, {n - window}) = {n_idx} per KV head (float16 "
      f"stored, float32 to the peers), Q->K = the {decode_steps} decode-step queries of every query head of the "
      f"group, K->K = the same {kk_queries} sampled keys per KV head, truth = exact top-{k_top} by inner product. "
      f"kvjax columns ({', '.join(compare_kinds)}) are copied from that file's curves, not rerun.\n\n"
      "Peers: `faiss_hnsw<M>_ip|_l2` = faiss IndexHNSWFlat (efConstruction 200) built and searched with that "
      "metric; `_l2ip` = the same L2-built index searched by inner product (storage metric switched after the "
      "build), i.e. the setup of kvjax `graph`; `faiss_ivf<nlist>_ip` = IndexIVFFlat with an IndexFlatIP "
      "quantizer. `hnswlib_ip|_l2` (M 16, ef_construction 200): recall from hnswlib's knn_query; hnswlib has no "
      "distance counter in Python, so scanned comes from replaying its searchKnn on its saved graph in NumPy "
      "(distinct distance computations"
      + (f", on {replay_queries} evenly spaced queries per mode and head" if replay_queries > 0 else "")
      + (f"; replayed top-{k_top} ids agree with knn_query's on {100 * min(agree):.1f}–{100 * max(agree):.1f}%"
         if agree else "")
      + "); `hnswlib_l2ip` = hnswlib's l2 graph searched by inner product, replay only. faiss HNSW scanned = "
      "hnsw_stats.ndis per query (upper-level greedy steps included); faiss IVF scanned = nlist centroids + "
      "sizes of the probed lists. Efforts: ef " + ",".join(map(str, efs)) + "; IVF nprobe = "
      + ",".join(nprobe_fracs_str(nprobe_fracs)) + " of nlist. "
      f"Peer study time {study_s:.0f} s (threads={threads}).\n\n"
      + summary_markdown(summary, kinds) + "\n" + equal_scan_markdown(both, kinds)
      + "\nRows below: peer curves, mean over the KV heads of each layer (layer 'all' = mean over layers).\n")
  if not name:
    name = f"recall_peers_{re.sub(r'[^a-z0-9]+', '', model_name.lower())}_{n // 1024}k"
  doc = write_results(name, curves, out_dir=out_dir or None, notes=notes)
  doc["summary"] = summary
  doc["kvjax_rows"] = own
  doc["per_head_rows"] = rows
  doc["meta"] = {key: v for key, v in meta.items() if key != "from_cache"} | {
      "study_s": round(study_s, 1), "compare": str(compare), "layers": layers, "kinds": kinds}
  directory = pathlib.Path(out_dir) if out_dir else pathlib.Path(__file__).resolve().parent / "results"
  write_text_atomic(directory / f"{name}.json", json.dumps(doc, indent=1) + "\n")
  if make_plot:
    plot(both, kinds, directory / f"{name}.png",
         f"{meta['model']}, N={n} ({n_idx} keys/head): kvjax vs faiss / hnswlib, recall@{k_top}")
  return curves, summary, notes


def nprobe_fracs_str(fracs):
  return [f"{f:g}" for f in fracs]


def main(argv):
  del argv
  if _RERENDER.value:
    print(rerender(_RERENDER.value, make_plot=_PLOT.value)["notes"])
    return
  efs = [int(e) for e in _EFS.value]
  if _PEERS.value:
    if not _MODEL.value:
      raise app.UsageError("--peers needs --model (cached real vectors)")
    for kind in _PEERS.value:
      parse_peer(kind)
    _, _, notes = run_peers(
        _MODEL.value, n=_CONTEXT.value, decode_steps=_STEPS.value, text=_TEXT.value,
        layers=[int(x) for x in _LAYERS.value], sinks=_SINKS.value, window=_WINDOW.value, peers=_PEERS.value,
        compare=_PEERS_CMP.value, compare_kinds=_PEERS_CMP_KINDS.value, k_top=_K.value, efs=efs,
        nprobe_fracs=[float(f) for f in _NPROBE_FRACS.value], kk_queries=_KK_Q.value, seed=_SEED.value,
        cache_dir=_CACHE.value, name=_NAME.value, out_dir=_OUT.value, make_plot=_PLOT.value,
        threads=_THREADS.value, replay_queries=_REPLAY_Q.value)
    print(notes)
    return
  if _MODEL.value:
    if _DATA.value != "synthetic":
      raise app.UsageError("give --model or --data, not both")
    for kind in _KINDS.value:
      parse_kind(kind)
    layers = [int(x) for x in _LAYERS.value]
    text = f"needle{_NEEDLE_DEPTH.value:g}" if _TEXT.value == "needle" else _TEXT.value
    _, summary, notes = run_real(
        _MODEL.value, n=_CONTEXT.value, decode_steps=_STEPS.value, text=text, layers=layers,
        sinks=_SINKS.value, window=_WINDOW.value, kinds=_KINDS.value, k_top=_K.value, efs=efs,
        nprobe_fracs=[float(f) for f in _NPROBE_FRACS.value], train_queries=_TRAIN_Q.value,
        train_topk=_TRAIN_K.value, kk_queries=_KK_Q.value, seed=_SEED.value, cache_dir=_CACHE.value,
        name=_NAME.value, out_dir=_OUT.value, make_plot=_PLOT.value, threads=_THREADS.value,
        hub_variants=_HUBS.value)
    print(notes)
    return
  if _DATA.value != "synthetic":
    raise app.UsageError(f"--data={_DATA.value}: only 'synthetic' (real vectors: --model=...)")
  n, d = _N.value, _D.value
  keys = synthetic.clustered(n, d, seed=_SEED.value)
  decode = synthetic.clustered(_Q.value, d, seed=_SEED.value + 1, shift=0.5, spread=1.5)
  train = synthetic.clustered(_M.value, d, seed=_SEED.value + 2, shift=0.5, spread=1.5)
  kq = keys[np.random.default_rng(_SEED.value).choice(n, _Q.value, replace=False)]
  nprobes = sorted({max(1, round(float(f) * 4 * np.sqrt(n))) for f in _NPROBE_FRACS.value})
  rows = []
  for mode, qs in (("Q->K", decode), ("K->K", kq)):
    rows += recall_rows(keys.astype(np.float16), qs, k=_K.value, kinds=[x for x in _KINDS.value if x != "flat"],
                        efs=efs, nprobes=nprobes, train_queries=train, mode=mode, label="synthetic")
  from experiments.results_io import write_results, write_text_atomic

  write_results(_NAME.value or "recall_synthetic", rows, out_dir=_OUT.value or None,
                notes="Synthetic clustered vectors (host_index.synthetic): says nothing about real models.")


if __name__ == "__main__":
  app.run(main)
