"""experiments/bench_train_topk.py runs end to end at a tiny size; its three methods agree."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_train_topk_small(tmp_path):
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "experiments")]), JAX_PLATFORMS="cpu")
  cmd = [sys.executable, os.path.join(ROOT, "experiments", "bench_train_topk.py"), "--keys=300,517",
         "--train_queries=70", "--q_heads=4", "--kv_heads=2", "--head_dim=16", "--topk=9", "--repeats=2",
         f"--out_dir={tmp_path}", "--name=tk"]
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = json.loads((tmp_path / "tk.json").read_text())["rows"]
  assert [(r["method"], r["keys"]) for r in rows] == [
      (m, n) for n in (300, 517) for m in ("topk_rows", "argpartition", "flat_search")]
  for r in rows:  # random float32 scores: no exact ties at this size, so every id agrees
    assert r["equal_ids_vs_topk_rows"] == 1.0 and r["seconds"] > 0 and len(r["runs"].split()) == 2
  assert all(r["vs_topk_rows"] == 1.0 for r in rows if r["method"] == "topk_rows")
