"""Prefilled contexts shared between benchmark rows that differ only in decode options.

`retrieval` and `retrieval --speculative` (or two top-k / tau settings) need the same prefill and
the same index build, which at 128K takes minutes: the first row saves its context
(kvjax.save_context) to a scratch directory and later rows load a fresh copy of it.
"""

from __future__ import annotations

import pathlib
import shutil
import tempfile
import time
from typing import Callable

import kvjax


class ContextReuse:
  """Builds a context once per (policy, state-shaping options, extra key) and reloads it."""

  def __init__(self, save: bool = True):
    """save: False when no later row can reuse a context (one retrieval row a case), which
    spares a long context's copy to disk (~38 GB at 1M tokens for SmolLM2 shapes)."""
    self._save = save
    self._saved: dict[tuple, tuple[pathlib.Path, float]] = {}
    self._scratch = pathlib.Path(tempfile.mkdtemp(prefix="kvjax_contexts_"))

  def get(self, model, name: str, options: dict, key: tuple, build: Callable[[], "kvjax.PrefilledContext"]):
    """(context, seconds its prefill and index build took when it was first made).

    key: what else the context depends on (lengths, batch, seed...)."""
    policy = kvjax.make_policy(name, **options)
    decode_only = set(policy.decode_options)
    shared = (name, tuple(sorted((k, v) for k, v in options.items() if k not in decode_only)), key)
    if shared in self._saved:
      path, seconds = self._saved[shared]
      # Every decode option, the defaults included: a loaded context keeps the saving row's
      # options for any left out (a plain row after a speculative one would decode speculatively).
      return kvjax.load_context(path, model, policy_options=policy.decode_option_values()), seconds
    t0 = time.perf_counter()
    context = build()
    seconds = time.perf_counter() - t0
    if name == "retrieval" and self._save:  # its index build is the expensive part; other prefills are cheap to redo
      path = self._scratch / f"context_{len(self._saved)}"
      kvjax.save_context(context, path)
      self._saved[shared] = (path, seconds)
    return context, seconds

  def close(self) -> None:
    shutil.rmtree(self._scratch, ignore_errors=True)
