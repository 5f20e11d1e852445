"""Per-step host phase times of a decode, and the share of host time speculation hides.

Both benchmarks (bench_decode, bench_scale) read a host-backed policy's cumulative
`*_seconds` counters after every step (`HostPhases`) and compare rows measured side by side
in one run (`hidden_shares`).
"""

from __future__ import annotations

import statistics

import numpy as np


class HostPhases:
  """A host-backed policy's runtime counters read after every decode step; `medians()` gives
  each phase's median ms per step over the steps after the first (the row's `*_ms_per_step`
  means include one-off work, such as a first step's catch-up indexing). With lag 2 a
  background job's time lands in the step during which it finished."""

  def __init__(self, context):
    policy = context.policy
    self.runtime = policy.runtime(context.state) if hasattr(policy, "runtime") else None
    self.snapshots = []

  def on_step(self, step: int) -> None:
    del step
    if self.runtime is not None:
      stats = self.runtime.stats.as_dict()
      self.snapshots.append({k: v for k, v in stats.items() if k.endswith("_seconds")})

  def medians(self) -> dict:
    snaps = self.snapshots  # after steps 1, 2, ...: consecutive differences are steps 2, 3, ...
    if len(snaps) < 2:
      return {}
    return {f"{k.removesuffix('_seconds')}_ms_median": round(1e3 * float(np.median(
        [b[k] - a[k] for a, b in zip(snaps, snaps[1:])])), 3) for k in snaps[0]}


def hidden_shares(rows: list[dict], *, case: tuple[str, ...],
                  pairs: list[tuple[str, str, str]]) -> list[dict]:
  """The issue's "speculation hides" measure, 1 - (host ms on the critical path with it) /
  (host search + attention ms without it), for every `case` (e.g. context and batch) where
  both rows of a pair ran.

  pairs: (row, its critical-path field, the synchronous row): the denominator is always the
  synchronous row's `attend_ms_median` (HostPhases: search + attention, or for per_step
  search + gather, at the median step). The critical-path field is the row's own in-callback
  host time for a per-layer bridge (`attend_ms_median`) and its whole host time between
  steps for a per_step bridge (`after_step_ms`), so transfers and landing count against
  hiding, not for it. A policy with several rows in a case counts by their medians."""
  ok = [r for r in rows if "decode_ms" in r]
  out = []
  for values in dict.fromkeys(tuple(r.get(k) for k in case) for r in ok):
    same = [r for r in ok if tuple(r.get(k) for k in case) == values]

    def median(policy, field):  # over the policy's rows in this case (rounds); None if one lacks it
      theirs = [r.get(field) for r in same if r["policy"] == policy]
      return statistics.median(theirs) if theirs and None not in theirs else None

    for key, critical, sync_key in pairs:
      reference, mine = median(sync_key, "attend_ms_median"), median(key, critical)
      if reference and mine is not None:
        out.append(dict(zip(case, values)) | dict(
            policy=key, against=sync_key, critical_host_ms=mine,
            sync_search_attend_ms=reference, hidden_share=round(1 - mine / reference, 3)))
  return out
