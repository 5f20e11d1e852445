"""The host half of retrieval's per_step bridge alone: where one step's host work goes.

    python experiments/bench_prefetch.py --layers=32 --q_heads=32 --kv_heads=8 --head_dim=128 --keys=8192

No model and no device work: a host_index.HostContext of the given shapes is filled with random
keys and values, indexed, and driven through `PrefetchRuntime.prefetch_step` (store the evicted
tokens, search every layer, assign slots, gather the entering rows, pack the update) with
queries that drift from step to step (q_t = q_{t-1} + drift * noise, so consecutive selections
overlap as they do in decode). Rows: per-phase medians over the steps after the first
(insert, search, gather = slot assignment + gathering + packing, wait for the previous step's
background indexing, total), rows and bytes shipped, and the functions with the most own time
under cProfile. Synthetic vectors: the keys scanned, and so the search time, are not those of a
real model; the gather and bookkeeping costs are (they depend on shapes and on how many rows
enter, which --drift sets). Run it on the machine whose host cores decode (the GPU machine):
this is CPU time only.
"""

from __future__ import annotations

import cProfile
import copy
import pstats
import threading
import time

import jax.numpy as jnp
import numpy as np
from absl import app, flags

import host_index
from gil_probe import GilProbe
from kvjax.host_runtime import available_cores
from kvjax.policies.retrieval import RetrievalAttention
from kvjax.prefetch_runtime import PrefetchRuntime, slot_stores
import results_io

flags.DEFINE_integer("layers", 32, "Layers served from the host.")
flags.DEFINE_integer("q_heads", 32, "Query heads.")
flags.DEFINE_integer("kv_heads", 8, "KV heads.")
flags.DEFINE_integer("head_dim", 128, "Head dimension.")
flags.DEFINE_integer("keys", 8192, "Host-resident keys per (layer, KV head).")
flags.DEFINE_enum("index", "graph", ["graph", "ivf", "flat", "roar"], "Host index kind.")
flags.DEFINE_enum("roar_heads", "kv", ["kv", "query"], "roar: one graph per KV head (the 128K configuration's) or "
                  "per query head.")
flags.DEFINE_integer("train_queries", 1024, "roar: random training queries per query head (their exact top-k on the "
                     "host: the decode's come from the device).")
flags.DEFINE_integer("topk", 100, "Keys retrieved per query head.")
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float16", "float32"], "Host store dtype.")
flags.DEFINE_integer("steps", 16, "Timed steps (after 2 warm-up steps).")
flags.DEFINE_float("drift", 0.3, "Step-to-step query noise, relative to the query scale.")
flags.DEFINE_boolean("reuse_buffers", True, "Reuse the update buffer (as on a GPU backend).")
flags.DEFINE_integer("profile_top", 12, "Functions listed by own time.")
flags.DEFINE_float("tau", None, "Speculative reuse (retrieval per_step, speculative=True): a KV-head group keeps its "
                   "latest search while its query stays within this cosine of that search's query; unset: every "
                   "head searches every step.")
flags.DEFINE_enum("refresh", "search", ["search", "merge"], "With --tau: how a group that has not drifted is "
                  "refreshed on its turn (retrieval per_step's `refresh`).")
flags.DEFINE_integer("tail_slots", RetrievalAttention.tail_slots, "Rows per query head for stored tokens its "
                     "latest search missed; with --tau a group is refreshed every tail_slots / 2 steps (retrieval "
                     "per_step's `tail_slots`).")
flags.DEFINE_integer("successors", 0, "Tokens following each retrieved one added to the selection (retrieval "
                     "per_step's `successors`, whose default there is twice its lag).")
flags.DEFINE_integer("successor_sources", 8, "How many of each head's best retrieved ids get successors.")
flags.DEFINE_integer("pinned", 0, "Ids per query head pinned by the first step's queries, each with --pinned_span "
                     "tokens (retrieval per_step's `pinned`, whose default there is 16).")
flags.DEFINE_integer("pinned_span", 16, "Tokens kept from each pinned id on.")
flags.DEFINE_integer("gil_probe_steps", 8, "Steps run again after the timed ones beside a thread that needs the GIL "
                     "(experiments/gil_probe.py): how long the decode loop's main thread would wait for it.")
flags.DEFINE_boolean("index_yields", False, "The background indexing pauses while the exchange's C calls run "
                     "(retrieval's `index_yields`, host_index/csrc/hi_gate.h).")
flags.DEFINE_string("out_dir", None, "Results directory.")
flags.DEFINE_string("name", "bench_prefetch", "Results file name.")
FLAGS = flags.FLAGS
NOTES = ("Synthetic random vectors, host CPU time only: search times depend on the vectors (random ones are the "
         "hardest case for a graph index); gather and bookkeeping costs depend on the shapes and the rows that "
         "enter. ms columns are medians over the timed steps.")
