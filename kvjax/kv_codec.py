"""How K/V rows are encoded on the host: as the model's dtype, or as int8 with a scale.

"int8" (symmetric, per token and KV head): a row x [D] is stored as q = round(x / s) in
[-127, 127] with s = max|x| / 127, the D int8 values and the float32 s packed into
D/2 + 2 uint16 words (D + 4 bytes against bfloat16's 2D: 0.52x at D = 128). The
encoding runs on the device before rows leave it, so the device->host copies of prefill and
eviction, the host store and the recalls back to the device all move the encoded bytes; rows
are decoded on the device when they land. The host never reads them as numbers (its store
holds them as "raw16"), which is why only page stores (freekv) take a codec: a vector index
must compute with the keys.

Error: decoded to float32, |x - decode(encode(x))| <= s / 2 = max|x| / 254 per element (up to a
float32 rounding), an absolute bound set by the row's largest entry: about twice bfloat16's
rounding (2^-9 relative) for that entry and relatively coarser for entries far below it.
Decoded to bfloat16 (the pools of a bfloat16 model), the rounding of the decoded value adds up to
|x̂| 2^-8 <= max|x| / 256: within max|x| / 127 in all (the worst of 20,000 random rows: max|x| /
136). Rows with max|x| below ~1.5e-36 (a subnormal scale) encode as zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

CODECS = ("none", "int8")
RAW_DTYPE = "raw16"  # host_index's opaque 16-bit storage
# Products with reciprocals, not divisions: XLA rewrites x / broadcast(s) as x * broadcast(1 / s),
# so the NumPy reference computes the same products and the two agree bit for bit.
_INV_127 = np.float32(1.0 / 127.0)


def check(codec: str, head_dim: int | None = None) -> None:
  """Raises ValueError for an unknown codec or (when given) a head_dim it cannot pack."""
  if codec not in CODECS:
    raise ValueError(f"host_codec={codec!r}; expected one of {CODECS}")
  if codec == "int8" and head_dim is not None and head_dim % 2:
    raise ValueError(f"host_codec='int8' packs two int8 values a word: head_dim {head_dim} is odd")


def _int8(codec: str) -> bool:
  check(codec)  # an unknown name is refused, not taken for int8
  return codec == "int8"


def host_width(codec: str, head_dim: int) -> int:
  """Elements of one stored row: head_dim, or int8's words."""
  return head_dim // 2 + 2 if _int8(codec) else head_dim


def host_dtype(codec: str, dtype) -> str:
  """host_index storage dtype name of rows under `codec` (the model's dtype for "none")."""
  return RAW_DTYPE if _int8(codec) else jnp.dtype(dtype).name


def wire_dtype(codec: str, dtype):
  """The dtype rows have between device and host."""
  return jnp.dtype(jnp.uint16) if _int8(codec) else jnp.dtype(dtype)


def _normal_or_zero(scale, xp):
  """A row's scale, 0 where it is not a normal float32 (max|x| below ~1.5e-36): a GPU flushes such
  subnormals to zero and NumPy does not, so those rows encode as zeros on both."""
  return xp.where(scale >= np.finfo(np.float32).tiny, scale, xp.float32(0.0))


def encode(x, codec: str):
  """x [..., D] -> rows as stored: x itself ("none") or [..., D/2 + 2] uint16 ("int8")."""
  if not _int8(codec):
    return x
  x32 = x.astype(jnp.float32)
  scale = _normal_or_zero(jnp.max(jnp.abs(x32), axis=-1) * _INV_127, jnp)
  inv = jnp.where(scale > 0, 1.0 / jnp.where(scale > 0, scale, 1.0), 0.0)[..., None]
  q = jnp.clip(jnp.round(x32 * inv), -127, 127).astype(jnp.int8)
  words = jax.lax.bitcast_convert_type(q.reshape(*q.shape[:-1], q.shape[-1] // 2, 2), jnp.uint16)
  return jnp.concatenate([words, jax.lax.bitcast_convert_type(scale, jnp.uint16)], axis=-1)


def decode(rows, codec: str, dtype):
  """Inverse of `encode`: rows [..., W] -> [..., D] in `dtype`."""
  if not _int8(codec):
    return rows.astype(dtype)
  half = rows.shape[-1] - 2
  q = jax.lax.bitcast_convert_type(rows[..., :half], jnp.int8).reshape(*rows.shape[:-1], 2 * half)
  scale = jax.lax.bitcast_convert_type(rows[..., half:], jnp.float32)  # [...]
  return (q.astype(jnp.float32) * scale[..., None]).astype(dtype)


def encode_np(x: np.ndarray) -> np.ndarray:
  """NumPy reference of encode(x, "int8"): [..., D] float -> [..., D/2 + 2] uint16."""
  x32 = np.asarray(x, np.float32)
  scale = _normal_or_zero(np.max(np.abs(x32), axis=-1) * _INV_127, np)
  inv = np.where(scale > 0, np.float32(1.0) / np.where(scale > 0, scale, np.float32(1.0)), np.float32(0.0))
  q = np.clip(np.round(x32 * inv[..., None]), -127, 127).astype(np.int8)
  return np.concatenate([q.view(np.uint16), scale[..., None].view(np.uint16)], axis=-1)


def decode_np(rows: np.ndarray) -> np.ndarray:
  """NumPy reference of decode(rows, "int8", float32)."""
  rows = np.ascontiguousarray(rows, np.uint16)
  q = rows[..., :-2].copy().view(np.int8).astype(np.float32)
  scale = rows[..., -2:].copy().view(np.float32)
  return q * scale
