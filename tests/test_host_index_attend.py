"""Host partial attention (C) against NumPy, through HostContext."""

import ml_dtypes
import numpy as np
import pytest

import host_index as hi
from host_index.synthetic import clustered

S, L, HQ, HKV, D = 2, 2, 4, 2, 16
G = HQ // HKV


def fill(ctx, n, seed=0, insert=False):
    rng = np.random.default_rng(seed)
    for s in range(ctx.num_seqs):
        for l in range(ctx.num_layers):
            k = np.stack([clustered(n, D, seed=seed + 10 * s + h) for h in range(HKV)])
            v = rng.standard_normal((HKV, n, D)).astype(np.float32)
            if insert:
                ctx.insert(s, l, 0, k, v, queries=rng.standard_normal((HQ, n, D)).astype(np.float32))
            else:
                ctx.append(s, l, 0, k, v)


def reference(ctx, layer, q, ids, scale):
    """NumPy attention of q [B, Hq, D] over the given ids [B, Hq, k]."""
    B = q.shape[0]
    o = np.zeros((B, HQ, D), np.float64)
    lse = np.full((B, HQ), -np.inf)
    for b in range(B):
        K, V = ctx.store.keys(b, layer), ctx.store.values(b, layer)
        for h in range(HQ):
            sel = ids[b, h][ids[b, h] >= 0]
            if len(sel) == 0:
                continue
            s = scale * (K[h // G, sel].astype(np.float64) @ q[b, h])
            m = s.max()
            w = np.exp(s - m)
            o[b, h] = w @ V[h // G, sel] / w.sum()
            lse[b, h] = m + np.log(w.sum())
    return o, lse


@pytest.mark.parametrize("kind", ["flat", "ivf", "graph", "roar"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_attend_matches_numpy(kind, dtype):
    ctx = hi.HostContext(S, L, HQ, HKV, D, dtype=dtype, kind=kind)
    fill(ctx, 400)
    tq = np.random.default_rng(5).standard_normal((S, HQ, 50, D)).astype(np.float32)
    ctx.build_layer(1, train_queries=tq if kind == "roar" else None)
    q = clustered(S * HQ, D, seed=9, shift=0.3).reshape(S, HQ, D)
    o, lse, scanned, ids = ctx.attend(1, q, k=20, ef=64, return_ids=True)
    assert o.dtype == np.float32 and lse.dtype == np.float32 and ids.shape == (S, HQ, 20)
    ro, rlse = reference(ctx, 1, q, ids, D ** -0.5)
    tol = {"float32": 1e-5, "float16": 1e-5, "bfloat16": 1e-5}[dtype]
    np.testing.assert_allclose(o, ro, rtol=tol, atol=tol)
    np.testing.assert_allclose(lse, rlse, rtol=tol, atol=tol)
    assert (scanned > 0).all()
    # The retrieved set is the index's search result for that head.
    for b in range(S):
        for h in range(HQ):
            ix = ctx.index(b, 1, h if kind == "roar" else h // G)
            np.testing.assert_array_equal(ix.search(q[b, h:h + 1], 20, ef=64)[0][0], ids[b, h])


def test_flat_attend_is_exact_topk_and_gqa_mapping():
    ctx = hi.HostContext(1, 1, HQ, HKV, D, dtype="float32", kind="flat")
    fill(ctx, 300)
    ctx.build_layer(0)
    q = np.random.default_rng(1).standard_normal((1, HQ, D)).astype(np.float32)
    _, _, _, ids = ctx.attend(0, q, k=7, return_ids=True)
    K = ctx.store.keys(0, 0)
    for h in range(HQ):
        want = np.argsort(-(K[h // G] @ q[0, h]), kind="stable")[:7]
        np.testing.assert_array_equal(ids[0, h], want)


def test_full_k_equals_dense_attention():
    ctx = hi.HostContext(1, 1, HQ, HKV, D, dtype="float32", kind="flat")
    fill(ctx, 50)
    ctx.build_layer(0)
    q = np.random.default_rng(2).standard_normal((1, HQ, D)).astype(np.float32)
    o, lse, _ = ctx.attend(0, q, k=80, scale=0.3)
    K, V = ctx.store.keys(0, 0), ctx.store.values(0, 0)
    for h in range(HQ):
        s = 0.3 * K[h // G] @ q[0, h]
        w = np.exp(s - s.max())
        np.testing.assert_allclose(o[0, h], w @ V[h // G] / w.sum(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(lse[0, h], np.log(np.exp(s).sum()), rtol=1e-5)


@pytest.mark.parametrize("kind", ["flat", "ivf", "graph", "roar"])
def test_empty_context(kind):
    ctx = hi.HostContext(S, L, HQ, HKV, D, kind=kind)
    q = np.ones((S, HQ, D), np.float32)
    o, lse, scanned, ids = ctx.attend(0, q, k=5, return_ids=True)
    assert (o == 0).all() and np.isneginf(lse).all() and (ids == -1).all() and (scanned == 0).all()
    o, lse, _ = ctx.attend(0, q, k=0)  # k = 0 is an empty set too
    assert (o == 0).all() and np.isneginf(lse).all()


@pytest.mark.parametrize("kind", ["flat", "ivf", "graph", "roar"])
def test_insert_then_attend_finds_new_tokens(kind):
    ctx = hi.HostContext(1, 1, HQ, HKV, D, dtype="float16", kind=kind)
    fill(ctx, 300, insert=True)  # decode-style inserts from empty
    assert ctx.indexed(0, 0) == 300
    K = ctx.store.keys(0, 0)
    # Queries aimed at early and late tokens retrieve their exact top-1.
    targets = np.array([5, 100, 299, 250])
    q = np.stack([K[h // G, t] * 4 for h, t in enumerate(targets)])[None]
    _, _, _, ids = ctx.attend(0, q, k=3, ef=64, return_ids=True)
    truth = [np.argmax(K[h // G] @ q[0, h]) for h in range(HQ)]
    np.testing.assert_array_equal(ids[0, :, 0], truth)


def test_insert_repeat_and_append_then_insert():
    ctx = hi.HostContext(1, 1, HQ, HKV, D, kind="roar")
    rng = np.random.default_rng(0)
    k = np.stack([clustered(120, D, seed=h) for h in range(HKV)])
    v = rng.standard_normal((HKV, 120, D)).astype(np.float32)
    q = rng.standard_normal((HQ, 120, D)).astype(np.float32)
    ctx.append(0, 0, 0, k[:, :80], v[:, :80])  # stored, not indexed
    assert ctx.insert(0, 0, 80, k[:, 80:], v[:, 80:], queries=q[:, 80:]) == 40
    assert ctx.indexed(0, 0) == 120
    assert ctx.insert(0, 0, 80, k[:, 80:], v[:, 80:], queries=q[:, 80:]) == 0  # repeat: no-op
    assert ctx.indexed(0, 0) == 120
    with pytest.raises(ValueError):
        ctx.insert(0, 0, 120, k[:, :5], v[:, :5], queries=q[:2, :5])  # wrong q heads


def test_attend_bad_input():
    ctx = hi.HostContext(S, L, HQ, HKV, D, kind="flat")
    q = np.ones((S, HQ, D), np.float32)
    with pytest.raises(ValueError):
        ctx.attend(0, q[:, :3], k=3)
    with pytest.raises(ValueError):
        ctx.attend(0, q, k=-1)
    with pytest.raises(ValueError):
        ctx.attend(5, q, k=3)
    with pytest.raises(ValueError):
        ctx.attend(0, q, k=3, seqs=[0, 7])
    q2 = q.copy()
    q2[0, 0, 0] = np.inf
    with pytest.raises(ValueError):
        ctx.attend(0, q2, k=3)
    with pytest.raises(TypeError):
        ctx.attend(0, q.astype(np.float64), k=3)
    with pytest.raises(ValueError):
        hi.HostContext(1, 1, 3, 2, D)
    with pytest.raises(ValueError):
        ctx.build_layer(0, train_queries=np.zeros((S, HQ, 4, D), np.float32))  # not roar


def test_bfloat16_queries_accepted():
    ctx = hi.HostContext(1, 1, HQ, HKV, D, kind="flat")
    fill(ctx, 60)
    ctx.build_layer(0)
    q = np.random.default_rng(3).standard_normal((1, HQ, D)).astype(np.float32)
    a = ctx.attend(0, q.astype(ml_dtypes.bfloat16), k=10)[0]
    b = ctx.attend(0, q.astype(ml_dtypes.bfloat16).astype(np.float32), k=10)[0]
    np.testing.assert_array_equal(a, b)


def test_concurrent_attend_and_insert():
    """Attention in one thread while another inserts into the same layer."""
    import threading
    ctx = hi.HostContext(1, 1, HQ, HKV, D, kind="graph")
    fill(ctx, 200, insert=True)
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, HQ, D)).astype(np.float32)
    errors = []

    def reader():
        try:
            for _ in range(200):
                o, lse, _ = ctx.attend(0, q, k=10, ef=32)
                assert np.isfinite(o).all() and np.isfinite(lse).all()
        except Exception as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    t = threading.Thread(target=reader)
    t.start()
    for i in range(200, 600):
        k = np.stack([clustered(1, D, seed=i * 7 + h) for h in range(HKV)])
        ctx.insert(0, 0, i, k, rng.standard_normal((HKV, 1, D)).astype(np.float32))
    t.join()
    assert not errors, errors
    assert ctx.indexed(0, 0) == 600