PHASES = ("insert_seconds", "search_seconds", "gather_seconds", "callback_seconds", "searched_heads", "index_seconds",
          "index_yield_seconds")


def build_runtime(rng) -> PrefetchRuntime:
  L, Hq, Hkv, D, n = FLAGS.layers, FLAGS.q_heads, FLAGS.kv_heads, FLAGS.head_dim, FLAGS.keys
  roar = dict(roar_heads=FLAGS.roar_heads) if FLAGS.index == "roar" else {}
  context = host_index.HostContext(1, L, Hq, Hkv, D, dtype=FLAGS.dtype, kind=FLAGS.index, **roar)
  for layer in range(L):
    keys = rng.standard_normal((Hkv, n, D), dtype=np.float32).astype(jnp.dtype(FLAGS.dtype))
    context.append(0, layer, 0, keys, keys)
    train = rng.standard_normal((1, Hq, FLAGS.train_queries, D), dtype=np.float32) if roar else None
    context.build_layer(layer, train_queries=train)
    # Room for every step run (warm-up, timed, profiled, probed), as decode reserves it: no store
    # or index growth inside a step.
    context.reserve(0, layer, n + 2 + 2 * FLAGS.steps + FLAGS.gil_probe_steps + 8)
  speculation = {} if FLAGS.tau is None else dict(speculative=True, tau=FLAGS.tau, refresh=FLAGS.refresh)
  runtime = PrefetchRuntime(context, tail_slots=FLAGS.tail_slots, sinks=0, window=1, topk=FLAGS.topk, ef=None,
                            scale=D**-0.5, successors=FLAGS.successors, successor_sources=FLAGS.successor_sources,
                            pinned=FLAGS.pinned, pinned_span=FLAGS.pinned_span, index_yields=FLAGS.index_yields,
                            **speculation)  # as retrieval's per_step runtime
  runtime.buffers.reuse = FLAGS.reuse_buffers
  return runtime


