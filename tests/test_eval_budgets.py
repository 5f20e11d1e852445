"""kvjax.eval.budgets: one token budget, split per policy family."""

import pytest

from kvjax.eval import budgets
from kvjax.policies import make_policy


def attended(family: str, options: dict) -> int:
  """Tokens a query head attends per step under these options (budgets' own definition)."""
  if family == "streaming":
    return options["sinks"] + options["window"]
  if family in ("quest", "freekv"):
    return options["budget"]
  return options["sinks"] + options["window"] + options["topk"]


@pytest.mark.parametrize("family", budgets.FAMILIES)
@pytest.mark.parametrize("budget", [128, 256, 768, 1024, 2048, 8192])
def test_every_family_attends_exactly_the_budget_and_accepts_its_options(family, budget):
  options = budgets.budget_options(family, budget)
  if family == "retrieval" and budget < 640 + budgets.MIN_RETRIEVED:
    assert options is None
    return
  assert attended(family, options) == budget
  make_policy(family, **options)  # the policy's own validation accepts the split


def test_defaults_are_the_papers_at_their_budgets():
  assert budgets.budget_options("freekv", 2048) == dict(sinks=512, window=512, budget=2048)  # FreeKV's default
  assert budgets.budget_options("retrieval", 768) == dict(sinks=128, window=512, topk=128)  # its static set
  assert budgets.budget_options("retrieval", 640) is None  # nothing left to retrieve
  assert budgets.budget_options("streaming", 640) == dict(sinks=128, window=512)  # StreamingLLM's default here


def test_specs_full_first_labels_and_extra_options():
  specs = budgets.budget_specs(["freekv", "retrieval"], [256, 1024], {"freekv": {"page_summary": "keys4"}})
  assert [s.label for s in specs] == ["full", "freekv@256", "freekv@1024", "retrieval@1024"]
  assert specs[1].options == dict(page_summary="keys4", sinks=64, window=64, budget=256)
  assert budgets.parse_label("freekv@1024") == ("freekv", 1024)
  assert budgets.parse_label("full") == ("full", None)


@pytest.mark.parametrize("family,budget,match", [
    ("h2o", 1024, "family='h2o'"), ("freekv", 100, "budget=100"), ("freekv", 0, "budget=0"),
    ("quest", True, "budget=True"), ("streaming", 256.0, "budget=256.0")])
def test_bad_family_or_budget(family, budget, match):
  with pytest.raises(ValueError, match=match):
    budgets.budget_options(family, budget)


def test_cli_small_run_pairs_every_point_with_full(tmp_path):
  """experiments/eval_budget.py on SmolLM2 (real weights, CPU), one 512-token sample, chosen by --seeds."""
  import json
  import os
  import pathlib
  import subprocess
  import sys

  repo = pathlib.Path(__file__).resolve().parents[1]
  env = dict(os.environ, PYTHONPATH=f"{repo}:{repo / 'experiments'}")
  cmd = [sys.executable, str(repo / "experiments" / "eval_budget.py"), "--lengths=512", "--seeds=3",
         "--budgets=256,768", "--families=streaming,freekv,retrieval", "--early_stop", "--noplot",
         f"--out_dir={tmp_path}", "--name=budget"]
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  doc = json.loads((tmp_path / "budget.json").read_text())
  assert "XLA deterministic flags: on (XLA_FLAGS=--xla_gpu_autotune_level=0" in doc["notes"]  # the default, parsed
  rows = doc["rows"]
  assert [r["policy"] for r in rows] == ["full", "streaming@256", "streaming@768", "freekv@256", "freekv@768",
                                         "retrieval@768"]
  assert {(r["family"], r["budget"]) for r in rows} >= {("full", None), ("retrieval", 768)}
  assert {r["seed"] for r in rows} == {3}
  paired = json.loads((tmp_path / "budget_paired.json").read_text())["rows"]
  assert sorted(p["policy"] for p in paired) == sorted(r["policy"] for r in rows[1:])
  assert all(p["n"] == 1 for p in paired)
