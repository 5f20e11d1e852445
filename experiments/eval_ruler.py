"""RULER-style synthetic tasks (and InfiniteBench's kv retrieval): task × policy × length.

Tasks and their parameters follow RULER (Hsieh et al. 2024) as documented in kvjax.eval
(niah_*, vt, cwe, fwe) and InfiniteBench (kv_retrieval); everything is generated locally.
Each sample is prefilled once per policy (once per group of specs that differ only in decode
options) and decoded greedily token by token.

    python experiments/eval_ruler.py                                          # SmolLM2, 4K and 7.5K
    python experiments/eval_ruler.py --tasks=niah_single_1,kv_retrieval,vt --lengths=4096 --samples=3
    python experiments/eval_ruler.py --combine=results/a.json,results/b.json --name=ab   # runs split by task

Writes <out_dir>/<name>.json (every record, stamped), .md (task × policy@length table, then
records) and .png (one heatmap of mean scores per length).
"""

from __future__ import annotations

import json
import pathlib

import eval_common
import results_io
from absl import app, flags, logging

from kvjax import eval as kveval

eval_common.define_flags(lengths=["4096", "7680"], samples=3, name="ruler_smollm2")
flags.DEFINE_list("tasks", list(kveval.RULER_TASKS) + ["kv_retrieval"], "Tasks (kvjax.eval.task_names()).")
flags.DEFINE_list("combine", [], "Instead of running: one table from the rows of these eval_ruler JSON files.")
FLAGS = flags.FLAGS


def pivot(summary: list[dict], tasks: list[str], columns: list[tuple[str, int]]) -> list[dict]:
  """Rows of tasks (and their mean), one column per (policy, length)."""
  score = {(s["task"], s["policy"], s["length"]): s["score"] for s in summary}
  rows = [{"task": t} | {f"{p} @{n}": score.get((t, p, n)) for p, n in columns} for t in tasks]
  mean = {"task": "mean"}
  for p, n in columns:  # only over every task: means over different task sets would not compare
    values = [score[(t, p, n)] for t in tasks if (t, p, n) in score]
    mean[f"{p} @{n}"] = sum(values) / len(values) if values and len(values) == len(tasks) else None
  return rows + [mean]


def main(argv):
  logging.set_verbosity(logging.WARNING)  # orbax logs every context save at INFO
  results_io.commit()  # stamped on every rewrite of the results: the commit this run started at
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if FLAGS.combine:
    combine(FLAGS.combine)
    return
  xla_note = eval_common.use_determinism(FLAGS.deterministic)
  unknown = [t for t in FLAGS.tasks if t not in kveval.task_names()]
  if unknown:
    raise app.UsageError(f"--tasks: unknown {unknown}; known: {', '.join(kveval.task_names())}")
  lengths = eval_common.ints(FLAGS.lengths, "lengths")
  specs = eval_common.policies(FLAGS.policies)
  model = eval_common.load_model(FLAGS.model, FLAGS.dtype)
  seeds = eval_common.sample_seeds(FLAGS.seeds, FLAGS.seed, FLAGS.samples, FLAGS.seeds_from)
  contexts = eval_common.context_store(FLAGS.context_dir)
  plan = [(t, n, seed) for n in lengths for t in FLAGS.tasks for seed in seeds]
  rows: list[dict] = []
  table: list[dict] = []
  for done, (task, length, seed) in enumerate(plan, 1):
    sample = kveval.make_sample(task, model.tokenizer, length=length, seed=seed)
    for record in kveval.run_sample(model, sample, specs, max_new_tokens=FLAGS.max_new_tokens,
                                    prefill_chunk=FLAGS.prefill_chunk, early_stop=FLAGS.early_stop,
                                    contexts=contexts):
      eval_common.progress(record)
      rows.append(eval_common.flatten(record))
    notes = (f"{model.cfg.name} ({model.source}); {len(seeds)} sample(s) per cell (seeds "
             f"{eval_common.seed_text(seeds)}); {SCORES}; early stop once every answer is in the text: "
             f"{FLAGS.early_stop}. {xla_note}" + eval_common.context_note(rows)
             + (f" PARTIAL: {done} of {len(plan)} samples." if done < len(plan) else ""))
    # Rewritten after every sample: a long CPU study that is stopped keeps what it measured.
    table = write(rows, tasks=FLAGS.tasks, labels=[s.label for s in specs], lengths=lengths, notes=notes,
                  model_name=model.cfg.name)
  print(results_io.markdown_table(table))


