"""experiments/bench_insert.py runs end to end at a tiny size, and its inserts make keys findable."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("kind", ["roar", "graph"])
def test_bench_insert_small(tmp_path, kind):
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "experiments")]), JAX_PLATFORMS="cpu")
  cmd = [sys.executable, os.path.join(ROOT, "experiments", "bench_insert.py"), "--model=random:tiny",
         "--context_len=700", "--decode_steps=4", "--sinks=16", "--window=64", "--inserts=96", "--k=20",
         "--layers=0", f"--index_kind={kind}", "--ef_inserts=32,8", f"--cache_dir={tmp_path / 'cache'}",
         f"--out_dir={tmp_path}", "--name=small"]
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-2000:]
  doc = json.loads((tmp_path / "small.json").read_text())
  rows = {r["ef_insert"]: r for r in doc["summary"]}
  assert list(rows) == ["rebuilt", "absent", 32, 8]
  assert rows["absent"]["inserted_recall"] == 0.0  # keys left out of the index are never returned
  for ef in (32, 8):
    assert rows[ef]["us_per_insert"] > 0
    assert rows[ef]["inserted_recall"] > 0.5  # inserted keys are found
  assert rows["rebuilt"]["recall"] > 0.8
