"""`freekv`: exact when the budget covers the context (both bridges), speculation with tau = 1
equals the synchronous path, the per_step bridge recalls each step's selection into the pool, the device's group-consistent selection matches a NumPy reference, only
missing pages are recalled, bad options are refused, host errors surface after the step."""

import functools
import os

import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import engine, freekv_host, host_runtime, kv_codec, row_update
from kvjax.policies import FreeKVAttention, make_policy
from kvjax.policies import freekv as freekv_policy
from kvjax.policies import page_selection
from kvjax.policies.page_selection import page_scores, plan_recall, top_pages
from test_generate import random_prompt, tiny_model

SMALL = dict(page_size=4, sinks=4, window=8)
STEPS = 24  # > window + page_size: tokens leave the window and new pages complete
PROMPTS = ((53, 0), (37, 1), (3, 2))  # ragged batch: (length, seed); 3 < sinks
COVERING = 4 + 8 + 4 * 20  # 20 pages >= the 17 host pages of the longest context


def prompts():
  return [random_prompt(n, seed=s) for n, s in PROMPTS]


@functools.lru_cache(maxsize=None)
def full_run():
  return kvjax.generate(tiny_model("llama"), prompts(), max_new_tokens=STEPS, prefill_chunk=16, return_logits=True)


def run(**options):
  return kvjax.generate(tiny_model("llama"), prompts(), max_new_tokens=STEPS, prefill_chunk=16,
                        return_logits=True, policy="freekv", policy_options=SMALL | options)


@pytest.fixture
def fetch_log(monkeypatch):
  """Records (layer, fetch_ids [B, Hkv, R]) of every callback."""
  log = []
  original = freekv_host.FreeKVRuntime.decode_layer

  def spy(self, layer, evicted_k, evicted_v, evicted_pos, fetch_ids, counters):
    log.append((layer, fetch_ids.copy()))
    return original(self, layer, evicted_k, evicted_v, evicted_pos, fetch_ids, counters)

  monkeypatch.setattr(freekv_host.FreeKVRuntime, "decode_layer", spy)
  return log


@pytest.mark.parametrize("speculative, dense_layers", [(False, ()), (True, (0,))])
def test_equals_full_when_budget_covers_the_context_and_recalls_each_page_once(speculative, dense_layers, fetch_log):
  before = set(host_runtime._RUNTIMES)
  full = full_run()
  sparse = run(budget=COVERING, speculative=speculative, tau=0.8, dense_layers=dense_layers)
  np.testing.assert_allclose(sparse.logits, full.logits, rtol=1e-4, atol=1e-4)
  assert sparse.tokens == full.tokens
  assert set(host_runtime._RUNTIMES) == before  # the runtime is released

  # Every page needed is recalled exactly once: later steps fetch only the page that
  # completed (non-speculative: one step later, when it becomes a candidate).
  decode_steps = STEPS - 1
  sparse_layers = 2 - len(dense_layers)
  assert len(fetch_log) == decode_steps * sparse_layers
  assert {layer for layer, _ in fetch_log} == set(range(len(dense_layers), 2))
  S, W, P = SMALL["sinks"], SMALL["window"], SMALL["page_size"]
  for b, (n, _) in enumerate(PROMPTS):
    last = n + decode_steps - 1  # position fed at the last step
    needed = (last - W - S + int(speculative)) // P  # pages complete when the last selection was made
    for layer in range(len(dense_layers), 2):
      for h in range(2):
        ids = np.concatenate([f[b, h] for l, f in fetch_log if l == layer])
        ids = ids[ids >= 0]
        assert sorted(ids.tolist()) == list(range(needed)), (b, layer, h)
  # A stable selection recalls nothing: most steps fetch no page at all.
  empty = sum(int((f < 0).all()) for _, f in fetch_log)
  assert empty >= len(fetch_log) // 2
  stats = sparse.policy_stats
  assert stats["hit_rate"] == 1.0  # the whole context is selected every step
  assert stats["decode_steps"] == decode_steps
  recalled = sum((f >= 0).sum() for _, f in fetch_log)
  assert stats["recalled_pages_per_step"] == pytest.approx(recalled / decode_steps)
  assert stats["recalled_bytes_per_step"] == pytest.approx(recalled * 2 * P * 16 * 4 / decode_steps)


def test_bfloat16_store_round_trips():
  model = tiny_model("llama", dtype="bfloat16")  # the host store holds bfloat16 as uint16 bits
  prompt = random_prompt(53)
  full = kvjax.generate(model, prompt, max_new_tokens=STEPS, prefill_chunk=16, return_logits=True)
  sparse = kvjax.generate(model, prompt, max_new_tokens=STEPS, prefill_chunk=16, return_logits=True,
                          policy="freekv", policy_options=SMALL | dict(budget=COVERING))
  np.testing.assert_allclose(sparse.logits, full.logits, rtol=0, atol=5e-2)  # |logits| ~ 4
  assert sparse.tokens == full.tokens


