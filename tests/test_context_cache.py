"""save_context / load_context: decode from a loaded context equals decode right after prefill."""

import json

import numpy as np
import pytest

import kvjax
from test_generate import random_prompt, tiny_model

SMALL = dict(sinks=4, window=8)
CASES = [
    ("full", {}),
    ("streaming", SMALL),
    ("retrieval", dict(index="roar", topk=6, **SMALL)),
    ("freekv", dict(budget=24, page_size=4, dense_layers=(), **SMALL)),
    ("freekv", dict(budget=24, page_size=4, dense_layers=(), bridge="per_step", **SMALL)),
    ("freekv", dict(budget=24, page_size=4, dense_layers=(), bridge="per_step", lag=2, **SMALL)),
    ("freekv", dict(budget=24, page_size=4, dense_layers=(), bridge="per_step", host_codec="int8", **SMALL)),
]


def prompts():
  return [random_prompt(41, seed=1), random_prompt(29, seed=2)]


@pytest.mark.parametrize("policy, options", CASES)
def test_loaded_context_decodes_token_for_token(tmp_path, policy, options):
  model = tiny_model("llama")
  direct = kvjax.generate(model, prompts(), max_new_tokens=20, policy=policy, policy_options=options,
                          prefill_chunk=16, return_logits=True)
  context = kvjax.prefill(model, prompts(), max_new_tokens=20, policy=policy, policy_options=options,
                          prefill_chunk=16)
  kvjax.save_context(context, tmp_path / "ctx")
  context.close()
  loaded = kvjax.load_context(tmp_path / "ctx", model)
  result = kvjax.decode(model, loaded, max_new_tokens=20, return_logits=True)
  assert result.tokens == direct.tokens
  np.testing.assert_allclose(result.logits, direct.logits, rtol=1e-5, atol=1e-5)


def test_decode_options_may_change_but_layout_options_may_not(tmp_path):
  model = tiny_model("llama")
  options = dict(index="flat", topk=6, **SMALL)
  context = kvjax.prefill(model, prompts(), max_new_tokens=12, policy="retrieval", policy_options=options,
                          prefill_chunk=16)
  kvjax.save_context(context, tmp_path / "ctx")
  context.close()
  plain = kvjax.decode(model, kvjax.load_context(tmp_path / "ctx", model), max_new_tokens=12, return_logits=True)
  spec = kvjax.decode(model, kvjax.load_context(tmp_path / "ctx", model,
                                                policy_options=dict(speculative=True, tau=1.0)),
                      max_new_tokens=12, return_logits=True)
  np.testing.assert_allclose(spec.logits, plain.logits, rtol=1e-4, atol=1e-4)  # tau 1 = not speculative
  with pytest.raises(ValueError, match="window"):
    kvjax.load_context(tmp_path / "ctx", model, policy_options=dict(window=16))


def test_refuses_another_model_and_a_spent_context(tmp_path):
  model = tiny_model("llama")
  context = kvjax.prefill(model, prompts(), max_new_tokens=8, prefill_chunk=16)
  kvjax.save_context(context, tmp_path / "ctx")
  kvjax.decode(model, context, max_new_tokens=4)
  with pytest.raises(ValueError, match="decoded already"):
    kvjax.decode(model, context, max_new_tokens=4)
  with pytest.raises(ValueError, match="decoded already"):
    kvjax.save_context(context, tmp_path / "again")
  other = tiny_model("llama", norm_eps=1e-3)  # another architecture hash
  with pytest.raises(ValueError, match="made by model"):
    kvjax.load_context(tmp_path / "ctx", other)
  with pytest.raises(ValueError, match="exists"):
    kvjax.save_context(kvjax.prefill(model, prompts(), max_new_tokens=8), tmp_path / "ctx")


def test_corruption_is_detected(tmp_path):
  model = tiny_model("llama")
  context = kvjax.prefill(model, prompts(), max_new_tokens=8, policy="retrieval",
                          policy_options=dict(index="flat", **SMALL), prefill_chunk=16)
  kvjax.save_context(context, tmp_path / "ctx")
  context.close()
  manifest = json.loads((tmp_path / "ctx" / "manifest.json").read_text())
  manifest["arrays"]["leaf_0"]["crc32"] ^= 1
  (tmp_path / "ctx" / "manifest.json").write_text(json.dumps(manifest))
  with pytest.raises(ValueError, match="checksum"):
    kvjax.load_context(tmp_path / "ctx", model)
  manifest["arrays"]["leaf_0"]["crc32"] ^= 1
  (tmp_path / "ctx" / "manifest.json").write_text(json.dumps(manifest))
  host = tmp_path / "ctx" / "host.bin"
  data = bytearray(host.read_bytes())
  data[len(data) // 2] ^= 0xFF
  host.write_bytes(bytes(data))
  with pytest.raises(ValueError):
    kvjax.load_context(tmp_path / "ctx", model)
  (tmp_path / "ctx" / "manifest.json").write_text("{not json")
  with pytest.raises(ValueError, match="corrupt"):
    kvjax.load_context(tmp_path / "ctx", model)
  with pytest.raises(ValueError, match="not a saved kvjax context"):
    kvjax.load_context(tmp_path / "nothing", model)


@pytest.mark.parametrize("policy, options", CASES + [
    ("retrieval", dict(index="roar", topk=6, bridge="per_step", lag=2, speculative=True, pinned=2, pinned_window=3,
                       **SMALL))])
def test_copied_context_decodes_token_for_token_and_leaves_the_original_whole(policy, options):
  model = tiny_model("llama")
  direct = kvjax.generate(model, prompts(), max_new_tokens=20, policy=policy, policy_options=options,
                          prefill_chunk=16, return_logits=True)
  context = kvjax.prefill(model, prompts(), max_new_tokens=20, policy=policy, policy_options=options,
                          prefill_chunk=16)
  copy = kvjax.copy_context(context, model)
  assert copy.policy == context.policy and copy.capacity == context.capacity
  for decoded in (copy, context):  # the copy first: decoding it must leave the original as prefilled
    result = kvjax.decode(model, decoded, max_new_tokens=20, return_logits=True)
    assert result.tokens == direct.tokens
    np.testing.assert_allclose(result.logits, direct.logits, rtol=1e-5, atol=1e-5)


def test_copy_takes_decode_options_and_refuses_the_rest():
  model = tiny_model("llama")
  context = kvjax.prefill(model, prompts(), max_new_tokens=12, policy="retrieval",
                          policy_options=dict(index="flat", topk=6, **SMALL), prefill_chunk=16)
  spec = kvjax.decode(model, kvjax.copy_context(context, model, policy_options=dict(speculative=True, tau=1.0)),
                      max_new_tokens=12, return_logits=True)
  assert spec.policy_stats["hit_rate"] is not None  # the copy decoded speculatively
  with pytest.raises(ValueError, match="window"):
    kvjax.copy_context(context, model, policy_options=dict(window=16))
  with pytest.raises(ValueError, match="made by model"):
    kvjax.copy_context(context, tiny_model("llama", norm_eps=1e-3))
  plain = kvjax.decode(model, context, max_new_tokens=12, return_logits=True)
  np.testing.assert_allclose(spec.logits, plain.logits, rtol=1e-4, atol=1e-4)  # tau 1 = not speculative
  with pytest.raises(ValueError, match="decoded already"):
    kvjax.copy_context(context, model)
