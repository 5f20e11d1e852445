"""One core's cost of the decode exchange's two index operations: a roar search (top-k) and a
decode-time insert, per KV-head graph, at several store sizes.

    python experiments/bench_op_costs.py --keys=32768,131072

Why: a step's host work is (searched heads x search cost) + (graphs x insert cost) core-seconds;
against the exchange's measured wall time over N cores it says how well the threads are used
(README, "Where things stand"). Random Gaussian keys and queries at SmolLM2's shapes (9 query
heads, 3 KV heads, head_dim 64, bfloat16), roar with one graph per KV head: the 128K
benchmark's synthetic configuration, not a real model's vectors.
"""

from __future__ import annotations

import time

import numpy as np
from absl import app, flags

import host_index
import results_io

flags.DEFINE_list("keys", ["32768", "131072"], "Keys per KV head.")
flags.DEFINE_integer("layers", 8, "Layers, each with its own graphs, visited in turn: a decode step's searches and "
                     "inserts each touch another layer's graph, so their memory is rarely in cache.")
flags.DEFINE_integer("q_heads", 9, "Query heads.")
flags.DEFINE_integer("kv_heads", 3, "KV heads.")
flags.DEFINE_integer("head_dim", 64, "Head dimension.")
flags.DEFINE_integer("topk", 100, "Keys a search returns.")
flags.DEFINE_integer("train_queries", 1024, "roar training queries per query head.")
flags.DEFINE_integer("repeats", 20, "Timed searches (each of every query head) and inserts (one token, every graph).")
flags.DEFINE_list("threads", [], "Also time a step's worth of work in one call at each of these thread counts: a "
                  "search of --searched_share of every layer's query heads (search_layers) and an insert of one token into every "
                  "layer's graphs (index_stored), as the decode exchange and its background indexing make them.")
flags.DEFINE_float("searched_share", 0.27, "The share of (layer, KV-head group)s a step's search call takes, drawn anew "
                   "each call (speculative decode at 128K searches ~74 of SmolLM2's 270 query heads a step).")
flags.DEFINE_string("out_dir", None, "Results directory.")
flags.DEFINE_string("name", "bench_op_costs", "Results file name.")
FLAGS = flags.FLAGS


def measure(n: int, rng) -> dict:
  Hq, Hkv, D = FLAGS.q_heads, FLAGS.kv_heads, FLAGS.head_dim
  L = FLAGS.layers
  ctx = host_index.HostContext(1, L, Hq, Hkv, D, dtype="bfloat16", kind="roar", roar_heads="kv")
  t0 = time.perf_counter()
  for layer in range(L):
    keys = rng.standard_normal((Hkv, n, D), dtype=np.float32)
    ctx.append(0, layer, 0, keys, keys)
    ctx.reserve(0, layer, n + FLAGS.repeats * (1 + len(FLAGS.threads) + 1))
    ctx.build_layer(layer, train_queries=rng.standard_normal((1, Hq, FLAGS.train_queries, D), dtype=np.float32))
  build_seconds = time.perf_counter() - t0
  query = rng.standard_normal((1, 1, Hq, D), dtype=np.float32)
  search, scanned = [], []
  for i in range(FLAGS.repeats):
    query = query + 0.3 * rng.standard_normal(query.shape, dtype=np.float32)  # drifts, as decode's
    t0 = time.perf_counter()
    _, seen = ctx.search_layers([i % L], query, k=FLAGS.topk, threads=1)
    search.append((time.perf_counter() - t0) / Hq)
    scanned.append(float(seen.mean()))
  insert = []
  for i in range(FLAGS.repeats):
    token = rng.standard_normal((Hkv, 1, D), dtype=np.float32)
    layer = i % L
    ctx.append(0, layer, ctx.store.length(0, layer), token, token)
    own_query = rng.standard_normal((1, Hq, 1, D), dtype=np.float32)
    t0 = time.perf_counter()
    ctx.index_stored([0], [layer], queries=own_query, threads=1)
    insert.append((time.perf_counter() - t0) / Hkv)
  one = dict(keys=n, layers=L, build_s=round(build_seconds, 2), search_ms_per_head=round(1e3 * float(np.median(search)), 4),
             scanned_keys=round(float(np.mean(scanned))), scanned_share=round(float(np.mean(scanned)) / n, 4),
             insert_ms_per_graph=round(1e3 * float(np.median(insert)), 4), threads=1)
  if not FLAGS.threads:
    return [one]
  steps = [step_costs(ctx, t, rng) for t in sorted({1, *map(int, FLAGS.threads)})]
  for row in steps:  # against the same calls on one thread
    row["search_efficiency"] = round(steps[0]["step_search_ms"] / (row["threads"] * row["step_search_ms"]), 3)
    row["insert_efficiency"] = round(steps[0]["step_insert_ms"] / (row["threads"] * row["step_insert_ms"]), 3)
  return [one] + steps


