"""README's accuracy table, computed from the results files it cites.

Each cell names an eval results file under experiments/results (its rows: one score per sample
and policy), a task and length in it, and a policy's label there. The paired statistics are
recomputed from those rows with today's rule (kvjax.eval.paired: bootstrap interval and exact
bound, bootstrap seed 0), so no verdict lags a change of rule, and tests/test_accuracy_table.py
fails when README's table differs from what the files give.

  python experiments/accuracy_table.py            # prints the table
  python experiments/accuracy_table.py --readme   # rewrites it in README.md between its markers

A new measurement that should reach README: add its cell to CELLS (or point a cell at the new,
larger file) and run with --readme.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys

from absl import app, flags

import eval_common
from kvjax.eval import paired

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "experiments" / "results"
README = ROOT / "README.md"
BEGIN, END = "<!-- accuracy-table:begin -->", "<!-- accuracy-table:end -->"

flags.DEFINE_bool("readme", False, "Rewrite the table in README.md between its markers instead of printing it.")
FLAGS = flags.FLAGS


@dataclasses.dataclass(frozen=True)
class Cell:
  model: str
  task: str
  length: int  # prompt text tokens, as the file's rows name it
  file: str  # results stem under experiments/results
  policy: str  # the policy's label in that file
  config: str  # what that label ran, for the reader (budget in the legend below the table)


SMOL, QWEN = "SmolLM2-135M", "Qwen2.5-0.5B"
FAST = "fast"  # retrieval per_step lag 2 --speculative, roar per KV head, top-100 (legend)
OLD_FAST = "fast (older defaults)"  # the same at an earlier commit, before some of today's defaults (legend)
CELLS = (
    Cell(SMOL, "niah_single_1", 4096, "ruler_smollm2_4k_niah1_50", "retrieval(index=roar,topk=100)", "retrieval per_layer"),
    Cell(SMOL, "niah_single_1", 4096, "ruler_smollm2_4k_niah1_defaults_cpu_280", "fast", FAST),
    Cell(SMOL, "niah_single_1", 4096, "ruler_smollm2_4k_niah1_50", "freekv", "freekv"),
    Cell(SMOL, "niah_single_1", 4096, "ruler_smollm2_4k_niah1_50", "streaming", "streaming"),
    Cell(SMOL, "niah_single_2", 4096, "ruler_smollm2_4k_niah2_50", "retrieval(index=roar,topk=100)", "retrieval per_layer"),
    Cell(SMOL, "niah_single_2", 4096, "ruler_smollm2_4k_niah2_cpu_365", "fast", OLD_FAST),
    Cell(SMOL, "niah_single_2", 4096, "ruler_smollm2_4k_niah2_50", "freekv", "freekv"),
    Cell(SMOL, "niah_single_2", 4096, "ruler_smollm2_4k_niah2_keys4", "freekv_keys4", "freekv keys4"),
    Cell(SMOL, "niah_single_2", 4096, "ruler_smollm2_4k_niah2_keys4_cpu_183", "freekv_keys4", "freekv keys4"),
    Cell(SMOL, "niah_single_3", 4096, "ruler_smollm2_4k_niah3_tail16_cpu", "fast_t16", OLD_FAST),
    Cell(SMOL, "niah_single_3", 4096, "ruler_smollm2_4k_niah3_defaults_cpu", "freekv_keys4", "freekv keys4"),
    Cell(QWEN, "niah_single_1", 32000, "ruler_qwen_32k_single1_defaults_h200_53", "fast", FAST),
    Cell(QWEN, "niah_single_1", 32000, "ruler_qwen_32k_single1", "freekv", "freekv"),
    Cell(QWEN, "niah_single_1", 32000, "ruler_qwen_32k_single1", "streaming", "streaming"),
    Cell(QWEN, "niah_single_2", 32000, "ruler_qwen_32k_niah2_retrieval_50", "retrieval", "retrieval per_layer"),
    Cell(QWEN, "niah_single_2", 32000, "ruler_qwen_32k_niah2_variants_50", "succ4", OLD_FAST),
    Cell(QWEN, "niah_single_2", 32000, "ruler_qwen_32k_niah2", "freekv", "freekv"),
    Cell(QWEN, "niah_single_2", 32000, "ruler_qwen_32k_niah2", "freekv_keys4", "freekv keys4"),
    Cell(QWEN, "niah_single_2", 32000, "ruler_qwen_32k_niah2", "streaming", "streaming"),
    Cell(QWEN, "niah_multikey_1", 32000, "ruler_qwen_32k_mk1_variants_a", "succ4", OLD_FAST),
    Cell(QWEN, "niah_multikey_1", 32000, "ruler_qwen_32k_multikey1", "freekv", "freekv"),
    Cell(QWEN, "niah_multikey_1", 32000, "ruler_qwen_32k_multikey1", "freekv_keys4", "freekv keys4"),
    Cell(QWEN, "niah_multikey_1", 32000, "ruler_qwen_32k_multikey1", "streaming", "streaming"),
    Cell(QWEN, "niah_multiquery", 32000, "ruler_qwen_32k_multiquery_222", "fast_t16", OLD_FAST),
    Cell(QWEN, "niah_multiquery", 32000, "ruler_qwen_32k_multiquery_lag0", "freekv", "freekv"),
    Cell(QWEN, "niah_multiquery", 32000, "ruler_qwen_32k_multiquery_a", "streaming", "streaming"),
    Cell(QWEN, "niah_multivalue", 32000, "ruler_qwen_32k_multivalue_tail16", "fast_t16", OLD_FAST),
)

COLUMNS = ("model", "context", "task", "policy", "n", "seeds", "hardware", "commit", "full", "score",
           "lost / won", "loss [95% CI]", "exact bound", "verdict", "file")


def load(stem: str) -> dict:
  path = RESULTS / f"{stem}.json"
  if not path.is_file():
    raise ValueError(f"results file {stem!r}: {path} does not exist")
  return json.loads(path.read_text())


def hardware(doc: dict) -> str:
  """"H200 bf16", "H100 bf16", "CPU f32": the device and the dtype the eval CLIs pick on it."""
  devices = [d.strip() for d in doc["device"].split(",")]
  names = list(dict.fromkeys("CPU" if d.startswith("cpu") else d.split("NVIDIA ")[-1].split()[0] for d in devices))
  command = doc.get("command", "")
  dtype = ("f32" if "--dtype=float32" in command or names == ["CPU"] else "bf16")
  return " + ".join(names) + " " + dtype


def commit_text(doc: dict) -> str:
  """The commit, or the first and last of a combined file's (their count in brackets)."""
  commits = list(dict.fromkeys(c.strip()[:7] + ("-dirty" if c.strip().endswith("-dirty") else "")
                               for c in doc["commit"].split(",")))
  return commits[0] if len(commits) == 1 else f"{commits[0]} … {commits[-1]} ({len(commits)})"


