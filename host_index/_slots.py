"""Row-wise id bookkeeping for row buffers mirrored elsewhere (e.g. a device buffer of retrieved
rows): which slots to rewrite so each row holds a new set of ids, keeping the ids it already
holds; and how many ids two selections share per row (hit rates)."""

from __future__ import annotations

import numpy as np

from host_index import _core, _dtypes


def assign_slots(held, wanted, *, threads: int | None = None):
    """The slot writes that turn each row of `held` into the id set of the same row of `wanted`.

    Ids held and still wanted keep their slot (nothing to send for them); entering ids take
    the free slots, first free slot first, in the order they appear in `wanted`; free slots
    left over are emptied. One threaded C call.

    Args:
        held: [R, S] int store ids now in each row's slots, -1 = empty.
        wanted: [R, S] int the rows' new selections, -1 = none (a repeated id counts once).
        threads: OpenMP threads (default: all; fewer for small inputs).

    Returns:
        (dest [n] int64 flat slot indices into [R * S], increasing; ids [n] int64 the id each
        such slot takes, -1 = emptied).

    Raises:
        TypeError: non-integer arrays.
        ValueError: shapes differ or are not 2-D, or an id below -1.
    """
    h = _dtypes.as_ids(held, "held", ndim=2)
    w = _dtypes.as_ids(wanted, "wanted", ndim=2)
    if h.shape != w.shape:
        raise ValueError(f"held {h.shape} and wanted {w.shape} must have one [R, S] shape")
    for name, a in (("held", h), ("wanted", w)):
        if a.size and a.min() < -1:
            raise ValueError(f"{name}: ids must be >= -1, got {a.min()}")
    R, S = h.shape
    writes = np.empty((R, S), np.int64)
    nthreads = 0 if threads is None else _dtypes.positive_int(threads, "threads")
    _core.assign_slots(h, w, R, S, writes, nthreads)
    dest = np.flatnonzero(writes >= -1)
    return dest, writes.reshape(-1)[dest]


def count_common(a, b, *, threads: int | None = None) -> np.ndarray:
    """Per row, how many valid ids of `a` occur in the same row of `b` (one threaded C call).

    Args:
        a: [R, n] int ids, -1 = none (a repeated id counts each time).
        b: [R, m] int ids, -1 = none.
        threads: OpenMP threads (default: all; fewer for small inputs).

    Returns:
        [R] int64 counts.

    Raises:
        TypeError: non-integer arrays.
        ValueError: not 2-D, row counts differ, or an id below -1.
    """
    x = _dtypes.as_ids(a, "a", ndim=2)
    y = _dtypes.as_ids(b, "b", ndim=2)
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"a {x.shape} and b {y.shape} must have the same number of rows")
    for name, ids in (("a", x), ("b", y)):
        if ids.size and ids.min() < -1:
            raise ValueError(f"{name}: ids must be >= -1, got {ids.min()}")
    counts = np.empty(x.shape[0], np.int64)
    nthreads = 0 if threads is None else _dtypes.positive_int(threads, "threads")
    _core.count_common(x, x.shape[1], y, y.shape[1], x.shape[0], counts, nthreads)
    return counts
