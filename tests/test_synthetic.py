"""kvjax.synthetic: fitted moments, the draws, the real head and moved tail, exactness across policies."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import synthetic
from models.config import RopeScaling
from models.rope import apply_rope, rope_tables
from test_generate import random_prompt, tiny_model

HEAD, TAIL = 24, 40


@pytest.fixture(scope="module")
def model():
  return tiny_model(max_position=8192)


@pytest.fixture(scope="module")
def stats(model):
  return synthetic.fit_statistics(model, random_prompt(400, seed=3), head_len=HEAD, tail_len=TAIL)


def full_cache(model, context):
  """[L, B, Hkv, capacity, D] keys and values of a `full` context, as numpy."""
  return np.asarray(context.state.k), np.asarray(context.state.v)


def test_moments_are_those_of_the_real_prefill(model, stats):
  prompt = random_prompt(400, seed=3)
  context = kvjax.prefill(model, prompt, max_new_tokens=1, policy="full")
  k, v = full_cache(model, context)
  context.close()
  middle = slice(HEAD, 400 - TAIL)
  for layer in range(model.cfg.num_layers):
    for head in range(model.cfg.num_kv_heads):
      x = k[layer, 0, head, middle].astype(np.float64)
      np.testing.assert_allclose(stats.k_mean[layer, head], x.mean(0), atol=1e-5)
      chol = stats.k_chol[layer, head].astype(np.float64)
      np.testing.assert_allclose(chol @ chol.T, np.cov(x.T), rtol=1e-3, atol=1e-5)
      y = v[layer, 0, head, middle].astype(np.float64)
      np.testing.assert_allclose(stats.v_mean[layer, head], y.mean(0), atol=1e-5)
  # The recorder is the full policy: its head and tail keys are the full cache's, bit for bit.
  np.testing.assert_array_equal(stats.head_k, k[:, 0, :, :HEAD])
  np.testing.assert_array_equal(stats.tail_v, v[:, 0, :, 400 - TAIL:400])
  assert stats.q_mean.shape == (model.cfg.num_layers, model.cfg.num_heads, model.cfg.head_dim)


def test_draws_have_the_fitted_moments(model, stats):
  n = 6000
  context = synthetic.synthetic_prefill(model, stats, [n], max_new_tokens=1, policy="full", seed=5)
  k, _ = full_cache(model, context)
  context.close()
  x = k[1, 0, 1, HEAD:n - TAIL].astype(np.float64)  # layer 1, KV head 1: 5936 draws
  chol = stats.k_chol[1, 1].astype(np.float64)
  cov = chol @ chol.T
  scale = np.sqrt(np.diag(cov))
  # Sampling error of a mean ~ sd / sqrt(n) = 1.3% of sd, of a covariance ~ sqrt(2 / n) = 1.8%.
  np.testing.assert_allclose(x.mean(0) / scale, stats.k_mean[1, 1] / scale, atol=0.06)
  np.testing.assert_allclose(np.cov(x.T) / np.outer(scale, scale), cov / np.outer(scale, scale), atol=0.08)


def test_head_is_real_and_tail_is_moved_to_the_end(model, stats):
  lengths = [900, 400]  # the second ends where the calibration prompt ended: no shift
  context = synthetic.synthetic_prefill(model, stats, lengths, max_new_tokens=4, policy="full")
  k, v = full_cache(model, context)
  context.close()
  np.testing.assert_array_equal(k[:, :, :, :HEAD], np.broadcast_to(stats.head_k[:, None], k[:, :, :, :HEAD].shape))
  np.testing.assert_array_equal(k[:, 1, :, 400 - TAIL:400], stats.tail_k)
  np.testing.assert_array_equal(v[:, 0, :, 900 - TAIL:900], stats.tail_v)
  inv_freq = rope_tables(model.cfg, 1024)[0]
  for layer in range(model.cfg.num_layers):
    tail = jnp.swapaxes(jnp.asarray(stats.tail_k[layer]), 0, 1)[None]  # [1, T, H, D]
    moved = synthetic._shift_rope(tail, jnp.asarray([500], jnp.int32), jnp.asarray(inv_freq[layer]))
    np.testing.assert_array_equal(k[layer, 0, :, 900 - TAIL:900], np.swapaxes(np.asarray(moved[0]), 0, 1))


def test_shift_rope_composes_with_rope():
  rng = np.random.default_rng(0)
  raw = jnp.asarray(rng.standard_normal((2, 5, 3, 16)), jnp.float32)
  positions = jnp.asarray(rng.integers(0, 4000, (2, 5)), jnp.int32)
  shift = jnp.asarray([1_000_000 - 4000, -37], jnp.int32)
  inv_freq = jnp.asarray(1.0 / (10000 ** (np.arange(0, 16, 2) / 16)), jnp.float32)
  factor = jnp.float32(1.3)  # yarn-style multiplier: applied once, by the first rotation
  moved = synthetic._shift_rope(apply_rope(raw, positions, inv_freq, factor), shift, inv_freq)
  direct = apply_rope(raw, positions + shift[:, None], inv_freq, factor)
  # float32 angles near 1e6 radians carry ~0.06 rad of rounding either way; scores match:
  # compare the rotation-invariant norms exactly and the vectors loosely.
  np.testing.assert_allclose(jnp.linalg.norm(moved, axis=-1), jnp.linalg.norm(direct, axis=-1), rtol=1e-5)
  np.testing.assert_allclose(moved[1], direct[1], atol=1e-4)
  np.testing.assert_allclose(moved[0], direct[0], atol=0.25)


@pytest.mark.parametrize("policy, options", [
    ("retrieval", dict(index="flat", topk=4096, sinks=16, window=32)),
    ("retrieval", dict(index="flat", topk=4096, sinks=16, window=32, bridge="per_step")),
    ("retrieval", dict(index="roar", topk=4096, sinks=16, window=32, ef=4096)),
    ("freekv", dict(budget=4096, sinks=16, window=32, page_size=16, dense_layers=())),
])
def test_sparse_policies_equal_full_on_a_synthetic_context(model, stats, policy, options):
  """Budgets covering the whole context: the same draws (same seed) decode as under `full`."""
  lengths, steps = [1000, 700], 6

  def run(name, opts):
    context = synthetic.synthetic_prefill(model, stats, lengths, max_new_tokens=steps, policy=name,
                                          policy_options=opts, seed=1)
    assert "synthetic" in context.metadata["synthetic"]
    return kvjax.decode(model, context, max_new_tokens=steps, stop_tokens=[], return_logits=True)

  reference, sparse = run("full", {}), run(policy, options)
  assert sparse.tokens == reference.tokens
  np.testing.assert_allclose(sparse.logits, reference.logits, atol=2e-5)


def test_same_seed_same_context_other_seed_other(model, stats):
  caches = [full_cache(model, c) for c in (
      synthetic.synthetic_prefill(model, stats, [500], max_new_tokens=1, seed=s) for s in (7, 7, 8))]
  np.testing.assert_array_equal(caches[0][0], caches[1][0])
  assert not np.array_equal(caches[0][0], caches[2][0])


def test_bad_requests_fail_before_any_work(model, stats):
  with pytest.raises(ValueError, match="head_len \\+ tail_len = 64"):
    synthetic.synthetic_prefill(model, stats, [63])
  with pytest.raises(ValueError, match="'streaming' cannot be filled"):
    synthetic.synthetic_prefill(model, stats, [500], policy="streaming")
  for options in (dict(sinks=HEAD + 1, window=32), dict(sinks=16, window=TAIL + 1)):  # not real tokens
    with pytest.raises(ValueError, match="real head"):
      synthetic.synthetic_prefill(model, stats, [500], policy="retrieval", policy_options=dict(index="flat", **options))
  with pytest.raises(ValueError, match="fitted with model"):
    synthetic.synthetic_prefill(tiny_model(max_position=8192, num_layers=3), stats, [500])
  with pytest.raises(ValueError, match="exceeds the context"):
    synthetic.synthetic_prefill(model, stats, [9000])
  prefills = []
  with pytest.MonkeyPatch.context() as patch:  # token ids: refused before the calibration prefill runs
    patch.setattr(synthetic, "prefill", lambda *a, **k: prefills.append(1))
    with pytest.raises(ValueError, match="leaves 8 positions"):
      synthetic.fit_statistics(model, random_prompt(72), head_len=HEAD, tail_len=TAIL)
  assert prefills == []
  for bad, error in ((dict(lengths=[300.9]), "lengths\\[0\\]=300.9"), (dict(chunk=100.5), "chunk=100.5"),
                     (dict(max_new_tokens=2.5), "max_new_tokens=2.5"), (dict(chunk=True), "chunk=True")):
    with pytest.raises(TypeError, match=error):  # was truncated, or failed deep in a shape
      synthetic.synthetic_prefill(model, stats, **({"lengths": [500]} | bad))
  dynamic = tiny_model(max_position=4096, rope_scaling=RopeScaling("dynamic", 2.0, 4096))
  dynamic_stats = synthetic.fit_statistics(dynamic, random_prompt(200), head_len=8, tail_len=16)
  with pytest.raises(ValueError, match="dynamic NTK"):
    synthetic.synthetic_prefill(dynamic, dynamic_stats, [500])


def test_host_memory_is_checked_before_filling(model, stats, monkeypatch):
  options = dict(index="flat", sinks=16, window=32)
  needed = synthetic.host_kv_bytes(kvjax.make_policy("retrieval", **options), model.cfg, [1000, 700])
  assert needed == 2 * model.cfg.num_layers * model.cfg.num_kv_heads * model.cfg.head_dim * 4 * 1700
  assert synthetic.host_kv_bytes(kvjax.make_policy("full"), model.cfg, [1000]) == 0
  int8 = kvjax.make_policy("freekv", host_codec="int8", dense_layers=())
  assert synthetic.host_kv_bytes(int8, model.cfg, [1000, 700]) == needed * (model.cfg.head_dim + 4) // (
      4 * model.cfg.head_dim)  # int8 rows and a float32 scale against float32 rows
  monkeypatch.setattr(synthetic, "_available_host_bytes", lambda: needed)
  with pytest.raises(ValueError, match="more than 90% of the"):
    synthetic.synthetic_prefill(model, stats, [1000, 700], policy="retrieval", policy_options=options)


@pytest.mark.parametrize("policy, options", [
    ("retrieval", dict(index="roar", topk=20, sinks=16, window=32, dense_layers=(1,))),
    ("freekv", dict(budget=256, sinks=16, window=32, page_size=16, dense_layers=(0,))),
])
def test_staged_fill_equals_the_whole_cache_fill(model, stats, policy, options, monkeypatch):
  """One sparse layer on the device at a time (offloaded as written) or every layer written
  first and offloaded by finish_prefill: the same decode state and the same tokens."""
  attention = kvjax.make_policy(policy, **options)
  staged = attention.init_state(model.cfg, 2, 1024, jnp.float32, staged=True)
  assert staged.dense.k.shape[0] == 2  # the dense layer + one staging slot, not every layer
  attention.release_fn(staged)()

  def run():
    context = synthetic.synthetic_prefill(model, stats, [1000, 700], max_new_tokens=6, policy=policy,
                                          policy_options=options, seed=2)
    leaves = [np.asarray(x) for x in jax.tree.leaves(context.state.replace(runtime_id=0))]  # ids differ
    result = kvjax.decode(model, context, max_new_tokens=6, stop_tokens=[], return_logits=True)
    return leaves, result

  staged_leaves, staged_result = run()
  monkeypatch.setattr(type(attention), "stages_prefill", False)
  whole_leaves, whole_result = run()
  assert len(staged_leaves) == len(whole_leaves)
  for a, b in zip(staged_leaves, whole_leaves):
    np.testing.assert_array_equal(a, b)
  assert staged_result.tokens == whole_result.tokens
  np.testing.assert_array_equal(staged_result.logits, whole_result.logits)


def test_a_saved_synthetic_context_says_so_and_decodes_the_same(model, stats, tmp_path):
  options = dict(budget=256, sinks=16, window=32, page_size=16)
  make = lambda: synthetic.synthetic_prefill(model, stats, [900], max_new_tokens=5, policy="freekv",
                                             policy_options=options, seed=4)
  context = make()
  kvjax.save_context(context, tmp_path / "ctx")
  direct = kvjax.decode(model, context, max_new_tokens=5, stop_tokens=[], return_logits=True)
  loaded = kvjax.load_context(tmp_path / "ctx", model)
  assert loaded.metadata["synthetic"].startswith("synthetic: Gaussian") and "seed 4" in loaded.metadata["synthetic"]
  again = kvjax.decode(model, loaded, max_new_tokens=5, stop_tokens=[], return_logits=True)
  assert again.tokens == direct.tokens
  np.testing.assert_array_equal(again.logits, direct.logits)
