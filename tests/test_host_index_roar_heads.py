"""HostContext(kind="roar", roar_heads="kv"): one roar index per KV head, trained on its group's queries."""

import numpy as np
import pytest

import host_index as hi
from host_index import _persist
from host_index.synthetic import clustered
from host_index.synthetic import exact_topk

S, L, HQ, HKV, D = 2, 1, 6, 2, 16
G = HQ // HKV
N, M = 1500, 64  # stored tokens per (seq, layer), training queries per query head


def keys_values(seed=0, n=N):
    rng = np.random.default_rng(seed)
    k = np.stack([clustered(n, D, seed=seed * 17 + h) for h in range(HKV)])  # [Hkv, n, D]
    return k, rng.standard_normal((HKV, n, D)).astype(np.float32)


def train_queries(seed=1, m=M):
    # [S, Hq, M, D], out of distribution as decode queries are (other mean and spread)
    return np.stack([np.stack([clustered(m, D, seed=seed * 101 + 7 * s + h, shift=0.4, spread=1.3)
                               for h in range(HQ)]) for s in range(S)])


def make(roar_heads="kv", *, dtype="float32", with_topk=False, **params):
    ctx = hi.HostContext(S, L, HQ, HKV, D, dtype=dtype, kind="roar", roar_heads=roar_heads,
                         index_params=params or None)
    for s in range(S):
        ctx.append(s, 0, 0, *keys_values(seed=s))
    tq = train_queries()
    tk = None
    if with_topk:
        tk = np.stack([np.stack([exact_topk(tq[s, h], ctx.store.keys(s, 0)[h // G], 100)
                                 for h in range(HQ)]) for s in range(S)])
    ctx.build_layer(0, train_queries=tq, train_topk=tk, threads=1)  # one thread: deterministic
    return ctx, tq, tk


def decode_queries(seed=9, rows=S):
    return clustered(rows * HQ, D, seed=seed, shift=0.4, spread=1.3).reshape(rows, HQ, D)


def interleave(a):
    """[G, M, X] -> [G*M, X], row m*G + j = a[j, m] (the documented training-row order)."""
    return np.ascontiguousarray(np.asarray(a).transpose(1, 0, 2)).reshape(-1, a.shape[2])


@pytest.mark.parametrize("with_topk", [False, True])
def test_kv_mode_equals_direct_build_over_group_queries(with_topk):
    ctx, tq, tk = make(with_topk=with_topk)
    assert ctx.roar_heads == "kv" and ctx.index_heads == HKV and not ctx.per_q_head
    q = decode_queries()
    ids, scanned = ctx.search(0, q, k=20, ef=48)
    for s in range(S):
        for g in range(HKV):
            heads = slice(g * G, (g + 1) * G)
            train = {"train_queries": interleave(tq[s, heads])}
            if with_topk:
                train["train_topk"] = interleave(tk[s, heads])
            direct = hi.build_index(ctx.store.keys(s, 0)[g], kind="roar", threads=1, **train)
            got = ctx.index(s, 0, g)._c.export()
            for part, want in direct._c.export().items():
                np.testing.assert_array_equal(np.asarray(got[part]), np.asarray(want), err_msg=part)
            for h in range(g * G, (g + 1) * G):  # query head h searches index h // G
                want_ids, _, want_scanned = direct.search(q[s, h][None], 20, ef=48)
                np.testing.assert_array_equal(ids[s, h], want_ids[0])
                assert scanned[s, h] == want_scanned[0]


@pytest.mark.parametrize("roar_heads", ["query", "kv"])
def test_search_and_attend_match_flat(roar_heads):
    ctx, _, _ = make(roar_heads, dtype="float16")
    flat = hi.HostContext(S, L, HQ, HKV, D, dtype="float16", kind="flat")
    for s in range(S):
        flat.append(s, 0, 0, *keys_values(seed=s))
    flat.build_layer(0)
    q = decode_queries(seed=11)
    k = 20
    truth, _ = flat.search(0, q, k=k)
    o, lse, scanned, ids = ctx.attend(0, q, k=k, ef=64, return_ids=True)
    recall = np.mean([len(set(a.tolist()) & set(b.tolist())) / k
                      for a, b in zip(ids.reshape(-1, k), truth.reshape(-1, k))])
    assert recall >= 0.9, recall
    assert scanned.mean() < 0.6 * N  # not a disguised full scan
    # attend's output is attention over the ids its search returned (index h // G in kv mode) ...
    np.testing.assert_array_equal(ctx.search(0, q, k=k, ef=64)[0], ids)
    o2, lse2 = ctx.attend_ids(0, q, ids)
    np.testing.assert_allclose(o2, o, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse2, lse, rtol=1e-6, atol=1e-6)
    # ... and close to exact top-k attention.
    fo, flse, _ = flat.attend(0, q, k=k)
    assert np.abs(lse - flse).mean() < 0.02
    assert np.abs(o - fo).mean() < 0.05 * np.abs(fo).mean()


def test_nbytes_and_index_count():
    q_ctx, _, _ = make("query")
    kv_ctx, _, _ = make("kv")
    assert len(q_ctx._ix[0][0]) == HQ and len(kv_ctx._ix[0][0]) == HKV
    store = kv_ctx.store.nbytes
    assert q_ctx.store.nbytes == store
    q_ix, kv_ix = q_ctx.nbytes - store, kv_ctx.nbytes - store
    assert 0 < kv_ix and G * kv_ix == pytest.approx(q_ix, rel=0.05)  # hub lists may differ a little


def test_insert_links_through_group_mean_query():
    ctx, tq, _ = make()
    new_k, new_v = keys_values(seed=5, n=6)
    new_k *= 3.0  # large keys: each tops the scores of queries pointing at it
    new_q = np.random.default_rng(3).standard_normal((HQ, 6, D)).astype(np.float32)
    ctx.insert(0, 0, N, new_k, new_v, queries=new_q)
    assert ctx.indexed(0, 0) == N + 6
    # Exactly a standalone index built the same way, extended with the group's mean query.
    keys = ctx.store.keys(0, 0)
    for g in range(HKV):
        direct = hi.build_index(keys[g, :N], kind="roar", threads=1,
                                train_queries=interleave(tq[0, g * G:(g + 1) * G]))
        direct.insert(keys[g, N:], queries=new_q[g * G:(g + 1) * G].mean(0))
        got = ctx.index(0, 0, g)._c.export()
        for part, want in direct._c.export().items():
            np.testing.assert_array_equal(np.asarray(got[part]), np.asarray(want), err_msg=part)
    # The new keys are found: query head h asking along new key i of its KV head gets it first.
    q = np.stack([new_k[h // G, h % 6] for h in range(HQ)])[None]  # [1, Hq, D]
    ids, _ = ctx.search(0, q, k=5, ef=48, seqs=[0])
    truth = [int(np.argmax(keys[h // G] @ q[0, h])) for h in range(HQ)]
    assert truth == [N + h % 6 for h in range(HQ)]
    assert [int(ids[0, h, 0]) for h in range(HQ)] == truth


def test_index_stored_equals_insert_many():
    a, _, _ = make()
    b, _, _ = make()
    new_k, new_v = keys_values(seed=6, n=4)
    new_q = np.random.default_rng(4).standard_normal((1, HQ, 4, D)).astype(np.float32)
    a.insert_many([1], [0], [N], new_k[None], new_v[None], queries=new_q)
    b.append(1, 0, N, new_k, new_v)
    assert b.indexed(1, 0) == N
    b.index_stored([1], [0], queries=new_q)
    for ia, ib in zip(a._ix[1][0], b._ix[1][0]):
        for part, want in ia._c.export().items():
            np.testing.assert_array_equal(np.asarray(ib._c.export()[part]), np.asarray(want))


def test_save_load_round_trip_and_old_files(tmp_path):
    q = decode_queries(seed=13)
    for roar_heads in ("kv", "query"):
        ctx, _, _ = make(roar_heads)
        ctx.insert(0, 0, N, *keys_values(seed=7, n=3),
                   queries=np.ones((HQ, 3, D), np.float32))
        path = tmp_path / f"{roar_heads}.kvjx"
        ctx.save(path, meta={"model": "m"})
        back = hi.HostContext.load(path)
        assert back.roar_heads == roar_heads and back.index_heads == ctx.index_heads
        for a, b in zip(ctx.search(0, q, k=10, ef=32), back.search(0, q, k=10, ef=32)):
            np.testing.assert_array_equal(a, b)
    # A file written before roar_heads existed (no such header entry) loads as "query".
    with _persist.Reader(path) as rd:
        head = dict(rd.meta)
        blobs = [(name, [rd.read(name)]) for name in rd.names()]
    head["context"] = {k: v for k, v in head["context"].items() if k != "roar_heads"}
    old = tmp_path / "old.kvjx"
    _persist.write(old, head, iter(blobs))
    back = hi.HostContext.load(old)
    assert back.roar_heads == "query" and back.index_heads == HQ
    for a, b in zip(ctx.search(0, q, k=10, ef=32), back.search(0, q, k=10, ef=32)):
        np.testing.assert_array_equal(a, b)
    # A bad value in the file is a corrupt file, not a crash.
    head["context"]["roar_heads"] = "group"
    _persist.write(old, head, iter(blobs))
    with pytest.raises(hi.CorruptFileError, match="roar_heads"):
        hi.HostContext.load(old)


def test_bad_input():
    for bad in ("x", "KV", None, 2):
        with pytest.raises(ValueError, match="roar_heads"):
            hi.HostContext(1, 1, HQ, HKV, D, kind="roar", roar_heads=bad)
    for kind in ("flat", "ivf", "graph"):
        with pytest.raises(ValueError, match="roar_heads='kv' applies to kind='roar' only"):
            hi.HostContext(1, 1, HQ, HKV, D, kind=kind, roar_heads="kv")
        assert hi.HostContext(1, 1, HQ, HKV, D, kind=kind, roar_heads="query").index_heads == HKV
    ctx = hi.HostContext(1, 1, HQ, HKV, D, kind="roar", roar_heads="kv")
    k, v = keys_values(n=150)
    ctx.append(0, 0, 0, k, v)
    tq = np.ones((1, HQ, 8, D), np.float32)
    with pytest.raises(ValueError, match="train_queries"):  # per KV head: still per query head
        ctx.build_layer(0, train_queries=tq[:, :HKV])
    with pytest.raises(ValueError, match="train_topk"):
        ctx.build_layer(0, train_queries=tq, train_topk=np.zeros((1, HKV, 8, 10), np.int64))
    ctx.build_layer(0, train_queries=tq)
    with pytest.raises(ValueError, match="queries"):  # inserts take every query head's query
        ctx.insert(0, 0, 150, k[:, :2], v[:, :2], queries=np.ones((HKV, 2, D), np.float32))
    with pytest.raises(ValueError, match="queries"):
        ctx.insert(0, 0, 150, k[:, :2], v[:, :2], queries=np.full((HQ, 2, D), np.nan, np.float32))
    assert ctx.indexed(0, 0) == 150
    with pytest.raises(ValueError, match="head"):
        ctx.index(0, 0, HKV)  # index heads are KV heads
