"""What an insert costs one token a step against in runs (retrieval's `index_every`).

    python experiments/bench_insert_runs.py --layers=12 --keys=32768 --runs=1,4,16

Retrieval decode inserts each token leaving the window into its (seq, layer) indexes. Once a
step, every layer's token goes into every KV head's graph: consecutive inserts into one graph
lie a whole step's worth of other graphs apart, and each starts from a cold cache (a graph of
128K keys is ~26 MB of keys and links, and decode holds 90). With `index_every=N` each graph
takes its N pending tokens in one run instead. This builds `--layers` layers of `--kv_heads`
graphs over `--keys` random keys each (the synthetic benchmarks' vectors; real keys of
consecutive tokens are correlated, which can only help runs), then, for each run length r in
`--runs`, appends the next r tokens of every layer and indexes them in one
`HostContext.index_stored` call on one thread (as a decode step's job does; run length 1 = every
step, retrieval's default until session 49, 8 since), `--rounds` times. The inserts per graph and their order are the same for
every r: only what lies between two inserts into a graph changes. Rows: median microseconds
per insert over the rounds; the run lengths alternate round by round so that the graphs grow
alike under each.

As decode does it: each step appends one token to every layer and indexes the layers due at
that step, those with (layer + step) % r == 0, each with its r pending tokens, in one call; so
every call inserts about as many keys as with r = 1 (the per-call overhead weighs the same).
A round is 3r steps, the first r untimed (they fill the stagger); what is pending at its end
is indexed untimed before the next round.
"""

from __future__ import annotations

import time

import numpy as np
from absl import app, flags

import host_index as hi
import results_io

flags.DEFINE_integer("layers", 12, "Layers (each a HostContext layer of --kv_heads graphs).")
flags.DEFINE_integer("kv_heads", 3, "KV heads per layer (SmolLM2: 3), one graph each.")
flags.DEFINE_integer("q_heads", 9, "Query heads per layer (roar links a new key through its group's mean query).")
flags.DEFINE_integer("keys", 32768, "Keys per graph before the inserts.")
flags.DEFINE_integer("dim", 64, "Head dimension.")
flags.DEFINE_enum("index_kind", "roar", ["roar", "graph"], "Index kind (roar per KV head: kvjax's default).")
flags.DEFINE_integer("ef_insert", 32, "The inserts' candidate list (retrieval's default for roar).")
flags.DEFINE_list("runs", ["1", "4", "16"], "Run lengths: tokens per graph per indexing call.")
flags.DEFINE_integer("rounds", 6, "Rounds per run length (each inserts run x layers x kv_heads keys).")
flags.DEFINE_integer("threads", None, "OpenMP threads of the builds (the inserts run on one).")
flags.DEFINE_integer("seed", 0, "Seed of the keys and queries.")
flags.DEFINE_string("out_dir", "experiments/results", "Where the JSON and markdown go.")
flags.DEFINE_string("name", "bench_insert_runs", "Result file stem.")
FLAGS = flags.FLAGS
STEPS = 3  # steps per round, in units of the run length: the first r untimed


def build(rng, total: int) -> hi.HostContext:
  """One sequence, --layers layers of --keys stored and indexed keys each, room for `total`."""
  L, Hkv, Hq, D = FLAGS.layers, FLAGS.kv_heads, FLAGS.q_heads, FLAGS.dim
  ctx = hi.HostContext(1, L, Hq, Hkv, D, dtype="bfloat16", kind=FLAGS.index_kind,
                       roar_heads="kv" if FLAGS.index_kind == "roar" else "query")
  for layer in range(L):
    ctx.reserve(0, layer, total)
    keys = rng.standard_normal((Hkv, FLAGS.keys, D)).astype(np.float32)
    ctx.append(0, layer, 0, keys, keys)
    train = rng.standard_normal((1, Hq, 1024, D)).astype(np.float32) if FLAGS.index_kind == "roar" else None
    ctx.build_layer(layer, train_queries=train, threads=FLAGS.threads)
  return ctx


