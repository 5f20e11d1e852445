"""Argument checks at the API boundary: a clear TypeError / ValueError naming the bad value,
before any work. bool is an int subclass and NumPy integers are not ints: both are handled here
once, so every caller refuses True where a count is meant and accepts np.int64 where it is."""

from __future__ import annotations

import math
import numbers

import numpy as np


class ArgumentTypeError(TypeError, ValueError):
  """A value of the wrong type: a TypeError, and a ValueError too for callers (and policy option
  checks) that catch every bad value as one."""


def integer(value, name: str, *, low: int | None = None, high: int | None = None) -> int:
  """`value` as an int (Python or NumPy integer, not bool), within [low, high] when given."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Integral, np.integer)):
    raise ArgumentTypeError(f"{name}={value!r} must be an int")
  value = int(value)
  _check_bounds(value, name, low, high)
  return value


def boolean(value, name: str) -> bool:
  if not isinstance(value, (bool, np.bool_)):
    raise ArgumentTypeError(f"{name}={value!r} must be a bool")
  return bool(value)


def real(value, name: str, *, low: float | None = None, high: float | None = None) -> float:
  """`value` as a finite float (an int or float, not bool), within [low, high] when given."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Real, np.floating, np.integer)):
    raise ArgumentTypeError(f"{name}={value!r} must be a number")
  value = float(value)
  if not math.isfinite(value):
    raise ValueError(f"{name}={value!r} must be finite")
  _check_bounds(value, name, low, high)
  return value


def _check_bounds(value, name: str, low, high) -> None:
  if (low is not None and value < low) or (high is not None and value > high):
    bounds = f">= {low}" if high is None else f"<= {high}" if low is None else f"in [{low}, {high}]"
    raise ValueError(f"{name}={value!r} must be {bounds}")


def layer_ids(values, name: str, *, distinct: bool = False) -> tuple[int, ...]:
  """Sorted distinct layer ids (ints >= 0) from a sequence; a string is refused, not read digit by
  digit. `distinct`: a repeated id is refused rather than merged."""
  if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
    raise ArgumentTypeError(f"{name}={values!r} must be a sequence of layer ids")
  ids = [integer(v, f"{name}[{i}]", low=0) for i, v in enumerate(values)]
  if distinct and len(set(ids)) != len(ids):
    raise ValueError(f"{name}={values!r} must be distinct non-negative layer ids")
  return tuple(sorted(set(ids)))


def token_ids(values, name: str) -> list[int]:
  """A prompt's token ids (ints or NumPy integers, a list or a 1-D integer array), as ints."""
  array = np.asarray(values) if isinstance(values, np.ndarray) else None
  if array is not None and (array.ndim != 1 or array.dtype.kind not in "iu"):
    raise ArgumentTypeError(f"{name} must be a 1-D integer array, got {array.dtype} of shape {array.shape}")
  return [integer(t, f"{name}[{i}]") for i, t in enumerate(values)]
