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
    with pytest.raises(ValueError, match="threads"):
        ctx.build_layer(0, train_queries=train[0], threads=0)
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
