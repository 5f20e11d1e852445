"""Policy specs at a token budget: how many tokens each query head attends per decode step.

One budget B, one split per policy family, so an accuracy-against-budget curve compares the
families at equal attended tokens:

  streaming   sinks min(128, B/4) + window (the rest): StreamingLLM's static set alone.
  quest       sinks B/4 + window B/4 + selected pages B/2 (pages of 32, all on the device).
  freekv      the same split as quest (B = 2048 is FreeKV's default: 512 + 512 + 32 pages),
              pages recalled from the host, speculative reuse and correction as configured.
  retrieval   RetrievalAttention's static set, sinks 128 + window 512, and top-(B - 640) keys
              per query head from the host index; B <= 640 + 16 leaves too few to retrieve and
              is not offered. Top-k is a decode option, so every budget of one sample shares
              one prefill and one index build.

Extra options (e.g. freekv's page_summary, retrieval's index) pass through unchanged.
"""

from __future__ import annotations

from typing import Any

from kvjax.eval.runner import PolicySpec

FAMILIES = ("streaming", "quest", "freekv", "retrieval")
PAGE = 32  # quest's and freekv's page size
RETRIEVAL_STATIC = (128, 512)  # RetrievalAttention's sinks + window
MIN_RETRIEVED = 16


def budget_options(family: str, budget: int) -> dict[str, Any] | None:
  """The options that make `family` attend `budget` tokens per query head per step, or None
  where the family cannot (retrieval below its static set plus 16 keys).

  Raises:
    ValueError: an unknown family, or a budget that is not a positive multiple of 4 pages.
  """
  if family not in FAMILIES:
    raise ValueError(f"family={family!r} must be one of {FAMILIES}")
  if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0 or budget % (4 * PAGE):
    raise ValueError(f"budget={budget!r} must be a positive multiple of {4 * PAGE} (four pages of {PAGE})")
  if family == "streaming":
    sinks = min(128, budget // 4)
    return dict(sinks=sinks, window=budget - sinks)
  if family in ("quest", "freekv"):
    return dict(sinks=budget // 4, window=budget // 4, budget=budget)
  sinks, window = RETRIEVAL_STATIC
  topk = budget - sinks - window
  return dict(sinks=sinks, window=window, topk=topk) if topk >= MIN_RETRIEVED else None


def budget_specs(families, budgets, extra: dict[str, dict[str, Any]] | None = None) -> list[PolicySpec]:
  """`full`, then one spec per (family, budget) it can serve, labelled "<family>@<budget>"
  (e.g. "freekv@1024"); `extra[family]` adds options to every spec of that family."""
  extra = extra or {}
  specs = [PolicySpec("full")]
  for family in families:
    for budget in budgets:
      options = budget_options(family, budget)
      if options is not None:
        specs.append(PolicySpec(family, {**extra.get(family, {}), **options}, label=f"{family}@{budget}"))
  return specs


def parse_label(label: str) -> tuple[str, int | None]:
  """("freekv", 1024) from "freekv@1024"; ("full", None) from "full"."""
  family, _, budget = label.partition("@")
  return family, int(budget) if budget else None
