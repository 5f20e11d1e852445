"""Decode throughput and per-token latency with the KV heads sharded over N devices of one host.

    python experiments/bench_scale.py --devices=4 --context_len=32768 --batch=1
    python experiments/bench_scale.py --devices=1,2,4,8 --policies=full,retrieval,freekv

For each device count the model is loaded sharded (`kvjax.load_model(..., devices=N)`, see
kvjax.sharding) and every policy prefills the same random prompt(s) and decodes `--steps`
tokens. Rows: decode_ms (median per-token step latency, first step dropped), tokens_per_s
(batch / decode_ms), prefill_and_index_s, the policy state's bytes over all devices, and the
host callbacks per step (one per sparse layer per device). Random weights: timing only.

On a CPU it runs with simulated devices (`jax_num_cpu_devices` is set to the largest
--devices), which proves the program, not its speed: do not record CPU numbers as results.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np
from absl import app, flags

POLICIES = {
    "full": ("full", {}),
    "retrieval": ("retrieval", {}),
    "retrieval_spec": ("retrieval", {"speculative": True}),
    "freekv": ("freekv", {}),
}

flags.DEFINE_string("model", "random:llama3-8b", "Model name (its KV heads must be divisible by --devices).")
flags.DEFINE_list("devices", ["1"], "Device counts to shard the KV heads over (1 = the unsharded path).")
flags.DEFINE_list("policies", ["full"], f"Policies, from {list(POLICIES)}.")
flags.DEFINE_integer("context_len", 32768, "Prompt length.")
flags.DEFINE_integer("batch", 1, "Sequences decoded together.")
flags.DEFINE_integer("steps", 32, "Decode steps per policy.")
flags.DEFINE_string("dtype", "bfloat16", "Weight and KV dtype.")
flags.DEFINE_string("index", "graph", "Host index of the retrieval policies.")
flags.DEFINE_integer("retrieval_topk", 100, "Top-k of the retrieval policies.")
flags.DEFINE_integer("sinks", None, "Device-resident first tokens of the sparse policies (default: theirs).")
flags.DEFINE_integer("window", None, "Device-resident recent tokens of the sparse policies (default: theirs).")
flags.DEFINE_integer("budget", None, "freekv's token budget (default: its own).")
flags.DEFINE_integer("prefill_chunk", 4096, "Prefill chunk.")
flags.DEFINE_string("out_dir", None, "Results directory.")
flags.DEFINE_string("name", "bench_scale", "Results file name.")
FLAGS = flags.FLAGS
NOTES = ("Heads sharded over N devices (kvjax.sharding): tensor-parallel weights, two all-reduces per layer. "
         "Random weights: latency only. decode_ms is the median step after the first; tokens_per_s = batch / "
         "decode_ms.")


def policy_options(name: str, options: dict) -> dict:
  options = dict(options)
  if name == "retrieval":
    options |= dict(index=FLAGS.index, topk=FLAGS.retrieval_topk)
  if name in ("retrieval", "freekv"):
    options |= {k: getattr(FLAGS, k) for k in ("sinks", "window") if getattr(FLAGS, k) is not None}
  if name == "freekv" and FLAGS.budget is not None:
    options["budget"] = FLAGS.budget
  return options


def run(model, devices: int, key: str) -> dict:
  import kvjax

  name, options = POLICIES[key]
  rng = np.random.default_rng(FLAGS.context_len + FLAGS.batch)
  prompts = [[int(t) for t in rng.integers(0, model.cfg.vocab_size, size=FLAGS.context_len)]
             for _ in range(FLAGS.batch)]
  t0 = time.perf_counter()
  context = kvjax.prefill(model, prompts, max_new_tokens=FLAGS.steps, policy=name,
                          policy_options=policy_options(name, options), prefill_chunk=FLAGS.prefill_chunk)
  prefill_total = time.perf_counter() - t0
  result = kvjax.decode(model, context, max_new_tokens=FLAGS.steps, stop_tokens=[])
  steps = max(1, len(result.decode_seconds) + 1)
  stats = result.policy_stats
  callbacks = stats.get("callbacks", stats.get("host_callbacks"))
  return dict(model=model.cfg.name, devices=devices, policy=key, describe=result.policy,
              context=FLAGS.context_len, batch=FLAGS.batch, decode_ms=round(result.ms_per_token, 3),
              tokens_per_s=round(FLAGS.batch * 1e3 / result.ms_per_token, 2),
              prefill_and_index_s=round(prefill_total, 2), state_bytes=result.kv_bytes,
              callbacks_per_step=None if callbacks is None else round(callbacks / steps, 2))


def main(argv):
  del argv
  counts = [int(n) for n in FLAGS.devices]
  unknown = sorted(set(FLAGS.policies) - set(POLICIES))
  if unknown:
    raise app.UsageError(f"unknown --policies {unknown}; known: {list(POLICIES)}")
  if min(counts) < 1:
    raise app.UsageError(f"--devices={FLAGS.devices}: counts must be >= 1")
  # Simulated CPU devices (set before JAX starts its backends; no effect on GPUs).
  jax.config.update("jax_num_cpu_devices", max(counts))
  import kvjax
  import results_io
  from models.config import RopeScaling

  rows = []
  for devices in counts:
    try:
      model = kvjax.load_model(FLAGS.model, dtype=FLAGS.dtype, devices=devices)
    except ValueError as e:  # e.g. a device count that does not divide the KV heads
      raise app.UsageError(str(e)) from None
    cfg = model.cfg
    if FLAGS.context_len + FLAGS.steps > cfg.max_context():
      factor = 2.0 ** int(np.ceil(np.log2((FLAGS.context_len + FLAGS.steps) / cfg.max_position)))
      model = dataclasses.replace(model, cfg=cfg.with_rope_scaling(RopeScaling("linear", factor, cfg.max_position)))
    for key in FLAGS.policies:
      try:
        row = run(model, devices, key)
      except Exception as e:  # e.g. out of memory: the other cases still get measured
        row = dict(devices=devices, policy=key, context=FLAGS.context_len, batch=FLAGS.batch,
                   error=f"{type(e).__name__}: {e}"[:300])
      print(row, flush=True)
      rows.append(row)
      # Written after every row: a run cut short by a time limit keeps what it measured.
      results_io.write_results(FLAGS.name, rows, out_dir=FLAGS.out_dir, notes=NOTES)
    del model


if __name__ == "__main__":
  app.run(main)