SCORES = ("scores: RULER string_match_all (niah_*, vt, cwe, fwe), exact match (kv_retrieval); length = prompt "
          "text tokens (chat template and answer prefix on top, see prompt_tokens). Summary: mean score per task, "
          "one column per policy @ length")


def combine(paths: list[str]) -> None:
  """One table from the rows of several eval_ruler results files (runs split by task, say)."""
  rows, sources, docs = [], [], []
  for path in paths:
    doc = json.loads(pathlib.Path(path).read_text())
    docs.append(doc)
    rows += doc["rows"]
    partial = " (PARTIAL)" if "PARTIAL" in doc.get("notes", "") else ""
    sources.append(f"`{pathlib.Path(path).name}`{partial}: commit {doc['commit']}, {doc['date']}, `{doc['command']}`")

  rows = unique_rows(rows)

  def ordered(key):
    return list(dict.fromkeys(r[key] for r in rows))

  notes = f"Combined from the rows of: {'; '.join(sources)}. {SCORES}."
  table = write(rows, tasks=ordered("task"), labels=ordered("policy"), lengths=ordered("length"), notes=notes,
                model_name="", measured_by=docs)
  print(results_io.markdown_table(table))


def unique_rows(rows: list[dict]) -> list[dict]:
  """Each (task, length, depth, seed, policy) once: a sample in two files (a rerun of the seeds a
  policy lost, say) would count twice in the means and once, silently, in the paired table. The
  same score twice keeps the first row; different scores are an error naming the samples."""
  seen: dict[tuple, dict] = {}
  conflicts = []
  for row in rows:
    key = tuple(row.get(k) for k in ("task", "length", "depth", "seed", "policy"))
    if key not in seen:
      seen[key] = row
    elif seen[key]["score"] != row["score"]:
      conflicts.append(key)
  if conflicts:
    raise app.UsageError(f"--combine: {len(conflicts)} sample(s) appear in several files with different scores "
                         f"(task, length, depth, seed, policy): {conflicts[:5]}; combine files of distinct samples")
  return list(seen.values())


def write(rows, *, tasks, labels, lengths, notes: str, model_name: str, measured_by=None) -> list[dict]:
  summary = eval_common.summarize(rows, ("task", "policy", "length"))
  table = pivot(summary, tasks, [(label, n) for n in lengths for label in labels])
  results_io.write_results(FLAGS.name, rows, out_dir=FLAGS.out_dir, notes=notes, summary=table,
                           measured_by=measured_by)
  eval_common.write_paired(rows, cell=("task", "length"), sample=("seed",), name=FLAGS.name, out_dir=FLAGS.out_dir,
                           seed=FLAGS.seed, measured_by=measured_by)
  if FLAGS.plot:
    out = pathlib.Path(FLAGS.out_dir) if FLAGS.out_dir else results_io.RESULTS_DIR
    by = {(s["task"], s["policy"], s["length"]): s["score"] for s in summary}
    panels = {f"{n} tokens": {(t, label): by[(t, label, n)] for t in tasks for label in labels if (t, label, n) in by}
              for n in lengths}
    eval_common.heatmaps(panels, rows=list(tasks), cols=list(labels), row_label="task", col_label="policy",
                         title=f"RULER-style tasks {model_name}".strip(), path=out / f"{FLAGS.name}.png")
  return table


if __name__ == "__main__":
  app.run(main)