def test_speculative_with_tau_one_equals_non_speculative_under_a_small_budget():
  budget = 4 + 8 + 4 * 3  # 3 pages of 4 out of up to 17
  sync = run(budget=budget, speculative=False, dense_layers=())
  spec = run(budget=budget, speculative=True, tau=1.0, dense_layers=())
  # Same attended set every step; the LSE merge splits it differently between resident and
  # just-recalled pages, so the sums agree to float32 rounding, not bit for bit.
  np.testing.assert_allclose(spec.logits, sync.logits, rtol=0, atol=1e-5)
  assert spec.tokens == sync.tokens
  assert spec.policy_stats["correction_rate"] == 1.0
  assert np.abs(sync.logits - full_run().logits).max() > 1e-2  # the budget really bites
  assert 0 < sync.policy_stats["hit_rate"] < 1


def test_correcting_every_changed_selection_equals_non_speculative():
  """correct_mass 0 corrects a head whenever its new selection holds a page the reused one lacks
  (tau 0 leaves the cosine rule out), so every step attends the current query's pages, as
  without speculation, while heads whose selection did not change reuse it."""
  budget = 4 + 8 + 4 * 3
  sync = run(budget=budget, speculative=False, dense_layers=())
  spec = run(budget=budget, speculative=True, tau=0.0, correct_mass=0.0, dense_layers=())
  np.testing.assert_allclose(spec.logits, sync.logits, rtol=0, atol=1e-5)
  assert spec.tokens == sync.tokens
  assert 0 < spec.policy_stats["correction_rate"] < 1
  cosine_only = run(budget=budget, speculative=True, tau=0.0, dense_layers=())
  assert cosine_only.policy_stats["correction_rate"] < spec.policy_stats["correction_rate"]
  never = run(budget=budget, speculative=True, tau=0.0, correct_mass=1.0, dense_layers=())  # mass <= 1 always
  np.testing.assert_array_equal(never.logits, cosine_only.logits)


def test_per_step_only_counts_the_mass_corrections():
  budget = 4 + 8 + 4 * 3
  plain = run(budget=budget, bridge="per_step", tau=0.0, dense_layers=())
  counted = run(budget=budget, bridge="per_step", tau=0.0, correct_mass=0.0, dense_layers=())
  np.testing.assert_array_equal(counted.logits, plain.logits)
  assert counted.policy_stats["correction_rate"] > plain.policy_stats["correction_rate"]


def test_lost_mass_counts_only_pages_the_reused_selection_lacks():
  pooled = np.array([[[0.5, 0.2, 0.2, 0.1]]], np.float32)  # [B=1, H=1, N=4]
  selection = np.array([[[0, 2, -1]]], np.int32)
  reused = np.array([[[2, 3, -1]]], np.int32)
  lost = page_selection.lost_mass(jnp.asarray(pooled), jnp.asarray(selection), jnp.asarray(reused))
  np.testing.assert_allclose(np.asarray(lost), [[0.5]])  # page 0 is new, page 2 was held, -1 is no page
  same = page_selection.lost_mass(jnp.asarray(pooled), jnp.asarray(selection), jnp.asarray(selection))
  np.testing.assert_array_equal(np.asarray(same), [[0.0]])


def _reference_selection(q, kmax, kmin, num_candidates, n_sel, scale):
  """NumPy: per query head softmax over candidate pages of Σ_d max(q·max, q·min), group mean, top n_sel."""
  B, Hq, D = q.shape
  H = kmax.shape[1]
  G = Hq // H
  ids = np.full((B, H, n_sel), -1)
  pooled = np.full((B, H, kmax.shape[2]), -np.inf)
  for b in range(B):
    c = num_candidates[b]
    for h in range(H):
      probs = []
      for g in range(G):
        qv = q[b, h * G + g].astype(np.float64)
        s = np.maximum(qv * kmax[b, h, :c], qv * kmin[b, h, :c]).sum(-1) * scale
        e = np.exp(s - s.max())
        probs.append(e / e.sum())
      pooled[b, h, :c] = np.mean(probs, axis=0)
      order = np.argsort(-pooled[b, h, :c], kind="stable")[:n_sel]
      ids[b, h, :len(order)] = order
  return pooled, ids


def test_group_consistent_selection_matches_numpy_reference():
  rng = np.random.default_rng(0)
  B, Hq, H, N, D = 2, 6, 2, 12, 16
  q = rng.normal(size=(B, Hq, D)).astype(np.float32)
  kmax = rng.normal(size=(B, H, N, D)).astype(np.float32)
  kmin = kmax - np.abs(rng.normal(size=(B, H, N, D))).astype(np.float32)
  counts = np.array([7, 12])
  for n_sel in (5, 9):  # 9 > 7 candidates: padded with -1
    want_pooled, want_ids = _reference_selection(q, kmax, kmin, counts, n_sel, 0.25)
    pooled = page_scores(jnp.asarray(q), jnp.asarray(kmax), jnp.asarray(kmin), jnp.asarray(counts), scale=0.25)
    np.testing.assert_allclose(np.asarray(pooled), want_pooled, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(top_pages(pooled, n_sel)), want_ids)