def compare_gathers(runtime: PrefetchRuntime, update, reps: int = 20) -> dict:
  """One update's entering rows gathered with a C call per (layer, seq) store, as the bridge
  did before gather_rows_many, against one call over every store: median ms of each."""
  dest, ids = update.dest[:update.count].astype(np.int64), update.ids[:update.count].astype(np.int64)
  stores, store_of, heads = slot_stores(dest, 1, FLAGS.q_heads, runtime.slots, runtime.context.group)
  store, threads = runtime.context.store, runtime.gather_threads
  out_k, out_v = np.empty_like(update.k[:update.count]), np.empty_like(update.v[:update.count])
  bounds = np.searchsorted(store_of, np.arange(len(stores) + 1))  # dest is sorted: each store's rows are a run

  def per_store():
    for i, (seq, layer) in enumerate(stores):
      lo, hi = bounds[i], bounds[i + 1]
      store.gather_rows(seq, layer, heads[lo:hi], ids[lo:hi], out_k=out_k[lo:hi], out_v=out_v[lo:hi],
                        threads=threads)

  def one_call():
    store.gather_rows_many(stores, store_of, heads, ids, out_k=out_k, out_v=out_v, threads=threads)

  times = {}
  for name, fn in (("per_store", per_store), ("one_call", one_call)) * 2:  # interleaved, twice
    for _ in range(reps // 2):
      t = time.perf_counter()
      fn()
      times.setdefault(name, []).append(time.perf_counter() - t)
  one_k = out_k.copy()
  per_store()
  assert np.array_equal(one_k, out_k), "the two gathers differ"
  ms = {name: round(1e3 * float(np.median(t)), 3) for name, t in times.items()}
  return dict(kind="gather_compare", rows=int(update.count), stores=len(stores),
              per_store_ms=ms["per_store"], one_call_ms=ms["one_call"])


def main(argv):
  del argv
  rng = np.random.default_rng(0)
  t0 = time.perf_counter()
  runtime = build_runtime(rng)
  build_seconds = time.perf_counter() - t0
  L, Hq, Hkv, D = FLAGS.layers, FLAGS.q_heads, FLAGS.kv_heads, FLAGS.head_dim
  layers = list(range(L))
  queries = rng.standard_normal((L, 1, Hq, D), dtype=np.float32)
  evicted_k = rng.standard_normal((L, 1, Hkv, D), dtype=np.float32).astype(jnp.dtype(FLAGS.dtype))
  evicted_q = rng.standard_normal((L, 1, Hq, D), dtype=np.float32)
  per_step, shipped, packed_bytes = [], [], []
  runtime.pin(layers, queries[:, :, :, None])  # W = 1: the "prompt's" last query (no-op without --pinned)

  def step(i: int):
    nonlocal queries
    queries = queries + FLAGS.drift * rng.standard_normal(queries.shape, dtype=np.float32)
    position = np.full((L, 1), FLAGS.keys + i)  # one new token per layer and step, as decode evicts
    return runtime.prefetch_step(layers, queries, evicted_k, evicted_k, evicted_q, position)

  profiler = cProfile.Profile()
  try:
    for i in range(2):
      step(i)
    for i in range(2, 2 + FLAGS.steps):
      before = copy.copy(runtime.stats)
      t = time.perf_counter()
      update = step(i)
      total = time.perf_counter() - t
      per_step.append({p: getattr(runtime.stats, p) - getattr(before, p) for p in PHASES} | {"total": total})
      shipped.append(update.count)
      packed_bytes.append(update.packed.nbytes)
    base = 2 + FLAGS.steps
    for i in range(base, base + FLAGS.steps):  # profiled apart: under the profiler the timed steps ran slower
      profiler.enable()
      update = step(i)  # the latest update: its buffers are the ones the next steps reuse (compare_gathers)
      profiler.disable()
    base += FLAGS.steps
    with GilProbe(threading.get_ident()) as probe:
      for i in range(base, base + FLAGS.gil_probe_steps):
        update = step(i)  # (its buffers are reused: compare_gathers needs the latest)
      runtime._wait_background(-1)
    compare = compare_gathers(runtime, update)
  finally:
    runtime.close()
  median = lambda key: round(1e3 * float(np.median([s[key] for s in per_step])), 3)
  index = f"roar per {FLAGS.roar_heads} head" if FLAGS.index == "roar" else FLAGS.index
  row = dict(kind="prefetch_step", index=index, layers=L, q_heads=Hq, kv_heads=Hkv, head_dim=D,
             keys=FLAGS.keys, topk=FLAGS.topk, drift=FLAGS.drift, host_cores=available_cores(),
             build_s=round(build_seconds, 2), total_ms=median("total"), insert_ms=median("insert_seconds"),
             search_ms=median("search_seconds"), gather_ms=median("gather_seconds"),
             # the median of each step's rest, not a difference of medians (of different steps)
             wait_ms=round(1e3 * float(np.median([s["callback_seconds"] - s["insert_seconds"] - s["search_seconds"]
                                                  - s["gather_seconds"] for s in per_step])), 3),
             # the background indexing (wall; counted when its job ends, so in the step after it started)
             index_ms=median("index_seconds"), index_yields=FLAGS.index_yields,
             index_yield_ms=median("index_yield_seconds"),  # its threads' waits for the exchange, summed
             tau=FLAGS.tau, refresh=FLAGS.refresh if FLAGS.tau is not None else None,
             successors=FLAGS.successors, successor_sources=FLAGS.successor_sources,
             pinned=FLAGS.pinned, pinned_span=FLAGS.pinned_span,
             searched_heads=int(np.median([s["searched_heads"] for s in per_step])),
             searched_heads_max=int(max(s["searched_heads"] for s in per_step)),
             search_ms_max=round(1e3 * max(s["search_seconds"] for s in per_step), 3),
             shipped_rows=int(np.median(shipped)), slots=L * Hq * runtime.slots,
             update_bytes=int(np.median(packed_bytes))) | probe.summary(max(1, FLAGS.gil_probe_steps))
  rows = [row, compare]
  stats = pstats.Stats(profiler)
  top = sorted(stats.stats.items(), key=lambda item: -item[1][2])[:FLAGS.profile_top]  # by own time
  for (filename, line, function), (_, calls, own, cumulative, _) in top:
    rows.append(dict(kind="profile", function=f"{function} ({filename.rsplit('/', 1)[-1]}:{line})",
                     calls_per_step=round(calls / FLAGS.steps, 1), own_ms_per_step=round(1e3 * own / FLAGS.steps, 3),
                     cumulative_ms_per_step=round(1e3 * cumulative / FLAGS.steps, 3)))
  if FLAGS.gil_probe_steps:
    for where, waited in probe.by_line.most_common(FLAGS.profile_top):
      rows.append(dict(kind="gil_hold", where=where,
                       probe_wait_ms_per_step=round(1e3 * waited / FLAGS.gil_probe_steps, 3)))
  for r in rows:
    print(r)
  results_io.write_results(FLAGS.name, rows, out_dir=FLAGS.out_dir, notes=NOTES)


if __name__ == "__main__":
  app.run(main)
