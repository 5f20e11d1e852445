"""How host threads slow a jitted decode step that has the device to itself.

    python experiments/bench_step_contention.py --model=random:llama3-8b --context_len=8192

Prefills one prompt of random token ids per policy, then calls the jitted decode step again and
again on the same state (no host work between steps: `after_step` is never called, so the
per_step rows' buffers stay as the prefill left them) and times each call up to its token, while
other Python threads run one kind of load:

  none            nothing (first and last case: the drift of the run)
  gil1            one thread running pure Python (it holds the GIL but for forced switches)
  gil1_nice10     the same at nice 10
  gil1_switch0.5  the same with sys.setswitchinterval(0.0005) (Python's default: 0.005)
  cpu8, cpu16     8 / 16 threads in BLAS (256x256 float32 matmuls, GIL released; set
                  OPENBLAS_NUM_THREADS=1), cpu16_nice10 at nice 10
  mem8            8 threads copying --copy_mb arrays (GIL released): DRAM bandwidth

Why: in a per_step decode the exchange thread works while the device computes, and the jitted
step measured inside decode (kvjax.GenerationResult's jitted part) was 2.5x full's at 8B shapes
although the profiler showed the GPU busy about as long as full's. `--trace` also reads the
device time of each policy's quiet step from the profiler (GPU only).
"""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np
from absl import app, flags

POLICIES = {
    "full": ("full", {}),
    "retrieval_step_lag2_kv_spec": ("retrieval", dict(index="roar", roar_heads="kv", bridge="per_step", lag=2,
                                                      speculative=True)),
}

flags.DEFINE_string("model", "random:llama3-8b", "Model name.")
flags.DEFINE_integer("context_len", 8192, "Prompt tokens (random ids).")
flags.DEFINE_list("policies", list(POLICIES), f"Policies, from {list(POLICIES)}.")
flags.DEFINE_integer("steps", 40, "Timed steps per case (the median is reported).")
flags.DEFINE_integer("copy_mb", 256, "Size of the arrays the mem8 threads copy (each thread holds two).")
flags.DEFINE_boolean("trace", False, "GPU only: also the device busy time of a quiet step from the profiler.")
flags.DEFINE_string("out_dir", None, "Results directory.")
flags.DEFINE_string("name", "bench_step_contention", "Results file name.")
FLAGS = flags.FLAGS


def _blas(stop: threading.Event) -> None:
  a = np.random.default_rng(1).standard_normal((256, 256)).astype(np.float32)
  while not stop.is_set():
    a = np.tanh(a @ a)


def _python(stop: threading.Event) -> None:
  x = 0
  while not stop.is_set():
    x += 1


def _copies(stop: threading.Event) -> None:
  a = np.ones(FLAGS.copy_mb << 18, np.float32)
  b = np.empty_like(a)
  while not stop.is_set():
    np.copyto(b, a)


def _niced(load, nice: int):
  def run(stop):
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    load(stop)
  return run


# case -> (threads, load, switch interval or None)
CASES = {
    "none": (0, None, None),
    "gil1": (1, _python, None),
    "gil1_nice10": (1, _niced(_python, 10), None),
    "gil1_switch0.5": (1, _python, 0.0005),
    "cpu8": (8, _blas, None),
    "cpu16": (16, _blas, None),
    "cpu16_nice10": (16, _niced(_blas, 10), None),
    "mem8": (8, _copies, None),
    "none_again": (0, None, None),
}


def time_under_load(step, steps: int, threads: int, load, interval) -> float:
  """Median ms of `step()` while `threads` threads run `load`."""
  stop = threading.Event()
  workers = [threading.Thread(target=load, args=(stop,), daemon=True) for _ in range(threads)]
  default = sys.getswitchinterval()
  if interval is not None:
    sys.setswitchinterval(interval)
  for w in workers:
    w.start()
  times = []
  try:
    for _ in range(steps):
      t0 = time.perf_counter()
      step()
      times.append(1e3 * (time.perf_counter() - t0))
  finally:
    stop.set()
    for w in workers:
      w.join()
    sys.setswitchinterval(default)
  return round(float(np.median(times)), 3)


def main(argv):
  del argv
  import jax
  import jax.numpy as jnp

  import kvjax
  import results_io
  from kvjax import engine
  from kvjax.sampling import SamplingConfig
  from models.rope import rope_tables

  unknown = sorted(set(FLAGS.policies) - set(POLICIES))
  if unknown:
    raise app.UsageError(f"unknown --policies {unknown}; known: {list(POLICIES)}")
  if FLAGS.trace and jax.default_backend() != "gpu":
    raise app.UsageError("--trace reads GPU kernels from a profiler trace: it needs a GPU")
  model = kvjax.load_model(FLAGS.model, dtype="bfloat16" if jax.default_backend() == "gpu" else "float32")
  cfg = model.cfg
  prompt = [int(t) for t in np.random.default_rng(0).integers(0, cfg.vocab_size, size=FLAGS.context_len)]
  rows = []
  for key in FLAGS.policies:
    name, options = POLICIES[key]
    context = kvjax.prefill(model, [prompt], max_new_tokens=8, policy=name, policy_options=options)
    box = {"state": engine.committed(context.state)}
    context.state = None  # donated below
    rope = tuple(jnp.asarray(t) for t in rope_tables(cfg, context.capacity))
    tokens, positions = jnp.zeros((1,), jnp.int32), jnp.asarray(context.prompt_lengths, jnp.int32)
    key0, sampling = jax.random.key(0), SamplingConfig()

    def step():
      out, _, box["state"] = engine.decode_step(model.params, rope, tokens, positions, box["state"], key0, cfg=cfg,
                                                policy=context.policy, sampling=sampling)
      np.asarray(out)  # waits for the step, as kvjax.decode does

    for _ in range(5):  # compile and warm up
      step()
    row = dict(model=cfg.name, policy=key, context=FLAGS.context_len)
    for case, (threads, load, interval) in CASES.items():
      row[f"{case}_ms"] = time_under_load(step, FLAGS.steps, threads, load, interval)
    if FLAGS.trace:
      import gpu_trace
      events = gpu_trace.traced(lambda: [step() for _ in range(6)])
      row["gpu_busy_ms"] = round(gpu_trace.busy_ns(events) / 6e6, 3)
      row["kernels_per_step"] = round(len(events) / 6, 1)
    print(row, flush=True)
    rows.append(row)
    results_io.write_results(FLAGS.name, rows, out_dir=FLAGS.out_dir, notes=(
        "Median ms of the jitted decode step (up to its token) called again and again on one prefilled state, "
        "under each host load (see the script's docstring); random weights, random token ids."))
    context.close()


if __name__ == "__main__":
  app.run(main)
