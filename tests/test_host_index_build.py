"""HostContext.build_layer: builds queued with wait=False, and its checks."""

import numpy as np
import pytest

import host_index as hi
from host_index._context import group_rows
from host_index.synthetic import clustered

S, L, HQ, HKV, D, N, M = 2, 3, 6, 2, 16, 300, 40
KINDS = ["flat", "ivf", "graph", "roar"]


def filled(kind, roar_heads="query"):
    """A context with N tokens in every (seq, layer), nothing indexed, and roar's training
    queries [S, Hq, M, D] per layer (None for the other kinds)."""
    ctx = hi.HostContext(S, L, HQ, HKV, D, dtype="float32", kind=kind, roar_heads=roar_heads)
    rng = np.random.default_rng(0)
    for s in range(S):
        for layer in range(L):
            k = np.stack([clustered(N, D, seed=10 * s + 3 * layer + h) for h in range(HKV)])
            ctx.append(s, layer, 0, k, rng.standard_normal((HKV, N, D)).astype(np.float32))
    train = [rng.standard_normal((S, HQ, M, D)).astype(np.float32) if kind == "roar" else None for _ in range(L)]
    return ctx, train


def exported(ctx):
    """Every index's structure, as (seq, layer, head) -> its exported arrays."""
    out = {}
    for s in range(S):
        for layer in range(L):
            for h in range(ctx.index_heads):
                st = ctx.index(s, layer, h)._c.export()
                out[s, layer, h] = {k: np.asarray(v) if not np.isscalar(v) else v for k, v in st.items()}
    return out


def assert_same_indexes(a, b):
    assert a.keys() == b.keys()
    for key in a:
        for part in a[key]:
            np.testing.assert_array_equal(a[key][part], b[key][part], err_msg=f"{key} {part}")


@pytest.mark.parametrize("kind,roar_heads", [(k, "query") for k in KINDS] + [("roar", "kv")])
def test_queued_builds_equal_one_thread_builds(kind, roar_heads):
    reference, train = filled(kind, roar_heads)
    for layer in range(L):  # one head after another, one thread: the deterministic reference
        for s in range(S):
            for h in range(reference.index_heads):
                tq = None if train[layer] is None else group_rows(
                    train[layer][s], h, 1 if reference.per_q_head else reference.group)
                reference.index(s, layer, h).build(N, train_queries=tq, threads=1)
    waited, _ = filled(kind, roar_heads)
    for layer in range(L):
        waited.build_layer(layer, train_queries=train[layer], threads=1)
    queued, _ = filled(kind, roar_heads)
    for layer in range(L):
        queued.build_layer(layer, train_queries=train[layer], wait=False)
    queued.wait_builds()
    want = exported(reference)
    assert_same_indexes(want, exported(waited))
    assert_same_indexes(want, exported(queued))
    q = clustered(S * HQ, D, seed=5).reshape(S, HQ, D)
    for layer in range(L):
        ids = reference.search(layer, q, k=10)[0]
        np.testing.assert_array_equal(queued.search(layer, q, k=10)[0], ids)


def test_bad_input_raises_before_anything_is_queued():
    ctx, train = filled("roar")
    bad = np.full((S, HQ, M, 5), N, np.int64)  # ids past the stored keys
    with pytest.raises(ValueError, match="train_topk ids out of range"):
        ctx.build_layer(0, train_queries=train[0], train_topk=bad, wait=False)
    wraps = np.full((S, HQ, M, 5), 2**32, np.int64)  # 0 once cast to int32: checked before the cast
    with pytest.raises(ValueError, match="train_topk ids out of range"):
        ctx.build_layer(0, train_queries=train[0], train_topk=wraps, wait=False)
    with pytest.raises(ValueError, match="threads"):
        ctx.build_layer(0, train_queries=train[0], threads=0)
    for bad_value in (np.nan, np.inf, -np.inf):  # checked by reading: min and max, no copy
        bad_queries = np.array(train[0])
        bad_queries[S - 1, HQ - 1, M - 1, 0] = bad_value
        with pytest.raises(ValueError, match="train_queries: contains NaN or inf"):
            ctx.build_layer(0, train_queries=bad_queries, wait=False)
    with pytest.raises(ValueError, match="train_topk has"):  # rows that do not pair up
        ctx.build_layer(0, train_queries=train[0], train_topk=np.zeros((S, HQ, M - 1, 5), np.int32), wait=False)
    assert ctx._builds == [] and ctx._builder is None
    ctx.wait_builds()  # nothing queued: a no-op
    assert all(ctx.indexed(s, 0) == 0 for s in range(S))


