"""Layer-wide C calls of HostContext: search (ids only), attend_ids, insert_many."""

import threading

import numpy as np
import pytest

import host_index as hi
from host_index import _core
from host_index.synthetic import clustered

S, L, HQ, HKV, D = 2, 2, 6, 2, 16
G = HQ // HKV
KINDS = ["flat", "ivf", "graph", "roar"]


def make(kind="flat", dtype="float32", n=300, seed=0, build=True):
    """A context with n tokens per (seq, layer), indexes built when asked."""
    ctx = hi.HostContext(S, L, HQ, HKV, D, dtype=dtype, kind=kind)
    rng = np.random.default_rng(seed)
    for s in range(S):
        for l in range(L):
            k = np.stack([clustered(n, D, seed=seed + 10 * s + 3 * l + h) for h in range(HKV)])
            ctx.append(s, l, 0, k, rng.standard_normal((HKV, n, D)).astype(np.float32))
    if build:
        tq = rng.standard_normal((S, HQ, 40, D)).astype(np.float32) if kind == "roar" else None
        for l in range(L):
            ctx.build_layer(l, train_queries=tq, threads=1)  # deterministic builds
    return ctx


def queries(seed=9, rows=S):
    return clustered(rows * HQ, D, seed=seed, shift=0.3).reshape(rows, HQ, D)


