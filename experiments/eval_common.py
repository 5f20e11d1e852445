"""What eval_needle.py and eval_ruler.py share: flags, model loading, rows, summaries, plots.

Rows written to results files are the runner's records flattened: options become one string,
answers one string, and the numeric policy_stats become `stat_<name>` columns.
"""

from __future__ import annotations

import collections
import json
import os
import statistics
import sys

from absl import app, flags

import kvjax
import results_io
from kvjax import cli
from kvjax import eval as kveval

DEFAULT_POLICIES = ["full", "streaming", "retrieval:index=roar:topk=100", "freekv"]


def define_flags(*, lengths: list[str], samples: int, name: str) -> None:
  flags.DEFINE_string("model", "smollm2", "Model name or path (kvjax.load_model); it needs a tokenizer.")
  flags.DEFINE_string("dtype", "auto", "auto (bfloat16 on GPU, float32 on CPU), float32, bfloat16 or float16.")
  flags.DEFINE_list("policies", DEFAULT_POLICIES,
                    "Policy specs name[:option=value]...[@label], e.g. retrieval:index=roar:topk=100@roar.")
  flags.DEFINE_list("lengths", lengths, "Prompt text lengths in tokens; the chat template, the answer prefix and "
                    "the generation come on top (SmolLM2's context is 8192).")
  flags.DEFINE_integer("samples", samples, "Samples per cell (seeds seed, seed+1, ...).")
  flags.DEFINE_integer("seed", 0, "First sample seed.")
  flags.DEFINE_list("seeds", [], "Sample seeds to run instead of --seed and --samples, e.g. the ones a policy lost "
                    "in an earlier run, to diagnose them without rerunning the rest.")
  flags.DEFINE_string("seeds_from", None, "FILE:POLICY[:worse|better|both]: run the seeds on which POLICY scored "
                      "below full (worse, the default), above it or either way in the rows of an earlier results "
                      "JSON, instead of --seed and --samples.")
  flags.DEFINE_integer("max_new_tokens", None, "Generation per decode; default: each task's own.")
  flags.DEFINE_integer("prefill_chunk", 1024, "Prompt tokens per prefill step.")
  flags.DEFINE_bool("early_stop", False, "Stop a decode once its text holds every answer (kvjax.eval.Sample.complete): "
                    "the scores are those of the whole generation, in fewer steps (kv_retrieval decodes in full).")
  flags.DEFINE_string("context_dir", None, "Keep each prefilled context here (kvjax.eval.ContextStore) and load it in "
                      "later runs instead of prefilling and indexing again. Contexts made by older code are reused "
                      "as they are (each record names the commit that made its context): use a new directory after "
                      "a change to prefill or to an index build.")
  flags.DEFINE_string("name", name, "Results stem: <out_dir>/<name>.json, .md and .png.")
  flags.DEFINE_string("out_dir", None, "Results directory (default experiments/results).")
  flags.DEFINE_bool("plot", True, "Write <name>.png (needs matplotlib, the bench extra).")
  flags.DEFINE_bool("deterministic", True, "Set XLA's deterministic GPU flags (kvjax.determinism) so that a seed "
                    "gives the same text in every process; --nodeterministic for XLA's fastest kernels (timing).")


def use_determinism(enabled: bool) -> str:
  """Call first in main(), before any JAX computation; returns the sentence the results' notes carry."""
  if not enabled:
    return "XLA deterministic flags: off."
  kvjax.use_deterministic_xla()
  return f"XLA deterministic flags: on (XLA_FLAGS={os.environ.get('XLA_FLAGS', '')})."


def context_store(directory: str | None) -> kveval.ContextStore | None:
  return None if directory is None else kveval.ContextStore(directory, made_by=results_io.commit())


def context_note(rows: list[dict]) -> str:
  """The notes' sentence on contexts loaded from a store ("" when none was): their prefill
  times are those of the run that made them, and so is the code of their prefill and index."""
  loaded = [r for r in rows if r.get("context_loaded")]
  if not loaded:
    return ""
  makers = sorted({r["context_made_by"] or "unknown" for r in loaded})
  return (f" {len(loaded)} of {len(rows)} decodes started from a context loaded from a context store, made at "
          f"{', '.join(makers)} (prefill_seconds are that run's).")


