"""Device-only sparse policies: `streaming` (sinks + window) and `quest` (min/max page selection).

Tiny random models on CPU. Each policy must equal `full` when its budget covers the context,
equal an independent masked-attention reference when it does not, and refuse bad options.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.policies import QuestAttention, StreamingLLM, make_policy
from kvjax.policies.base import AttentionPolicy, layer_window
from kvjax.policies.full import FullAttention, write_tokens
from kvjax.policies.quest import select_pages
from test_generate import random_prompt, tiny_model

# Ragged batch (the shorter prompt is padded over a whole chunk) and >= 8 decode steps.
PROMPTS = [random_prompt(45, seed=1), random_prompt(20, seed=2)]
RUN = dict(max_new_tokens=9, prefill_chunk=16, return_logits=True)


@functools.lru_cache(maxsize=None)
def model_of(family):
  if family == "gemma3-3layer":  # layers: local (window 6), global, global
    a, b = tiny_model("gemma3", seed=0), tiny_model("gemma3", seed=1)
    layers = jax.tree.map(lambda x, y: jnp.concatenate([x, y[1:]]), a.params["layers"], b.params["layers"])
    cfg = dataclasses.replace(a.cfg, num_layers=3, layer_windows=(6, 0, 0))
    return dataclasses.replace(a, cfg=cfg, params=a.params | {"layers": layers})
  return tiny_model(family)


@functools.lru_cache(maxsize=None)
def run_full(family):
  return kvjax.generate(model_of(family), PROMPTS, **RUN)


def run(family, policy):
  return kvjax.generate(model_of(family), PROMPTS, policy=policy, **RUN)


@pytest.mark.parametrize("family", ["llama", "gemma3"])  # gemma3: layer 0 is local (window 6)
@pytest.mark.parametrize("policy", [
    StreamingLLM(sinks=16, window=256),
    QuestAttention(budget=256, page_size=8, sinks=8, window=16, dense_layers=()),
    # Pages of 12 never divide a capacity rounded to 256 alone: refused before the capacity honoured them.
    QuestAttention(budget=264, page_size=12, sinks=12, window=24, dense_layers=()),
], ids=["streaming", "quest", "quest_pages_of_12"])
def test_covering_budget_equals_full(family, policy):
  full, sparse = run_full(family), run(family, policy)
  assert sparse.logits.shape[0] >= 9  # the first token + >= 8 decode steps
  np.testing.assert_allclose(sparse.logits, full.logits, rtol=1e-4, atol=1e-4)
  assert sparse.tokens == full.tokens


@dataclasses.dataclass(frozen=True)
class MaskedStreamingReference(AttentionPolicy):
  """Dense cache + an explicit mask: decode queries see {j < sinks} ∪ {p - window < j <= p}."""

  sinks: int
  window: int
  dense_layers: tuple[int, ...] = ()
  name: str = "masked-streaming-reference"

  def init_state(self, cfg, batch, capacity, dtype):
    return FullAttention().init_state(cfg, batch, capacity, dtype)

  def attend(self, cfg, layer, q, k, v, positions, state):
    state = state.replace(k=write_tokens(state.k, layer, k, positions), v=write_tokens(state.v, layer, v, positions))
    keys, values = state.k[layer].astype(jnp.float32), state.v[layer].astype(jnp.float32)  # [B, Hkv, S, D]
    p = positions[:, :, None]  # [B, T, 1]
    j = jnp.arange(keys.shape[2])[None, None, :]
    win = layer_window(cfg, layer)
    mask = (j <= p) & ((win == 0) | (j > p - win))
    streaming = (q.shape[1] == 1) & ~jnp.isin(layer, jnp.asarray(self.dense_layers or (-1,)))
    mask = mask & ((j < self.sinks) | (j > p - self.window) | ~streaming)  # [B, T, S]
    batch, seq, num_heads, head_dim = q.shape
    qg = q.astype(jnp.float32).reshape(batch, seq, keys.shape[1], -1, head_dim)
    s = jnp.einsum("BTHGD,BHSD->BTHGS", qg, keys, precision="highest") * cfg.attn_scale
    s = jnp.where(mask[:, :, None, None, :], s, -jnp.inf)
    o = jnp.einsum("BTHGS,BHSD->BTHGD", jax.nn.softmax(s, axis=-1), values, precision="highest")
    return o.reshape(batch, seq, num_heads, head_dim), state


def test_streaming_small_window_equals_masked_reference():
  # The window wraps the ring many times; layer 0's own window (6) is narrower than the
  # streaming window, layer 1 streams, layer 2 decodes densely.
  family, options = "gemma3-3layer", dict(sinks=3, window=8, dense_layers=(2,))
  streaming = run(family, StreamingLLM(**options))
  reference = run(family, MaskedStreamingReference(**options))
  np.testing.assert_allclose(streaming.logits, reference.logits, rtol=1e-4, atol=1e-4)
  assert np.abs(streaming.logits - run_full(family).logits).max() > 1e-2  # the window really cuts
  # Decode holds only the ring (and the dense layers), not the prompt's dense cache.
  cfg = model_of(family).cfg
  ring = cfg.num_layers * len(PROMPTS) * cfg.num_kv_heads * (options["sinks"] + options["window"]) * cfg.head_dim
  dense = len(options.get("dense_layers", ())) * len(PROMPTS) * cfg.num_kv_heads * 256 * cfg.head_dim
  assert streaming.kv_bytes == 4 * 2 * (ring + dense) + 4 * len(PROMPTS)  # f32 K and V, + prompt lengths


def numpy_select(q, kmax, kmin, pos, *, page_size, sinks, window, budget, scale):
  """Quest selection for one decode step, written out with loops: a list of page sets [b][h]."""
  batch, num_heads, _ = q.shape
  kv_heads = kmax.shape[1]
  groups = num_heads // kv_heads
  sink_pages = -(-sinks // page_size)
  chosen = []
  for b in range(batch):
    cur = pos[b] // page_size
    first_win = max(pos[b] - window + 1, 0) // page_size
    kept = {g for g in range(cur + 1) if g < sink_pages or g >= first_win}
    cand = [g for g in range(cur + 1) if g not in kept]
    per_head = []
    for h in range(kv_heads):
      pooled = np.zeros(len(cand))
      for i in range(groups):
        qh = q[b, h * groups + i].astype(np.float64)
        s = np.array([np.maximum(qh * kmax[b, h, g], qh * kmin[b, h, g]).sum() * scale for g in cand])
        if len(cand):
          e = np.exp(s - s.max())
          pooled += e / e.sum() / groups
      room = budget // page_size - len(kept)
      top = [cand[i] for i in np.argsort(-pooled, kind="stable")[:room]]
      per_head.append(sorted(kept | set(top)))
    chosen.append(per_head)
  return chosen


QUEST = dict(page_size=4, sinks=4, window=6, budget=32)  # 8 pages: sink 1 + window <= 3 + selected


def test_quest_selection_matches_numpy():
  rng = np.random.default_rng(0)
  batch, kv_heads, groups, pages, dim = 4, 2, 3, 16, 8
  q = rng.normal(size=(batch, kv_heads * groups, dim)).astype(np.float32)
  kmin = rng.normal(size=(batch, kv_heads, pages, dim)).astype(np.float32)
  kmax = kmin + np.abs(rng.normal(size=kmin.shape)).astype(np.float32)
  pos = np.array([5, 37, 63, 30], np.int32)  # all fit; partial pages; the last page; 30 % 4 != 3
  ids, counts = jax.jit(functools.partial(select_pages, scale=0.3, **QUEST))(q, kmax, kmin, pos)
  expected = numpy_select(q, kmax, kmin, pos, scale=0.3, **QUEST)
  got = [[list(np.asarray(ids)[b, h, : counts[b, h]]) for h in range(kv_heads)] for b in range(batch)]
  assert got == expected
  assert max(map(int, np.asarray(counts).ravel())) == 8  # the budget is used, not exceeded
  assert expected[1][0] != expected[1][1]  # heads choose their own pages: the test can tell them apart


def test_quest_attends_exactly_the_selected_pages():
  cfg = model_of("llama").cfg
  policy = QuestAttention(dense_layers=(0,), **QUEST)
  rng = np.random.default_rng(1)
  batch, chunk, capacity, layer = 2, 40, 64, 1
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  state = policy.init_state(cfg, batch, capacity, jnp.float32)
  attend = jax.jit(functools.partial(policy.attend, cfg))
  # Prefill a chunk of 40 positions; sequence 0's prompt is 30 tokens long, so 30..39 are
  # padding, and decode at 30 leaves padding (31) in its current page and in later pages.
  positions = jnp.broadcast_to(jnp.arange(chunk, dtype=jnp.int32), (batch, chunk))
  kv = [normal(batch, chunk, cfg.num_kv_heads, cfg.head_dim) for _ in range(2)]
  q = normal(batch, chunk, cfg.num_heads, cfg.head_dim)
  _, state = attend(jnp.int32(layer), q, *kv, positions, state)
  state = policy.finish_prefill(cfg, state)
  pos = np.array([30, 40], np.int32)
  q1, k1, v1 = (normal(batch, 1, h, cfg.head_dim) for h in (cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads))
  o, state = attend(jnp.int32(layer), q1, k1, v1, jnp.asarray(pos)[:, None], state)

  keys, values = np.asarray(state.k[layer]), np.asarray(state.v[layer])  # [B, Hkv, S, D]
  P = QUEST["page_size"]
  for b in range(batch):  # the summaries of every page up to the current one cover exactly positions <= p
    for g in range(pos[b] // P + 1):
      real = keys[b, :, g * P : min(g * P + P, pos[b] + 1)]
      np.testing.assert_array_equal(np.asarray(state.kmax[layer, b, :, g]), real.max(axis=1))
      np.testing.assert_array_equal(np.asarray(state.kmin[layer, b, :, g]), real.min(axis=1))
  chosen = numpy_select(np.asarray(q1[:, 0]), np.asarray(state.kmax[layer]), np.asarray(state.kmin[layer]), pos,
                        scale=cfg.attn_scale, **QUEST)
  groups = cfg.num_heads // cfg.num_kv_heads
  expected = np.zeros(o.shape, np.float64)
  for b in range(batch):
    for h in range(cfg.num_heads):
      tok = [t for g in chosen[b][h // groups] for t in range(g * P, g * P + P) if t <= pos[b]]
      s = keys[b, h // groups, tok] @ np.asarray(q1[b, 0, h], np.float64) * cfg.attn_scale
      w = np.exp(s - s.max())
      expected[b, 0, h] = (w / w.sum()) @ values[b, h // groups, tok]
  assert len(chosen[1][0]) == 8 and len(chosen[1][0]) < pos[1] // P + 1  # a real selection happened
  np.testing.assert_allclose(np.asarray(o), expected, rtol=1e-5, atol=1e-5)


def test_quest_small_budget_runs_and_differs_from_full():
  result = run("llama", QuestAttention(dense_layers=(0,), **QUEST))
  assert np.isfinite(result.logits).all()
  assert np.abs(result.logits - run_full("llama").logits).max() > 1e-2
  assert "budget=32" in result.policy and "dense layers [0]" in result.policy


@pytest.mark.parametrize("name, options, message", [
    ("streaming", dict(window=0), "window=0"),
    ("streaming", dict(sinks=-1), "sinks=-1"),
    ("streaming", dict(dense_layers=(1, 1)), r"dense_layers=\(1, 1\)"),
    ("streaming", dict(budget=64), "does not take"),
    ("quest", dict(window=0), "window=0"),
    ("quest", dict(page_size=0), "page_size=0"),
    ("quest", dict(budget=1000), "budget=1000"),  # < sinks 512 + window 512
    ("quest", dict(budget=1040), "budget=1040"),  # the window can span 17 pages of 32
    ("quest", dict(topk=3), "does not take"),
])
def test_bad_options_are_refused(name, options, message):
  with pytest.raises(ValueError, match=message):
    make_policy(name, **options)


@pytest.mark.parametrize("name, options, message", [
    ("quest", dict(dense_layers=(2,)), "dense_layers"),  # 2 layers
    ("streaming", dict(dense_layers=(0, 5)), "dense_layers"),
])
def test_options_that_do_not_fit_the_run_are_refused(name, options, message):
  with pytest.raises(ValueError, match=message):
    kvjax.generate(model_of("llama"), [1, 2, 3], max_new_tokens=2, policy=name, policy_options=options)


def test_describe_states_the_budget():
  assert make_policy("streaming").describe() == (
      "streaming(sinks=128, window=512, dense prefill; decode budget 640 tokens = sinks 128 + window 512)")
  assert make_policy("quest").describe() == (
      "quest(budget=2048 tokens = sinks 512 (16 pages) + window 512 (<= 17 pages) + selected pages of 32 "
      "up to 64 pages, dense prefill, dense layers [0])")
