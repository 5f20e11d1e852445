"""experiments/bench_compile_modes.py runs every mode and policy end to end on the CPU."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_mode_and_policy_runs(tmp_path):
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "experiments")]), JAX_PLATFORMS="cpu")
  cmd = [sys.executable, os.path.join(ROOT, "experiments", "bench_compile_modes.py"), "--model=random:tiny",
         "--dtype=float32", "--context_len=300", "--batches=2", "--steps=4", "--policies=full,freekv_step",
         f"--out_dir={tmp_path}", "--name=modes"]
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = json.loads((tmp_path / "modes.json").read_text())["rows"]
  assert [(r["mode"], r["policy"]) for r in rows] == [
      (m, p) for m in ("unrolled_cb_off", "unrolled_cb_on", "stacked") for p in ("full", "freekv_step")]
  for r in rows:
    assert "error" not in r, r
    assert 0 < r["call_ms"] <= r["jitted_ms"]
    assert r["after_ms"] > 0 or r["policy"] == "full"  # freekv exchanges pages between steps


def test_every_mode_names_valid_compile_options():
  """The GPU-only command-buffer knobs are validated by name on any backend: a typo or an
  option this jaxlib lacks fails here, not in a device call."""
  sys.path.insert(0, os.path.join(ROOT, "experiments"))
  import jax
  import jax.numpy as jnp

  import bench_compile_modes

  for mode, (layout, options) in bench_compile_modes.MODES.items():
    assert layout in ("unrolled", "stacked"), mode
    jax.jit(lambda x: x + 1, compiler_options=options)(jnp.ones(2)).block_until_ready()
