"""Decode latency and throughput as contexts, batches and devices grow.

    python experiments/bench_scale.py --model=smollm2 --context=synthetic \\
        --context_lens=131072,262144,524288,1048576 --policies=full,freekv,retrieval_step_lag2 --index=flat
    python experiments/bench_scale.py --devices=1,2 --context_lens=131072 --policies=full,retrieval,freekv
    python experiments/bench_scale.py --context=synthetic --context_lens=131072 --batches=1,4,8 [--ragged]

For each device count, context length, batch and policy a context is built and `--steps` tokens
are decoded. `--context=real` prefills random token ids (the model is loaded sharded over the
devices, kvjax.sharding). `--context=synthetic` (one device) runs one real calibration prefill
of `--calibration_len` tokens and writes every context from its statistics without running the
model over it (kvjax.synthetic): the only way to reach 1M tokens within one run. Its rows say
"synthetic": search cost, scan fractions and hit rates measured on them are those of Gaussian
draws, not of the model.

Rows: decode_ms (median per-token step latency, first step dropped) and its parts,
tokens_per_s (batch / decode_ms), prefill_and_index_s (prefill or synthetic fill, plus the
policy's offload and index build; a retrieval row that only differs in decode options from an
earlier one reloads that row's saved context and repeats its figure), device state bytes, host bytes (store + indexes) and host
callbacks per step. Summary rows: each policy's decode_ms at each length, its ratio to `full`'s
and relative to its shortest context (growth), and its best tokens/s over the batches; a policy
listed several times in --policies (rounds, e.g. full,a,b,full,b,a) counts by the median of its
rows, with their range; with `retrieval_step_lag1_kv` in the run, the share of host time each
lag-2 `_kv` row takes off the critical path (host_phases.hidden_shares, also medians).

On a CPU it runs with simulated devices (`jax_num_cpu_devices` is set to the largest
--devices), which proves the program, not its speed: do not record CPU numbers as results.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import sys
import time

import jax
import numpy as np
from absl import app, flags

import host_phases

# retrieval's per_step bridge at lag 2, roar per KV head, speculative: the 128K configuration the
# presets below vary one option of, side by side
_STEP_SPEC = {"bridge": "per_step", "lag": 2, "roar_heads": "kv", "speculative": True}

POLICIES = {
    "full": ("full", {}),
    "retrieval": ("retrieval", {}),
    "retrieval_spec": ("retrieval", {"speculative": True}),
    "retrieval_step_lag2": ("retrieval", {"bridge": "per_step", "lag": 2}),
    "retrieval_step_lag1_kv": ("retrieval", {"bridge": "per_step", "lag": 1, "roar_heads": "kv"}),
    "retrieval_step_lag2_kv": ("retrieval", {"bridge": "per_step", "lag": 2, "roar_heads": "kv"}),
    "retrieval_step_lag2_kv_spec": ("retrieval", _STEP_SPEC),
    # successors off: what the default successors (= 2 * lag) cost, side by side (a decode option: it
    # reloads the spec row's context when both run)
    "retrieval_step_lag2_kv_spec_s0": ("retrieval", _STEP_SPEC | {"successors": 0}),
    # no pinned spans (16 of 16 tokens per query head are the per_step default since 2026-12-05):
    # what keeping them costs at 128K (a decode option, like _s0)
    "retrieval_step_lag2_kv_spec_p0": ("retrieval", _STEP_SPEC | {"pinned": 0}),
    # 2 successors, the default until 2026-12-03 (4 since): what the 2 more cost at 128K
    "retrieval_step_lag2_kv_spec_s2": ("retrieval", _STEP_SPEC | {"successors": 2}),
    # host threads at the caller's priority (background_nice 0), as before 2026-12-03: what
    # lowering them (the default, 10) gains, side by side (a decode option, like _s0)
    "retrieval_step_lag2_kv_spec_nice0": ("retrieval", _STEP_SPEC | {"background_nice": 0}),
    # 32 tail slots (default 16, 8 before 2026-12-06): each KV-head group is refreshed every 16 steps
    # when its query does not drift, so fewer groups search each step (a decode option, like _s0)
    "retrieval_step_lag2_kv_spec_t32": ("retrieval", _STEP_SPEC | {"tail_slots": 32}),
    # 16 tail slots (the default since 2026-12-06, named for runs before): a group not drifting is
    # refreshed every 8 steps instead of 4, halving the ~65 refresh searches of the ~74 a 128K step
    # made at 8 (bench_scale_smollm2shapes_synthetic_128k_rounds); _t8: the old default, side by side
    "retrieval_step_lag2_kv_spec_t16": ("retrieval", _STEP_SPEC | {"tail_slots": 16}),
    "retrieval_step_lag2_kv_spec_t8": ("retrieval", _STEP_SPEC | {"tail_slots": 8}),
    "retrieval_step_lag2_kv_spec_r2_t16": ("retrieval", _STEP_SPEC | {"reserved_cores": 2, "tail_slots": 16}),
    # refreshes by merging the new tokens into a group's top-k instead of searching again (the ~65
    # refresh searches of a 128K step's ~74 become exact scores of ~8 rows a head); with 2 cores reserved too
    "retrieval_step_lag2_kv_spec_merge": ("retrieval", _STEP_SPEC | {"refresh": "merge"}),
    "retrieval_step_lag2_kv_spec_r2_merge": ("retrieval", _STEP_SPEC | {"reserved_cores": 2, "refresh": "merge"}),
    # the background indexing on 16 / 6 threads (default: every core; 11 of 16 until
    # bench_scale_smollm2shapes_synthetic_32k_index_threads): its share of the cores, side by side
    "retrieval_step_lag2_kv_spec_idx16": ("retrieval", _STEP_SPEC | {"index_threads": 16}),
    "retrieval_step_lag2_kv_spec_idx6": ("retrieval", _STEP_SPEC | {"index_threads": 6}),
    # 12 of 16: the exchange thread and its 3 gather threads find idle cores beside the indexing
    "retrieval_step_lag2_kv_spec_idx12": ("retrieval", _STEP_SPEC | {"index_threads": 12}),
    # cores reserved for the thread launching the step: none (the default since 2026-12-03; the
    # exchange then runs at background_nice), 2 (the H200 host's default that day) and 4
    "retrieval_step_lag2_kv_spec_r0": ("retrieval", _STEP_SPEC | {"reserved_cores": 0}),
    "retrieval_step_lag2_kv_spec_r2": ("retrieval", _STEP_SPEC | {"reserved_cores": 2}),
    "retrieval_step_lag2_kv_spec_r4": ("retrieval", _STEP_SPEC | {"reserved_cores": 4}),
    # 2 reserved and the indexing on 10 threads: the exchange's row gather (0.39 ms alone, 2.37 beside
    # the indexing on the H100 host: bench_prefetch_smollm2shapes_32k_pinned16_select.md) gets cores of
    # its own among the 14 left
    "retrieval_step_lag2_kv_spec_r2_idx10": ("retrieval", _STEP_SPEC | {"reserved_cores": 2, "index_threads": 10}),
    # the background indexing pauses while the exchange's C calls run and works in their gaps
    # (host_index/csrc/hi_gate.h), without and with 2 cores reserved for the launching thread
    "retrieval_step_lag2_kv_spec_yield": ("retrieval", _STEP_SPEC | {"index_yields": True}),
    "retrieval_step_lag2_kv_spec_r2_yield": ("retrieval", _STEP_SPEC | {"reserved_cores": 2, "index_yields": True}),
    # the decode-time inserts' candidate list (ef_insert): the indexing is the largest host load beside
    # the step. 64 (roar's build-time list) was the default until session 48, 32 since (_ei32 names it
    # for the runs before); with 2 cores reserved too
    "retrieval_step_lag2_kv_spec_ei64": ("retrieval", _STEP_SPEC | {"ef_insert": 64}),
    "retrieval_step_lag2_kv_spec_ei48": ("retrieval", _STEP_SPEC | {"ef_insert": 48}),
    "retrieval_step_lag2_kv_spec_ei32": ("retrieval", _STEP_SPEC | {"ef_insert": 32}),
    "retrieval_step_lag2_kv_spec_ei16": ("retrieval", _STEP_SPEC | {"ef_insert": 16}),
    "retrieval_step_lag2_kv_spec_r2_ei32": ("retrieval", _STEP_SPEC | {"reserved_cores": 2, "ef_insert": 32}),
    # each layer's evicted tokens indexed in runs of 4 / 8 every 4 / 8 exchanges, the layers staggered
    # (index_every; the tail slots hold them until then): an index's consecutive inserts find its graph in cache.
    # 8 is the default since session 49 (_every1 names the one before)
    "retrieval_step_lag2_kv_spec_every1": ("retrieval", _STEP_SPEC | {"index_every": 1}),
    "retrieval_step_lag2_kv_spec_every4": ("retrieval", _STEP_SPEC | {"index_every": 4}),
    "retrieval_step_lag2_kv_spec_every8": ("retrieval", _STEP_SPEC | {"index_every": 8}),
    "freekv": ("freekv", {}),
    "freekv_step": ("freekv", {"bridge": "per_step"}),
    "freekv_step_pinned": ("freekv", {"bridge": "per_step", "transfer": "pinned"}),
    "freekv_step_sync": ("freekv", {"bridge": "per_step", "sync_transfer": True}),
    "freekv_step_lag2": ("freekv", {"bridge": "per_step", "lag": 2}),
    "freekv_step_lag2_r0": ("freekv", {"bridge": "per_step", "lag": 2, "reserved_cores": 0}),  # the default
    "freekv_step_lag2_r2": ("freekv", {"bridge": "per_step", "lag": 2, "reserved_cores": 2}),
    "freekv_step_lag2_nice0": ("freekv", {"bridge": "per_step", "lag": 2, "background_nice": 0}),
    "freekv_step_lag2_keys2": ("freekv", {"bridge": "per_step", "lag": 2, "page_summary": "keys2"}),
    "freekv_step_lag2_keys4": ("freekv", {"bridge": "per_step", "lag": 2, "page_summary": "keys4"}),
    "freekv_step_lag2_int8": ("freekv", {"bridge": "per_step", "lag": 2, "host_codec": "int8"}),
    "freekv_step_lag2_int8_pinned": ("freekv", {"bridge": "per_step", "lag": 2, "host_codec": "int8",
                                                "transfer": "pinned"}),
    "freekv_step_lag2_int8_pageable": ("freekv", {"bridge": "per_step", "lag": 2, "host_codec": "int8",
                                                  "transfer": "pageable"}),
}

flags.DEFINE_string("model", "random:llama3-8b", "Model name (its KV heads must be divisible by --devices).")
flags.DEFINE_list("devices", ["1"], "Device counts to shard the KV heads over (1 = the unsharded path).")
flags.DEFINE_list("policies", ["full"], f"Policies, from {list(POLICIES)}.")
flags.DEFINE_list("context_lens", ["32768"], "Context lengths (tokens per sequence).")
flags.DEFINE_list("batches", ["1"], "Sequences decoded together.")
flags.DEFINE_boolean("ragged", False, "Batches of different lengths: sequence b of a batch of B holds "
                     "context_len * (1 - b / (2B)) tokens (the row's `context` is the longest).")
flags.DEFINE_enum("context", "real", ["real", "synthetic"],
                  "Prefill random token ids, or write synthetic contexts from a calibration prefill's statistics.")
flags.DEFINE_enum("calibration", "text", ["text", "random"],
                  "Synthetic: calibrate on essay-like haystack text (models with a tokenizer) or random ids.")
flags.DEFINE_integer("calibration_len", 8192, "Synthetic: tokens of the calibration prefill.")
flags.DEFINE_integer("steps", 32, "Tokens decoded per policy; >= 3, so that a timed step remains once the "
                     "first decode step (it compiles) is dropped.", lower_bound=3)
flags.DEFINE_string("dtype", "bfloat16", "Weight and KV dtype.")
flags.DEFINE_string("index", "graph", "Host index of the retrieval policies.")
flags.DEFINE_integer("retrieval_topk", 100, "Top-k of the retrieval policies.")
flags.DEFINE_integer("sinks", None, "Device-resident first tokens of the sparse policies (default: theirs).")
flags.DEFINE_integer("window", None, "Device-resident recent tokens of the sparse policies (default: theirs).")
flags.DEFINE_integer("budget", None, "freekv's token budget (default: its own).")
flags.DEFINE_enum("transfer", None, ["page_locked", "pageable", "pinned"],
                  "How the per_step policies' row and page updates reach the device, for the presets that "
                  "do not name one (default: the policies' own).")
flags.DEFINE_integer("max_recall", None, "freekv's pages recalled per (seq, KV head) and phase per step, which sizes "
                     "its callbacks' static page buffers (default: n_sel).")
flags.DEFINE_integer("prefill_chunk", 4096, "Prefill chunk (real contexts and the calibration).")
flags.DEFINE_boolean("layer_major", False, "Real contexts: layer-major prefill (one layer's prompt KV on the device "
                     "at a time for retrieval and freekv; kvjax.prefill).")
flags.DEFINE_integer("trace", 0, "GPU only: decode under the profiler and write each row's top N kernel groups "
                     "(device time per step after the first) to <name>_kernels; the traced rows' latencies "
                     "carry the profiler's overhead.")
flags.DEFINE_boolean("step_times", False, "Add each decode step's ms to the rows (decode_ms_steps).")
flags.DEFINE_list("switch_interval", [], "sys.setswitchinterval values (s; Python's default 0.005), each row run "
                 "under each: how soon the main thread gets the GIL back from a per_step exchange thread.")
flags.DEFINE_string("out_dir", None, "Results directory.")
flags.DEFINE_string("name", "bench_scale", "Results file name.")
FLAGS = flags.FLAGS


def notes() -> str:
  weights = ("Random weights: latency only. " if FLAGS.model.startswith("random:") else
             f"Real weights ({FLAGS.model}). ")
  context = ("Real contexts: random token ids. " if FLAGS.context == "real" else
             f"SYNTHETIC contexts (kvjax.synthetic, calibration: {FLAGS.calibration_len} tokens of "
             f"{FLAGS.calibration}): latency and memory only; search costs are those of Gaussian draws. ")
  return (weights + context + "Heads sharded over N devices where devices > 1 (tensor-parallel weights, two "
          "all-reduces per layer). decode_ms is the median step after the first; tokens_per_s = batch / decode_ms.")


def policy_options(name: str, options: dict) -> dict:
  options = dict(options)
  if name == "retrieval":
    options |= dict(index=FLAGS.index, topk=FLAGS.retrieval_topk)
  if name in ("retrieval", "freekv"):
    options |= {k: getattr(FLAGS, k) for k in ("sinks", "window") if getattr(FLAGS, k) is not None}
  if name == "freekv":
    options |= {k: getattr(FLAGS, k) for k in ("budget", "max_recall") if getattr(FLAGS, k) is not None}
  if FLAGS.transfer is not None and options.get("bridge") == "per_step":
    options.setdefault("transfer", FLAGS.transfer)  # a preset naming its own (_pinned) keeps it
  return options


def calibration_prompt(model) -> tuple[list[int], str]:
  """Token ids of the synthetic contexts' calibration prefill, and what they are."""
  from kvjax import prompts as prompts_lib

  n = FLAGS.calibration_len
  if FLAGS.calibration == "text":
    if model.tokenizer is None:
      raise app.UsageError(f"--calibration=text needs a model with a tokenizer; {FLAGS.model} has none "
                           "(pass --calibration=random)")
    ids = model.tokenizer.encode(" ".join(prompts_lib.haystack_sentences("essay", n // 4, seed=0)))
    if len(ids) < n:
      raise ValueError(f"haystack text gave {len(ids)} tokens < --calibration_len={n}")
    return ids[:n], "essay text"
  rng = np.random.default_rng(n)
  return [int(t) for t in rng.integers(0, model.cfg.vocab_size, size=n)], "random token ids"


def sequence_lengths(length: int, batch: int) -> list[int]:
  """Tokens per sequence: all `length`, or with --ragged spread down to about half of it."""
  if not FLAGS.ragged:
    return [length] * batch
  return [length - (length * b) // (2 * batch) for b in range(batch)]


def run(model, devices: int, key: str, length: int, batch: int, stats, contexts, kernels: list) -> dict:
  """Builds (or reloads, for retrieval rows that differ only in decode options: the index build
  is shared) the context and decodes it; with --trace, appends its kernel groups to `kernels`."""
  import kvjax
  import results_io
  from kvjax import synthetic

  name, options = POLICIES[key]
  options = policy_options(name, options)
  lengths = sequence_lengths(length, batch)

  def build():
    if stats is None:
      rng = np.random.default_rng(length + batch)
      prompts = [[int(t) for t in rng.integers(0, model.cfg.vocab_size, size=n)] for n in lengths]
      return kvjax.prefill(model, prompts, max_new_tokens=FLAGS.steps, policy=name, policy_options=options,
                           prefill_chunk=FLAGS.prefill_chunk, layer_major=FLAGS.layer_major)
    return synthetic.synthetic_prefill(model, stats, lengths, max_new_tokens=FLAGS.steps, policy=name,
                                       policy_options=options, seed=length + batch)

  context, prefill_total = contexts.get(model, name, options, (devices, length, batch), build)
  trace = {}
  phases = host_phases.HostPhases(context)
  if FLAGS.trace:
    import gpu_trace
    tracer = gpu_trace.StepTracer(first=1)

    def on_step(step):
      tracer.on_step(step)
      phases.on_step(step)

    result = kvjax.decode(model, context, max_new_tokens=FLAGS.steps, stop_tokens=[], on_step=on_step)
    trace, groups = gpu_trace.kernel_table(tracer.events(), tracer.steps, FLAGS.trace)
    kernels += [dict(policy=key, context=length, batch=batch, **g) for g in groups]
  else:
    result = kvjax.decode(model, context, max_new_tokens=FLAGS.steps, stop_tokens=[], on_step=phases.on_step)
  steps = max(1, result.decode_steps)
  callbacks = result.policy_stats.get("callbacks", result.policy_stats.get("host_callbacks"))
  row = dict(model=model.cfg.name, devices=devices, policy=key, describe=result.policy, context_kind=FLAGS.context,
             context=length, batch=batch, lengths=",".join(map(str, lengths)) if FLAGS.ragged else None,
             tokens_per_s=round(batch * 1e3 / result.ms_per_token, 2),
             prefill_and_index_s=round(prefill_total, 2),
             callbacks_per_step=None if callbacks is None else round(callbacks / steps, 2))
  row = row | trace | results_io.decode_fields(result) | phases.medians()
  if FLAGS.step_times:  # where the mean's excess over the median comes from
    row["decode_ms_steps"] = " ".join(f"{1e3 * t:.1f}" for t in result.decode_seconds)
  return row


def summaries(rows: list[dict]) -> list[dict]:
  """Per (devices, policy, switch interval): growth of decode_ms with the context (batch 1 where
  measured, else the smallest batch), decode_ms at each length with its spread and its ratio to
  `full`'s, and the best tokens/s over the batches (rows of several intervals once overwrote each
  other's growth).

  A policy listed more than once (rounds of the same variants, to see the machine's drift) counts
  by the median of its rows at each (context, batch), never its best row: on a noisy host four
  rows of one variant spread 1-2 ms (experiments/results/bench_scale_smollm2shapes_synthetic_128k_tail16_b.md)."""
  ok = [r for r in rows if "decode_ms" in r]
  group = lambda r: (r["devices"], r["policy"], r.get("switch_interval"))
  # (devices, policy, interval) -> (context, batch) -> the rows' decode_ms, in order run
  runs: dict[tuple, dict[tuple, list[float]]] = {}
  for r in ok:
    runs.setdefault(group(r), {}).setdefault((r["context"], r["batch"]), []).append(r["decode_ms"])
  median_ms = {key: {case: statistics.median(ms) for case, ms in cases.items()} for key, cases in runs.items()}
  out = []
  for (devices, key, interval), cases in runs.items():
    batch = min(b for _, b in cases)
    by_len = {n: median_ms[devices, key, interval][n, b] for n, b in cases if b == batch}
    shortest = min(by_len)
    full = median_ms.get((devices, "full", interval), {})
    per_len = {}
    for n, ms in sorted(by_len.items()):
      per_len[f"growth_{n}"] = round(ms / by_len[shortest], 3)
      per_len[f"decode_ms_{n}"] = round(ms, 3)
      spread = cases[n, batch]
      per_len[f"rows_{n}"] = f"{len(spread)}: {min(spread)}-{max(spread)}" if len(spread) > 1 else "1"
      if key != "full" and (n, batch) in full:
        per_len[f"vs_full_{n}"] = round(ms / full[n, batch], 3)
    best = {}
    for (n, b), ms in median_ms[devices, key, interval].items():
      tokens_per_s = round(b * 1e3 / ms, 2)
      if tokens_per_s > best.get(n, (0, 0))[0]:
        best[n] = (tokens_per_s, b)
    out.append(dict(devices=devices, policy=key, **({} if interval is None else dict(switch_interval=interval)),
                    growth_batch=batch, growth_from=shortest, **per_len,
                    **{f"best_tokens_per_s_{n}": f"{t} (batch {b})" for n, (t, b) in sorted(best.items())}))
  return out


# hidden_shares' pairs: each lag-2 `_kv` row's whole host time between steps against the
# synchronous exchange (lag 1: the host searches and gathers between the steps).
HIDING = [(key, "after_step_ms", "retrieval_step_lag1_kv")
          for key in POLICIES if key.startswith("retrieval_step_lag2_kv")]


def main(argv):
  del argv
  counts = [int(n) for n in FLAGS.devices]
  lengths = [int(n) for n in FLAGS.context_lens]
  batches = [int(n) for n in FLAGS.batches]
  unknown = sorted(set(FLAGS.policies) - set(POLICIES))
  if unknown:
    raise app.UsageError(f"unknown --policies {unknown}; known: {list(POLICIES)}")
  if min(counts) < 1 or min(lengths) < 1 or min(batches) < 1:
    raise app.UsageError(f"--devices, --context_lens and --batches must be >= 1: {counts}, {lengths}, {batches}")
  try:
    intervals = [float(x) for x in FLAGS.switch_interval] or [None]
  except ValueError:
    raise app.UsageError(f"--switch_interval must be numbers (seconds): {FLAGS.switch_interval}") from None
  if intervals != [None] and min(intervals) <= 0:
    raise app.UsageError(f"--switch_interval values must be > 0: {FLAGS.switch_interval}")
  if FLAGS.layer_major and (FLAGS.context == "synthetic" or counts != [1]):
    raise app.UsageError("--layer_major applies to real contexts on one device (synthetic ones are staged anyway)")
  if FLAGS.context == "synthetic" and counts != [1]:
    raise app.UsageError(f"--context=synthetic runs on one device, not --devices={FLAGS.devices}")
  # Simulated CPU devices (set before JAX starts its backends; no effect on GPUs).
  jax.config.update("jax_num_cpu_devices", max(counts))
  if FLAGS.trace and jax.default_backend() == "cpu":
    raise app.UsageError("--trace reads GPU kernels from a profiler trace: it needs a GPU")
  import kvjax
  import results_io
  from kvjax import synthetic
  from models.config import RopeScaling

  from context_reuse import ContextReuse

  reusable = sum(POLICIES[key][0] == "retrieval" for key in FLAGS.policies) > 1 or len(FLAGS.switch_interval) > 1
  rows, kernels, contexts = [], [], ContextReuse(save=reusable)
  default_interval = sys.getswitchinterval()
  for devices in counts:
    try:
      model = kvjax.load_model(FLAGS.model, dtype=FLAGS.dtype, devices=devices)
    except ValueError as e:  # e.g. a device count that does not divide the KV heads
      raise app.UsageError(str(e)) from None
    cfg = model.cfg
    longest = max(lengths) + FLAGS.steps
    if longest > cfg.max_context():  # one scaling for every length, so their rows compare
      factor = 2.0 ** int(np.ceil(np.log2(longest / cfg.max_position)))
      model = dataclasses.replace(model, cfg=cfg.with_rope_scaling(RopeScaling("linear", factor, cfg.max_position)))
    stats = None
    if FLAGS.context == "synthetic":
      prompt, source = calibration_prompt(model)
      t0 = time.perf_counter()
      stats = synthetic.fit_statistics(model, prompt, source=source, prefill_chunk=FLAGS.prefill_chunk)
      print(f"calibration: {stats.describe()} ({time.perf_counter() - t0:.1f} s)", flush=True)
    for length in lengths:
      for batch in batches:
        for key, interval in itertools.product(FLAGS.policies, intervals):
          sys.setswitchinterval(default_interval if interval is None else interval)
          try:
            row = run(model, devices, key, length, batch, stats, contexts, kernels)
          except Exception as e:  # e.g. out of memory: the other cases still get measured
            row = dict(devices=devices, policy=key, context_kind=FLAGS.context, context=length, batch=batch,
                       error=f"{type(e).__name__}: {e}"[:300])
          if interval is not None:
            row["switch_interval"] = interval
          print(row, flush=True)
          rows.append(row)
          # Written after every row: a run cut short by a time limit keeps what it measured.
          results_io.write_results(FLAGS.name, rows, out_dir=FLAGS.out_dir, notes=notes(), summary=summaries(rows) +
                                   host_phases.hidden_shares(rows, case=("devices", "context", "batch"), pairs=HIDING))
          if kernels:
            results_io.write_results(f"{FLAGS.name}_kernels", kernels, out_dir=FLAGS.out_dir,
                                     notes="Kernel groups by device time per decode step (profiler trace from the "
                                           "second step on, the host work between steps included), per row of "
                                           f"{FLAGS.name}.")
    del model
  contexts.close()


if __name__ == "__main__":
  app.run(main)
