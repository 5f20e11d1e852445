"""Saving and loading a KVStore or a HostContext (file format in _persist)."""

from __future__ import annotations

import numpy as np

from host_index import _persist
from host_index._persist import CorruptFileError

CONTEXT_FORMAT = "kvjax.host_context/1"
STORE_FORMAT = "kvjax.kv_store/1"
INDEX_PARTS = ("adj", "deg", "centroids", "assign", "hubs")  # Index export() arrays, in restore()'s order


def _store_meta(store) -> dict:
    return {"num_seqs": store.num_seqs, "num_layers": store.num_layers,
            "num_kv_heads": store.num_kv_heads, "head_dim": store.head_dim,
            "dtype": store.dtype, "page_size": store.page_size,
            "lengths": store._len.tolist()}


def _store_blobs(store):
    for s in range(store.num_seqs):
        for l in range(store.num_layers):
            k, v, n = store.buffers(s, l)
            for name, a in (("k", k), ("v", v)):
                # One contiguous [n, D] block per head: [Hkv, n, D] on disk.
                yield f"{name}/{s}/{l}", [a[h, :n] for h in range(store.num_kv_heads)]


def _load_store_into(store, rd, lengths) -> None:
    for s in range(store.num_seqs):
        for l in range(store.num_layers):
            n = int(lengths[s][l])
            store.reserve(s, l, n)
            k, v, _ = store.buffers(s, l)
            for name, dst in (("k", k), ("v", v)):
                tmp = np.empty((store.num_kv_heads, n, store.head_dim), dst.dtype)
                rd.read_into(f"{name}/{s}/{l}", tmp)
                dst[:, :n] = tmp
            store._len[s, l] = n


def save_store(store, path, meta: dict) -> None:
    head = {"format": STORE_FORMAT, "store": _store_meta(store), "user": meta}
    _persist.write(path, head, _store_blobs(store))


def load_store(cls, path, expect_meta, max_bytes):
    with _persist.Reader(path) as rd:
        head = _check_head(rd, STORE_FORMAT, expect_meta)
        st = head["store"]
        try:
            store = cls(st["num_seqs"], st["num_layers"], st["num_kv_heads"], st["head_dim"],
                        dtype=st["dtype"], page_size=st["page_size"], max_bytes=max_bytes)
            _check_lengths(st["lengths"], store.num_seqs, store.num_layers)
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, CorruptFileError):
                raise
            raise CorruptFileError(f"{path}: bad store description: {e}") from e
        _load_store_into(store, rd, st["lengths"])
        store.meta = head["user"]
        return store


def save_context(ctx, path, meta: dict) -> None:
    indexes = {}

    def blobs():  # one index exported at a time (all at once held every index twice: GBs at 128K)
        yield from _store_blobs(ctx.store)
        for s in range(ctx.num_seqs):
            for l in range(ctx.num_layers):
                for h, ix in enumerate(ctx._ix[s][l]):
                    st = ix._c.export()
                    key = f"{s}/{l}/{h}"
                    indexes[key] = {"n": st["n"], "entry": st["entry"], "nlist": st["nlist"]}
                    for part in INDEX_PARTS:
                        yield f"ix/{key}/{part}", [st[part]]

    # `indexes` fills as the blobs stream out: _persist.write writes the header after them.
    head = {"format": CONTEXT_FORMAT, "store": _store_meta(ctx.store),
            "context": {"num_q_heads": ctx.num_q_heads, "kind": ctx.kind,
                        "index_params": ctx.index_params, "seed": ctx.seed,
                        "roar_heads": ctx.roar_heads},
            "indexes": indexes, "user": meta}
    _persist.write(path, head, blobs())


