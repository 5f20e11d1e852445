"""Per-token decode latency of every policy side by side, with the host-side breakdown.

    python experiments/bench_decode.py --model=random:llama3-8b --context_lens=32768 --batches=1

Each policy prefills the same random prompt (random weights: timing only — search cost,
correction and hit rates depend on the vectors and must be measured on real models) and
decodes `--steps` tokens. Rows: decode ms/token (median, first step dropped; split into the
jitted step up to its sampled token and the policy's host work between steps), prefill and
index-build seconds, device bytes of the policy state, and the policy's host counters per
step (callback, insert, search + attention, background search, correction and hit rates,
recalled bytes). `retrieval` and `retrieval_spec` differ only in decode options, so they share
one prefill and index build (saved once with kvjax.save_context, loaded per policy). Index
builds at 128K for 8B shapes take minutes per layer group: pass `--index=ivf` for such sizes.

`--prompt=text` (real models) feeds essay-like haystack text instead of random token ids, so
query drift, correction and hit rates are those of natural text. Summary rows give the share of
host search time speculation hides where both rows of a pair ran (host_phases.hidden_shares):
1 - (critical-path host ms with speculation) / (host search + attention ms without it), for
`retrieval_spec` against `retrieval` and the per_step lag-2 rows against `retrieval_step`.
`--roar_heads=kv` builds one roar graph per KV head (the per_step rows' 128K setting).
"""

from __future__ import annotations

import dataclasses

import numpy as np
from absl import app, flags

import kvjax
import host_phases
import results_io
from context_reuse import ContextReuse
from kvjax import prompts as prompts_lib
from models.config import RopeScaling

POLICIES = {
    "full": ("full", {}),
    "streaming": ("streaming", {}),
    "quest": ("quest", {}),
    "retrieval": ("retrieval", {}),
    "retrieval_spec": ("retrieval", {"speculative": True}),
    "retrieval_step": ("retrieval", {"bridge": "per_step"}),
    "retrieval_step_lag2": ("retrieval", {"bridge": "per_step", "lag": 2}),
    "retrieval_step_lag2_spec": ("retrieval", {"bridge": "per_step", "lag": 2, "speculative": True}),
    "freekv": ("freekv", {}),
    "freekv_step": ("freekv", {"bridge": "per_step"}),
    "freekv_step_pinned": ("freekv", {"bridge": "per_step", "transfer": "pinned"}),
    "freekv_step_sync": ("freekv", {"bridge": "per_step", "sync_transfer": True}),
    "freekv_step_lag2": ("freekv", {"bridge": "per_step", "lag": 2}),
    "freekv_step_lag2_keys2": ("freekv", {"bridge": "per_step", "lag": 2, "page_summary": "keys2"}),
    "freekv_step_lag2_keys4": ("freekv", {"bridge": "per_step", "lag": 2, "page_summary": "keys4"}),
}

flags.DEFINE_string("model", "random:llama3-8b", "Model name.")
flags.DEFINE_list("policies", list(POLICIES), f"Policies to time, from {list(POLICIES)}.")
flags.DEFINE_string("index", "graph", "Host index of the retrieval policies.")
flags.DEFINE_integer("retrieval_topk", 100, "Top-k of the retrieval policies.")
flags.DEFINE_enum("roar_heads", None, ["query", "kv"], "--index=roar: one graph per query head or per KV head "
                  "(default: the policy's).")
flags.DEFINE_list("context_lens", ["32768"], "Prompt lengths.")
flags.DEFINE_list("batches", ["1"], "Batch sizes.")
flags.DEFINE_integer("steps", 32, "Tokens decoded per policy; >= 3, so that a timed step remains once the "
                     "first decode step (it compiles) is dropped.", lower_bound=3)
flags.DEFINE_string("dtype", "bfloat16", "Weight and KV dtype.")
flags.DEFINE_string("out_dir", None, "Results directory.")
flags.DEFINE_string("name", "bench_decode", "Results file name.")
flags.DEFINE_enum("prompt", "random", ["random", "text"], "Random token ids, or essay-like haystack text.")
FLAGS = flags.FLAGS
RANDOM_NOTES = ("Random weights: latency only (random vectors are the hardest case for a graph index: searches "
                "scan far more than on real vectors). ")
