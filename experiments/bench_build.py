"""Where a context's index build time goes when it is scheduled two ways, side by side.

    python experiments/bench_build.py --layers=24 --q_heads=14 --kv_heads=2 --head_dim=64 --keys=31360

A HostContext of one sequence and `--layers` layers is filled with the same keys each time
and every index built, timed as a whole (wall seconds) under two schedules:

  per_head      layer by layer, the heads one after another, each with every core
                (HostContext.build_layer's default);
  queued        every layer's builds queued at once, one core each (build_layer(wait=False),
                what retrieval's prefill does), then wait_builds.

On the H200 host (16 cores, Qwen2.5-0.5B shapes, 31K keys a graph) both took ~17.5 s for 112
roar graphs: the builds use 16 threads well, so the queue's gain is determinism (one-thread
builds) and the overlap with the caller's next layer, not build speed.

roar trains on `--train_queries` strided queries per query head with their exact top-100 among
the layer's keys, computed once beforehand as retrieval's prefill does (on the device where
there is one), and with --connect_candidates (the default) links each key through its 64
nearest keys, computed beforehand as the prefill does (ops.nearest_keys up to 524,288 keys a
head, ops.block_nearest_keys past it; on a CPU backend only with --candidates_on_cpu); without
them the build searches its graph for every key as RoarGraph does.

phase_*_s: the builds' own timers (host_index stats), summed over the indexes: training links,
projection, connectivity (the link search or the candidates' pruning), reachability repair,
co-occurrence links. Queued builds run one core each, so there the sums are core-seconds.
Vectors: SYNTHETIC clusters (host_index.synthetic.clustered), or with --capture a cached
experiments/recall.py capture (.npz with q [L, Hq, N, D] and k [L, Hkv, N, D]), whose layers
are reused cyclically. Build times depend on the vectors (a graph's connectivity pass searches
them) and on the machine: run it on the machine whose host builds (the GPU machine's 16 cores).
"""

from __future__ import annotations

import time

import numpy as np
from absl import app, flags

import host_index
from host_index.synthetic import clustered
from kvjax.host_runtime import available_cores
from kvjax.policies import retrieval
from kvjax.policies.retrieval import _connect_candidates, _train_topk
import results_io

flags.DEFINE_integer("layers", 24, "Layers, every one indexed.")
flags.DEFINE_integer("q_heads", 14, "Query heads.")
flags.DEFINE_integer("kv_heads", 2, "KV heads.")
flags.DEFINE_integer("head_dim", 64, "Head dimension.")
flags.DEFINE_integer("keys", 31360, "Keys per (layer, KV head).")
flags.DEFINE_integer("train_queries", 4096, "roar: training queries per query head (retrieval's default).")
flags.DEFINE_integer("train_topk", 100, "roar: N_q, exact top keys per training query.")
flags.DEFINE_enum("index", "roar", ["roar", "graph", "ivf"], "Index kind.")
flags.DEFINE_enum("roar_heads", "query", ["query", "kv"], "roar: one graph per query head or per KV head.")
flags.DEFINE_list("schedules", ["per_head", "queued"], "Schedules timed, in this order.")
flags.DEFINE_boolean("connect_candidates", True, "roar: link each key through its nearest keys, computed beforehand "
                     "as retrieval's prefill does (ops.nearest_keys), instead of searching for them.")
flags.DEFINE_integer("max_exact_candidate_keys", None, "Overrides kvjax.policies.retrieval.MAX_EXACT_CANDIDATE_KEYS, "
                     "the longest head given exact neighbours (past it: block neighbours).")
flags.DEFINE_integer("neighbour_block", None, "Overrides retrieval.NEIGHBOUR_BLOCK (block neighbours' block size).")
flags.DEFINE_integer("neighbour_probes", None, "Overrides retrieval.NEIGHBOUR_PROBES (blocks each key ranks).")
flags.DEFINE_boolean("candidates_on_cpu", False, "Compute those candidates on a CPU backend too (the prefill does not).")
flags.DEFINE_string("capture", None, "experiments/recall.py .npz of real vectors (default: synthetic).")
flags.DEFINE_string("out_dir", None, "Results directory.")
flags.DEFINE_string("name", "bench_build", "Results file name.")
FLAGS = flags.FLAGS


