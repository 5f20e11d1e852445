"""Host -> device copy speed of one packed update, by the ways JAX can make it (GPU).

    python experiments/bench_h2d.py --sizes_mb=20,40,80,160

A per_step exchange ends with one packed byte buffer copied to the device (kvjax.row_update);
at 8B shapes, batch 8, 128K that is ~80 MB a step, and the next step cannot start before it has
landed. Ways measured, each the median of --repeats copies, waited for:
  pageable:        jax.device_put of the NumPy buffer (PjRt stages it).
  chunks_N:        the buffer as N slices, one device_put call for the list.
  threads_N:       N slices, each device_put from its own thread.
  via_pinned:      device_put to the "pinned_host" memory kind, then to the device.
  pinned_dma:      only the second half of via_pinned (the buffer already page-locked).
  registered:      the NumPy buffer page-locked in place (kvjax.page_lock), then device_put.
  pinned_view:     a "pinned_host" jax.Array written through a NumPy view of its buffer
                   (unsafe_buffer_pointer), then device_put; `view_ok` says whether the device
                   copy held what was written.
Rows report ms and GB/s; a way that fails records its error instead.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import statistics
import time

import jax
import numpy as np
from absl import app, flags

from kvjax import page_lock

flags.DEFINE_list("sizes_mb", ["20", "40", "80", "160"], "Buffer sizes in MiB.")
flags.DEFINE_integer("repeats", 10, "Copies per way and size (median reported).")
flags.DEFINE_list("splits", ["4", "8"], "Slice counts of the chunks_N and threads_N ways.")
flags.DEFINE_string("out_dir", None, "Results directory.")
flags.DEFINE_string("name", "bench_h2d", "Results file name.")
FLAGS = flags.FLAGS


def _timed(copy, repeats: int) -> float:
  """Median ms of `copy()` (which returns device arrays) until its arrays are ready."""
  jax.block_until_ready(copy())  # compiles / warms
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(copy())
    times.append(time.perf_counter() - t0)
  return 1e3 * statistics.median(times)


def _page_aligned(nbytes: int) -> np.ndarray:
  raw = np.empty(nbytes + 4096, np.uint8)
  start = (-raw.ctypes.data) % 4096
  return raw[start:start + nbytes]


def ways(buf: np.ndarray, device, splits: list[int], pool) -> dict:
  """name -> a function making the copy (returning the device arrays), for `buf`."""
  on_device = jax.sharding.SingleDeviceSharding(device)
  pinned = on_device.with_memory_kind("pinned_host")
  out = {"pageable": lambda: jax.device_put(buf, on_device)}
  for n in splits:
    parts = np.array_split(buf, n)
    out[f"chunks_{n}"] = lambda parts=parts: jax.device_put(parts, [on_device] * len(parts))
    out[f"threads_{n}"] = lambda parts=parts: list(pool.map(lambda p: jax.device_put(p, on_device), parts))
  out["via_pinned"] = lambda: jax.device_put(jax.device_put(buf, pinned), on_device)
  staged = jax.block_until_ready(jax.device_put(buf, pinned))
  out["pinned_dma"] = lambda: jax.device_put(staged, on_device)
  return out


def main(argv):
  del argv
  import results_io

  if jax.default_backend() != "gpu":
    raise app.UsageError("bench_h2d measures GPU copies")
  device = jax.devices()[0]
  splits = [int(n) for n in FLAGS.splits]
  rows = []
  with concurrent.futures.ThreadPoolExecutor(max(splits)) as pool:
    for mb in (int(s) for s in FLAGS.sizes_mb):
      nbytes = mb << 20
      buf = _page_aligned(nbytes)
      buf[:] = np.random.default_rng(mb).integers(0, 256, nbytes, dtype=np.uint8)
      found = ways(buf, device, splits, pool)
      registered = buf.copy()
      if page_lock.lock(registered):
        found["registered"] = lambda r=registered: jax.device_put(r, jax.sharding.SingleDeviceSharding(device))
      else:
        rows.append(dict(size_mb=mb, way="registered", error="kvjax.page_lock could not lock the buffer (see log)"))
      for way, copy in found.items():
        try:
          ms = _timed(copy, FLAGS.repeats)
          rows.append(dict(size_mb=mb, way=way, ms=round(ms, 3), gb_per_s=round(nbytes / ms / 1e6, 2)))
        except Exception as e:  # a way this JAX cannot do is a finding, not a crash
          rows.append(dict(size_mb=mb, way=way, error=f"{type(e).__name__}: {e}"[:300]))
        print(rows[-1], flush=True)
      rows.append(_pinned_view(buf, device))
      print(rows[-1], flush=True)
  results_io.write_results(FLAGS.name, rows, out_dir=FLAGS.out_dir,
                           notes="Host -> device copies of one uint8 buffer (module docstring); ms = median, "
                                 "waited for; GB/s = bytes / ms.")


def _pinned_view(buf: np.ndarray, device) -> dict:
  """Writes `buf` into a pinned_host array through a NumPy view of its buffer, then copies
  that array to the device; checks the device copy holds `buf`."""
  row = dict(size_mb=buf.nbytes >> 20, way="pinned_view")
  on_device = jax.sharding.SingleDeviceSharding(device)
  try:
    host = jax.block_until_ready(jax.device_put(np.zeros(buf.nbytes, np.uint8), on_device.with_memory_kind("pinned_host")))
    view = np.ctypeslib.as_array((ctypes.c_uint8 * buf.nbytes).from_address(host.unsafe_buffer_pointer()))
    times = []
    for _ in range(FLAGS.repeats + 1):
      t0 = time.perf_counter()
      view[:] = buf
      t1 = time.perf_counter()
      out = jax.block_until_ready(jax.device_put(host, on_device))
      times.append((t1 - t0, time.perf_counter() - t1))
    fill, dma = (1e3 * statistics.median(t[i] for t in times[1:]) for i in (0, 1))
    ok = bool(np.array_equal(np.asarray(out[:4096]), buf[:4096]) and np.array_equal(np.asarray(out[-4096:]), buf[-4096:]))
    row |= dict(ms=round(dma, 3), gb_per_s=round(buf.nbytes / dma / 1e6, 2), fill_ms=round(fill, 3), view_ok=ok)
  except Exception as e:
    row["error"] = f"{type(e).__name__}: {e}"[:300]
  return row


if __name__ == "__main__":
  app.run(main)