TIMING_NOTES = ("decode_ms is the median step after the first; jitted_step_ms and after_step_ms are the medians of "
                "its two parts (the jitted step up to its token, the policy's host work between steps); "
                "*_ms_per_step are means over the steps (one-time costs included).")


def notes() -> str:
  return (RANDOM_NOTES if FLAGS.model.startswith("random:") else
          f"Real weights ({FLAGS.model}, prompt {FLAGS.prompt}). ") + TIMING_NOTES


def make_prompts(model, context_len: int, batch: int) -> list[list[int]]:
  """`batch` prompts of exactly `context_len` token ids (random ids, or haystack text)."""
  if FLAGS.prompt == "random":
    rng = np.random.default_rng(context_len + batch)
    return [[int(t) for t in rng.integers(0, model.cfg.vocab_size, size=context_len)] for _ in range(batch)]
  prompts = []
  for b in range(batch):
    count = context_len // 4  # well over context_len tokens: sentences have ~10+ tokens
    ids = model.tokenizer.encode(" ".join(prompts_lib.haystack_sentences("essay", count, seed=b)))
    if len(ids) < context_len:
      raise ValueError(f"haystack text gave {len(ids)} tokens < {context_len}")
    prompts.append(ids[:context_len])
  return prompts


def run(model, key: str, context_len: int, batch: int, contexts: ContextReuse) -> dict:
  """Prefills (or loads the context an earlier policy with the same prefill saved) and decodes."""
  name, options = POLICIES[key]
  options = dict(options)
  if name == "retrieval":
    options |= dict(index=FLAGS.index, topk=FLAGS.retrieval_topk)
    if FLAGS.roar_heads:
      options["roar_heads"] = FLAGS.roar_heads
  build = lambda: kvjax.prefill(model, make_prompts(model, context_len, batch), max_new_tokens=FLAGS.steps,
                                policy=name, policy_options=options, prefill_chunk=4096)
  context, prefill_total = contexts.get(model, name, options, (context_len, batch), build)
  phases = host_phases.HostPhases(context)
  result = kvjax.decode(model, context, max_new_tokens=FLAGS.steps, stop_tokens=[], on_step=phases.on_step)
  row = dict(policy=key, describe=result.policy, context=context_len, batch=batch,
             prefill_and_index_s=round(prefill_total, 2))
  return row | results_io.decode_fields(result) | phases.medians()


# host_phases.hidden_shares' pairs: the per-layer bridge's speculative row against plain
# retrieval (in-callback host time), and the per_step rows against its synchronous lag 1
# (their whole host time between steps).
HIDING = [("retrieval_spec", "attend_ms_median", "retrieval"),
          ("retrieval_step_lag2", "after_step_ms", "retrieval_step"),
          ("retrieval_step_lag2_spec", "after_step_ms", "retrieval_step")]


def main(argv):
  del argv
  unknown = sorted(set(FLAGS.policies) - set(POLICIES))
  if unknown:
    raise app.UsageError(f"unknown --policies {unknown}; known: {list(POLICIES)}")
  model = kvjax.load_model(FLAGS.model, dtype=FLAGS.dtype)
  rows = []
  contexts = ContextReuse()
  for context_len in map(int, FLAGS.context_lens):
    cfg = model.cfg
    if context_len + FLAGS.steps > cfg.max_context():
      factor = 2.0 ** int(np.ceil(np.log2((context_len + FLAGS.steps) / cfg.max_position)))
      cfg = cfg.with_rope_scaling(RopeScaling("linear", factor, cfg.max_position))
    scaled = dataclasses.replace(model, cfg=cfg)
    for batch in map(int, FLAGS.batches):
      for key in FLAGS.policies:
        try:
          row = run(scaled, key, context_len, batch, contexts)
        except Exception as e:  # e.g. out of memory: the other policies still get measured
          row = dict(policy=key, context=context_len, batch=batch, error=f"{type(e).__name__}: {e}"[:300])
        print(row, flush=True)
        rows.append(row)
        # Written after every row: a run cut short by a time limit keeps what it measured.
        hidden = host_phases.hidden_shares(rows, case=("context", "batch"), pairs=HIDING)
        results_io.write_results(FLAGS.name, rows, out_dir=FLAGS.out_dir, notes=notes(), summary=hidden)
  contexts.close()


if __name__ == "__main__":
  app.run(main)
