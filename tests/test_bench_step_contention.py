"""experiments/bench_step_contention.py runs end to end at a tiny size."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_step_contention_small(tmp_path):
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "experiments")]), JAX_PLATFORMS="cpu",
             OPENBLAS_NUM_THREADS="1")
  cmd = [sys.executable, os.path.join(ROOT, "experiments", "bench_step_contention.py"), "--model=random:tiny",
         "--context_len=700", "--steps=2", "--copy_mb=8", f"--out_dir={tmp_path}", "--name=small"]
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-2000:]
  rows = json.loads((tmp_path / "small.json").read_text())["rows"]
  assert [r["policy"] for r in rows] == ["full", "retrieval_step_lag2_kv_spec"]
  cases = ("none", "gil1", "gil1_nice10", "gil1_switch0.5", "cpu8", "cpu16", "cpu16_nice10", "mem8", "none_again")
  assert all(r[f"{case}_ms"] > 0 for r in rows for case in cases)
