"""kvjax.page_lock: buffers locked once per owner, unlocked before they are freed, and copies
that fall back to pageable memory wherever the CUDA driver is missing or refuses."""

import gc
import logging

import jax
import numpy as np
import pytest

from kvjax import page_lock, row_update


class FakeDriver:
  """Records the registrations a real driver would make."""

  def __init__(self, fail: bool = False):
    self.fail = fail
    self.registered: dict[int, int] = {}
    self.calls: list[tuple] = []

  def register(self, address, nbytes):
    self.calls.append(("register", address, nbytes))
    if self.fail:
      raise RuntimeError("cuMemHostRegister returned CUDA error 2")
    self.registered[address] = nbytes

  def unregister(self, address):
    self.calls.append(("unregister", address))
    del self.registered[address]


@pytest.fixture
def driver(monkeypatch):
  fake = FakeDriver()
  monkeypatch.setattr(page_lock, "_driver", fake)
  monkeypatch.setattr(page_lock, "_driver_error", None)
  monkeypatch.setattr(page_lock, "_locked", {})
  return fake


def test_a_buffer_is_locked_once_through_any_of_its_views_and_unlocked_when_freed(driver):
  owner = np.empty(1 << 20, np.uint8)
  address = owner.ctypes.data
  assert page_lock.lock(owner[:1000])
  assert page_lock.lock(owner[4096:].view(np.int32))  # another view: no second registration
  assert driver.calls == [("register", address, owner.nbytes)]
  assert page_lock.locked_bytes() == owner.nbytes
  view = owner[:10]
  del owner
  gc.collect()
  assert driver.registered  # a view keeps the memory, so it stays locked
  del view
  gc.collect()
  assert driver.calls[-1] == ("unregister", address) and not driver.registered
  assert page_lock.locked_bytes() == 0


def test_a_refused_registration_leaves_the_buffer_pageable_and_is_not_retried(monkeypatch, caplog):
  fake = FakeDriver(fail=True)
  monkeypatch.setattr(page_lock, "_driver", fake)
  monkeypatch.setattr(page_lock, "_locked", {})
  monkeypatch.setattr(page_lock, "_refused", {})
  monkeypatch.setattr(page_lock, "_warned", False)
  buf = np.arange(64, dtype=np.uint8)
  with caplog.at_level(logging.WARNING):
    locked = [page_lock.lock(buf) for _ in range(3)]  # a reused step buffer: one driver call and warning
  assert locked == [False] * 3
  assert len(fake.calls) == 1 and caplog.text.count("stays pageable") == 1 and page_lock.locked_bytes() == 0
  del buf
  gc.collect()
  assert not page_lock._refused  # forgotten once freed: a new buffer at that address is tried


def test_memory_numpy_does_not_own_is_not_locked(driver):
  raw = bytearray(1 << 16)
  small, big = np.frombuffer(raw, np.uint8, count=4096), np.frombuffer(raw, np.uint8)
  assert not page_lock.lock(small) and not page_lock.lock(big)  # one address, two extents, another's lifetime
  assert driver.calls == []


def test_without_a_cuda_driver_nothing_is_locked(monkeypatch):
  monkeypatch.setattr(page_lock, "_driver", None)
  monkeypatch.setattr(page_lock, "_driver_error", None)
  monkeypatch.setattr(page_lock._Driver, "__init__", lambda self: (_ for _ in ()).throw(OSError("libcuda.so.1")))
  assert not page_lock.lock(np.zeros(16, np.uint8))
  assert page_lock._driver_error == "libcuda.so.1"


@pytest.mark.parametrize("transfer", row_update.TRANSFERS)
def test_every_transfer_copies_the_bytes(transfer):
  packed = np.random.default_rng(0).integers(0, 256, 4096 + 123, dtype=np.uint8)
  out = row_update.to_device(packed, jax.devices()[0], transfer)
  np.testing.assert_array_equal(np.asarray(out), packed)


def test_step_buffers_grow_to_twice_the_update_that_outgrew_them():
  buffers = row_update.StepBuffers(count=1)
  buffers.reuse = True
  first = buffers.get(100, most=1000)
  assert first.size == 100 and first.base.size == 200
  assert buffers.get(150, most=1000).base is first.base  # fits: the same memory
  assert buffers.get(700, most=1000).base.size == 1000  # never past the worst case


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
def test_a_locked_buffer_copies_exactly_on_a_gpu():
  owner = np.random.default_rng(1).integers(0, 256, 8 << 20, dtype=np.uint8)
  out = row_update.to_device(owner[: 5 << 20], jax.devices()[0], "page_locked")
  assert page_lock.locked_bytes() >= owner.nbytes
  np.testing.assert_array_equal(np.asarray(out), owner[: 5 << 20])
