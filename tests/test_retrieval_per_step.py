"""`retrieval(bridge="per_step")`: no host callback inside the step; the host selects with the
previous step's queries between steps (kvjax.prefetch_runtime).

The host half is checked against brute force (exact top-k of the given queries, the stored
rows gathered, evicted tokens kept); the device half (`attend_rows`) against dense masked
attention; the whole against `full` when the budget covers the context.
"""

import dataclasses
import types

import jax.numpy as jnp
import numpy as np
import pytest

import host_index
import kvjax
from kvjax import device_read, host_runtime, prefetch_runtime, row_update
from kvjax.policies import RetrievalAttention
from kvjax.policies.retrieval import attend_group_rows, first_of_each_id, prompt_window
from kvjax.prefetch_runtime import PrefetchRuntime, layer_rows, span_ids, successor_ids
from kvjax.row_update import padded_size
from ops.rows_attention import attend_rows
from test_generate import random_prompt, tiny_model
from test_retrieval import SMALL, run

PER_STEP = dict(SMALL, bridge="per_step")


@pytest.mark.parametrize("index, extra", [("flat", {}), ("roar", {}), ("roar", {"roar_heads": "kv"}),
                                          ("graph", {}), ("flat", {"lag": 2}), ("roar", {"lag": 2}),
                                          ("flat", {"lag": 2, "successors": 2}), ("flat", {"lag": 0}),
                                          ("roar", {"lag": 0, "speculative": True, "tau": 0.8}),
                                          ("flat", {"lag": 2, "pinned": 4, "pinned_span": 3}),
                                          ("flat", {"lag": 2, "pinned": 4, "pinned_span": 3, "pinned_window": 5}),
                                          ("roar", {"lag": 2, "speculative": True, "tau": 0.8, "refresh": "merge"}),
                                          ("roar", {"lag": 2, "speculative": True, "search_query": "group_mean", "roar_heads": "kv"}),
                                          ("flat", {"lag": 2, "group_rows": True}),
                                          ("flat", {"lag": 0, "group_rows": True}),
                                          ("roar", {"lag": 2, "speculative": True, "roar_heads": "kv", "group_rows": True}),
                                          ("roar", {"lag": 2, "speculative": True, "roar_heads": "kv", "tail_slots": 6,
                                                    "index_every": 3}),
                                          ("flat", {"lag": 1, "tail_slots": 4, "index_every": 2})])
def test_equals_full_when_topk_covers_the_context(index, extra):
  model = tiny_model("llama")
  # Ragged, 24 steps > window: evictions; the short prompts start inside the window / the sinks.
  prompts = [random_prompt(53), random_prompt(21, seed=5), random_prompt(6, seed=6), random_prompt(3, seed=7)]
  full = run(model, prompts)
  sparse = run(model, prompts, index=index, topk=500, **PER_STEP, **extra)
  np.testing.assert_allclose(sparse.logits, full.logits, rtol=1e-4, atol=1e-4)
  assert sparse.tokens == full.tokens
  assert sparse.policy_stats["inserted_tokens"] > 0  # tokens did leave the window
  assert sparse.policy_stats["hit_rate"] == 1.0  # a covering selection loses nothing to the lag


