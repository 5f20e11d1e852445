"""One approximate-nearest-neighbour index per head, with one API for every kind.

Kinds:
  flat:  exact scan; the twin every recall test compares with.
  ivf:   k-means (L2) on the keys; a query probes the `nprobe` lists whose
         centroids have the largest inner product with it.
  graph: key-only proximity graph, HNSW-style (one layer, entry near the mean),
         neighbours selected by RNG-style pruning under `metric` ("l2" or "ip",
         the latter as off-the-shelf HNSW-IP indexes do).
  roar:  attention-aware graph after RoarGraph: each training query's nearest
         key (pivot) is linked to the query's other top-N_q keys, pruned to
         out-degree M, with reverse edges; then a connectivity pass (every key
         searches for its neighbours with list L and fills free slots) and a
         reachability repair; then n_cooc co-occurrence links per key (to the
         keys whose training-query sets overlap its own most, by
         count / sqrt(frequency)); best-first search from the key nearest the
         mean plus n_hubs seeds: half the keys the last 64 training rows
         (the prompt's end) rank high most often, half spread over eight
         position strata of the keys, each stratum's most frequent in the
         last quarter's top lists (far needles; host_index/NOTES_roar.md).

Search always maximises the inner product q.k. `ef` is the candidate-list size
for graph/roar (default max(64, k); an ef below k keeps a beam of ef and
returns the best k of every key scanned) and `nprobe` for ivf (default
nlist // 8). `scanned` counts distinct distance computations per query, ivf
centroids included.

Indexes hold ids only; keys come from a key source (an owned array for
`build_index`, the KVStore inside a HostContext), so the query heads of a GQA
group share one copy of the keys.
"""

from __future__ import annotations

import numpy as np

from host_index import _core
from host_index import _dtypes

KINDS = {"flat": 0, "ivf": 1, "graph": 2, "roar": 3}
METRICS = {"l2": 0, "ip": 1}

# Defaults per kind. graph follows hnswlib (M 16, 2M links per node,
# ef_construction 200); roar follows RoarGraph's N_q 100 with L 100 (as good
# as the public L 500, ../shared/DESIGN.md), but keeps M 6 projection /
# connectivity links, adds 40 co-occurrence links per key and 32 hub seeds: on
# real Gemma-3 32K vectors that takes the keys scanned for recall@100 0.95
# from 6.6% (RoarGraph's M 35 alone) to under 3% (host_index/NOTES_roar.md). ef_insert
# is the candidate list of inserts after the build (0: ef_construction for
# graph, L for roar). roar's 64: decode inserts every token leaving the window
# into every index, and on real SmolLM2 vectors ef 64 costs two thirds of L 100's
# time per insert for 0.3 points of recall@100, ef 32 under half for 1.7 points
# (experiments/results/bench_insert_smollm2_8k.md).
DEFAULT_PARAMS = {
    "flat": {},
    "ivf": {"nlist": 0, "niter": 10},
    "graph": {"M": 16, "ef_construction": 200, "metric": "l2", "alpha": 1.0, "ef_insert": 0},
    "roar": {"n_q": 100, "M": 6, "L": 100, "metric": "l2", "n_pivots": 1, "alpha": 1.0,
             "ef_insert": 64, "n_cooc": 40, "n_hubs": 32},
}


def resolve_params(kind: str, params: dict) -> dict:
    """Defaults merged with `params`; unknown names or bad values raise.

    Raises:
        ValueError: unknown kind, metric, or out-of-range value.
        TypeError: a parameter that does not apply to `kind`.
    """
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} must be one of {sorted(KINDS)}")
    out = dict(DEFAULT_PARAMS[kind])
    for name, value in params.items():
        if name not in out:
            raise TypeError(f"parameter {name!r} does not apply to kind={kind!r} "
                            f"(accepted: {sorted(out)})")
        out[name] = value
    if "metric" in out and out["metric"] not in METRICS:
        raise ValueError(f"metric={out['metric']!r} must be one of {sorted(METRICS)}")
    for name in ("M", "ef_construction", "L", "n_q", "n_pivots"):
        if name in out:
            _dtypes.positive_int(out[name], name)
    for name in ("nlist", "niter", "ef_insert", "n_cooc", "n_hubs"):
        if name in out:
            _dtypes.positive_int(out[name], name, allow_zero=True)
    if "M" in out and out["M"] > 256:
        raise ValueError(f"M={out['M']} must be <= 256")
    if "n_cooc" in out and out["n_cooc"] > 256:
        raise ValueError(f"n_cooc={out['n_cooc']} must be <= 256")
    if "n_hubs" in out and out["n_hubs"] > 4096:
        raise ValueError(f"n_hubs={out['n_hubs']} must be <= 4096")
    if "alpha" in out and not (isinstance(out["alpha"], (int, float)) and out["alpha"] >= 1.0):
        raise ValueError(f"alpha={out['alpha']!r} must be a number >= 1")
    return out


