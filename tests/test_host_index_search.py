"""Indexes against the exact flat twin: recall, scan counts, inserts, edge cases."""

import numpy as np
import pytest

import host_index as hi
from host_index.synthetic import exact_topk, hub_seeds, keys_queries, recall

N, D, Q, K = 3000, 32, 64, 10


@pytest.fixture(scope="module")
def data():
    keys, queries = keys_queries(N, D, Q + 400, seed=3)
    return keys, queries[:Q], queries[Q:]  # keys, test queries, training queries


def test_flat_is_exact(data):
    keys, q, _ = data
    ids, scores, scanned = hi.build_index(keys).search(q, K)
    np.testing.assert_array_equal(ids, exact_topk(q, keys, K))
    np.testing.assert_allclose(scores, np.take_along_axis(q @ keys.T, ids, 1), rtol=1e-5, atol=1e-4)
    assert (scanned == N).all()
    assert (np.diff(scores, axis=1) <= 0).all()


# (kind, params, ef, minimum recall@10, maximum mean scanned fraction)
CASES = [
    ("ivf", {"nlist": 64}, 16, 0.90, 0.45),
    ("graph", {"metric": "l2"}, 64, 0.95, 0.35),
    ("graph", {"metric": "ip"}, 64, 0.90, 0.50),
    ("roar", {}, 64, 0.95, 0.35),
]


@pytest.mark.parametrize("kind,params,ef,min_recall,max_scan", CASES)
def test_recall_against_flat(data, kind, params, ef, min_recall, max_scan):
    keys, q, tq = data
    train = {"train_queries": tq} if kind == "roar" else {}
    ix = hi.build_index(keys, kind=kind, **train, **params)
    assert len(ix) == N
    ids, scores, scanned = ix.search(q, K, ef=ef)
    truth = exact_topk(q, keys, K)
    r = recall(ids, truth)
    frac = scanned.mean() / N
    assert r >= min_recall, (kind, params, r, frac)
    assert frac <= max_scan, (kind, params, r, frac)
    # Returned scores are exact inner products, best first.
    np.testing.assert_allclose(scores, np.take_along_axis(q @ keys.T, ids, 1), rtol=1e-5, atol=1e-4)
    # More effort never hurts much and scans more.
    ids2, _, scanned2 = ix.search(q, K, ef=4 * ef)
    assert recall(ids2, truth) >= r - 0.02
    assert scanned2.mean() >= scanned.mean()


def test_roar_with_device_topk_matches_computed(data):
    keys, q, tq = data
    topk = exact_topk(tq, keys, 100)
    a = hi.build_index(keys, kind="roar", train_topk=topk, threads=1)
    b = hi.build_index(keys, kind="roar", train_queries=tq, threads=1)
    ia, _, _ = a.search(q, K, ef=64)
    ib, _, _ = b.search(q, K, ef=64)
    np.testing.assert_array_equal(ia, ib)


def test_ivf_scanned_counts_centroids(data):
    keys, q, _ = data
    ix = hi.build_index(keys, kind="ivf", nlist=50)
    _, _, scanned = ix.search(q, K, ef=50)  # every list: all keys + all centroids
    assert (scanned == N + 50).all()


@pytest.mark.parametrize("kind", ["flat", "ivf", "graph", "roar"])
def test_inserted_keys_are_found(data, kind):
    keys, q, tq = data
    train = {"train_queries": tq} if kind == "roar" else {}
    ix = hi.build_index(keys[:2000], kind=kind, **train)
    new = keys[2000:]
    ix.insert(new, queries=q[np.arange(len(new)) % Q] if kind == "roar" else None)
    assert len(ix) == N
    # Each inserted key, used as a query scaled up, finds itself first.
    probe = new[:200] * 3.0
    ids, _, _ = ix.search(probe, 5, ef=128)
    truth = exact_topk(probe, keys, 1)[:, 0]
    assert np.mean(ids[:, 0] == truth) >= 0.95
    assert recall(ix.search(q, K, ef=128)[0], exact_topk(q, keys, K)) >= 0.9


@pytest.mark.parametrize("kind", ["graph", "roar", "ivf"])
def test_build_deterministic_with_one_thread(data, kind):
    keys, q, tq = data
    train = {"train_queries": tq[:200]} if kind == "roar" else {}
    runs = [hi.build_index(keys[:1500], kind=kind, seed=7, threads=1, **train) for _ in range(2)]
    a, b = (r.search(q, K, ef=32) for r in runs)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    sa, sb = (r._c.export() for r in runs)
    assert sa == sb


