"""Row-wise id bookkeeping for row buffers mirrored elsewhere (e.g. a device buffer of retrieved
rows): which slots to rewrite so each row holds a new set of ids, keeping the ids it already
holds (given those ids, or composed from search results and spans); and how many ids two
selections share per row (hit rates)."""

from __future__ import annotations

from typing import NamedTuple

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


class Selection(NamedTuple):
    """What `select_slots` did: the slot writes (dest, ids, rows [n] int64 each), the rows'
    found and tail ids (retrieved [T, B, H, k + tail] int64) and the scoring (hits, total)."""

    dest: np.ndarray  # flat slot indices into held, increasing when layers increase
    ids: np.ndarray  # the id each such slot now holds, -1 = emptied
    rows: np.ndarray  # the row (t * B + b) * H + h each write belongs to
    retrieved: np.ndarray  # each row's found then tail ids, -1 padded
    hits: int  # valid `used` ids of the scored rows that their own selection holds: found or tail ids
    total: int  # valid `used` ids of the scored rows


def select_slots(held, layers, found, seen, stored, *, tail: int, age=None, sources: int = 0,
                 successors: int = 0, pins=None, span: int = 1, used=None, score=None,
                 threads: int | None = None) -> Selection:
    """Composes each row's wanted ids and rewrites `held` in place so that its rows hold them,
    as `assign_slots` would for those wanted rows; optionally scores an earlier selection
    against the found ids. One threaded C call, GIL released, that builds no [rows, slots]
    array and checks every id before it writes anything.

    Row (t, b, h) wants, in this order, with n = stored[t, b] (ids at or past n are dropped):
    found[t, b, h] (its search result); the tail, seen[t, b, h] + i for i < tail; the
    successors, found[t, b, h, j] + age[t, b, h] + c for j < sources and c = 1..successors,
    of the found ids that exist; the spans pins[t, b, h, j] + c for c < span of the pins that
    exist. Rows of held in layers not listed are not touched.

    Args:
        held: [L, B, H, S] int64, C-contiguous and writable: each slot's store id, -1 = empty;
            rewritten in place. S >= k + tail + sources * successors + p * span.
        layers: [T] distinct ints in [0, L): the layers composed.
        found: [T, B, H, k] int store ids, -1 = none, each below its store's length.
        seen: [T, B, H] int >= 0: the first id of each row's tail.
        stored: [T, B] int >= 0: each (layer, seq) store's length.
        tail: ids per row from `seen` on.
        age: [T, B, H] int >= 0, how far each row's successors move on; needed with successors.
        sources: found ids per row (the first ones) that get successors, <= k.
        successors: ids after each source.
        pins: [T, B, H, p] int span starts, -1 = none (default: none).
        span: ids per pin, >= 1.
        used: [T, B, H, m] int ids of an earlier selection, -1 = none; with `score`.
        score: [T, B, H] bool, the rows whose `used` ids are scored against their own selection:
            a hit is a found id or one of the row's tail ids (stored, not yet searchable).
        threads: OpenMP threads (default: all; fewer for small inputs).

    Returns:
        A `Selection`.

    Raises:
        TypeError: held not an int64 ndarray, or non-integer arrays or options.
        ValueError: shapes that disagree, held not C-contiguous and writable, layers repeated
            or out of range, ids out of range (held, pins or used ids below -1, found ids
            outside [-1, stored), negative seen, stored or age).
    """
    h = _held(held)
    L, B, H, S = h.shape
    lay = _dtypes.as_ids(layers, "layers", ndim=1)
    T = lay.size
    if np.unique(lay).size != T or (T and (lay.min() < 0 or lay.max() >= L)):
        raise ValueError(f"layers {lay.tolist()} must be distinct and lie in [0, {L})")
    if (used is None) != (score is None):
        raise ValueError("used and score go together")
    named = {"found": found, "seen": seen, "stored": stored, "age": age, "pins": pins, "used": used}
    ranks = {"found": 4, "seen": 3, "stored": 2, "age": 3, "pins": 4, "used": 4}
    arrays = {name: _dtypes.as_ids(a, name, ndim=ranks[name]) for name, a in named.items() if a is not None}
    if score is not None:
        arrays["score"] = np.ascontiguousarray(score)
        if arrays["score"].dtype != np.bool_:
            raise TypeError(f"score: dtype {arrays['score'].dtype} is not bool")
    for name, a in arrays.items():  # leading axes [T, B, H] ([T, B] for stored)
        if a.shape[:3] != (T, B, H)[:a.ndim]:
            raise ValueError(f"{name} {a.shape} must start with {[T, B, H][:a.ndim]} (held {h.shape}, "
                             f"{T} layers)")
    k = arrays["found"].shape[3]
    p = arrays["pins"].shape[3] if pins is not None else 0
    m = arrays["used"].shape[3] if used is not None else 0
    tail, sources, successors = (_dtypes.positive_int(v, n, allow_zero=True) for v, n in
                                 ((tail, "tail"), (sources, "sources"), (successors, "successors")))
    span = _dtypes.positive_int(span, "span")
    if sources > k:
        raise ValueError(f"sources={sources} must be <= k={k}")
    if successors and age is None:
        raise ValueError("age is needed with successors")
    if k + tail + sources * successors + p * span > S:
        raise ValueError(f"held's {S} slots cannot hold k + tail + sources * successors + pins * span = "
                         f"{k + tail + sources * successors + p * span} ids")
    retrieved = np.empty((T, B, H, k + tail), np.int64)
    dest, ids, rows = (np.empty(T * B * H * S, np.int64) for _ in range(3))
    nthreads = 0 if threads is None else _dtypes.positive_int(threads, "threads")
    try:
        n, hits, total = _core.select_slots(
            h, L * B * H, S, lay, T, B, H, arrays["stored"], arrays["found"], k, arrays["seen"], tail,
            arrays.get("age"), sources, successors, arrays.get("pins"), p, span, arrays.get("score"),
            arrays.get("used"), m, retrieved, dest, ids, rows, nthreads)
    except ValueError as e:  # the C call checks values (no scans here on the hot path): name the bad one
        raise ValueError(_first_out_of_range(h[lay], arrays) or str(e)) from None
    return Selection(dest[:n], ids[:n], rows[:n], retrieved, hits, total)


