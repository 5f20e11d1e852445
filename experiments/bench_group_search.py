"""Searching a KV head's graph for its G query heads together (`HostContext.search(grouped=True)`)
against one search per query head: recall, rows loaded and time.

Why: a graph search at 128K keys is bound by memory latency (each key scored is a row fetched from
DRAM: ~0.6 ms a head search on the H200 host, README). The G query heads of a KV head search the
same graph (graph indexes, roar with roar_heads="kv") and rank many of the same keys (pairwise
top-100 overlap 0.34-0.78 on SmolLM2 decode queries), so a walk that scores every key it reaches
for all G queries at once loads their union instead of their sum.

Two parts, one row each per (part, ef, mode):
  real: recall.py's capture of a real model (default SmolLM2-135M, 8,128 tokens of docs text, 64
    greedy decode steps), roar per KV head built as the retrieval prefill builds it (bench_insert's
    `new_context`) over the keys between the sinks and the window, per layer in --layers; the
    decode queries searched one step at a time (all query heads of the layer in one call) on
    --threads threads. Recall@k against exact NumPy top-k.
  synthetic (--synthetic_keys > 0): --synthetic_layers layers of graph indexes over clustered keys
    (a store larger than the caches, as at 128K), queries of a group drawn around one direction
    with --synthetic_noise; every layer searched in one `search_layers` call a step, as the
    per_step bridge does. Times only (Gaussian draws say nothing about recall on real vectors).

rows_per_step: distinct key rows scored a step over every query head (per-head mode: the sum of
the heads' counts). ms_per_step: median wall time of a step's search call. Both modes run in
turns twice (per-head, grouped, per-head, grouped); the row gives the median over both turns.
"""

from __future__ import annotations

import time

import numpy as np
from absl import app, flags

import bench_insert
import host_index as hi
import recall
import results_io
from host_index.synthetic import clustered

# recall.py's flags serve here too (--model, --context_len, --decode_steps, --layers, --sinks, --window,
# --k, --threads, --cache_dir, --out_dir, --name); its --efs (beam widths compared) defaults here to:
flags.FLAGS.set_default("efs", ["64", "80", "100"])
flags.DEFINE_integer("synthetic_keys", 0, "Keys per KV head of the synthetic part (0: skip it; 131072 as at 128K).")
flags.DEFINE_integer("synthetic_layers", 4, "Layers of the synthetic part (their stores should exceed the caches).")
flags.DEFINE_float("synthetic_noise", 0.7, "Spread of a group's query heads around their shared direction.")
flags.DEFINE_integer("synthetic_steps", 30, "Search calls timed per mode and turn in the synthetic part.")
FLAGS = flags.FLAGS


def timed_search(search, steps: int) -> tuple[float, list]:
  """Median ms of `search(step)` over the steps, and each step's (ids, scanned)."""
  seconds, results = [], []
  for s in range(steps):
    t0 = time.perf_counter()
    results.append(search(s))
    seconds.append(time.perf_counter() - t0)
  return 1e3 * float(np.median(seconds)), results


