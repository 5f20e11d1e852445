"""experiments/bench_topk.py runs end to end at a tiny size, and every chunk size gives the same ids."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_topk_small(tmp_path):
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "experiments")]), JAX_PLATFORMS="cpu")
  cmd = [sys.executable, os.path.join(ROOT, "experiments", "bench_topk.py"), "--keys=700", "--kv_heads=2",
         "--q_heads=4", "--head_dim=16", "--train_queries=40", "--train_topk=10", "--neighbours=8",
         "--block_n=64,0", "--block_q=32", "--repeats=1", f"--out_dir={tmp_path}", "--name=small"]
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-2000:]
  rows = json.loads((tmp_path / "small.json").read_text())["rows"]
  assert [(r["op"], r["block_n"]) for r in rows] == [("nearest_keys", 64), ("nearest_keys", "all"),
                                                     ("exact_topk", 64), ("exact_topk", "all")]
  assert all(r["same_ids"] and r["seconds"] > 0 for r in rows)
