"""Bit-reproducible GPU runs: XLA flags that make every compile pick the same kernels.

On the H200 in bf16 the same seeds decoded in two processes at one commit gave different greedy
text for 3 of 6 (policy, sample) pairs (full twice, freekv once; near-tied logits flip). XLA's
autotuner times candidate kernels at each compile and keeps the fastest, which varies between
processes, and some GPU ops order their reductions by thread timing. With autotuning off and
those ops excluded, 6 of 6 pairs matched, at a cost in time: median ms/token full +7.5%, freekv
+22%, retrieval within noise (experiments/results/ruler_qwen_32k_repro.md). The CPU backend is
reproducible without them; they parse there and change nothing.

XLA reads XLA_FLAGS once, when JAX first starts a backend, so `use_deterministic_xla` must run
before the first computation (the eval CLIs call it first thing in main()).
"""

from __future__ import annotations

import os

DETERMINISTIC_XLA_FLAGS = ("--xla_gpu_autotune_level=0", "--xla_gpu_exclude_nondeterministic_ops=true")


def _backends_initialized() -> bool:
  try:
    from jax._src import xla_bridge
  except ImportError:  # JAX moved it: cannot tell, so trust the caller's order
    return False
  check = getattr(xla_bridge, "backends_are_initialized", None)
  return bool(check and check())


def use_deterministic_xla() -> list[str]:
  """Adds DETERMINISTIC_XLA_FLAGS to the XLA_FLAGS environment variable; returns the flags added.

  A flag already in XLA_FLAGS by name (e.g. the user's own autotune level) is kept as written.
  RuntimeError if a flag is missing and JAX has already started a backend: XLA would ignore it.
  """
  current = os.environ.get("XLA_FLAGS", "").split()
  present = {flag.split("=", 1)[0] for flag in current}
  missing = [flag for flag in DETERMINISTIC_XLA_FLAGS if flag.split("=", 1)[0] not in present]
  if not missing:
    return []
  if _backends_initialized():
    raise RuntimeError(f"use_deterministic_xla() after JAX started a backend: XLA_FLAGS is read once, so "
                       f"{' '.join(missing)} would be ignored; call it before the first JAX computation")
  os.environ["XLA_FLAGS"] = " ".join(current + missing)
  return missing