def load_context(cls, path, expect_meta, max_bytes):
    with _persist.Reader(path) as rd:
        head = _check_head(rd, CONTEXT_FORMAT, expect_meta)
        try:
            st, cx = head["store"], head["context"]
            params = dict(cx["index_params"])
            if cx["kind"] in ("graph", "roar"):
                # files from before ef_insert inserted with the build's beam (ef_insert 0)
                params.setdefault("ef_insert", 0)
            if cx["kind"] == "roar":
                params.setdefault("n_cooc", 0)  # files written before roar had co-occurrence links
                params.setdefault("n_hubs", 0)  # ... or hubs
            ctx = cls(st["num_seqs"], st["num_layers"], cx["num_q_heads"], st["num_kv_heads"],
                      st["head_dim"], dtype=st["dtype"], kind=cx["kind"],
                      index_params=params, max_bytes=max_bytes,
                      page_size=st["page_size"], seed=cx["seed"],
                      # files written before roar_heads existed kept one roar index per query head
                      roar_heads=cx.get("roar_heads", "query"))
            _check_lengths(st["lengths"], ctx.num_seqs, ctx.num_layers)
            idx = head["indexes"]
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, CorruptFileError):
                raise
            raise CorruptFileError(f"{path}: bad context description: {e}") from e
        _load_store_into(ctx.store, rd, st["lengths"])
        for s in range(ctx.num_seqs):
            for l in range(ctx.num_layers):
                for h, ix in enumerate(ctx._ix[s][l]):
                    key = f"{s}/{l}/{h}"
                    try:
                        d = idx[key]
                        n, entry, nlist = int(d["n"]), int(d["entry"]), int(d["nlist"])
                        if n > ctx.store.length(s, l):
                            raise ValueError(f"index covers {n} > stored tokens")
                        parts = [rd.read(f"ix/{key}/{p}") for p in INDEX_PARTS[:-1]]
                        if rd.has(f"ix/{key}/hubs"):  # files before roar's hubs have none
                            parts.append(rd.read(f"ix/{key}/hubs"))
                        ix._c.restore(n, entry, nlist, *parts)
                    except CorruptFileError:
                        raise
                    except (KeyError, TypeError, ValueError) as e:
                        raise CorruptFileError(f"{path}: index {key}: {e}") from e
        ctx.meta = head["user"]
        return ctx


def copy_context(ctx):
    """A new HostContext holding what `ctx` holds (store, indexes, meta): save_context then
    load_context without the file, so without its checksums (nothing crossed a disk)."""
    new = type(ctx)(ctx.num_seqs, ctx.num_layers, ctx.num_q_heads, ctx.num_kv_heads, ctx.head_dim,
                    dtype=ctx.store.dtype, kind=ctx.kind, index_params=ctx.index_params,
                    max_bytes=ctx.store.max_bytes, page_size=ctx.store.page_size, seed=ctx.seed,
                    roar_heads=ctx.roar_heads)
    src, dst = ctx.store, new.store
    for s in range(src.num_seqs):
        for l in range(src.num_layers):
            n = src.length(s, l)
            new.reserve(s, l, src.capacity(s, l))  # store and node arrays: the decode room `ctx` has
            for a, b in zip(src.buffers(s, l)[:2], dst.buffers(s, l)[:2]):
                b[:, :n] = a[:, :n]
            dst._len[s, l] = n
            for ix, copy in zip(ctx._ix[s][l], new._ix[s][l]):
                st = ix._c.export()
                copy._c.restore(st["n"], st["entry"], st["nlist"], *(st[p] for p in INDEX_PARTS))
    new.meta = dict(ctx.meta)
    return new


def _check_head(rd, fmt, expect_meta) -> dict:
    head = rd.meta
    if not isinstance(head, dict) or head.get("format") != fmt:
        got = head.get("format") if isinstance(head, dict) else None
        raise CorruptFileError(f"{rd.path}: holds {got!r}, expected {fmt!r}")
    user = head.get("user")
    if not isinstance(user, dict):
        raise CorruptFileError(f"{rd.path}: missing user meta")
    for key, want in (expect_meta or {}).items():
        if user.get(key) != want:
            raise ValueError(f"{rd.path}: saved {key}={user.get(key)!r}, expected {want!r} "
                             f"(a context saved under another model/config)")
    return head


def _check_lengths(lengths, S, L) -> None:
    a = np.asarray(lengths)
    if a.shape != (S, L) or a.dtype.kind not in "iu" or (a < 0).any():
        raise CorruptFileError(f"bad lengths table {a.shape}")
