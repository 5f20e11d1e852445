"""experiments/bench_group_search.py runs end to end at a tiny size with both parts and reports
consistent rows."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_group_search_small(tmp_path):
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "experiments")]), JAX_PLATFORMS="cpu")
  cmd = [sys.executable, os.path.join(ROOT, "experiments", "bench_group_search.py"), "--model=random:tiny",
         "--context_len=700", "--decode_steps=4", "--sinks=16", "--window=64", "--k=20", "--layers=0",
         "--efs=16,40", "--synthetic_keys=600", "--synthetic_layers=2", "--synthetic_steps=3",
         f"--cache_dir={tmp_path / 'cache'}", f"--out_dir={tmp_path}", "--name=small"]
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-2000:]
  doc = json.loads((tmp_path / "small.json").read_text())
  rows = {(r["part"], r["ef"], r["mode"]): r for r in doc["summary"]}
  assert set(rows) == {(p, ef, m) for p in ("real", "synthetic") for ef in (16, 40) for m in ("per_head", "grouped")}
  for (part, ef, mode), row in rows.items():
    assert row["rows_per_step"] > 0 and row["ms_per_step"] > 0
    assert (row["recall"] is None) == (part == "synthetic")
  assert rows["real", 40, "grouped"]["recall"] > 0.8
  assert (tmp_path / "small.md").exists()
