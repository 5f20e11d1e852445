"""experiments/bench_key_scores.py runs end to end at a tiny size (XLA scorers on the CPU)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_key_scores_small(tmp_path):
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "experiments")]), JAX_PLATFORMS="cpu")
  cmd = [sys.executable, os.path.join(ROOT, "experiments", "bench_key_scores.py"), "--contexts=256", "--batches=2",
         "--implementations=xla", "--layers=2", "--q_heads=4", "--kv_heads=2", "--head_dim=32", "--page_size=8",
         "--reps=2", f"--out_dir={tmp_path}", "--name=small"]
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  rows = json.loads((tmp_path / "small.json").read_text())["rows"]
  assert [r["summary"] for r in rows] == ["minmax", "keys2", "keys4"]
  by = {r["summary"]: r["summary_bytes"] for r in rows}
  # 2 layers, 2 sequences, 2 KV heads, 32 pages of 8 keys: min/max two bf16 rows of 32 a page;
  # codes D * bits / 8 bytes a key, plus lo and step (f32 rows of 32 per layer, sequence, head).
  assert by["minmax"] == 2 * 2 * 2 * 32 * 32 * 2 * 2
  assert by["keys4"] == 2 * 2 * 2 * 32 * 8 * 16 + 2 * (2 * 2 * 2 * 32 * 4)
  assert all(r["ms"] > 0 for r in rows)
