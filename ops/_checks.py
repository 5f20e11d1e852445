"""Boundary validation shared by the ops entry points.

Every check runs before any device work and raises a ValueError/TypeError that
names the offending value. Value checks (lengths, page ids, layer) only run when
the value is concrete: inside `jit` the arguments are tracers and are skipped.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

STORAGE_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def is_concrete(x: Any) -> bool:
  """True if `x` holds a value now (not a tracer inside jit/vmap/scan)."""
  return not isinstance(x, jax.core.Tracer)


def concrete_value(x: Any) -> np.ndarray | None:
  """Returns `x` as a NumPy array when concrete, else None."""
  if x is None or not is_concrete(x):
    return None
  return np.asarray(x)


def index_array(x: Any) -> Any:
  """`x` as is when a JAX array (or tracer), else as a NumPy array: ids and lengths given as
  Python or NumPy int64 keep their width for the range checks (jnp.asarray would first wrap
  2**32 + 5 to 5 under JAX's default int32)."""
  return x if isinstance(x, jax.Array) else np.asarray(x)


def check_float(name: str, x: Any) -> None:
  dtype = jnp.dtype(getattr(x, "dtype", None) or jnp.asarray(x).dtype)
  if dtype not in STORAGE_DTYPES:
    raise TypeError(f"{name}.dtype={dtype} must be one of bfloat16, float16, float32")


def check_int(name: str, x: Any) -> None:
  dtype = jnp.dtype(getattr(x, "dtype", None) or jnp.asarray(x).dtype)
  if not jnp.issubdtype(dtype, jnp.integer):
    raise TypeError(f"{name}.dtype={dtype} must be an integer dtype (int32)")


def check_ndim(name: str, x: Any, ndims: tuple[int, ...], layout: str) -> None:
  if x.ndim not in ndims:
    raise ValueError(f"{name}.shape={tuple(x.shape)} must be {layout}")


def check_shape(name: str, x: Any, shape: tuple[int, ...], layout: str) -> None:
  if tuple(x.shape) != tuple(shape):
    raise ValueError(f"{name}.shape={tuple(x.shape)} must be {tuple(shape)} ({layout})")


def check_groups(q_heads: int, kv_heads: int) -> int:
  """Returns the GQA group size G = q_heads // kv_heads or raises."""
  if kv_heads <= 0 or q_heads % kv_heads:
    raise ValueError(f"{q_heads=} must be a positive multiple of {kv_heads=} (GQA groups)")
  return q_heads // kv_heads


def check_range(name: str, x: Any, lo: int, hi: int) -> None:
  """Checks lo <= x <= hi elementwise when `x` is concrete."""
  val = concrete_value(x)
  if val is None or val.size == 0:
    return
  bad = (val < lo) | (val > hi)
  if bad.any():
    idx = tuple(int(i) for i in np.argwhere(bad)[0])
    raise ValueError(f"{name}{list(idx)}={val[idx]} is outside [{lo}, {hi}]")


def check_layer(layer: Any, num_layers: int | None) -> None:
  """`layer` must be given iff the cache is layer-stacked, and in range."""
  if num_layers is None:
    if layer is not None:
      raise ValueError(f"{layer=} given but the cache is not layer-stacked")
    return
  if layer is None:
    raise ValueError(
        f"the cache is layer-stacked ({num_layers} layers): pass layer=")
  check_int("layer", layer)
  if jnp.ndim(layer) != 0:
    raise ValueError(f"layer.shape={jnp.shape(layer)} must be a scalar")
  check_range("layer", layer, 0, num_layers - 1)


def check_pow2(name: str, value: int, minimum: int, hint: str = "") -> None:
  if value < minimum or value & (value - 1):
    raise ValueError(f"{name}={value} must be a power of two >= {minimum}{hint}")


def check_implementation(implementation: str) -> None:
  if implementation not in ("pallas", "xla"):
    raise ValueError(f"{implementation=} must be 'pallas' or 'xla'")


def check_query_and_cache(q: Any, k: Any, v: Any, *, q_layout: str, q_head_axis: int, layer: Any):
  """Checks q against a head-major cache k, v ([B, Hkv, S, D], or [L, B, Hkv, S, D] with `layer`).

  Returns (num_layers or None, batch, kv_heads, seq_len, head_dim).
  """
  for name, x in (("q", q), ("k", k), ("v", v)):
    check_float(name, x)
  check_ndim("q", q, (len(q_layout.split(",")),), q_layout)
  check_ndim("k", k, (4, 5), "[batch, kv_heads, seq, head_dim] or [layers, batch, kv_heads, seq, head_dim]")
  if v.shape != k.shape:
    raise ValueError(f"v.shape={tuple(v.shape)} must equal k.shape={tuple(k.shape)}")
  if v.dtype != k.dtype:
    raise TypeError(f"v.dtype={v.dtype} must equal k.dtype={k.dtype}")
  num_layers = k.shape[0] if k.ndim == 5 else None
  batch, kv_heads, seq_len, head_dim = k.shape[-4:]
  if seq_len == 0:
    raise ValueError(f"k.shape={tuple(k.shape)} holds no key slots (seq = 0)")
  if q.shape[0] != batch:
    raise ValueError(f"q batch {q.shape[0]} (q.shape={tuple(q.shape)}) must equal k batch {batch}")
  if q.shape[-1] != head_dim:
    raise ValueError(f"q head_dim {q.shape[-1]} must equal k head_dim {head_dim}")
  check_groups(q.shape[q_head_axis], kv_heads)
  check_layer(layer, num_layers)
  return num_layers, batch, kv_heads, seq_len, head_dim
