"""KVStore: appends, dtypes, overlap/gap rules, memory cap, pages."""

import ml_dtypes
import numpy as np
import pytest

import host_index as hi

H, D = 2, 8


def kv(n, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((H, n, D)).astype(dtype),
            rng.standard_normal((H, n, D)).astype(dtype))


def test_append_and_read_back():
    st = hi.KVStore(2, 3, H, D, dtype="float32")
    k, v = kv(10)
    assert st.append(1, 2, 0, k, v) == 10
    assert st.length(1, 2) == 10 and st.length(0, 0) == 0
    np.testing.assert_array_equal(st.keys(1, 2), k)
    np.testing.assert_array_equal(st.values(1, 2), v)


def test_overlap_is_skipped_and_gap_rejected():
    st = hi.KVStore(1, 1, H, D, dtype="float32")
    k, v = kv(20)
    assert st.append(0, 0, 0, k[:, :12], v[:, :12]) == 12
    assert st.append(0, 0, 0, k[:, :12], v[:, :12]) == 0  # repeated call: harmless
    assert st.append(0, 0, 8, k[:, 8:20], v[:, 8:20]) == 8  # overlap of 4 skipped
    np.testing.assert_array_equal(st.keys(0, 0), k)
    with pytest.raises(ValueError, match="gap"):
        st.append(0, 0, 21, k[:, :1], v[:, :1])


def test_growth_is_amortized_and_accounted():
    st = hi.KVStore(1, 1, H, D, dtype="float16")
    k, v = kv(1)
    caps = set()
    for i in range(300):
        st.append(0, 0, i, k, v)
        caps.add(st.capacity(0, 0))
    assert len(caps) < 20  # not one reallocation per token
    assert st.nbytes == 2 * H * st.capacity(0, 0) * D * 2
    assert st.capacity(0, 0) % st.page_size == 0


@pytest.mark.parametrize("store_dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("in_dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_dtype_conversions(store_dtype, in_dtype):
    st = hi.KVStore(1, 1, H, D, dtype=store_dtype)
    k, v = kv(7, dtype=in_dtype)
    st.append(0, 0, 0, k, v)
    ref = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}[store_dtype]
    want = k.astype(np.float32).astype(ref).astype(np.float32)  # round to nearest even
    np.testing.assert_array_equal(st.keys(0, 0), want)


def test_half_conversion_exhaustive():
    # Every finite half value and the rounding of floats near half ties.
    bits = np.arange(0, 1 << 16, dtype=np.uint32).astype(np.uint16)
    halves = bits.view(np.float16)
    halves = halves[np.isfinite(halves)]
    n = len(halves) // H // D * H * D
    x = halves[:n].reshape(H, -1, D)
    st = hi.KVStore(1, 1, H, D, dtype="float32")
    st.append(0, 0, 0, x, x)
    np.testing.assert_array_equal(st.keys(0, 0), x.astype(np.float32))
    f = np.random.default_rng(0).standard_normal((H, 4096, D)).astype(np.float32) * 1000
    st16 = hi.KVStore(1, 1, H, D, dtype="float16")
    st16.append(0, 0, 0, f, f)
    np.testing.assert_array_equal(st16.keys(0, 0), f.astype(np.float16).astype(np.float32))


def test_bad_values_write_nothing():
    st = hi.KVStore(1, 1, H, D, dtype="float16")
    k, v = kv(5)
    st.append(0, 0, 0, k, v)
    before = st.keys(0, 0)
    for bad in (np.nan, np.inf, 1e6):  # 1e6 overflows float16
        k2, v2 = kv(4, seed=1)
        v2[1, 2, 3] = bad
        with pytest.raises(ValueError):
            st.append(0, 0, 5, k2, v2)
    assert st.length(0, 0) == 5
    np.testing.assert_array_equal(st.keys(0, 0), before)


def test_bad_shapes_and_dtypes():
    st = hi.KVStore(1, 1, H, D)
    k, v = kv(3)
    with pytest.raises(ValueError):
        st.append(0, 0, 0, k[:1], v[:1])
    with pytest.raises(ValueError):
        st.append(0, 0, 0, k, v[:, :2])
    with pytest.raises(TypeError):
        st.append(0, 0, 0, k.astype(np.float64), v)
    with pytest.raises(ValueError):
        st.append(1, 0, 0, k, v)
    with pytest.raises(ValueError):
        st.append(0, 0, -1, k, v)
    with pytest.raises(ValueError):
        hi.KVStore(1, 1, H, D, dtype="int8")