def test_plan_recall_fetches_only_missing_pages_into_the_lowest_scoring_slots():
  pool = jnp.asarray([[[5, -1, 2, 7]]], jnp.int32)  # slot 1 empty
  scores = jnp.asarray([[[0.0, 0.0, 0.3, 0.1, 0.05, 0.2, 0.0, 0.02, 0.0, 0.25]]], jnp.float32)
  wanted = jnp.asarray([[[2, 9, 3, 4]]], jnp.int32)  # 2 resident; 9, 3, 4 missing
  fetch, slots, new_pool = plan_recall(pool, wanted, scores, 4)
  assert fetch.tolist() == [[[9, 3, 4, -1]]]
  # Empty slot 1 first, then page 7 (score 0.02) before page 5 (0.2); page 2 is kept.
  assert slots.tolist() == [[[1, 3, 0, 4]]]
  assert new_pool.tolist() == [[[4, 9, 2, 3]]]
  again, _, same = plan_recall(new_pool, wanted, scores, 4)
  assert (np.asarray(again) == -1).all() and same.tolist() == new_pool.tolist()
  capped, _, _ = plan_recall(pool, wanted, scores, 2)  # max_recall bounds a step's recall
  assert capped.tolist() == [[[9, 3]]]


@pytest.mark.parametrize("options, message", [
    (dict(page_size=32, sinks=48), "sinks=48"),
    (dict(page_size=32, window=100), "window=100"),
    (dict(budget=2050), "budget=2050"),
    (dict(budget=1024), "budget=1024"),
    (dict(budget=512), "budget=512"),
    (dict(tau=1.5), "tau=1.5"),
    (dict(tau=-0.1), "tau=-0.1"),
    (dict(correct_mass=1.5), "correct_mass=1.5"),
    (dict(correct_mass=True), "correct_mass=True"),
    (dict(speculative=False, correct_mass=0.1), "applies to speculative=True"),
    (dict(max_recall=0), "max_recall=0"),
    (dict(max_recall=33), "max_recall=33"),
    (dict(page_size=0), "page_size=0"),
    (dict(dense_layers=(-1,)), "dense_layers"),
    (dict(implementation="cuda"), "implementation="),
    (dict(bridge="per_token"), "bridge='per_token'"),
    (dict(bridge="per_step", speculative=False), "needs speculative=True"),
    (dict(transfer="dma"), "transfer='dma'"),
    (dict(sync_transfer="yes"), "sync_transfer='yes'"),
    (dict(lag=3, bridge="per_step"), "lag=3"),
    (dict(lag=2), "lag=2 needs bridge='per_step'"),
    (dict(page_summary="keys3"), "page_summary='keys3'"),
    (dict(reserved_cores=1), "reserved_cores=1"),
    (dict(bridge="per_step", lag=2, reserved_cores=-1), "reserved_cores=-1"),
    (dict(bridge="per_step", lag=2, reserved_cores=100_000), "reserved_cores=100000 leaves no core"),
    (dict(bridge="per_step", page_size=1, budget=24, sinks=4, window=8), "page_size=1: bridge='per_step'"),
])
def test_bad_options(options, message):
  with pytest.raises(ValueError, match=message):
    FreeKVAttention(**options)


def test_defaults_and_unknown_option():
  policy = make_policy("freekv", tau=1.0)  # 1.0 exactly is allowed
  assert (policy.budget, policy.page_size, policy.sinks, policy.window, policy.n_sel) == (2048, 32, 512, 512, 32)
  assert policy.speculative and policy.dense_layers == (0,) and policy.recall == 32
  with pytest.raises(ValueError, match="does not take"):
    make_policy("freekv", topk=10)


def test_host_error_is_raised_after_the_step(monkeypatch):
  def broken(self, *args):
    raise OSError("disk on fire")

  monkeypatch.setattr(freekv_host.FreeKVRuntime, "decode_layer", broken)
  before = set(host_runtime._RUNTIMES)
  with pytest.raises(RuntimeError, match="disk on fire"):
    run(budget=4 + 8 + 4 * 3, speculative=False, dense_layers=())  # compiled by the test above
  assert set(host_runtime._RUNTIMES) == before


class ExchangeLog:
  """per_step exchanges seen by the spies of `exchange_log`: `fetches` has every gather's fetch
  [L, B, Hkv, R] in order; `landed` one entry per landing: (pool ids after it, the selection it
  recalls, its fetch, whether every resident pool page equals the host store's page). Copies:
  the state's buffers are donated to the next step."""

  def __init__(self):
    self.fetches, self.landed, self._selections = [], [], []


