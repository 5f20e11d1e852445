"""The eval CLIs' sample seeds (experiments/eval_common.py): --seeds picks samples by seed,
--seeds_from those an earlier run's policy lost or won against full."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest
from absl import app

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "experiments"))

import eval_common  # noqa: E402


def test_seeds_default_to_a_run_from_seed():
  assert eval_common.sample_seeds([], seed=3, samples=4) == [3, 4, 5, 6]


def test_explicit_seeds_replace_seed_and_samples_in_their_order():
  assert eval_common.sample_seeds(["39", "5", "16"], seed=0, samples=50) == [39, 5, 16]


@pytest.mark.parametrize("seeds,samples,match", [(["5", "x"], 1, "--seeds=5,x must be integers"),
                                                 (["5", "5"], 1, "--seeds=5,5 repeats a seed"),
                                                 ([], 0, "--samples=0 must be at least 1")])
def test_bad_seeds_are_refused_by_name(seeds, samples, match):
  with pytest.raises(app.UsageError, match=match):
    eval_common.sample_seeds(seeds, seed=0, samples=samples)


def test_seed_text_shortens_each_run_of_three_or_more():
  assert eval_common.seed_text(list(range(30, 50))) == "30-49"
  assert eval_common.seed_text([5, 16, 32]) == "5, 16, 32"
  assert eval_common.seed_text([7]) == "7"
  assert eval_common.seed_text([0, 1, 2, 3, 40, 41, 50]) == "0-3, 40, 41, 50"
  assert eval_common.seed_text([39, 5, 6, 7]) == "39, 5-7"  # the order given (a --seeds list) is kept


def test_seeds_from_an_earlier_run(tmp_path):
  rows = [dict(task="niah", length=4096, depth=None, seed=s, policy=p, score=score)
          for s, p, score in ((7, "full", 1.0), (7, "fast", 0.5), (3, "full", 0.5), (3, "fast", 1.0),
                              (5, "full", 1.0), (5, "fast", 1.0))]
  path = tmp_path / "run.json"
  path.write_text(json.dumps({"rows": rows}))
  assert eval_common.sample_seeds([], seed=0, samples=50, seeds_from=f"{path}:fast") == [7]
  assert eval_common.sample_seeds([], seed=0, samples=50, seeds_from=f"{path}:fast:both") == [7, 3]


@pytest.mark.parametrize("spec,match", [("{path}", "must be FILE:POLICY"),
                                        ("{path}:slow", "no rows of policy 'slow'"),
                                        ("{path}:fast:lost", "which='lost' must be one of"),
                                        ("{path}.missing:fast", "cannot read rows"),
                                        ("{path}:fast:better", "agree on every seed")])
def test_bad_seeds_from_is_refused_by_name(tmp_path, spec, match):
  path = tmp_path / "run.json"
  rows = [dict(seed=1, policy="full", score=1.0), dict(seed=1, policy="fast", score=0.0)]
  path.write_text(json.dumps({"rows": rows}))
  with pytest.raises(app.UsageError, match=match):
    eval_common.sample_seeds([], seed=0, samples=1, seeds_from=spec.format(path=path))
  with pytest.raises(app.UsageError, match="not both"):
    eval_common.sample_seeds(["1"], seed=0, samples=1, seeds_from=f"{path}:fast")
