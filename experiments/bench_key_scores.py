"""What does scoring every page cost a freekv step? Times page_selection.layer_scores (all layers of
one step, as after_layers calls it) for each page summary: FreeKV's min/max bound and key codes
of 2 / 4 bits, the latter through the Pallas kernel and through XLA.

    python experiments/bench_key_scores.py                      # 8B shapes, 32K and 128K, batch 1 and 4
    python experiments/bench_key_scores.py --contexts=1048576 --batches=1
    python experiments/bench_key_scores.py --block_bytes=8192,16384,32768 --num_warps=4,8   # kernel sweep

The inputs are random draws (codes uniform over their bytes, bounds and queries Gaussian): the
work and the bytes read do not depend on the values. read_GBps = the summary's bytes / time.
"""

from __future__ import annotations

import itertools
import statistics
import time

import jax
import jax.numpy as jnp
from absl import app, flags

import ops
import results_io
from kvjax.policies import page_selection, page_summary

flags.DEFINE_list("contexts", ["32768", "131072"], "Tokens per sequence held as pages.")
flags.DEFINE_list("batches", ["1", "4"], "Sequences.")
flags.DEFINE_list("summaries", list(page_summary.SUMMARIES), "Page summaries (minmax, keys2, keys4).")
flags.DEFINE_list("implementations", ["pallas", "xla"], "Key-code scorers (min/max is always XLA).")
flags.DEFINE_list("block_bytes", [], "Kernel sweep: code bytes per program (empty: the kernel's default only).")
flags.DEFINE_list("num_warps", [], "Kernel sweep: warps per program (empty: the kernel's default only).")
flags.DEFINE_integer("layers", 32, "Layers scored per step.")
flags.DEFINE_integer("q_heads", 32, "Query heads.")
flags.DEFINE_integer("kv_heads", 8, "KV heads.")
flags.DEFINE_integer("head_dim", 128, "Head dim.")
flags.DEFINE_integer("page_size", 32, "Tokens per page.")
flags.DEFINE_integer("reps", 20, "Timed calls per row (median).")
flags.DEFINE_string("name", "bench_key_scores", "Results file name.")
flags.DEFINE_string("out_dir", None, "Results directory.")
FLAGS = flags.FLAGS


def _summary(rng, kind: str, L: int, B: int, H: int, N: int, P: int, D: int) -> tuple:
  """A random summary in freekv's layout: (kmax, kmin) [L, B, H, N, D] bf16 or (codes
  [L, B, H, N, P, D * bits / 8] uint8, lo, step [L, B, H, D] f32)."""
  bits = page_summary.bits_of(kind)
  if not bits:
    kmin = jax.random.normal(rng, (L, B, H, N, D), jnp.bfloat16)
    return kmin + jnp.bfloat16(1.0), kmin
  codes = jax.random.randint(rng, (L, B, H, N, P, D * bits // 8), 0, 256, jnp.int32).astype(jnp.uint8)
  lo = jax.random.normal(rng, (L, B, H, D), jnp.float32)
  return codes, lo, jnp.full((L, B, H, D), 0.1, jnp.float32)


def _median_ms(fn, *args) -> float:
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(FLAGS.reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return 1e3 * statistics.median(times)


def _kernel_configs() -> list[tuple[int | None, int | None]]:
  """(block_bytes, num_warps) pairs to time; (None, None) is the default freekv uses."""
  sweep = list(itertools.product([int(b) for b in FLAGS.block_bytes] or [None],
                                 [int(w) for w in FLAGS.num_warps] or [None]))
  return [(None, None)] + [c for c in sweep if c != (None, None)]


def _swept_scores(q, summary, *, scale: float, block_bytes: int, num_warps: int):
  """page_selection.layer_scores' Pallas call (layers folded into the batch) with a kernel config."""
  codes, lo, step = summary
  L, B = q.shape[:2]
  flat = lambda x: x.reshape((L * B,) + x.shape[2:])
  bits = 8 * codes.shape[-1] // q.shape[-1]
  return ops.key_page_scores(flat(q), flat(codes), flat(lo), flat(step), bits=bits, scale=scale,
                             block_bytes=block_bytes, num_warps=num_warps)


def main(argv):
  del argv
  L, Hq, H, D, P = FLAGS.layers, FLAGS.q_heads, FLAGS.kv_heads, FLAGS.head_dim, FLAGS.page_size
  rows = []
  for context in map(int, FLAGS.contexts):
    N = context // P
    for B in map(int, FLAGS.batches):
      q = jax.random.normal(jax.random.key(1), (L, B, Hq, D), jnp.float32)
      for kind in FLAGS.summaries:
        summary = _summary(jax.random.key(2), kind, L, B, H, N, P, D)
        nbytes = sum(x.size * x.dtype.itemsize for x in summary)
        impls = FLAGS.implementations if page_summary.bits_of(kind) else ["xla"]
        for impl in impls:
          for block_bytes, num_warps in _kernel_configs() if impl == "pallas" else [(None, None)]:
            if block_bytes is None and num_warps is None:  # exactly what a freekv step calls
              fn = jax.jit(lambda q, s, impl=impl: page_selection.layer_scores(q, s, scale=D**-0.5, implementation=impl))
            else:
              fn = jax.jit(lambda q, s, bb=block_bytes, nw=num_warps: _swept_scores(
                  q, s, scale=D**-0.5, block_bytes=bb, num_warps=nw))
            ms = _median_ms(fn, q, summary)
            row = dict(context=context, batch=B, summary=kind, implementation=impl,
                       block_bytes=block_bytes or "default", num_warps=num_warps or "default", ms=round(ms, 3),
                       summary_bytes=nbytes, read_GBps=round(nbytes / ms / 1e6, 1))
            print(row, flush=True)
            rows.append(row)
      del summary
  notes = (f"page_selection.layer_scores over {L} layers, {Hq} query / {H} KV heads, head_dim {D}, pages of {P}: "
           "the per-head page scores one step's selection needs. Random inputs; median of "
           f"{FLAGS.reps} calls after a warm-up; read_GBps = summary bytes / time.")
  results_io.write_results(FLAGS.name, rows, out_dir=FLAGS.out_dir, notes=notes)


if __name__ == "__main__":
  app.run(main)