def policies(values: list[str]) -> list[kveval.PolicySpec]:
  try:
    return [kveval.PolicySpec.parse(v) for v in values]
  except (ValueError, TypeError) as e:
    raise app.UsageError(f"--policies: {e}") from None


def sample_seeds(seeds: list[str], seed: int, samples: int, seeds_from: str | None = None) -> list[int]:
  """The samples' seeds: `seeds` (--seeds) or those `seeds_from` names (--seeds_from) if given,
  else `samples` of them from `seed`."""
  if seeds and seeds_from:
    raise app.UsageError("give --seeds or --seeds_from, not both")
  if seeds_from:
    return seeds_from_run(seeds_from)
  if seeds:
    chosen = ints(seeds, "seeds")
    if len(set(chosen)) != len(chosen):
      raise app.UsageError(f"--seeds={','.join(seeds)} repeats a seed")
    return chosen
  if samples < 1:
    raise app.UsageError(f"--samples={samples} must be at least 1")
  return [seed + s for s in range(samples)]


def seeds_from_run(spec: str) -> list[int]:
  """--seeds_from=FILE:POLICY[:worse|better|both] -> kvjax.eval.disagreeing_seeds of FILE's rows."""
  path, _, rest = spec.partition(":")
  policy, _, which = rest.partition(":")
  if not path or not policy:
    raise app.UsageError(f"--seeds_from={spec} must be FILE:POLICY[:worse|better|both]")
  try:
    with open(path) as f:
      rows = json.load(f)["rows"]
  except (OSError, ValueError, KeyError) as e:
    raise app.UsageError(f"--seeds_from: cannot read rows from {path}: {e}") from None
  try:
    chosen = kveval.disagreeing_seeds(rows, policy, which=which or "worse")
  except ValueError as e:
    raise app.UsageError(f"--seeds_from={spec}: {e}") from None
  if not chosen:
    raise app.UsageError(f"--seeds_from={spec}: {policy} and full agree on every seed of {path}")
  return chosen


def seed_text(seeds: list[int]) -> str:
  """The seeds in their order, each run of three or more consecutive ones shortened:
  '0-49', '5, 16, 32', '0-34, 40, 41'."""
  runs: list[list[int]] = []
  for s in seeds:
    if runs and s == runs[-1][-1] + 1:
      runs[-1].append(s)
    else:
      runs.append([s])
  return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs)


def ints(values: list[str], flag: str) -> list[int]:
  try:
    return [int(v) for v in values]
  except ValueError:
    raise app.UsageError(f"--{flag}={','.join(values)} must be integers") from None


def load_model(name: str, dtype: str):
  model = kvjax.load_model(name, dtype=cli.resolve_dtype(dtype))
  if model.tokenizer is None:
    raise app.UsageError(f"--model={name} has no tokenizer: the tasks are text")
  return model


def flatten(record: dict) -> dict:
  row = {k: v for k, v in record.items() if k not in ("options", "answers", "policy_stats", "answer_depths")}
  row["options"] = ",".join(f"{k}={v}" for k, v in sorted(record["options"].items()))
  row["answers"] = " | ".join(record["answers"])
  row["answer_depths"] = ",".join(f"{d:.3f}" for d in record["answer_depths"] or [])
  for key, value in (record["policy_stats"] or {}).items():
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      row[f"stat_{key}"] = value
  return row


METRIC_NAMES = {"all": "RULER string_match_all", "part": "RULER string_match_part",
                "kv_exact": "exact match (InfiniteBench kv_retrieval)"}


def metric_text(rows: list[dict]) -> str:
  """The scorers the rows were scored by, named for a results file's notes."""
  return ", ".join(METRIC_NAMES.get(m, m) for m in dict.fromkeys(r.get("metric") for r in rows) if m) or "?"