def _first_out_of_range(held, arrays) -> str | None:
    """The first value select_slots' C checks refuse, as a message naming its array, index and
    value (None if none is found). held: the composed layers' rows [T, B, H, S]."""
    stored = arrays["stored"]
    limits = [("held", held, -1, None), ("stored", stored, 0, None),
              ("found", arrays["found"], -1, stored[:, :, None, None]), ("seen", arrays["seen"], 0, None)]
    limits += [(name, arrays[name], low, None) for name, low in (("age", 0), ("pins", -1), ("used", -1))
               if name in arrays]
    for name, a, low, high in limits:
        bad = (a < low) if high is None else (a < low) | (a >= high)
        if bad.any():
            at = np.unravel_index(int(np.argmax(bad)), a.shape)
            bound = f">= {low}" if high is None else f"in [{low}, stored = {np.broadcast_to(high, a.shape)[at]})"
            return f"select_slots: ids out of range: {name}[{', '.join(map(str, at))}] = {a[at]} must be {bound}"
    return None


def _held(held) -> np.ndarray:
    """held as given (it is rewritten in place): a writable C-contiguous [L, B, H, S] int64 array."""
    if not isinstance(held, np.ndarray) or held.dtype != np.int64:
        raise TypeError(f"held must be an int64 ndarray, got {type(held).__name__} "
                        f"{getattr(held, 'dtype', '')}")
    if held.ndim != 4 or not held.flags.c_contiguous or not held.flags.writeable:
        raise ValueError(f"held {held.shape} must be a writable C-contiguous [L, B, H, S] array")
    return held
