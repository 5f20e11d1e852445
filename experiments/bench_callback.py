"""What one host callback costs inside a jitted decode-like program, by how it is called.

    python experiments/bench_callback.py --layers=32

The retrieval policies make one `jax.pure_callback` per layer per step. bench_decode shows
far more time per step than the callbacks' own Python bodies take (SmolLM2 8K: ~0.7 ms per
callback outside the body). This isolates the bridge: a program of `--layers` dependent
rounds, each a small matmul on the device (the layer) followed by a callback whose host body
is trivial (a copy of its query), timed per variant:

  * `separate`: the retrieval bridge's shape — 7 operands (ids, layer, query [B, Hq, D] f32,
    evicted k/v [B, Hkv, D] bf16, evicted q, positions) and 3 results (o, lse, status);
  * `packed`: the same bytes in one f32 operand and one f32 result;
  * `no_callback`: the device work alone (the floor);
with layers under `lax.scan` and unrolled, and XLA command buffers on (default) and off.
Rows: ms per program, ms per callback over the floor, and the Python body's own time.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

flags.DEFINE_integer("layers", 32, "Dependent rounds (callbacks) per program.")
flags.DEFINE_integer("reps", 30, "Timed programs per variant (median).")
flags.DEFINE_string("out_dir", None, "Results directory.")
flags.DEFINE_string("name", "bench_callback", "Results file name.")
FLAGS = flags.FLAGS

B, HQ, HKV, D, HIDDEN = 1, 32, 8, 128, 4096  # Llama-3-8B attention shapes
BODY_SECONDS = []  # time inside the Python bodies, appended by the callbacks


def _separate_body(runtime_id, layer, q, ek, ev, eq, pos):
  t0 = time.perf_counter()
  o = np.array(q, np.float32)
  lse = np.zeros(q.shape[:2], np.float32)
  BODY_SECONDS.append(time.perf_counter() - t0)
  return o, lse, np.int32(0)


def _packed_body(packed):
  t0 = time.perf_counter()
  out = np.array(packed[..., : HQ * D + HQ + 1], np.float32)
  BODY_SECONDS.append(time.perf_counter() - t0)
  return out


def _round(variant, w, x, layer):
  """One layer: x [B, HIDDEN] -> a device matmul -> (the callback) -> x for the next layer."""
  h = jnp.tanh(x @ w)  # [B, HIDDEN]
  q = h[:, : HQ * D].reshape(B, HQ, D).astype(jnp.float32)
  if variant == "no_callback":
    return x + h
  ek = h[:, : HKV * D].reshape(B, HKV, D).astype(jnp.bfloat16)
  if variant == "separate":
    shapes = (jax.ShapeDtypeStruct((B, HQ, D), jnp.float32), jax.ShapeDtypeStruct((B, HQ), jnp.float32),
              jax.ShapeDtypeStruct((), jnp.int32))
    o, lse, status = jax.pure_callback(_separate_body, shapes, jnp.int32(1), layer, q, ek, ek, q,
                                       jnp.zeros((B,), jnp.int32), vmap_method="sequential")
    back = o.reshape(B, HQ * D) + lse.sum() + status
  else:
    packed = jnp.concatenate([q.reshape(B, -1), ek.reshape(B, -1).astype(jnp.float32),
                              ek.reshape(B, -1).astype(jnp.float32), q.reshape(B, -1),
                              jnp.zeros((B, 2), jnp.float32)], axis=1)
    out = jax.pure_callback(_packed_body, jax.ShapeDtypeStruct((B, HQ * D + HQ + 1), jnp.float32), packed,
                            vmap_method="sequential")
    back = out[:, : HQ * D] + out[:, HQ * D:].sum()
  return x + back.astype(x.dtype)


def program(variant: str, layout: str, command_buffers: bool):
  def run(ws, x):
    if layout == "scan":
      def body(x, args):
        w, layer = args
        return _round(variant, w, x, layer), None
      x, _ = jax.lax.scan(body, x, (ws, jnp.arange(ws.shape[0], dtype=jnp.int32)))
      return x
    for layer in range(ws.shape[0]):
      x = _round(variant, ws[layer], x, jnp.int32(layer))
    return x
  options = None if command_buffers else {"xla_gpu_enable_command_buffer": ""}
  return jax.jit(run, compiler_options=options)


def time_variant(fn, ws, x, reps):
  fn(ws, x).block_until_ready()  # compile
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    fn(ws, x).block_until_ready()
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def main(argv):
  del argv
  import results_io

  L = FLAGS.layers
  key = jax.random.PRNGKey(0)
  ws = (jax.random.normal(key, (L, HIDDEN, HIDDEN), jnp.float32) * HIDDEN**-0.5).astype(jnp.bfloat16)
  x = jax.random.normal(key, (B, HIDDEN), jnp.bfloat16)
  rows = []
  for layout in ("scan", "unrolled"):
    for command_buffers in (True, False):
      floor = None
      for variant in ("no_callback", "separate", "packed"):
        BODY_SECONDS.clear()
        seconds = time_variant(program(variant, layout, command_buffers), ws, x, FLAGS.reps)
        if variant == "no_callback":
          floor = seconds
        body_ms = 1e3 * float(np.median(BODY_SECONDS)) if BODY_SECONDS else None
        row = dict(layout=layout, command_buffers=command_buffers, variant=variant, layers=L,
                   ms_per_program=round(1e3 * seconds, 3),
                   ms_per_callback_over_floor=None if variant == "no_callback" else round(1e3 * (seconds - floor) / L, 4),
                   body_ms=None if body_ms is None else round(body_ms, 4))
        print(row, flush=True)
        rows.append(row)
        results_io.write_results(FLAGS.name, rows, out_dir=FLAGS.out_dir,
                                 notes="Floor = the same program without callbacks; body_ms = median time "
                                       "inside one callback's Python body.")


if __name__ == "__main__":
  app.run(main)
