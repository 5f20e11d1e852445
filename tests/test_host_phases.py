"""experiments/host_phases.py: the "speculation hides" share follows from the rows it pairs."""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "experiments"))

import host_phases  # noqa: E402

PAIRS = [("lag2", "after_step_ms", "lag1"), ("lag2_spec", "after_step_ms", "lag1")]


def row(policy, context, **fields):
  return dict(policy=policy, context=context, decode_ms=1.0, **fields)


def test_share_is_one_minus_critical_over_the_synchronous_search():
  rows = [row("lag1", 8, attend_ms_median=10.0, after_step_ms=12.0),
          row("lag2", 8, after_step_ms=4.0, attend_ms_median=9.0),
          row("lag2_spec", 8, after_step_ms=1.5),
          row("lag2", 16, after_step_ms=3.0)]  # no lag-1 row at 16: no share
  shares = host_phases.hidden_shares(rows, case=("context",), pairs=PAIRS)
  assert [(s["policy"], s["context"], s["against"]) for s in shares] == [("lag2", 8, "lag1"), ("lag2_spec", 8, "lag1")]
  assert [s["hidden_share"] for s in shares] == [pytest.approx(0.6), pytest.approx(0.85)]
  assert shares[0]["critical_host_ms"] == 4.0 and shares[0]["sync_search_attend_ms"] == 10.0


def test_rows_that_failed_or_lack_the_fields_give_no_share():
  rows = [row("lag1", 8, attend_ms_median=10.0), dict(policy="lag2", context=8, error="OOM"),
          row("lag2_spec", 8)]  # no after_step_ms
  assert host_phases.hidden_shares(rows, case=("context",), pairs=PAIRS) == []
  # a slower critical path than the synchronous search: a negative share, reported as measured
  rows = [row("lag1", 8, attend_ms_median=2.0), row("lag2", 8, after_step_ms=3.0)]
  assert host_phases.hidden_shares(rows, case=("context",), pairs=PAIRS)[0]["hidden_share"] == pytest.approx(-0.5)


def test_a_policy_run_in_several_rows_counts_by_its_medians():
  rows = [row("lag1", 8, attend_ms_median=10.0), row("lag2", 8, after_step_ms=2.0),
          row("lag1", 8, attend_ms_median=11.0), row("lag2", 8, after_step_ms=3.0),
          row("lag1", 8, attend_ms_median=14.0), row("lag2", 8, after_step_ms=9.0)]
  (share,) = host_phases.hidden_shares(rows, case=("context",), pairs=PAIRS)
  # the medians, neither the first rows' 10 / 2 nor the last rows' 14 / 9
  assert share["critical_host_ms"] == 3.0 and share["sync_search_attend_ms"] == 11.0
  assert share["hidden_share"] == pytest.approx(1 - 3.0 / 11.0, abs=1e-3)
