"""Host -> device updates of slot buffers, shared by the per_step bridges of `retrieval` (rows
of one head) and `freekv` (pages of one head).

Between two decode steps the host gathers what enters the device's slot buffers into one
packed byte buffer (`RowUpdate`), copies it to the device in one transfer (`to_device`) and a
donated jitted scatter (`scatter_rows`) writes it in place. One buffer, one copy: on the H200
machine four separate copies took 4.6 ms per step for 3.5 MB of SmolLM2 rows, one packed copy
2.6 ms for 3.7 MB.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import kv_codec, page_lock

TRANSFERS = ("page_locked", "pageable", "pinned")


@dataclasses.dataclass(frozen=True)
class RowUpdate:
  """Slot dest[i] of the flattened [..., slots] buffers takes id ids[i] (-1 = emptied) and the
  rows k[i], v[i] (a row: one token's [D], or one page's [P * D]). Padded to a few static sizes
  (entries past `count` have distinct out-of-range dest, so the scatter drops them, and
  unspecified rows). Layout of `packed`:
  [dest int32 x size | ids int32 x size | k x size x width | v x size x width] (rows in the store
  dtype)."""

  packed: np.ndarray  # [size * (8 + 2 * width * itemsize)] uint8
  size: int  # entries, padding included
  count: int  # real entries
  width: int  # elements per row
  dtype: np.dtype  # of the rows (the store's; bfloat16 as uint16 bits)

  @staticmethod
  def nbytes(size: int, width: int, dtype) -> int:
    return size * (8 + 2 * width * np.dtype(dtype).itemsize)

  def _part(self, index: int) -> np.ndarray:
    n, row = self.size, self.width * np.dtype(self.dtype).itemsize
    starts = (0, 4 * n, 8 * n, 8 * n + n * row, 8 * n + 2 * n * row)
    part = self.packed[starts[index]:starts[index + 1]]
    return part.view(np.int32) if index < 2 else part.view(self.dtype).reshape(n, self.width)

  dest = property(lambda self: self._part(0))  # [size] int32 flat slot index
  ids = property(lambda self: self._part(1))  # [size] int32 id now in that slot, -1 = empty
  k = property(lambda self: self._part(2))  # [size, width]
  v = property(lambda self: self._part(3))  # [size, width]

  def pad(self, num_slots: int) -> None:
    """Marks the entries past `count` as padding (dest distinct and >= num_slots: dropped)."""
    self.dest[self.count:] = num_slots + np.arange(self.size - self.count)
    self.ids[self.count:] = -1


def padded_size(n: int) -> int:
  """A static size >= n from a short geometric ladder (ratio 2^(1/4), multiples of 64), so a
  handful of compiled scatter shapes serve every step and padding stays under ~26%.

  Compiling the sizes next to each one used on a background thread, before a step needs them,
  was tried (a421b5b) and dropped. The slow steps of a decode on the H200 were its first three,
  while the pool fills and the update size jumps rungs faster than neighbours compile (a small
  freekv decode on the CPU compiles new sizes at steps 2 and 4, none later); the steady steps
  showed no gain (8B shapes, 128K: 17.4 ms median with it against 13.4 without in one pair of
  runs, 11.5 in a third; experiments/results/bench_scale_8b_synthetic_128k_ahead_*.md)."""
  if n <= 64:
    return 64
  rung = lambda k: int(-(-int(np.ceil(2.0 ** (k / 4))) // 64) * 64)  # 2^(k/4) up to a multiple of 64
  k = int(np.ceil(4 * np.log2(n)))
  while rung(k - 1) >= n:  # rounding to 64 lets a lower rung hold n (192 holds 182, whose 2^(k/4) is 215)
    k -= 1
  return rung(k)


def ladder(upto: int) -> list[int]:
  """Every size `padded_size` returns, in order, up to padded_size(upto)."""
  sizes = [64]
  while sizes[-1] < upto:
    sizes.append(padded_size(sizes[-1] + 1))
  return sizes


# Off on a CPU backend, where the decode step itself is the slow part and tests prefill often;
# set it to warm there too (tests).
WARM_ON_CPU = False


def warm_scatter(
    buf_k,  # [..., slots, *row] the slot buffers of scatter_rows (donated, returned unchanged)
    buf_v,  # same shape
    buf_ids,  # [..., slots] int32
    *,
    most: int,  # the largest update's real entries
    codec: str = "none",
):
  """Runs `scatter_rows` once for every padded size up to padded_size(most), each with an update
  of padding only (every dest past the buffers: dropped, nothing written), so no decode step
  compiles one. Returns the (unchanged) buffers.

  Why: each padded size is its own compile, and an update's size drifts over a decode: retrieval
  per_step at SmolLM2 shapes, 128K, spent 76-100 ms on 7 of its first 30 steps in `land` against a
  0.41 ms median, and a second decode in the same process had no such step, most likely because
  the sizes were compiled by then
  (experiments/results/bench_scale_smollm2shapes_synthetic_128k_roar_kv_room.md). Compiling
  neighbouring sizes during decode instead (a421b5b) slowed the steady steps: here every size
  compiles before the first step. The padding is made on the buffers' device and committed to it,
  as a copied update is, so the decode's calls find these compiles."""
  if jax.default_backend() == "cpu" and not WARM_ON_CPU:
    return buf_k, buf_v, buf_ids
  device = next(iter(buf_k.devices()))
  num_slots = math.prod(buf_ids.shape)
  row = buf_k.shape[buf_ids.ndim:]
  width = math.prod(row[:-1]) * kv_codec.host_width(codec, row[-1])
  row_bytes = width * kv_codec.wire_dtype(codec, buf_k.dtype).itemsize
  for size in ladder(most):
    packed = jax.device_put(_padding_update(size, num_slots, row_bytes), jax.sharding.SingleDeviceSharding(device))
    buf_k, buf_v, buf_ids = scatter_rows(buf_k, buf_v, buf_ids, packed, codec=codec)  # codec by name, as callers pass it
  return buf_k, buf_v, buf_ids


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _padding_update(size: int, num_slots: int, row_bytes: int):
  """A packed RowUpdate (layout as RowUpdate.packed) of `size` padding entries: dest distinct and
  >= num_slots, ids -1, rows zero."""
  as_bytes = lambda a: jax.lax.bitcast_convert_type(a, jnp.uint8).reshape(-1)
  dest = num_slots + jnp.arange(size, dtype=jnp.int32)
  return jnp.concatenate([as_bytes(dest), as_bytes(jnp.full((size,), -1, jnp.int32)),
                          jnp.zeros((2 * size * row_bytes,), jnp.uint8)])


