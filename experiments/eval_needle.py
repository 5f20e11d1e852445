"""Needle in a haystack, context length × depth, per attention policy: a heatmap of scores.

Kamradt's grid with RULER's needle ("One of the special magic numbers for <key> is: <7
digits>.", an essay-like haystack: task `needle`, kvjax.eval.niah); any task that places its
answer at a depth can stand in (--task=passkey, niah_single_1, kv_retrieval...). Each
(length, depth, seed) prompt is prefilled once per policy (once per group of specs that differ
only in decode options) and decoded greedily token by token.

    python experiments/eval_needle.py                                   # SmolLM2, 4K and 7.5K, 5 depths
    python experiments/eval_needle.py --lengths=4096 --depths=0.1,0.5,0.9 --policies=full,freekv

Writes <out_dir>/<name>.json (every record, stamped), .md (summary, then records) and .png.
"""

from __future__ import annotations

import pathlib

import eval_common
import results_io
from absl import app, flags, logging

from kvjax import eval as kveval

eval_common.define_flags(lengths=["4096", "7680"], samples=1, name="needle_smollm2")
flags.DEFINE_string("task", "needle", "A task that takes a depth (kvjax.eval.takes_depth).")
flags.DEFINE_list("depths", ["0", "0.25", "0.5", "0.75", "1"], "Answer depths in [0, 1] of the haystack's tokens.")
FLAGS = flags.FLAGS


def main(argv):
  logging.set_verbosity(logging.WARNING)  # orbax logs every context save at INFO
  results_io.commit()  # stamped on every rewrite of the results: the commit this run started at
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  xla_note = eval_common.use_determinism(FLAGS.deterministic)
  if FLAGS.task not in kveval.task_names() or not kveval.takes_depth(FLAGS.task):
    raise app.UsageError(f"--task={FLAGS.task} does not place its answer at a depth")
  try:
    depths = [float(d) for d in FLAGS.depths]
  except ValueError:
    raise app.UsageError(f"--depths={','.join(FLAGS.depths)} must be numbers") from None
  lengths = eval_common.ints(FLAGS.lengths, "lengths")
  specs = eval_common.policies(FLAGS.policies)
  model = eval_common.load_model(FLAGS.model, FLAGS.dtype)
  seeds = eval_common.sample_seeds(FLAGS.seeds, FLAGS.seed, FLAGS.samples, FLAGS.seeds_from)
  contexts = eval_common.context_store(FLAGS.context_dir)
  plan = [(n, d, seed) for n in lengths for d in depths for seed in seeds]
  records: list[dict] = []
  summary: list[dict] = []
  for done, (length, depth, seed) in enumerate(plan, 1):
    sample = kveval.make_sample(FLAGS.task, model.tokenizer, length=length, depth=depth, seed=seed)
    for record in kveval.run_sample(model, sample, specs, max_new_tokens=FLAGS.max_new_tokens,
                                    prefill_chunk=FLAGS.prefill_chunk, early_stop=FLAGS.early_stop,
                                    contexts=contexts):
      eval_common.progress(record)
      records.append(record)
    # Rewritten after every sample: a long CPU study that is stopped keeps what it measured.
    summary = write(model, specs, lengths, depths, seeds, records, xla_note=xla_note,
                    partial=f"{done} of {len(plan)} samples" if done < len(plan) else "")
  for s in summary:
    print(f"{s['policy']:<34} length={s['length']} depth={s['depth']} score={s['score']:.2f} (n={s['n']})")


def write(model, specs, lengths, depths, seeds, records, *, xla_note: str, partial: str) -> list[dict]:
  rows = [eval_common.flatten(r) for r in records]
  summary = eval_common.summarize(rows, ("policy", "length", "depth"))
  notes = (f"Task `{FLAGS.task}` on {model.cfg.name} ({model.source}); score = {eval_common.metric_text(rows)}; "
           f"{len(seeds)} sample(s) per cell (seeds {eval_common.seed_text(seeds)}); length = prompt text tokens "
           f"(chat template and answer prefix on top, see prompt_tokens). Depth = haystack tokens before the needle / "
           f"all haystack tokens; early stop once every answer is in the text: {FLAGS.early_stop}. {xla_note}"
           + eval_common.context_note(rows)
           + (f" PARTIAL: {partial}." if partial else ""))
  results_io.write_results(FLAGS.name, rows, out_dir=FLAGS.out_dir, notes=notes, summary=summary)
  eval_common.write_paired(rows, cell=("length", "depth"), sample=("seed",), name=FLAGS.name, out_dir=FLAGS.out_dir,
                           seed=FLAGS.seed)
  if FLAGS.plot:
    panels = {spec.label: {(s["length"], s["depth"]): s["score"] for s in summary if s["policy"] == spec.label}
              for spec in specs}
    out = pathlib.Path(FLAGS.out_dir) if FLAGS.out_dir else results_io.RESULTS_DIR
    eval_common.heatmaps(panels, rows=lengths, cols=depths, row_label="prompt tokens", col_label="depth",
                         title=f"{FLAGS.task}, {model.cfg.name}", path=out / f"{FLAGS.name}.png")
  return summary

if __name__ == "__main__":
  app.run(main)
