"""dtype "raw16": caller-encoded uint16 rows stored and copied back bit for bit, never read as numbers."""

import re

import ml_dtypes
import numpy as np
import pytest

import host_index as hi
from host_index import _core

S, L, HQ, HKV, D, P = 2, 2, 4, 2, 6, 4
# NaN / inf / -0 / subnormal as bfloat16 or float16: a float store would reject or change some.
SPECIAL = np.array([0x7FC0, 0xFF80, 0x7F80, 0xFFFF, 0x7C00, 0xFE00, 0x8000, 0x0001], np.uint16)


def words(shape, seed):
    """Random uint16 words of `shape`, with every SPECIAL pattern in the first rows."""
    a = np.random.default_rng(seed).integers(0, 1 << 16, size=shape, dtype=np.uint16)
    flat = a.reshape(-1)
    flat[:SPECIAL.size] = SPECIAL
    return a


def encode(x):
    """[..., 8] float32 -> [..., 6] uint16 words: int8 values + a float32 scale, as a GPU packer would."""
    scale = np.abs(x).max(-1, keepdims=True).astype(np.float32) / 127
    q = np.round(x / scale).astype(np.int8)
    return np.concatenate([q.view(np.uint16), scale.view(np.uint16)], -1)


def flat_ctx(**kw):
    return hi.HostContext(S, L, HQ, HKV, D, dtype="raw16", kind="flat", page_size=P, **kw)


def expected_pages(stored, heads, pages):
    """[len(pages), P, D] pages of `stored` [HKV, n, D], zero past its end."""
    out = np.zeros((len(pages), P, D), np.uint16)
    for i, (h, p) in enumerate(zip(heads, pages)):
        rows = stored[h, p * P:(p + 1) * P]
        out[i, :rows.shape[0]] = rows
    return out


def test_append_and_fetch_are_bit_exact():
    ctx = flat_ctx()
    st = ctx.store
    assert (st.dtype, st.itemsize, st.head_dim) == ("raw16", 2, D)
    k, v = words((HKV, 10, D), 0), words((HKV, 10, D), 1)
    assert ctx.append(0, 1, 0, k[:, :7], v[:, :7]) == 7
    assert ctx.append(0, 1, 5, k[:, 5:], v[:, 5:]) == 3  # the overlap is skipped, no bits checked
    kb, vb, n = st.buffers(0, 1)
    assert n == 10 and kb.dtype == vb.dtype == np.uint16
    np.testing.assert_array_equal(kb[:, :n], k)
    np.testing.assert_array_equal(vb[:, :n], v)
    heads, pages = [1, 0, 1, 0], [2, 0, 1, 2]  # page 2 is half stored: zero-filled
    ok, ov = ctx.fetch_pages(0, 1, heads, pages)
    assert ok.dtype == ov.dtype == np.uint16
    np.testing.assert_array_equal(ok, expected_pages(k, heads, pages))
    np.testing.assert_array_equal(ov, expected_pages(v, heads, pages))
    # Into caller buffers (pinned ones in FreeKV), as uint16.
    out_k, out_v = np.ones((4, P, D), np.uint16), np.ones((4, P, D), np.uint16)
    ctx.fetch_pages(0, 1, heads, pages, out_k=out_k, out_v=out_v)
    np.testing.assert_array_equal(out_k, ok)
    np.testing.assert_array_equal(out_v, ov)