def layer_vectors(layer: int, capture):
  """Keys [Hkv, N, D] and training queries [Hq, M, D] float32 of one layer."""
  Hq, Hkv, D, N, M = FLAGS.q_heads, FLAGS.kv_heads, FLAGS.head_dim, FLAGS.keys, FLAGS.train_queries
  if capture is not None:
    k, q = capture["k"], capture["q"]
    src = layer % k.shape[0]
    if k.shape[1] != Hkv or q.shape[1] != Hq or k.shape[3] != D or k.shape[2] < N:
      raise app.UsageError(f"--capture holds k {k.shape}, q {q.shape}: it does not fit the requested shapes")
    stride = max(1, q.shape[2] // M)
    return k[src, :, :N].astype(np.float32), q[src, :, ::stride][:, :M].astype(np.float32)
  keys = np.stack([clustered(N, D, seed=1000 * layer + h) for h in range(Hkv)])
  queries = np.stack([clustered(M, D, seed=7 + 1000 * layer + h, shift=0.3) for h in range(Hq)])
  return keys, queries


def build_all(schedule: str, layers) -> tuple[host_index.HostContext, float]:
  """A filled context, and the wall seconds its indexes took under `schedule`."""
  ctx = host_index.HostContext(1, FLAGS.layers, FLAGS.q_heads, FLAGS.kv_heads, FLAGS.head_dim, dtype="bfloat16",
                               kind=FLAGS.index, roar_heads=FLAGS.roar_heads if FLAGS.index == "roar" else "query")
  for layer, (keys, _, _, _) in enumerate(layers):
    ctx.append(0, layer, 0, keys, keys)
  def train(layer):
    if FLAGS.index != "roar":
      return {}
    _, queries, topk, cand = layers[layer]
    return dict(train_queries=queries[None], train_topk=topk[None],
                connect_candidates=None if cand is None else cand[None])

  t = time.perf_counter()
  for layer in range(FLAGS.layers):
    ctx.build_layer(layer, wait=schedule == "per_head", **train(layer))
  ctx.wait_builds()
  return ctx, time.perf_counter() - t


def main(argv):
  del argv
  bad = [s for s in FLAGS.schedules if s not in ("per_head", "queued")]
  if bad:  # any other name ran the queued schedule under its own label
    raise app.UsageError(f"--schedules: {bad} are not schedules (per_head, queued)")
  t = time.perf_counter()
  capture = dict(np.load(FLAGS.capture)) if FLAGS.capture else None
  retrieval.NEIGHBOURS_ON_CPU = FLAGS.candidates_on_cpu
  for flag, name, least in (("max_exact_candidate_keys", "MAX_EXACT_CANDIDATE_KEYS", 0),
                            ("neighbour_block", "NEIGHBOUR_BLOCK", 1), ("neighbour_probes", "NEIGHBOUR_PROBES", 1)):
    value = getattr(FLAGS, flag)
    if value is not None:
      if value < least:
        raise app.UsageError(f"--{flag}={value} must be >= {least}")
      setattr(retrieval, name, value)
  layers, candidates_s = [], 0.0
  for layer in range(FLAGS.layers):
    keys, queries = layer_vectors(layer, capture)
    # the training links as retrieval's prefill computes them (ops.exact_topk on an accelerator)
    topk = _train_topk(queries, keys, FLAGS.train_topk) if FLAGS.index == "roar" else None
    t_cand = time.perf_counter()
    cand = _connect_candidates(keys) if FLAGS.index == "roar" and FLAGS.connect_candidates else None
    candidates_s += time.perf_counter() - t_cand
    layers.append((keys, queries, topk, cand))
  prepare_s = time.perf_counter() - t
  candidates = ("none" if layers[0][3] is None else
                "exact" if FLAGS.keys <= retrieval.MAX_EXACT_CANDIDATE_KEYS else "blocks")
  rows, reference = [], None
  for schedule in FLAGS.schedules:
    ctx, seconds = build_all(schedule, layers)
    probe = np.stack([layers[0][1][:, 0]])  # [1, Hq, D]: each head's first training query
    ids = ctx.search(0, probe, k=10)[0]
    reference = ids if reference is None else reference
    builds = FLAGS.layers * ctx.index_heads
    stats = [ctx.index(0, layer, h).stats() for layer in range(FLAGS.layers) for h in range(ctx.index_heads)]
    phases = {f"phase_{p}_s": round(sum(st[f"t_{p}"] for st in stats), 4)
              for p in ("topk", "project", "connect", "repair", "cooc")}
    rows.append(dict(schedule=schedule, index=FLAGS.index, roar_heads=FLAGS.roar_heads, layers=FLAGS.layers,
                     q_heads=FLAGS.q_heads, kv_heads=FLAGS.kv_heads, head_dim=FLAGS.head_dim, keys=FLAGS.keys,
                     train_queries=FLAGS.train_queries, candidates=candidates, builds=builds,
                     host_cores=available_cores(), build_s=round(seconds, 2), s_per_build=round(seconds / builds, 4),
                     **phases,
                     probe_top10_overlap=round(float(np.mean([len(set(a) & set(b)) / 10 for a, b in zip(
                         ids.reshape(-1, 10), reference.reshape(-1, 10))])), 3)))
    print(rows[-1], flush=True)
  base = rows[0]["build_s"]
  for row in rows:
    row["speedup_vs_first"] = round(base / row["build_s"], 2)
  vectors = f"capture {FLAGS.capture}" if FLAGS.capture else "SYNTHETIC clustered vectors"
  found = ("by brute force" if candidates == "exact" else f"among the keys of the {retrieval.NEIGHBOUR_PROBES} "
           f"nearest blocks of {retrieval.NEIGHBOUR_BLOCK}")
  links = (f"each key's {retrieval.CONNECT_CANDIDATES} nearest keys ({found}) as link candidates, computed beforehand "
           f"as the prefill does ({candidates_s:.1f} s of the preparation)" if candidates != "none" else
           "no link candidates: the builds search for each key's links")
  notes = (f"One sequence, every layer indexed; {vectors}; exact training top-{FLAGS.train_topk} computed beforehand "
           f"as retrieval's prefill does; {links} (preparation {prepare_s:.1f} s, not in build_s). "
           "build_s = wall seconds to build every index; phase_*_s = the builds' own timers summed over the indexes "
           "(training links, projection, connectivity, repair, co-occurrence links; core-seconds when queued); "
           "probe_top10_overlap = top-10 overlap with the first schedule's index for each head's first training "
           "query (builds with several threads differ within noise; one-thread builds are deterministic).")
  results_io.write_results(FLAGS.name, rows, out_dir=FLAGS.out_dir, notes=notes)
  print(results_io.markdown_table(rows))


if __name__ == "__main__":
  app.run(main)