@pytest.fixture
def exchange_log(monkeypatch):
  log = ExchangeLog()
  policy = freekv_policy.FreeKVAttention
  step_arrays, gather, land = policy._step_arrays, policy._gather, policy._land

  def rows_spy(state):  # per gather, in gather order: start_after_step and after_step read one state
    if not log._selections or log._selections[-1][0] is not state:
      log._selections.append((state, np.asarray(state.selection)))
    return step_arrays(state)

  def gather_spy(self, runtime, rows, device):
    log.fetches.append(np.array(rows[3]))
    return gather(self, runtime, rows, device)

  def land_spy(self, runtime, state, packed):
    after = land(self, runtime, state, packed)
    store = self.runtime(after).context  # alive only during the run
    pool_ids, pool_k, pool_v = (np.asarray(a) for a in (after.pool_ids, after.pool_k, after.pool_v))
    same = True
    for l, b in np.ndindex(*pool_ids.shape[:2]):
      heads, slots = np.nonzero(pool_ids[l, b] >= 0)
      if heads.size:
        k, v = store.fetch_pages(b, l, heads, pool_ids[l, b, heads, slots])
        if self.host_codec != "none":  # the store holds encoded rows; the pool their decoding
          k, v = kv_codec.decode_np(k), kv_codec.decode_np(v)
        same &= np.array_equal(k, pool_k[l, b, heads, slots]) and np.array_equal(v, pool_v[l, b, heads, slots])
    i = len(log.landed)  # landings follow gathers in order
    log.landed.append((pool_ids, log._selections[i][1], log.fetches[i], same))
    return after

  monkeypatch.setattr(policy, "_step_arrays", staticmethod(rows_spy))
  monkeypatch.setattr(policy, "_gather", gather_spy)
  monkeypatch.setattr(policy, "_land", land_spy)
  return log


@pytest.mark.parametrize("lag, transfer, sync, reuse", [(1, "pinned", True, False), (1, "pageable", False, False),
                                                       (1, "page_locked", False, True), (2, "pageable", False, True),
                                                       (2, "pinned", True, False)])
def test_per_step_equals_full_when_budget_covers_the_context(lag, transfer, sync, reuse, exchange_log, monkeypatch):
  if reuse:  # as on a GPU: packed host buffers rewritten every step, copies not waited for
    init = row_update.StepBuffers.__init__
    monkeypatch.setattr(row_update.StepBuffers, "__init__",
                        lambda self, *args: (init(self, *args), setattr(self, "reuse", True))[0])
  full = full_run()
  sparse = run(budget=COVERING, bridge="per_step", lag=lag, transfer=transfer, sync_transfer=sync, dense_layers=(0,))
  np.testing.assert_allclose(sparse.logits, full.logits, rtol=1e-4, atol=1e-4)
  assert sparse.tokens == full.tokens
  decode_steps = STEPS - 1
  # lag priming exchanges after the prefill, one per step; with lag 2 the last one never lands.
  assert len(exchange_log.fetches) == decode_steps + lag
  assert len(exchange_log.landed) == decode_steps + 1
  stats = sparse.policy_stats
  assert stats["host_callbacks"] == 0 and stats["decode_steps"] == decode_steps
  assert stats["missed_pages_per_step"] == 0 and stats["hit_rate"] == 1.0
  # Each page is recalled once (the prompt's by the priming exchanges, later ones as they complete).
  S, W, P = SMALL["sinks"], SMALL["window"], SMALL["page_size"]
  for b, (n, _) in enumerate(PROMPTS):
    needed = (n + decode_steps - 1 - W - S + 1) // P  # complete after the last step's eviction
    ids = np.concatenate([f[1, b].ravel() for f in exchange_log.fetches])
    assert sorted(ids[ids >= 0].tolist()) == sorted(list(range(needed)) * 2), b  # 2 KV heads
  assert stats["transfer_bytes_per_step"] > 0
  assert stats["host_slowest_exchange_ms"] >= 1e3 * stats["host_exchange_seconds"] / stats["host_exchanges"] > 0
  if lag == 2:
    assert 0 <= stats["host_exchange_wait_seconds"] < stats["host_exchange_seconds"] + 1.0
    assert 1e3 * stats["host_exchange_wait_seconds"] >= stats["host_slowest_wait_ms"] >= 0


@pytest.mark.parametrize("lag", [1, 2])
def test_per_step_recalls_every_selection_into_the_pool_with_the_stored_pages(lag, exchange_log):
  budget = 4 + 8 + 4 * 3  # 3 pages of 4 out of up to 17: the selection moves
  sparse = run(budget=budget, bridge="per_step", lag=lag, dense_layers=())
  moved = 0
  for pool_ids, selection, fetch, same in exchange_log.landed:
    assert same  # the pool holds the stored pages its ids name
    moved += int((fetch >= 0).sum())
    for l, b, h in np.ndindex(*pool_ids.shape[:3]):
      chosen = selection[l, b, h][selection[l, b, h] >= 0]
      assert set(chosen.tolist()) <= set(pool_ids[l, b, h].tolist()), (l, b, h)  # the recalled pages are resident
  assert moved > len(exchange_log.landed)  # pages really move between steps
  stats = sparse.policy_stats
  # Pages completed by the step's own eviction were recalled before the store held their last
  # token (written from the evicted rows), and `same` above found them whole.
  assert stats["host_completed_pages"] > 0
  assert stats["missed_pages_per_step"] > 0  # the lag has a cost here, and it is counted
  assert stats["recalled_pages_per_step"] == pytest.approx(
      sum(int((f >= 0).sum()) for f in exchange_log.fetches[lag:]) / (STEPS - 1))