def index(ctx, layers, pending, new_q) -> float:
  """Indexes the pending tokens of `layers` (equally many each) in one call -> its seconds."""
  if not layers:
    return 0.0
  queries = np.ascontiguousarray(np.stack([new_q[layer][:, pending[layer]] for layer in layers]))  # [T, Hq, r, D]
  t = time.perf_counter()
  ctx.index_stored([0] * len(layers), layers, queries=queries, ef=FLAGS.ef_insert, threads=1)
  return time.perf_counter() - t


def main(argv):
  del argv
  runs = [int(r) for r in FLAGS.runs]
  if min(runs) < 1:
    raise app.UsageError(f"--runs={','.join(FLAGS.runs)}: run lengths must be >= 1")
  if len(set(runs)) != len(runs):
    raise app.UsageError(f"--runs={','.join(FLAGS.runs)}: each run length once (a repeat would merge into one row)")
  if FLAGS.rounds < 1:
    raise app.UsageError(f"--rounds={FLAGS.rounds}: must be >= 1")
  L, Hkv, Hq, D = FLAGS.layers, FLAGS.kv_heads, FLAGS.q_heads, FLAGS.dim
  rng = np.random.default_rng(FLAGS.seed)
  total = FLAGS.keys + STEPS * sum(runs) * FLAGS.rounds
  t0 = time.perf_counter()
  ctx = build(rng, total)
  build_s = time.perf_counter() - t0
  new_k = rng.standard_normal((L, Hkv, total - FLAGS.keys, D)).astype(np.float32)
  new_q = rng.standard_normal((L, Hq, total - FLAGS.keys, D)).astype(np.float32)
  seconds = {r: [] for r in runs}
  timed = {r: 0 for r in runs}  # inserts timed, counted
  at = 0  # tokens appended to every layer so far
  for _ in range(FLAGS.rounds):
    for r in runs:
      pending = {layer: [] for layer in range(L)}  # per layer: the new tokens' positions
      spent, inserted = 0.0, 0
      for step in range(STEPS * r):
        for layer in range(L):
          ctx.append(0, layer, FLAGS.keys + at, new_k[layer, :, at:at + 1], new_k[layer, :, at:at + 1])
          pending[layer].append(at)
        at += 1
        due = [layer for layer in range(L) if (layer + step) % r == 0]
        took = index(ctx, due, pending, new_q)
        if step >= r:  # the first r steps fill the stagger: every due layer then holds r tokens
          spent += took
          inserted += sum(len(pending[layer]) for layer in due) * Hkv
        for layer in due:
          pending[layer] = []
      for layer in range(L):  # the rest, untimed
        index(ctx, [layer] if pending[layer] else [], pending, new_q)
      seconds[r].append(spent / inserted)
      timed[r] += inserted
  if not np.array_equal(ctx.indexed_counts(), ctx.store.lengths()):  # every token appended was indexed
    raise RuntimeError(f"indexed {ctx.indexed_counts().tolist()} of {ctx.store.lengths().tolist()} tokens")
  rows = [dict(index=FLAGS.index_kind, graphs=L * Hkv, keys=FLAGS.keys, dim=D, ef_insert=FLAGS.ef_insert, run=r,
               timed_inserts=timed[r], us_per_insert=round(1e6 * float(np.median(seconds[r])), 1),
               us_per_insert_min=round(1e6 * float(np.min(seconds[r])), 1))
          for r in runs]
  base = rows[0]["us_per_insert"]
  for row in rows:
    row["vs_first"] = round(row["us_per_insert"] / base, 3)
  notes = (f"{L * Hkv} {FLAGS.index_kind} graphs ({L} layers x {Hkv} KV heads) of {FLAGS.keys} random keys, "
           f"dim {D}, bfloat16 store, built in {build_s:.0f} s; inserts at ef {FLAGS.ef_insert} on one thread, "
           f"each step appending a token to every layer and indexing, in one call, the layers due at that step "
           f"((layer + step) % run == 0) with their `run` pending tokens (run 1: every step); "
           f"median (and min) microseconds per insert over {FLAGS.rounds} rounds of {STEPS} x run steps (the first "
           f"run steps untimed), run lengths alternating.")
  results_io.write_results(FLAGS.name, rows, out_dir=FLAGS.out_dir, notes=notes)
  for row in rows:
    print(row, flush=True)


if __name__ == "__main__":
  app.run(main)
