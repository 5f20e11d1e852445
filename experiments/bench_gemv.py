"""Why does the dense decode step read its weights far below copy bandwidth? Time one decode
GEMV ([batch, 4096] x [4096, 14336], bf16) in the ways the decoder could write it.

    python experiments/bench_gemv.py                     # XLA's default GEMM choice
    XLA_FLAGS=--xla_gpu_enable_triton_gemm=false python experiments/bench_gemv.py
"""

from __future__ import annotations

import os
import statistics
import time

import jax
import jax.numpy as jnp
from absl import app, flags

import results_io

flags.DEFINE_integer("layers", 32, "Distinct weight matrices cycled (defeats the L2 cache).")
flags.DEFINE_string("name", "bench_gemv", "Results file name.")
flags.DEFINE_string("out_dir", None, "Results directory.")
FLAGS = flags.FLAGS

VARIANTS = {
    "einsum_f32_acc": lambda x, w: jnp.einsum("BI,IO->BO", x, w, preferred_element_type=jnp.float32).astype(x.dtype),
    "dot_bf16": lambda x, w: jnp.dot(x, w),
    "dot_wT": lambda x, wt: jnp.einsum("BI,OI->BO", x, wt, preferred_element_type=jnp.float32).astype(x.dtype),
}


def timed(fn, *args, reps=30):
  out = fn(*args)
  jax.block_until_ready(out)
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def main(argv):
  del argv
  key = jax.random.key(0)
  hidden, inter = 4096, 14336
  w = jax.random.normal(key, (FLAGS.layers, hidden, inter), jnp.bfloat16)
  wt = jnp.swapaxes(w, 1, 2).copy()
  rows = []
  for batch in (1, 8):
    x = jax.random.normal(key, (batch, hidden), jnp.bfloat16)
    for name, op in VARIANTS.items():
      weights = wt if name == "dot_wT" else w

      @jax.jit
      def chain(x, per_layer, op=op):  # separate arrays per layer, as unstack_layers gives
        total = 0.0
        for wl in per_layer:
          total = total + op(x, wl)[:, :1].astype(jnp.float32).sum()
        return total

      per_layer = [weights[i] for i in range(FLAGS.layers)]
      seconds = timed(chain, x, per_layer)
      bytes_read = weights.nbytes
      rows.append(dict(variant=name, batch=batch, xla_flags=os.environ.get("XLA_FLAGS", ""),
                       us_per_gemv=round(1e6 * seconds / FLAGS.layers, 2),
                       tb_s=round(bytes_read / seconds / 1e12, 3)))
      print(rows[-1], flush=True)
  results_io.write_results(FLAGS.name, rows, out_dir=FLAGS.out_dir)


if __name__ == "__main__":
  app.run(main)
