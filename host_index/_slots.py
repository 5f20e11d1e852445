"""Slot bookkeeping for row buffers mirrored elsewhere (e.g. a device buffer of retrieved rows):
which slots to rewrite so each row holds a new set of ids, keeping the ids it already holds."""

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
