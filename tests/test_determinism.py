"""kvjax.use_deterministic_xla: the XLA flags that make GPU runs reproducible, set before JAX starts."""

import os
import subprocess
import sys

import pytest

from kvjax import determinism

AUTOTUNE, EXCLUDE = determinism.DETERMINISTIC_XLA_FLAGS


@pytest.fixture
def fresh(monkeypatch):
  monkeypatch.setattr(determinism, "_backends_initialized", lambda: False)
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  return monkeypatch


def test_flags_are_appended_after_the_users_own(fresh):
  fresh.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
  assert determinism.use_deterministic_xla() == [AUTOTUNE, EXCLUDE]
  assert os.environ["XLA_FLAGS"] == f"--xla_dump_to=/tmp/x {AUTOTUNE} {EXCLUDE}"
  assert determinism.use_deterministic_xla() == []  # a second call adds nothing
  assert os.environ["XLA_FLAGS"] == f"--xla_dump_to=/tmp/x {AUTOTUNE} {EXCLUDE}"


def test_a_flag_the_user_set_is_kept_as_written(fresh):
  fresh.setenv("XLA_FLAGS", "--xla_gpu_autotune_level=4")
  assert determinism.use_deterministic_xla() == [EXCLUDE]
  assert os.environ["XLA_FLAGS"] == f"--xla_gpu_autotune_level=4 {EXCLUDE}"


def test_too_late_is_an_error_that_changes_nothing(fresh):
  fresh.setattr(determinism, "_backends_initialized", lambda: True)
  with pytest.raises(RuntimeError, match="xla_gpu_autotune_level=0"):
    determinism.use_deterministic_xla()
  assert "XLA_FLAGS" not in os.environ


def test_xla_accepts_the_flags():
  """An unknown XLA flag aborts the process at backend start: the pinned jaxlib must parse these."""
  code = ("import kvjax, jax.numpy as jnp; added = kvjax.use_deterministic_xla(); "
          "print(len(added), float(jnp.arange(4.0).sum()))")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.split() == ["2", "6.0"]