def real_rows(q, k, layer: int) -> list[dict]:
  """Recall, rows and time of both modes on one layer's real decode queries."""
  n = FLAGS.context_len
  lo, hi_ = FLAGS.sinks, n - FLAGS.window
  Hq, Hkv = q.shape[1], k.shape[1]
  G = Hq // Hkv
  keys = np.ascontiguousarray(k[layer, :, lo:hi_])  # [Hkv, n_idx, D]
  decode = q[layer, :, n:n + FLAGS.decode_steps].astype(np.float32).transpose(1, 0, 2)  # [S, Hq, D]
  truth = np.stack([recall.exact_topk_np(decode[:, h], keys[h // G], FLAGS.k) for h in range(Hq)], axis=1)
  context = bench_insert.new_context(keys, q, layer, keys.shape[1], 0)
  rows = []
  for ef in (int(e) for e in FLAGS.efs):
    turns = {}
    for grouped in (False, True, False, True):
      ms, results = timed_search(lambda s: context.search(0, decode[s][None], k=FLAGS.k, ef=ef, threads=FLAGS.threads,
                                                          grouped=grouped), decode.shape[0])
      turns.setdefault(grouped, []).append((ms, results))
    for grouped, runs in turns.items():
      results = runs[0][1]
      found = [np.isin(truth[s, h], results[s][0][0, h]).mean() for s in range(len(results)) for h in range(Hq)]
      rows.append(dict(part="real", layer=layer, keys=keys.shape[1], ef=ef, k=FLAGS.k,
                       mode="grouped" if grouped else "per_head", recall=round(float(np.mean(found)), 4),
                       rows_per_step=int(np.mean([r[1].sum() for r in results])),
                       ms_per_step=round(float(np.median([ms for ms, _ in runs])), 3), threads=FLAGS.threads))
  return rows


def synthetic_rows() -> list[dict]:
  """Time and rows of both modes over graph indexes larger than the caches."""
  L, N, D = FLAGS.synthetic_layers, FLAGS.synthetic_keys, 64
  Hkv, G = 3, 3  # SmolLM2's heads
  Hq = Hkv * G
  rng = np.random.default_rng(0)
  context = hi.HostContext(1, L, Hq, Hkv, D, dtype="bfloat16", kind="graph")
  t0 = time.perf_counter()
  for layer in range(L):
    keys = np.stack([clustered(N, D, seed=10 * layer + h) for h in range(Hkv)])
    context.append(0, layer, 0, keys, keys)
    context.build_layer(layer, threads=FLAGS.threads)
  build_s = time.perf_counter() - t0
  steps = FLAGS.synthetic_steps
  base = np.repeat(rng.standard_normal((steps, L, 1, Hkv, 1, D)), G, axis=4)
  queries = (base + FLAGS.synthetic_noise * rng.standard_normal(base.shape)).reshape(steps, L, 1, Hq, D)
  queries = queries.astype(np.float32)
  rows = []
  for ef in (int(e) for e in FLAGS.efs):
    turns = {}
    for grouped in (False, True, False, True):
      turns.setdefault(grouped, []).append(timed_search(
          lambda s: context.search_layers(list(range(L)), queries[s], k=FLAGS.k, ef=ef, threads=FLAGS.threads,
                                          grouped=grouped), steps))
    for grouped, runs in turns.items():
      rows.append(dict(part="synthetic", layer=f"0-{L - 1}", keys=N, ef=ef, k=FLAGS.k,
                       mode="grouped" if grouped else "per_head", recall=None,
                       rows_per_step=int(np.mean([r[1].sum() for r in runs[0][1]])),
                       ms_per_step=round(float(np.median([ms for ms, _ in runs])), 3), threads=FLAGS.threads,
                       build_s=round(build_s, 1)))
  return rows


def main(argv):
  del argv
  data, layers = bench_insert.load_capture()
  q, k = data["q"], data["k"]  # [L, Hq, N + S, D], [L, Hkv, N + S, D]
  rows = []
  for layer in layers:
    rows += real_rows(q, k, layer)
    print(*rows[-2 * len(FLAGS.efs):], sep="\n", flush=True)
  if FLAGS.synthetic_keys > 0:
    rows += synthetic_rows()
    print(*rows[-2 * len(FLAGS.efs):], sep="\n", flush=True)
  summary = []
  for part in ("real", "synthetic"):
    for ef in (int(e) for e in FLAGS.efs):
      for mode in ("per_head", "grouped"):
        sel = [r for r in rows if (r["part"], r["ef"], r["mode"]) == (part, ef, mode)]
        if sel:
          summary.append(dict(part=part, ef=ef, mode=mode,
                              recall=round(float(np.mean([r["recall"] for r in sel])), 4) if part == "real" else None,
                              rows_per_step=int(np.mean([r["rows_per_step"] for r in sel])),
                              ms_per_step=round(float(np.mean([r["ms_per_step"] for r in sel])), 3)))
  notes = (f"real: {bench_insert.capture_description(data)}, roar per KV head over the keys between the sinks and the "
           f"window, every query head of a layer searched in one call a step, recall@{FLAGS.k} against exact top-k. "
           + (f"synthetic: {FLAGS.synthetic_layers} layers x 3 KV heads x {FLAGS.synthetic_keys} clustered keys "
              f"(bfloat16), graph indexes, 9 query heads drawn around their group's direction with noise "
              f"{FLAGS.synthetic_noise}, every layer in one search_layers call a step (times only). "
              if FLAGS.synthetic_keys else "")
           + "rows_per_step: distinct key rows scored a step over every query head; ms_per_step: median search call, "
           "the two modes run in turns twice. Summary: means over layers.")
  results_io.write_results(FLAGS.name or "bench_group_search", rows, out_dir=FLAGS.out_dir or None, notes=notes,
                           summary=summary)
  for row in summary:
    print(row)


if __name__ == "__main__":
  app.run(main)
