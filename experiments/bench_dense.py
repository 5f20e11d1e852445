"""The `full` baseline on one device: prefill tokens/s, decode ms/token, effective bandwidth.

Effective bandwidth = (weight bytes + KV bytes read per decode step) / step time; the
ceiling is a large device-to-device copy measured in the same run ((read + written) / time).

    python experiments/bench_dense.py --models=smollm2,random:llama3-8b --context_lens=32768,131072

`--fill=random` skips the real prefill and fills the cache with random keys and values
(decode time does not depend on their values; rows say `fill=random`), for sizes where a
real prefill would not fit the time budget.
"""

from __future__ import annotations

import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import kvjax
from kvjax import engine
from kvjax.policies import FullAttention
from kvjax.sampling import SamplingConfig
from models.config import RopeScaling
from models.decoder import decode_layout, unstack_layers
from models.rope import rope_tables
import results_io

flags.DEFINE_list("models", ["smollm2", "random:llama3-8b"], "Models to time.")
flags.DEFINE_list("context_lens", ["32768", "131072"], "Context lengths.")
flags.DEFINE_list("batches", ["1"], "Batch sizes.")
flags.DEFINE_list("implementations", ["pallas", "xla"], "Decode attention implementations, side by side.")
LAYOUTS = ("scan", "unrolled", "fused_scan", "fused_unrolled")
flags.DEFINE_list("layouts", ["scan", "unrolled", "fused_unrolled"],
                  f"Decode parameter layouts, from {LAYOUTS}: lax.scan over stacked weights or unrolled over "
                  "per-layer weights (models.decoder.unstack_layers), with q/k/v and gate/up fused or not "
                  "(models.decoder.fuse_projections).")
flags.DEFINE_enum("fill", "real", ["real", "random"], "Prefill for real, or fill the cache with random values.")
flags.DEFINE_integer("prefill_chunk", 4096, "Prefill chunk.")
flags.DEFINE_integer("steps", 40, "Timed decode steps (after 3 warm-up steps).")
flags.DEFINE_string("dtype", "bfloat16", "Weight and KV dtype.")
flags.DEFINE_integer("copy_mib", 4096, "Size of the copy that measures the bandwidth ceiling.")
flags.DEFINE_string("out_dir", None, "Results directory (default experiments/results).")
flags.DEFINE_string("name", "bench_dense", "Results file name.")
FLAGS = flags.FLAGS


