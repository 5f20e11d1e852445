"""Writes a study's results: JSON stamped with device, JAX version, commit, date and command,
and a markdown table made from the same rows."""

from __future__ import annotations

import datetime
import functools
import json
import os
import pathlib
import subprocess
import sys

import numpy as np

RESULTS_DIR = pathlib.Path(__file__).resolve().parent / "results"


@functools.lru_cache(maxsize=None)
def commit() -> str:
  """The commit stamped on every result of this process, read at the first call: a long study
  rewrites its files after every sample, so it calls this when it starts (its code's commit,
  not the checkout's HEAD at each rewrite)."""
  # The GPU machine's checkout carries a stale .git: the caller passes the real commit.
  if os.environ.get("KVJAX_COMMIT"):
    return os.environ["KVJAX_COMMIT"]
  try:
    out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, check=True,
                         cwd=RESULTS_DIR.parent)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                           cwd=RESULTS_DIR.parent).stdout.strip()
    return out.stdout.strip() + ("-dirty" if dirty else "")
  except (OSError, subprocess.CalledProcessError):
    return os.environ.get("KVJAX_COMMIT", "unknown")



def stamp() -> dict:
  import jax

  device = jax.devices()[0]
  return {
      "device": f"{device.platform}:{getattr(device, 'device_kind', '?')}",
      "jax": jax.__version__,
      "commit": commit(),
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
  }


def sources_stamp(docs: list[dict]) -> dict:
  """Device, JAX version and commit of stamped result documents, each distinct value once."""
  return {key: ", ".join(dict.fromkeys(str(doc.get(key, "unknown")) for doc in docs))
          for key in ("device", "jax", "commit")}


def decode_fields(result) -> dict:
  """Row fields of a kvjax.GenerationResult: decode ms/token (median after the first step; also
  the mean and the slowest step) and its two parts (the jitted step up to its token, the host
  work between steps), state bytes, and the policy's counters (seconds as ms per step, means
  over the steps)."""
  steps = max(1, result.decode_steps)
  row = dict(decode_ms=round(result.ms_per_token, 3), state_bytes=result.kv_bytes,
             peak_device_bytes=result.peak_device_bytes)
  if result.decode_seconds:  # a median hides spikes (a host thread running late, a store growing)
    row["decode_ms_mean"] = round(1e3 * float(np.mean(result.decode_seconds)), 3)
    row["decode_ms_max"] = round(1e3 * float(np.max(result.decode_seconds)), 3)
  if result.after_step_seconds:
    row["jitted_step_ms"] = round(1e3 * float(np.median(np.subtract(result.decode_seconds, result.after_step_seconds))), 3)
    row["after_step_ms"] = round(1e3 * float(np.median(result.after_step_seconds)), 3)
  for stat, value in result.policy_stats.items():
    if stat.endswith("_seconds"):
      row[f"{stat[:-8]}_ms_per_step"] = round(1e3 * value / steps, 3)
    elif isinstance(value, float):
      row[stat] = round(value, 4)
    elif value is not None:
      row[stat] = value
  return row


def markdown_table(rows: list[dict]) -> str:
  if not rows:
    return "(no rows)\n"
  columns = list(dict.fromkeys(k for row in rows for k in row))
  def fmt(v):  # a cell stays one cell: newlines and pipes in generated text are escaped
    return f"{v:.4g}" if isinstance(v, float) else str(v).replace("\n", "\\n").replace("|", "\\|")
  lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
  lines += ["| " + " | ".join(fmt(row.get(c, "")) for c in columns) + " |" for row in rows]
  return "\n".join(lines) + "\n"


def write_results(name: str, rows: list[dict], *, out_dir: str | os.PathLike | None = None, notes: str = "",
                  summary: list[dict] | None = None, measured_by: list[dict] | None = None) -> dict:
  """Writes <out_dir>/<name>.json and <name>.md; returns the JSON document.

  `summary` (rows aggregated from `rows`, e.g. mean scores) goes into the JSON under
  "summary" and into the markdown as a first table, before the rows. `measured_by`: the
  stamped documents the rows were copied from (a combined table): their device, JAX and
  commit replace this process's, which measured nothing.
  """
  doc = stamp() | (sources_stamp(measured_by) if measured_by else {}) | {"rows": rows}
  if notes:
    doc["notes"] = notes
  if summary is not None:
    doc["summary"] = summary
  return write_document(name, doc, out_dir=out_dir)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
  """Replaces `path` by `text` in one rename: studies rewrite their files after every sample so a
  run cut short keeps them, and a kill in the middle of a plain rewrite left a truncated file."""
  tmp = pathlib.Path(f"{path}.tmp{os.getpid()}")
  tmp.write_text(text)
  os.replace(tmp, path)


def write_document(name: str, doc: dict, *, out_dir: str | os.PathLike | None = None) -> dict:
  """Writes a stamped document (rows, optional notes and summary) as <name>.json and <name>.md,
  as measured: also how a correction to a results file is written, its stamp kept."""
  directory = pathlib.Path(out_dir) if out_dir else RESULTS_DIR
  directory.mkdir(parents=True, exist_ok=True)
  write_text_atomic(directory / f"{name}.json", json.dumps(doc, indent=2) + "\n")
  header = f"# {name}\n\n" + "".join(f"- {k}: `{doc[k]}`\n" for k in ("device", "jax", "commit", "date", "command"))
  if doc.get("notes"):
    header += f"\n{doc['notes']}\n"
  body = markdown_table(doc["rows"])
  if doc.get("summary") is not None:
    body = "## Summary\n\n" + markdown_table(doc["summary"]) + "\n## Rows\n\n" + body
  write_text_atomic(directory / f"{name}.md", header + "\n" + body)
  return doc