def test_multithreaded_build_recall_stable(data):
    keys, q, _ = data
    truth = exact_topk(q, keys, K)
    rs = [recall(hi.build_index(keys, kind="graph", threads=2).search(q, K, ef=64)[0], truth)
          for _ in range(2)]
    assert abs(rs[0] - rs[1]) < 0.05


@pytest.mark.parametrize("kind", ["flat", "ivf", "graph", "roar"])
def test_k_larger_than_index_pads(kind):
    keys, q = keys_queries(20, 16, 3)
    train = {"train_queries": q} if kind == "roar" else {}
    ids, scores, _ = hi.build_index(keys, kind=kind, **train).search(q, 30, ef=64)
    assert ids.shape == (3, 30)
    assert (ids[:, 20:] == -1).all() and np.isneginf(scores[:, 20:]).all()
    for row in ids:
        assert sorted(row[:20]) == list(range(20))


@pytest.mark.parametrize("kind", ["flat", "ivf", "graph", "roar"])
def test_empty_index(kind):
    ix = hi.build_index(np.zeros((0, 16), np.float32), kind=kind)
    ids, scores, scanned = ix.search(np.ones((2, 16), np.float32), 4)
    assert (ids == -1).all() and np.isneginf(scores).all() and (scanned == 0).all()
    ix.insert(np.eye(16, dtype=np.float32)[:3], queries=np.ones((3, 16), np.float32))
    ids, _, _ = ix.search(np.eye(16, dtype=np.float32)[:3], 1)
    np.testing.assert_array_equal(ids[:, 0], [0, 1, 2])


def test_k_zero():
    keys, q = keys_queries(50, 16, 2)
    ids, scores, scanned = hi.build_index(keys).search(q, 0)
    assert ids.shape == (2, 0) and scores.shape == (2, 0)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_keys(data, dtype):
    import ml_dtypes
    keys, q, _ = data
    np_dt = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    kh = keys.astype(np_dt)
    ids, scores, _ = hi.build_index(kh, kind="graph").search(q, K, ef=64)
    truth = exact_topk(q, kh.astype(np.float32), K)
    assert recall(ids, truth) >= 0.95
    np.testing.assert_allclose(scores, np.take_along_axis(q @ kh.astype(np.float32).T, ids, 1),
                               rtol=1e-4, atol=1e-3)
    fids, _, _ = hi.build_index(kh).search(q, K)
    np.testing.assert_array_equal(fids, truth)


def test_non_contiguous_inputs_are_copied(data):
    keys, q, _ = data
    wide = np.zeros((N, 2 * D), np.float32)
    wide[:, ::2] = keys
    ix = hi.build_index(wide[:, ::2])
    qf = np.asfortranarray(q)
    np.testing.assert_array_equal(ix.search(qf, K)[0], exact_topk(q, keys, K))


