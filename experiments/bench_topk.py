"""What the prefill's device top-k ops cost, per key chunk size, side by side.

    python experiments/bench_topk.py --keys=131072 --block_n=16384,65536,0

A roar build at 128K keys a head takes two device results before it starts (kvjax.policies
.retrieval): each training query's exact top-100 keys (`ops.exact_topk`, 4,096 queries per
query head) and each key's 64 nearest keys (`ops.nearest_keys`, every key a query). Both scan
the keys in chunks of `block_n` and take each chunk's top-k in two stages (ops/topk.py), whose
sorted values a row fall as the chunk grows, ~2 N sqrt(k / block_n), while a chunk's scores
[heads, block_q, block_n] float32 grow with it. Rows: median wall seconds of a jitted call
(after a warm-up call) for one layer's heads, per op and block_n; `same_ids` checks every
setting against the first. Vectors: synthetic clusters (host_index.synthetic.clustered);
times depend on the shapes only.
"""

from __future__ import annotations

import time

import jax.numpy as jnp
import numpy as np
from absl import app, flags

import ops
import results_io
from host_index.synthetic import clustered

flags.DEFINE_integer("keys", 131072, "Keys per KV head.")
flags.DEFINE_integer("kv_heads", 3, "KV heads (one layer's).")
flags.DEFINE_integer("q_heads", 9, "Query heads (exact_topk's training queries).")
flags.DEFINE_integer("head_dim", 64, "Head dimension.")
flags.DEFINE_integer("train_queries", 4096, "Training queries per query head.")
flags.DEFINE_integer("train_topk", 100, "exact_topk's k (roar's N_q).")
flags.DEFINE_integer("neighbours", 64, "nearest_keys' count (retrieval's CONNECT_CANDIDATES).")
flags.DEFINE_list("block_n", ["16384", "65536", "0"], "Key chunk sizes compared (0: the ops' default, every key).")
flags.DEFINE_integer("block_q", 0, "Queries per block (0: the ops' default, which keeps a block's scores "
                     "within 2^28 floats).")
flags.DEFINE_integer("repeats", 3, "Timed calls per setting (after one warm-up).")
flags.DEFINE_string("out_dir", None, "Results directory.")
flags.DEFINE_string("name", "bench_topk", "Results file name.")
FLAGS = flags.FLAGS


def timed(fn) -> tuple[float, float, np.ndarray]:
  """(seconds of the warm-up call (compiling), median seconds of FLAGS.repeats calls after it,
  the ids of the last)."""
  t0 = time.perf_counter()
  ids = np.asarray(fn())
  first = time.perf_counter() - t0
  seconds = []
  for _ in range(FLAGS.repeats):
    t0 = time.perf_counter()
    ids = np.asarray(fn())  # the copy to the host ends the call (ids are what the builds take)
    seconds.append(time.perf_counter() - t0)
  return first, float(np.median(seconds)), ids


def main(argv):
  del argv
  try:
    blocks = [int(b) for b in FLAGS.block_n]
  except ValueError:
    raise app.UsageError(f"--block_n must be integers: {FLAGS.block_n}") from None
  if min(blocks) < 0:
    raise app.UsageError(f"--block_n values must be >= 0: {FLAGS.block_n}")
  H, Hq, N, D = FLAGS.kv_heads, FLAGS.q_heads, FLAGS.keys, FLAGS.head_dim
  keys = jnp.asarray(np.stack([clustered(N, D, seed=h) for h in range(H)]))  # [H, N, D]
  queries = jnp.asarray(np.stack([clustered(FLAGS.train_queries, D, seed=100 + h, shift=0.5, spread=1.5)
                                  for h in range(Hq)]))  # [Hq, M, D]
  cases = {
      "nearest_keys": lambda bn: ops.nearest_keys(keys, FLAGS.neighbours, block_q=FLAGS.block_q or None,
                                                  block_n=bn),
      "exact_topk": lambda bn: ops.exact_topk(queries, keys, FLAGS.train_topk, block_q=FLAGS.block_q or None,
                                              block_n=bn)[1],
  }
  rows = []
  for op, call in cases.items():
    first = None
    for bn in blocks:
      first_seconds, seconds, ids = timed(lambda: call(bn or None))
      first = ids if first is None else first
      rows.append(dict(op=op, keys=N, kv_heads=H, q_heads=Hq, head_dim=D, block_q=FLAGS.block_q or "default",
                       block_n=bn or "all",
                       k=FLAGS.neighbours if op == "nearest_keys" else FLAGS.train_topk,
                       seconds=round(seconds, 4), first_seconds=round(first_seconds, 3),
                       same_ids=bool(np.array_equal(ids, first))))
      print(rows[-1], flush=True)
  notes = (f"One layer's heads: nearest_keys over {H} KV heads of {N} keys ({D} dims; every key a query), "
           f"exact_topk of {FLAGS.train_queries} queries per query head ({Hq}) over them. seconds: median of "
           f"{FLAGS.repeats} jitted calls after a warm-up, the ids copied to the host; first_seconds: the "
           f"warm-up call (compiling included); same_ids: equal to the "
           f"first block_n's. Synthetic clustered vectors.")
  results_io.write_results(FLAGS.name, rows, out_dir=FLAGS.out_dir, notes=notes)


if __name__ == "__main__":
  app.run(main)