class StepBuffers:
  """The byte buffers the steps' RowUpdates are packed into, used in turn.

  With `reuse` `count` buffers serve every step in rotation, each grown (to twice the update
  that outgrew it, at most `most` bytes) rather than sized for the worst case up front: at 8B
  shapes, batch 12, int8 rows, the worst case is ~0.8 GB a buffer and a typical update ~0.13 GB. The copy
  to the device of the update packed into a buffer must be complete before that buffer is
  packed again (`to_device` with `wait`, or an ordering that implies it: see freekv's
  exchange). Fresh buffers cost their page faults each step (~9 ms per 28 MB on the dev box),
  and a reused one is page-locked once (transfer "page_locked"); the CPU backend may alias
  host memory, so by default only other backends reuse."""

  def __init__(self, count: int = 1):
    self.reuse = jax.default_backend() != "cpu"
    self._buffers: list[np.ndarray | None] = [None] * count
    self._next = 0

  def get(self, nbytes: int, most: int) -> np.ndarray:
    """A [nbytes] uint8 buffer (nbytes <= most)."""
    if not self.reuse:
      return np.empty(nbytes, np.uint8)
    i, self._next = self._next, (self._next + 1) % len(self._buffers)
    if self._buffers[i] is None or self._buffers[i].size < nbytes:
      self._buffers[i] = np.empty(min(most, 2 * nbytes), np.uint8)
    return self._buffers[i][:nbytes]


def new_update(buffers: StepBuffers, count: int, most: int, width: int, dtype) -> RowUpdate:
  """An update of `count` real entries (at most `most`) in a buffer from `buffers`."""
  size = padded_size(count)
  packed = buffers.get(RowUpdate.nbytes(size, width, dtype), RowUpdate.nbytes(padded_size(most), width, dtype))
  return RowUpdate(packed, size=size, count=count, width=width, dtype=np.dtype(dtype))


