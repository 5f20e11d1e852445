"""HostContext: the host side of one context — a KVStore plus one index per
(sequence, layer, head) over that store's keys, host partial attention, and
the FreeKV page path.

Index heads: `roar` keeps one index per query head by default
(roar_heads="query": its training queries differ within a GQA group), or one
per KV head with roar_heads="kv", trained on the union of its group's queries
(G times fewer builds, less memory and fewer decode-time inserts);
flat/ivf/graph keep one per KV head. A per-KV-head index is shared by the G =
Hq / Hkv query heads of its group (query head h reads index h // G). Every
index covers store indices 0..len(index)-1 of its (seq, layer); `insert`
appends to the store and extends the indexes, `append` only stores.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os

import numpy as np

from host_index import _core
from host_index import _dtypes
from host_index import _index
from host_index._store import KVStore

ROAR_HEADS = ("query", "kv")


def _cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class StoreKeys:
    """Key source of an index: one KV head of one (seq, layer) of a KVStore."""

    def __init__(self, store: KVStore, seq: int, layer: int, head: int):
        self.store, self.seq, self.layer, self.head = store, seq, layer, head

    def view(self):
        """(K [Hkv, cap, D], dtype code, head, cap, length) for the C core."""
        k, _, n = self.store.buffers(self.seq, self.layer)
        return k, self.store.code, self.head, k.shape[1], n


class HostContext:
    """Store + per-(seq, layer, head) indexes for one batch of contexts.

    Thread safety: `attend`/`search`/`attend_ids` may run in one thread while
    another thread calls `insert`/`append`/`build_layer` on the same or other
    (seq, layer)s: every search sees each index as of the store length it read
    when the call started (later tokens are ignored, never half-read), though
    an insert that re-prunes a full neighbour list can change which of the old
    tokens a concurrent graph search reaches (wait for the search first for a
    timing-independent result, as kvjax.host_runtime does). Two concurrent
    mutations of the same (seq, layer) (insert vs build_layer) must be ordered
    by the caller; mutations of different (seq, layer)s need no locking.
    """

    def __init__(self, num_seqs: int, num_layers: int, num_q_heads: int, num_kv_heads: int,
                 head_dim: int, *, dtype: str = "float16", kind: str = "roar",
                 index_params: dict | None = None, max_bytes: int | None = None,
                 page_size: int = 32, seed: int = 0, roar_heads: str = "query"):
        """Creates an empty context.

        Args:
            num_seqs, num_layers, num_q_heads, num_kv_heads, head_dim: cache
                shape; num_q_heads must be a multiple of num_kv_heads.
            dtype: K/V storage dtype, "float16" | "bfloat16" | "float32", or
                "raw16" (caller-encoded uint16 rows, kind "flat" only): a page
                store that holds no indexes, so every search, attention, build
                and insert raises ValueError.
            kind: index kind, "flat" | "ivf" | "graph" | "roar".
            index_params: per-kind parameters (see host_index.DEFAULT_PARAMS).
            max_bytes: cap on the store's K/V bytes (indexes are reported in
                `nbytes` but not capped).
            page_size: FreeKV page size in tokens.
            seed: index build seed.
            roar_heads: roar only: "query" (default), one index per query
                head, trained on that head's queries; or "kv", one index per
                KV head, shared by its G = num_q_heads / num_kv_heads query
                heads and trained on all G heads' queries (see build_layer).
                Other kinds always keep one index per KV head and accept only
                the default: "kv" with them raises ValueError (a config that
                asks for it has the wrong kind).
        """
        _dtypes.positive_int(num_q_heads, "num_q_heads")
        _dtypes.positive_int(num_kv_heads, "num_kv_heads")
        if num_q_heads % num_kv_heads:
            raise ValueError(f"{num_q_heads=} must be a multiple of {num_kv_heads=}")
        if dtype == "raw16" and kind != "flat":
            raise ValueError(f"{kind=} indexes keys by value, but dtype='raw16' holds opaque "
                             f"16-bit words: use kind='flat' (a page store)")
        self.store = KVStore(num_seqs, num_layers, num_kv_heads, head_dim, dtype=dtype,
                             max_bytes=max_bytes, page_size=page_size)
        self.num_q_heads = int(num_q_heads)
        self.group = self.num_q_heads // self.store.num_kv_heads
        self.kind = kind
        self.index_params = _index.resolve_params(kind, dict(index_params or {}))
        if not isinstance(roar_heads, str) or roar_heads not in ROAR_HEADS:
            raise ValueError(f"{roar_heads=} must be one of {ROAR_HEADS}")
        if roar_heads != "query" and kind != "roar":
            raise ValueError(f"{roar_heads=} applies to kind='roar' only ({kind=} always keeps "
                             f"one index per KV head)")
        self.seed = _dtypes.positive_int(seed, "seed", allow_zero=True)
        self.roar_heads = roar_heads
        self.per_q_head = kind == "roar" and roar_heads == "query"
        self.index_heads = self.num_q_heads if self.per_q_head else self.store.num_kv_heads
        self.meta: dict = {}
        S, L = self.store.num_seqs, self.store.num_layers
        # raw16 holds no numbers to index (the C core refuses even an empty build over it).
        held = 0 if self.store.code == _dtypes.RAW16 else self.index_heads
        # [seq][layer] -> tuple of Index, one per index head
        self._ix = [[tuple(self._new_index(s, l, h) for h in range(held))
                     for l in range(L)] for s in range(S)]
        self._builder = None  # build_layer(wait=False)'s threads, until wait_builds
        self._builds: list[concurrent.futures.Future] = []

    def _new_index(self, seq, layer, head):
        kv = head // self.group if self.per_q_head else head
        return _index.Index(self.kind, self.store.head_dim, StoreKeys(self.store, seq, layer, kv),
                            seed=self.seed, **self.index_params)

    # -- accessors -----------------------------------------------------------

    @property
    def num_seqs(self) -> int:
        return self.store.num_seqs

    @property
    def num_layers(self) -> int:
        return self.store.num_layers

    @property
    def num_kv_heads(self) -> int:
        return self.store.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.store.head_dim

    def index(self, seq: int, layer: int, head: int) -> _index.Index:
        """The index of (seq, layer, head); head is a query head for roar with
        roar_heads="query", else a KV head."""
        self.store._require_floats("HostContext.index")
        self.store._check(seq, layer)
        if isinstance(head, bool) or not isinstance(head, (int, np.integer)) or not 0 <= head < self.index_heads:
            raise ValueError(f"head={head!r} must be an int in [0, {self.index_heads})")
        return self._ix[seq][layer][head]

    def indexed(self, seq: int, layer: int) -> int:
        """Tokens of (seq, layer) covered by its indexes (0 for raw16, which has none)."""
        self.store._check(seq, layer)
        return _covered(self._ix[seq][layer])

    def indexed_counts(self) -> np.ndarray:
        """[num_seqs, num_layers] int64: `indexed` of every (seq, layer), in one call."""
        return np.array([[_covered(per_layer) for per_layer in per_seq] for per_seq in self._ix],
                        np.int64).reshape(self.num_seqs, self.num_layers)

    @property
    def nbytes(self) -> int:
        """Bytes held: the store's K/V arrays plus every index structure."""
        return self.store.nbytes + sum(ix._c.nbytes for per_s in self._ix for per_l in per_s
                                       for ix in per_l)

    # -- mutation --------------------------------------------------------------

    def append(self, seq: int, layer: int, start: int, keys, values, *, threads=None) -> int:
        """Stores tokens without indexing them (prefill, before build_layer).

        See KVStore.append; returns the number of new tokens.
        """
        return self.store.append(seq, layer, start, keys, values, threads=threads)

    def reserve(self, seq: int, layer: int, n: int) -> None:
        """Room for n tokens of (seq, layer): the store (KVStore.reserve) and its indexes' node
        arrays, so neither grows (copies) while decode fills that room.

        Raises:
            StoreFullError: the store's growth would cross max_bytes (nothing changes).
        """
        self.store.reserve(seq, layer, n)
        for ix in self._ix[seq][layer]:
            ix.reserve(n)

    def append_tokens(self, seqs, layers, starts, keys, values) -> int:
        """One token into each of several (seq, layer) stores, without indexing it; see
        KVStore.append_tokens."""
        return self.store.append_tokens(seqs, layers, starts, keys, values)

    def build_layer(self, layer: int, *, seqs=None, train_queries=None, train_topk=None,
                    connect_candidates=None, threads: int | None = None, wait: bool = True) -> None:
        """(Re)builds every index of one layer over all stored tokens.

        Heads are built one after another, each with `threads` OpenMP
        threads (default: all cores; the builds are parallel inside).

        With wait=False the builds are queued on the context's build threads
        (one per core, each build single-threaded) and the call returns at
        once: a caller offloading layer after layer (retrieval's prefill)
        prepares the next layer while every core builds, and every build is
        deterministic (a build with several threads links nodes concurrently
        and varies within noise). On the H200 host's 16 cores the two take
        the same time (bench_build_qwen_shapes_32k.md: 17.4 vs 17.9 s for 112
        graphs of 31K keys). `wait_builds` waits for the queued builds (and
        raises a build's error); a layer must not be searched, inserted into
        or rebuilt before then, nor the arrays passed in written to: each
        build copies its rows on its own thread (on the caller's, the copies
        took ~90 ms a layer while the earlier layers' builds held every core,
        15 ms now: Qwen2.5 at 32K on the H200 host; the builds themselves
        are that prefill's critical path). Arguments are checked before
        anything is queued.

        Args:
            layer: the layer.
            seqs: sequence ids (default: all).
            train_queries: roar only: [len(seqs), Hq, M, D] prefill queries
                (in prompt order).
            train_topk: roar only: [len(seqs), Hq, M, N_q] int, each training
                query's exact top keys by inner product (store indices, best
                first, -1 padded), e.g. computed on the device.
            connect_candidates: roar only: [len(seqs), Hkv, N, C] int, each
                stored key's C nearest keys of its KV head (-1 padded; e.g.
                ops.nearest_keys on the device): every index of that KV head
                links through them instead of searching its own graph for
                each key (see build_index).
            threads: OpenMP threads per build when waited (default: all).
            wait: False to queue the builds (see above).

        With roar_heads="kv" the arguments keep these per-query-head shapes;
        KV head g's index trains on the G*M rows of its query heads
        gG..gG+G-1, interleaved position-major (row m*G + j = head gG+j's
        m-th query, see `group_rows`), so the rows stay in prompt order and
        the hub seeds (half from the last 64 rows, the rest from the last
        quarter's) still come from the end of the prompt.
        """
        self.store._require_floats("HostContext.build_layer")
        seqs = list(range(self.num_seqs)) if seqs is None else _seq_list(seqs)
        if len(set(seqs)) != len(seqs):  # two builds of one index, queued side by side
            raise ValueError(f"seqs={seqs} names a sequence twice")
        Hq, Hkv = self.num_q_heads, self.store.num_kv_heads
        for name, arr, heads, kind in (("train_queries", train_queries, Hq, "q"), ("train_topk", train_topk, Hq, "q"),
                                       ("connect_candidates", connect_candidates, Hkv, "kv")):
            if arr is None:
                continue
            if self.kind != "roar":
                raise ValueError(f"{name} does not apply to kind={self.kind!r}")
            shape = np.shape(arr)
            if len(shape) != 4 or shape[0] != len(seqs) or shape[1] != heads:
                raise ValueError(f"{name} shape {shape} must start with [{len(seqs)} seqs, {heads} {kind} heads]")
        per_build = None if threads is None else _dtypes.positive_int(threads, "threads")
        G = 1 if self.per_q_head else self.group
        jobs = []  # one per (seq, index head), each given its arguments checked but uncopied
        for si, s in enumerate(seqs):
            n = self.store.length(s, layer)
            tq, tk, cand = (None if a is None else a[si] for a in (train_queries, train_topk, connect_candidates))
            tq, tk = _index.check_train_args(self.kind, n, self.store.head_dim, tq, tk, ndim=3)
            cand = _index.check_connect_candidates(self.kind, n, cand, ndim=3)
            for h, ix in enumerate(self._ix[s][layer]):
                kv = h // self.group if self.per_q_head else h
                jobs.append(functools.partial(_build_head, ix, n, h, G, tq, tk, None if cand is None else cand[kv]))
        if not wait:
            if self._builder is None:
                self._builder = concurrent.futures.ThreadPoolExecutor(_cores(), thread_name_prefix="host_index-build")
            self._builds += [self._builder.submit(job, 1) for job in jobs]
            return
        for job in jobs:
            job(per_build)

    def wait_builds(self) -> None:
        """Waits for every build queued by build_layer(wait=False) and stops the build
        threads; raises the first failed build's error (after all have ended)."""
        builds, self._builds = self._builds, []
        if self._builder is not None:
            self._builder.shutdown(wait=True)
            self._builder = None
        for future in builds:
            future.result()

    def insert(self, seq: int, layer: int, start: int, keys, values, *, queries=None,
               ef: int | None = None, threads=None) -> int:
        """Stores tokens and adds them to every index of (seq, layer).

        The indexes of (seq, layer) are extended in one C call, one thread per
        index head (see `insert_many`).

        Args:
            start: store index of the first token (overlap skipped, gap = error).
            keys, values: [Hkv, n, D].
            queries: [Hq, n, D] or None: each token's own query; roar links a
                new key through it (its training query; with roar_heads="kv"
                through the mean of its group's G queries, see `insert_many`);
                other kinds ignore it.
            ef: graph and roar inserts' candidate list (default: the index's ef_insert;
                see `insert_many`).
            threads: OpenMP threads (default: all; at most one per index head).

        Returns:
            The number of new tokens stored.
        """
        self.store._require_floats("HostContext.insert")
        keys, values = np.asarray(keys), np.asarray(values)
        for name, a in (("keys", keys), ("values", values)):
            if a.ndim != 3:
                raise ValueError(f"{name} {a.shape} must be [num_kv_heads, n, head_dim]")
        q = None if queries is None else np.asarray(queries)[None]
        return int(self.insert_many([seq], [layer], [start], keys[None], values[None],
                                    queries=q, ef=ef, threads=threads)[0])

    def insert_many(self, seqs, layers, starts, keys, values, *, queries=None,
                    ef: int | None = None, threads=None) -> np.ndarray:
        """Stores tokens of several (seq, layer)s and extends all their indexes in one call.

        E.g. the token leaving the device window of every sequence in a layer,
        or of every layer of a step: the stores are appended first, then one
        GIL-free C call extends every index of every (seq, layer), one thread
        per index (a graph insert is 0.1-1 ms; the indexes are independent).

        Args:
            seqs, layers, starts: [T] int: distinct (seq, layer) pairs and the
                store index of each one's first token (overlap skipped, gap =
                error, as in `insert`).
            keys, values: [T, Hkv, n, D] float32/float16/bfloat16, finite.
            queries: [T, Hq, n, D] or None: each token's own query (roar links
                a new key through it; other kinds ignore it). With
                roar_heads="kv" a KV head's index links the key through the
                mean of its G query heads' queries: the index takes one query
                per token (the C insert searches with it once), and the mean
                ranks keys by the group's mean score q.k, the one direction that
                serves all G heads equally.
            ef: the candidate list of each graph or roar insert's beam searches, this
                call only (default None: the index's `ef_insert`); ivf and flat ignore
                it. Smaller is cheaper and links the new keys less well
                (experiments/results/bench_insert_smollm2_8k.md).
            threads: OpenMP threads (default: all; at most one per index).

        Returns:
            new [T] int64: tokens stored per (seq, layer).

        Raises:
            ValueError / TypeError / StoreFullError: as KVStore.append. Every
            check but the NaN/inf and capacity ones happens before anything is
            stored; when one of those fails for item i, items before it stay
            stored and indexed.
        """
        self.store._require_floats("HostContext.insert_many")
        seqs, layers, starts = ([int(x) for x in _dtypes.as_ids(np.atleast_1d(a), name, ndim=1)]
                                for a, name in ((seqs, "seqs"), (layers, "layers"),
                                                (starts, "starts")))
        T = len(seqs)
        if len(layers) != T or len(starts) != T:
            raise ValueError(f"{len(seqs)} seqs, {len(layers)} layers and {len(starts)} starts "
                             "must be equally many")
        if len(set(zip(seqs, layers))) != T:
            raise ValueError("(seq, layer) pairs must be distinct")
        for s, l, st in zip(seqs, layers, starts):
            self.store._check(s, l)
            _dtypes.positive_int(st, "start", allow_zero=True)
            if st > self.store.length(s, l):
                raise ValueError(f"start={st} leaves a gap after the {self.store.length(s, l)} "
                                 f"stored tokens of seq={s} layer={l}")
        kshape, vshape = np.shape(keys), np.shape(values)
        want = (T, self.num_kv_heads)
        if len(kshape) != 4 or kshape[:2] != want or kshape[3] != self.head_dim or kshape != vshape:
            raise ValueError(f"keys {kshape} and values {vshape} must both be "
                             f"[{T}, {self.num_kv_heads}, n, {self.head_dim}]")
        n = kshape[2]
        q = None
        if queries is not None:
            qshape = np.shape(queries)
            if qshape != (T, self.num_q_heads, n, self.head_dim):
                raise ValueError(f"queries {qshape} must be [{T}, {self.num_q_heads}, {n}, "
                                 f"{self.head_dim}]")
            if self.kind == "roar":  # others ignore them
                q = self._insert_queries(queries, qshape)
        nthreads = 0 if threads is None else _dtypes.positive_int(threads, "threads")
        ef = _insert_ef(ef)
        new = np.zeros(T, np.int64)
        done = 0
        try:
            for i, (s, l, st) in enumerate(zip(seqs, layers, starts)):
                # One small append per (seq, layer): the C copy stays on this
                # thread below ~64K elements (no team to wake).
                new[i] = self.store.append(s, l, st, keys[i], values[i], threads=threads)
                done = i + 1
        finally:
            self._extend(seqs[:done], layers[:done], starts[:done], q, nthreads, ef)
        return new

    def index_stored(self, seqs, layers, *, queries=None, ef: int | None = None, threads=None,
                     yield_to_foreground: bool = False) -> float:
        """Indexes the stored but not yet indexed tokens of several (seq, layer)s, one C call.

        Decoding appends each token leaving the device window with `append` (a copy, on
        the critical path) and indexes it here later, off the critical path; until then
        the caller attends those tokens exactly by store id.

        Args:
            seqs, layers: [T] int: distinct (seq, layer) pairs.
            queries: [T, Hq, n, D] or None: the queries of each pair's n unindexed tokens
                (roar links a new key through its own query, or with roar_heads="kv"
                through its group's mean query, as `insert_many`; other kinds ignore
                them). Every pair must then have exactly n unindexed tokens.
            ef: the inserts' candidate list (default: the index's ef_insert; see `insert_many`).
            threads: OpenMP threads (default: all; at most one per index).
            yield_to_foreground: each index's insert first waits while any search, slot
                selection, row gather or host attention of this process runs (a background
                indexing beside a decode exchange: host_index/csrc/hi_gate.h).

        Returns:
            The seconds the inserts waited so, summed over the threads (0 without yielding).
        """
        self.store._require_floats("HostContext.index_stored")
        ef = _insert_ef(ef)
        seqs, layers = ([int(x) for x in _dtypes.as_ids(np.atleast_1d(a), name, ndim=1)]
                        for a, name in ((seqs, "seqs"), (layers, "layers")))
        if len(seqs) != len(layers) or len(set(zip(seqs, layers))) != len(seqs):
            raise ValueError(f"seqs {seqs} and layers {layers} must be equally many distinct pairs")
        for s, l in zip(seqs, layers):
            self.store._check(s, l)
        starts = [_covered(self._ix[s][l]) for s, l in zip(seqs, layers)]  # `indexed`, checked above
        q = None
        if queries is not None and self.kind == "roar":
            qshape = np.shape(queries)
            lengths = self.store.lengths()
            pending = {int(lengths[s, l]) - st for s, l, st in zip(seqs, layers, starts)}
            if (len(qshape) != 4 or qshape[:2] != (len(seqs), self.num_q_heads)
                    or qshape[3] != self.head_dim or pending != {qshape[2]}):
                raise ValueError(f"queries {qshape} must be [{len(seqs)}, {self.num_q_heads}, n, "
                                 f"{self.head_dim}] with n the unindexed tokens of every pair "
                                 f"({sorted(pending)})")
            q = self._insert_queries(queries, qshape)
        nthreads = 0 if threads is None else _dtypes.positive_int(threads, "threads")
        return self._extend(seqs, layers, starts, q, nthreads, ef, yield_to_foreground=bool(yield_to_foreground))

    def _insert_queries(self, queries, qshape):
        """Validated float32 queries [T, Hidx, n, D], one row per token and index head.

        qshape = [T, Hq, n, D] (checked by the caller). roar_heads="kv": the
        mean over each group's G query heads (one query per token per index).
        """
        q = _dtypes.as_f32(np.reshape(queries, (-1, self.head_dim)), "queries", ndim=2,
                           dim=self.head_dim).reshape(qshape)
        if not self.per_q_head:
            T, _, n, D = qshape
            q = np.ascontiguousarray(q.reshape(T, self.num_kv_heads, self.group, n, D).mean(
                axis=2, dtype=np.float32))
        return q

    def _extend(self, seqs, layers, starts, q, nthreads, ef: int, *, yield_to_foreground: bool = False) -> float:
        """Indexes every stored token of the (seq, layer)s in one C call -> the seconds it waited
        for foreground calls (see index_stored).

        The (seq, layer)s are checked by the callers (insert_many, index_stored). q: [T, Hidx, n, D]
        float32 (rows of tokens starts[i] ..., one per index head) or None. ef: 0 (each
        index's ef_insert) or the inserts' candidate list.
        """
        kv_of = [h // self.group if self.per_q_head else h for h in range(self.index_heads)]
        jobs = []  # one (index, K, kv head, cap, total, qstart, qrows) per index behind its store
        for i, ((k, total), s, l, st) in enumerate(zip(self.store._keys_of(zip(seqs, layers)), seqs, layers, starts)):
            for h, ix in enumerate(self._ix[s][l]):
                c = ix._c
                if c.n < total:  # len(ix) < total
                    jobs.append((c, k, kv_of[h], k.shape[1], total, st, None if q is None else q[i, h]))
        if not jobs:
            return 0.0
        return _core.insert_many(*zip(*jobs), self.store.code, ef, nthreads, yield_to_foreground)

    # -- compute ---------------------------------------------------------------

    def attend(self, layer: int, queries, *, k: int, ef: int | None = None,
               scale: float | None = None, seqs=None, return_ids: bool = False,
               threads: int | None = None):
        """Host partial attention of one layer for all query heads, in one C call.

        For each (b, h): search the head's index for the top-k keys by q.k,
        then softmax(scale * q.k) over them and the weighted sum of their values.

        Args:
            layer: the layer.
            queries: [B, Hq, D] float32/float16/bfloat16 (post-RoPE), finite.
            k: keys retrieved per query head (>= 0).
            ef: search effort (graph/roar candidate list, ivf nprobe).
            scale: score scale (default head_dim ** -0.5).
            seqs: [B] sequence ids (default 0..B-1).
            return_ids: also return the retrieved store indices.
            threads: OpenMP threads (default: all).

        Returns:
            o [B, Hq, D] float32 normalized over the retrieved set, lse [B, Hq]
            float32 (natural log of sum exp(scale * q.k); -inf with o = 0 when
            nothing is retrieved), scanned [B, Hq] int64, and with return_ids,
            ids [B, Hq, k] int64 (-1 padded).
        """
        self.store._require_floats("HostContext.attend")
        q, seqs, bufs = self._layer_args(layer, queries, seqs)
        B = q.shape[0]
        k = _dtypes.positive_int(k, "k", allow_zero=True)
        ef = 0 if ef is None else _dtypes.positive_int(ef, "ef")
        scale = self.head_dim ** -0.5 if scale is None else float(scale)
        if not np.isfinite(scale):
            raise ValueError(f"scale={scale} must be finite")
        nthreads = 0 if threads is None else _dtypes.positive_int(threads, "threads")
        ixs = tuple(ix._c for s in seqs for ix in self._ix[s][layer])
        o = np.empty(q.shape, np.float32)
        lse = np.empty(q.shape[:2], np.float32)
        scanned = np.empty(q.shape[:2], np.int64)
        ids = np.empty(q.shape[:2] + (k,), np.int64) if return_ids else None
        _core.attend(ixs, tuple(b[0] for b in bufs), tuple(b[1] for b in bufs),
                     tuple(b[0].shape[1] for b in bufs), tuple(b[2] for b in bufs),
                     self.store.code, self.num_kv_heads, self.head_dim, q, B, self.num_q_heads,
                     self.per_q_head, k, ef, scale, o, lse, scanned, ids, nthreads)
        return (o, lse, scanned, ids) if return_ids else (o, lse, scanned)

    def _layer_args(self, layer, queries, seqs):
        """Validated (queries f32 [B, Hq, D], seqs list, per-seq store buffers)."""
        q = _dtypes.as_f32(queries, "queries", ndim=3, dim=self.head_dim)
        B = q.shape[0]
        if q.shape[1] != self.num_q_heads:
            raise ValueError(f"queries {q.shape} must be [B, {self.num_q_heads}, {self.head_dim}]")
        seqs = list(range(B)) if seqs is None else _seq_list(seqs)
        if len(seqs) != B:
            raise ValueError(f"{len(seqs)} seqs for {B} query rows")
        if B == 0:
            raise ValueError("queries has no rows")
        for s in seqs:
            self.store._check(s, layer)
        return q, seqs, [self.store.buffers(s, layer) for s in seqs]

    def search(self, layer: int, queries, *, k: int, ef: int | None = None, heads=None,
               seqs=None, threads: int | None = None):
        """Top-k store ids of one layer for all (seq, query head), in one C call.

        The search half of `attend`: (b, h) gets exactly what
        `index(seqs[b], layer, h if per_q_head else h // G).search(queries[b, h], k, ef=ef)`
        returns (per_q_head: roar with roar_heads="query").

        Args:
            layer: the layer.
            queries: [B, Hq, D] float32/float16/bfloat16 (post-RoPE), finite.
            k: ids per query head (>= 0).
            ef: search effort (graph/roar candidate list, ivf nprobe).
            heads: [B, Hq] bool, the (seq, head)s to search (default all);
                the others get ids -1 and scanned 0.
            seqs: [B] sequence ids (default 0..B-1).
            threads: OpenMP threads (default: all; at most one per searched head).

        Returns:
            ids [B, Hq, k] int64 (best first, -1 padded), scanned [B, Hq] int64.
        """
        self.store._require_floats("HostContext.search")
        q, seqs, _ = self._layer_args(layer, queries, seqs)
        B = q.shape[0]
        mask = None
        if heads is not None:
            mask = np.asarray(heads)
            if mask.shape != (B, self.num_q_heads) or mask.dtype != np.bool_:
                raise ValueError(f"heads {mask.shape} {mask.dtype} must be a bool "
                                 f"[{B}, {self.num_q_heads}] mask")
            mask = np.ascontiguousarray(mask)
        return self._search_rows([(s, layer) for s in seqs], q, k, ef, mask, threads)

    def _search_rows(self, pairs, q, k, ef, mask, threads):
        """One C search call: query row i [Hq, D] of q searches the indexes of (seq, layer)
        pairs[i] (checked by the callers, search and search_layers) -> ids [len(pairs), Hq, k],
        scanned [len(pairs), Hq]."""
        k = _dtypes.positive_int(k, "k", allow_zero=True)
        ef = 0 if ef is None else _dtypes.positive_int(ef, "ef")
        nthreads = 0 if threads is None else _dtypes.positive_int(threads, "threads")
        bufs = self.store._keys_of(pairs)  # (K, length) of each
        ixs = tuple(ix._c for s, l in pairs for ix in self._ix[s][l])
        ids = np.empty((len(pairs), self.num_q_heads, k), np.int64)
        scanned = np.empty((len(pairs), self.num_q_heads), np.int64)
        _core.search(ixs, tuple(b[0] for b in bufs), tuple(b[0].shape[1] for b in bufs),
                     tuple(b[1] for b in bufs), self.store.code, self.num_kv_heads,
                     self.head_dim, q, len(pairs), self.num_q_heads, self.per_q_head, k, ef, mask,
                     ids, scanned, nthreads)
        return ids, scanned

    def search_layers(self, layers, queries, *, k: int, ef: int | None = None, heads=None,
                      threads: int | None = None):
        """`search` of several layers for every sequence, in one C call.

        One team of threads takes all len(layers) * B * Hq searches at once, so
        a step's searches keep every core busy (per-layer calls of a few heads
        leave most of a 16-core team idle and pay its wake-up per layer).

        Args:
            layers: [T] distinct layer ids.
            queries: [T, B, Hq, D] float32/float16/bfloat16 (post-RoPE), finite;
                B = num_seqs.
            k, ef, threads: as in `search`.
            heads: [T, B, Hq] bool, the (layer, seq, head)s to search (default all);
                the others get ids -1 and scanned 0.

        Returns:
            ids [T, B, Hq, k] int64 (best first, -1 padded), scanned [T, B, Hq] int64;
            row (t, b) equals `search(layers[t], queries[t])[.][b]`.
        """
        self.store._require_floats("HostContext.search_layers")
        layers = [int(x) for x in _dtypes.as_ids(np.atleast_1d(layers), "layers", ndim=1)] if len(layers) else []
        if len(set(layers)) != len(layers):
            raise ValueError(f"layers {layers} must be distinct")
        qshape = np.shape(queries)
        want = (len(layers), self.num_seqs, self.num_q_heads, self.head_dim)
        if qshape != want:
            raise ValueError(f"queries {qshape} must be {list(want)} = [layers, seqs, q heads, head_dim]")
        T, B = want[:2]
        k = _dtypes.positive_int(k, "k", allow_zero=True)
        if T == 0:
            return np.empty((0, B, self.num_q_heads, k), np.int64), np.empty((0, B, self.num_q_heads), np.int64)
        q = _dtypes.as_f32(np.reshape(queries, (T * B, self.num_q_heads, self.head_dim)), "queries", ndim=3,
                           dim=self.head_dim)
        mask = None
        if heads is not None:
            mask = np.asarray(heads)
            if mask.shape != (T, B, self.num_q_heads) or mask.dtype != np.bool_:
                raise ValueError(f"heads {mask.shape} {mask.dtype} must be a bool "
                                 f"[{T}, {B}, {self.num_q_heads}] mask")
            mask = np.ascontiguousarray(mask.reshape(T * B, self.num_q_heads))
        pairs = [(s, l) for l in layers for s in range(B)]
        for s, l in pairs:
            self.store._check(s, l)
        ids, scanned = self._search_rows(pairs, q, k, ef, mask, threads)
        return ids.reshape(T, B, self.num_q_heads, k), scanned.reshape(T, B, self.num_q_heads)

    def attend_ids(self, layer: int, queries, ids, *, scale: float | None = None, seqs=None,
                   threads: int | None = None):
        """Host partial attention of one layer over given store ids, in one C call.

        For each (b, h): softmax(scale * q.k) over the keys ids[b, h] of query
        head h's KV head and the weighted sum of their values. Ids < 0 (e.g.
        -1 padding) or at or past the store length are skipped; a repeated id
        counts each time it appears.

        Args:
            layer: the layer.
            queries: [B, Hq, D] float32/float16/bfloat16 (post-RoPE), finite.
            ids: [B, Hq, n] int store indices.
            scale: score scale (default head_dim ** -0.5).
            seqs: [B] sequence ids (default 0..B-1).
            threads: OpenMP threads (default: all; small layers run on the
                calling thread).

        Returns:
            o [B, Hq, D] float32 normalized over the given set, lse [B, Hq]
            float32 (-inf with o = 0 where no id is valid), as `attend`.
        """
        self.store._require_floats("HostContext.attend_ids")
        q, seqs, bufs = self._layer_args(layer, queries, seqs)
        B = q.shape[0]
        a = _dtypes.as_ids(ids, "ids", ndim=3)
        if a.shape[:2] != (B, self.num_q_heads):
            raise ValueError(f"ids {a.shape} must be [{B}, {self.num_q_heads}, n]")
        scale = self.head_dim ** -0.5 if scale is None else float(scale)
        if not np.isfinite(scale):
            raise ValueError(f"scale={scale} must be finite")
        nthreads = 0 if threads is None else _dtypes.positive_int(threads, "threads")
        o = np.empty(q.shape, np.float32)
        lse = np.empty(q.shape[:2], np.float32)
        _core.attend_ids(tuple(b[0] for b in bufs), tuple(b[1] for b in bufs),
                         tuple(b[0].shape[1] for b in bufs), tuple(b[2] for b in bufs),
                         self.store.code, self.num_kv_heads, self.head_dim, q, B,
                         self.num_q_heads, a, a.shape[2], scale, o, lse, nthreads)
        return o, lse

    def fetch_pages(self, seq: int, layer: int, kv_heads, page_ids, *, out_k=None, out_v=None,
                    threads=None):
        """FreeKV recall: copies pages of K and V; see KVStore.fetch_pages."""
        return self.store.fetch_pages(seq, layer, kv_heads, page_ids, out_k=out_k, out_v=out_v,
                                      threads=threads)

    def fetch_pages_many(self, groups, group_of, kv_heads, page_ids, *, out_k=None, out_v=None,
                         threads=None):
        """FreeKV recall over several (seq, layer) stores in one call; see KVStore.fetch_pages_many."""
        return self.store.fetch_pages_many(groups, group_of, kv_heads, page_ids, out_k=out_k, out_v=out_v,
                                           threads=threads)

    # -- persistence -------------------------------------------------------------

    def save(self, path, *, meta: dict | None = None) -> None:
        """Writes the store and every index to one checksummed file, atomically.

        meta: JSON-serializable identity of the context (e.g. model name,
        config hash, dtype), returned as `.meta` by `load` and checked by its
        `expect_meta`.
        """
        from host_index import _saveload
        self.wait_builds()  # never a half-built index on disk
        _saveload.save_context(self, path, dict(meta if meta is not None else self.meta))

    def copy(self) -> "HostContext":
        """An independent copy in memory (store, indexes, meta), as `save` then `load` would
        give, for the same (seq, layer)s' capacity; waits for queued builds first."""
        from host_index import _saveload
        self.wait_builds()
        return _saveload.copy_context(self)

    @classmethod
    def load(cls, path, *, expect_meta: dict | None = None,
             max_bytes: int | None = None) -> "HostContext":
        """Reads a file written by `save`.

        Args:
            expect_meta: entries that must equal the saved meta (e.g. the model
                identity): a mismatch raises ValueError.
            max_bytes: store cap for the loaded context.

        Raises:
            CorruptFileError (a ValueError): foreign, truncated or corrupt file.
            ValueError: expect_meta mismatch.
        """
        from host_index import _saveload
        return _saveload.load_context(cls, path, expect_meta, max_bytes)


def group_rows(a, g: int, G: int) -> np.ndarray:
    """Training rows of index head g: [G*M, X] from a [Hq, M, X] per-query-head array.

    G = 1: query head g's rows as they are. G > 1 (roar_heads="kv"): query heads
    gG..gG+G-1 interleaved position-major, row m*G + j = head gG+j's row m, so
    the rows stay in prompt order (roar picks its hub seeds from the last
    quarter of the rows).
    """
    if G == 1:
        return a[g]
    part = a[g * G:(g + 1) * G]  # [G, M, X]
    return np.ascontiguousarray(part.transpose(1, 0, 2)).reshape(-1, part.shape[2])


def _build_head(ix, n, h, G, train_queries, train_topk, candidates, threads) -> None:
    """Builds index head h over n keys from its layer's checked training arguments ([Hq, M, D],
    [Hq, M, N_q]; h's rows are group_rows(., h, G)) and its KV head's candidates [N, C]: their
    copies for the C call (h's rows, int64 ids, contiguous) are made here, on the build's own
    thread, so a caller queuing builds (build_layer(wait=False)) does not wait for them while
    every core builds."""
    tq, tk = (None if a is None else group_rows(a, h, G) for a in (train_queries, train_topk))
    ix.prepare_build(n, train_queries=tq, train_topk=tk, connect_candidates=candidates)(threads)


def _insert_ef(ef) -> int:
    """An insert's `ef` argument -> the C call's: 0 for None (each index's ef_insert)."""
    return 0 if ef is None else _dtypes.positive_int(ef, "ef")


def _covered(indexes) -> int:
    """Tokens every one of a (seq, layer)'s indexes covers (0 without indexes: raw16)."""
    return min([ix._c.n for ix in indexes], default=0)  # len(ix), read without a call per index


def _seq_list(seqs) -> list[int]:
    """Sequence ids as ints (checked in range by the store): floats and strings were read by int()."""
    return [int(s) for s in _dtypes.as_ids(seqs, "seqs", ndim=None).reshape(-1)]