def verdict_text(row: dict) -> str:
  if not row["criterion_applies"]:
    return "n/a (full ≤ 0.5)"
  return {"loss": "✗ loss", "inconclusive": "inconclusive"}.get(row["verdict"], "✓ no loss > 2 pts")


def cell_row(cell: Cell) -> dict:
  """The cell's table row: its policy paired with full over the file's samples of task and length."""
  doc = load(cell.file)
  rows = [r for r in doc["rows"] if r["task"] == cell.task and r["length"] == cell.length]
  stats = {r["policy"]: r for r in paired.compare_to_reference(rows, cell=("task", "length"), sample=("seed",))}
  if cell.policy not in stats:
    raise ValueError(f"{cell.file}: no policy {cell.policy!r} paired with full on {cell.task} at {cell.length} "
                     f"(policies there: {sorted(stats)})")
  s = stats[cell.policy]
  low, high = (float(x) for x in s["loss_ci95"].strip("[]").split(","))
  seeds = sorted({r["seed"] for r in rows if r["policy"] == cell.policy} & {r["seed"] for r in rows if r["policy"] == "full"})
  return {"model": cell.model, "context": f"{cell.length // 1000}K", "task": cell.task, "policy": cell.config,
          "n": str(s["n"]), "seeds": eval_common.seed_text(seeds), "hardware": hardware(doc), "commit": commit_text(doc),
          "full": f"{s['full_score']:.3f}", "score": f"{s['score']:.3f}", "lost / won": f"{s['worse']} / {s['better']}",
          "loss [95% CI]": f"{s['loss']:.3f} [{low:.3f}, {high:.3f}]",
          "exact bound": f"{s['loss_bound_exact']:.4f}", "verdict": verdict_text(s), "file": f"`{cell.file}`"}


def table() -> str:
  rows = [cell_row(c) for c in CELLS]
  lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
  lines += ["| " + " | ".join(r[c] for c in COLUMNS) + " |" for r in rows]
  return "\n".join(lines) + "\n"


def readme_block(text: str) -> str:
  """What README holds between the markers (the table as last written)."""
  if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
    raise ValueError(f"README.md must hold {BEGIN} once, then {END} once")
  return text[text.index(BEGIN) + len(BEGIN):text.index(END)].strip("\n") + "\n"


def with_table(text: str, block: str) -> str:
  readme_block(text)  # checks the markers
  return text[:text.index(BEGIN) + len(BEGIN)] + "\n" + block + text[text.index(END):]


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  block = table()
  if FLAGS.readme:
    README.write_text(with_table(README.read_text(), block))
  else:
    sys.stdout.write(block)


if __name__ == "__main__":
  app.run(main)
