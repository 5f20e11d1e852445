"""experiments/bench_prefetch.py runs end to end at a tiny size and reports consistent numbers."""

import json
import os
import subprocess
import sys

from kvjax.policies.retrieval import RetrievalAttention

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_bench(tmp_path, name, *flags):
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "experiments")]), JAX_PLATFORMS="cpu")
  cmd = [sys.executable, os.path.join(ROOT, "experiments", "bench_prefetch.py"), "--layers=2", "--q_heads=4",
         "--kv_heads=2", "--head_dim=16", "--keys=300", "--topk=10", f"--out_dir={tmp_path}", f"--name={name}",
         *flags]
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  return json.loads((tmp_path / f"{name}.json").read_text())


def test_speculative_reuse_searches_fewer_heads(tmp_path):
  every = run_bench(tmp_path, "every", "--steps=6")["rows"][0]
  reuse = run_bench(tmp_path, "reuse", "--steps=6", "--tau=0.5")["rows"][0]
  assert every["tau"] is None and every["searched_heads"] == 2 * 4  # layers x query heads, each step
  assert reuse["tau"] == 0.5 and reuse["searched_heads"] < every["searched_heads"]


def test_roar_per_kv_head_with_a_yielding_indexing(tmp_path):
  """The 128K configuration's index (roar, a graph per KV head) and `index_yields` run end to end;
  the yielding indexing reports its waits (none beside a pass that does not yield)."""
  rows = {y: run_bench(tmp_path, f"roar_{y}", "--index=roar", "--train_queries=40", "--steps=4", "--tau=0.8",
                       f"--{'' if y else 'no'}index_yields")["rows"][0] for y in (False, True)}
  for yields, row in rows.items():
    assert row["index"] == "roar per kv head" and row["index_yields"] is yields and row["search_ms"] > 0
    assert row["index_ms"] > 0 and row["index_yield_ms"] >= 0
  assert rows[False]["index_yield_ms"] == 0


def test_pinned_spans_and_tail_slots_take_their_slots(tmp_path):
  # (without the GIL probe's steps: compare_gathers then read an update whose buffers later steps had reused)
  pinned = run_bench(tmp_path, "pinned", "--steps=4", "--pinned=2", "--pinned_span=3", "--tail_slots=5",
                     "--gil_probe_steps=0")["rows"][0]
  assert pinned["pinned"] == 2 and pinned["slots"] == 2 * 4 * (10 + 5 + 2 * 3)  # topk + tail + spans


def test_bench_prefetch_small(tmp_path):
  doc = run_bench(tmp_path, "small", "--steps=3")
  step, compare, *rest = doc["rows"]
  profile = [r for r in rest if r["kind"] == "profile"]
  assert all(r["kind"] in ("profile", "gil_hold") for r in rest)
  assert step["gil_wait_ms_per_step"] >= step["gil_long_wait_ms_per_step"] >= 0
  assert compare["kind"] == "gather_compare" and compare["rows"] > 0 and compare["stores"] == 2
  assert compare["per_store_ms"] > 0 and compare["one_call_ms"] > 0
  assert step["kind"] == "prefetch_step" and step["slots"] == 2 * 4 * (10 + RetrievalAttention.tail_slots)  # top-k + the default tail
  assert 0 < step["shipped_rows"] <= step["slots"]  # queries drift: some rows enter, never more than all
  assert step["total_ms"] >= step["search_ms"] > 0
  assert step["update_bytes"] >= step["shipped_rows"] * (8 + 2 * 16 * 2)  # bf16 rows + dest + id, padded
  assert profile
  assert (tmp_path / "small.md").exists()


def test_gil_probe_sees_a_thread_that_holds_the_gil():
  """The probe's long waits add up to most of a pure-Python spin; beside a sleep it retakes the
  GIL far more often (a count, not a time: on a loaded CI box the probe also waits for a core,
  which lengthens its waits beside a sleep as well)."""
  import threading
  import time

  sys.path.insert(0, os.path.join(ROOT, "experiments"))
  from gil_probe import GilProbe

  def spin(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
      pass

  with GilProbe(threading.get_ident(), threshold=0.001) as busy:
    spin(0.3)
  with GilProbe(threading.get_ident(), threshold=0.001) as idle:
    time.sleep(0.3)
  assert busy.summary(1)["gil_long_wait_ms_per_step"] > 150
  # ~10x apart on a quiet box; 5.7x with an eval on both of the dev box's cores beside the suite.
  assert len(idle.waits) > 4 * len(busy.waits)
  assert busy.by_line and all(isinstance(where, str) for where in busy.by_line)