def _compiled_step(model, options, prompt_len=53, policy="freekv"):
  """(optimized HLO text of one unrolled decode step, the prefilled state it was compiled for)."""
  import dataclasses

  import jax

  from kvjax import engine
  from kvjax.sampling import SamplingConfig
  from models.decoder import decode_layout
  from models.rope import rope_tables

  model = dataclasses.replace(model, params=decode_layout(model.params, unroll=True))  # layers: Python ints
  context = kvjax.prefill(model, [random_prompt(prompt_len)], max_new_tokens=4, policy=policy,
                          policy_options=options)
  try:
    state, cfg = context.state, model.cfg
    rope = tuple(jnp.asarray(t) for t in rope_tables(cfg, context.capacity))
    step = jax.jit(engine.decode_step.__wrapped__, static_argnames=("cfg", "policy", "sampling"),
                   donate_argnames=("state",))
    hlo = step.lower(model.params, rope, jnp.zeros((1,), jnp.int32), jnp.asarray([prompt_len], jnp.int32), state,
                     jax.random.key(0), cfg=cfg, policy=context.policy, sampling=SamplingConfig()).compile().as_text()
    return hlo, jax.tree.map(lambda x: x.shape, state)
  finally:
    context.close()


def test_per_step_layer_costs_few_operations():
  """per_step's sparse layer only writes its ring and attends (after_layers does the rest once):
  the compiled CPU step grows by ~43 top-level operations per layer (111 before after_layers).
  A ceiling, so a change that puts per-layer work back into the loop shows here."""
  per_layer = ops_per_layer(lambda layers: _compiled_step(tiny_model("llama", num_layers=layers), SMALL | dict(
      budget=4 + 8 + 4 * 3, bridge="per_step", dense_layers=()))[0])
  assert 0 < per_layer <= 46, per_layer


def ops_per_layer(compiled_hlo) -> float:
  """Top-level operations a layer adds to a compiled step: compiled_hlo(layers) -> HLO text."""
  import re

  def entry_ops(layers):
    hlo = compiled_hlo(layers)
    entry = hlo[hlo.index("ENTRY"):]
    entry = entry[:entry.index("\n}\n")]
    skip = ("parameter", "get-tuple-element", "tuple", "constant", "bitcast")
    return sum(1 for m in re.finditer(r"= \S+ ([\w-]+)\(", entry) if m.group(1) not in skip)

  return (entry_ops(6) - entry_ops(2)) / 4


@pytest.mark.parametrize("bridge", ["per_layer", "per_step"])
def test_unrolled_decode_step_updates_rings_and_summaries_in_place(bridge):
  """XLA copies a whole [L, ...] state array when a value read from it before its update (or
  read by nothing that orders it before the next layer's update) is still live: per layer and
  step, the rings and page summaries are the largest arrays of the state (537 MB per sequence
  at 8B shapes and 128K). The compiled step must not copy them."""
  import re

  hlo, shapes = _compiled_step(tiny_model("llama"), SMALL | dict(budget=4 + 8 + 4 * 3, bridge=bridge, dense_layers=()))
  copied = {tuple(int(d) for d in m.group(1).split(",")) for m in re.finditer(r"= f32\[([\d,]+)\]\S* copy\(", hlo)}
  for name in ("ring_k", "ring_v", "kmax", "kmin"):
    assert tuple(getattr(shapes, name)) not in copied, name