def test_non_contiguous_input_is_copied():
    st = hi.KVStore(1, 1, H, D, dtype="float32")
    k, v = kv(6)
    kt = np.ascontiguousarray(k.transpose(1, 0, 2)).transpose(1, 0, 2)  # strided view
    assert not kt.flags.c_contiguous
    st.append(0, 0, 0, kt, v[:, :, :])
    np.testing.assert_array_equal(st.keys(0, 0), k)


def test_memory_cap():
    per_token = 2 * H * D * 2  # K and V, float16
    st = hi.KVStore(2, 1, H, D, dtype="float16", max_bytes=per_token * 96)
    k, v = kv(64)
    st.append(0, 0, 0, k, v)
    with pytest.raises(hi.StoreFullError) as e:
        st.append(1, 0, 0, k, v)  # 64 more tokens: past the cap
    assert isinstance(e.value, MemoryError)
    assert st.length(1, 0) == 0 and st.nbytes <= st.max_bytes
    st.append(1, 0, 0, k[:, :32], v[:, :32])  # what fits still goes in
    assert st.nbytes <= st.max_bytes
    np.testing.assert_array_equal(st.keys(1, 0), k[:, :32].astype(np.float16).astype(np.float32))


def test_fetch_pages():
    st = hi.KVStore(1, 2, H, D, dtype="float16", page_size=4)
    k, v = kv(10)
    st.append(0, 1, 0, k, v)
    ok, ov = st.fetch_pages(0, 1, [1, 0, 1], [0, 2, 2])
    kk = k.astype(np.float16)
    np.testing.assert_array_equal(ok[0], kk[1, 0:4])
    np.testing.assert_array_equal(ok[1, :2], kk[0, 8:10])
    assert (ok[1, 2:] == 0).all()  # past the stored length: zeros
    np.testing.assert_array_equal(ov[2, :2], v.astype(np.float16)[1, 8:10])
    out_k = np.empty((3, 4, D), np.float16)
    out_v = np.empty((3, 4, D), np.float16)
    rk, _ = st.fetch_pages(0, 1, [1, 0, 1], [0, 2, 2], out_k=out_k, out_v=out_v)
    assert rk is out_k
    np.testing.assert_array_equal(out_k, ok)
    with pytest.raises(ValueError):
        st.fetch_pages(0, 1, [0], [3])  # page past the end
    with pytest.raises(ValueError, match="not a stored page"):
        st.fetch_pages(0, 1, [0], [2**62])  # id * page wraps negative: once passed the check (segfault)
    with pytest.raises(ValueError):
        st.fetch_pages(0, 1, [2], [0])  # head out of range
    with pytest.raises(ValueError):
        st.fetch_pages(0, 1, [0], [0], out_k=np.empty((1, 4, D), np.float32))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_append_tokens_equals_one_append_per_store(dtype):
    import ml_dtypes
    ref = hi.KVStore(2, 3, H, D, dtype=dtype, page_size=4)
    got = hi.KVStore(2, 3, H, D, dtype=dtype, page_size=4)
    for st in (ref, got):
        st.append(0, 1, 0, *kv(3))
        st.append(1, 2, 0, *kv(4))  # grows past its first page below
    rng = np.random.default_rng(1)
    seqs, layers, starts = np.array([0, 1, 1, 0]), np.array([1, 2, 0, 0]), np.array([3, 4, 0, 0])
    k = rng.normal(size=(4, H, D)).astype(ml_dtypes.bfloat16)  # as a device step hands them over
    v = rng.normal(size=(4, H, D)).astype(ml_dtypes.bfloat16)
    for i in range(4):
        ref.append(int(seqs[i]), int(layers[i]), int(starts[i]), k[i][:, None], v[i][:, None])
    assert got.append_tokens(seqs, layers, starts, k, v) == 4
    assert got.append_tokens(seqs, layers, starts, k, v) == 0  # stored already: skipped
    for seq in range(2):
        for layer in range(3):
            assert got.length(seq, layer) == ref.length(seq, layer)
            np.testing.assert_array_equal(got.keys(seq, layer), ref.keys(seq, layer))
            np.testing.assert_array_equal(got.values(seq, layer), ref.values(seq, layer))
    before = got.length(0, 1)
    with pytest.raises(ValueError, match="gap"):
        got.append_tokens([0, 1], [1, 0], [before, 5], k[:2], v[:2])  # (1, 0) holds 1 token
    assert got.length(0, 1) == before  # nothing written
    with pytest.raises(ValueError, match="distinct"):
        got.append_tokens([0, 0], [1, 1], [before, before], k[:2], v[:2])
    bad = k[:1].astype(np.float32)
    bad[0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        got.append_tokens([0], [1], [before], bad, v[:1])
    with pytest.raises(ValueError, match="layers"):
        got.append_tokens([0], [3], [0], k[:1], v[:1])


def test_append_tokens_refused_growth_keeps_the_earlier_stores_written():
    """A growth refused by max_bytes raises StoreFullError after the stores before it in the call took
    their token (lengths included) and leaves that store and the later ones as they were."""
    per_token = 2 * H * D * 4  # K and V, float32
    st = hi.KVStore(2, 2, H, D, dtype="float32", page_size=4, max_bytes=per_token * 13)
    st.reserve(0, 0, 8)  # room for the token below
    st.append(0, 0, 0, *kv(3, seed=1))
    st.append(1, 0, 0, *kv(4, seed=2))  # full: its next token needs a growth past the cap
    k, v = (a[:, :3].transpose(1, 0, 2) for a in kv(3, seed=3))  # [3, H, D]
    with pytest.raises(hi.StoreFullError):
        st.append_tokens([0, 1, 0], [0, 0, 1], [3, 4, 0], k, v)
    assert st.lengths().tolist() == [[4, 0], [4, 0]]
    np.testing.assert_array_equal(st.keys(0, 0)[:, 3], k[0])
    np.testing.assert_array_equal(st.values(0, 0)[:, 3], v[0])
    np.testing.assert_array_equal(st.keys(0, 0)[:, :3], kv(3, seed=1)[0])
    with pytest.raises(hi.StoreFullError):  # (0, 0) holds its token already: nothing is grown for it
        st.append_tokens([0, 1], [0, 0], [3, 4], k[:2], v[:2])
    assert st.lengths().tolist() == [[4, 0], [4, 0]]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fetch_pages_many_equals_slices_of_each_store(dtype):
    st = hi.KVStore(2, 3, H, D, dtype=dtype, page_size=4)
    stored = {}
    for b in range(2):
        for layer in range(3):
            k, v = kv(9 + 4 * b + layer)  # ragged lengths, partial last pages
            st.append(b, layer, 0, k, v)
            stored[b, layer] = (st.keys(b, layer), st.values(b, layer))  # as stored (rounded)
    groups = [(1, 2), (0, 0), (1, 0)]
    group_of = np.array([0, 1, 2, 0, 2, 1])
    heads = np.array([1, 0, 1, 0, 0, 1])
    pages = np.array([3, 2, 0, 1, 3, 0])  # (1, 2) holds 15 tokens, (0, 0) 9, (1, 0) 13
    out_k, out_v = st.fetch_pages_many(groups, group_of, heads, pages)
    assert out_k.shape == (6, 4, D)
    as_float = st._as_float
    for i, (g, h, p) in enumerate(zip(group_of, heads, pages)):
        ref_k, ref_v = stored[groups[g]]
        rows = ref_k[h, 4 * p:4 * p + 4]
        np.testing.assert_array_equal(as_float(out_k[i, :len(rows)]), rows)
        np.testing.assert_array_equal(as_float(out_v[i, :len(rows)]), ref_v[h, 4 * p:4 * p + 4])
        assert (out_k[i, len(rows):] == 0).all()  # past the stored length: zeros
    with pytest.raises(ValueError, match="page_ids"):
        st.fetch_pages_many(groups, [1], [0], [3])  # (0, 0) holds pages 0-2
    with pytest.raises(ValueError, match="group_of"):
        st.fetch_pages_many(groups, [3], [0], [0])
    with pytest.raises(ValueError, match="kv_heads"):
        st.fetch_pages_many(groups, [0], [H], [0])
    with pytest.raises(ValueError, match="differ"):
        st.fetch_pages_many(groups, [0, 1], [0], [0])
    none = np.zeros(0, np.int64)
    empty_k, _ = st.fetch_pages_many([], none, none, none)
    assert empty_k.shape == (0, 4, D)


def test_reserve_keeps_appends_in_place():
  store = hi.KVStore(1, 1, 2, 8, dtype="float32")
  store.reserve(0, 0, 100)
  assert store.capacity(0, 0) >= 100
  keys, _ = store.buffers(0, 0)[:2]
  rng = np.random.default_rng(0)
  for t in range(100):
    store.append(0, 0, t, rng.normal(size=(2, 1, 8)).astype(np.float32), rng.normal(size=(2, 1, 8)).astype(np.float32))
  assert store.buffers(0, 0)[0] is keys  # never reallocated
  with pytest.raises(ValueError, match="n="):
    store.reserve(0, 0, -1)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_gathered_rows_as_float32_equal_the_stored_keys(dtype):
    st = hi.KVStore(1, 1, H, D, dtype=dtype)
    k, v = kv(9, seed=3)
    st.append(0, 0, 0, k, v)
    ids = np.array([4, 0, 8, 4])
    rows = st.to_float32(st.gather_rows(0, 0, 1, ids)[0])
    assert rows.dtype == np.float32
    np.testing.assert_array_equal(rows, st.keys(0, 0)[1, ids])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gather_rows_many_matches_numpy_across_stores(dtype):
    st = hi.KVStore(2, 3, H, D, dtype=dtype)
    for seq in range(2):
        for layer in range(3):
            k, v = kv(5 + 4 * seq + layer, seed=10 * seq + layer)
            st.append(seq, layer, 0, k, v)
    groups = [(1, 2), (0, 0), (1, 0)]
    rng = np.random.default_rng(5)
    group_of = rng.integers(0, 3, size=40)
    lens = np.array([st.length(s, l) for s, l in groups])
    ids = np.where(rng.random(40) < 0.2, -1, (rng.random(40) * lens[group_of]).astype(np.int64))
    heads = rng.integers(0, H, size=40)
    out_k, out_v = st.gather_rows_many(groups, group_of, heads, ids)
    for i in range(40):
        K, V, _ = st.buffers(*groups[group_of[i]])
        want_k = K[heads[i], ids[i]] if ids[i] >= 0 else np.zeros(D, K.dtype)
        want_v = V[heads[i], ids[i]] if ids[i] >= 0 else np.zeros(D, V.dtype)
        np.testing.assert_array_equal(out_k[i], want_k)
        np.testing.assert_array_equal(out_v[i], want_v)
    with pytest.raises(ValueError, match=r"ids\[3\] = 99 is not a stored row .* \(1, 0\)"):
        st.gather_rows_many(groups, [0, 0, 0, 2], [0] * 4, [0, 1, -1, 99])
    with pytest.raises(ValueError, match="group_of"):
        st.gather_rows_many(groups, [3], [0], [0])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gather_rows_matches_numpy(dtype):
    st = hi.KVStore(1, 1, H, D, dtype=dtype)
    k, v = kv(13, seed=3)
    st.append(0, 0, 0, k, v)
    K, V, n = st.buffers(0, 0)
    rng = np.random.default_rng(4)
    ids = rng.integers(-1, n, size=(5, 7))
    heads = rng.integers(0, H, size=(5, 1))  # broadcast over each row
    gk, gv = st.gather_rows(0, 0, heads, ids)
    want_k = np.where((ids >= 0)[..., None], K[heads, np.maximum(ids, 0)], 0)
    want_v = np.where((ids >= 0)[..., None], V[heads, np.maximum(ids, 0)], 0)
    np.testing.assert_array_equal(gk, want_k)
    np.testing.assert_array_equal(gv, want_v)
    out_k, out_v = np.full((2, 5, 7, D), 7, K.dtype), np.full((2, 5, 7, D), 7, V.dtype)
    st.gather_rows(0, 0, heads, ids, out_k=out_k[1], out_v=out_v[1])  # a slice of a larger buffer
    np.testing.assert_array_equal(out_k[1], want_k)
    assert (out_k[0] == 7).all()
    with pytest.raises(ValueError, match=r"ids\[0\] = 13 is not a stored row"):
        st.gather_rows(0, 0, 0, [n])  # past the stored length
    with pytest.raises(ValueError, match=r"ids\[0\] = -2"):
        st.gather_rows(0, 0, 0, [-2])
    with pytest.raises(ValueError, match="kv_heads"):
        st.gather_rows(0, 0, H, [0])
    with pytest.raises(ValueError, match="out_k"):
        st.gather_rows(0, 0, 0, [0], out_k=np.empty((1, D), np.float64))


def test_the_c_core_refuses_what_the_wrappers_never_pass():
    """The C core checks its own inputs (the wrappers check first): a page id whose byte offset
    overflows, a capacity whose byte size overflows int64, a second __init__ of a live index."""
    from host_index import _core
    k = np.zeros((1, 64, D), np.float16)
    ints = lambda *xs: np.array(xs, np.int64)
    out = np.zeros((1, 32, D), np.float16)
    with pytest.raises(ValueError):  # gather_pages_multi(ks, vs, dtype, Hkv, dim, page, caps, lens, ...)
        _core.gather_pages_multi([k], [k], hi._dtypes.CODES["float16"], 1, D, 32, ints(64), ints(64), ints(0),
                                 ints(0), ints(2**58), 1, out, out.copy(), 1)
    ix = _core.Index(0, 128)
    with pytest.raises(ValueError, match="out of range"):  # 2**55 rows of 256 bytes: the size wraps to 0
        ix.build(np.zeros((1, 128), np.float32), hi._dtypes.CODES["float32"], 0, 2**55, 200_000, None, 0, None, 0,
                 None, 0, 1)
    with pytest.raises(RuntimeError, match="already initialized"):
        ix.__init__(0, 128)
