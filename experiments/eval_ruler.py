"""RULER-style synthetic tasks (and InfiniteBench's kv retrieval): task × policy × length.

Tasks and their parameters follow RULER (Hsieh et al. 2024) as documented in kvjax.eval
(niah_*, vt, cwe, fwe) and InfiniteBench (kv_retrieval); everything is generated locally.
Each sample is prefilled once per policy (once per group of specs that differ only in decode
options) and decoded greedily token by token.

    python experiments/eval_ruler.py                                          # SmolLM2, 4K and 7.5K
    python experiments/eval_ruler.py --tasks=niah_single_1,kv_retrieval,vt --lengths=4096 --samples=3

Writes <out_dir>/<name>.json (every record, stamped), .md (task × policy@length table, then
records) and .png (one heatmap of mean scores per length).
"""

from __future__ import annotations

import pathlib

import eval_common
import results_io
from absl import app, flags, logging

from kvjax import eval as kveval

eval_common.define_flags(lengths=["4096", "7680"], samples=3, name="ruler_smollm2")
flags.DEFINE_list("tasks", list(kveval.RULER_TASKS) + ["kv_retrieval"], "Tasks (kvjax.eval.task_names()).")
FLAGS = flags.FLAGS


def pivot(summary: list[dict], tasks: list[str], columns: list[tuple[str, int]]) -> list[dict]:
  """Rows of tasks (and their mean), one column per (policy, length)."""
  score = {(s["task"], s["policy"], s["length"]): s["score"] for s in summary}
  rows = [{"task": t} | {f"{p} @{n}": score.get((t, p, n)) for p, n in columns} for t in tasks]
  mean = {"task": "mean"}
  for p, n in columns:
    values = [score[(t, p, n)] for t in tasks if (t, p, n) in score]
    mean[f"{p} @{n}"] = sum(values) / len(values) if values else None
  return rows + [mean]


def main(argv):
  logging.set_verbosity(logging.WARNING)  # orbax logs every context save at INFO
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  unknown = [t for t in FLAGS.tasks if t not in kveval.task_names()]
  if unknown:
    raise app.UsageError(f"--tasks: unknown {unknown}; known: {', '.join(kveval.task_names())}")
  lengths = eval_common.ints(FLAGS.lengths, "lengths")
  specs = eval_common.policies(FLAGS.policies)
  model = eval_common.load_model(FLAGS.model, FLAGS.dtype)
  plan = [(t, n, FLAGS.seed + s) for n in lengths for t in FLAGS.tasks for s in range(FLAGS.samples)]
  records: list[dict] = []
  table: list[dict] = []
  for done, (task, length, seed) in enumerate(plan, 1):
    sample = kveval.make_sample(task, model.tokenizer, length=length, seed=seed)
    for record in kveval.run_sample(model, sample, specs, max_new_tokens=FLAGS.max_new_tokens,
                                    prefill_chunk=FLAGS.prefill_chunk, early_stop=FLAGS.early_stop):
      eval_common.progress(record)
      records.append(record)
    # Rewritten after every sample: a long CPU study that is stopped keeps what it measured.
    table = write(model, specs, lengths, records, partial=f"{done} of {len(plan)} samples" if done < len(plan) else "")
  print(results_io.markdown_table(table))


def write(model, specs, lengths, records, *, partial: str) -> list[dict]:
  rows = [eval_common.flatten(r) for r in records]
  summary = eval_common.summarize(rows, ("task", "policy", "length"))
  columns = [(spec.label, n) for n in lengths for spec in specs]
  table = pivot(summary, FLAGS.tasks, columns)
  notes = (f"{model.cfg.name} ({model.source}); {FLAGS.samples} sample(s) per cell; scores: RULER "
           f"string_match_all (niah_*, vt, cwe, fwe), exact match (kv_retrieval); length = prompt text tokens "
           f"(chat template and answer prefix on top, see prompt_tokens); early stop at the answer's sentence end: "
           f"{FLAGS.early_stop}. Summary: mean score per task, one column per policy @ length."
           + (f" PARTIAL: {partial}." if partial else ""))
  results_io.write_results(FLAGS.name, rows, out_dir=FLAGS.out_dir, notes=notes, summary=table)
  if FLAGS.plot:
    out = pathlib.Path(FLAGS.out_dir) if FLAGS.out_dir else results_io.RESULTS_DIR
    by = {(s["task"], s["policy"], s["length"]): s["score"] for s in summary}
    panels = {f"{n} tokens": {(t, spec.label): by[(t, spec.label, n)] for t in FLAGS.tasks for spec in specs
                              if (t, spec.label, n) in by} for n in lengths}
    eval_common.heatmaps(panels, rows=list(FLAGS.tasks), cols=[s.label for s in specs], row_label="task",
                         col_label="policy", title=f"RULER-style tasks, {model.cfg.name}", path=out / f"{FLAGS.name}.png")
  return table

if __name__ == "__main__":
  app.run(main)
