"""Exact top-k of score rows in one threaded C call: the CPU path of roar's training top-k in a
retrieval prefill, where NumPy's argpartition had taken 126 of 217 s (Qwen2.5 at 8K, 2 cores;
experiments/results/bench_train_topk_qwenshapes_cpu.md)."""

from __future__ import annotations

import numpy as np

from host_index import _core, _dtypes


def topk_rows(scores, k: int, *, threads: int | None = None) -> np.ndarray:
    """Each row's k largest scores, as column ids, largest first; a tie goes to the lower column.

    Args:
        scores: [R, N] float32, finite (other dtypes are refused, not rounded: rounding could
            reorder near-ties).
        k: ids per row, 0 <= k <= N.
        threads: OpenMP threads (default: all; fewer for small inputs).

    Returns:
        [R, k] int64 column ids.

    Raises:
        TypeError: not float32, or k / threads not ints.
        ValueError: not 2-D, k out of range, N >= 2^31, or a NaN / inf score.
    """
    s = np.asarray(scores)
    if s.dtype != np.float32:
        raise TypeError(f"scores: dtype {s.dtype} is not float32")
    if s.ndim != 2:
        raise ValueError(f"scores: expected [R, N], got shape {s.shape}")
    s = np.ascontiguousarray(s)
    R, N = s.shape
    k = _dtypes.positive_int(k, "k", allow_zero=True)
    if k > N:
        raise ValueError(f"k={k} exceeds the {N} scores a row")
    if N >= 2**31:
        raise ValueError(f"rows of {N} scores: at most 2^31 - 1")
    nthreads = 0 if threads is None else _dtypes.positive_int(threads, "threads")
    ids = np.empty((R, k), np.int64)
    try:
        _core.topk_rows(s, R, N, k, ids, nthreads)
    except ValueError as err:  # the core's only failure past the checks above
        raise ValueError("scores: contains NaN or inf") from err
    return ids