def to_device(packed: np.ndarray, device, transfer: str, *, wait: bool = True):
  """Copies `packed` to `device`; with `wait`, returns once the copy is complete (the host
  buffer may then be rewritten). Without it the copy overlaps what the caller does next; the
  caller must not rewrite `packed` before something that consumed the device copy has finished.

  transfer:
    "page_locked": the buffer under `packed` is page-locked in place once (kvjax.page_lock;
      CUDA devices only, else as "pageable"), and the copy DMAs straight from it: 39 GB/s for
      80 MB on the H200 machine against 5.2 GB/s pageable (experiments/results/bench_h2d.md).
    "pageable": PjRt stages the pageable buffer, then DMAs.
    "pinned": a host copy into JAX's "pinned_host" memory, then the DMA from there: 4.9 GB/s
      for the two together in the same run.
  """
  if transfer not in TRANSFERS:
    raise ValueError(f"transfer={transfer!r}; expected one of {TRANSFERS}")
  on_device = jax.sharding.SingleDeviceSharding(device)
  if transfer == "page_locked" and device.platform == "gpu":
    page_lock.lock(packed)
  if transfer == "pinned":
    packed = jax.device_put(packed, on_device.with_memory_kind("pinned_host"))
  out = jax.device_put(packed, on_device)
  return jax.block_until_ready(out) if wait else out


class TransferTimer:
  """`to_device` bound to a device and transfer mode, adding its seconds (the whole copy with
  `wait`, else only what blocks the caller) and bytes to `stats.transfer_seconds` /
  `stats.transfer_bytes` (thread-safe enough: one caller at a time)."""

  def __init__(self, stats, device, transfer: str, *, wait: bool = True):
    self.stats, self.device, self.transfer, self.wait = stats, device, transfer, wait

  def __call__(self, update: RowUpdate):
    t0 = time.perf_counter()
    out = to_device(update.packed, self.device, self.transfer, wait=self.wait)
    self.stats.transfer_seconds += time.perf_counter() - t0
    self.stats.transfer_bytes += update.packed.nbytes
    return out


@functools.partial(jax.jit, donate_argnums=(0, 1, 2), static_argnames=("codec",))
def scatter_rows(
    buf_k,  # [..., slots, *row]: e.g. [L, B, Hq, slots, D] or [L, B, Hkv, slots, P, D]
    buf_v,  # same shape
    buf_ids,  # [..., slots] int32
    packed,  # [n * (8 + 2 * width * itemsize)] uint8 (RowUpdate layout), width = prod(wire row)
    codec: str = "none",  # how the rows travel (kvjax.kv_codec); decoded here to buf_k's dtype
):
  """Unpacks (bitcasts) a RowUpdate on the device, decodes its rows and scatters them in
  place; one compile per padded update size (a short ladder, `padded_size`)."""
  row = buf_k.shape[buf_ids.ndim:]
  wire_row = row[:-1] + (kv_codec.host_width(codec, row[-1]),)
  wire = kv_codec.wire_dtype(codec, buf_k.dtype)
  width, itemsize = math.prod(wire_row), wire.itemsize
  n = packed.shape[0] // (8 + 2 * width * itemsize)

  def part(start, count, dtype, size):  # bytes -> [count, size] of dtype
    raw = packed[start:start + count * size * jnp.dtype(dtype).itemsize]
    return jax.lax.bitcast_convert_type(raw.reshape(count, size, jnp.dtype(dtype).itemsize), dtype)

  dest = part(0, n, jnp.int32, 1)[:, 0]  # distinct; out of range = padding, dropped
  ids = part(4 * n, n, jnp.int32, 1)[:, 0]
  rows = lambda start: kv_codec.decode(part(start, n, wire, width).reshape(n, *wire_row), codec, buf_k.dtype)
  rows_k, rows_v = rows(8 * n), rows(8 * n + n * width * itemsize)
  put = lambda buf, new: buf.reshape(-1, *new.shape[1:]).at[dest].set(
      new, mode="drop", unique_indices=True).reshape(buf.shape)
  return put(buf_k, rows_k), put(buf_v, rows_v), put(buf_ids, ids)
