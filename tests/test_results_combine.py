"""eval_ruler --combine: one table from several stamped runs, stamped with what measured them."""

import json
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def _run_doc(seed: int, commit: str) -> dict:
  rows = [dict(task="niah_single_2", length=32000, seed=seed, policy=policy, score=score, ms_per_token=1.0)
          for policy, score in (("full", 1.0), ("retrieval", float(seed % 2)))]
  return dict(device="gpu:NVIDIA H200", jax="0.11.2", commit=commit, date="2026-12-02T00:00:00+00:00",
              command="eval_ruler.py ...", rows=rows, notes="")


def test_combined_table_keeps_the_sources_device_and_commits(tmp_path):
  paths = []
  for i, (seeds, commit) in enumerate((((0, 1), "aaaa"), ((2, 3), "bbbb"))):
    doc = _run_doc(seeds[0], commit)
    doc["rows"] += _run_doc(seeds[1], commit)["rows"]
    paths.append(tmp_path / f"part{i}.json")
    paths[-1].write_text(json.dumps(doc))
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=f"{REPO}:{REPO / 'experiments'}")
  subprocess.run([sys.executable, str(REPO / "experiments" / "eval_ruler.py"), f"--combine={paths[0]},{paths[1]}",
                  "--name=both", f"--out_dir={tmp_path}", "--noplot"], check=True, env=env, capture_output=True)
  combined = json.loads((tmp_path / "both.json").read_text())
  assert (combined["device"], combined["commit"]) == ("gpu:NVIDIA H200", "aaaa, bbbb")
  assert len(combined["rows"]) == 8
  assert combined["summary"][0]["retrieval @32000"] == 0.5  # seeds 1 and 3 of 0-3 pass
  paired = json.loads((tmp_path / "both_paired.json").read_text())
  assert paired["device"] == "gpu:NVIDIA H200"
  assert paired["rows"][0]["n"] == 4


def test_a_sample_in_two_files_counts_once_and_conflicting_scores_are_refused(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=f"{REPO}:{REPO / 'experiments'}")
  first, rerun = _run_doc(1, "aaaa"), _run_doc(1, "bbbb")  # seed 1 twice, the same scores
  first["rows"] += _run_doc(2, "aaaa")["rows"]
  paths = [tmp_path / "a.json", tmp_path / "b.json"]
  for path, doc in zip(paths, (first, rerun)):
    path.write_text(json.dumps(doc))
  command = [sys.executable, str(REPO / "experiments" / "eval_ruler.py"), f"--combine={paths[0]},{paths[1]}",
             "--name=both", f"--out_dir={tmp_path}", "--noplot"]
  subprocess.run(command, check=True, env=env, capture_output=True)
  combined = json.loads((tmp_path / "both.json").read_text())
  assert len(combined["rows"]) == 4 and combined["summary"][0]["retrieval @32000"] == 0.5  # seeds 1 and 2
  rerun["rows"][1]["score"] = 0.0  # the rerun lost seed 1
  paths[1].write_text(json.dumps(rerun))
  proc = subprocess.run(command, env=env, capture_output=True, text=True)
  assert proc.returncode != 0 and "different scores" in proc.stderr