def progress(record: dict) -> None:
  ms = record["ms_per_token"]  # None when the answer ended after its first token: no decode step was timed
  print(f"{record['task']:>16} len={record['length']} depth={record['depth']} seed={record['seed']} "
        f"{record['policy']:<34} score={record['score']:.2f} {'-' if ms is None else f'{ms:.0f}'} ms/tok "
        f"{record['generated']!r}", file=sys.stderr, flush=True)


def summarize(rows: list[dict], keys: tuple[str, ...]) -> list[dict]:
  """Mean score (and median ms/token) per distinct value of `keys`, in first-seen order."""
  groups: dict[tuple, list[dict]] = collections.defaultdict(list)
  for row in rows:
    groups[tuple(row[k] for k in keys)].append(row)
  out = []
  for values, members in groups.items():
    out.append(dict(zip(keys, values)) | {
        "score": statistics.fmean(r["score"] for r in members),
        "n": len(members),
        "ms_per_token": statistics.median(timed) if (timed := [r["ms_per_token"] for r in members
                                                               if r["ms_per_token"] is not None]) else None,
    })
  return out


def write_paired(rows: list[dict], *, cell: tuple[str, ...], sample: tuple[str, ...], name: str, out_dir,
                 seed: int, measured_by: list[dict] | None = None) -> list[dict]:
  """<name>_paired.json / .md: each policy's paired loss against `full` per cell
  (kvjax.eval.paired), when `full` ran; returns its rows. `measured_by`: as in
  results_io.write_results."""
  table = kveval.compare_to_reference(rows, cell=cell, sample=sample, reference="full", seed=seed)
  if table:
    results_io.write_results(
        f"{name}_paired", table, out_dir=out_dir,
        notes="Paired loss (full's score - the policy's) per sample, mean and 95% percentile-bootstrap interval "
              f"over the samples (seed {seed}); worse / better: samples the policy scored below / above full; "
              "loss_bound_exact: the Clopper-Pearson upper bound (97.5%) of worse / n, which bounds the mean loss "
              "(scores lie in [0, 1]); 'no loss > 0.02' = both the interval and that bound lie below 2 points (with no "
              "sample lost: n >= 183). criterion_applies: full scores above 0.5 in the cell. same_text: samples whose "
              "generated text equals full's. lost_margins / won_margins (rows since 2026-12-07): on each sample the "
              "policy lost / won, full's top-1 minus top-2 logit at the first token where the policy's tokens depart "
              "from full's; lost_gaps / won_gaps (rows since 2026-12-07, session 50): full's top-1 logit minus its "
              "logit of the token the policy chose there (= the margin where the policy took full's runner-up): "
              "near 0, a near-tie of full itself; wide, the policy's own doing.", measured_by=measured_by)
  return table


def heatmaps(panels: dict[str, dict[tuple, float]], *, rows: list, cols: list, row_label: str, col_label: str,
             title: str, path) -> None:
  """One heatmap per panel (e.g. per policy): cell (row, col) = mean score, annotated."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np

  width = 1.6 + 0.75 * max(len(cols), 2)  # per panel
  fig, axes = plt.subplots(1, len(panels), figsize=(1.5 + width * len(panels), 1.8 + 0.45 * len(rows)),
                           squeeze=False, sharey=True)
  image = None
  for ax, (name, cells) in zip(axes[0], panels.items()):
    grid = np.array([[cells.get((r, c), np.nan) for c in cols] for r in rows], dtype=float)
    image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    for i in range(len(rows)):
      for j in range(len(cols)):
        if not np.isnan(grid[i, j]):
          ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=8)
    long_labels = max(len(str(c)) for c in cols) > 5
    ax.set_xticks(range(len(cols)), [str(c) for c in cols], rotation=30 if long_labels else 0,
                  ha="right" if long_labels else "center", fontsize=7 if long_labels else 9)
    ax.set_yticks(range(len(rows)), [str(r) for r in rows])
    ax.set_xlabel(col_label)
    ax.set_title(name, fontsize=8)
  axes[0][0].set_ylabel(row_label)
  fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8, label="score")
  fig.suptitle(title, fontsize=10, y=1.08)
  fig.savefig(path, dpi=120, bbox_inches="tight")
  plt.close(fig)
