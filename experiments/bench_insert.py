"""What indexing a token that leaves the window costs, and what a cheaper insert loses.

    python experiments/bench_insert.py --model=smollm2 --context_len=8128

Retrieval decode inserts every token leaving the device window into its (seq, layer, head)
index, in the background (`HostContext.index_stored`). At 128K SmolLM2 shapes that work was
5.0-5.8 ms a step on 8 of the H200 host's cores (90 indexes, one token each), longer than the
whole dense step, and the next exchange waits for it
(experiments/results/bench_scale_smollm2shapes_synthetic_128k_sources8.md). An insert is two
beam searches of `ef_insert` candidates (the key by the build metric, roar: also the token's
own query by inner product) and the reverse links; `ef_insert` 0 means the build's list
(roar L 100, graph ef_construction 200).

For each layer and KV head of a real capture (experiments/recall.py's, cached), this builds the
index as kvjax's prefill does (roar per KV head: trained on its group's prompt queries, with each
key's nearest keys as connect candidates) over the keys [sinks, N - window - inserts), then
inserts the last `--inserts` keys before the window one at a time with their group-mean query,
as decode does, once per `--ef_inserts` value, on one thread (decode runs one insert per index
per core). Rows: median microseconds per insert; and for the decode queries (the capture's
generated steps) searched at the decode ef, recall@k over all the keys, the recall of the true
top-k keys that were inserted, and the share of the true top-k that were inserted. Reference
rows: the index built over every key at once (`ef_insert` "rebuilt"), and the keys left out of
the index (`ef_insert` "absent": what a token that is never indexed costs).
"""

from __future__ import annotations

import time

import numpy as np
from absl import app, flags

import host_index as hi
import recall
import results_io

# recall.py's flags serve here too: --model (default here smollm2), --context_len, --decode_steps, --layers
# (default here 3, 15, 27), --sinks, --window, --k, --threads (build and search; inserts run on one),
# --cache_dir, --out_dir, --name (default here bench_insert).
flags.DEFINE_integer("inserts", 1024, "Keys indexed by insertion, the last ones before the window.")
flags.DEFINE_enum("index_kind", "roar", ["roar", "graph"], "Index kind (roar: one index per KV head, kvjax's default).")
flags.DEFINE_list("ef_inserts", ["100", "64", "32", "16"], "Insert candidate lists (0: the build's).")
flags.DEFINE_integer("search_ef", 0, "Search ef (0: kvjax's default, max(64, k)).")
DEFAULT_MODEL, DEFAULT_LAYERS = "smollm2", ["3", "15", "27"]
FLAGS = flags.FLAGS


