"""experiments/bench_insert_runs.py runs end to end at a tiny size and indexes every token it appends."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_insert_runs_small(tmp_path):
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "experiments")]), JAX_PLATFORMS="cpu")
  cmd = [sys.executable, os.path.join(ROOT, "experiments", "bench_insert_runs.py"), "--layers=3", "--keys=300",
         "--dim=16", "--rounds=2", "--runs=1,2,3", "--threads=1", f"--out_dir={tmp_path}", "--name=small"]
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-2000:]  # it raises when a token was left unindexed
  rows = json.loads((tmp_path / "small.json").read_text())["rows"]
  assert [r["run"] for r in rows] == [1, 2, 3]
  for r in rows:  # 2 timed steps a run length unit per round, every layer's tokens timed once
    assert r["timed_inserts"] == 2 * r["run"] * 3 * 3 * 2 and r["us_per_insert"] > 0
  assert rows[0]["vs_first"] == 1.0


def test_bench_insert_runs_rejects_repeated_runs_and_no_rounds(tmp_path):
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "experiments")]), JAX_PLATFORMS="cpu")
  base = [sys.executable, os.path.join(ROOT, "experiments", "bench_insert_runs.py"), "--layers=2", "--keys=100",
          "--dim=8", f"--out_dir={tmp_path}", "--name=bad"]
  for bad, named in (("--runs=4,4", "--runs=4,4"), ("--rounds=0", "--rounds=0")):
    proc = subprocess.run(base + [bad], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and named in proc.stderr, proc.stderr[-1000:]
  assert not list(tmp_path.iterdir())  # rejected before any work
