"""Element types: names, C codes, and turning caller arrays into C-ready buffers."""

from __future__ import annotations

import numpy as np

# Codes shared with host_index/csrc/hi_common.h (enum hi_dtype).
F32, F16, BF16, RAW16 = 0, 1, 2, 3
CODES = {"float32": F32, "float16": F16, "bfloat16": BF16}
# raw16: rows a caller encoded itself (e.g. int8 values + a float32 scale) as
# 16-bit words, stored and handed back bit for bit; nothing reads them as numbers.
STORE_CODES = {**CODES, "raw16": RAW16}
# bfloat16 is held as its uint16 bit pattern so the store needs no ml_dtypes.
STORAGE = {F32: np.dtype(np.float32), F16: np.dtype(np.float16), BF16: np.dtype(np.uint16),
           RAW16: np.dtype(np.uint16)}


def code_of(name: str) -> int:
    """C code of a storage dtype name ("float32" | "float16" | "bfloat16" | "raw16")."""
    if name not in STORE_CODES:
        raise ValueError(f"dtype={name!r} must be one of {sorted(STORE_CODES)}")
    return STORE_CODES[name]


def as_c_array(x, what: str, *, ndim: int) -> tuple[np.ndarray, int]:
    """Validates a float array and returns (C-contiguous buffer-ready array, code).

    Accepts float32, float16 and bfloat16 (ml_dtypes, as JAX hands to host
    callbacks); bfloat16 is returned viewed as uint16. Non-contiguous input is
    copied.

    Raises:
        TypeError: not an ndarray-like of one of those dtypes.
        ValueError: wrong number of dimensions.
    """
    a = np.asarray(x)
    name = a.dtype.name
    if name not in CODES:
        raise TypeError(f"{what}: dtype {a.dtype} is not float32, float16 or bfloat16")
    if a.ndim != ndim:
        raise ValueError(f"{what}: expected {ndim} dimensions, got shape {a.shape}")
    a = np.ascontiguousarray(a)
    if name == "bfloat16":
        a = a.view(np.uint16)
    return a, CODES[name]


def as_raw16(x, what: str, *, ndim: int) -> tuple[np.ndarray, int]:
    """(C-contiguous uint16 array, RAW16) for a raw16 store: the caller's bits, unconverted.

    Raises:
        TypeError: not uint16 (a float has no raw16 encoding to convert to).
        ValueError: wrong number of dimensions.
    """
    a = np.asarray(x)
    if a.dtype != np.uint16:
        raise TypeError(f"{what}: dtype {a.dtype} is not uint16 (dtype='raw16' stores "
                        f"encoded rows viewed as uint16)")
    if a.ndim != ndim:
        raise ValueError(f"{what}: expected {ndim} dimensions, got shape {a.shape}")
    return np.ascontiguousarray(a), RAW16


def check_f32(x, what: str, *, ndim: int, dim: int | None = None) -> np.ndarray:
    """x as an array, checked as `as_f32` checks it but read only (no copy, no temporary).

    Raises:
        TypeError / ValueError: bad dtype, rank, last dimension, or NaN/inf.
    """
    a = np.asarray(x)
    if a.dtype.name not in CODES:
        raise TypeError(f"{what}: dtype {a.dtype} is not float32, float16 or bfloat16")
    if a.ndim != ndim:
        raise ValueError(f"{what}: expected {ndim} dimensions, got shape {a.shape}")
    if dim is not None and a.shape[-1] != dim:
        raise ValueError(f"{what}: last dimension {a.shape[-1]} != head_dim {dim}")
    # min and max propagate NaN and reach +-inf, so both are finite only for finite arrays
    if a.size and not (np.isfinite(a.min()) and np.isfinite(a.max())):
        raise ValueError(f"{what}: contains NaN or inf")
    return a


def as_f32(x, what: str, *, ndim: int, dim: int | None = None) -> np.ndarray:
    """A finite, C-contiguous float32 copy/view of a float array.

    Raises:
        TypeError / ValueError: bad dtype, rank, last dimension, or NaN/inf.
    """
    return np.ascontiguousarray(check_f32(x, what, ndim=ndim, dim=dim), dtype=np.float32)


def check_ids(x, what: str, *, ndim: int | None) -> np.ndarray:
    """x as an integer array of rank ndim (any rank for None; no copy).

    Raises:
        TypeError: not an integer array (floats, bools).
        ValueError: wrong rank.
    """
    a = np.asarray(x)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{what}: dtype {a.dtype} is not an integer type")
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{what}: expected {ndim} dimensions, got shape {a.shape}")
    return a


def as_ids(x, what: str, *, ndim: int | None) -> np.ndarray:
    """A C-contiguous int64 copy/view of an integer array.

    Raises:
        TypeError: not an integer array.
        ValueError: wrong rank.
    """
    a = np.asarray(x)
    if not a.size:  # an empty list: NumPy reads it as float64
        a = a.astype(np.int64)
    return np.ascontiguousarray(check_ids(a, what, ndim=ndim), dtype=np.int64)


def positive_int(v, what: str, *, allow_zero: bool = False) -> int:
    """Validates an integer option (bools and floats are rejected)."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{what}={v!r} must be an int")
    if v < 0 or (v == 0 and not allow_zero):
        raise ValueError(f"{what}={v!r} must be {'>= 0' if allow_zero else '> 0'}")
    return int(v)