def test_append_tokens_and_fetch_pages_many_are_bit_exact():
    ctx = flat_ctx()
    ref = {}
    for s in range(S):
        for l in range(L):
            k, v = words((HKV, 5 + s + l, D), 10 * s + l), words((HKV, 5 + s + l, D), 100 + 10 * s + l)
            ctx.append(s, l, 0, k, v)
            ref[s, l] = [k, v]
    # One evicted token per (seq, layer), as FreeKV's decode step appends them.
    seqs, layers = np.array([0, 0, 1, 1]), np.array([0, 1, 0, 1])
    starts = np.array([ctx.store.length(s, l) for s, l in zip(seqs, layers)])
    tk, tv = words((4, HKV, D), 7), words((4, HKV, D), 8)
    assert ctx.append_tokens(seqs, layers, starts, tk, tv) == 4
    assert ctx.append_tokens(seqs, layers, starts, tk, tv) == 0  # stored already
    for i, (s, l) in enumerate(zip(seqs, layers)):
        ref[s, l] = [np.concatenate([a, t[i][:, None]], 1) for a, t in zip(ref[s, l], (tk, tv))]
    groups = [(1, 1), (0, 0), (1, 0)]
    group_of, heads, pages = np.array([0, 1, 2, 0, 2]), np.array([1, 0, 1, 0, 0]), np.array([1, 0, 1, 0, 0])
    ok, ov = ctx.fetch_pages_many(groups, group_of, heads, pages)
    for i, (g, h, p) in enumerate(zip(group_of, heads, pages)):
        for got, want in ((ok, ref[groups[g]][0]), (ov, ref[groups[g]][1])):
            np.testing.assert_array_equal(got[i], expected_pages(want, [h], [p])[0])


def test_encoded_rows_decode_exactly():
    x = np.random.default_rng(3).standard_normal((HKV, 9, 8)).astype(np.float32)
    enc = encode(x)  # [HKV, 9, 6]
    ctx = flat_ctx()
    ctx.append(1, 0, 0, enc, enc[::-1].copy())
    ok, _ = ctx.fetch_pages(1, 0, [0, 1, 1], [0, 1, 2])
    got = np.concatenate([ok[0], ok[1], ok[2][:1]])  # head 0's first page, head 1's rows 4..8
    np.testing.assert_array_equal(got[:P], enc[0, :P])
    np.testing.assert_array_equal(got[P:], enc[1, P:])
    q, scale = ok[0][..., :4].view(np.int8), ok[0][..., 4:].view(np.float32)
    np.testing.assert_array_equal(q.astype(np.float32) * scale, np.round(x[0, :P] / scale) * scale)


def test_nbytes_counts_two_bytes_per_word():
    ctx = flat_ctx()
    ctx.append(0, 0, 0, words((HKV, 5, D), 0), words((HKV, 5, D), 1))
    cap = ctx.store.capacity(0, 0)
    assert cap % P == 0 and cap >= 5
    assert ctx.store.nbytes == ctx.nbytes == 2 * HKV * cap * D * 2  # K and V, 2 bytes a word
    per_page = 2 * HKV * P * D * 2
    capped = flat_ctx(max_bytes=2 * per_page)
    capped.append(0, 0, 0, words((HKV, 2 * P, D), 0), words((HKV, 2 * P, D), 1))  # fits exactly
    assert capped.nbytes == 2 * per_page
    with pytest.raises(hi.StoreFullError, match="max_bytes"):
        capped.append(0, 1, 0, words((HKV, 1, D), 2), words((HKV, 1, D), 3))


def test_save_load_round_trip(tmp_path):
    ctx = flat_ctx()
    for s in range(S):
        ctx.append(s, 1, 0, words((HKV, 6 + s, D), s), words((HKV, 6 + s, D), 9 + s))
    ctx.save(tmp_path / "ctx", meta={"model": "m"})
    back = hi.HostContext.load(tmp_path / "ctx", expect_meta={"model": "m"})
    assert back.store.dtype == "raw16" and back.kind == "flat" and back.nbytes == back.store.nbytes
    for s in range(S):
        for l in range(L):
            a, b = ctx.store.buffers(s, l), back.store.buffers(s, l)
            assert a[2] == b[2] and b[0].dtype == np.uint16
            np.testing.assert_array_equal(a[0][:, :a[2]], b[0][:, :b[2]])
            np.testing.assert_array_equal(a[1][:, :a[2]], b[1][:, :b[2]])
    back.append(0, 1, 6, words((HKV, 1, D), 5), words((HKV, 1, D), 6))  # still a working store
    assert back.store.length(0, 1) == 7
    st = hi.KVStore(1, 1, HKV, D, dtype="raw16", page_size=P)
    k = words((HKV, 3, D), 4)
    st.append(0, 0, 0, k, k)
    st.save(tmp_path / "st")
    loaded = hi.KVStore.load(tmp_path / "st")
    assert loaded.dtype == "raw16"
    np.testing.assert_array_equal(loaded.buffers(0, 0)[0][:, :3], k)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16, np.int16])
