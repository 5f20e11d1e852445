"""Suite-wide test hooks.

Every compiled XLA CPU executable keeps its JIT code in memory mappings of its own, and JAX's
caches keep every executable alive. Two test files alone left 17,453 mappings in one process,
so an xdist worker running half the suite nears Linux's default limit of 65,530
(vm.max_map_count), where a compile's mmap fails: the likely cause of the segfaults inside XLA's
CPU compiler that clean-clone CI runs showed late in the run (tests/test_synthetic.py; the
count at the crash itself was not captured). Clearing JAX's caches after each test module frees
the executables no test holds any more (629 mappings after the same two files).
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
