"""Do roar graphs need exact link candidates? Graph recall with exact, block and no candidates.

    python experiments/bench_neighbours.py --capture=/tmp/kvjax_recall/smollm2_8128_d217cc3566.npz \\
        --layers=3,15,27 --configs=256x8,256x4,128x4

retrieval's prefill hands each roar build every key's 64 nearest keys as link candidates: exact
(ops.nearest_keys, N^2) up to MAX_EXACT_CANDIDATE_KEYS, past it from nearby blocks
(ops.block_nearest_keys: the keys of the `probes` blocks of `block` keys nearest each key's own).
For one KV head per layer of a capture (or SYNTHETIC clustered vectors) this builds one roar
graph per candidate set (exact; each BLOCKxPROBES; none, where the build searches for its links)
from the same training links (every other prefill query of the head's group, or
`--train_queries` of them: a 1M head trains on 4,096, so most of its keys get no training link
and the candidates carry them) and searches it with the group's other prefill queries.
`--candidates_only=N` skips the exact set and the graphs and scores the block sets on N sampled
keys by brute force, for lengths (1M) where the rest is too slow for the machine.

Rows: candidate_recall (the share of the exact 64 neighbours each set keeps), candidates_s (the
set's seconds on this backend), build_s, and per ef the search's recall@k against brute force and
the fraction of keys it scanned. The candidates' seconds are only meaningful on the machine the
prefill runs them on (the GPU); the recall columns are the point of a CPU run.
"""

from __future__ import annotations

import time

import jax.numpy as jnp
import numpy as np
from absl import app, flags

import host_index
import ops
import results_io
from host_index import synthetic

flags.DEFINE_string("capture", None, "experiments/recall.py .npz (q [L, Hq, N, D], k [L, Hkv, N, D]); "
                    "default: synthetic clustered vectors.")
flags.DEFINE_list("layers", ["3", "15", "27"], "Capture layers studied (head 0 of each).")
flags.DEFINE_integer("keys", 8192, "Synthetic: keys per head.")
flags.DEFINE_integer("head_dim", 64, "Synthetic: head dimension.")
flags.DEFINE_integer("train_queries", 0, "Training queries (strided over the training half; 0: all of it). "
                     "retrieval trains on 4,096 per query head, so past ~100K keys most keys get no training "
                     "link and the candidates carry them: fewer here mimic that on short heads.")
flags.DEFINE_integer("test_queries", 2048, "Search queries (strided over the held-out half; 0: all of it).")
flags.DEFINE_integer("count", 64, "Candidates per key (retrieval.CONNECT_CANDIDATES).")
flags.DEFINE_list("configs", ["256x8", "256x4", "128x4"], "Block candidate sets, BLOCKxPROBES.")
flags.DEFINE_list("efs", ["100", "150", "250"], "Search efforts.")
flags.DEFINE_integer("candidates_only", 0, "N > 0: only the block sets' candidate recall, against brute force on N "
                     "sampled keys (no exact set, no graphs): how the sets hold up at lengths where exact "
                     "neighbours and graph builds are too slow for this machine (e.g. --keys=1048576).")
flags.DEFINE_integer("k", 100, "recall@k.")
flags.DEFINE_integer("threads", None, "Build and search threads (default: all).")
flags.DEFINE_string("out_dir", None, "Results directory.")
flags.DEFINE_string("name", "bench_neighbours", "Results file name.")
FLAGS = flags.FLAGS


def head_keys(layer: int, capture):
  """KV head 0's keys [N, D] float32 of one capture layer, or synthetic ones."""
  if capture is None:
    return synthetic.clustered(FLAGS.keys, FLAGS.head_dim, seed=layer).astype(np.float32)
  return capture["k"][layer, 0].astype(np.float32)