@pytest.mark.parametrize("lag", [1, 2])
def test_equals_full_with_dense_and_local_layers(lag):
  model = tiny_model("gemma3")  # layer 0 is a sliding-window layer, attended densely
  prompt = random_prompt(40, seed=3)
  full = run(model, prompt)
  sparse = run(model, prompt, index="flat", topk=500, lag=lag, **PER_STEP)
  np.testing.assert_allclose(sparse.logits, full.logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("lag, refresh", [(1, "search"), (2, "search"), (2, "merge")])
def test_equals_full_with_host_layers_around_a_dense_one(lag, refresh):
  """Host layers 0 and 2 around dense layer 1: the exchange indexes its per-layer state with an
  array rather than a slice (prefetch_runtime.layer_rows); speculative, so the reuse bookkeeping
  (and the merges' score cache) takes that path too."""
  assert layer_rows([1, 2, 3]) == slice(1, 4)
  np.testing.assert_array_equal(layer_rows([0, 2]), [0, 2])
  model = tiny_model("llama", num_layers=3)
  prompts = [random_prompt(53), random_prompt(21, seed=5)]
  full = run(model, prompts)
  sparse = run(model, prompts, index="flat", topk=500, lag=lag, speculative=True, tau=0.0, tail_slots=8,
               dense_layers=(1,), refresh=refresh, **PER_STEP)
  np.testing.assert_allclose(sparse.logits, full.logits, rtol=1e-4, atol=1e-4)
  assert sparse.policy_stats["speculated_groups"] > 0


@pytest.mark.parametrize("lag, refresh", [(1, "search"), (2, "search"), (2, "merge")])
def test_speculative_reuse_loses_nothing_when_topk_covers_the_context(lag, refresh):
  """tau 0: a group searches again only on its turn in the refresh rotation (every
  tail_slots // 2 = 4 steps), or with refresh="merge" folds the tokens stored since into its
  top-k; until then they are attended from its tail, so with a covering top-k decode still
  equals full, while groups skip their search."""
  model = tiny_model("llama")
  prompts = [random_prompt(53), random_prompt(21, seed=5)]
  full = run(model, prompts)
  sparse = run(model, prompts, index="flat", topk=500, lag=lag, speculative=True, tau=0.0, tail_slots=8,
               refresh=refresh, **PER_STEP)
  np.testing.assert_allclose(sparse.logits, full.logits, rtol=1e-4, atol=1e-4)
  stats = sparse.policy_stats
  searched = stats["corrected_groups"] + (stats["refreshed_groups"] if refresh == "search" else 0)
  groups = stats["speculated_groups"] + stats["corrected_groups"] + stats["refreshed_groups"]
  assert stats["speculated_groups"] > 0 and stats["corrected_groups"] > 0  # a tiny random model's queries swing
  assert stats["refreshed_groups"] > 0  # groups on their turn that had not drifted
  G = model.cfg.num_heads // model.cfg.num_kv_heads
  first = model.cfg.num_layers * 2 * model.cfg.num_heads  # the first exchange searches every head
  assert stats["searched_heads"] == first + G * searched < first + G * groups
  assert stats["correction_rate"] == stats["corrected_groups"] / groups


def test_speculative_tau_one_searches_every_head_as_without_it():
  model = tiny_model("llama")
  prompt = random_prompt(60, seed=4)
  options = dict(index="flat", topk=3, lag=2, **PER_STEP)
  plain = run(model, prompt, **options)
  spec = run(model, prompt, speculative=True, tau=1.0, **options)
  np.testing.assert_array_equal(spec.logits, plain.logits)
  assert spec.policy_stats["speculated_groups"] == spec.policy_stats["refreshed_groups"] == 0
  assert spec.policy_stats["corrected_groups"] > 0 and spec.policy_stats["correction_rate"] == 1.0
  assert spec.policy_stats["searched_heads"] == plain.policy_stats["searched_heads"]


def test_speculative_rotation_is_not_counted_as_correction(monkeypatch):
  """Queries that never drift (cosine 1): only the rotation searches again, 1 / (tail_slots // 2)
  of the groups a step, and the correction rate stays 0 (it read 0.25 at 8 tail slots)."""
  monkeypatch.setattr(prefetch_runtime, "group_mean_cosine", lambda q, prev, groups: np.ones(q.shape[:1] + (groups,)))
  model = tiny_model("llama")
  spec = run(model, random_prompt(60, seed=4), index="flat", topk=3, lag=2, speculative=True, tau=0.8,
             tail_slots=8, **PER_STEP)
  stats = spec.policy_stats
  assert stats["corrected_groups"] == 0 and stats["correction_rate"] == 0.0
  decided = stats["speculated_groups"] + stats["refreshed_groups"]
  assert stats["refreshed_groups"] == pytest.approx(decided / 4, abs=model.cfg.num_layers * model.cfg.num_kv_heads)


def test_lag_zero_searches_the_lowest_host_layer_with_its_own_query():
  """Lag 0 runs each step twice, the second on rows its first pass's queries found. The lowest
  host layer's first-pass query is already exact, so with it the only host layer (and flat
  search, no successors, each evicted token indexed at the next exchange as per_layer does) it
  attends what per_layer's current-query search does; lag 1 does not."""
  model = tiny_model("llama")  # two layers: layer 1 stays dense
  prompts = [random_prompt(53), random_prompt(21, seed=5)]
  options = dict(SMALL, index="flat", topk=5, dense_layers=(1,))
  per_layer = run(model, prompts, **options)
  lag0 = run(model, prompts, bridge="per_step", lag=0, successors=0, pinned=0, index_every=1, **options)
  lag1 = run(model, prompts, bridge="per_step", lag=1, successors=0, index_every=1, **options)
  np.testing.assert_allclose(lag0.logits, per_layer.logits, rtol=1e-4, atol=1e-4)
  assert lag0.tokens == per_layer.tokens
  assert np.abs(lag1.logits - per_layer.logits).max() > 1e-2  # the small top-k bites: lag 1 differs
  assert 0 < lag0.policy_stats["repeated_steps"] <= len(lag0.tokens[0])


def test_lag_two_is_deterministic_and_differs_from_lag_one():
  model = tiny_model("llama")
  prompt = random_prompt(60, seed=4)
  options = dict(index="flat", topk=2, **PER_STEP)
  one = run(model, prompt, **options)
  two, again = run(model, prompt, lag=2, **options), run(model, prompt, lag=2, **options)
  np.testing.assert_array_equal(two.logits, again.logits)  # thread timing does not leak into results
  yielding = run(model, prompt, lag=2, index_yields=True, **options)  # the indexing in the exchange's gaps
  np.testing.assert_array_equal(two.logits, yielding.logits)
  assert yielding.policy_stats["index_yield_seconds"] >= 0.0 == two.policy_stats["index_yield_seconds"]
  assert np.abs(two.logits - one.logits).max() > 1e-4  # an older selection: a different approximation
  assert two.policy_stats["step_wait_seconds"] >= 0.0
  for result in (one, two):  # after each step: reading its rows, then (from the second on) landing an update
    assert result.policy_stats["rows_seconds"] > 0 and result.policy_stats["land_seconds"] > 0


def test_ef_insert_defaults_to_32_for_roar_only():
  """None resolves at use: DEFAULT_ROAR_EF_INSERT (32) for roar, the index's own for graph."""
  assert RetrievalAttention().insert_ef == 32 and "inserts at ef 32" in RetrievalAttention().describe()
  assert RetrievalAttention(ef_insert=64).insert_ef == 64
  assert RetrievalAttention(index="graph").insert_ef is None
  assert RetrievalAttention(index="flat").insert_ef is None and "inserts" not in RetrievalAttention(index="flat").describe()


def test_index_every_defaults_to_8_with_per_step_within_the_tail():
  """None resolves at use: DEFAULT_INDEX_EVERY (8) with per_step, at most tail_slots // 2; 1 otherwise."""
  step = RetrievalAttention(bridge="per_step")
  assert step.index_period == 8 and "indexing every 8 steps" in step.describe()
  assert RetrievalAttention(bridge="per_step", tail_slots=6).index_period == 3
  assert RetrievalAttention(bridge="per_step", tail_slots=1).index_period == 1
  assert RetrievalAttention(bridge="per_step", index_every=1).index_period == 1
  assert "indexing every" not in RetrievalAttention(bridge="per_step", index_every=1).describe()
  assert RetrievalAttention().index_period == 1  # per_layer indexes at every step


def test_index_every_unset_follows_tail_slots_changed_at_load():
  """A saved context keeps index_every unset, so other tail_slots at load get the default that
  fits them; an explicit value that no longer fits is refused, naming it."""
  from kvjax.context_cache import _policy_options, _restore_policy

  saved = {"name": "retrieval", "options": _policy_options(RetrievalAttention(bridge="per_step"))}
  assert saved["options"]["index_every"] is None
  assert _restore_policy(saved, {}).index_period == 8
  assert _restore_policy(saved, {"tail_slots": 8}).index_period == 4
  with pytest.raises(ValueError, match="index_every=8"):
    _restore_policy(saved, {"tail_slots": 8, "index_every": 8})


def record_index_stored(monkeypatch) -> list:
  """Every HostContext.index_stored call from now on, as (layers, tokens per pair or None, ef)."""
  calls = []
  index_stored = host_index.HostContext.index_stored

  def recording(self, seqs, layers, *args, queries=None, ef=None, **kwargs):
    calls.append((list(layers), None if queries is None else np.shape(queries)[2], ef))
    return index_stored(self, seqs, layers, *args, queries=queries, ef=ef, **kwargs)

  monkeypatch.setattr(host_index.HostContext, "index_stored", recording)
  return calls


@pytest.mark.parametrize("index, ef_insert, expected", [("graph", None, None), ("graph", 5, 5), ("roar", None, 32)])
def test_ef_insert_reaches_every_decode_insert(monkeypatch, index, ef_insert, expected):
  """The decode option reaches each insert call (None: roar's default, graph's own list), lag 1 and 2."""
  calls = record_index_stored(monkeypatch)
  prompt = random_prompt(60, seed=4)
  for lag in (1, 2):
    result = run(tiny_model("llama"), prompt, index=index, topk=4, lag=lag, ef_insert=ef_insert, **PER_STEP)
    assert result.policy_stats["inserted_tokens"] > 0
  assert calls and {ef for _, _, ef in calls} == {expected}


@pytest.mark.parametrize("lag, index_every", [(1, 3), (2, 3), (2, None)])
def test_index_every_indexes_each_layer_in_runs_staggered_over_the_steps(monkeypatch, lag, index_every):
  """index_every=3 (or the default, which 6 tail slots bound to 3): each background indexing call
  takes about a third of the layers, 3 tokens each (runs), every layer's evicted tokens are indexed
  within 3 exchanges, and no layer waits longer (the tail slots hold the rest; the decode equals
  full at a covering top-k: the test above)."""
  calls = record_index_stored(monkeypatch)
  model = tiny_model("llama")
  result = run(model, random_prompt(60, seed=4), index="roar", topk=4, lag=lag, tail_slots=6,
               index_every=index_every, **PER_STEP)
  stats = result.policy_stats
  assert stats["inserted_tokens"] > 6 * model.cfg.num_layers
  runs = [n for _, n, _ in calls]
  assert runs and max(runs) <= 3 and runs.count(3) >= len(runs) // 2  # runs of 3 once the ring evicts
  assert max(len(layers) for layers, _, _ in calls) <= -(-model.cfg.num_layers // 3)  # staggered
  assert stats["unindexed_attended"] > 0


def test_no_host_callback_inside_the_step(monkeypatch):
  def forbidden(*args):
    raise AssertionError("the per_layer callback ran")

  monkeypatch.setattr(host_runtime, "decode_callback", forbidden)
  result = run(tiny_model("llama"), random_prompt(40), index="flat", topk=4, **PER_STEP)
  assert result.policy_stats["callbacks"] == len(result.tokens[0])  # one exchange per step + one at prefill


def _runtime(keys, values, *, topk, tail_slots=4, sinks=2, kind="flat", **options):
  """A PrefetchRuntime over one sequence and 2 layers holding `keys`/`values` [L, Hkv, n, D]."""
  L, Hkv, n, D = keys.shape
  context = host_index.HostContext(1, L, 2 * Hkv, Hkv, D, dtype="float32", kind=kind)
  for layer in range(L):
    context.append(0, layer, 0, keys[layer], values[layer])
    context.build_layer(layer)
  return PrefetchRuntime(context, tail_slots=tail_slots, sinks=sinks, window=8, topk=topk, ef=None, scale=D**-0.5,
                         background_threads=1, **options)


class DeviceMirror:
  """What the device's row buffers hold after the updates applied so far (a NumPy twin of
  kvjax.row_update.scatter_rows)."""

  def __init__(self, L, B, Hq, slots, D, dtype=np.float32):
    self.k, self.v = np.zeros((2, L, B, Hq, slots, D), dtype)
    self.ids = np.full((L, B, Hq, slots), -1, np.int64)

  def apply(self, update):
    real = slice(0, update.count)
    assert np.all(update.dest[update.count:] >= self.ids.size)  # padding lands out of range
    for buf, new in ((self.k, update.k), (self.v, update.v), (self.ids, update.ids)):
      buf.reshape(-1, *new.shape[1:])[update.dest[real]] = new[real]
    return self.k, self.v, self.ids >= 0


def test_index_overflow_indexes_only_pairs_behind_by_more_than_the_tail():
  """A (seq, layer) with more unindexed tokens than tail slots is indexed on the spot, one within
  them is left to the background; the counts returned are those after it."""
  rng = np.random.default_rng(3)
  L, Hkv, n, D = 2, 1, 20, 8
  keys, values = rng.standard_normal((2, L, Hkv, n, D)).astype(np.float32)
  runtime = _runtime(keys, values, topk=4, tail_slots=4, kind="graph")
  try:
    context = runtime.context
    for layer, extra in ((0, 6), (1, 3)):  # layer 0 past the 4 tail slots, layer 1 within them
      k, v = rng.standard_normal((2, Hkv, extra, D)).astype(np.float32)
      context.append(0, layer, n, k, v)
      runtime._unindexed_queries[(0, layer)] = list(rng.standard_normal((extra, 2 * Hkv, D)).astype(np.float32))
    indexed = runtime._index_overflow([0, 1], 1, context.store.lengths())
    assert indexed.tolist() == context.indexed_counts().tolist() == [[n + 6, n]]
    assert list(runtime._unindexed_queries) == [(0, 1)]
  finally:
    runtime.close()


def test_queued_indexing_groups_pairs_by_their_count_of_new_tokens():
  """Pairs behind by different counts (a repeated or skipped step) are indexed in one index_stored
  call per count, each with its tokens' queries in store order; one token a pair is one group."""
  to_index = [((0, 1), np.full((2, 2, 3), 1.0)), ((0, 0), np.full((2, 1, 3), 2.0)), ((1, 1), np.full((2, 2, 3), 3.0))]
  groups = host_runtime.index_groups(to_index)
  assert [pairs for pairs, _ in groups] == [[(0, 1), (1, 1)], [(0, 0)]]
  assert [q.shape for _, q in groups] == [(2, 2, 2, 3), (1, 2, 1, 3)]
  np.testing.assert_array_equal(groups[0][1][:, 0, 0, 0], [1.0, 3.0])
  rng = np.random.default_rng(5)
  L, Hkv, n, D = 2, 1, 20, 8
  keys, values = rng.standard_normal((2, L, Hkv, n, D)).astype(np.float32)
  runtime = _runtime(keys, values, topk=4, kind="graph")
  try:
    context = runtime.context
    for extra in ((2, 1), (1, 1)):  # mixed counts, then one token a pair
      for layer, count in enumerate(extra):
        k, v = rng.standard_normal((2, Hkv, count, D)).astype(np.float32)
        context.append(0, layer, context.store.length(0, layer), k, v)
        runtime._unindexed_queries[(0, layer)] = list(rng.standard_normal((count, 2 * Hkv, D)).astype(np.float32))
      runtime._submit_background(-1, None)
      runtime._wait_background(-1)
      assert not runtime._unindexed_queries
      assert context.indexed_counts().tolist() == context.store.lengths().tolist()
    runtime._submit_background(-1, None)  # nothing stored since: nothing queued
    assert -1 not in runtime._pending
  finally:
    runtime.close()


def test_group_mean_cosine_norms_are_those_of_linalg_norm():
  """The drift test's cosine, bit for bit as np.linalg.norm's statement gave it (a changed rounding
  could move a group across tau), zero rows included."""
  rng = np.random.default_rng(6)
  queries, previous = rng.standard_normal((2, 5, 6, 64)).astype(np.float32)
  previous[1, 2] = 0.0
  dot = np.sum(queries * previous, axis=-1)
  norms = np.linalg.norm(queries, axis=-1) * np.linalg.norm(previous, axis=-1)
  want = (dot / np.maximum(norms, 1e-30)).reshape(5, 3, 2).mean(axis=-1)
  got = host_runtime.group_mean_cosine(queries, previous, 3)
  assert got.dtype == want.dtype
  np.testing.assert_array_equal(got, want)


def test_speculative_counters_partition_the_groups_and_match_the_searched_heads():
  """Every exchange after the first decides each (layer, seq, KV group) once: corrected, refreshed on its
  turn, or speculated; the searched heads are the first two kinds' query heads."""
  rng = np.random.default_rng(7)
  L, Hkv, n, D = 2, 2, 40, 8
  keys, values = rng.standard_normal((2, L, Hkv, n, D)).astype(np.float32)
  runtime = _runtime(keys, values, topk=3, tail_slots=6, speculative=True, tau=0.9)
  queries = rng.standard_normal((L, 1, 2 * Hkv, D), dtype=np.float32)
  none = (np.zeros((L, 1, Hkv, D), np.float32), np.zeros((L, 1, Hkv, D), np.float32),
          np.zeros((L, 1, 2 * Hkv, D), np.float32))
  try:
    runtime.prefetch_step([0, 1], queries, *none, np.full((L, 1), -1))
    kinds = set()
    for _ in range(6):
      before = dataclasses.replace(runtime.stats)
      queries = queries + 0.5 * rng.standard_normal(queries.shape, dtype=np.float32)
      runtime.prefetch_step([0, 1], queries, *none, np.full((L, 1), -1))
      delta = {name: getattr(runtime.stats, name) - getattr(before, name)
               for name in ("corrected_groups", "refreshed_groups", "speculated_groups", "searched_heads")}
      assert delta["corrected_groups"] + delta["refreshed_groups"] + delta["speculated_groups"] == L * Hkv
      assert delta["searched_heads"] == 2 * (delta["corrected_groups"] + delta["refreshed_groups"])
      kinds |= {name for name, count in delta.items() if count}
    assert kinds == {"corrected_groups", "refreshed_groups", "speculated_groups", "searched_heads"}
  finally:
    runtime.close()


def test_successor_ids_follow_each_found_id_within_the_store():
  found = np.array([[[[3, 7, -1, 8]]]])  # [T, B, Hq, k]; store of 9 tokens (ids 0..8)
  got = successor_ids(found, np.array([[9]]), 2)
  np.testing.assert_array_equal(got, [[[[4, 5, 8, -1, -1, -1, -1, -1]]]])
  assert successor_ids(found, np.array([[9]]), 0).shape == (1, 1, 1, 0)
  # a search reused for 2 more exchanges: its successors start 2 further on
  got = successor_ids(found, np.array([[12]]), 2, age=np.array([[[2]]]))
  np.testing.assert_array_equal(got, [[[[6, 7, 10, 11, -1, -1, 11, -1]]]])  # 8 + 2 + 2 = 12: past the store


@pytest.mark.parametrize("sources", [8, 2])
def test_successors_extend_the_selection_by_the_following_tokens(sources):
  """A small top-k with successors selects exactly top-k, the followers within the store of its
  best `sources` ids and the unindexed tail, each once (successors lag behind a stale query's find)."""
  rng = np.random.default_rng(1)
  L, Hkv, n, D, topk = 1, 1, 30, 8, 4
  keys, values = rng.standard_normal((2, L, Hkv, n, D), dtype=np.float32)
  runtime = _runtime(keys, values, topk=topk, successors=2, successor_sources=sources)
  queries = rng.standard_normal((L, 1, 2, D), dtype=np.float32)
  evicted_pos = np.array([[-1]])
  try:
    assert runtime.slots == topk + min(sources, topk) * 2 + runtime.tail_slots
    runtime.prefetch_step([0], queries, *np.zeros((2, L, 1, Hkv, D), np.float32), np.zeros((L, 1, 2, D), np.float32),
                          evicted_pos)
    for h in range(2):
      top = np.argsort(-(keys[0, 0] @ queries[0, 0, h]))[:topk]
      expect = {int(i) for i in top} | {int(i) + j for i in top[:sources] for j in (1, 2) if i + j < n}
      ids = runtime.slot_ids[0, 0, h]
      assert sorted(ids[ids >= 0].tolist()) == sorted(expect)  # each once: a repeated id takes one slot
  finally:
    runtime.close()


def test_span_ids_start_at_each_id_within_the_store():
  starts = np.array([[[[3, -1, 7]]]])  # [T, B, Hq, p]; store of 9 tokens
  np.testing.assert_array_equal(span_ids(starts, np.array([[9]]), 3), [[[[3, 4, 5, -1, -1, -1, 7, 8, -1]]]])


def test_pinned_spans_of_the_pinning_query_stay_in_every_selection():
  """pin() keeps each head's best `pinned` ids for its query, with the tokens after them; later
  exchanges select their own top-k, the tail and those spans, each id once."""
  rng = np.random.default_rng(4)
  L, Hkv, n, D, topk = 1, 1, 40, 8, 4
  keys, values = rng.standard_normal((2, L, Hkv, n, D), dtype=np.float32)
  runtime = _runtime(keys, values, topk=topk, pinned=2, pinned_span=3)
  question = rng.standard_normal((L, 1, 2, D), dtype=np.float32)
  zeros = (*np.zeros((2, L, 1, Hkv, D), np.float32), np.zeros((L, 1, 2, D), np.float32), np.array([[-1]]))
  try:
    assert runtime.slots == topk + runtime.tail_slots + 2 * 3
    runtime.pin([0], question[:, :, :, None])  # W = 1: the search's best ids
    for step in range(3):
      queries = rng.standard_normal((L, 1, 2, D), dtype=np.float32)
      runtime.prefetch_step([0], queries, *zeros)
      for h in range(2):
        pinned = np.argsort(-(keys[0, 0] @ question[0, 0, h]))[:2]
        top = np.argsort(-(keys[0, 0] @ queries[0, 0, h]))[:topk]
        expect = {int(i) for i in top} | {int(i) + j for i in pinned for j in range(3) if i + j < n}
        ids = runtime.slot_ids[0, 0, h]
        assert sorted(ids[ids >= 0].tolist()) == sorted(expect)
  finally:
    runtime.close()


def test_a_failed_last_prefetch_is_raised_by_settle_and_warned_at_close():
  """The prefetch started after a decode's last step serves no step, so no take_prefetched
  raises its failure: reading the counters (settle) does, and closing warns of it."""
  rng = np.random.default_rng(3)
  keys, values = rng.standard_normal((2, 1, 1, 20, 8), dtype=np.float32)
  runtime = _runtime(keys, values, topk=4)

  def broken_copy(update):
    raise OSError("device gone")

  zeros = (*np.zeros((2, 1, 1, 1, 8), np.float32), np.zeros((1, 1, 2, 8), np.float32), np.array([[-1]]))
  runtime.start_prefetch(broken_copy, [0], rng.standard_normal((1, 1, 2, 8), dtype=np.float32), *zeros)
  with pytest.raises(RuntimeError, match="prefetch failed"):
    runtime.settle()
  with pytest.warns(RuntimeWarning, match="device gone"):
    runtime.close()


def test_a_window_of_queries_pins_the_ids_they_attend_most_together():
  """W > 1: the union of the W searches (here every stored key) ranked by the W queries'
  summed softmax, each over those keys and its device keys (log-sum-exp given); an absent
  query is left out."""
  rng = np.random.default_rng(6)
  L, Hkv, n, D, W, pinned = 1, 1, 24, 8, 3, 3
  keys, values = rng.standard_normal((2, L, Hkv, n, D), dtype=np.float32)
  queries = 2 * rng.standard_normal((L, 1, 2, W, D), dtype=np.float32)
  device_lse = rng.standard_normal((L, 1, 2, W)).astype(np.float32)
  for valid in (np.ones((1, W), bool), np.array([[False, True, True]])):
    runtime = _runtime(keys, values, topk=n, pinned=pinned, pinned_span=2)
    try:
      runtime.pin([0], queries, device_lse, valid)
      for h in range(2):
        scores = D**-0.5 * queries[0, 0, h][valid[0]] @ keys[0, 0].T  # [W', n]
        total = np.logaddexp(np.log(np.exp(scores).sum(-1)), device_lse[0, 0, h][valid[0]])
        votes = np.exp(scores - total[:, None]).sum(0)
        np.testing.assert_array_equal(runtime.pinned_ids[0, 0, h], np.argsort(-votes, kind="stable")[:pinned])
    finally:
      runtime.close()


@pytest.mark.parametrize("lengths", [(12,), (5,), (12, 4)])
def test_prompt_window_reads_the_last_queries_and_their_device_keys(lengths):
  """prompt_window against NumPy: the ring (sinks, then slot (pos - sinks) % R) filled from a
  known prompt; each window query's log-sum-exp over the sinks and the window's keys at or before
  it (the ring's older keys, R - window of them, are in the host store)."""
  rng = np.random.default_rng(len(lengths) + lengths[0])
  L, Hq, Hkv, D, S, R, W, window = 2, 4, 2, 8, 2, 5, 3, 3
  B = len(lengths)
  ring_q = np.zeros((L, B, Hq, R, D), np.float32)
  ring_k = np.zeros((L, B, Hkv, S + R, D), np.float32)
  Q = rng.standard_normal((B, L, Hq, max(lengths), D), dtype=np.float32)
  K = rng.standard_normal((B, L, Hkv, max(lengths), D), dtype=np.float32)
  for b, n in enumerate(lengths):
    for p in range(n):  # later positions overwrite their ring slot, as the prefill writes
      slot = p if p < S else S + (p - S) % R
      ring_k[:, b, :, slot] = K[b, :, :, p]
      if p >= S:
        ring_q[:, b, :, (p - S) % R] = Q[b, :, :, p]
  q, lse, valid = prompt_window(jnp.asarray(ring_q), jnp.asarray(ring_k), jnp.asarray(lengths, jnp.int32),
                                sinks=S, window=window, size=W, scale=0.5)
  for b, n in enumerate(lengths):
    held = [p for p in range(n) if p < S or p >= max(S, n - window)]
    for w in range(W):
      pos = n - W + w
      assert bool(valid[b, w]) == (pos >= S)
      if pos < S:
        continue
      np.testing.assert_array_equal(q[:, b, :, w], Q[b, :, :, pos])
      seen = [p for p in held if p <= pos]
      for layer in range(L):
        for h in range(Hq):
          s = 0.5 * K[b, layer, h // 2, seen] @ Q[b, layer, h, pos]
          np.testing.assert_allclose(lse[layer, b, h, w], np.log(np.exp(s).sum()), rtol=1e-5)


@pytest.mark.parametrize("window", [1, 4])
def test_a_loaded_context_pins_what_the_prefill_pinned(tmp_path, monkeypatch, window):
  model = tiny_model("llama")
  prompt = random_prompt(50, seed=7)
  options = dict(index="roar", topk=6, lag=2, pinned=3, pinned_span=4, pinned_window=window, **PER_STEP)
  calls = []
  real_pin = PrefetchRuntime.pin
  def recorded_pin(self, layers, queries, device_lse=None, valid=None):
    calls.append((queries.shape[3], device_lse.shape[3], bool(np.all(np.isfinite(device_lse)))))
    return real_pin(self, layers, queries, device_lse, valid)
  monkeypatch.setattr(PrefetchRuntime, "pin", recorded_pin)
  ctx = kvjax.prefill(model, prompt, max_new_tokens=STEPS_SAVED, policy="retrieval", policy_options=options,
                      prefill_chunk=16)
  assert calls == [(window, window, True)]  # the window's queries reach pin() with their device keys' lse
  pinned = ctx.policy.runtime(ctx.state).pinned_ids.copy()
  assert (pinned[:, :, :, 0] >= 0).all()  # every head of every host layer pinned its best id
  kvjax.save_context(ctx, tmp_path / "c")
  direct = kvjax.decode(model, ctx, max_new_tokens=STEPS_SAVED, return_logits=True)
  loaded_ctx = kvjax.load_context(tmp_path / "c", model)
  assert len(calls) == 2
  np.testing.assert_array_equal(loaded_ctx.policy.runtime(loaded_ctx.state).pinned_ids, pinned)
  loaded = kvjax.decode(model, loaded_ctx, max_new_tokens=STEPS_SAVED, return_logits=True)
  assert loaded.tokens == direct.tokens
  np.testing.assert_allclose(loaded.logits, direct.logits, rtol=1e-5, atol=1e-5)


def test_the_indexing_is_queued_beside_or_after_the_gather():
  """An exchange the device waits for (lag 0, 1) gathers before it queues the indexing, so the
  two do not share the cores; lag 2's queues it first. The rows and the indexing are the same."""
  rng = np.random.default_rng(4)
  L, Hkv, n, D = 1, 1, 24, 8
  keys, values = rng.standard_normal((2, L, Hkv, n, D), dtype=np.float32)
  queries, evicted_q = rng.standard_normal((2, L, 1, 2, D), dtype=np.float32)
  evicted_k, evicted_v = rng.standard_normal((2, L, 1, Hkv, D), dtype=np.float32)
  step = ([0], queries, evicted_k, evicted_v, evicted_q, np.array([[2 + n]]))  # position 2 + n: the sinks are 2
  slot_ids = []
  for after in (False, True):
    runtime = _runtime(keys, values, topk=4, kind="graph", index_after_gather=after)
    calls = []
    for name in ("_submit_background", "_gather_update"):
      method = getattr(runtime, name)
      setattr(runtime, name, lambda *a, _name=name, _method=method: calls.append(_name) or _method(*a))
    try:
      runtime.prefetch_step(*step)
      order = ["_gather_update", "_submit_background"]
      assert calls == (order if after else order[::-1])
      runtime._wait_background(-1)
      assert runtime.context.indexed_counts().tolist() == [[n + 1]]  # the evicted token is indexed either way
      slot_ids.append(runtime.slot_ids)
    finally:
      runtime.close()
  np.testing.assert_array_equal(*slot_ids)


def test_only_an_exchange_the_device_waits_for_indexes_after_its_gather():
  model = tiny_model("llama")
  for lag, after in ((0, True), (1, True), (2, False)):
    policy = RetrievalAttention(index="flat", topk=4, bridge="per_step", lag=lag)
    context = host_index.HostContext(1, model.cfg.num_layers, model.cfg.num_heads, model.cfg.num_kv_heads,
                                     model.cfg.head_dim, dtype="float32", kind="flat")
    runtime = policy.new_runtime(model.cfg, context)
    try:
      assert runtime.index_after_gather is after
    finally:
      runtime.close()


def test_a_reused_search_moves_its_successors_on_by_its_age():
  """Speculative reuse (tau 0 keeps every search until its turn in the rotation): a head that
  reuses the search of the previous exchange attends the tokens 2 after each found one, not 1."""
  rng = np.random.default_rng(2)
  L, Hkv, n, D, topk = 1, 2, 40, 8, 3
  keys, values = rng.standard_normal((2, L, Hkv, n, D), dtype=np.float32)
  runtime = _runtime(keys, values, topk=topk, tail_slots=8, successors=1, speculative=True, tau=0.0)
  queries = rng.standard_normal((L, 1, 2 * Hkv, D), dtype=np.float32)
  none = np.zeros((L, 1, Hkv, D), np.float32), np.zeros((L, 1, Hkv, D), np.float32), np.zeros((L, 1, 2 * Hkv, D), np.float32)
  try:
    for _ in range(2):
      runtime.prefetch_step([0], queries, *none, np.array([[-1]]))
    reused = np.flatnonzero(runtime._searched_at[0, 0] == 1)
    assert reused.size  # the rotation refreshed only some groups at the second exchange
    for h in reused:
      top = np.argsort(-(keys[0, h // 2] @ queries[0, 0, h]))[:topk]
      ids = runtime.slot_ids[0, 0, h]
      assert set(ids[ids >= 0].tolist()) == {int(i) for i in top} | {int(i) + 2 for i in top if i + 2 < n}
  finally:
    runtime.close()


@pytest.mark.parametrize("layers, num_layers", [([0, 1], 2), ([0, 2], 3)])
def test_merge_refresh_keeps_the_exact_top_k_of_the_latest_search_query(layers, num_layers):
  """refresh="merge" with exact (flat) search: while queries do not drift no head searches again,
  yet each head's top-k stays the exact top-k, by the query of its latest search, of every token
  stored up to its latest merge (scores of earlier merges reused), and its tail holds the rest.
  At step 5 the queries turn around (cosine -1 < tau 0): every head searches, none merges, and the
  merges after it must score the new search's top-k afresh. Layers [0, 2]: the per-layer state
  indexed by an array."""
  rng = np.random.default_rng(11)
  L, Hkv, n, D, topk = num_layers, 2, 30, 8, 4
  keys, values = rng.standard_normal((2, L, Hkv, n, D), dtype=np.float32)
  runtime = _runtime(keys, values, topk=topk, tail_slots=4, speculative=True, tau=0.0, refresh="merge")
  Hq = 2 * Hkv
  queries = rng.standard_normal((L, 1, Hq, D), dtype=np.float32)
  search_query = queries.copy()  # the query of every head's latest search
  stored_k = [np.array(keys[layer]) for layer in range(L)]  # [Hkv, n, D] per layer, grown below
  merges = 0
  try:
    for step in range(9):
      evicted_k, evicted_v = rng.standard_normal((2, L, 1, Hkv, D), dtype=np.float32)
      step_query = (-1 if step >= 5 else 1) * (queries + 0.01 * step)
      if step == 5:
        search_query = step_query
      evicted_k[:, 0] += 3 * search_query[:, 0, ::2]  # strong new keys: merging must take them in
      position = runtime.sinks + n + step - 1  # the first exchange stores nothing
      evicted_pos = np.full((L, 1), position if step else -1)
      searched_before = runtime.stats.searched_heads
      merged_before = runtime.stats.refreshed_groups
      runtime.prefetch_step(layers, step_query, evicted_k, evicted_v,
                            rng.standard_normal((L, 1, Hq, D), dtype=np.float32), evicted_pos)
      if step:
        for layer in layers:
          stored_k[layer] = np.concatenate([stored_k[layer], evicted_k[layer, 0][:, None]], axis=1)
        searched_now = runtime.stats.searched_heads - searched_before
        assert searched_now == (len(layers) * Hq if step == 5 else 0)  # only the turn searches again
        merges += runtime.stats.refreshed_groups - merged_before if step > 5 else 0
      for layer in layers:
        for h in range(Hq):
          seen = int(runtime._seen[layer, 0, h])
          scores = stored_k[layer][h // 2, :seen] @ search_query[layer, 0, h]
          want = np.argsort(-scores, kind="stable")[:topk]
          np.testing.assert_array_equal(runtime._last_found[layer, 0, h], want)
          assert stored_k[layer].shape[1] - seen <= runtime.tail_slots
    assert merges > 0 and runtime._last_found[layers].max() >= n  # merged heads took in new tokens
    assert 0 < runtime.stats.merge_seconds <= runtime.stats.search_seconds
  finally:
    runtime.close()


def test_prefetch_step_is_exact_top_k_plus_every_unindexed_token():
  rng = np.random.default_rng(0)
  L, Hkv, n, D, topk = 2, 2, 40, 16, 5
  keys, values = rng.standard_normal((2, L, Hkv, n, D), dtype=np.float32)
  runtime = _runtime(keys, values, topk=topk)
  Hq = 2 * Hkv
  queries = rng.standard_normal((L, 1, Hq, D), dtype=np.float32)
  evicted_k, evicted_v = rng.standard_normal((2, L, 1, Hkv, D), dtype=np.float32)
  evicted_q = rng.standard_normal((L, 1, Hq, D), dtype=np.float32)
  evicted_pos = np.array([[runtime.sinks + n], [-1]])  # layer 0 evicts the token after the stored ones
  try:
    update = runtime.prefetch_step([0, 1], queries, evicted_k, evicted_v, evicted_q, evicted_pos)
    k, v, valid = DeviceMirror(L, 1, Hq, topk + runtime.tail_slots, D).apply(update)
    assert update.count == int(valid.sum())  # a first step ships every selected row, nothing else
    for layer in range(L):
      for h in range(Hq):
        scores = keys[layer, h // 2] @ queries[layer, 0, h]
        expect = set(np.argsort(-scores)[:topk])
        slots = np.flatnonzero(valid[layer, 0, h])
        store = np.concatenate([keys[layer, h // 2], evicted_k[layer, 0, h // 2][None]])  # the evicted one is id n
        found = {int(np.flatnonzero((store == row).all(axis=1))[0]) for row in k[layer, 0, h, slots]}
        expect_all = expect | ({n} if layer == 0 else set())  # layer 0's evicted token: stored, not indexed yet
        assert found == expect_all  # the exact top-k's own rows, plus every unindexed token
        np.testing.assert_array_equal(runtime.slot_ids[layer, 0, h, slots] >= 0, True)
        for slot in slots:
          i = int(runtime.slot_ids[layer, 0, h, slot])
          row_v = values[layer, h // 2, i] if i < n else evicted_v[layer, 0, h // 2]
          np.testing.assert_array_equal(v[layer, 0, h, slot], row_v)
    runtime._wait_background(-1)
    assert runtime.context.indexed(0, 0) == n + 1  # indexed by the background job
  finally:
    runtime.close()


def test_group_mean_search_gives_a_group_the_exact_top_k_of_its_mean_query():
  rng = np.random.default_rng(2)
  L, Hkv, n, D, topk = 2, 2, 40, 16, 6
  keys, values = rng.standard_normal((2, L, Hkv, n, D), dtype=np.float32)
  runtime = _runtime(keys, values, topk=topk, search_query="group_mean")
  Hq, group = 2 * Hkv, 2
  queries = rng.standard_normal((L, 1, Hq, D), dtype=np.float32)
  no_k, no_v = np.zeros((2, L, 1, Hkv, D), np.float32)
  try:
    runtime.prefetch_step([0, 1], queries, no_k, no_v, np.zeros((L, 1, Hq, D), np.float32), np.full((L, 1), -1))
    for layer in range(L):
      for h in range(Hq):
        g = h // group
        mean_query = queries[layer, 0, g * group:(g + 1) * group].mean(axis=0)
        expect = set(np.argsort(-(keys[layer, g] @ mean_query))[:topk])
        held = set(runtime.slot_ids[layer, 0, h][runtime.slot_ids[layer, 0, h] >= 0].tolist())
        assert held == expect  # each head of the group: the mean query's exact top-k (nothing evicted)
    assert runtime.stats.searched_heads == L * Hkv  # one search a group
  finally:
    runtime.close()
  np.testing.assert_allclose(prefetch_runtime.group_mean_queries(queries, group)[:, :, 1],
                             queries[:, :, :2].mean(axis=2), rtol=1e-6)
  with pytest.raises(ValueError, match="search_query='first'"):
    _runtime(keys, values, topk=topk, search_query="first")


def test_attend_rows_matches_dense_masked_attention():
  rng = np.random.default_rng(1)
  B, H, n, D = 2, 3, 7, 16
  q, k, v = (rng.standard_normal(s, dtype=np.float32) for s in ((B, H, D), (B, H, n, D), (B, H, n, D)))
  valid = rng.random((B, H, n)) < 0.6
  valid[0, 0] = False  # one head with nothing: o = 0, lse = -inf
  o, lse = attend_rows(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(valid), scale=0.3)
  for b in range(B):
    for h in range(H):
      s = 0.3 * k[b, h] @ q[b, h]
      if not valid[b, h].any():
        assert np.all(np.asarray(o[b, h]) == 0) and np.asarray(lse[b, h]) == -np.inf
        continue
      s = np.where(valid[b, h], s, -np.inf)
      w = np.exp(s - s.max())
      np.testing.assert_allclose(o[b, h], (w / w.sum()) @ v[b, h], rtol=1e-5, atol=1e-5)
      np.testing.assert_allclose(lse[b, h], s.max() + np.log(w.sum()), rtol=1e-5)


def test_first_of_each_id():
  ids = jnp.asarray([[5, -1, 3, 5, 3, 7, -1, 5], [0, 0, 0, -1, 2, 1, 2, 9]], jnp.int32)
  expect = [[1, 0, 1, 0, 0, 1, 0, 0], [1, 0, 0, 0, 1, 1, 0, 1]]
  np.testing.assert_array_equal(first_of_each_id(ids), np.asarray(expect, bool))


def test_group_rows_attend_the_union_of_a_groups_rows_once():
  """Each head's attention over the distinct store ids its group's heads hold (a row held by two
  heads counted once; -1 empty), against NumPy on the union; a head with no own row still
  attends its group-mates'."""
  rng = np.random.default_rng(2)
  B, Hkv, group, n, D, stored = 2, 2, 3, 5, 8, 9
  Hq = Hkv * group
  store_k, store_v = (rng.standard_normal((B, Hkv, stored, D)).astype(np.float32) for _ in range(2))
  ids = rng.integers(-1, stored, size=(B, Hq, n)).astype(np.int32)  # repeats within and across heads
  ids[0, 0] = -1  # head 0 holds nothing itself
  kv_head = np.arange(Hq) // group
  gathered = lambda store: np.stack([[store[b, kv_head[h], np.maximum(ids[b, h], 0)] for h in range(Hq)]
                                     for b in range(B)])
  q = rng.standard_normal((B, Hq, D)).astype(np.float32)
  o, lse = attend_group_rows(jnp.asarray(q), jnp.asarray(gathered(store_k)), jnp.asarray(gathered(store_v)),
                             jnp.asarray(ids), group=group, scale=0.4)
  assert o.shape == (B, Hq, D) and lse.shape == (B, Hq)
  for b in range(B):
    for h in range(Hq):
      g = kv_head[h]
      union = sorted({int(i) for j in range(g * group, (g + 1) * group) for i in ids[b, j] if i >= 0})
      s = 0.4 * store_k[b, g, union] @ q[b, h]
      w = np.exp(s - s.max())
      np.testing.assert_allclose(o[b, h], (w / w.sum()) @ store_v[b, g, union], rtol=1e-5, atol=1e-5)
      np.testing.assert_allclose(lse[b, h], s.max() + np.log(w.sum()), rtol=1e-5)


@pytest.mark.parametrize("every_head_holds_it", [False, True])
def test_group_rows_at_lag_0_attend_the_evicted_token_once(every_head_holds_it):
  """lag 0: the ring leaves the token this step evicts out only when every head holds it in its
  rows; otherwise the ring attends it, so no head's union may (one group-mate holding it would
  count it twice)."""
  cfg = tiny_model("llama").cfg  # 6 query heads, 2 KV heads
  policy = RetrievalAttention(bridge="per_step", lag=0, group_rows=True, sinks=2, window=4, topk=3)
  B, n, D = 1, 3, cfg.head_dim
  pos = jnp.asarray([20], jnp.int32)
  leaving = 20 - 4 - 2  # store id of position pos - window
  rng = np.random.default_rng(3)
  ids = rng.integers(0, leaving, size=(1, B, cfg.num_heads, n)).astype(np.int32)  # [L=1, B, Hq, n]
  ids[0, 0, 1, 0] = leaving  # head 1 (group 0) holds it
  if every_head_holds_it:
    ids[0, 0, :, 2] = leaving
  state = types.SimpleNamespace(buf_ids=jnp.asarray(ids),
                                buf_k=jnp.asarray(rng.standard_normal((1, B, cfg.num_heads, n, D)), jnp.float32),
                                buf_v=jnp.asarray(rng.standard_normal((1, B, cfg.num_heads, n, D)), jnp.float32))
  q0 = jnp.asarray(rng.standard_normal((B, cfg.num_heads, D)), jnp.float32)
  held = policy._evicted_in_rows(state, 0, pos)
  o, lse = policy._attend_buffered_rows(cfg, 0, q0, pos, state, evicted_in_rows=held)
  kept = ids[0] if every_head_holds_it else np.where(ids[0] == leaving, -1, ids[0])
  o_ref, lse_ref = attend_group_rows(q0, state.buf_k[0], state.buf_v[0], jnp.asarray(kept), group=3,
                                     scale=cfg.attn_scale)
  np.testing.assert_allclose(o, o_ref, rtol=1e-6)
  np.testing.assert_allclose(lse, lse_ref, rtol=1e-6)
  assert bool(held[0]) == every_head_holds_it


def test_group_rows_options():
  with pytest.raises(ValueError, match="group_rows=True applies to bridge='per_step'"):
    RetrievalAttention(group_rows=True)
  with pytest.raises(TypeError, match="group_rows"):
    RetrievalAttention(bridge="per_step", group_rows=1)
  assert "each head attending its KV group's rows" in RetrievalAttention(bridge="per_step", group_rows=True).describe()


@pytest.mark.parametrize("lag", [0, 1, 2])
def test_saved_context_decodes_token_for_token(tmp_path, lag):
  model = tiny_model("llama")
  prompt = random_prompt(50, seed=7)
  options = dict(index="roar", topk=6, lag=lag, **PER_STEP)
  ctx = kvjax.prefill(model, prompt, max_new_tokens=STEPS_SAVED, policy="retrieval", policy_options=options,
                      prefill_chunk=16)
  kvjax.save_context(ctx, tmp_path / "c")
  direct = kvjax.decode(model, ctx, max_new_tokens=STEPS_SAVED, return_logits=True)
  loaded = kvjax.decode(model, kvjax.load_context(tmp_path / "c", model), max_new_tokens=STEPS_SAVED,
                        return_logits=True)
  assert loaded.tokens == direct.tokens
  np.testing.assert_allclose(loaded.logits, direct.logits, rtol=1e-5, atol=1e-5)
  # Other row buffers at load (top-k, successors, tail slots): as a prefill with those options.
  other = dict(topk=9, successors=0, tail_slots=6)
  fresh = kvjax.generate(model, prompt, max_new_tokens=STEPS_SAVED, policy="retrieval", prefill_chunk=16,
                         policy_options=options | other, return_logits=True)
  resized = kvjax.decode(model, kvjax.load_context(tmp_path / "c", model, policy_options=other),
                         max_new_tokens=STEPS_SAVED, return_logits=True)
  assert resized.tokens == fresh.tokens
  np.testing.assert_allclose(resized.logits, fresh.logits, rtol=1e-5, atol=1e-5)
  assert np.abs(resized.logits - direct.logits).max() > 1e-3  # the options did change the decode
  with pytest.raises(ValueError, match="cannot change at decode"):
    kvjax.load_context(tmp_path / "c", model, policy_options={"lag": 3 - lag})


STEPS_SAVED = 12


def test_every_update_size_compiles_before_the_first_step(tmp_path, monkeypatch):
  """With the warm-up (forced here: it is off on a CPU backend) a decode compiles no update
  scatter, after a prefill and after a load, and decodes as without it; without the warm-up a
  decode with fresh buffer shapes does compile some (what the warm-up moves out of the steps)."""
  model = tiny_model("llama")
  prompt = random_prompt(50, seed=8)

  def prefill_and_decode(topk, warm, path=None):
    monkeypatch.setattr(row_update, "WARM_ON_CPU", warm)
    options = dict(index="flat", topk=topk, lag=2, **PER_STEP)
    ctx = kvjax.prefill(model, prompt, max_new_tokens=STEPS_SAVED, policy="retrieval", policy_options=options,
                        prefill_chunk=16)
    if path is not None:
      kvjax.save_context(ctx, path)
    before, reads = row_update.scatter_rows._cache_size(), device_read._pack._cache_size()
    result = kvjax.decode(model, ctx, max_new_tokens=STEPS_SAVED, return_logits=True)
    assert device_read._pack._cache_size() == reads  # the steps' output read compiled with the first rows
    return result, row_update.scatter_rows._cache_size() - before

  _, compiled = prefill_and_decode(topk=5, warm=False)
  assert compiled > 0
  warm, compiled = prefill_and_decode(topk=6, warm=True, path=tmp_path / "c")
  assert compiled == 0
  cold, _ = prefill_and_decode(topk=6, warm=False)  # the same shapes, compiled already: equal results
  assert warm.tokens == cold.tokens
  np.testing.assert_array_equal(warm.logits, cold.logits)
  loaded = kvjax.load_context(tmp_path / "c", model)  # attach_host warms again (nothing new to compile)
  before = row_update.scatter_rows._cache_size()
  again = kvjax.decode(model, loaded, max_new_tokens=STEPS_SAVED, return_logits=True)
  assert row_update.scatter_rows._cache_size() == before and again.tokens == warm.tokens


def test_warm_scatter_leaves_the_buffers_as_they_were(monkeypatch):
  monkeypatch.setattr(row_update, "WARM_ON_CPU", True)
  rng = np.random.default_rng(0)
  buf_k = jnp.asarray(rng.standard_normal((2, 3, 5, 4)), jnp.float32)
  buf_v = jnp.asarray(rng.standard_normal((2, 3, 5, 4)), jnp.float32)
  buf_ids = jnp.asarray(rng.integers(-1, 9, (2, 3, 5)), jnp.int32)
  want = [np.asarray(a) for a in (buf_k, buf_v, buf_ids)]
  sizes_before = row_update.scatter_rows._cache_size()
  out = row_update.warm_scatter(buf_k, buf_v, buf_ids, most=200)
  for got, expected in zip(out, want):
    np.testing.assert_array_equal(np.asarray(got), expected)
  assert row_update.scatter_rows._cache_size() - sizes_before <= len(row_update.ladder(200))
  assert row_update.ladder(200) == [64, 128, 192, 256] and row_update.ladder(64) == [64]


def test_pinned_default_follows_the_bridge_and_topk():
  """per_step pins 16 ids a head by default, at most topk (so a load with another topk pins that
  topk's default); per_layer pins none; an explicit value is kept."""
  assert RetrievalAttention(bridge="per_step").pinned_per_head == 16
  assert RetrievalAttention(bridge="per_step", topk=6).pinned_per_head == 6
  assert RetrievalAttention(bridge="per_step", pinned=0).pinned_per_head == 0
  assert RetrievalAttention(bridge="per_step", pinned=3).pinned_per_head == 3
  assert RetrievalAttention().pinned_per_head == 0
  policy = RetrievalAttention(bridge="per_step", topk=6)
  assert dataclasses.replace(policy, topk=9).pinned_per_head == 9
  assert "+6 spans of 16 tokens" in policy.describe()
  assert policy.slots_per_head == 6 + 6 * 2 + 16 + 6 * 16  # top-k, successors, tail slots, pinned spans


@pytest.mark.parametrize("options, message", [
    (dict(bridge="async"), "bridge="),
    (dict(bridge="per_step", tau=1.5), "tau=1.5"),
    (dict(bridge="per_step", tail_slots=0), "tail_slots=0"),
    (dict(bridge="per_step", speculative=True, refresh="skip"), "refresh='skip'"),
    (dict(bridge="per_step", refresh="merge"), "refresh='merge' applies"),
    (dict(speculative=True, refresh="merge"), "refresh='merge' applies"),
    (dict(roar_heads="group"), "roar_heads="),
    (dict(bridge="per_step", lag=3), "lag=3"),
    (dict(lag=2), "lag=2 applies"),
    (dict(lag=0), "lag=0 applies"),
    (dict(bridge="per_step", lag=True), "lag=True"),
    (dict(index="flat", roar_heads="kv"), "roar_heads='kv'"),
    (dict(bridge="per_step", successors=-1), "successors=-1"),
    (dict(successors=2), "successors=2 applies"),
    (dict(bridge="per_step", successor_sources=0), "successor_sources=0"),
    (dict(bridge="per_step", index_threads=0), "index_threads=0"),
    (dict(bridge="per_step", pinned=-1), "pinned=-1"),
    (dict(bridge="per_step", topk=4, pinned=5), "pinned=5 must not exceed topk=4"),
    (dict(bridge="per_step", pinned=2, pinned_span=0), "pinned_span=0"),
    (dict(pinned=2), "pinned=2 applies"),
    (dict(bridge="per_step", pinned_window=0), "pinned_window=0"),
    (dict(bridge="per_step", window=8, pinned_window=9), "pinned_window=9 applies"),
    (dict(pinned_window=4), "pinned_window=4 applies"),
    (dict(index_threads=4), "index_threads=4"),
    (dict(bridge="per_step", index_yields=1), "index_yields"),
    (dict(ef_insert=0), "ef_insert=0"),
    (dict(index_every=2), "index_every=2 applies"),
    (dict(bridge="per_step", index_every=0), "index_every=0"),
    (dict(bridge="per_step", tail_slots=8, index_every=5), "index_every=5 must lie in"),
    (dict(bridge="per_step", index_every=2.0), "index_every=2.0"),
    (dict(ef_insert=True), "ef_insert"),
    (dict(index="ivf", ef_insert=32), "ef_insert=32 applies"),
    (dict(bridge="per_step", search_query="group"), "search_query='group'"),
    (dict(search_query="group_mean", roar_heads="kv"), "search_query='group_mean' applies"),
    (dict(bridge="per_step", speculative=True, refresh="merge", search_query="group_mean", roar_heads="kv"),
     "does not combine"),
    (dict(bridge="per_step", search_query="group_mean"), "needs an index per KV head"),
])
def test_bad_options(options, message):
  with pytest.raises((ValueError, TypeError), match=message):
    RetrievalAttention(**options)


def test_pin_defaults_resolve_per_bridge():
  """16 pins chosen by the last 32 prompt queries with per_step (at most topk / the window), none
  with per_layer; resolved at use, so a load with another topk or window gets its own."""
  step = RetrievalAttention(bridge="per_step", lag=2)
  assert (step.pinned_per_head, step.pin_window) == (16, 32) and "last 32 queries" in step.describe()
  assert RetrievalAttention(bridge="per_step", topk=8, window=16).pinned_per_head == 8
  assert RetrievalAttention(bridge="per_step", window=16).pin_window == 16
  assert (RetrievalAttention().pinned_per_head, RetrievalAttention().pin_window) == (0, 1)
  assert RetrievalAttention(bridge="per_step", pinned_window=1).pin_window == 1


def test_updates_ship_only_entering_rows_and_keep_the_buffers_exact():
  rng = np.random.default_rng(2)
  keys, values = rng.standard_normal((2, 2, 1, 30, 8), dtype=np.float32)
  none = np.full((2, 1), -1)
  ek = np.zeros((2, 1, 1, 8), np.float32)
  eq = np.zeros((2, 1, 2, 8), np.float32)
  for reuse in (False, True):  # reused host buffers (as on a GPU) must not change the result
    runtime = _runtime(keys, values, topk=3)
    runtime.buffers.reuse = reuse
    mirror = DeviceMirror(2, 1, 2, 3 + 4, 8)
    try:
      queries = rng.standard_normal((2, 1, 2, 8), dtype=np.float32)
      mirror.apply(runtime.prefetch_step([0, 1], queries, ek, ek, eq, none))
      moved = queries + 0.05 * rng.standard_normal(queries.shape, dtype=np.float32)  # a small drift
      update = runtime.prefetch_step([0, 1], moved, ek, ek, eq, none)
      k, v, valid = mirror.apply(update)
      changed = 0
      for layer in range(2):
        for h in range(2):
          best = set(np.argsort(-(keys[layer, 0] @ moved[layer, 0, h]))[:3])
          before = set(np.argsort(-(keys[layer, 0] @ queries[layer, 0, h]))[:3])
          changed += len(best - before)
          held = {int(i) for i in mirror.ids[layer, 0, h] if i >= 0}
          assert held == best
          for slot in np.flatnonzero(valid[layer, 0, h]):
            i = mirror.ids[layer, 0, h, slot]
            np.testing.assert_array_equal(k[layer, 0, h, slot], keys[layer, 0, i])
            np.testing.assert_array_equal(v[layer, 0, h, slot], values[layer, 0, i])
      assert update.count == changed  # only the rows that entered were sent (no ids left without a successor)
      np.testing.assert_array_equal(runtime.slot_ids, mirror.ids)
    finally:
      runtime.close()


def test_padded_size_is_a_short_ladder():
  sizes = [padded_size(n) for n in range(0, 20000, 7)]
  assert all(s >= n and s % 64 == 0 for s, n in zip(sizes, range(0, 20000, 7)))
  assert max(s / n for s, n in zip(sizes, range(0, 20000, 7)) if n > 512) < 1.27
  assert len(set(sizes)) < 40
  rungs = row_update.ladder(20000)  # each n gets the smallest rung that holds it (182 got 256, not 192)
  assert all(padded_size(n) == min(r for r in rungs if r >= n) for n in range(1, 20000))


def test_successors_default_to_twice_the_lag_on_the_per_step_bridge_only():
  assert RetrievalAttention(bridge="per_step", lag=2).successors == 4
  assert RetrievalAttention(bridge="per_step").successors == 2
  assert RetrievalAttention(bridge="per_step", lag=2, successors=0).successors == 0
  assert RetrievalAttention().successors == 0  # per_layer searches with the step's own query
  policy = RetrievalAttention(bridge="per_step", lag=2, topk=10, tail_slots=4, pinned=0)  # successors of the best 8
  assert policy.slots_per_head == 10 + 8 * 4 + 4 and "+4 following tokens of the best 8" in policy.describe()
  assert RetrievalAttention(bridge="per_step", lag=2, topk=5, tail_slots=4, pinned=0).slots_per_head == 5 * 5 + 4


LAYER_OPS = 56  # a ceiling: 53 now, 68.5 with the per-layer ring copies; full's layer: 31


@pytest.mark.parametrize("lag", [1, 2])
def test_compiled_step_writes_the_rings_in_place_and_keeps_layers_small(lag):
  """Reading each layer's evicted token from its ring before the layer's write made XLA copy the
  whole [L, ...] rings every layer (~218 MB a layer at 8B shapes); after_layers reads every
  layer's at once from a ring `lag` tokens longer than the window. The compiled CPU step: no
  ring copied, and a sparse layer adds <= LAYER_OPS top-level operations (68.5 before; full's
  layer adds 31)."""
  import re

  from test_freekv import _compiled_step, ops_per_layer

  options = SMALL | dict(bridge="per_step", lag=lag)
  hlo, shapes = _compiled_step(tiny_model("llama"), options, prompt_len=80, policy="retrieval")
  copied = {tuple(int(d) for d in m.group(1).split(",")) for m in re.finditer(r"= f32\[([\d,]+)\]\S* copy\(", hlo)}
  for name in ("ring_k", "ring_v", "ring_q"):
    assert tuple(getattr(shapes, name)) not in copied, name
  per_layer = ops_per_layer(lambda layers: _compiled_step(tiny_model("llama", num_layers=layers), options,
                                                          prompt_len=80, policy="retrieval")[0])
  assert 0 < per_layer <= LAYER_OPS, per_layer


class _NumpySelection(PrefetchRuntime):
  """The exchange's selection as NumPy built it before host_index.select_slots: [L, B, Hq, slots]
  temporaries, assign_slots, the gather by slot_stores (the reference the C composition must
  match update for update)."""

  def _select(self, layers, rows, found, searched, stored, *, queue_indexing):
    if queue_indexing:
      self._submit_background(-1, None)
    wanted = self.slot_ids.copy()
    retrieved_end = self.topk + self.tail_slots
    successors_end = retrieved_end + self.successor_sources * self.successors
    wanted[rows, :, :, :self.topk] = found
    tail = self._seen[rows][..., None] + np.arange(self.tail_slots)
    wanted[rows, :, :, self.topk:retrieved_end] = np.where(tail < stored[..., None, None], tail, -1)
    if self.successors:
      age = self._exchanges - self._searched_at[rows]
      wanted[rows, :, :, retrieved_end:successors_end] = successor_ids(found[..., :self.successor_sources], stored,
                                                                       self.successors, age)
    if self.pinned:
      wanted[rows, :, :, successors_end:] = (-1 if self.pinned_ids is None else
                                             span_ids(self.pinned_ids[rows], stored, self.pinned_span))
    scored = [t for t, layer in enumerate(layers) if self._selections[layer]]
    if scored:
      used = np.stack([self._selections[layers[t]].popleft() for t in scored])
      fresh = searched[scored]
      hits, total = host_runtime.reuse_hits(used[fresh][:, :retrieved_end], found[scored][fresh])
      self.stats.reused_hits += hits
      self.stats.reused_total += total
    for layer in layers:
      self._selections[layer].append(wanted[layer])
    L, B, Hq, S = wanted.shape
    dest, ids = host_index.assign_slots(self.slot_ids.reshape(-1, S), wanted.reshape(-1, S))
    self.slot_ids = self.slot_ids.copy()
    self.slot_ids.reshape(-1)[dest] = ids
    store = self.context.store
    update = row_update.new_update(self.buffers, dest.size, L * B * Hq * S, self.context.head_dim, store.storage_dtype)
    stores, store_of, heads = prefetch_runtime.slot_stores(dest, B, Hq, S, self.context.group)
    store.gather_rows_many(stores, store_of, heads, ids, out_k=update.k[:dest.size], out_v=update.v[:dest.size])
    update.dest[:dest.size] = dest
    update.ids[:dest.size] = ids
    update.pad(L * B * Hq * S)
    self.stats.shipped_rows += dest.size
    return update


@pytest.mark.parametrize("layers, options", [
    ([0, 2, 3], dict(speculative=True, tau=0.9, successors=2, successor_sources=3, pinned=2, pinned_span=3)),
    ([1, 2], dict(successors=3, successor_sources=5, pinned=3, pinned_span=4, index_after_gather=True)),
    ([0, 1, 2, 3], dict(speculative=True, tau=0.5)),
])
def test_select_slots_updates_equal_the_numpy_composition(layers, options):
  """Step after step (speculative reuse, successors moved on by their age, pins, stores growing
  into the tail, a sequence with fewer keys than topk so -1 ids, successors and spans repeating
  found ids, dense layers, a repeated selection as lag 2 makes one), the runtime's updates,
  slot ids and hit counts equal those of the NumPy composition it replaced."""
  rng = np.random.default_rng(len(layers))
  L, B, Hkv, D, sinks, topk = 4, 2, 2, 8, 2, 5
  Hq = 2 * Hkv
  lengths = (30, 4)  # sequence 1 holds fewer keys than topk: its searches return -1 ids
  keys = [rng.standard_normal((L, Hkv, n, D), dtype=np.float32) for n in lengths]
  runtimes = []
  for cls in (PrefetchRuntime, _NumpySelection):
    context = host_index.HostContext(B, L, Hq, Hkv, D, dtype="float32", kind="flat")
    for layer in range(L):
      for b in range(B):
        context.append(b, layer, 0, keys[b][layer], 2 * keys[b][layer])
      context.build_layer(layer)
    runtimes.append(cls(context, tail_slots=4, sinks=sinks, window=8, topk=topk, ef=None, scale=D**-0.5,
                        background_threads=1, **options))
  question = rng.standard_normal((L, B, Hq, 1, D), dtype=np.float32)
  queries = rng.standard_normal((L, B, Hq, D), dtype=np.float32)
  try:
    for runtime in runtimes:
      runtime.pin(layers, question)
    for step in range(8):
      queries = queries + 0.3 * rng.standard_normal(queries.shape, dtype=np.float32)
      evicted_k = rng.standard_normal((L, B, Hkv, D), dtype=np.float32)
      evicted_q = rng.standard_normal((L, B, Hq, D), dtype=np.float32)
      stored = runtimes[0].context.store.lengths().T  # [L, B]
      evicted_pos = np.where(rng.random((L, B)) < 0.7, sinks + stored, -1)  # not every layer evicts every step
      updates = [runtime.prefetch_step(layers, queries, evicted_k, 3 * evicted_k, evicted_q, evicted_pos)
                 for runtime in runtimes]
      new, old = updates
      assert new.count == old.count and new.count > 0
      for part in ("dest", "ids", "k", "v"):
        np.testing.assert_array_equal(getattr(new, part)[:new.count], getattr(old, part)[:old.count])
      np.testing.assert_array_equal(runtimes[0].slot_ids, runtimes[1].slot_ids)
      if step == 0:
        for runtime in runtimes:
          runtime.repeat_selection()
    stats = [runtime.stats for runtime in runtimes]
    for name in ("reused_hits", "reused_total", "shipped_rows", "speculated_groups", "unindexed_attended"):
      assert getattr(stats[0], name) == getattr(stats[1], name), name
    assert stats[0].reused_total > 0
    assert not options.get("speculative") or stats[0].speculated_groups > 0
  finally:
    for runtime in runtimes:
      runtime.close()