def new_context(keys, q, layer: int, build_end: int, ef_insert) -> hi.HostContext:
  """A one-layer HostContext holding `keys` [Hkv, n, D] (float16, as the store keeps a capture), built
  as kvjax's retrieval prefill builds it over the first `build_end` of them: roar per KV head, trained
  on every query head's prompt queries before position sinks + build_end + window with their exact
  top-n_q (all of them; the prefill strides them to at most 4,096), each key's nearest keys as
  connect candidates."""
  Hkv, n, D = keys.shape
  Hq = q.shape[1]
  context = hi.HostContext(1, 1, Hq, Hkv, D, dtype="float16", kind=FLAGS.index_kind,
                           index_params=dict(ef_insert=int(ef_insert)),
                           roar_heads="kv" if FLAGS.index_kind == "roar" else "query")
  context.append(0, 0, 0, keys[:, :build_end], keys[:, :build_end])
  context.reserve(0, 0, n)
  train = {}
  if FLAGS.index_kind == "roar":
    stop = FLAGS.sinks + build_end + FLAGS.window
    tq = q[layer, :, :stop].astype(np.float32)  # [Hq, M, D]
    n_q = hi.DEFAULT_PARAMS["roar"]["n_q"]
    tk = np.stack([recall.exact_topk_np(tq[h], keys[h // (Hq // Hkv), :build_end], n_q) for h in range(Hq)])
    cand = np.stack([hi.key_neighbours(keys[g, :build_end].astype(np.float32), recall.CONNECT_KNN)
                     for g in range(Hkv)])
    train = dict(train_queries=tq[None], train_topk=tk[None], connect_candidates=cand[None])
  context.build_layer(0, threads=FLAGS.threads, **train)
  return context


def recall_row(context, decode, truth, first_inserted: int) -> dict:
  """recall@k of the decode queries `decode` [S, Hq, D] against `truth` [S, Hq, k] (store ids), overall
  and on the true ids >= first_inserted."""
  found = np.zeros(truth.shape, bool)
  scanned = []
  for s in range(decode.shape[0]):
    ids, scan = context.search(0, decode[s][None], k=FLAGS.k, ef=FLAGS.search_ef or None, threads=FLAGS.threads)
    found[s] = [np.isin(t, i) for t, i in zip(truth[s], ids[0])]
    scanned.append(scan[0])
  inserted = truth >= first_inserted
  return dict(recall=round(float(found.mean()), 4),
              inserted_recall=round(float(found[inserted].mean()), 4) if inserted.any() else None,
              inserted_share=round(float(inserted.mean()), 4), scanned=int(np.median(scanned)))


def layer_rows(q, k, layer: int) -> list[dict]:
  """The rows of one layer (every KV head's index in one HostContext, as decode keeps them)."""
  n = FLAGS.context_len
  lo, hi_ = FLAGS.sinks, n - FLAGS.window
  base = hi_ - lo - FLAGS.inserts
  if base < FLAGS.k:
    raise ValueError(f"--inserts={FLAGS.inserts} leaves {base} keys for the build, fewer than k={FLAGS.k}")
  Hq, Hkv = q.shape[1], k.shape[1]
  G = Hq // Hkv
  keys = np.ascontiguousarray(k[layer, :, lo:hi_])  # [Hkv, n_idx, D]
  decode = q[layer, :, n:n + FLAGS.decode_steps].astype(np.float32).transpose(1, 0, 2)  # [S, Hq, D]
  truth = np.stack([recall.exact_topk_np(decode[:, h], keys[h // G], FLAGS.k) for h in range(Hq)], axis=1)
  own_queries = q[layer, :, lo:hi_].astype(np.float32)  # [Hq, n_idx, D]: each token's own query
  common = dict(layer=layer, kind=FLAGS.index_kind, kv_heads=Hkv, keys=keys.shape[1], inserted=FLAGS.inserts)
  rows = [common | dict(ef_insert="rebuilt", us_per_insert=None)
          | recall_row(new_context(keys, q, layer, keys.shape[1], 0), decode, truth, base)]
  for i, ef_insert in enumerate(FLAGS.ef_inserts):
    context = new_context(keys, q, layer, base, ef_insert)
    if i == 0:  # the keys never indexed: what the inserts recover
      rows.append(common | dict(ef_insert="absent", us_per_insert=None) | recall_row(context, decode, truth, base))
    seconds = []
    for t in range(base, keys.shape[1]):  # one token per step, every KV head's index, one thread
      context.append(0, 0, t, keys[:, t:t + 1], keys[:, t:t + 1])
      t0 = time.perf_counter()
      context.index_stored([0], [0], queries=own_queries[None, :, t:t + 1], threads=1)
      seconds.append((time.perf_counter() - t0) / Hkv)
    rows.append(common | dict(ef_insert=int(ef_insert), us_per_insert=round(1e6 * float(np.median(seconds)), 1))
                | recall_row(context, decode, truth, base))
  return rows


def load_capture() -> tuple[dict, list[int]]:
  """recall.py's capture of --model (cached) and the layers of --layers, checked against it."""
  model = FLAGS.model or DEFAULT_MODEL
  data = recall.load_or_capture(model, FLAGS.context_len, decode_steps=FLAGS.decode_steps, text="docs", seed=0,
                                cache_dir=FLAGS.cache_dir)
  layers = [int(x) for x in FLAGS.layers or DEFAULT_LAYERS]
  for layer in layers:
    if not 0 <= layer < data["k"].shape[0]:
      raise ValueError(f"--layers: {layer} is not a layer of {model} ({data['k'].shape[0]} layers)")
  return data, layers


def capture_description(data) -> str:
  return (f"{data['meta']['model']} vectors ({FLAGS.context_len} prompt tokens of {data['meta']['text']} text, "
          f"{FLAGS.decode_steps} greedy decode steps)")


def main(argv):
  del argv
  data, layers = load_capture()
  q, k = data["q"], data["k"]  # [L, Hq, N + S, D], [L, Hkv, N + S, D]
  rows = []
  for layer in layers:
    rows += layer_rows(q, k, layer)
    print(*rows[-len(FLAGS.ef_inserts) - 2:], sep="\n", flush=True)
  summary = []
  for ef_insert in ["rebuilt", "absent"] + [int(e) for e in FLAGS.ef_inserts]:
    sel = [r for r in rows if r["ef_insert"] == ef_insert]
    mean = lambda key: (round(float(np.mean([r[key] for r in sel if r[key] is not None])), 4)
                        if any(r[key] is not None for r in sel) else None)
    summary.append(dict(ef_insert=ef_insert, us_per_insert=(round(float(np.median([r["us_per_insert"] for r in sel])), 1)
                                                            if sel[0]["us_per_insert"] is not None else None),
                        recall=mean("recall"), inserted_recall=mean("inserted_recall"),
                        inserted_share=mean("inserted_share"), scanned=int(np.median([r["scanned"] for r in sel])),
                        layers=len(sel)))
  notes = (f"{capture_description(data)}; index kind {FLAGS.index_kind}; the last {FLAGS.inserts} keys before "
           "the window inserted one per step into every KV head's index on one thread (HostContext.index_stored, the decode path; roar links each through its group's mean query). recall: the decode queries' "
           f"recall@{FLAGS.k} over every key; inserted_recall: over the true top-{FLAGS.k} ids that were inserted; "
           "inserted_share: their share of the true top ids. us_per_insert: median per call (summary: median of "
           "the layers' medians; per index: a call's time / KV heads). 'rebuilt': every key in the build; 'absent': the inserted keys left out.")
  results_io.write_results(FLAGS.name or "bench_insert", rows, out_dir=FLAGS.out_dir or None, notes=notes,
                           summary=summary)
  for row in summary:
    print(row)


if __name__ == "__main__":
  app.run(main)
