"""Each key's nearest keys: the connectivity candidates a roar build can take instead of
searching its own graph for every key (`build_index(connect_candidates=...)`).

This is the NumPy reference and the CPU path; on an accelerator `ops.nearest_keys` computes
the same lists (kvjax's retrieval prefill passes them to the builds).
"""

from __future__ import annotations

import numpy as np

from host_index import _dtypes


def key_neighbours(keys, count: int, *, block: int = 2048) -> np.ndarray:
    """[N, count] int64: each key's `count` nearest other keys by L2 distance, nearest first
    (-1 padded when N - 1 < count). keys: [N, D] float32 / float16 / bfloat16, finite."""
    if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 1:
        raise ValueError(f"count={count!r} must be a positive int")
    count = int(count)
    if np.ndim(keys) != 2:
        raise ValueError(f"keys: expected [N, D], got shape {np.shape(keys)}")
    k = _dtypes.as_f32(keys, "keys", ndim=2)  # finite: a NaN key made key 0 every key's nearest
    n = k.shape[0]
    out = np.full((n, count), -1, np.int64)
    c = min(count, n - 1)
    if c <= 0:
        return out
    sq = np.einsum("nd,nd->n", k, k)
    for start in range(0, n, block):
        rows = np.arange(start, min(start + block, n))
        # ||a - b||^2 up to the row's constant ||a||^2: the ranking of each row is unchanged
        dist = sq[None, :] - 2.0 * (k[rows] @ k.T)
        dist[np.arange(len(rows)), rows] = np.inf  # not itself
        part = np.argpartition(dist, c - 1, axis=1)[:, :c]
        d = np.take_along_axis(dist, part, axis=1)
        order = np.lexsort((part, d), axis=1)  # by distance, then by id
        out[rows, :c] = np.take_along_axis(part, order, axis=1)
    return out
