"""Accuracy against budget: each sparse policy at several token budgets, paired per sample
with `full`, on RULER-style tasks; a curve per policy family.

    python experiments/eval_budget.py --task=niah_single_2 --length=4096 --budgets=256,512,1024,2048

A budget B is the number of tokens each query head attends per decode step; how each family
spends it (sinks, window, selected pages or retrieved keys) is kvjax.eval.budgets. Every
(family, budget) is a policy spec labelled "<family>@<B>" run on the same samples as `full`,
so each point has a paired loss against full with its 95% interval (<name>_paired.md).

Writes <out_dir>/<name>.json / .md (summary: mean score per family and budget, then every
record), <name>_paired.json / .md and <name>.png (score against budget, one line per family,
full dashed).
"""

from __future__ import annotations

import pathlib

import eval_common
import results_io
from absl import app, flags, logging

from kvjax import eval as kveval
from kvjax.eval import budgets as kvbudgets

eval_common.define_flags(lengths=["4096"], samples=10, name="budget_smollm2")
flags.DEFINE_string("task", "niah_single_2", "Task (kvjax.eval.task_names()).")
flags.DEFINE_list("families", list(kvbudgets.FAMILIES), "Policy families to sweep.")
flags.DEFINE_list("budgets", ["256", "512", "1024", "2048"], "Tokens attended per query head per step.")
flags.DEFINE_string("freekv_options", "", "Extra freekv options, e.g. page_summary=keys4 (':'-separated).")
flags.DEFINE_string("retrieval_options", "index=roar", "Extra retrieval options (':'-separated).")
FLAGS = flags.FLAGS


def extra_options() -> dict[str, dict]:
  """--freekv_options / --retrieval_options as option dicts (parsed as a spec's options are)."""
  out = {}
  for family, text in (("freekv", FLAGS.freekv_options), ("retrieval", FLAGS.retrieval_options)):
    if text:
      out[family] = eval_common.policies([f"{family}:{text}"])[0].options
  return out


def main(argv):
  logging.set_verbosity(logging.WARNING)
  results_io.commit()
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  xla_note = eval_common.use_determinism(FLAGS.deterministic)
  if FLAGS.task not in kveval.task_names():
    raise app.UsageError(f"--task={FLAGS.task}: known tasks are {', '.join(kveval.task_names())}")
  budgets = eval_common.ints(FLAGS.budgets, "budgets")
  lengths = eval_common.ints(FLAGS.lengths, "lengths")
  try:
    specs = kvbudgets.budget_specs(FLAGS.families, budgets, extra_options())
  except (ValueError, TypeError) as e:
    raise app.UsageError(str(e)) from None
  model = eval_common.load_model(FLAGS.model, FLAGS.dtype)
  seeds = eval_common.sample_seeds(FLAGS.seeds, FLAGS.seed, FLAGS.samples, FLAGS.seeds_from)
  contexts = eval_common.context_store(FLAGS.context_dir)
  plan = [(n, seed) for n in lengths for seed in seeds]
  rows: list[dict] = []
  for done, (length, seed) in enumerate(plan, 1):
    sample = kveval.make_sample(FLAGS.task, model.tokenizer, length=length, seed=seed)
    for record in kveval.run_sample(model, sample, specs, max_new_tokens=FLAGS.max_new_tokens,
                                    prefill_chunk=FLAGS.prefill_chunk, early_stop=FLAGS.early_stop,
                                    contexts=contexts):
      eval_common.progress(record)
      family, budget = kvbudgets.parse_label(record["policy"])
      rows.append(eval_common.flatten(record) | {"family": family, "budget": budget})
    summary = write(model, rows, lengths, budgets, seeds, xla_note=xla_note,
                    partial="" if done == len(plan) else f"{done} of {len(plan)}")
  print(results_io.markdown_table(summary))


def write(model, rows, lengths, budgets, seeds, *, xla_note: str, partial: str) -> list[dict]:
  summary = eval_common.summarize(rows, ("length", "family", "budget"))
  skipped = [f"{f}@{b}" for f in FLAGS.families for b in budgets if kvbudgets.budget_options(f, b) is None]
  notes = (f"Task `{FLAGS.task}` on {model.cfg.name} ({model.source}); {len(seeds)} sample(s) per point (seeds "
           f"{eval_common.seed_text(seeds)}), the same samples for every point; "
           f"score = {eval_common.metric_text(rows)}; "
           "budget = tokens attended per query head per decode step, split per family as kvjax.eval.budgets says "
           "(streaming: sinks min(128, B/4) + window; quest and freekv: sinks B/4 + window B/4 + pages B/2; "
           f"retrieval: sinks 128 + window 512 + top-(B-640)); early stop: {FLAGS.early_stop}. {xla_note}"
           + eval_common.context_note(rows)
           + (f" Not offered (budget below the family's static set): {', '.join(skipped)}." if skipped else "")
           + (f" PARTIAL: {partial} samples." if partial else ""))
  results_io.write_results(FLAGS.name, rows, out_dir=FLAGS.out_dir, notes=notes, summary=summary)
  eval_common.write_paired(rows, cell=("task", "length"), sample=("seed",), name=FLAGS.name, out_dir=FLAGS.out_dir,
                           seed=FLAGS.seed)
  if FLAGS.plot:
    out = pathlib.Path(FLAGS.out_dir) if FLAGS.out_dir else results_io.RESULTS_DIR
    plot(summary, lengths, path=out / f"{FLAGS.name}.png", title=f"{FLAGS.task}, {model.cfg.name}")
  return summary


def plot(summary, lengths, *, path, title: str) -> None:
  """Score against budget (log2 axis), one panel per length, one line per family."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, len(lengths), figsize=(4.5 * len(lengths), 3.4), squeeze=False, sharey=True)
  for ax, length in zip(axes[0], lengths):
    here = [s for s in summary if s["length"] == length]
    for s in here:
      if s["family"] == "full":
        ax.axhline(s["score"], color="black", linestyle="--", label=f"full ({s['score']:.2f})")
    families = dict.fromkeys(s["family"] for s in here if s["family"] != "full")
    for i, family in enumerate(families):  # markers and a small offset keep equal scores apart
      points = sorted((s["budget"], s["score"]) for s in here if s["family"] == family)
      ax.plot([b for b, _ in points], [v + 0.012 * (i - len(families) / 2) for _, v in points], alpha=0.85,
              marker="osD^v"[i % 5], label=family)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens attended per step (budget)")
    ax.set_title(f"{length} prompt tokens", fontsize=9)
    ax.set_ylim(-0.05, 1.05)
  axes[0][0].set_ylabel("score")
  axes[0][-1].legend(fontsize=7, loc="lower right")
  fig.suptitle(title, fontsize=10)
  fig.savefig(path, dpi=120, bbox_inches="tight")
  plt.close(fig)


if __name__ == "__main__":
  app.run(main)