def head_vectors(layer: int, capture):
  """Keys [N, D], training queries [M, D] and test queries [Q, D] float32 of one head."""
  keys = head_keys(layer, capture)
  if capture is None:
    queries = synthetic.clustered(FLAGS.keys, FLAGS.head_dim, seed=layer + 1000, shift=0.3)[None]
  else:
    groups = capture["q"].shape[1] // capture["k"].shape[1]
    queries = capture["q"][layer, :groups].astype(np.float32)  # [G, N, D]: KV head 0's query heads
  d = keys.shape[-1]
  train = queries[:, ::2].reshape(-1, d)
  if FLAGS.train_queries:
    train = train[::max(1, len(train) // FLAGS.train_queries)][:FLAGS.train_queries]
  test = queries[:, 1::16].reshape(-1, d)
  if FLAGS.test_queries:
    test = test[::max(1, len(test) // FLAGS.test_queries)][:FLAGS.test_queries]
  return keys, train, test


def parse_configs(configs: list[str]) -> list[tuple[int, int]]:
  out = []
  for c in configs:
    try:
      block, probes = (int(x) for x in c.split("x"))
    except ValueError:
      raise app.UsageError(f"--configs entry {c!r} must be BLOCKxPROBES, e.g. 256x8") from None
    if block < 1 or probes < 1:
      raise app.UsageError(f"--configs entry {c!r}: block and probes must be >= 1")
    out.append((block, probes))
  return out


def candidate_sets(keys):  # keys [N, D] -> {name: ([N, count] ids or None, seconds)}
  sets = {}
  t = time.perf_counter()
  exact = np.asarray(ops.nearest_keys(jnp.asarray(keys)[None], FLAGS.count))[0]
  sets["exact"] = (exact, time.perf_counter() - t)
  for block, probes in parse_configs(FLAGS.configs):
    t = time.perf_counter()
    ids = np.asarray(ops.block_nearest_keys(jnp.asarray(keys)[None], FLAGS.count, block=block, probes=probes))[0]
    sets[f"blocks {block}x{probes}"] = (ids, time.perf_counter() - t)
  sets["none (search-built)"] = (None, 0.0)
  return sets


def recall(ids, truth, n):  # ids [Q, >=k], truth [Q, k] -> mean share of truth found
  member = np.zeros((len(truth), n + 1), bool)
  np.put_along_axis(member, truth, True, axis=1)
  return float(np.take_along_axis(member, np.where(ids >= 0, ids, n), axis=1).sum(1).mean() / truth.shape[1])


def sampled_recall(keys, ids, sample) -> float:  # keys [N, D], ids [N, count], sample [S] -> mean share
  """Share of each sampled key's exact `count` nearest keys (NumPy brute force) that `ids` holds."""
  sq = np.einsum("nd,nd->n", keys, keys)
  found = []
  for i in sample:
    dist = sq - 2.0 * (keys @ keys[i])
    dist[i] = np.inf
    truth = np.argpartition(dist, FLAGS.count)[:FLAGS.count]
    found.append(len(set(truth.tolist()) & set(ids[i].tolist())) / FLAGS.count)
  return float(np.mean(found))


def candidates_only_rows(capture) -> list[dict]:
  rows = []
  for layer in (int(x) for x in FLAGS.layers):
    keys = head_keys(layer, capture)
    sample = np.random.default_rng(layer).choice(len(keys), min(FLAGS.candidates_only, len(keys)), replace=False)
    for block, probes in parse_configs(FLAGS.configs):
      t = time.perf_counter()
      ids = np.asarray(ops.block_nearest_keys(jnp.asarray(keys)[None], FLAGS.count, block=block, probes=probes))[0]
      row = dict(layer=layer, keys=len(keys), candidates=f"blocks {block}x{probes}",
                 candidates_s=round(time.perf_counter() - t, 2),
                 candidate_recall=round(sampled_recall(keys, ids, sample), 3), sampled_keys=len(sample))
      print(row, flush=True)
      rows.append(row)
  return rows


def main(argv):
  del argv
  parse_configs(FLAGS.configs)  # bad entries fail before any work
  capture = dict(np.load(FLAGS.capture)) if FLAGS.capture else None
  vectors = f"capture {FLAGS.capture}" if capture is not None else f"SYNTHETIC clustered vectors ({FLAGS.keys} keys)"
  if FLAGS.candidates_only > 0:
    notes = (f"{vectors}; KV head 0 of each layer; candidate_recall: the share of each of {FLAGS.candidates_only} "
             f"sampled keys' exact {FLAGS.count} nearest keys (brute force) that the block set holds. No graphs. "
             "Seconds are this machine's.")
    results_io.write_results(FLAGS.name, candidates_only_rows(capture), out_dir=FLAGS.out_dir, notes=notes)
    return
  efs = [int(e) for e in FLAGS.efs]
  rows = []
  for layer in (int(x) for x in FLAGS.layers):
    keys, train, test = head_vectors(layer, capture)
    n = len(keys)
    truth = synthetic.exact_topk(test, keys, FLAGS.k)
    sets = candidate_sets(keys)
    exact = sets["exact"][0]
    for name, (cand, seconds) in sets.items():
      t = time.perf_counter()
      index = host_index.build_index(keys, kind="roar", train_queries=train, connect_candidates=cand,
                                     threads=FLAGS.threads)
      row = dict(layer=layer, keys=n, candidates=name,
                 candidate_recall=None if cand is None else round(float(np.mean(
                     [len(set(a) & set(b)) for a, b in zip(cand, exact)])) / FLAGS.count, 3),
                 candidates_s=round(seconds, 2), build_s=round(time.perf_counter() - t, 2))
      for ef in efs:
        ids, _, scanned = index.search(test, FLAGS.k, ef=ef, threads=FLAGS.threads)
        row[f"recall_ef{ef}"] = round(recall(ids, truth, n), 4)
        row[f"scanned_ef{ef}"] = round(float(scanned.mean()) / n, 4)
      print(row, flush=True)
      rows.append(row)
  trained = f"{FLAGS.train_queries} of " if FLAGS.train_queries else ""
  notes = (f"{vectors}; KV head 0 of each layer; roar trained on {trained}every other prefill query of the head's group, "
           f"searched with up to {FLAGS.test_queries or 'all'} of every 16th of the others (recall@{FLAGS.k} against "
           "brute force). candidate_recall: the "
           f"share of the exact {FLAGS.count} nearest keys each set holds. Seconds are this machine's.")
  results_io.write_results(FLAGS.name, rows, out_dir=FLAGS.out_dir, notes=notes)


if __name__ == "__main__":
  app.run(main)
