"""The CPU path of a retrieval prefill's training top-k (each training query's exact top-100
keys, roar's links), three ways side by side on the same vectors:

    python experiments/bench_train_topk.py --keys=8000 --train_queries=4096

  topk_rows     what the prefill runs (retrieval._train_topk on a CPU backend): BLAS scores
                of a block of queries, then host_index.topk_rows (threaded C);
  argpartition  the NumPy path it replaced: BLAS scores, np.argpartition, then a sort of the k;
  flat_search   host_index's exact index (kind="flat"): a scan of every key per query, in C.

One layer's query heads (Qwen2.5-0.5B's shapes by default: 14 query heads over 2 KV heads,
head_dim 64) over random Gaussian vectors; the work does not depend on the vectors' values
beyond ties. Each method's id lists are compared with topk_rows' (the share of equal ids:
only exact score ties may differ). On an accelerator the prefill runs ops.exact_topk on the
device instead; this is the CPU user's (and CI's) prefill.
"""

from __future__ import annotations

import statistics
import time

import jax
import numpy as np
from absl import app, flags

import host_index
from kvjax.host_runtime import available_cores
from kvjax.policies.retrieval import _train_topk
import results_io

flags.DEFINE_list("keys", ["8000"], "Keys per KV head (the prompt's length).")
flags.DEFINE_integer("train_queries", 4096, "Training queries per query head.")
flags.DEFINE_integer("q_heads", 14, "Query heads.")
flags.DEFINE_integer("kv_heads", 2, "KV heads.")
flags.DEFINE_integer("head_dim", 64, "Head dimension.")
flags.DEFINE_integer("topk", 100, "Keys per training query.")
flags.DEFINE_integer("repeats", 3, "Timed runs of each method (median reported).")
flags.DEFINE_string("out_dir", None, "Results directory.")
flags.DEFINE_string("name", "bench_train_topk", "Results file name.")
FLAGS = flags.FLAGS


def argpartition_topk(queries, keys, k: int, block: int = 1024) -> np.ndarray:
  """[Hq, M, k]: the NumPy path of _train_topk before host_index.topk_rows."""
  groups = queries.shape[0] // keys.shape[0]
  out = np.empty(queries.shape[:2] + (k,), np.int32)
  for h in range(queries.shape[0]):
    for start in range(0, queries.shape[1], block):
      s = queries[h, start:start + block] @ keys[h // groups].T
      part = np.argpartition(-s, k - 1, axis=1)[:, :k]
      order = np.argsort(-np.take_along_axis(s, part, axis=1), axis=1, kind="stable")
      out[h, start:start + block] = np.take_along_axis(part, order, axis=1)
  return out


def flat_search_topk(queries, keys, k: int) -> np.ndarray:
  groups = queries.shape[0] // keys.shape[0]
  out = np.empty(queries.shape[:2] + (k,), np.int32)
  for h in range(queries.shape[0]):
    out[h] = host_index.build_index(keys[h // groups], kind="flat").search(queries[h], k)[0]
  return out


METHODS = {"topk_rows": _train_topk, "argpartition": argpartition_topk, "flat_search": flat_search_topk}


def main(argv):
  del argv
  if jax.default_backend() != "cpu":
    raise app.UsageError("run with JAX_PLATFORMS=cpu: on an accelerator _train_topk runs on the device")
  rng = np.random.default_rng(0)
  rows = []
  for n in (int(x) for x in FLAGS.keys):
    queries = rng.standard_normal((FLAGS.q_heads, FLAGS.train_queries, FLAGS.head_dim), dtype=np.float32)
    keys = rng.standard_normal((FLAGS.kv_heads, n, FLAGS.head_dim), dtype=np.float32)
    reference = None
    for method, fn in METHODS.items():
      times = []
      for _ in range(FLAGS.repeats):
        t0 = time.perf_counter()
        ids = fn(queries, keys, FLAGS.topk)
        times.append(time.perf_counter() - t0)
      reference = ids if reference is None else reference
      rows.append(dict(method=method, keys=n, train_queries=FLAGS.train_queries, q_heads=FLAGS.q_heads,
                       kv_heads=FLAGS.kv_heads, head_dim=FLAGS.head_dim, topk=FLAGS.topk, host_cores=available_cores(),
                       seconds=round(statistics.median(times), 4), runs=" ".join(f"{t:.3f}" for t in times),
                       ns_per_score=round(statistics.median(times) * 1e9 / (queries.shape[0] * queries.shape[1] * n),
                                          3),
                       equal_ids_vs_topk_rows=round(float((ids == reference).mean()), 6)))
      print(rows[-1], flush=True)
    first = next(r for r in rows if r["keys"] == n and r["method"] == "topk_rows")
    for r in rows:
      if r["keys"] == n:
        r["vs_topk_rows"] = round(r["seconds"] / first["seconds"], 2)
  results_io.write_results(
      FLAGS.name, rows, out_dir=FLAGS.out_dir,
      notes=f"One layer's training top-{FLAGS.topk} on the CPU, random Gaussian vectors; seconds: median of "
            f"{FLAGS.repeats} runs (runs: each); ns_per_score: per query-key score; vs_topk_rows: time against "
            "the prefill's path; equal_ids_vs_topk_rows: the share of ids equal to its lists (exact ties may "
            "differ: topk_rows gives a tie to the lower key id).")


if __name__ == "__main__":
  app.run(main)
