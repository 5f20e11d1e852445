"""Saving and loading stores and contexts: round trips and rejected files."""

import os

import numpy as np
import pytest

import host_index as hi
from host_index.synthetic import clustered

S, L, HQ, HKV, D = 1, 2, 4, 2, 16


def make_ctx(kind, dtype="float16"):
    ctx = hi.HostContext(S, L, HQ, HKV, D, dtype=dtype, kind=kind)
    rng = np.random.default_rng(0)
    for l in range(L):
        k = np.stack([clustered(300, D, seed=l * 10 + h) for h in range(HKV)])
        ctx.append(0, l, 0, k, rng.standard_normal((HKV, 300, D)).astype(np.float32))
        tq = rng.standard_normal((S, HQ, 40, D)).astype(np.float32)
        ctx.build_layer(l, train_queries=tq if kind == "roar" else None)
    ctx.insert(0, 1, 300, k[:, :5] * 1.1, np.ones((HKV, 5, D), np.float32),
               queries=np.ones((HQ, 5, D), np.float32))
    return ctx


def test_file_mode_follows_the_umask(tmp_path):
    """mkstemp makes 0600 files; a saved context must be readable as any file the user writes."""
    path = tmp_path / "ctx.kvjx"
    make_ctx("flat").save(path)
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~umask


def test_files_from_before_ef_insert_keep_inserting_with_the_build_beam(tmp_path):
    """Roar files written before ef_insert existed have no such parameter: they inserted with
    ef 0 (the build's beam L), not today's default of 64."""
    from host_index import _persist

    path = tmp_path / "ctx.kvjx"
    make_ctx("roar").save(path)
    with _persist.Reader(path) as rd:
        head = dict(rd.meta)
        blobs = [(name, [rd.read(name)]) for name in rd.names()]
    head["context"] = dict(head["context"])
    head["context"]["index_params"] = {k: v for k, v in head["context"]["index_params"].items() if k != "ef_insert"}
    _persist.write(path, head, iter(blobs))
    assert hi.HostContext.load(path).index_params["ef_insert"] == 0


@pytest.mark.parametrize("kind", ["flat", "ivf", "graph", "roar"])
def test_context_round_trip(tmp_path, kind):
    ctx = make_ctx(kind, dtype="bfloat16" if kind == "graph" else "float16")
    path = tmp_path / "ctx.kvjx"
    ctx.save(path, meta={"model": "smollm2", "config_hash": "abc"})
    assert [p.name for p in tmp_path.iterdir()] == ["ctx.kvjx"]  # no temp file left
    back = hi.HostContext.load(path, expect_meta={"model": "smollm2"})
    assert back.meta == {"model": "smollm2", "config_hash": "abc"}
    assert back.kind == kind and back.index_params == ctx.index_params
    q = np.random.default_rng(1).standard_normal((S, HQ, D)).astype(np.float32)
    for l in range(L):
        assert back.store.length(0, l) == ctx.store.length(0, l)
        np.testing.assert_array_equal(back.store.keys(0, l), ctx.store.keys(0, l))
        np.testing.assert_array_equal(back.store.values(0, l), ctx.store.values(0, l))
        assert back.indexed(0, l) == ctx.indexed(0, l)
        for a, b in zip(ctx.attend(l, q, k=10, ef=32, return_ids=True),
                        back.attend(l, q, k=10, ef=32, return_ids=True)):
            np.testing.assert_array_equal(a, b)
    # A loaded context keeps accepting inserts.
    back.insert(0, 1, 305, np.ones((HKV, 1, D), np.float32), np.ones((HKV, 1, D), np.float32))
    assert back.indexed(0, 1) == 306
    # Saving again gives the same bytes (deterministic file).
    ctx.save(tmp_path / "again.kvjx", meta={"model": "smollm2", "config_hash": "abc"})
    assert (tmp_path / "again.kvjx").read_bytes() == path.read_bytes()


@pytest.mark.parametrize("kind", ["flat", "ivf", "graph", "roar"])
def test_context_copy_is_what_a_save_holds_and_independent(tmp_path, kind):
    ctx = make_ctx(kind, dtype="bfloat16" if kind == "graph" else "float16")
    ctx.reserve(0, 0, 700)  # decode room, kept by the copy
    ctx.meta = {"model": "smollm2"}
    copy = ctx.copy()
    ctx.save(tmp_path / "a.kvjx")
    copy.save(tmp_path / "b.kvjx")
    assert (tmp_path / "a.kvjx").read_bytes() == (tmp_path / "b.kvjx").read_bytes()
    assert copy.meta == ctx.meta and copy.meta is not ctx.meta
    assert [copy.store.capacity(0, l) for l in range(L)] == [ctx.store.capacity(0, l) for l in range(L)]
    # Inserting into one changes nothing in the other.
    q = np.random.default_rng(1).standard_normal((S, HQ, D)).astype(np.float32)
    before = ctx.attend(1, q, k=10, ef=32, return_ids=True)
    copy.insert(0, 1, 305, 3 * np.ones((HKV, 4, D), np.float32), np.ones((HKV, 4, D), np.float32))
    assert copy.indexed(0, 1) == 309 and ctx.indexed(0, 1) == ctx.store.length(0, 1) == 305
    for a, b in zip(before, ctx.attend(1, q, k=10, ef=32, return_ids=True)):
        np.testing.assert_array_equal(a, b)
    ctx.save(tmp_path / "c.kvjx")
    assert (tmp_path / "c.kvjx").read_bytes() == (tmp_path / "a.kvjx").read_bytes()