def attend_ids_reference(ctx, layer, q, ids, scale, seqs=None):
    """float64 NumPy attention over ids [B, Hq, n]; ids < 0 or >= length skipped."""
    seqs = range(q.shape[0]) if seqs is None else seqs
    o = np.zeros(q.shape, np.float64)
    lse = np.full(q.shape[:2], -np.inf)
    for b, s in enumerate(seqs):
        K, V = ctx.store.keys(s, layer), ctx.store.values(s, layer)
        n = K.shape[1]
        for h in range(HQ):
            sel = ids[b, h][(ids[b, h] >= 0) & (ids[b, h] < n)]
            if len(sel) == 0:
                continue
            x = scale * (K[h // G, sel].astype(np.float64) @ q[b, h].astype(np.float64))
            w = np.exp(x - x.max())
            o[b, h] = w @ V[h // G, sel] / w.sum()
            lse[b, h] = x.max() + np.log(w.sum())
    return o, lse


# -- attend_ids ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_attend_ids_matches_numpy(dtype):
    ctx = make(dtype=dtype, build=False)
    rng = np.random.default_rng(1)
    q = queries()
    n = 40
    ids = rng.integers(0, 300, (S, HQ, n))
    ids[rng.random(ids.shape) < 0.2] = -1  # padding
    ids[0, 1, :5] = [300, 301, 10**9, -7, 299]  # out of range (skipped) and the last row
    ids[0, 2] = -1  # nothing valid: o 0, lse -inf
    ids[1, 3] = 7  # one id repeated: counts n times, softmax over equal scores
    ids[1, 4, :] = 400  # all past the length
    o, lse = ctx.attend_ids(1, q, ids, scale=0.3)
    assert o.dtype == np.float32 and lse.dtype == np.float32
    ro, rlse = attend_ids_reference(ctx, 1, q, ids, 0.3)
    np.testing.assert_allclose(o, ro, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, rlse, rtol=1e-5, atol=1e-5)
    assert (o[0, 2] == 0).all() and np.isneginf(lse[0, 2])
    assert (o[1, 4] == 0).all() and np.isneginf(lse[1, 4])
    np.testing.assert_allclose(lse[1, 3], 0.3 * ctx.store.keys(1, 1)[1, 7] @ q[1, 3] + np.log(n),
                               rtol=1e-5)
    # Deterministic, whatever the thread count.
    for threads in (1, 2):
        o2, lse2 = ctx.attend_ids(1, q, ids, scale=0.3, threads=threads)
        np.testing.assert_array_equal(o2, o)
        np.testing.assert_array_equal(lse2, lse)


def test_attend_ids_seqs_default_scale_and_empty():
    ctx = make(build=False)
    q = queries(rows=3)
    ids = np.random.default_rng(2).integers(-1, 300, (3, HQ, 25))
    o, lse = ctx.attend_ids(0, q, ids, seqs=[1, 0, 1])
    ro, rlse = attend_ids_reference(ctx, 0, q, ids, D ** -0.5, seqs=[1, 0, 1])
    np.testing.assert_allclose(o, ro, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, rlse, rtol=1e-5, atol=1e-5)
    o, lse = ctx.attend_ids(0, q, np.zeros((3, HQ, 0), np.int64), seqs=[1, 0, 1])  # n = 0
    assert (o == 0).all() and np.isneginf(lse).all()
    empty = hi.HostContext(1, 1, HQ, HKV, D)  # nothing stored: every id is out of range
    o, lse = empty.attend_ids(0, q[:1], np.zeros((1, HQ, 4), np.int32))
    assert (o == 0).all() and np.isneginf(lse).all()


@pytest.mark.parametrize("kind", KINDS)
def test_attend_ids_over_attend_ids_equals_attend(kind):
    ctx = make(kind, dtype="float16")
    q = queries()
    o, lse, _, ids = ctx.attend(1, q, k=20, ef=64, return_ids=True)
    o2, lse2 = ctx.attend_ids(1, q, ids)
    np.testing.assert_allclose(o2, o, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse2, lse, rtol=1e-6, atol=1e-6)


def test_attend_ids_bad_input():
    ctx = make(build=False)
    q = queries()
    ids = np.zeros((S, HQ, 3), np.int64)
    with pytest.raises(ValueError, match="ids"):
        ctx.attend_ids(0, q, ids[:, :2])
    with pytest.raises(ValueError):
        ctx.attend_ids(0, q, ids[0])
    with pytest.raises(TypeError):
        ctx.attend_ids(0, q, ids.astype(np.float32))
    with pytest.raises(ValueError):
        ctx.attend_ids(0, q, ids, scale=float("nan"))
    with pytest.raises(ValueError):
        ctx.attend_ids(3, q, ids)


# -- search -----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_search_equals_per_index_search(kind):
    ctx = make(kind, dtype="bfloat16")
    q = queries(rows=3)
    seqs = [1, 0, 1]
    ids, scanned = ctx.search(1, q, k=12, ef=48, seqs=seqs)
    assert ids.shape == (3, HQ, 12) and ids.dtype == np.int64 and scanned.dtype == np.int64
    for b, s in enumerate(seqs):
        for h in range(HQ):
            ix = ctx.index(s, 1, h if kind == "roar" else h // G)
            want, _, count = ix.search(q[b, h][None], 12, ef=48)
            np.testing.assert_array_equal(ids[b, h], want[0])
            assert scanned[b, h] == count[0] > 0
    # The same ids as attend retrieves, whatever the thread count.
    _, _, att_scanned, att_ids = ctx.attend(1, q, k=12, ef=48, seqs=seqs, return_ids=True)
    np.testing.assert_array_equal(ids, att_ids)
    np.testing.assert_array_equal(scanned, att_scanned)
    for threads in (1, 2):
        again = ctx.search(1, q, k=12, ef=48, seqs=seqs, threads=threads)
        np.testing.assert_array_equal(again[0], ids)
        np.testing.assert_array_equal(again[1], scanned)


@pytest.mark.parametrize("kind", KINDS)
def test_search_layers_equals_search_per_layer(kind):
    ctx = make(kind)
    q = np.stack([queries(seed=3), queries(seed=4)])  # [T=2, S, HQ, D]
    ids, scanned = ctx.search_layers([1, 0], q, k=10, ef=40)
    assert ids.shape == (2, S, HQ, 10) and scanned.shape == (2, S, HQ)
    for t, layer in enumerate([1, 0]):
        want_ids, want_scanned = ctx.search(layer, q[t], k=10, ef=40)
        np.testing.assert_array_equal(ids[t], want_ids)
        np.testing.assert_array_equal(scanned[t], want_scanned)
    with pytest.raises(ValueError, match="distinct"):
        ctx.search_layers([0, 0], q, k=10)
    with pytest.raises(ValueError, match="queries"):
        ctx.search_layers([0], q, k=10)
    assert ctx.search_layers([], q[:0], k=3)[0].shape == (0, S, HQ, 3)
    mask = np.zeros((2, S, HQ), bool)
    mask[0, 0, 1] = mask[1, 1, 2:] = True
    ids, scanned = ctx.search_layers([1, 0], q, k=10, ef=40, heads=mask)
    for t, layer in enumerate([1, 0]):
        want_ids, want_scanned = ctx.search(layer, q[t], k=10, ef=40, heads=mask[t])
        np.testing.assert_array_equal(ids[t], want_ids)
        np.testing.assert_array_equal(scanned[t], want_scanned)
    assert (ids[~mask] == -1).all() and (scanned[~mask] == 0).all() and (scanned[mask] > 0).all()
    with pytest.raises(ValueError, match="heads"):
        ctx.search_layers([1, 0], q, k=10, heads=mask[:1])


@pytest.mark.parametrize("kind", ["graph", "roar"])
def test_search_masked_heads(kind):
    ctx = make(kind)
    q = queries()
    full, full_scanned = ctx.search(0, q, k=8)
    mask = np.zeros((S, HQ), bool)
    mask[0, 1] = mask[1, 3:] = True
    ids, scanned = ctx.search(0, q, k=8, heads=mask)
    np.testing.assert_array_equal(ids[mask], full[mask])
    np.testing.assert_array_equal(scanned[mask], full_scanned[mask])
    assert (ids[~mask] == -1).all() and (scanned[~mask] == 0).all()
    ids, scanned = ctx.search(0, q, k=8, heads=np.zeros((S, HQ), bool))
    assert (ids == -1).all() and (scanned == 0).all()


def test_search_empty_small_and_bad_input():
    ctx = hi.HostContext(S, L, HQ, HKV, D, kind="graph")
    q = queries()
    ids, scanned = ctx.search(0, q, k=5)
    assert (ids == -1).all() and (scanned == 0).all()
    ctx = make("flat", n=3)
    ids, _ = ctx.search(0, q, k=5)  # fewer keys than k: -1 padded
    assert (ids[..., :3] >= 0).all() and (ids[..., 3:] == -1).all()
    assert ctx.search(0, q, k=0)[0].shape == (S, HQ, 0)
    with pytest.raises(ValueError, match="heads"):
        ctx.search(0, q, k=5, heads=np.ones((S, HQ - 1), bool))
    with pytest.raises(ValueError, match="heads"):
        ctx.search(0, q, k=5, heads=np.ones((S, HQ), np.int32))
    with pytest.raises(ValueError):
        ctx.search(0, q, k=-1)
    with pytest.raises(ValueError):
        ctx.search(0, q, k=5, seqs=[0])


# -- insert_many ----------------------------------------------------------------------------


def new_tokens(T, n, seed):
    rng = np.random.default_rng(seed)
    k = np.stack([np.stack([clustered(n, D, seed=seed * 31 + 7 * t + h) for h in range(HKV)])
                  for t in range(T)])
    return (k, rng.standard_normal((T, HKV, n, D)).astype(np.float32),
            rng.standard_normal((T, HQ, n, D)).astype(np.float32))


def state(ctx):
    return [[[ix._c.export() for ix in per_l] for per_l in per_s] for per_s in ctx._ix]


@pytest.mark.parametrize("kind", KINDS)
def test_insert_many_equals_one_by_one(kind):
    """Every (seq, layer) and head in one threaded call = the same inserts one at a time."""
    a, b = make(kind, dtype="float16"), make(kind, dtype="float16")
    pairs = [(s, l) for s in range(S) for l in range(L)]
    for step in range(3):
        k, v, q = new_tokens(len(pairs), 2, seed=step)
        start = 300 + 2 * step
        new = a.insert_many([s for s, _ in pairs], [l for _, l in pairs], [start] * len(pairs), k,
                            v, queries=q)
        assert new.dtype == np.int64 and (new == 2).all()
        for i, (s, l) in enumerate(pairs):
            assert b.insert(s, l, start, k[i], v[i], queries=q[i], threads=1) == 2
    assert all(a.indexed(s, l) == 306 for s, l in pairs)
    assert state(a) == state(b)
    for s, l in pairs:
        np.testing.assert_array_equal(a.store.keys(s, l), b.store.keys(s, l))
        np.testing.assert_array_equal(a.store.values(s, l), b.store.values(s, l))
    # A repeat is a no-op; a partial overlap stores and indexes only the new token.
    k, v, q = new_tokens(len(pairs), 2, seed=9)
    new = a.insert_many([s for s, _ in pairs], [l for _, l in pairs], [305] * len(pairs), k, v,
                        queries=q)
    assert (new == 1).all() and all(a.indexed(s, l) == 307 for s, l in pairs)


def test_insert_many_catches_up_on_appended_tokens():
    ctx = make("roar", n=100)
    k, v, q = new_tokens(2, 5, seed=4)
    ctx.append(0, 1, 100, k[0], v[0])  # stored without indexing
    assert ctx.indexed(0, 1) == 100
    new = ctx.insert_many([0, 1], [1, 1], [105, 100], k, v, queries=q)
    np.testing.assert_array_equal(new, [5, 5])
    assert ctx.indexed(0, 1) == 110 and ctx.indexed(1, 1) == 105


@pytest.mark.parametrize("kind", ["graph", "roar"])
def test_index_stored_equals_insert_many(kind):
    """append now + index_stored later (decode's deferred insert) = insert_many at once."""
    a, b = make(kind), make(kind)
    pairs = [(0, 1), (1, 1)]
    k, v, q = new_tokens(len(pairs), 3, seed=6)
    for i, (s, l) in enumerate(pairs):
        a.append(s, l, 300, k[i], v[i])
    assert a.indexed(0, 1) == 300
    a.index_stored([s for s, _ in pairs], [l for _, l in pairs], queries=q)
    b.insert_many([s for s, _ in pairs], [l for _, l in pairs], [300, 300], k, v, queries=q)
    assert all(a.indexed(s, l) == 303 for s, l in pairs)
    assert state(a) == state(b)
    a.index_stored([0], [1])  # nothing left to index: a no-op
    assert state(a) == state(b)


@pytest.mark.parametrize("kind", ["graph", "roar"])
def test_a_yielding_index_waits_while_a_foreground_call_runs(kind):
    """index_stored(yield_to_foreground=True) inserts nothing while a foreground call runs (the
    exchange's searches, gathers: host_index/csrc/hi_gate.h), then what it inserts without
    yielding; an insert that does not yield goes on beside the call."""
    a, b = make(kind), make(kind)
    pairs = [(0, 1), (1, 1)]
    seqs, layers = [s for s, _ in pairs], [l for _, l in pairs]
    k, v, q = new_tokens(len(pairs), 3, seed=6)
    for ctx in (a, b):
        for i, (s, l) in enumerate(pairs):
            ctx.append(s, l, 300, k[i], v[i])
    waited = []
    _core.foreground_enter()
    try:
        worker = threading.Thread(target=lambda: waited.append(
            a.index_stored(seqs, layers, queries=q, yield_to_foreground=True)))
        worker.start()
        assert b.index_stored(seqs, layers, queries=q) == 0.0  # beside the foreground call
        assert b.indexed(0, 1) == 303
        worker.join(timeout=0.5)
        assert worker.is_alive() and a.indexed(0, 1) == a.indexed(1, 1) == 300
    finally:
        _core.foreground_exit()
    worker.join(timeout=60)
    assert not worker.is_alive() and waited[0] > 0.0
    assert state(a) == state(b)
    assert a.index_stored([0], [1], yield_to_foreground=True) == 0.0  # nothing to index, no wait
    with pytest.raises(RuntimeError, match="no foreground call"):
        _core.foreground_exit()


@pytest.mark.parametrize("kind", ["flat", "roar"])
def test_lengths_and_indexed_counts_read_every_pair_at_once(kind):
    """store.lengths() / indexed_counts() [S, L] equal length / indexed pair by pair, with pairs
    stored but not yet indexed."""
    ctx = make(kind, n=60)
    k, v, q = new_tokens(1, 3, seed=8)
    ctx.append(1, 0, 60, k[0], v[0])
    ctx.append(0, 1, 60, k[0, :, :2], v[0, :, :2])
    ctx.index_stored([0], [1], queries=q[:, :, :2])
    lengths, indexed = ctx.store.lengths(), ctx.indexed_counts()
    assert lengths.shape == indexed.shape == (S, L) and lengths.dtype == indexed.dtype == np.int64
    assert lengths.tolist() == [[ctx.store.length(s, l) for l in range(L)] for s in range(S)]
    assert indexed.tolist() == [[ctx.indexed(s, l) for l in range(L)] for s in range(S)]
    assert lengths[1, 0] == 63 and indexed[1, 0] == 60 and lengths[0, 1] == indexed[0, 1] == 62
    lengths[0, 0] = -5  # a copy: the store is unchanged
    assert ctx.store.length(0, 0) == 60


def test_index_stored_bad_input():
    ctx = make("roar", n=50)
    k, v, q = new_tokens(1, 2, seed=7)
    ctx.append(0, 1, 50, k[0], v[0])
    with pytest.raises(ValueError, match="unindexed tokens"):
        ctx.index_stored([0], [1], queries=q[:, :, :1])
    with pytest.raises(ValueError, match="distinct"):
        ctx.index_stored([0, 0], [1, 1])
    assert ctx.indexed(0, 1) == 50


def test_insert_many_bad_input_and_partial_failure():
    ctx = make("graph", n=50)
    k, v, q = new_tokens(2, 1, seed=5)
    with pytest.raises(ValueError, match="distinct"):
        ctx.insert_many([0, 0], [1, 1], [50, 50], k, v)
    with pytest.raises(ValueError, match="equally many"):
        ctx.insert_many([0, 1], [1], [50, 50], k, v)
    with pytest.raises(ValueError, match="keys"):
        ctx.insert_many([0, 1], [1, 1], [50, 50], k[:, :1], v[:, :1])
    with pytest.raises(ValueError, match="queries"):
        ctx.insert_many([0, 1], [1, 1], [50, 50], k, v, queries=q[:, :2])
    with pytest.raises(ValueError, match="gap"):
        ctx.insert_many([0, 1], [1, 1], [50, 52], k, v)
    assert ctx.store.length(0, 1) == 50  # rejected before anything was stored
    assert ctx.store.length(1, 1) == 50
    bad = k.copy()
    bad[1, 0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        ctx.insert_many([0, 1], [1, 1], [50, 50], bad, v)
    # The item before the failing one is stored and indexed; the failing one is not stored.
    assert ctx.store.length(0, 1) == 51 and ctx.indexed(0, 1) == 51
    assert ctx.store.length(1, 1) == 50 and ctx.indexed(1, 1) == 50


@pytest.mark.parametrize("kind", ["graph", "roar"])
def test_ef_insert(kind):
    """0 is ef_construction / L; a small list still links new keys findably."""
    same = hi.DEFAULT_PARAMS[kind]["ef_construction" if kind == "graph" else "L"]
    ctxs = [hi.HostContext(1, 1, HQ, HKV, D, kind=kind, index_params=p)
            for p in ({"ef_insert": 0}, {"ef_insert": same}, {"ef_insert": 4})]
    k, v, q = new_tokens(1, 200, seed=6)
    for ctx in ctxs:
        for i in range(0, 200, 10):  # decode-style: from empty, a few tokens at a time
            ctx.insert(0, 0, i, k[0, :, i:i + 10], v[0, :, i:i + 10], queries=q[0, :, i:i + 10])
    assert state(ctxs[0]) == state(ctxs[1])
    assert state(ctxs[0]) != state(ctxs[2])
    K = ctxs[2].store.keys(0, 0)
    targets = np.array([3, 77, 150, 199, 120, 40])
    qq = np.stack([K[h // G, t] * 4 for h, t in enumerate(targets)])[None]
    ids, _ = ctxs[2].search(0, qq, k=3, ef=64)
    np.testing.assert_array_equal(ids[0, :, 0], [np.argmax(K[h // G] @ qq[0, h]) for h in range(HQ)])
    with pytest.raises(ValueError, match="ef_insert"):
        hi.HostContext(1, 1, HQ, HKV, D, kind=kind, index_params={"ef_insert": -1})
    with pytest.raises(TypeError, match="ef_insert"):
        hi.HostContext(1, 1, HQ, HKV, D, kind="ivf", index_params={"ef_insert": 8})


@pytest.mark.parametrize("kind", ["graph", "roar"])
def test_a_calls_ef_overrides_the_index_ef_insert_for_that_call(kind):
    """insert / index_stored(ef=e) link new keys exactly as an index built with ef_insert=e
    does (decode's ef_insert option on a context built or loaded with another), and only
    for that call: the next call without ef uses the index's own again."""
    own = hi.DEFAULT_PARAMS[kind]["ef_insert"] or hi.DEFAULT_PARAMS[kind]["ef_construction"]
    small = 6
    assert small != own
    override, built_small, built_own = (hi.HostContext(1, 1, HQ, HKV, D, kind=kind, index_params=p)
                                        for p in ({}, {"ef_insert": small}, {}))
    k, v, q = new_tokens(1, 120, seed=11)
    for i in range(0, 60, 10):  # decode-style: a few tokens at a time, from empty
        override.insert(0, 0, i, k[0, :, i:i + 10], v[0, :, i:i + 10], queries=q[0, :, i:i + 10], ef=small)
        built_small.insert(0, 0, i, k[0, :, i:i + 10], v[0, :, i:i + 10], queries=q[0, :, i:i + 10])
        built_own.insert(0, 0, i, k[0, :, i:i + 10], v[0, :, i:i + 10], queries=q[0, :, i:i + 10])
    assert state(override) == state(built_small) != state(built_own)
    for ctx in (override, built_small):  # then the deferred path, without ef: each index's own
        ctx.append(0, 0, 60, k[0, :, 60:], v[0, :, 60:])
        ctx.index_stored([0], [0], queries=q[:, :, 60:])
        assert ctx.indexed(0, 0) == 120
    # Equal graphs before: they part only if `override` went back to its own list (a leaked
    # small list would keep them equal).
    assert state(override) != state(built_small)
    ctx = make(kind, n=80)
    k2, v2, q2 = new_tokens(1, 2, seed=12)
    ctx.append(0, 1, 80, k2[0], v2[0])
    for bad, error in ((0, ValueError), (-3, ValueError), (2.0, TypeError), (True, TypeError)):
        with pytest.raises(error, match="ef"):
            ctx.index_stored([0], [1], queries=q2, ef=bad)
        with pytest.raises(error, match="ef"):
            ctx.insert_many([1], [1], [80], k2, v2, queries=q2, ef=bad)
    assert ctx.indexed(0, 1) == 80 and ctx.store.length(1, 1) == 80  # refused before any work
    ctx.index_stored([0], [1], queries=q2, ef=small)
    assert ctx.indexed(0, 1) == 82


@pytest.mark.parametrize("kind", ["ivf", "graph", "roar"])
def test_a_build_sizes_its_nodes_for_the_reserved_room(kind):
    """A build over a store reserved for decode (KVStore.reserve) sizes its node arrays for that
    room: the inserts that fill it do not grow the index (a copy of its node arrays on the first
    decode step, ~0.6 s at SmolLM2 shapes, 128K), and without the reservation they do."""
    n, room = 300, 64
    sizes = {}
    for reserved in (True, False):
        ctx = hi.HostContext(1, 1, HQ, HKV, D, kind=kind)
        if reserved:
            ctx.store.reserve(0, 0, n + room)
        rng = np.random.default_rng(0)
        k = np.stack([clustered(n + room, D, seed=h) for h in range(HKV)])
        v = rng.standard_normal((HKV, n + room, D)).astype(np.float32)
        ctx.append(0, 0, 0, k[:, :n], v[:, :n])
        tq = rng.standard_normal((1, HQ, 40, D)).astype(np.float32) if kind == "roar" else None
        ctx.build_layer(0, train_queries=tq, threads=1)
        built = ctx.index(0, 0, 0).nbytes
        ctx.append(0, 0, n, k[:, n:], v[:, n:])
        ctx.index_stored([0], [0], queries=rng.standard_normal((1, HQ, room, D)).astype(np.float32), threads=1)
        assert len(ctx.index(0, 0, 0)) == n + room
        sizes[reserved] = (built, ctx.index(0, 0, 0).nbytes)
    assert sizes[True][0] == sizes[True][1]  # reserved: no growth
    assert sizes[False][1] > sizes[False][0]  # not reserved: the inserts grew it


@pytest.mark.parametrize("kind", ["graph", "roar"])
def test_reserve_sizes_built_indexes_for_the_room(kind):
    """HostContext.reserve after a build (as a loaded context's decode room is reserved) grows
    the node arrays then, not on the inserts that fill the room."""
    n, room = 300, 64
    ctx = make(kind, n=n + room, build=False)  # rows past n are appended later, as decode does
    ctx2 = hi.HostContext(1, 1, HQ, HKV, D, kind=kind)
    k, v = ctx.store.keys(0, 0), ctx.store.values(0, 0)
    ctx2.append(0, 0, 0, k[:, :n], v[:, :n])
    rng = np.random.default_rng(1)
    tq = rng.standard_normal((1, HQ, 40, D)).astype(np.float32) if kind == "roar" else None
    ctx2.build_layer(0, train_queries=tq, threads=1)
    built = ctx2.index(0, 0, 0).nbytes
    ctx2.reserve(0, 0, n + room)
    reserved = ctx2.index(0, 0, 0).nbytes
    assert reserved > built and ctx2.store.capacity(0, 0) >= n + room
    ctx2.append(0, 0, n, k[:, n:], v[:, n:])
    ctx2.index_stored([0], [0], queries=rng.standard_normal((1, HQ, room, D)).astype(np.float32), threads=1)
    assert len(ctx2.index(0, 0, 0)) == n + room and ctx2.index(0, 0, 0).nbytes == reserved
    with pytest.raises(ValueError, match="n="):
        ctx2.reserve(0, 0, -1)


# -- values of the wrong type, once read by int() or by size  ----------------------------


def test_ids_heads_seqs_and_buffers_of_the_wrong_type_are_refused():
    ctx = make(build=False)
    store = ctx.store
    with pytest.raises(TypeError, match="ids"):
        store.gather_rows(0, 0, 0, np.array([1.9]))  # read row 1
    with pytest.raises(TypeError, match="kv_heads"):
        store.gather_rows(0, 0, np.array([1.7]), np.array([1]))  # read head 1
    with pytest.raises(TypeError, match="ids"):
        store.gather_rows(0, 0, 0, np.array([True]))
    k, _ = store.gather_rows(0, 0, 0, [])  # an empty list is not a float array
    assert k.shape == (0, D)
    with pytest.raises(ValueError, match="out_k"):  # float32 rows landed in an int32 buffer as bit patterns
        store.gather_rows(0, 0, 0, np.array([1]), out_k=np.empty((1, D), np.int32),
                          out_v=np.empty((1, D), np.float32))
    with pytest.raises(TypeError, match="seqs"):
        ctx.search(0, queries(), k=3, seqs=[1.9, 0])  # searched sequence 1
    with pytest.raises(ValueError, match="names a sequence twice"):
        ctx.build_layer(0, seqs=[0, 0])
    with pytest.raises(ValueError, match="head=1.5"):
        ctx.index(0, 0, 1.5)


def test_bfloat16_rows_go_to_bfloat16_or_uint16_buffers_only():
    import ml_dtypes

    ctx = make(dtype="bfloat16", build=False)
    k16, _ = ctx.store.gather_rows(0, 0, 0, np.array([0, 1]))
    out = np.empty((2, D), ml_dtypes.bfloat16)
    ctx.store.gather_rows(0, 0, 0, np.array([0, 1]), out_k=out, out_v=np.empty((2, D), np.uint16))
    np.testing.assert_array_equal(out.view(np.uint16), k16)
    with pytest.raises(ValueError, match="out_k"):  # bfloat16 bits read as float16 values
        ctx.store.gather_rows(0, 0, 0, np.array([0]), out_k=np.empty((1, D), np.float16),
                              out_v=np.empty((1, D), np.uint16))


def test_key_neighbours_refuses_nan_and_takes_numpy_counts():
    keys = np.random.default_rng(0).standard_normal((6, 4)).astype(np.float32)
    np.testing.assert_array_equal(hi.key_neighbours(keys, np.int64(2)), hi.key_neighbours(keys, 2))
    keys[3, 1] = np.nan  # made key 0 every key's nearest
    with pytest.raises(ValueError, match="NaN"):
        hi.key_neighbours(keys, 2)
    with pytest.raises(TypeError, match="int64"):
        hi.key_neighbours(np.ones((6, 4), np.int64), 2)
