"""experiments/bench_host.py runs end to end at a tiny size, stamped from its first row."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_host_small_bfloat16(tmp_path):
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", KVJAX_COMMIT="abc123")
  cmd = [sys.executable, os.path.join(ROOT, "experiments", "bench_host.py"), "--n_keys=2048", "--build_sizes=1024",
         "--q_heads=4", "--kv_heads=2", "--head_dim=32", "--dtype=bfloat16", "--kinds=flat,graph", "--topk=100",
         "--ef_100=200", "--steps=3", f"--out_dir={tmp_path}"]
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  doc = json.loads((tmp_path / "bench_host.json").read_text())
  assert doc["commit"] == "abc123" and doc["date"] and doc["jax"]  # the commit the caller passed
  layer = {r["kind"]: r for r in doc["rows"] if r["bench"] == "layer_attend"}
  # The truth ranks the keys as the bfloat16 store holds them: exact search scores 1 (0.998 against
  # float16-rounded keys before).
  assert layer["flat"]["recall"] == 1.0 and 0 < layer["graph"]["recall"] <= 1
  assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]  # written through a rename