def step_costs(ctx, threads: int, rng) -> dict:
  """Medians of `repeats` calls on `threads` threads: a random share of every layer's KV-head groups
  searched in one call, and one new token inserted into every layer's graphs in one call."""
  Hq, Hkv, D, L = FLAGS.q_heads, FLAGS.kv_heads, FLAGS.head_dim, FLAGS.layers
  layers = list(range(L))
  queries = rng.standard_normal((L, 1, Hq, D), dtype=np.float32)
  search = []
  for _ in range(FLAGS.repeats):
    queries = queries + 0.3 * rng.standard_normal(queries.shape, dtype=np.float32)
    groups = rng.random((L, 1, Hkv)) < FLAGS.searched_share
    t0 = time.perf_counter()
    ctx.search_layers(layers, queries, k=FLAGS.topk, heads=np.repeat(groups, Hq // Hkv, axis=-1), threads=threads)
    search.append(time.perf_counter() - t0)
  insert = []
  for _ in range(FLAGS.repeats):
    for layer in layers:
      token = rng.standard_normal((Hkv, 1, D), dtype=np.float32)
      ctx.append(0, layer, ctx.store.length(0, layer), token, token)
    own_query = rng.standard_normal((L, Hq, 1, D), dtype=np.float32)
    t0 = time.perf_counter()
    ctx.index_stored([0] * L, layers, queries=own_query, threads=threads)
    insert.append(time.perf_counter() - t0)
  return dict(keys=ctx.store.length(0, 0), layers=L, threads=threads, step_searches=round(FLAGS.searched_share * L * Hq),
              step_search_ms=round(1e3 * float(np.median(search)), 3), step_inserts=L * Hkv,
              step_insert_ms=round(1e3 * float(np.median(insert)), 3))


def main(argv):
  del argv
  rng = np.random.default_rng(0)
  rows = [row for n in FLAGS.keys for row in measure(int(n), rng)]
  for row in rows:
    print(row)
  notes = (f"One thread, medians of {FLAGS.repeats}: a search of every query head ({FLAGS.q_heads}; top-{FLAGS.topk}, "
           f"default ef) in layer i % layers, divided by the heads; an insert of one token into every KV head's graph ({FLAGS.kv_heads}; "
           "roar's decode insert: a key search and an own-query search at ef_insert), divided by the graphs. Random "
           "vectors (the synthetic benchmarks' case), roar per KV head, bfloat16 store.")
  if FLAGS.threads:
    notes += (f" Rows with step_* fields: one call searching a random {FLAGS.searched_share:.0%} of every layer's KV-head "
              "groups (step_searches query heads on average, a new draw each call) and one inserting a token into "
              "every layer's graphs (step_inserts) on `threads` threads, medians of "
              f"{FLAGS.repeats}; efficiency = the one-thread call's time / (threads x this time). "
              "Nothing else runs beside them (in decode the device's launching thread and the other phases do).")
  results_io.write_results(FLAGS.name, rows, out_dir=FLAGS.out_dir, notes=notes)


if __name__ == "__main__":
  app.run(main)
