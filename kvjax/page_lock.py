"""Page-locking NumPy buffers in place, so host -> device copies from them run at DMA speed.

A `jax.device_put` of an 80 MB NumPy buffer took 16.1 ms on the H200 machine (5.2 GB/s: PjRt
stages pageable memory); the same buffer registered with the CUDA driver (`cuMemHostRegister`)
took 2.1 ms (39 GB/s), as fast as a copy from JAX's own "pinned_host" memory, with no copy on
the host (experiments/results/bench_h2d.md). The per_step bridges pack each step's update into
a few reused buffers (kvjax.row_update.StepBuffers), so each is registered once, when first
copied, and unregistered just before NumPy frees it.

Only CUDA devices and memory NumPy allocated: elsewhere, for a view of foreign memory, or when the
driver refuses, `lock` returns False and the copy runs from pageable memory as before (a refused
buffer is not tried again while it lives; the refusal is logged once).
"""

from __future__ import annotations

import ctypes
import logging
import threading
import weakref

import numpy as np

_PORTABLE = 1  # CU_MEMHOSTREGISTER_PORTABLE: locked for every CUDA context of the process


class _Driver:
  """The few CUDA driver calls this needs, made in device 0's primary context (the one XLA
  uses; a portable registration serves every device)."""

  def __init__(self):
    self.lib = ctypes.CDLL("libcuda.so.1")
    device, self.context = ctypes.c_int(), ctypes.c_void_p()
    self._check(self.lib.cuInit(0), "cuInit")
    self._check(self.lib.cuDeviceGet(ctypes.byref(device), 0), "cuDeviceGet")
    self._check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(self.context), device), "cuDevicePrimaryCtxRetain")

  @staticmethod
  def _check(code: int, call: str) -> None:
    if code != 0:
      raise RuntimeError(f"{call} returned CUDA error {code}")

  def _in_context(self, call: str, fn, *args) -> None:
    self._check(self.lib.cuCtxPushCurrent_v2(self.context), "cuCtxPushCurrent")
    try:
      self._check(fn(*args), call)
    finally:
      self.lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))

  def register(self, address: int, nbytes: int) -> None:
    self._in_context("cuMemHostRegister", self.lib.cuMemHostRegister_v2, ctypes.c_void_p(address),
                     ctypes.c_size_t(nbytes), ctypes.c_uint(_PORTABLE))

  def unregister(self, address: int) -> None:
    self._in_context("cuMemHostUnregister", self.lib.cuMemHostUnregister, ctypes.c_void_p(address))


# Reentrant: a finalizer (`_release`) may run on this thread while `lock` holds it, if a
# garbage collection starts inside the driver call.
_lock = threading.RLock()
_driver: _Driver | None = None
_driver_error: str | None = None
_locked: dict[int, int] = {}  # data address of a locked owner array -> its bytes
_refused: dict[int, int] = {}  # ... of an owner the driver refused (not tried again while it lives)
_warned = False


def _owner(array: np.ndarray) -> np.ndarray:
  """The array that owns `array`'s memory (the end of its chain of views)."""
  while isinstance(array.base, np.ndarray):
    array = array.base
  return array


def _get_driver() -> _Driver | None:
  global _driver, _driver_error
  if _driver is None and _driver_error is None:
    try:
      _driver = _Driver()
    except (OSError, AttributeError, RuntimeError) as e:
      _driver_error = str(e)
      logging.warning("kvjax.page_lock: host buffers stay pageable (%s)", e)
  return _driver


def _release(address: int) -> None:
  """Unregisters a locked owner, or forgets a refused one; called as it is freed (weakref finalizer)."""
  with _lock:
    _refused.pop(address, None)
    if _locked.pop(address, None) is not None and _driver is not None:
      try:
        _driver.unregister(address)
      except RuntimeError as e:  # freed anyway; nothing to raise into
        logging.warning("kvjax.page_lock: %s", e)


def lock(
    array: np.ndarray,  # any view of a contiguous NumPy buffer; its whole owner is locked
) -> bool:
  """Page-locks the memory under `array` (once per owning buffer, until it is freed);
  True when it is locked. Meant for buffers copied from many times (registering pins every
  page of the buffer; its cost was not timed)."""
  global _warned
  owner = _owner(array)
  # Memory NumPy does not own (frombuffer, mmap, a jax array's): another array may start at the same
  # address, and its lifetime is not the owner's, so the registration could not be tracked.
  if not owner.flags.c_contiguous or not owner.flags.owndata or owner.nbytes == 0:
    return False
  address = owner.ctypes.data
  with _lock:
    if address in _locked:
      return True
    if address in _refused:
      return False
    driver = _get_driver()
    if driver is None:
      return False
    try:
      driver.register(address, owner.nbytes)
    except RuntimeError as e:
      _refused[address] = owner.nbytes
      weakref.finalize(owner, _release, address).atexit = False
      if not _warned:
        _warned = True
        # str(e): a record holding the exception would hold its frames, and so this buffer
        logging.warning("kvjax.page_lock: a %d-byte buffer stays pageable (%s); later refusals are not logged",
                        owner.nbytes, str(e))
      return False
    _locked[address] = owner.nbytes
  weakref.finalize(owner, _release, address).atexit = False  # the driver may be gone by then
  return True


def locked_bytes() -> int:
  """Bytes of host memory this process holds page-locked through `lock`."""
  with _lock:
    return sum(_locked.values())
