"""experiments/bench_neighbours.py runs end to end at a tiny size."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_neighbours_small(tmp_path):
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "experiments")]), JAX_PLATFORMS="cpu")
  cmd = [sys.executable, os.path.join(ROOT, "experiments", "bench_neighbours.py"), "--layers=1", "--keys=600",
         "--head_dim=16", "--train_queries=50", "--count=8", "--configs=64x2", "--efs=20", "--k=10", "--threads=1",
         f"--out_dir={tmp_path}", "--name=small"]
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  rows = json.loads((tmp_path / "small.json").read_text())["rows"]
  assert [r["candidates"] for r in rows] == ["exact", "blocks 64x2", "none (search-built)"]
  assert rows[0]["candidate_recall"] == 1.0 and 0 < rows[1]["candidate_recall"] <= 1
  assert rows[2]["candidate_recall"] is None
  assert all(0 < r["recall_ef20"] <= 1 and 0 < r["scanned_ef20"] <= 1 for r in rows)


def test_bench_neighbours_candidates_only(tmp_path):
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "experiments")]), JAX_PLATFORMS="cpu")
  cmd = [sys.executable, os.path.join(ROOT, "experiments", "bench_neighbours.py"), "--layers=1", "--keys=2000",
         "--head_dim=16", "--count=8", "--configs=64x2,64x64", "--candidates_only=50", f"--out_dir={tmp_path}",
         "--name=small"]
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  rows = json.loads((tmp_path / "small.json").read_text())["rows"]
  assert [r["candidates"] for r in rows] == ["blocks 64x2", "blocks 64x64"]
  assert 0 < rows[0]["candidate_recall"] <= rows[1]["candidate_recall"] == 1.0  # 64 probes: every block


def test_bench_neighbours_rejects_a_bad_config(tmp_path):
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "experiments")]), JAX_PLATFORMS="cpu")
  cmd = [sys.executable, os.path.join(ROOT, "experiments", "bench_neighbours.py"), "--configs=64-2",
         f"--out_dir={tmp_path}"]
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode != 0 and "64-2" in proc.stderr