def test_store_round_trip(tmp_path):
    st = hi.KVStore(2, 1, HKV, D, dtype="float32")
    rng = np.random.default_rng(0)
    st.append(1, 0, 0, rng.standard_normal((HKV, 33, D)).astype(np.float32),
              rng.standard_normal((HKV, 33, D)).astype(np.float32))
    st.save(tmp_path / "s", meta={"x": 1})
    back = hi.KVStore.load(tmp_path / "s")
    assert back.meta == {"x": 1} and back.length(0, 0) == 0
    np.testing.assert_array_equal(back.keys(1, 0), st.keys(1, 0))
    with pytest.raises(hi.CorruptFileError, match="expected"):
        hi.HostContext.load(tmp_path / "s")  # a store is not a context


def test_meta_mismatch(tmp_path):
    ctx = make_ctx("flat")
    ctx.save(tmp_path / "c", meta={"model": "a"})
    with pytest.raises(ValueError, match="model"):
        hi.HostContext.load(tmp_path / "c", expect_meta={"model": "b"})


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("p") / "ctx.kvjx"
    make_ctx("roar").save(path, meta={"m": 1})
    return path.read_bytes()


def _load_bytes(tmp_path, data):
    p = tmp_path / "bad.kvjx"
    p.write_bytes(data)
    return hi.HostContext.load(p)


def test_truncated(tmp_path, saved):
    for cut in (0, 10, 40, len(saved) // 2, len(saved) - 1):
        with pytest.raises(hi.CorruptFileError):
            _load_bytes(tmp_path, saved[:cut])


def test_foreign(tmp_path):
    with pytest.raises(hi.CorruptFileError, match="not a kvjax"):
        _load_bytes(tmp_path, b"PK\x03\x04" + os.urandom(200))
    with pytest.raises(ValueError):  # CorruptFileError is a ValueError
        _load_bytes(tmp_path, b"")


def test_bit_flips_detected(tmp_path, saved):
    rng = np.random.default_rng(0)
    positions = list(rng.integers(0, len(saved), 40)) + [9, 20, 100, len(saved) - 3]
    for pos in positions:
        data = bytearray(saved)
        data[pos] ^= 0x10
        try:
            _load_bytes(tmp_path, bytes(data))
        except hi.CorruptFileError:
            continue
        # Only padding bytes between blobs may flip unnoticed.
        pytest.fail(f"flip at {pos} of {len(saved)} not detected") if _in_blob_or_header(saved, pos) else None


def _in_blob_or_header(data, pos):
    import json
    import struct
    off, hlen = struct.unpack("<QQ", data[16:32])
    if pos < 32 or pos >= off:
        return True
    blobs = json.loads(data[off:off + hlen])["blobs"].values()
    return any(o <= pos < o + n for o, n, _ in blobs)


def test_corrupt_index_state_rejected(tmp_path, saved):
    """A well-formed file whose graph has an edge out of range is refused."""
    from host_index import _persist
    rd = _persist.Reader(_write(tmp_path, saved))
    meta = rd.meta
    blobs = [(n, [rd.read(n)]) for n in rd.names()]
    rd.close()
    name = "ix/0/0/0/adj"
    adj = np.frombuffer(dict(blobs)[name][0], np.int32).copy()
    adj[0] = 10**6
    blobs = [(n, [adj.tobytes()] if n == name else p) for n, p in blobs]
    _persist.write(tmp_path / "evil.kvjx", meta, blobs)
    with pytest.raises(hi.CorruptFileError, match="range"):
        hi.HostContext.load(tmp_path / "evil.kvjx")


def _write(tmp_path, data):
    p = tmp_path / "ok.kvjx"
    p.write_bytes(data)
    return p


def test_roar_cooc_round_trip_and_old_files(tmp_path):
    rng = np.random.default_rng(2)
    q = rng.standard_normal((S, HQ, D)).astype(np.float32)
    for params in ({"n_cooc": 8}, {"n_cooc": 0}):
        ctx = hi.HostContext(S, 1, HQ, HKV, D, kind="roar", index_params=params)
        k = np.stack([clustered(300, D, seed=h) for h in range(HKV)])
        ctx.append(0, 0, 0, k, rng.standard_normal((HKV, 300, D)).astype(np.float32))
        ctx.build_layer(0, train_queries=rng.standard_normal((S, HQ, 40, D)).astype(np.float32))
        path = tmp_path / f"ctx{params['n_cooc']}.kvjx"
        if not params["n_cooc"]:
            ctx.index_params.pop("n_cooc")  # as written before roar had co-occurrence links
        ctx.save(path)
        back = hi.HostContext.load(path)
        assert back.index_params["n_cooc"] == params["n_cooc"]
        ctx.index_params["n_cooc"] = params["n_cooc"]
        a, b = (c.search(0, q, k=10, ef=32) for c in (ctx, back))
        np.testing.assert_array_equal(a[0], b[0])