def test_a_failed_queued_build_raises_at_wait_builds(monkeypatch):
    ctx, _ = filled("flat")
    index = ctx.index(1, 2, 0)

    def failing_build(n, **_):
        def run(threads=None):
            raise MemoryError(f"no room for {n} keys")
        return run

    monkeypatch.setattr(index, "prepare_build", failing_build)
    for layer in range(L):
        ctx.build_layer(layer, wait=False)
    with pytest.raises(MemoryError, match="no room for 300 keys"):
        ctx.wait_builds()
    assert ctx.indexed(0, 2) == N  # the other builds ran to the end
    assert ctx._builder is None


def test_save_waits_for_queued_builds(tmp_path):
    ctx, train = filled("roar")
    for layer in range(L):
        ctx.build_layer(layer, train_queries=train[layer], wait=False)
    ctx.save(tmp_path / "ctx")
    loaded = hi.HostContext.load(tmp_path / "ctx")
    assert ctx._builds == []
    assert_same_indexes(exported(ctx), exported(loaded))


# -- connect_candidates: the connectivity pass links through given neighbours ---------------


def roar_data(n=2000, d=16, m=200, seed=0):
    keys = clustered(n, d, seed=seed)
    train = clustered(m, d, seed=seed + 1, shift=0.3)
    queries = clustered(64, d, seed=seed + 2, shift=0.3)
    return keys, train, queries


def recall_at(ix, keys, queries, k=10, ef=64):
    truth = np.argsort(-(queries @ keys.T), axis=1)[:, :k]
    ids, _, scanned = ix.search(queries, k, ef=ef)
    return np.mean([len(set(a) & set(b)) / k for a, b in zip(ids, truth)]), scanned.mean()


def test_roar_with_nearest_key_candidates_skips_the_search_and_keeps_recall():
    keys, train, queries = roar_data()
    searched = hi.build_index(keys, kind="roar", train_queries=train, threads=1)
    linked = hi.build_index(keys, kind="roar", train_queries=train, threads=1,
                            connect_candidates=hi.key_neighbours(keys, 32))
    # the connectivity pass computes 32 distances a key instead of a graph search per key
    assert linked.stats()["dist_build"] < 0.5 * searched.stats()["dist_build"]
    # On these few-cluster vectors the kNN-linked graph needs a wider beam than the searched one
    # (0.94 vs 0.99 at ef 64); on real SmolLM2 keys the two match (host_index/NOTES_roar.md).
    r_searched, scan_searched = recall_at(searched, keys, queries, ef=128)
    r_linked, scan_linked = recall_at(linked, keys, queries, ef=128)
    assert r_linked >= 0.99 and r_searched >= 0.99
    assert scan_linked <= 1.1 * scan_searched


def test_useless_candidates_still_leave_every_key_reachable():
    keys, train, queries = roar_data(n=600)
    none = np.full((600, 4), -1)  # no candidate at all: projection links and the repair pass only
    ix = hi.build_index(keys, kind="roar", train_queries=train, threads=1, connect_candidates=none)
    ids, _, _ = ix.search(keys[:50], 1, ef=600)  # a search wide enough to visit every reachable key
    np.testing.assert_array_equal(ids[:, 0], np.argmax(keys[:50] @ keys.T, axis=1))