def test_raw16_store_takes_uint16_only(dtype):
    ctx = flat_ctx()
    bad = np.zeros((HKV, 2, D), dtype)
    good = np.zeros((HKV, 2, D), np.uint16)
    name = np.dtype(dtype).name
    with pytest.raises(TypeError, match=f"keys: dtype {name} is not uint16"):
        ctx.append(0, 0, 0, bad, good)
    with pytest.raises(TypeError, match=f"values: dtype {name} is not uint16"):
        ctx.append(0, 0, 0, good, bad)
    with pytest.raises(TypeError, match=f"dtype {name} is not uint16"):
        ctx.append_tokens([0], [0], [0], bad[:, 0][None], good[:, 0][None])
    assert ctx.store.length(0, 0) == 0


def test_float_store_still_refuses_uint16():
    st = hi.KVStore(1, 1, HKV, D, dtype="bfloat16")
    u = np.zeros((HKV, 2, D), np.uint16)
    with pytest.raises(TypeError, match="dtype uint16 is not float32"):
        st.append(0, 0, 0, u, u)


@pytest.mark.parametrize("kind", ["ivf", "graph", "roar"])
def test_raw16_needs_kind_flat(kind):
    with pytest.raises(ValueError, match=f"kind='{kind}'.*dtype='raw16'"):
        hi.HostContext(S, L, HQ, HKV, D, dtype="raw16", kind=kind)


def test_everything_that_reads_numbers_refuses_raw16():
    ctx = flat_ctx()
    k = words((HKV, 8, D), 0)
    ctx.append(0, 0, 0, k, k)
    q = np.ones((S, HQ, D), np.float32)
    f = np.ones((HKV, 1, D), np.float32)
    calls = {
        "keys()": lambda: ctx.store.keys(0, 0),
        "values()": lambda: ctx.store.values(0, 0),
        "HostContext.index": lambda: ctx.index(0, 0, 0),
        "HostContext.build_layer": lambda: ctx.build_layer(0),
        "HostContext.insert": lambda: ctx.insert(0, 0, 8, f, f),
        "HostContext.insert_many": lambda: ctx.insert_many([0], [0], [8], f[None], f[None]),
        "HostContext.index_stored": lambda: ctx.index_stored([0], [0]),
        "HostContext.attend": lambda: ctx.attend(0, q, k=2),
        "HostContext.search": lambda: ctx.search(0, q, k=2),
        "HostContext.search_layers": lambda: ctx.search_layers([0], q[None], k=2),
        "HostContext.attend_ids": lambda: ctx.attend_ids(0, q, np.zeros((S, HQ, 1), np.int64)),
    }
    for what, call in calls.items():
        with pytest.raises(ValueError, match=re.escape(f"{what} reads stored values as numbers, but dtype='raw16'")):
            call()
    assert ctx.store.length(0, 0) == 8 and ctx.indexed(0, 0) == 0  # nothing written


def test_c_core_refuses_raw16_outside_copies():
    u = np.zeros((HKV, 4, D), np.uint16)
    f = np.zeros((HKV, 4, D), np.float32)
    n = u.size
    with pytest.raises(ValueError, match="raw16"):
        _core.convert(f, 0, 0, n, u, 3, 0, n, 1, n, 1)  # float -> raw16 would be a conversion
    with pytest.raises(ValueError, match="raw16"):
        _core.convert(u, 3, 0, n, f, 0, 0, n, 1, n, 1)
    with pytest.raises(ValueError, match="raw16"):
        _core.count_bad(u, 3, 1, n)
    assert _core.count_bad(u | 0x7FC0, 3, 3, n) == 0  # no NaN check on opaque bits
    ix = _core.Index(0, D)  # flat
    with pytest.raises(ValueError, match="raw16"):
        ix.build(u, 3, 0, 4, 4, None, 0, None, 0, None, 0, 1)
    with pytest.raises(ValueError, match="raw16"):
        ix.search(u, 3, 0, 4, 4, np.zeros((1, D), np.float32), 1, 1, 0, np.empty((1, 1), np.int64),
                  np.empty((1, 1), np.float32), np.empty(1, np.int64), 1)
