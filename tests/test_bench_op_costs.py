"""experiments/bench_op_costs.py runs end to end at a tiny size with consistent numbers."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_op_costs_small(tmp_path):
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "experiments")]), JAX_PLATFORMS="cpu")
  cmd = [sys.executable, os.path.join(ROOT, "experiments", "bench_op_costs.py"), "--keys=300,900", "--q_heads=4",
         "--kv_heads=2", "--head_dim=16", "--topk=10", "--train_queries=40", "--repeats=4", "--layers=2", f"--out_dir={tmp_path}",
         "--name=small"]
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  rows = json.loads((tmp_path / "small.json").read_text())["rows"]
  assert [r["keys"] for r in rows] == [300, 900]
  for r in rows:
    assert r["search_ms_per_head"] > 0 and r["insert_ms_per_graph"] > 0 and r["threads"] == 1 and r["layers"] == 2
    assert 10 <= r["scanned_keys"] <= r["keys"] and abs(r["scanned_share"] - r["scanned_keys"] / r["keys"]) < 0.01


def test_bench_op_costs_thread_sweep(tmp_path):
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "experiments")]), JAX_PLATFORMS="cpu")
  cmd = [sys.executable, os.path.join(ROOT, "experiments", "bench_op_costs.py"), "--keys=400", "--q_heads=4",
         "--kv_heads=2", "--head_dim=16", "--topk=10", "--train_queries=40", "--repeats=3", "--layers=3",
         "--threads=2", "--searched_share=1", f"--out_dir={tmp_path}", "--name=sweep"]
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  one, *steps = json.loads((tmp_path / "sweep.json").read_text())["rows"]
  assert one["threads"] == 1 and "step_search_ms" not in one
  assert [r["threads"] for r in steps] == [1, 2]  # the one-thread call is always timed: the efficiencies' base
  assert steps[0]["search_efficiency"] == 1 and steps[0]["insert_efficiency"] == 1
  for r in steps:
    assert r["step_searches"] == 3 * 4 and r["step_inserts"] == 3 * 2
    assert r["step_search_ms"] > 0 and r["step_insert_ms"] > 0 and r["search_efficiency"] > 0
    assert r["keys"] > 400  # the inserts of the rows before grew the stores
