"""Where a dense decode step's time goes on the GPU: per-kernel device time from a profiler trace.

    python experiments/profile_decode.py --model=random:llama3-8b --context_len=131072 --layout=fused_unrolled

Fills a `full` cache with random keys and values (decode time does not depend on them), runs
`--steps` decode steps under `jax.profiler.trace`, reads the trace back with
`jax.profiler.ProfileData` and reports, per step: wall time, the time some kernel was running
on the GPU (the union of kernel intervals), the idle rest, and the kernels grouped by name
(count per step, µs per step, share). Idle time is launch and host overhead the step could
lose; kernel time is what better kernels could win.
"""

from __future__ import annotations

import functools
import statistics
import time

import jax
import jax.numpy as jnp
from absl import app, flags

import kvjax
from kvjax import engine
from kvjax.policies import FullAttention
from kvjax.sampling import SamplingConfig
from models.config import RopeScaling
from models.decoder import decode_layout, unstack_layers
from models.rope import rope_tables
import gpu_trace
import results_io

flags.DEFINE_string("model", "random:llama3-8b", "Model name.")
flags.DEFINE_integer("context_len", 131072, "Tokens in the cache.")
flags.DEFINE_enum("layout", "fused_unrolled", ["scan", "unrolled", "fused_unrolled"], "Parameter layout.")
flags.DEFINE_enum("implementation", "pallas", ["pallas", "xla"], "Decode attention implementation.")
flags.DEFINE_integer("steps", 10, "Traced decode steps (after 3 untraced warm-up steps).")
flags.DEFINE_integer("top", 25, "Kernel groups listed.")
flags.DEFINE_string("dtype", "bfloat16", "Weight and KV dtype.")
flags.DEFINE_string("out_dir", None, "Results directory.")
flags.DEFINE_string("name", None, "Results file name (default profile_decode_<layout>).")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  model = kvjax.load_model(FLAGS.model, dtype=FLAGS.dtype, layout="stacked")
  cfg = model.cfg
  n = FLAGS.context_len
  if n + FLAGS.steps + 3 > cfg.max_context():
    factor = 2.0 ** int(jnp.ceil(jnp.log2((n + FLAGS.steps + 3) / cfg.max_position)))
    cfg = cfg.with_rope_scaling(RopeScaling("linear", factor, cfg.max_position))
  capacity = -(-(n + FLAGS.steps + 3) // 256) * 256
  rope = tuple(jnp.asarray(t) for t in rope_tables(cfg, capacity))
  if FLAGS.layout == "scan":
    params = model.params
  else:
    params = unstack_layers(model.params) if FLAGS.layout == "unrolled" else decode_layout(model.params, unroll=True)
  policy = FullAttention(implementation=FLAGS.implementation)
  state = policy.init_state(cfg, 1, capacity, jnp.dtype(FLAGS.dtype))
  kk, kv = jax.random.split(jax.random.key(1))
  state = type(state)(k=jax.random.normal(kk, state.k.shape, state.k.dtype),
                      v=jax.random.normal(kv, state.v.shape, state.v.dtype))
  step = functools.partial(engine.decode_step, cfg=cfg, policy=policy, sampling=SamplingConfig())
  tokens = jnp.zeros((1,), jnp.int32)

  def run(i, tokens, state):
    return step(params, rope, tokens, jnp.full((1,), n + i, jnp.int32), state, jax.random.key(i))

  for i in range(3):
    tokens, _, state = run(i, tokens, state)
  tokens.block_until_ready()
  walls = []

  def traced_steps():
    nonlocal tokens, state
    for i in range(3, 3 + FLAGS.steps):
      t0 = time.perf_counter()
      tokens, _, state = run(i, tokens, state)
      tokens.block_until_ready()
      walls.append(time.perf_counter() - t0)

  events = gpu_trace.traced(traced_steps)
  trace_summary, rows = gpu_trace.kernel_table(events, FLAGS.steps, FLAGS.top)
  summary = dict(model=cfg.name, context=n, layout=FLAGS.layout, impl=FLAGS.implementation,
                 wall_ms_median=round(1e3 * statistics.median(walls), 3), **trace_summary)
  print(summary, flush=True)
  for row in rows:
    print(row)
  results_io.write_results(FLAGS.name or f"profile_decode_{FLAGS.layout}", [summary] + rows,
                           out_dir=FLAGS.out_dir,
                           notes="First row: per-step summary (trace span / busy = union of kernel intervals / "
                                 "idle = span - busy). Other rows: kernels grouped by name, per decode step.")


if __name__ == "__main__":
  app.run(main)
