"""Layer-major prefill (every chunk through a layer before the next) equals the chunk-major
prefill for every policy; host-backed policies hold one layer's prompt on the device."""

import types

import numpy as np
import pytest

import kvjax
from test_generate import random_prompt, tiny_model

SMALL = dict(sinks=8, window=16)
CASES = [
    ("full", {}),
    ("streaming", dict(sinks=8, window=32)),
    ("quest", dict(budget=64, page_size=8, sinks=8, window=16)),
    ("retrieval", dict(index="roar", topk=16, **SMALL)),
    ("retrieval", dict(index="flat", topk=16, bridge="per_step", lag=2, **SMALL)),
    ("freekv", dict(budget=64, page_size=8, **SMALL)),
]


def decode_both(model, policy, options, prompts, steps=5):
  out = []
  for layer_major in (False, True):
    progress = []
    context = kvjax.prefill(model, prompts, max_new_tokens=steps, policy=policy, policy_options=options,
                            prefill_chunk=48, layer_major=layer_major,
                            on_prefill_progress=lambda done, total: progress.append((done, total)))
    assert progress[-1][0] == progress[-1][1] == max(len(p) for p in prompts)
    out.append(kvjax.decode(model, context, max_new_tokens=steps, stop_tokens=[], return_logits=True))
  return out


@pytest.mark.parametrize("policy, options", CASES, ids=lambda x: x if isinstance(x, str) else "-".join(map(str, x.values())))
def test_layer_major_equals_chunk_major(policy, options):
  model = tiny_model()
  prompts = [random_prompt(150, seed=1), random_prompt(97, seed=2)]  # ragged, several chunks each
  chunk_major, layer_major = decode_both(model, policy, options, prompts)
  assert layer_major.tokens == chunk_major.tokens
  np.testing.assert_allclose(layer_major.logits, chunk_major.logits, atol=2e-5)


def test_layer_major_with_sliding_window_layers():
  model = tiny_model("gemma3")  # layer 0 slides (kept dense by retrieval), layer 1 is global
  prompts = [random_prompt(130, seed=3)]
  chunk_major, layer_major = decode_both(model, "retrieval", dict(index="flat", topk=16, **SMALL), prompts)
  np.testing.assert_allclose(layer_major.logits, chunk_major.logits, atol=2e-5)


def test_layer_major_stages_the_host_backed_prompt(monkeypatch):
  """The state a layer-major retrieval prefill runs with holds the dense layers + one slot."""
  model = tiny_model(num_layers=3)
  seen = []
  policy = kvjax.make_policy("retrieval", index="flat", topk=16, dense_layers=(2,), **SMALL)
  offload = type(policy).offload_layer

  def spy(self, cfg, state, layer):
    seen.append((layer, state.dense.k.shape[0], state.staged))
    return offload(self, cfg, state, layer)

  monkeypatch.setattr(type(policy), "offload_layer", spy)
  context = kvjax.prefill(model, random_prompt(120), max_new_tokens=2, policy=policy, prefill_chunk=48,
                          layer_major=True)
  assert seen == [(0, 2, True), (1, 2, True), (2, 2, True)]
  assert context.state.dense.k.shape[0] == 1 and not context.state.staged  # decode keeps the dense layer
  context.close()


def test_layer_major_refuses_a_sharded_model():
  model = tiny_model()
  sharded = types.SimpleNamespace(cfg=model.cfg, params=model.params, tokenizer=None, mesh="a mesh")
  with pytest.raises(ValueError, match="layer_major prefill runs on one device"):
    kvjax.prefill(sharded, random_prompt(50), policy="full", layer_major=True)
