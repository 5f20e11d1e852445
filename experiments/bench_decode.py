"""Per-token decode latency of every policy side by side, with the host-side breakdown.

    python experiments/bench_decode.py --model=random:llama3-8b --context_lens=32768 --batches=1

Each policy prefills the same random prompt (random weights: timing only — search cost,
correction and hit rates depend on the vectors and must be measured on real models) and
decodes `--steps` tokens. Rows: decode ms/token (median, first step dropped), prefill and
index-build seconds, device bytes of the policy state, and the policy's host counters per
step (callback, insert, search + attention, background search, correction and hit rates,
recalled bytes). Index builds at 128K for 8B shapes take minutes per layer group: pass
`--index=ivf` or reuse a saved context (kvjax.save_context) for such sizes.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
from absl import app, flags

import kvjax
from models.config import RopeScaling
import results_io

POLICIES = {
    "full": ("full", {}),
    "streaming": ("streaming", {}),
    "quest": ("quest", {}),
    "retrieval": ("retrieval", {}),
    "retrieval_spec": ("retrieval", {"speculative": True}),
    "freekv": ("freekv", {}),
}

flags.DEFINE_string("model", "random:llama3-8b", "Model name.")
flags.DEFINE_list("policies", list(POLICIES), f"Policies to time, from {list(POLICIES)}.")
flags.DEFINE_string("index", "graph", "Host index of the retrieval policies.")
flags.DEFINE_integer("retrieval_topk", 100, "Top-k of the retrieval policies.")
flags.DEFINE_list("context_lens", ["32768"], "Prompt lengths.")
flags.DEFINE_list("batches", ["1"], "Batch sizes.")
flags.DEFINE_integer("steps", 32, "Decode steps per policy.")
flags.DEFINE_string("dtype", "bfloat16", "Weight and KV dtype.")
flags.DEFINE_string("out_dir", None, "Results directory.")
flags.DEFINE_string("name", "bench_decode", "Results file name.")
FLAGS = flags.FLAGS
NOTES = ("Random weights: latency only (random vectors are the hardest case for a graph index: searches scan "
         "far more than on real vectors). decode_ms is the median step after the first; *_ms_per_step are "
         "means over the steps (one-time costs included).")


def run(model, key: str, context_len: int, batch: int) -> dict:
  name, options = POLICIES[key]
  options = dict(options)
  if name == "retrieval":
    options |= dict(index=FLAGS.index, topk=FLAGS.retrieval_topk)
  rng = np.random.default_rng(context_len + batch)
  prompts = [[int(t) for t in rng.integers(0, model.cfg.vocab_size, size=context_len)] for _ in range(batch)]
  t0 = time.perf_counter()
  context = kvjax.prefill(model, prompts, max_new_tokens=FLAGS.steps, policy=name, policy_options=options,
                          prefill_chunk=4096)
  prefill_total = time.perf_counter() - t0
  result = kvjax.decode(model, context, max_new_tokens=FLAGS.steps, stop_tokens=[])
  steps = max(1, len(result.decode_seconds) + 1)
  row = dict(policy=key, describe=result.policy, context=context_len, batch=batch,
             decode_ms=round(result.ms_per_token, 3), prefill_and_index_s=round(prefill_total, 2),
             state_bytes=result.kv_bytes, peak_device_bytes=result.peak_device_bytes)
  for stat, value in result.policy_stats.items():
    if stat.endswith("_seconds"):
      row[f"{stat[:-8]}_ms_per_step"] = round(1e3 * value / steps, 3)
    elif isinstance(value, float):
      row[stat] = round(value, 4)
    elif value is not None:
      row[stat] = value
  return row


def main(argv):
  del argv
  unknown = sorted(set(FLAGS.policies) - set(POLICIES))
  if unknown:
    raise app.UsageError(f"unknown --policies {unknown}; known: {list(POLICIES)}")
  model = kvjax.load_model(FLAGS.model, dtype=FLAGS.dtype)
  rows = []
  for context_len in map(int, FLAGS.context_lens):
    cfg = model.cfg
    if context_len + FLAGS.steps > cfg.max_context():
      factor = 2.0 ** int(np.ceil(np.log2((context_len + FLAGS.steps) / cfg.max_position)))
      cfg = cfg.with_rope_scaling(RopeScaling("linear", factor, cfg.max_position))
    scaled = dataclasses.replace(model, cfg=cfg)
    for batch in map(int, FLAGS.batches):
      for key in FLAGS.policies:
        try:
          row = run(scaled, key, context_len, batch)
        except Exception as e:  # e.g. out of memory: the other policies still get measured
          row = dict(policy=key, context=context_len, batch=batch, error=f"{type(e).__name__}: {e}"[:300])
        print(row, flush=True)
        rows.append(row)
        # Written after every row: a run cut short by a time limit keeps what it measured.
        results_io.write_results(FLAGS.name, rows, out_dir=FLAGS.out_dir, notes=NOTES)


if __name__ == "__main__":
  app.run(main)
