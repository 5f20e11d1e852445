"""KVStore: host-resident keys and values, per (sequence, layer), head-major.

Each (seq, layer) holds two arrays [Hkv, cap, D] in the storage dtype (float32,
float16, or bfloat16 held as uint16 bits): every (seq, layer, kv head) is one
contiguous [cap, D] block (FreeKV's "HND" layout), so a page of 32 consecutive
tokens of one head is one contiguous copy. Tokens are addressed by their store
index 0..length-1; what a store index means (which absolute position) is the
caller's business.

dtype "raw16" holds rows the caller encoded (D uint16 words each, e.g. int8
values and a scale packed on the GPU) and copies them in and out bit for bit;
whatever would read them as numbers (keys(), values(), any index) refuses it.
"""

from __future__ import annotations

import threading

import numpy as np

from host_index import _core
from host_index import _dtypes


class StoreFullError(MemoryError):
    """An append would take the store past its max_bytes; nothing was written."""


class KVStore:
    """Appendable host K/V store with memory accounting and an optional cap.

    Thread safety: appends are serialized by an internal lock. Readers (C
    searches/attention through a HostContext) may run concurrently with
    appends: an append that grows an array replaces it, and a reader holding
    the old array keeps reading valid data below the length it was given.
    """

    def __init__(self, num_seqs: int, num_layers: int, num_kv_heads: int, head_dim: int, *,
                 dtype: str = "float16", max_bytes: int | None = None, page_size: int = 32):
        """Creates an empty store.

        Args:
            num_seqs, num_layers, num_kv_heads, head_dim: shape of the cache.
            dtype: storage dtype, "float16" | "bfloat16" | "float32", or "raw16"
                (opaque uint16 words, head_dim of them per row; copied only).
            max_bytes: cap on the bytes of all K/V arrays (None: no cap).
            page_size: capacity is rounded up to whole pages (FreeKV's unit).
        """
        self.num_seqs = _dtypes.positive_int(num_seqs, "num_seqs")
        self.num_layers = _dtypes.positive_int(num_layers, "num_layers")
        self.num_kv_heads = _dtypes.positive_int(num_kv_heads, "num_kv_heads")
        self.head_dim = _dtypes.positive_int(head_dim, "head_dim")
        if self.head_dim > 2048:
            raise ValueError(f"head_dim={head_dim} must be <= 2048")
        self.dtype = dtype
        self.code = _dtypes.code_of(dtype)
        self.page_size = _dtypes.positive_int(page_size, "page_size")
        self.max_bytes = None if max_bytes is None else _dtypes.positive_int(
            max_bytes, "max_bytes", allow_zero=True)
        npdt = _dtypes.STORAGE[self.code]
        empty = lambda: np.empty((self.num_kv_heads, 0, self.head_dim), npdt)
        # [seq][layer] -> [Hkv, cap, D]
        self._k = [[empty() for _ in range(num_layers)] for _ in range(num_seqs)]
        self._v = [[empty() for _ in range(num_layers)] for _ in range(num_seqs)]
        self._len = np.zeros((num_seqs, num_layers), np.int64)
        self._nbytes = 0
        self._lock = threading.Lock()
        self.meta: dict = {}

    @property
    def itemsize(self) -> int:
        return self.storage_dtype.itemsize

    @property
    def storage_dtype(self) -> np.dtype:
        """The NumPy dtype rows are held and returned in (bfloat16 and raw16 as uint16)."""
        return _dtypes.STORAGE[self.code]

    @property
    def nbytes(self) -> int:
        """Bytes allocated for all K/V arrays (capacity, not just length)."""
        return self._nbytes

    def _require_floats(self, what: str) -> None:
        """Refuses `what`, which reads the stored values as numbers, on a raw16 store."""
        if self.code == _dtypes.RAW16:
            raise ValueError(f"{what} reads stored values as numbers, but dtype={self.dtype!r} "
                             f"holds opaque 16-bit words (copy them out with fetch_pages or buffers)")

    def _input(self, x, what: str, *, ndim: int) -> tuple[np.ndarray, int]:
        """(C-ready array, code) of caller keys/values: uint16 words for raw16, else floats."""
        if self.code == _dtypes.RAW16:
            return _dtypes.as_raw16(x, what, ndim=ndim)
        return _dtypes.as_c_array(x, what, ndim=ndim)

    def _check(self, seq, layer):
        if not (isinstance(seq, (int, np.integer)) and 0 <= seq < self.num_seqs):
            raise ValueError(f"seq={seq!r} out of range [0, {self.num_seqs})")
        if not (isinstance(layer, (int, np.integer)) and 0 <= layer < self.num_layers):
            raise ValueError(f"layer={layer!r} out of range [0, {self.num_layers})")

    def length(self, seq: int, layer: int) -> int:
        """Tokens stored for (seq, layer)."""
        self._check(seq, layer)
        return int(self._len[seq, layer])

    def lengths(self) -> np.ndarray:
        """[num_seqs, num_layers] int64: tokens stored for every (seq, layer), a copy (one call
        instead of a `length` call per pair: decode's per-step bookkeeping reads them all)."""
        with self._lock:
            return self._len.copy()

    def capacity(self, seq: int, layer: int) -> int:
        self._check(seq, layer)
        return self._k[seq][layer].shape[1]

    def buffers(self, seq: int, layer: int):
        """(K [Hkv, cap, D], V [Hkv, cap, D], length) in the storage dtype; rows
        at or past length are unspecified."""
        self._check(seq, layer)
        # One read of the pair under the lock so K and V match in capacity.
        with self._lock:
            return self._k[seq][layer], self._v[seq][layer], int(self._len[seq, layer])

    def _keys_of(self, pairs) -> list:
        """[(K [Hkv, cap, D], length)] of (seq, layer) pairs the caller checked (`_check`), read
        under one hold of the lock (`buffers` of each, without its check and V)."""
        with self._lock:
            return [(self._k[s][l], int(self._len[s, l])) for s, l in pairs]

    def _as_float(self, a: np.ndarray) -> np.ndarray:
        if self.code != _dtypes.BF16:
            return a.astype(np.float32)
        return (a.astype(np.uint32) << 16).view(np.float32)

    def keys(self, seq: int, layer: int) -> np.ndarray:
        """Copy of the stored keys as float32 [Hkv, length, D]."""
        self._require_floats("keys()")
        k, _, n = self.buffers(seq, layer)
        return self._as_float(k[:, :n])

    def to_float32(self, rows: np.ndarray) -> np.ndarray:
        """Rows in the storage dtype (as gather_rows returns them) as float32."""
        self._require_floats("to_float32()")
        return self._as_float(np.asarray(rows))

    def values(self, seq: int, layer: int) -> np.ndarray:
        """Copy of the stored values as float32 [Hkv, length, D]."""
        self._require_floats("values()")
        _, v, n = self.buffers(seq, layer)
        return self._as_float(v[:, :n])

    def _round(self, n: int) -> int:
        p = self.page_size
        return -(-n // p) * p

    def reserve(self, seq: int, layer: int, n: int) -> None:
        """Grows (seq, layer) to hold at least n tokens (e.g. before a prefill).

        Raises:
            StoreFullError: the growth would cross max_bytes (nothing changes).
        """
        self._check(seq, layer)
        with self._lock:
            self._grow(seq, layer, self._round(_dtypes.positive_int(n, "n", allow_zero=True)))

    def _make_room(self, seq: int, layer: int, n: int) -> int:
        """Grows (seq, layer) to hold n tokens, by half its capacity at least (amortized) or,
        where that would cross max_bytes, exactly; returns the capacity. Caller holds the lock."""
        cap = self._k[seq][layer].shape[1]
        if n > cap:
            need = self._round(n)
            try:
                self._grow(seq, layer, self._round(max(need, cap + cap // 2)))
            except StoreFullError:
                self._grow(seq, layer, need)
            cap = self._k[seq][layer].shape[1]
        return cap

    def _grow(self, seq, layer, cap):
        """Reallocates (seq, layer) to capacity cap; caller holds the lock."""
        old_k, old_v = self._k[seq][layer], self._v[seq][layer]
        old_cap = old_k.shape[1]
        if cap <= old_cap:
            return
        delta = 2 * (cap - old_cap) * self.num_kv_heads * self.head_dim * self.itemsize
        if self.max_bytes is not None and self._nbytes + delta > self.max_bytes:
            raise StoreFullError(
                f"growing seq={seq} layer={layer} to {cap} tokens needs {delta} more bytes: "
                f"{self._nbytes} + {delta} > max_bytes={self.max_bytes}")
        n = int(self._len[seq, layer])
        shape = (self.num_kv_heads, cap, self.head_dim)
        k = np.empty(shape, old_k.dtype)
        v = np.empty(shape, old_v.dtype)
        k[:, :n] = old_k[:, :n]
        v[:, :n] = old_v[:, :n]
        self._k[seq][layer], self._v[seq][layer] = k, v
        self._nbytes += delta

    def append(self, seq: int, layer: int, start: int, keys, values, *,
               threads: int | None = None) -> int:
        """Stores keys/values for store indices start .. start + n - 1.

        The part that overlaps what is already stored is skipped, so repeating
        a call is harmless; a gap (start > length) is an error. Validation and
        the capacity check happen before anything is written.

        Args:
            seq, layer: which cache.
            start: store index of the first token in keys/values.
            keys, values: [Hkv, n, D] float32/float16/bfloat16, finite; uint16
                (any bits, copied as they are) for a raw16 store.
            threads: OpenMP threads for the conversion (default: all).

        Returns:
            The number of new tokens stored.

        Raises:
            ValueError / TypeError: bad shape, dtype, start, NaN/inf, or a value
                out of the storage dtype's range.
            StoreFullError: max_bytes would be crossed.
        """
        self._check(seq, layer)
        start = _dtypes.positive_int(start, "start", allow_zero=True)
        k, kc = self._input(keys, "keys", ndim=3)
        v, vc = self._input(values, "values", ndim=3)
        want = (self.num_kv_heads, k.shape[1], self.head_dim)
        if k.shape != want or v.shape != want:
            raise ValueError(f"keys {k.shape} and values {v.shape} must both be "
                             f"[num_kv_heads, n, head_dim] = {want}")
        nthreads = 0 if threads is None else _dtypes.positive_int(threads, "threads")
        n = k.shape[1]
        with self._lock:
            length = int(self._len[seq, layer])
            if start > length:
                raise ValueError(f"start={start} leaves a gap after the {length} stored tokens "
                                 f"of seq={seq} layer={layer}")
            skip = length - start
            if skip >= n:
                return 0
            new = n - skip
            # Reject bad values before touching the store (nothing half-written).
            for name, a, c in (("keys", k, kc), ("values", v, vc)):
                part = np.ascontiguousarray(a[:, skip:]) if skip else a
                if _core.count_bad(part, c, self.code, self.num_kv_heads * new * self.head_dim):
                    raise ValueError(f"{name}: contains NaN/inf or values out of "
                                     f"{self.dtype} range")
            cap = self._make_room(seq, layer, length + new)
            D = self.head_dim
            for a, c, dst in ((k, kc, self._k[seq][layer]), (v, vc, self._v[seq][layer])):
                _core.convert(a, c, skip * D, n * D, dst, self.code, length * D, cap * D,
                              self.num_kv_heads, new * D, nthreads)
            self._len[seq, layer] = length + new
            return new

    def append_tokens(self, seqs, layers, starts, keys, values) -> int:
        """`append` of one token to each of T distinct (seq, layer) stores, validated and
        converted in one pass: a decode step's evicted tokens over every layer and sequence.

        Args:
            seqs, layers, starts: [T] int: store (seqs[t], layers[t]) takes its token at store
                index starts[t] (skipped if stored already; a gap is an error).
            keys, values: [T, Hkv, D] float32/float16/bfloat16, finite (uint16 for raw16).

        Returns:
            The number of new tokens stored. Everything is checked before anything is
            written, except that a store growth refused by max_bytes (StoreFullError) leaves
            the tokens of earlier stores in the call written.
        """
        s = _dtypes.as_ids(seqs, "seqs", ndim=1)
        l = _dtypes.as_ids(layers, "layers", ndim=1)
        t = _dtypes.as_ids(starts, "starts", ndim=1)
        k, kc = self._input(keys, "keys", ndim=3)
        v, vc = self._input(values, "values", ndim=3)
        T = s.size
        want = (T, self.num_kv_heads, self.head_dim)
        if not (l.size == t.size == T and k.shape == want and v.shape == want):
            raise ValueError(f"seqs {s.shape}, layers {l.shape}, starts {t.shape}, keys {k.shape} and values "
                             f"{v.shape} must be [T] x3 and [T, num_kv_heads, head_dim] = {want}")
        if T and (s.min() < 0 or s.max() >= self.num_seqs or l.min() < 0 or l.max() >= self.num_layers):
            raise ValueError(f"seqs must lie in [0, {self.num_seqs}) and layers in [0, {self.num_layers})")
        if T and t.min() < 0:
            raise ValueError(f"starts must be >= 0, got {t.min()}")
        flat = s * self.num_layers + l  # in range (checked above)
        if T and np.bincount(flat).max() > 1:
            raise ValueError("append_tokens: the (seq, layer) pairs must be distinct")
        total = T * self.num_kv_heads * self.head_dim
        converted = []
        for name, a, c in (("keys", k, kc), ("values", v, vc)):
            if _core.count_bad(a, c, self.code, total):
                raise ValueError(f"{name}: contains NaN/inf or values out of {self.dtype} range")
            out = np.empty(want, _dtypes.STORAGE[self.code])
            _core.convert(a, c, 0, total, out, self.code, 0, total, 1, total, 0)
            converted.append(out)
        with self._lock:
            lengths = self._len[s, l]
            gap = np.flatnonzero(t > lengths)
            if gap.size:
                i = int(gap[0])
                raise ValueError(f"starts[{i}]={t[i]} leaves a gap after the {lengths[i]} stored tokens of "
                                 f"seq={s[i]} layer={l[i]}")
            new = np.flatnonzero(t == lengths)  # the others are stored already
            done = 0
            try:  # Python ints and rows read once (not NumPy scalars and views per token)
                for seq, layer, at, k_row, v_row in zip(s[new].tolist(), l[new].tolist(), lengths[new].tolist(),
                                                        converted[0][new], converted[1][new]):
                    if at >= self._k[seq][layer].shape[1]:
                        self._make_room(seq, layer, at + 1)
                    self._k[seq][layer][:, at] = k_row
                    self._v[seq][layer][:, at] = v_row
                    done += 1
            finally:  # the lengths of the stores written (all, unless a growth was refused), in one write
                written = new[:done]
                self._len[s[written], l[written]] = lengths[written] + 1
            return int(new.size)

    def save(self, path, *, meta: dict | None = None) -> None:
        """Writes the store to one checksummed file, atomically (see HostContext.save)."""
        from host_index import _saveload
        _saveload.save_store(self, path, dict(meta or {}))

    @classmethod
    def load(cls, path, *, expect_meta: dict | None = None,
             max_bytes: int | None = None) -> "KVStore":
        """Reads a file written by `save`; raises CorruptFileError (a ValueError)
        on a foreign, truncated or corrupt file."""
        from host_index import _saveload
        return _saveload.load_store(cls, path, expect_meta, max_bytes)

    def fetch_pages(self, seq: int, layer: int, kv_heads, page_ids, *, out_k=None, out_v=None,
                    threads: int | None = None):
        """Copies pages (page_size consecutive tokens of one head) of K and V.

        Args:
            kv_heads: [P] int, the head of each page.
            page_ids: [P] int, page p covers tokens p*page_size .. (p+1)*page_size-1;
                rows past the stored length are zero-filled.
            out_k, out_v: optional C-contiguous [P, page_size, D] arrays of the
                storage dtype (uint16 for bfloat16 and raw16; e.g. pinned buffers).

        Returns:
            (out_k, out_v).
        """
        self._check(seq, layer)
        p = _dtypes.as_ids(page_ids, "page_ids", ndim=1)
        return self.fetch_pages_many([(seq, layer)], np.zeros(p.shape, np.int64), kv_heads, p, out_k=out_k,
                                     out_v=out_v, threads=threads)

    def fetch_pages_many(self, groups, group_of, kv_heads, page_ids, *, out_k=None, out_v=None,
                         threads: int | None = None):
        """fetch_pages over several (seq, layer) stores in one C call (one parallel loop over
        every page): page i comes from store groups[group_of[i]].

        Args:
            groups: sequence of G (seq, layer) pairs.
            group_of, kv_heads, page_ids: [P] int each.
            out_k, out_v: as fetch_pages.

        Returns:
            (out_k, out_v), [P, page_size, D] each.
        """
        return self._gather_multi(groups, group_of, kv_heads, page_ids, self.page_size, "page_ids",
                                  out_k=out_k, out_v=out_v, threads=threads)

    def _gather_multi(self, groups, group_of, kv_heads, ids, page: int, what: str, *, out_k, out_v, threads):
        """[P, page, D] K and V: runs ids[i] * page .. + page - 1 of head kv_heads[i] of store
        groups[group_of[i]], zero past the stored length; with page 1, id -1 is a zero row."""
        g = _dtypes.as_ids(group_of, "group_of", ndim=1)
        h = _dtypes.as_ids(kv_heads, "kv_heads", ndim=1)
        p = _dtypes.as_ids(ids, what, ndim=1)
        if not g.shape == h.shape == p.shape:
            raise ValueError(f"group_of {g.shape}, kv_heads {h.shape} and {what} {p.shape} differ in length")
        stores = [self.buffers(int(seq), int(layer)) for seq, layer in groups]
        lens = np.array([n for _, _, n in stores], np.int64)
        if g.size and (g.min() < 0 or g.max() >= len(stores)):
            raise ValueError(f"group_of must lie in [0, {len(stores)})")
        if h.size and (h.min() < 0 or h.max() >= self.num_kv_heads):
            raise ValueError(f"kv_heads must lie in [0, {self.num_kv_heads})")
        lowest = -1 if page == 1 else 0
        # page id < ceil(len / page): id * page >= len would wrap for huge ids and pass
        bad = (p < lowest) | (p >= -(-lens[g] // page)) if p.size else np.zeros(0, bool)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            unit = "row (or -1)" if page == 1 else "page"
            raise ValueError(f"{what}[{i}] = {p[i]} is not a stored {unit} of (seq, layer) "
                             f"{tuple(groups[g[i]])} ({lens[g[i]]} tokens)")
        outs = self._out_buffers((h.size, page, self.head_dim), out_k, out_v)
        caps = np.array([k.shape[1] for k, _, _ in stores], np.int64)
        nthreads = 0 if threads is None else _dtypes.positive_int(threads, "threads")
        _core.gather_pages_multi([k for k, _, _ in stores], [v for _, v, _ in stores], self.code,
                                 self.num_kv_heads, self.head_dim, page, caps, lens, g, h, p,
                                 h.size, outs[0], outs[1], nthreads)
        return outs[0], outs[1]

    def _out_buffers(self, shape, out_k, out_v) -> list:
        """[out_k, out_v] of `shape` in the storage dtype: the caller's (checked) or new."""
        dt = _dtypes.STORAGE[self.code]
        outs = []
        for name, o in (("out_k", out_k), ("out_v", out_v)):
            if o is None:
                o = np.empty(shape, dt)
            elif not (isinstance(o, np.ndarray) and o.shape == shape and self._holds_rows(o.dtype)
                      and o.flags.c_contiguous and o.flags.writeable):
                raise ValueError(f"{name} must be a writable C-contiguous {shape} array of {dt}"
                                 f"{' (or ml_dtypes bfloat16)' if self.code == _dtypes.BF16 else ''}")
            outs.append(o)
        return outs

    def _holds_rows(self, dtype: np.dtype) -> bool:
        """Whether an output buffer of `dtype` takes the stored bits as they are: the storage dtype,
        bfloat16 for a bfloat16 store (held as uint16), any 16-bit type for raw16. Checked by size
        alone, float32 rows landed in an int32 buffer and bfloat16 bits in a float16 one."""
        dt = _dtypes.STORAGE[self.code]
        if self.code == _dtypes.RAW16:
            return dtype.itemsize == 2
        return dtype == dt or (self.code == _dtypes.BF16 and dtype.name == "bfloat16")

    def gather_rows(self, seq: int, layer: int, kv_heads, ids, *, out_k=None, out_v=None,
                    threads=None):
        """Copies stored K/V rows by store index into [..., D] buffers, in one C call.

        Args:
            kv_heads: int array, the KV head of each row (broadcast against ids).
            ids: int array [...], store indices; -1 = none (the row is zero-filled).
            out_k, out_v: optional C-contiguous [*ids.shape, D] arrays of the storage
                dtype (uint16 for bfloat16 and raw16), e.g. a slice of a larger step buffer.

        Returns:
            (out_k, out_v) [*ids.shape, D] in the storage dtype.

        Raises:
            ValueError: an id outside [0, stored length) other than -1, or a head
                outside [0, num_kv_heads); nothing is copied.
        """
        self._check(seq, layer)
        i = _dtypes.as_ids(ids, "ids", ndim=None)  # floats were truncated (1.9 read row 1)
        h = np.broadcast_to(_dtypes.as_ids(kv_heads, "kv_heads", ndim=None), i.shape)
        k, v = self.gather_rows_many([(seq, layer)], np.zeros(i.size, np.int64), h.reshape(-1), i.reshape(-1),
                                     out_k=out_k, out_v=out_v, threads=threads)
        return k.reshape(i.shape + (self.head_dim,)), v.reshape(i.shape + (self.head_dim,))

    def gather_rows_many(self, groups, group_of, kv_heads, ids, *, out_k=None, out_v=None, threads=None):
        """gather_rows over several (seq, layer) stores in one C call (one parallel loop over
        every row): row i comes from store groups[group_of[i]]. A call per store cost the
        per_step bridge a thread team per (layer, seq) each step.

        Args:
            groups: sequence of G (seq, layer) pairs.
            group_of, kv_heads, ids: [T] int each; id -1 = a zero row.
            out_k, out_v: optional C-contiguous arrays of T rows of D in the storage dtype
                (any shape [..., D]; filled in place).

        Returns:
            (out_k, out_v) [T, D] in the storage dtype.
        """
        T = np.asarray(ids).size
        rows = []  # the caller's buffers as [T, 1, D] views (C order: no copy)
        for name, o in (("out_k", out_k), ("out_v", out_v)):
            if o is not None and not (isinstance(o, np.ndarray) and o.flags.c_contiguous
                                      and o.size == T * self.head_dim):
                raise ValueError(f"{name} must be a C-contiguous array of {T} rows of {self.head_dim}")
            rows.append(None if o is None else o.reshape(T, 1, self.head_dim))
        k, v = self._gather_multi(groups, group_of, kv_heads, ids, 1, "ids", out_k=rows[0], out_v=rows[1],
                                  threads=threads)
        return k.reshape(T, self.head_dim), v.reshape(T, self.head_dim)
