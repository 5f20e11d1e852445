"""kvjax.checks: the argument checks every API boundary uses."""

import numpy as np
import pytest

from kvjax import checks


def test_integer_takes_python_and_numpy_ints_only():
  assert checks.integer(3, "n") == 3 and checks.integer(np.int64(3), "n") == 3
  assert type(checks.integer(np.int32(3), "n")) is int
  for bad in (True, np.bool_(True), 3.0, "3", None):
    with pytest.raises(TypeError, match="n=.* must be an int"):
      checks.integer(bad, "n")
  with pytest.raises(ValueError, match="n=0 must be >= 1"):
    checks.integer(0, "n", low=1)
  with pytest.raises(ValueError, match=r"n=9 must be in \[1, 8\]"):
    checks.integer(9, "n", low=1, high=8)
  assert issubclass(checks.ArgumentTypeError, ValueError)  # option checks that raised ValueError still do


def test_real_and_boolean():
  assert checks.real(1, "t") == 1.0 and checks.real(np.float32(0.5), "t") == 0.5
  for bad in (float("nan"), float("inf")):
    with pytest.raises(ValueError, match="must be finite"):
      checks.real(bad, "t")
  with pytest.raises(TypeError):
    checks.real(True, "t")
  with pytest.raises(ValueError, match=r"in \[0.0, 1.0\]"):
    checks.real(1.5, "t", low=0.0, high=1.0)
  assert checks.boolean(np.bool_(False), "b") is False
  with pytest.raises(TypeError, match="b='no' must be a bool"):
    checks.boolean("no", "b")


def test_token_and_layer_ids():
  assert checks.token_ids(np.array([1, 2], np.int64), "p") == [1, 2]
  with pytest.raises(TypeError, match="1-D integer array"):
    checks.token_ids(np.array([[1, 2]]), "p")
  with pytest.raises(TypeError, match=r"p\[1\]=2.5"):
    checks.token_ids([1, 2.5], "p")
  assert checks.layer_ids([3, 0, 3], "d") == (0, 3)
  for bad in ("01", 5, [1.7]):
    with pytest.raises(TypeError):
      checks.layer_ids(bad, "d")
  with pytest.raises(ValueError, match=r"d\[0\]=-1"):
    checks.layer_ids([-1], "d")
