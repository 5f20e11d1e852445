"""generate(): chunked prefill, batching with ragged lengths, sampling, and input errors."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.sampling import SamplingConfig, sample
from models.config import ModelConfig, RopeScaling, param_shapes


@dataclasses.dataclass(frozen=True)
class TinyModel:
  cfg: ModelConfig
  params: dict
  tokenizer: None = None


def tiny_model(family="llama", seed=0, **overrides) -> TinyModel:
  extra = dict(qkv_bias=True) if family == "qwen2" else {}
  if family == "gemma3":
    extra = dict(qk_norm=True, sandwich_norms=True, layer_windows=(6, 0), rope_local_theta=100.0,
                 activation="gelu_tanh", embed_scale=8.0)
  fields = dict(name=f"tiny-{family}", family=family, vocab_size=97, hidden_size=64, num_layers=2, num_heads=6,
                num_kv_heads=2, head_dim=16, intermediate_size=96, max_position=256, rope_theta=10000.0)
  cfg = ModelConfig(**(fields | extra | overrides))
  shapes = param_shapes(cfg)
  paths, treedef = jax.tree.flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))
  keys = jax.random.split(jax.random.key(seed), len(paths))
  leaves = []
  for key, (path, shape) in zip(keys, paths):
    is_norm = "norm" in jax.tree_util.keystr(path)
    leaves.append(0.15 * jax.random.normal(key, shape) + (1.0 if is_norm else 0.0))
  params = jax.tree.unflatten(treedef, leaves)
  return TinyModel(cfg, params)


def random_prompt(length, seed=0, vocab=97):
  return [int(t) for t in np.random.default_rng(seed).integers(0, vocab, size=length)]


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_chunked_prefill_equals_one_shot(family):
  model = tiny_model(family)
  prompt = random_prompt(45)
  one_shot = kvjax.generate(model, prompt, max_new_tokens=6, prefill_chunk=64, return_logits=True)
  for chunk in (7, 16):  # neither divides 45
    chunked = kvjax.generate(model, prompt, max_new_tokens=6, prefill_chunk=chunk, return_logits=True)
    np.testing.assert_allclose(chunked.logits, one_shot.logits, rtol=1e-4, atol=1e-4)
    assert chunked.tokens == one_shot.tokens


def test_ragged_batch_equals_separate_runs():
  model = tiny_model("llama")
  prompts = [random_prompt(30, seed=1), random_prompt(13, seed=2)]
  batched = kvjax.generate(model, prompts, max_new_tokens=8, prefill_chunk=16, return_logits=True)
  for b, prompt in enumerate(prompts):
    alone = kvjax.generate(model, prompt, max_new_tokens=8, prefill_chunk=16, return_logits=True)
    np.testing.assert_allclose(batched.logits[:, b], alone.logits[:, 0], rtol=1e-4, atol=1e-4)
    assert batched.tokens[b] == alone.tokens[0]
  assert batched.prompt_lengths == [30, 13]


def test_stop_tokens_end_a_sequence():
  model = tiny_model("llama")
  free = kvjax.generate(model, random_prompt(20), max_new_tokens=10)
  stop_at = free.tokens[0][3]
  stopped = kvjax.generate(model, random_prompt(20), max_new_tokens=10, stop_tokens=[stop_at])
  assert stopped.tokens[0] == free.tokens[0][: free.tokens[0].index(stop_at)]


def test_stop_when_ends_a_sequence_after_the_token_that_satisfies_it():
  model = tiny_model("llama")
  prompts = [random_prompt(20), random_prompt(17, seed=1)]
  free = kvjax.generate(model, prompts, max_new_tokens=10).tokens
  target = free[0][4]  # the first sequence stops once it has generated this token; the second may not
  seen = []
  stopped = kvjax.decode(model, kvjax.prefill(model, prompts, max_new_tokens=10), max_new_tokens=10,
                         stop_when=lambda ids: seen.append(list(ids)) or target in ids).tokens
  for b in range(2):
    expected = free[b][: free[b].index(target) + 1] if target in free[b] else free[b]
    assert stopped[b] == expected, b
  assert [free[0][0]] in seen  # called with each sequence's ids so far
  with pytest.raises(TypeError, match="stop_when"):
    kvjax.decode(model, kvjax.prefill(model, prompts, max_new_tokens=4), max_new_tokens=4, stop_when=3)


def test_decode_steps_count_every_step():
  """decode_seconds drops the compiling first step (when more ran); decode_steps counts them all."""
  model = tiny_model("llama")
  for new_tokens, steps, timed in ((1, 0, 0), (2, 1, 1), (5, 4, 3)):
    result = kvjax.generate(model, random_prompt(10), max_new_tokens=new_tokens)
    assert (result.decode_steps, len(result.decode_seconds)) == (steps, timed), new_tokens


def test_sampling_is_reproducible_from_seed():
  model = tiny_model("llama")
  runs = [kvjax.generate(model, random_prompt(20), max_new_tokens=12, temperature=1.5, seed=s).tokens
          for s in (3, 3, 4)]
  assert runs[0] == runs[1]
  assert runs[0] != runs[2]


def test_top_p_keeps_only_the_nucleus():
  logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
  drawn = {int(sample(logits, jax.random.key(i), SamplingConfig(temperature=1.0, top_p=0.7))[0])
           for i in range(200)}
  assert drawn == {0, 1}  # 0.5 + 0.3 reach 0.7; 0.15 and 0.05 are cut
  greedy = sample(logits, jax.random.key(0), SamplingConfig())
  assert int(greedy[0]) == 0
  tied = jnp.log(jnp.asarray([[0.4, 0.2, 0.2, 0.2]]))  # the nucleus is 0 and one of the tied three
  drawn = {int(sample(tied, jax.random.key(i), SamplingConfig(temperature=1.0, top_p=0.5))[0]) for i in range(200)}
  assert drawn == {0, 1}  # a logit threshold kept all four


def test_a_tiny_temperature_samples_the_best_token():
  logits = jnp.asarray([[3.0, 5.0, -1.0]])  # / 1e-38 overflowed to tied infinities: token 0 came out
  for top_p, temperature in ((1.0, 1e-38), (0.5, 1e-38), (1.0, 5e-324)):
    assert int(sample(logits, jax.random.key(0), SamplingConfig(temperature=temperature, top_p=top_p))[0]) == 1


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompts=[]), "empty"),
    (dict(prompts=[[]]), "empty"),
    (dict(prompts=""), "prompt 0 is an empty string"),
    (dict(prompts=["", "text"]), "prompt 0 is an empty string"),
    (dict(prompts=[5, 500]), "outside"),
    (dict(prompts=[1] * 250, max_new_tokens=10), "exceeds the context"),
    (dict(prompts=[1, 2], max_new_tokens=0), "max_new_tokens"),
    (dict(prompts=[1, 2], policy="nonsense"), "unknown policy"),
    (dict(prompts=[1, 2], policy_options={"topk": 3}), "does not take"),
    (dict(prompts=[1, 2], temperature=-1.0), "temperature"),
    (dict(prompts=[1, 2], top_p=0.0), "top_p"),
    (dict(prompts="text"), "no tokenizer"),
])
def test_bad_input_is_refused_before_work(kwargs, message):
  model = tiny_model("llama")
  prompts = kwargs.pop("prompts")
  with pytest.raises(ValueError, match=message):
    kvjax.generate(model, prompts, **kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompts=[[1.7, 2.2]]), r"prompt 0\[0\]=1.7 must be an int"),  # once truncated to [1, 2]
    (dict(prompts=[["5", "6"]]), "must be an int"),
    (dict(prompts=[[True, False]]), "must be an int"),
    (dict(prompts=[np.array([1.0, 2.0])]), "1-D integer array"),
    (dict(prompts=[1, 2], max_new_tokens=2.5), "max_new_tokens=2.5"),
    (dict(prompts=[1, 2], max_new_tokens=True), "max_new_tokens=True"),
    (dict(prompts=[1, 2], prefill_chunk=True), "prefill_chunk=True"),
    (dict(prompts=[1, 2], seed=1.5), "seed=1.5"),
    (dict(prompts=[1, 2], stop_tokens=[10**6]), "outside the vocabulary"),
    (dict(prompts=[1, 2], stop_tokens=5), "stop_tokens=5"),
    (dict(prompts=[1, 2], stop_tokens=[1.5]), "must be an int"),
    (dict(prompts=[1, 2], temperature=float("inf")), "temperature=inf"),
    (dict(prompts=[1, 2], return_logits="no"), "return_logits='no'"),
    (dict(prompts=[1, 2], policy="retrieval", policy_options=dict(topk=100.0)), "topk=100.0"),
    (dict(prompts=[1, 2], policy="retrieval", policy_options=dict(speculative="false")), "speculative='false'"),
    (dict(prompts=[1, 2], policy="retrieval", policy_options=dict(topk=True)), "topk=True"),
    (dict(prompts=[1, 2], policy="streaming", policy_options=dict(sinks=True)), "sinks=True"),
    (dict(prompts=[1, 2], policy="quest", policy_options=dict(page_size=True)), "page_size=True"),
    (dict(prompts=[1, 2], policy="freekv", policy_options=dict(max_recall=True)), "max_recall=True"),
    (dict(prompts=[1, 2], policy="freekv", policy_options=dict(dense_layers="01")), "dense_layers='01'"),
])
def test_values_of_the_wrong_type_are_refused_before_work(kwargs, message, monkeypatch):
  """Each is a TypeError (also a ValueError, kvjax.checks.ArgumentTypeError, for the policy
  options that raised ValueError before) or a ValueError, raised before the prefill starts."""
  from kvjax import engine

  model = tiny_model("llama")
  monkeypatch.setattr(engine, "prefill_chunk", None)  # no work may start: a prefill chunk would fail here
  prompts = kwargs.pop("prompts")
  with pytest.raises((TypeError, ValueError), match=message):
    kvjax.generate(model, prompts, max_new_tokens=kwargs.pop("max_new_tokens", 2), **kwargs)


def test_numpy_token_ids_are_accepted():
  model = tiny_model("llama")
  ids = np.array(random_prompt(9), np.int64)
  expected = kvjax.generate(model, [ids.tolist()], max_new_tokens=3).tokens
  assert kvjax.generate(model, ids, max_new_tokens=3).tokens == expected  # one prompt as a 1-D array
  assert kvjax.generate(model, [ids], max_new_tokens=3).tokens == expected
  assert kvjax.generate(model, [list(ids)], max_new_tokens=3).tokens == expected  # np.int64 items


def test_decode_refuses_to_run_past_the_model_context():
  model = tiny_model("llama")  # 256 positions; the room is rounded up past them
  context = kvjax.prefill(model, [1] * 240, max_new_tokens=1, prefill_chunk=200)
  try:
    assert context.capacity - 240 > 16
    with pytest.raises(ValueError, match="exceeds the context"):
      kvjax.decode(model, context, max_new_tokens=20)
  finally:
    context.close()


def test_rope_scaling_extends_the_context():
  model = tiny_model("llama")
  scaled = dataclasses.replace(model, cfg=model.cfg.with_rope_scaling(
      RopeScaling(kind="linear", factor=2.0, original_max_position=256)))
  result = kvjax.generate(scaled, random_prompt(300), max_new_tokens=3, prefill_chunk=128)
  assert len(result.tokens[0]) == 3


def test_unrolled_layers_equal_scanned_layers():
  from models.decoder import unstack_layers

  model = tiny_model("gemma3")
  unrolled = dataclasses.replace(model, params=unstack_layers(model.params))
  prompt = random_prompt(21)
  a = kvjax.generate(model, prompt, max_new_tokens=5, prefill_chunk=8, return_logits=True)
  b = kvjax.generate(unrolled, prompt, max_new_tokens=5, prefill_chunk=8, return_logits=True)
  np.testing.assert_allclose(b.logits, a.logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
@pytest.mark.parametrize("unroll", [False, True])
def test_decode_layout_equals_stacked_layers(family, unroll):
  # fused q/k/v (with Qwen2's biases) and gate/up, stacked or unrolled: the same model
  from models.decoder import decode_layout

  model = tiny_model(family)
  fused = dataclasses.replace(model, params=decode_layout(model.params, unroll=unroll))
  assert "wq" not in (fused.params["layers"][0] if unroll else fused.params["layers"])
  prompt = random_prompt(19)
  a = kvjax.generate(model, prompt, max_new_tokens=5, prefill_chunk=8, return_logits=True)
  b = kvjax.generate(fused, prompt, max_new_tokens=5, prefill_chunk=8, return_logits=True)
  np.testing.assert_allclose(b.logits, a.logits, rtol=1e-5, atol=1e-5)
