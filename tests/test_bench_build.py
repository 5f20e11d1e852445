"""experiments/bench_build.py runs end to end at a tiny size."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("on_cpu, max_keys, candidates", [(False, None, "none"), (True, None, "exact"),
                                                          (True, 399, "blocks")])  # 400 keys a head
def test_bench_build_small(tmp_path, on_cpu, max_keys, candidates):
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "experiments")]), JAX_PLATFORMS="cpu")
  cmd = [sys.executable, os.path.join(ROOT, "experiments", "bench_build.py"), "--layers=2", "--q_heads=4",
         "--kv_heads=2", "--head_dim=16", "--keys=400", "--train_queries=64", "--train_topk=10",
         f"--candidates_on_cpu={on_cpu}", f"--out_dir={tmp_path}", "--name=small"]
  cmd += [] if max_keys is None else [f"--max_exact_candidate_keys={max_keys}", "--neighbour_block=64",
                                      "--neighbour_probes=2"]
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  rows = json.loads((tmp_path / "small.json").read_text())["rows"]
  assert [r["schedule"] for r in rows] == ["per_head", "queued"]
  for r in rows:
    assert r["builds"] == 2 * 4 and r["build_s"] > 0 and 0 <= r["probe_top10_overlap"] <= 1
    assert r["candidates"] == candidates  # on a CPU backend only when asked, up to the longest head allowed
    phases = [r[f"phase_{p}_s"] for p in ("topk", "project", "connect", "repair", "cooc")]
    assert min(phases) >= 0 and r["phase_connect_s"] > 0
  assert rows[0]["speedup_vs_first"] == 1
