"""experiments/bench_context_copy.py runs end to end at a tiny size, and the copy decodes as the load."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_context_copy_small(tmp_path):
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "experiments")]), JAX_PLATFORMS="cpu")
  policy = "retrieval:index=flat:topk=8:sinks=4:window=16:bridge=per_step:lag=2:speculative=true:pinned=2"
  cmd = [sys.executable, os.path.join(ROOT, "experiments", "bench_context_copy.py"), "--model=smollm2",
         "--length=300", f"--policy={policy}", "--repeats=2", "--tokens=4", f"--out_dir={tmp_path}", "--name=small"]
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-2000:]
  (row,) = json.loads((tmp_path / "small.json").read_text())["rows"]
  assert row["copy_decodes_as_loaded"] is True and row["repeats"] == 2
  assert row["save_s"] > 0 and row["load_s"] > 0 and row["copy_s"] > 0 and row["saved_mb"] > 0
