"""Suite-wide test hooks.

Every compiled XLA CPU executable keeps its JIT code in memory mappings of its own, and JAX's
caches keep every executable alive: an xdist worker running half the suite grew past Linux's
default limit of 65,530 mappings (vm.max_map_count), where the next compile's mmap fails and
XLA's CPU compiler crashes the worker with a segfault (seen in clean-clone CI runs, inside
tests/test_synthetic.py, late in the run). Two test files alone left ~17,000 mappings. Clearing
JAX's caches after each test module frees the executables no test holds any more.
"""

from __future__ import annotations

import gc

import jax
import pytest


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_executables_after_each_module():
  yield
  jax.clear_caches()
  gc.collect()