@pytest.mark.parametrize("lag", [1, 2])
def test_per_step_bookkeeping_after_the_last_layer_matches_a_per_layer_reference(lag):
  """after_layers does every sparse layer's host-facing work at once: the evicted token folded
  into its page's min/max, q_t's selection over the pages complete after the eviction, and the
  recall plan against the promised pool (lag 2: one exchange ahead of the landed one). Checked per layer against the module's own per-layer
  functions; the dense layer's rows and summaries stay untouched."""
  import jax

  from kvjax import engine
  from kvjax.sampling import SamplingConfig
  from models.rope import rope_tables

  model = tiny_model("llama")
  options = SMALL | dict(budget=4 + 8 + 4 * 3, bridge="per_step", dense_layers=(0,), lag=lag)
  n = 56  # lag 2's two priming selections differ by one candidate page (10 and 11 complete pages)
  context = kvjax.prefill(model, [random_prompt(n)], max_new_tokens=4, policy="freekv", policy_options=options)
  try:
    policy, cfg = context.policy, model.cfg
    before = jax.tree.map(np.asarray, context.state)
    rope = tuple(jnp.asarray(t) for t in rope_tables(cfg, context.capacity))
    _, _, state = engine.decode_step(model.params, rope, jnp.zeros((1,), jnp.int32), jnp.asarray([n], jnp.int32),
                                     context.state, jax.random.key(0), cfg=cfg, policy=policy,
                                     sampling=SamplingConfig())
    after = jax.tree.map(np.asarray, state)
    S, W, P = SMALL["sinks"], SMALL["window"], SMALL["page_size"]
    ev_pos = n - W  # the token leaving the window at position n
    ev_slot = S + (ev_pos - S) % policy.ring_len
    page = (ev_pos - S) // P
    c_now = jnp.asarray([(n - W - S + 1) // P], jnp.int32)
    for l in range(cfg.num_layers):
      if l == 0:  # dense: nothing for the host, summaries as they were
        assert (after.step_evicted_pos[l] == -1).all() and (after.step_fetch[l] == -1).all()
        assert (after.selection[l] == before.selection[l]).all()
        np.testing.assert_array_equal(after.kmax[l], before.kmax[l])
        continue
      ev_k = after.ring_k[l, 0, :, ev_slot]  # [Hkv, D]
      assert after.step_evicted_pos[l, 0] == ev_pos
      np.testing.assert_array_equal(after.step_evicted_k[l, 0], ev_k)
      np.testing.assert_array_equal(after.kmax[l, 0, :, page], np.maximum(before.kmax[l, 0, :, page], ev_k))
      np.testing.assert_array_equal(after.kmin[l, 0, :, page], np.minimum(before.kmin[l, 0, :, page], ev_k))
      pooled = page_scores(jnp.asarray(after.prev_q[l]), jnp.asarray(after.kmax[l]), jnp.asarray(after.kmin[l]),
                           c_now, scale=cfg.attn_scale)
      selection = top_pages(pooled, policy.n_sel)
      np.testing.assert_array_equal(after.selection[l], selection)
      fetch, slots, promised = plan_recall(jnp.asarray(before.promised_ids[l]), selection, pooled, policy.recall)
      np.testing.assert_array_equal(after.step_fetch[l], fetch)
      np.testing.assert_array_equal(after.step_slots[l], slots)
      np.testing.assert_array_equal(after.promised_ids[l], promised)
    assert after.primed[1:].all() and not after.primed[0]
  finally:
    context.close()


@pytest.mark.parametrize("lag", [1, 2])
def test_per_step_decode_compiles_its_step_once(lag):
  # The pool rows a between-step exchange writes come from a committed device_put; a state mixing
  # them with uncommitted arrays compiled the step again at its second step (8.4 s at 8B shapes).
  compiles = lambda: sum(j._cache_size() for j in engine.decode_step.jits)
  before = compiles()
  run(budget=4 + 8 + 4 * 7, tau=0.75, bridge="per_step", lag=lag)  # options no other test uses: a new entry
  assert compiles() - before == 1


# -- page summaries of quantized keys (kvjax.policies.page_summary) ---------------------------


def test_key_scores_match_a_numpy_reference():
  from kvjax.policies import page_summary

  rng = np.random.default_rng(0)
  B, H, G, N, P, D = 2, 2, 3, 5, 4, 16
  keys = rng.standard_normal((B, H, N * P, D)).astype(np.float32)
  q = rng.standard_normal((B, H * G, D)).astype(np.float32)
  for bits in (2, 4):
    lo, step = page_summary.key_range(jnp.asarray(keys), jnp.ones((B, 1, N * P, 1), bool), bits)
    lo, step = np.asarray(lo), np.asarray(step)
    np.testing.assert_allclose(lo, keys.min(2), rtol=1e-6)
    np.testing.assert_allclose(step, (keys.max(2) - keys.min(2)) / (2**bits - 1), rtol=1e-5)
    packed = page_summary.quantize(jnp.asarray(keys), lo[:, :, None], step[:, :, None], bits)
    assert packed.shape == (B, H, N * P, D * bits // 8) and packed.dtype == jnp.uint8
    code = np.clip(np.round((keys - lo[:, :, None]) / step[:, :, None]), 0, 2**bits - 1)
    np.testing.assert_array_equal(np.asarray(page_summary.unpack(packed, bits)), code)
    planes = code.astype(np.uint8).reshape(B, H, N * P, 8 // bits, -1)  # byte j: channels j, j + D/per_byte, ...
    want = sum(planes[..., i, :] << (i * bits) for i in range(8 // bits)).astype(np.uint8)
    np.testing.assert_array_equal(np.asarray(packed), want)
    k_hat = lo[:, :, None] + code * step[:, :, None]  # [B, H, N * P, D]
    exact = np.einsum("bhgd,bhtd->bhgt", q.reshape(B, H, G, D), k_hat).reshape(B, H, G, N, P).max(-1) * 0.25
    got = page_summary.key_scores(jnp.asarray(q), packed.reshape(B, H, N, P, -1), jnp.asarray(lo), jnp.asarray(step),
                                  scale=0.25)
    np.testing.assert_allclose(np.asarray(got), exact, rtol=1e-4, atol=1e-4)
    assert np.abs(k_hat - keys).max() <= step.max() / 2 + 1e-5  # within half a level


@pytest.mark.parametrize("summary, bridge, lag", [("keys2", "per_layer", 1), ("keys4", "per_step", 2)])
def test_key_summaries_equal_full_when_budget_covers_the_context(summary, bridge, lag):
  full = full_run()
  sparse = run(budget=COVERING, page_summary=summary, bridge=bridge, lag=lag)
  np.testing.assert_allclose(sparse.logits, full.logits, rtol=1e-4, atol=1e-4)
  assert sparse.tokens == full.tokens
  assert "4-bit keys" in sparse.policy if summary == "keys4" else "2-bit keys" in sparse.policy


@pytest.mark.parametrize("bits", [0, 4])
def test_layer_scores_equal_each_layers_scores(bits, monkeypatch):
  """layer_scores' one kernel call over all layers (layers folded into the batch; run here in
  interpret mode), its per-layer XLA map and the min/max vmap each equal page_summary.scores
  layer by layer."""
  from kvjax.policies import page_summary
  import ops

  rng = np.random.default_rng(bits)
  L, B, H, G, N, P, D = 3, 2, 2, 2, 5, 8, 32
  q = jnp.asarray(rng.standard_normal((L, B, H * G, D)), jnp.float32)
  if bits:
    summary = (jnp.asarray(rng.integers(0, 256, (L, B, H, N, P, D * bits // 8)), jnp.uint8),
               jnp.asarray(rng.standard_normal((L, B, H, D)), jnp.float32),
               jnp.asarray(rng.uniform(0.1, 0.5, (L, B, H, D)), jnp.float32))
  else:
    kmin = jnp.asarray(rng.standard_normal((L, B, H, N, D)), jnp.float32)
    summary = (kmin + 1.0, kmin)
  want = np.stack([page_summary.scores(q[i], tuple(x[i] for x in summary), scale=0.5) for i in range(L)])
  real = ops.key_page_scores
  monkeypatch.setattr(ops, "key_page_scores", functools.partial(real, interpret=True))
  for impl in ("pallas", "xla"):
    got = page_selection.layer_scores(q, summary, scale=0.5, implementation=impl)
    assert got.shape == (L, B, H, G, N)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4, err_msg=impl)


def test_key_codes_hold_every_stored_key_and_select_the_next_pages():
  """After the prefill each sparse layer's codes quantize its stored prompt keys over their
  range; a decode step adds the token leaving the window at its page and offset; the next
  selection is top_pages of pooled_scores over those codes."""
  import jax

  from kvjax.policies import page_summary
  from kvjax.policies.page_selection import pooled_scores
  from kvjax.sampling import SamplingConfig
  from models.rope import rope_tables

  model, n, bits = tiny_model("llama"), 58, 2  # the token leaving the window sits at offset 2 of its page
  S, W, P = SMALL["sinks"], SMALL["window"], SMALL["page_size"]
  dense = kvjax.prefill(model, [random_prompt(n)], max_new_tokens=4)
  keys = np.asarray(dense.state.k)[:, 0]  # [L, Hkv, capacity, D]: the prompt's keys
  dense.close()
  options = SMALL | dict(budget=4 + 8 + 4 * 3, bridge="per_step", dense_layers=(0,), page_summary=f"keys{bits}")
  context = kvjax.prefill(model, [random_prompt(n)], max_new_tokens=4, policy="freekv", policy_options=options)
  try:
    policy, cfg = context.policy, model.cfg
    before = jax.tree.map(np.asarray, context.state)
    assert before.kmax.shape[3] == 0 and before.kcodes.dtype == np.uint8
    stored = keys[1, :, S:n - W]  # layer 1 is sparse
    np.testing.assert_allclose(before.klo[1, 0], stored.min(1), rtol=1e-6)
    np.testing.assert_allclose(before.kstep[1, 0], (stored.max(1) - stored.min(1)) / 3, rtol=1e-5)
    codes = np.asarray(page_summary.unpack(jnp.asarray(before.kcodes[1, 0]), bits)).reshape(2, -1, keys.shape[-1])
    want = np.clip(np.round((stored - before.klo[1, 0][:, None]) / before.kstep[1, 0][:, None]), 0, 3)
    np.testing.assert_array_equal(codes[:, :stored.shape[1]], want)
    assert not codes[:, stored.shape[1]:].any()  # slots of tokens not stored yet
    rope = tuple(jnp.asarray(t) for t in rope_tables(cfg, context.capacity))
    _, _, state = engine.decode_step(model.params, rope, jnp.zeros((1,), jnp.int32), jnp.asarray([n], jnp.int32),
                                     context.state, jax.random.key(0), cfg=cfg, policy=policy,
                                     sampling=SamplingConfig())
    after = jax.tree.map(np.asarray, state)
    ev_pos = n - W
    page, offset = (ev_pos - S) // P, (ev_pos - S) % P
    ev_k = after.ring_k[1, 0, :, S + (ev_pos - S) % policy.ring_len]  # [Hkv, D]
    got = np.asarray(page_summary.unpack(jnp.asarray(after.kcodes[1, 0, :, page, offset]), bits))
    np.testing.assert_array_equal(got, np.clip(np.round((ev_k - before.klo[1, 0]) / before.kstep[1, 0]), 0, 3))
    changed = np.argwhere(after.kcodes != before.kcodes)
    assert {(l, p, o) for l, _, _, p, o, _ in changed} <= {(1, page, offset)}
    summary = (jnp.asarray(after.kcodes[1]), jnp.asarray(after.klo[1]), jnp.asarray(after.kstep[1]))
    c_now = jnp.asarray([(n - W - S + 1) // P], jnp.int32)
    pooled = pooled_scores(jnp.asarray(after.prev_q[1]), summary, c_now, scale=cfg.attn_scale)
    np.testing.assert_array_equal(after.selection[1], top_pages(pooled, policy.n_sel))
  finally:
    context.close()


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="per-thread CPU affinity on two or more cores")
def test_lag_two_exchange_thread_stays_off_the_reserved_cores():
  """Lag 2's exchange thread runs on the cores left after the reserved ones, at the caller's
  priority, and its page fetch sizes its OpenMP team to them; lag 1 reserves none."""
  import host_index
  from test_retrieval import cores, nice

  allowed = sorted(os.sched_getaffinity(0))
  context = host_index.HostContext(1, 1, 2, 1, 4, kind="flat", page_size=2)
  runtime = freekv_host.FreeKVRuntime(context, sinks=0, page_size=2, sync_recall=1, sparse_layers=1, step_buffers=2,
                                      background_nice=5, reserved_cores=1)
  try:
    assert runtime.worker().submit(lambda: (cores(), nice())).result() == (set(allowed[1:]), nice())
    assert runtime.fetch_threads == len(allowed) - 1
  finally:
    runtime.close()
  assert make_policy("freekv", bridge="per_step")._reserved_cores() == 0
  lag2 = make_policy("freekv", bridge="per_step", lag=2)
  assert lag2._reserved_cores() == host_runtime.default_reserved_cores(len(allowed))


def test_per_layer_counts_the_pages_its_first_step_could_not_recall():
  """A layer's first step (pool empty, correction test not run) wants n_sel pages and recalls at
  most max_recall: the shortfall is counted (it was dropped with the undecided counters)."""
  result = kvjax.generate(tiny_model("llama"), prompts(), max_new_tokens=2, prefill_chunk=16,
                          policy="freekv", policy_options=SMALL | dict(budget=COVERING, max_recall=1, dense_layers=()))
  stats = result.policy_stats
  assert stats["decode_steps"] == 1 and stats["host_decided_heads"] == 0  # the one step is every layer's first
  assert stats["missed_pages_per_step"] > 0


@pytest.mark.parametrize("lag", [1, 2])
def test_per_step_hit_rate_scores_the_pool_the_step_attended(lag, monkeypatch):
  """Reuse counters per (layer, seq, KV head): the pages the step attended (its pool, as the
  step saw it: with lag 2 the selection of two steps back) and how many of them the step's own
  query selects. Scoring the previous step's selection overstated lag 2's hit rate."""
  records = []
  step_arrays = freekv_policy.FreeKVAttention._step_arrays

  def spy(state):
    records.append((np.asarray(state.pool_ids), np.asarray(state.selection), np.asarray(state.step_counters)))
    return step_arrays(state)

  monkeypatch.setattr(freekv_policy.FreeKVAttention, "_step_arrays", staticmethod(spy))
  out = run(budget=4 + 8 + 4 * 3, bridge="per_step", lag=lag, dense_layers=(0,))
  stats = out.policy_stats
  hits = reused = 0
  for pool_ids, selection, counters in records[lag:]:  # the priming exchanges' records first
    decided = counters[..., 0] > 0
    in_selection = ((pool_ids[..., :, None] == selection[..., None, :]) & (selection[..., None, :] >= 0)).any(-1)
    np.testing.assert_array_equal(counters[..., 3], (in_selection & (pool_ids >= 0)).sum(-1))
    np.testing.assert_array_equal(counters[..., 2], (pool_ids >= 0).sum(-1))
    hits += int((counters[..., 3] * decided).sum())
    reused += int((counters[..., 2] * decided).sum())
  assert reused > 0 and 0 < hits < reused  # a small budget: some reused pages drop out
  assert stats["hit_rate"] == hits / reused