def _threads(threads) -> int:
    if threads is None:
        return 0
    return _dtypes.positive_int(threads, "threads")


class OwnedKeys:
    """Keys owned by a standalone index: [cap, D] in the storage dtype."""

    def __init__(self, dim: int, code: int):
        self.dim, self.code = dim, code
        self.arr = np.empty((0, dim), _dtypes.STORAGE[code])  # [cap, D]
        self.n = 0

    def view(self):
        """(buffer [1, cap, D], dtype code, head 0, cap, valid rows) for the C core."""
        return self.arr, self.code, 0, self.arr.shape[0], self.n

    def append(self, keys: np.ndarray, code: int) -> None:
        """Appends keys [n, D] (already validated), growing amortized."""
        n = keys.shape[0]
        if self.n + n > self.arr.shape[0]:
            cap = max(self.n + n, self.arr.shape[0] * 3 // 2, 64)
            grown = np.empty((cap, self.dim), self.arr.dtype)
            grown[: self.n] = self.arr[: self.n]
            self.arr = grown
        _core.convert(keys, code, 0, 0, self.arr, self.code, self.n * self.dim, 0, 1,
                      n * self.dim, 1)
        self.n += n


class Index:
    """One index over one head's keys. Create with `build_index`.

    Thread safety: `search` may run concurrently with other searches and with
    `insert` on the same index (the C core takes a read/write lock; a search
    sees the index before or after an insert). `insert` on a standalone index
    also grows its key array, so concurrent `insert` calls on one index need
    external locking.
    """

    def __init__(self, kind: str, dim: int, keysrc, *, seed: int = 0, **params):
        self.kind = kind
        self.dim = dim
        self.params = resolve_params(kind, params)
        self.seed = int(seed)
        self._keys = keysrc
        cparams = {k: (METRICS[v] if k == "metric" else v) for k, v in self.params.items()}
        self._c = _core.Index(KINDS[kind], dim, seed=self.seed, **cparams)
        buf, code, head, cap, _ = keysrc.view()
        self._c.build(buf, code, head, cap, 0, None, 0, None, 0, None, 0, 1)  # empty, usable

    def __len__(self) -> int:
        return self._c.n

    def __repr__(self) -> str:
        return f"Index(kind={self.kind!r}, dim={self.dim}, n={len(self)}, params={self.params})"

    @property
    def nbytes(self) -> int:
        """Bytes held by the index structure (plus its keys when it owns them)."""
        own = self._keys.arr.nbytes if isinstance(self._keys, OwnedKeys) else 0
        return self._c.nbytes + own

    def reserve(self, n: int) -> None:
        """Sizes the node arrays for n keys, so inserting up to n grows (copies) nothing."""
        self._c.reserve(_dtypes.positive_int(n, "n", allow_zero=True))

    def stats(self) -> dict:
        """Build statistics: nodes, pivots, repaired nodes, distance counts, phase times (s)."""
        return self._c.stats()

    def build(self, n: int, *, train_queries=None, train_topk=None, connect_candidates=None,
              threads=None) -> None:
        """(Re)builds over keys 0..n-1 of the key source. See `build_index`."""
        self.prepare_build(n, train_queries=train_queries, train_topk=train_topk,
                           connect_candidates=connect_candidates)(threads)

    def prepare_build(self, n: int, *, train_queries=None, train_topk=None, connect_candidates=None):
        """Validates and converts a build's arguments now; returns `run(threads)`, which builds
        (the C call, GIL released). Lets a caller reject bad input before queuing the work."""
        tq, tk, m, nq = _train_args(self.kind, n, self.dim, train_queries, train_topk)
        cand = _connect_candidates(self.kind, n, connect_candidates)
        buf, code, head, cap, valid = self._keys.view()
        if n > valid:
            raise ValueError(f"n={n} exceeds the {valid} stored keys")
        nc = 0 if cand is None else cand.shape[1]
        return lambda threads=None: self._c.build(buf, code, head, cap, n, tq, m, tk, nq, cand, nc,
                                                  _threads(threads))

    def search(self, queries, k: int, *, ef: int | None = None, threads: int | None = None):
        """Top-k keys by inner product for each query.

        Args:
            queries: [Q, D] float32/float16/bfloat16, finite.
            k: results per query (>= 0); missing results are padded.
            ef: graph/roar candidate list (default max(64, k); below k, the
                beam is ef wide and the results are the best k of every key
                scanned); ivf nprobe (default nlist // 8); ignored by flat.
            threads: OpenMP threads (default: OMP_NUM_THREADS / all cores).

        Returns:
            ids [Q, k] int64 (best first, -1 padded), scores [Q, k] float32
            (q.k, -inf padded), scanned [Q] int64 (distance computations).
        """
        q = _dtypes.as_f32(queries, "queries", ndim=2, dim=self.dim)
        k = _dtypes.positive_int(k, "k", allow_zero=True)
        ef = 0 if ef is None else _dtypes.positive_int(ef, "ef")
        nq = q.shape[0]
        ids = np.empty((nq, k), np.int64)
        scores = np.empty((nq, k), np.float32)
        scanned = np.empty((nq,), np.int64)
        buf, code, head, cap, valid = self._keys.view()
        self._c.search(buf, code, head, cap, valid, q, nq, k, ef, ids, scores, scanned,
                       _threads(threads))
        return ids, scores, scanned

    def insert(self, keys, queries=None, *, threads=None) -> None:
        """Appends keys to a standalone index (ids continue from len(self)).

        Args:
            keys: [n, D] float32/float16/bfloat16, finite.
            queries: [n, D] or None: for roar, each key's own query, used as
                its training query (linked by both); ignored by other kinds.

        Raises:
            TypeError: the index reads its keys from a KVStore (use
                HostContext.insert).
        """
        if not isinstance(self._keys, OwnedKeys):
            raise TypeError("this index reads its keys from a KVStore: use HostContext.insert")
        a, code = _dtypes.as_c_array(keys, "keys", ndim=2)
        if a.shape[1] != self.dim:
            raise ValueError(f"keys: last dimension {a.shape[1]} != {self.dim}")
        q = None
        if queries is not None:
            q = _dtypes.as_f32(queries, "queries", ndim=2, dim=self.dim)
            if q.shape[0] != a.shape[0]:
                raise ValueError(f"queries has {q.shape[0]} rows, keys {a.shape[0]}")
        if _core.count_bad(a, code, self._keys.code, a.size):
            raise ValueError("keys: contains NaN/inf or values out of the storage dtype's range")
        if len(self) != self._keys.n:
            raise RuntimeError("index and its keys are out of step")
        self._keys.append(a, code)
        self.extend(self._keys.n, queries=q, threads=threads)

    def extend(self, n_total: int, *, queries=None, threads=None) -> None:
        """Indexes keys len(self)..n_total-1 already present in the key source.

        queries: [n_total - len(self), D] float32 C-contiguous or None.
        """
        buf, code, head, cap, valid = self._keys.view()
        if n_total > valid:
            raise ValueError(f"n_total={n_total} exceeds the {valid} stored keys")
        if queries is not None and self.kind != "roar":
            queries = None
        if queries is not None:  # C checks only the byte count: float64 rows would read as pairs of floats
            queries = _dtypes.as_f32(queries, "queries", ndim=2, dim=self.dim)
            if queries.shape[0] != n_total - len(self):
                raise ValueError(f"queries has {queries.shape[0]} rows for {n_total - len(self)} new keys")
        self._c.insert(buf, code, head, cap, n_total, queries, _threads(threads))


def check_train_args(kind, n, dim, train_queries, train_topk, *, ndim: int = 2):
    """Checks roar's training arguments, [..., M, D] queries and [..., M, N_q] ids (ndim
    dimensions each), by reading them; returns them as arrays, uncopied."""
    if kind != "roar":
        if train_queries is not None or train_topk is not None:
            raise ValueError(f"train_queries/train_topk do not apply to kind={kind!r}")
        return None, None
    tq = tk = None
    if train_queries is not None:
        tq = _dtypes.check_f32(train_queries, "train_queries", ndim=ndim, dim=dim)
    if train_topk is not None:
        tk = _dtypes.check_ids(train_topk, "train_topk", ndim=ndim)
        if tq is not None and tk.shape[:-1] != tq.shape[:-1]:
            raise ValueError(f"train_topk has {tk.shape[:-1]} rows, train_queries {tq.shape[:-1]}")
        if tk.size and (tk.min() < -1 or tk.max() >= n):
            raise ValueError(f"train_topk ids out of range: must lie in [-1, {n}) (-1 = padding)")
    if n > 0 and tq is None and tk is None:
        raise ValueError("kind='roar' needs train_queries [M, D] and/or train_topk [M, N_q]")
    return tq, tk


def _train_args(kind, n, dim, train_queries, train_topk):
    """Validated (train_queries f32 | None, train_topk int64 | None, m, nq)."""
    tq, tk = check_train_args(kind, n, dim, train_queries, train_topk)
    if tq is not None:
        tq = np.ascontiguousarray(tq, dtype=np.float32)
    if tk is not None:
        tk = np.ascontiguousarray(tk, dtype=np.int64)
    rows = tk if tk is not None else tq  # both given: check_train_args paired their rows
    return tq, tk, 0 if rows is None else rows.shape[0], 0 if tk is None else tk.shape[1]


MAX_CONNECT_CANDIDATES = 1024


def check_connect_candidates(kind, n, candidates, *, ndim: int = 2):
    """Checks roar's connectivity candidates, [..., n, C] int ids (ndim dimensions), by reading
    them; returns them as an array, uncopied (or None)."""
    if candidates is None:
        return None
    if kind != "roar":
        raise ValueError(f"connect_candidates do not apply to kind={kind!r}")
    c = _dtypes.check_ids(candidates, "connect_candidates", ndim=ndim)
    if c.shape[-2] != n or not 0 < c.shape[-1] <= MAX_CONNECT_CANDIDATES:
        raise ValueError(f"connect_candidates shape {c.shape} must be [{n} keys, 1..{MAX_CONNECT_CANDIDATES}]")
    if c.size and (c.min() < -1 or c.max() >= n):
        raise ValueError(f"connect_candidates ids out of range: must lie in [-1, {n}) (-1 = padding)")
    return c


def _connect_candidates(kind, n, candidates):
    """Validated roar connectivity candidates [n, C] int32 (C <= MAX_CONNECT_CANDIDATES), or None."""
    c = check_connect_candidates(kind, n, candidates)
    return None if c is None else np.ascontiguousarray(c, dtype=np.int32)


def build_index(keys, *, kind: str = "flat", train_queries=None, train_topk=None,
                connect_candidates=None, seed: int = 0, threads: int | None = None, **params) -> Index:
    """Builds a standalone index over keys (which it copies and owns).

    Args:
        keys: [N, D] float32/float16/bfloat16, finite; stored in that dtype.
        kind: "flat" | "ivf" | "graph" | "roar".
        train_queries: roar only: [M, D] prefill queries; their exact top-n_q
            keys are computed here when train_topk is not given.
        train_topk: roar only: [M, N_q] int ids of each training query's
            exact top keys, best first (-1 = padding), e.g. from the device.
        connect_candidates: roar only: [N, C] int ids (-1 = padding) of each
            key's candidate neighbours for the connectivity pass, e.g. its C
            nearest keys computed on the device (`key_neighbours`); they
            replace that pass's graph search of every key, most of a build's
            time. None: searched, as RoarGraph does.
        seed: seeds k-means sampling (the graph builds use no randomness). A
            build with threads=1 is deterministic; with more threads, graph
            builds insert concurrently and results vary within noise.
        threads: OpenMP threads (default: all).
        **params: per kind (defaults in DEFAULT_PARAMS): ivf nlist (0 = 4*sqrt(N)),
            niter; graph M, ef_construction, metric ("l2" | "ip"), alpha, ef_insert;
            roar n_q, M, L, metric, n_pivots, alpha, ef_insert, n_cooc. ef_insert is
            the candidate list of `insert` (and HostContext.insert); 0 uses
            ef_construction (graph) or L (roar). n_cooc (roar): extra links per
            key to the keys that share the most training top-n_q lists with it
            (0: RoarGraph's graph alone); keys inserted later get none. n_hubs
            (roar): keys every search scores besides the entry (counted in
            `scanned`): half from the top lists of the last 64 train_queries /
            train_topk rows, half from the last quarter's, spread over eight key
            strata; rows and keys must be in prompt order.

    Returns:
        An Index with search / insert / len.
    """
    a, code = _dtypes.as_c_array(keys, "keys", ndim=2)
    n, dim = a.shape
    if not 0 < dim <= 2048:
        raise ValueError(f"head_dim={dim} must be in 1..2048")
    if _core.count_bad(a, code, code, a.size):
        raise ValueError("keys: contains NaN or inf")
    src = OwnedKeys(dim, code)
    ix = Index(kind, dim, src, seed=_dtypes.positive_int(seed, "seed", allow_zero=True), **params)
    src.append(a, code)
    ix.build(n, train_queries=train_queries, train_topk=train_topk, connect_candidates=connect_candidates,
             threads=threads)
    return ix
