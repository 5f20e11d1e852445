"""experiments/bench_scale.py runs end to end on the CPU (synthetic and real contexts) and its
summary rows follow from its rows."""

import json
import os
import statistics
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_bench(tmp_path, name, *flags):
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "experiments")]), JAX_PLATFORMS="cpu")
  cmd = [sys.executable, os.path.join(ROOT, "experiments", "bench_scale.py"), "--model=random:tiny",
         "--dtype=float32", "--steps=4", f"--out_dir={tmp_path}", f"--name={name}", *flags]
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads((tmp_path / f"{name}.json").read_text())


def test_synthetic_contexts_at_two_lengths_and_batches(tmp_path):
  doc = run_bench(tmp_path, "synthetic", "--context=synthetic", "--calibration=random", "--calibration_len=1800",
                  "--context_lens=2048,3072", "--batches=1,2", "--policies=full,freekv",
                  "--index=flat", "--sinks=32", "--window=64", "--budget=256")
  rows = doc["rows"]
  assert len(rows) == 2 * 2 * 2 and not [r for r in rows if "error" in r], rows
  assert {r["context_kind"] for r in rows} == {"synthetic"} and "SYNTHETIC" in doc["notes"]
  for r in rows:
    assert r["tokens_per_s"] == pytest.approx(r["batch"] * 1e3 / r["decode_ms"], rel=1e-3, abs=0.01)  # both are rounded
  for s in doc["summary"]:
    mine = {(r["context"], r["batch"]): r for r in rows if r["policy"] == s["policy"]}
    assert s["growth_2048"] == 1.0
    assert s["growth_3072"] == pytest.approx(mine[3072, 1]["decode_ms"] / mine[2048, 1]["decode_ms"], abs=1e-3)
  freekv = [r for r in rows if r["policy"] == "freekv"]
  assert all(r["resident_bytes"] > 0 for r in freekv)  # the host store holds the context


def test_retrieval_rows_share_one_index_build(tmp_path):
  doc = run_bench(tmp_path, "shared", "--context=synthetic", "--calibration=random", "--calibration_len=1800",
                  "--context_lens=2048", "--policies=retrieval_spec,retrieval", "--index=flat", "--sinks=32",
                  "--window=64", "--switch_interval=0.001,0.005")
  rows = doc["rows"]
  assert [(r["policy"], r["switch_interval"]) for r in rows] == [
      ("retrieval_spec", 0.001), ("retrieval_spec", 0.005), ("retrieval", 0.001), ("retrieval", 0.005)]
  assert not [r for r in rows if "error" in r], rows
  # the plain rows load the speculative row's saved context: its decode options are not theirs
  spec, plain = rows[0], rows[2]
  assert "speculative" in spec["describe"] and "speculative" not in plain["describe"]
  # every row decodes the loaded context's build, not a new one
  assert {r["prefill_and_index_s"] for r in rows} == {plain["prefill_and_index_s"]}


def test_real_contexts_on_two_simulated_devices(tmp_path):
  doc = run_bench(tmp_path, "real", "--devices=1,2", "--context_lens=256", "--policies=full", "--step_times")
  assert [r["devices"] for r in doc["rows"]] == [1, 2] and all("decode_ms" in r for r in doc["rows"])
  for r in doc["rows"]:  # --step_times: the steps after the first, whose median is decode_ms
    steps = [float(t) for t in r["decode_ms_steps"].split()]
    assert len(steps) == 2 and statistics.median(steps) == pytest.approx(r["decode_ms"], abs=0.06)


def test_ragged_batches_through_a_host_backed_policy(tmp_path):
  doc = run_bench(tmp_path, "ragged", "--context_lens=1024", "--batches=3", "--ragged", "--policies=freekv,freekv_step",
                  "--sinks=32", "--window=64", "--budget=256", "--max_recall=2",
                  "--switch_interval=0.001")
  per_layer, per_step = doc["rows"]
  assert "--switch_interval=0.001" in doc["command"] and {r["switch_interval"] for r in doc["rows"]} == {0.001}
  assert "max_recall 2" in per_layer["describe"] and "one host exchange per step" in per_step["describe"]
  assert per_layer["lengths"] == "1024,854,683" and per_layer["callbacks_per_step"] == 1.0  # one per sparse layer, whole batch
  assert per_step["callbacks_per_step"] == 0 and per_step["host_exchanges"] == per_step["decode_steps"] == 3  # no callback
  # per-step host phase medians from the runtime's counters, steps after the first
  assert per_layer["callback_ms_median"] > 0 and per_step["exchange_ms_median"] > 0
  assert per_step["callback_ms_median"] == 0  # per_step makes no callback


def test_per_step_rows_report_the_share_of_host_time_lag_2_hides(tmp_path):
  doc = run_bench(tmp_path, "hides", "--context=synthetic", "--calibration=random", "--calibration_len=1800",
                  "--context_lens=2048", "--policies=retrieval_step_lag1_kv,retrieval_step_lag2_kv", "--index=roar",
                  "--sinks=32", "--window=64")
  sync, lag2 = doc["rows"]
  assert "per KV head" in sync["describe"], sync["describe"]
  (share,) = [s for s in doc["summary"] if "hidden_share" in s]
  assert share["policy"] == "retrieval_step_lag2_kv" and share["against"] == "retrieval_step_lag1_kv"
  assert share["sync_search_attend_ms"] == sync["attend_ms_median"] > 0
  assert share["hidden_share"] == pytest.approx(1 - lag2["after_step_ms"] / sync["attend_ms_median"], abs=1e-3)


def test_a_policy_listed_twice_counts_by_its_median_row(tmp_path):
  doc = run_bench(tmp_path, "rounds", "--context=synthetic", "--calibration=random", "--calibration_len=1800",
                  "--context_lens=2048", "--policies=full,freekv,full,freekv,freekv", "--sinks=32", "--budget=256",
                  "--window=64")
  rows = doc["rows"]
  assert not [r for r in rows if "error" in r], rows
  ms = {p: [r["decode_ms"] for r in rows if r["policy"] == p] for p in ("full", "freekv")}
  summary = {s["policy"]: s for s in doc["summary"]}
  for policy, mine in ms.items():
    s = summary[policy]
    assert s["decode_ms_2048"] == pytest.approx(statistics.median(mine), abs=1e-3)  # never the best row
    assert s["rows_2048"] == f"{len(mine)}: {min(mine)}-{max(mine)}"
    assert s["best_tokens_per_s_2048"] == f"{round(1e3 / statistics.median(mine), 2)} (batch 1)"
  assert summary["freekv"]["vs_full_2048"] == pytest.approx(
      statistics.median(ms["freekv"]) / statistics.median(ms["full"]), abs=1e-3)
  assert "vs_full_2048" not in summary["full"]