def test_build_layer_hands_each_index_its_kv_heads_candidates():
    ctx, train = filled("roar")
    cand = np.stack([np.stack([hi.key_neighbours(ctx.store.keys(s, 0)[g], 8) for g in range(HKV)])
                     for s in range(S)])  # [S, Hkv, N, 8]
    ctx.build_layer(0, train_queries=train[0], connect_candidates=cand, threads=1)
    reference, _ = filled("roar")
    for s in range(S):
        for h in range(HQ):
            reference.index(s, 0, h).build(N, train_queries=train[0][s, h], connect_candidates=cand[s, h // (HQ // HKV)],
                                           threads=1)
    for s in range(S):
        for h in range(HQ):
            a, b = ctx.index(s, 0, h)._c.export(), reference.index(s, 0, h)._c.export()
            np.testing.assert_array_equal(np.asarray(a["adj"]), np.asarray(b["adj"]))


@pytest.mark.parametrize("cand,match", [
    (np.zeros((N, 4), np.int64), "must start with"),  # not [S, Hkv, N, C]
    (np.zeros((S, HQ, N, 4), np.int64), "must start with"),  # query heads, not KV heads
    (np.full((S, HKV, N, 4), N), "out of range"),
    (np.full((S, HKV, N, 4), 2**32 + 1, np.int64), "out of range"),  # would wrap to 1 as int32
    (np.zeros((S, HKV, N - 1, 4), np.int64), "must be"),
    (np.zeros((S, HKV, N, 4), np.float32), "not an integer")])
def test_bad_connect_candidates(cand, match):
    ctx, train = filled("roar")
    with pytest.raises((ValueError, TypeError), match=match):
        ctx.build_layer(0, train_queries=train[0], connect_candidates=cand, wait=False)
    assert ctx._builds == []


def test_connect_candidates_only_for_roar_and_key_neighbours_checks():
    ctx, _ = filled("graph")
    with pytest.raises(ValueError, match="does not apply"):
        ctx.build_layer(0, connect_candidates=np.zeros((S, HKV, N, 4), np.int64))
    with pytest.raises(ValueError, match="count=0"):
        hi.key_neighbours(np.zeros((5, 4), np.float32), 0)
    with pytest.raises(ValueError, match=r"\[N, D\]"):
        hi.key_neighbours(np.zeros((2, 5, 4), np.float32), 3)


def adjacency(ix):
    """{node: its out-links} of a graph index."""
    st = ix._c.export()
    adj = np.frombuffer(st["adj"], np.int32).reshape(st["n"], st["R"])
    deg = np.frombuffer(st["deg"], np.int32)
    return {u: adj[u, :deg[u]].tolist() for u in range(st["n"])}


def test_roar_insert_into_a_full_list_swaps_out_its_farthest_link_only():
    """A decode-time roar insert links the new key from its neighbours; a neighbour whose list is
    full keeps it full and keeps every other link (its co-occurrence links among them), giving up
    only its link farthest from it (L2), and only to a key closer than that link, except the new
    key's nearest neighbour (its first out-link), which always links it."""
    keys, train, _ = roar_data(n=1000)
    new = clustered(40, 16, seed=9)
    ix = hi.build_index(keys, kind="roar", train_queries=train, threads=1)
    R = ix._c.export()["R"]
    swaps = 0
    for i in range(len(new)):
        before = adjacency(ix)
        x = len(keys) + i
        ix.insert(new[i:i + 1], queries=new[i:i + 1] * 2, threads=1)
        after = adjacency(ix)
        every = np.concatenate([keys, new[:i + 1]])
        for u in before:
            if before[u] == after[u]:
                continue
            assert x in after[u] and x not in before[u]
            if len(before[u]) < R:  # room left: appended
                assert after[u] == before[u] + [x]
                continue
            swaps += 1
            out = set(before[u]) - set(after[u])
            assert len(after[u]) == R and len(out) == 1
            far = np.linalg.norm(every[before[u]] - every[u], axis=1)
            gone = before[u].index(out.pop())
            assert far[gone] == far.max()
            assert np.linalg.norm(every[x] - every[u]) < far[gone] or u == after[x][0]
        linked_from = [u for u in after if x in after[u]]
        assert after[x][0] in linked_from  # every new key has an in-link, from its nearest neighbour
    assert swaps > 0  # the build filled lists: the swap path ran


def test_roar_insert_links_a_key_of_large_norm():
    """A key of large norm is far (L2) from every neighbour, so it is closer than none of their
    links; it tops the inner-product search along its own direction, and the search finds it (with
    the swap unforced, a key of norm x3 in tests/test_host_index_roar_heads.py had no in-link)."""
    keys, train, _ = roar_data(n=1000)
    ix = hi.build_index(keys, kind="roar", train_queries=train, threads=1)
    big = keys[:8] * 4.0
    ix.insert(big, queries=big, threads=1)
    truth = np.argmax(big @ np.concatenate([keys, big]).T, axis=1)
    assert (truth >= 1000).all()  # each query's best key is a new one
    ids, _, _ = ix.search(big, 1, ef=100)  # kvjax's default search list (top-100)
    np.testing.assert_array_equal(ids[:, 0], truth)


def test_extend_refuses_queries_of_another_dtype_or_count():
    """C checks only the byte count of an insert's queries: float64 rows would pass as twice as
    many float32 values."""
    rng = np.random.default_rng(0)
    keys = clustered(120, 16, seed=3)
    ix = hi.build_index(keys[:100], kind="roar", train_queries=rng.standard_normal((40, 16)).astype(np.float32),
                        n_q=10, threads=1)
    ix._keys.append(keys[100:110], hi._dtypes.CODES["float32"])  # the keys an extend indexes
    with pytest.raises(TypeError, match="float64"):
        ix.extend(110, queries=rng.standard_normal((5, 16)))  # float64, 5 x 16 x 8 bytes = 10 float32 rows
    with pytest.raises(ValueError, match="rows"):
        ix.extend(110, queries=rng.standard_normal((4, 16)).astype(np.float32))
    ix.extend(110, queries=rng.standard_normal((10, 16)).astype(np.float32))
    assert len(ix) == 110