class TestBadInput:
    def setup_method(self):
        self.keys, self.q = keys_queries(100, 16, 4)

    @pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
    def test_nonfinite_keys(self, bad):
        k = self.keys.copy()
        k[5, 3] = bad
        with pytest.raises(ValueError, match="NaN"):
            hi.build_index(k)
        ix = hi.build_index(self.keys, kind="graph")
        with pytest.raises(ValueError, match="NaN"):
            ix.insert(k[:10])
        assert len(ix) == 100

    def test_nonfinite_queries(self):
        q = self.q.copy()
        q[0, 0] = np.nan
        with pytest.raises(ValueError, match="NaN"):
            hi.build_index(self.keys).search(q, 3)

    def test_wrong_dtype(self):
        with pytest.raises(TypeError):
            hi.build_index(self.keys.astype(np.float64))
        with pytest.raises(TypeError):
            hi.build_index(self.keys.astype(np.int32))
        with pytest.raises(TypeError):
            hi.build_index(self.keys).search(self.q.astype(np.complex64), 3)

    def test_wrong_shape(self):
        with pytest.raises(ValueError):
            hi.build_index(self.keys[0])
        with pytest.raises(ValueError):
            hi.build_index(self.keys).search(self.q[:, :8], 3)
        with pytest.raises(ValueError):
            hi.build_index(self.keys).insert(self.keys[:, :8])

    def test_negative_k_and_ef(self):
        ix = hi.build_index(self.keys, kind="graph")
        with pytest.raises(ValueError):
            ix.search(self.q, -1)
        with pytest.raises(ValueError):
            ix.search(self.q, 3, ef=0)
        with pytest.raises(TypeError):
            ix.search(self.q, 2.5)

    def test_topk_ids_out_of_range(self):
        tk = np.zeros((4, 5), np.int64)
        tk[1, 2] = 100
        with pytest.raises(ValueError, match="range"):
            hi.build_index(self.keys, kind="roar", train_topk=tk)
        tk[1, 2] = -2
        with pytest.raises(ValueError, match="range"):
            hi.build_index(self.keys, kind="roar", train_topk=tk)
        with pytest.raises(TypeError):
            hi.build_index(self.keys, kind="roar", train_topk=tk.astype(np.float32))

    def test_bad_params(self):
        with pytest.raises(ValueError):
            hi.build_index(self.keys, kind="hnsw")
        with pytest.raises(TypeError):
            hi.build_index(self.keys, kind="ivf", M=3)
        with pytest.raises(ValueError):
            hi.build_index(self.keys, kind="graph", metric="cos")
        with pytest.raises(ValueError):
            hi.build_index(self.keys, kind="graph", M=0)
        with pytest.raises(ValueError):
            hi.build_index(self.keys, kind="graph", train_queries=self.q)
        with pytest.raises(ValueError):
            hi.build_index(self.keys, kind="roar")  # no training data


def _adjacency(ix):
    e = ix._c.export()
    n, r = e["n"], e["R"]
    adj = np.frombuffer(e["adj"], np.int32).reshape(n, r)
    deg = np.frombuffer(e["deg"], np.int32)
    return [adj[i, :deg[i]] for i in range(n)]


def cooc_reference(topk, n, base, want):
    """NumPy twin of roar's co-occurrence pass: per key u, the `want` keys v (not already linked) with the
    largest c(u, v) / sqrt(f(v)) (c: training top lists holding both, f: lists holding v), ties by smaller id."""
    f = np.bincount(topk[topk >= 0].ravel(), minlength=n).astype(np.float32)
    out = []
    for u in range(n):
        rows = topk[(topk == u).any(1)]
        c = np.bincount(rows[rows >= 0].ravel(), minlength=n).astype(np.float32)
        c[u] = 0
        c[base[u]] = 0
        c = np.where(c > 0, c / np.sqrt(np.maximum(f, 1)), 0).astype(np.float32)
        order = np.lexsort((np.arange(n), -c))
        out.append(order[:want][c[order[:want]] > 0])
    return out


@pytest.mark.parametrize("threads", [1, 2])
def test_roar_cooc_links_match_numpy(data, threads):
    keys, _, tq = data
    n = 800
    topk = exact_topk(tq, keys[:n], 20)
    topk[::7, -3:] = -1  # padding is ignored
    base = hi.build_index(keys[:n], kind="roar", train_topk=topk, threads=1, n_cooc=0)
    ix = hi.build_index(keys[:n], kind="roar", train_topk=topk, threads=threads, n_cooc=6)
    ref = cooc_reference(topk, n, _adjacency(base), 6)
    got = _adjacency(ix)
    stats = ix.stats()
    if threads == 1:  # the projection / connectivity part is deterministic with one thread
        for u in range(n):
            b = _adjacency(base)[u]
            np.testing.assert_array_equal(got[u][:len(b)], b)
            np.testing.assert_array_equal(got[u][len(b):], ref[u])
        assert stats["cooc_edges"] == sum(len(r) for r in ref)
    m = hi.DEFAULT_PARAMS["roar"]["M"]
    assert all(len(g) <= m + 6 and len(set(g.tolist())) == len(g) for g in got)
    assert stats["cooc_edges"] > 0


def test_roar_cooc_recall_and_honest_scan(data):
    keys, q, tq = data
    truth = exact_topk(q, keys, K)
    ix = hi.build_index(keys, kind="roar", train_queries=tq, M=35, n_cooc=16, threads=2)
    ids, scores, scanned = ix.search(q, K, ef=64)
    assert recall(ids, truth) >= 0.95
    assert (scanned <= N).all() and (scanned >= K).all()
    np.testing.assert_allclose(scores, np.take_along_axis(q @ keys.T, ids, 1), rtol=1e-5, atol=1e-4)
    # Inserts after a build keep working with the wider adjacency.
    more, _ = keys_queries(200, D, 1, seed=11)
    ix.insert(more, queries=q[np.arange(200) % Q])
    all_keys = np.concatenate([keys, more])
    probe = more[:100] * 3.0
    assert np.mean(ix.search(probe, 1, ef=128)[0][:, 0] == exact_topk(probe, all_keys, 1)[:, 0]) >= 0.95


