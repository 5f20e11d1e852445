"""host_index's OpenMP threads sleep when idle: importing host_index sets OMP_WAIT_POLICY=PASSIVE
unless the user chose a policy or spin count (host_index/__init__.py says why)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# After a parallel search on 2 threads, the process's CPU time while its main thread sleeps: what
# the idle OpenMP worker burns spinning.
PROBE = """
import json, os, resource, time
import numpy as np
import host_index

def cpu_seconds():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime

ctx = host_index.HostContext(1, 1, 4, 2, 16, dtype="float32", kind="flat")
keys = np.random.default_rng(0).standard_normal((2, 20000, 16), dtype=np.float32)
ctx.append(0, 0, 0, keys, keys)
queries = keys[None, None, :, :2].reshape(1, 1, 4, 16).copy()
spent = 0.0
for _ in range(10):
    ctx.search_layers([0], queries, k=10, threads=2)
    before = cpu_seconds()
    time.sleep(0.05)
    spent += cpu_seconds() - before
print(json.dumps({"policy": os.environ.get("OMP_WAIT_POLICY"), "cpu_ms_per_sleep": 1e3 * spent / 10}))
"""


def run(code: str, **env_vars) -> subprocess.CompletedProcess:
  env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
  env.update(env_vars, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")])))
  proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  return proc


def probe(**env_vars) -> dict:
  return json.loads(run(PROBE, **env_vars).stdout.strip().splitlines()[-1])


def test_idle_threads_sleep_unless_the_user_chose_a_policy():
  default = probe()
  assert default["policy"] == "PASSIVE" and default["cpu_ms_per_sleep"] < 5  # 0.5 ms measured on 2 cores
  active = probe(OMP_WAIT_POLICY="ACTIVE")  # the user's choice stands: the idle worker spins throughout
  # A spinning worker burns up to the whole 50 ms sleep; with other processes on the cores it got
  # 19 ms (2 cores, an eval beside the suite), still 40x the sleeping threads' 0.5.
  assert active["policy"] == "ACTIVE" and active["cpu_ms_per_sleep"] > 10


def test_a_libgomp_loaded_earlier_is_named_in_a_warning():
  """Loaded before host_index, libgomp has read its settings already: the import says so."""
  early = run("import ctypes, warnings; ctypes.CDLL('libgomp.so.1'); warnings.simplefilter('always'); "
              "import host_index")
  assert "libgomp was loaded before host_index" in early.stderr
  assert "libgomp was loaded" not in run("import host_index").stderr
