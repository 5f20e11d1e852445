"""kvjax.device_read: several device arrays read in one copy equal their separate reads."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import device_read


def step_like_arrays():
  """A per_step bridge's outputs in kind: scalars, float32 queries, bfloat16 rows, int32 positions,
  a bool mask, an int8 code and an empty array, in an order that puts narrow items first."""
  rng = np.random.default_rng(0)
  return (jnp.int32(7), jnp.asarray(rng.standard_normal((3, 1, 2, 5)), jnp.bfloat16), jnp.int32(-1),
          jnp.asarray(rng.standard_normal((3, 1, 4, 5)), jnp.float32), jnp.asarray([[3], [-1], [9]], jnp.int32),
          jnp.asarray(rng.random((2, 3)) > 0.5), jnp.asarray([-128, 0, 127], jnp.int8), jnp.zeros((0, 4), jnp.float32))


def test_one_copy_equals_separate_reads(monkeypatch):
  arrays = step_like_arrays()
  expected = [np.asarray(x) for x in arrays]
  monkeypatch.setattr(jax, "device_get", lambda *a: pytest.fail("one device: no per-array reads"))
  got = device_read.read_together(arrays)
  assert len(got) == len(arrays)
  for want, have in zip(expected, got):
    assert have.dtype == want.dtype and have.shape == want.shape
    np.testing.assert_array_equal(have, want)
    assert not have.flags.writeable  # views of the one copy
  assert device_read.read_together(()) == []


def test_values_that_are_not_device_arrays_are_read_one_by_one():
  arrays = (np.arange(4, dtype=np.int32), jnp.float32(2.5))
  got = device_read.read_together(arrays)
  np.testing.assert_array_equal(got[0], np.arange(4))
  assert got[1] == np.float32(2.5) and got[1].dtype == np.float32


def test_a_started_read_gives_the_same_arrays_once_finished(monkeypatch):
  arrays = step_like_arrays()
  expected = [np.asarray(x) for x in arrays]
  copies = []
  array_type = type(arrays[1])  # jax.Array's implementation
  real_copy = array_type.copy_to_host_async
  monkeypatch.setattr(array_type, "copy_to_host_async", lambda self: (copies.append(self), real_copy(self))[1])
  started = device_read.start_reading(arrays)
  assert len(copies) == 1  # the packed bytes' copy began before anyone asked for them
  assert started.reads(arrays) and not started.reads(arrays[:-1]) and not started.reads(step_like_arrays())
  got = device_read.finish_reading(started, arrays)
  for want, have in zip(expected, got):
    assert have.dtype == want.dtype and have.shape == want.shape
    np.testing.assert_array_equal(have, want)
  assert started.result() is got  # finished once


def test_finishing_a_read_of_other_arrays_is_refused():
  arrays = step_like_arrays()
  started = device_read.start_reading(arrays)
  with pytest.raises(ValueError, match="not a read of these arrays"):
    device_read.finish_reading(started, step_like_arrays())  # equal values, other objects
  started.result()
  with pytest.raises(ValueError, match="not yet finished"):
    device_read.finish_reading(started, arrays)  # a finished read no longer holds (or names) its arrays
  np.testing.assert_array_equal(device_read.finish_reading(None, arrays[:2])[1], np.asarray(arrays[1]))


def test_also_travels_in_the_same_copy_and_is_not_in_the_result(monkeypatch):
  arrays, tokens = step_like_arrays(), jnp.asarray([5, 11], jnp.int32)
  copies = []
  array_type = type(arrays[1])
  real_copy = array_type.copy_to_host_async
  monkeypatch.setattr(array_type, "copy_to_host_async", lambda self: (copies.append(self), real_copy(self))[1])
  monkeypatch.setattr(jax, "device_get", lambda *a: pytest.fail("one device: no per-array reads"))
  started = device_read.start_reading(arrays, also=tokens)
  assert len(copies) == 1 and started.reads(arrays) and not started.reads(arrays + (tokens,))
  np.testing.assert_array_equal(started.also(), [5, 11])  # asked for first, as the decode loop does
  assert started.reads(arrays)  # still the policy's to finish
  got = device_read.finish_reading(started, arrays)
  assert len(got) == len(arrays)
  for want, have in zip(arrays, got):
    np.testing.assert_array_equal(have, np.asarray(want))
  with pytest.raises(ValueError, match="without an `also` array"):
    device_read.start_reading(arrays).also()


def test_also_on_a_read_one_by_one():
  got = device_read.start_reading((np.arange(3, dtype=np.int32),), also=jnp.asarray([4], jnp.int32))
  np.testing.assert_array_equal(got.also(), [4])
  np.testing.assert_array_equal(got.result()[0], np.arange(3))