def test_roar_cooc_param_checks(data):
    keys, _, tq = data
    with pytest.raises(ValueError):
        hi.build_index(keys[:100], kind="roar", train_queries=tq[:10], n_cooc=-1)
    with pytest.raises(ValueError):
        hi.build_index(keys[:100], kind="roar", train_queries=tq[:10], n_cooc=257)
    with pytest.raises(TypeError):
        hi.build_index(keys[:100], kind="graph", n_cooc=4)


@pytest.mark.parametrize("kind", ["graph", "roar"])
def test_ef_below_k_returns_best_k_scanned(data, kind):
    keys, q, tq = data
    train = {"train_queries": tq} if kind == "roar" else {}
    ix = hi.build_index(keys, kind=kind, threads=1, **train)
    k = 40
    ids, scores, scanned = ix.search(q, k, ef=10)
    ids_k, _, scanned_k = ix.search(q, k, ef=k)
    assert (ids >= 0).all() and all(len(set(r)) == k for r in ids.tolist())
    np.testing.assert_allclose(scores, np.take_along_axis(q @ keys.T, ids, 1), rtol=1e-5, atol=1e-4)
    assert (np.diff(scores, axis=1) <= 0).all()
    assert scanned.mean() < scanned_k.mean()
    truth = exact_topk(q, keys, k)
    assert recall(ids, truth) >= 0.5
    assert recall(ids_k, truth) >= recall(ids, truth) - 0.02


@pytest.mark.parametrize("m, n_hubs", [(40, 32), (300, 32), (1000, 5), (1000, 100)])
def test_roar_hubs_cover_the_last_queries_and_every_stratum(m, n_hubs):
    rng = np.random.default_rng(m + n_hubs)
    n = 800
    keys = rng.normal(size=(n, 16)).astype(np.float32)
    tq = rng.normal(size=(m, 16)).astype(np.float32)
    topk = exact_topk(tq, keys, 12)
    ix = hi.build_index(keys, kind="roar", train_topk=topk, threads=2, n_hubs=n_hubs)
    hubs = np.frombuffer(ix._c.export()["hubs"], np.int32)
    np.testing.assert_array_equal(hubs, hub_seeds(topk, n, n_hubs))
    assert len(set(hubs.tolist())) == len(hubs) == n_hubs
    # Half the hubs come from the last 64 queries' top lists (the prompt's end, which decoding continues).
    assert set(hubs[:n_hubs // 2].tolist()) <= set(topk[-64:].ravel().tolist())
    if n_hubs >= 16:  # every eighth of the key range holds a hub
        assert len({int(h) * 8 // n for h in hubs}) == 8


def test_roar_hubs_are_the_recent_top_keys_and_counted(data):
    keys, q, tq = data
    n = 1000
    topk = exact_topk(tq, keys[:n], 20)
    ix = hi.build_index(keys[:n], kind="roar", train_topk=topk, threads=1, n_hubs=8)
    hubs = np.frombuffer(ix._c.export()["hubs"], np.int32)
    np.testing.assert_array_equal(hubs, hub_seeds(topk, n, 8))
    # A search scores the entry and every hub before anything else: k = ef = 1 still scans them.
    _, _, scanned = ix.search(q, 1, ef=1)
    assert (scanned >= 1 + len(set(hubs.tolist()))).all()
    none = hi.build_index(keys[:n], kind="roar", train_topk=topk, threads=1, n_hubs=0)
    assert np.frombuffer(none._c.export()["hubs"], np.int32).size == 0
    # Same graph without hubs (restored without them): seeds change the search only.
    e = ix._c.export()
    ix._c.restore(e["n"], e["entry"], e["nlist"], e["adj"], e["deg"], e["centroids"], e["assign"])
    assert np.frombuffer(ix._c.export()["hubs"], np.int32).size == 0
    with pytest.raises(ValueError):
        ix._c.restore(e["n"], e["entry"], e["nlist"], e["adj"], e["deg"], e["centroids"], e["assign"],
                      np.asarray([n], np.int32).tobytes())