def copy_bandwidth(nbytes: int) -> float:
  """(bytes read + bytes written) / time of a large device-to-device copy, bytes/s."""
  x = jax.random.bits(jax.random.key(0), (nbytes // 4,), jnp.uint32)
  copy = jax.jit(lambda a: a ^ jnp.uint32(1))  # forces a real read and write of every element
  copy(x).block_until_ready()
  times = []
  for _ in range(20):
    t0 = time.perf_counter()
    copy(x).block_until_ready()
    times.append(time.perf_counter() - t0)
  return 2 * nbytes / statistics.median(times)


def weight_bytes_per_token(params, cfg) -> int:
  """Bytes of weights a decode step reads: everything but the embedding table, which is read
  as one row per token unless it doubles as the output projection."""
  total = sum(x.nbytes for x in jax.tree.leaves(params))
  if not cfg.tie_embeddings:
    total -= params["embed"].nbytes
  return total


def prefill(model, cfg, policy, rope, context_len: int, batch: int, capacity: int, dtype) -> tuple:
  """Fills a dense cache for `context_len` tokens: a timed real prefill, or random values."""
  state = policy.init_state(cfg, batch, capacity, dtype)
  if FLAGS.fill == "random":
    key_k, key_v = jax.random.split(jax.random.key(1))
    return type(state)(k=jax.random.normal(key_k, state.k.shape, dtype),
                       v=jax.random.normal(key_v, state.v.shape, dtype)), {}
  chunk = FLAGS.prefill_chunk
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(batch, context_len)).astype(np.int32)
  last_index = jnp.full((batch,), context_len - 1, jnp.int32)
  last_hidden = jnp.zeros((batch, cfg.hidden_size), dtype)
  t0, timed_tokens = None, 0
  for begin in range(0, context_len, chunk):
    part = jnp.asarray(tokens[:, begin : begin + chunk])
    pos = jnp.broadcast_to(jnp.arange(begin, begin + part.shape[1], dtype=jnp.int32), part.shape)
    last_hidden, state = engine.prefill_chunk(model.params, rope, part, pos, last_index, last_hidden, state,
                                              cfg=cfg, policy=policy)
    if t0 is None:  # the first chunk compiles: time the rest
      last_hidden.block_until_ready()
      t0, timed_tokens = time.perf_counter(), batch * (context_len - part.shape[1])
  last_hidden.block_until_ready()
  seconds = time.perf_counter() - t0
  return state, (dict(prefill_tok_s=round(timed_tokens / seconds, 1)) if timed_tokens else {})


def time_decode(params, cfg, policy, rope, state, context_len: int, batch: int):
  """Median seconds of one decode step after 3 warm-up steps; positions restart at context_len,
  so several implementations can be timed on one prefilled cache."""
  step = functools.partial(engine.decode_step, cfg=cfg, policy=policy, sampling=SamplingConfig())
  tokens = jnp.zeros((batch,), jnp.int32)
  times = []
  for i in range(FLAGS.steps + 3):
    positions = jnp.full((batch,), context_len + i, jnp.int32)
    t0 = time.perf_counter()
    tokens, _, state = step(params, rope, tokens, positions, state, jax.random.key(i))
    tokens.block_until_ready()
    times.append(time.perf_counter() - t0)
  return statistics.median(times[3:]), state


def run_cases(model, context_len: int, batch: int, ceiling: float) -> list[dict]:
  cfg = model.cfg
  if context_len > cfg.max_context():
    factor = 2 ** int(np.ceil(np.log2(context_len / cfg.max_position)))
    cfg = cfg.with_rope_scaling(RopeScaling("linear", float(factor), cfg.max_position))
  capacity = -(-(context_len + FLAGS.steps + 3) // 256) * 256
  rope = tuple(jnp.asarray(t) for t in rope_tables(cfg, capacity))
  dtype = jnp.dtype(FLAGS.dtype)
  base = dict(model=cfg.name, context=context_len, batch=batch, fill=FLAGS.fill)
  state, prefill_row = prefill(model, cfg, FullAttention(), rope, context_len, batch,
                               capacity, dtype)
  kv_read = 2 * cfg.num_layers * batch * cfg.num_kv_heads * (context_len + 3) * cfg.head_dim * dtype.itemsize
  w_read = weight_bytes_per_token(model.params, cfg)
  rows = []
  for layout in FLAGS.layouts:
    if layout not in LAYOUTS:
      raise app.UsageError(f"--layouts: {layout!r} is not one of {LAYOUTS}")
    # every layout but "scan" is a second copy of the weights, dropped after its rows
    if layout.startswith("fused"):
      params = decode_layout(model.params, unroll=layout == "fused_unrolled")
    else:
      params = unstack_layers(model.params) if layout == "unrolled" else model.params
    for impl in FLAGS.implementations:
      row = base | dict(impl=impl, layout=layout) | prefill_row
      try:
        seconds, state = time_decode(params, cfg, FullAttention(implementation=impl), rope, state, context_len, batch)
        effective = (kv_read + w_read) / seconds
        row |= dict(decode_ms=round(1e3 * seconds, 3), kv_gib=round(kv_read / 2**30, 2),
                    weights_gib=round(w_read / 2**30, 2), eff_tb_s=round(effective / 1e12, 3),
                    copy_tb_s=round(ceiling / 1e12, 3), pct_of_copy=round(100 * effective / ceiling, 1))
      except Exception as e:  # one failing case (e.g. out of memory) must not hide the others
        row["error"] = f"{type(e).__name__}: {e}"[:300]
      print(row, flush=True)
      rows.append(row)
    del params
  return rows


def main(argv):
  del argv
  ceiling = copy_bandwidth(FLAGS.copy_mib << 20)
  rows = []
  for name in FLAGS.models:
    model = kvjax.load_model(name, dtype=FLAGS.dtype, layout="stacked")  # the layouts are made below
    for context_len in map(int, FLAGS.context_lens):
      for batch in map(int, FLAGS.batches):
        try:
          rows += run_cases(model, context_len, batch, ceiling)
        except Exception as e:  # e.g. the prefill ran out of memory
          rows.append(dict(model=name, context=context_len, batch=batch, error=f"{type(e).__name__}: {e}"[:300]))
          print(rows[-1], flush=True)
    del model
  results_io.write_results(FLAGS.name, rows, out_dir=FLAGS.out_dir,
                           notes="Decode: median of timed steps, one token per sequence per step, greedy. "
                                 "prefill_tok_s excludes the first chunk (compilation).")


if __name__ == "__main__":
  app.run(main)
