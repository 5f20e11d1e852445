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


def save_prefilled(path, model, options, *, max_new_tokens=12, policy="retrieval"):
  """Prefills prompts() under `policy`, saves the context at `path` and closes it."""
  context = kvjax.prefill(model, prompts(), max_new_tokens=max_new_tokens, policy=policy, policy_options=options,
                          prefill_chunk=16)
  kvjax.save_context(context, path)
  context.close()


@pytest.mark.parametrize("policy, options", CASES)
def test_loaded_context_decodes_token_for_token(tmp_path, policy, options):
  model = tiny_model("llama")
  direct = kvjax.generate(model, prompts(), max_new_tokens=20, policy=policy, policy_options=options,
                          prefill_chunk=16, return_logits=True)
  save_prefilled(tmp_path / "ctx", model, options, max_new_tokens=20, policy=policy)
  loaded = kvjax.load_context(tmp_path / "ctx", model)
  result = kvjax.decode(model, loaded, max_new_tokens=20, return_logits=True)
  assert result.tokens == direct.tokens
  np.testing.assert_allclose(result.logits, direct.logits, rtol=1e-5, atol=1e-5)


def test_decode_options_may_change_but_layout_options_may_not(tmp_path):
  model = tiny_model("llama")
  save_prefilled(tmp_path / "ctx", model, dict(index="flat", topk=6, **SMALL))
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
  save_prefilled(tmp_path / "ctx", model, dict(index="flat", **SMALL), max_new_tokens=8)
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


@pytest.mark.parametrize("exchange", [True, False])  # one atomic swap, or (file systems without it) two renames
def test_overwrite_replaces_only_a_saved_context_and_keeps_the_old_one_until_the_new_is_in(
    tmp_path, monkeypatch, exchange):
  import os

  from kvjax import context_cache

  if not exchange:
    monkeypatch.setattr(context_cache, "_exchange", lambda a, b: False)
  else:
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    supported = context_cache._exchange(tmp_path / "a", tmp_path / "b")
    (tmp_path / "a").rmdir(), (tmp_path / "b").rmdir()
    if not supported:
      pytest.skip("this file system has no RENAME_EXCHANGE")
  model = tiny_model("llama")
  new = lambda: kvjax.prefill(model, prompts(), max_new_tokens=8, prefill_chunk=16)
  (tmp_path / "data").mkdir()
  (tmp_path / "data" / "keep.txt").write_text("x")
  (tmp_path / "file").write_text("x")
  for target in ("data", "file"):
    with pytest.raises(ValueError, match="not a saved kvjax context"):
      kvjax.save_context(new(), tmp_path / target, overwrite=True)
  assert (tmp_path / "data" / "keep.txt").read_text() == "x" and (tmp_path / "file").read_text() == "x"

  kvjax.save_context(new(), tmp_path / "ctx")
  before = (tmp_path / "ctx" / "manifest.json").read_text()
  real_replace = os.replace

  def failing_move(src, dst):  # the new directory cannot be moved in
    if ".tmp-" in str(src):
      raise OSError("disk gone")
    return real_replace(src, dst)

  def failing_exchange(a, b):
    raise OSError("disk gone")

  with monkeypatch.context() as patch:
    patch.setattr(context_cache.os, "replace", failing_move)
    if exchange:
      patch.setattr(context_cache, "_exchange", failing_exchange)
    with pytest.raises(OSError, match="disk gone"):
      kvjax.save_context(new(), tmp_path / "ctx", overwrite=True)
  assert (tmp_path / "ctx" / "manifest.json").read_text() == before  # the old context is back in place
  assert sorted(p.name for p in tmp_path.iterdir()) == ["ctx", "data", "file"]  # nothing half-written left

  context = new()
  context.metadata["prompt"] = "two random prompts"
  kvjax.save_context(context, tmp_path / "ctx", overwrite=True)
  assert kvjax.load_context(tmp_path / "ctx", model).metadata == {"prompt": "two random prompts"}
  assert sorted(p.name for p in tmp_path.iterdir()) == ["ctx", "data", "file"]


def test_metadata_that_json_cannot_hold_is_refused_before_any_work(tmp_path):
  model = tiny_model("llama")
  context = kvjax.prefill(model, prompts(), max_new_tokens=8, prefill_chunk=16)
  for key, value in (("steps", {3}), ("run", {1: "one"}), ("mixed", {1: "a", "b": 2})):
    context.metadata[key] = value  # a set; a key that JSON would turn into "1"; keys it cannot sort
    with pytest.raises(TypeError, match=f"'{key}'"):
      kvjax.save_context(context, tmp_path / "ctx")
    context.metadata.pop(key)
  context.metadata[7] = "x"
  with pytest.raises(TypeError, match="7"):
    kvjax.save_context(context, tmp_path / "ctx")
  assert list(tmp_path.iterdir()) == []


def test_numpy_scalars_save_as_numbers_and_relative_paths_work(tmp_path, monkeypatch):
  """A NumPy option or metadata value is written as the number it holds; orbax takes absolute paths
  only, so a relative path (and ~) failed after the whole prefill."""
  model = tiny_model("llama")
  options = dict(budget=np.int64(12), page_size=2, sinks=2, window=4)
  context = kvjax.prefill(model, prompts(), max_new_tokens=8, prefill_chunk=16, policy="freekv", policy_options=options)
  context.metadata["steps"] = np.int64(3)
  expected = kvjax.decode(model, kvjax.copy_context(context, model), max_new_tokens=8).tokens
  monkeypatch.chdir(tmp_path)
  kvjax.save_context(context, "ctx")
  loaded = kvjax.load_context("ctx", model)
  assert loaded.metadata == {"steps": 3} and loaded.policy.budget == 12
  assert kvjax.decode(model, loaded, max_new_tokens=8).tokens == expected


def test_the_manifest_is_checksummed_and_version_7_files_still_load(tmp_path):
  model = tiny_model("llama")
  save_prefilled(tmp_path / "ctx", model, dict(index="flat", topk=6, **SMALL))
  manifest_file = tmp_path / "ctx" / "manifest.json"
  manifest = json.loads(manifest_file.read_text())
  expected = kvjax.decode(model, kvjax.load_context(tmp_path / "ctx", model), max_new_tokens=12).tokens
  manifest_file.write_text(json.dumps(manifest | {"capacity": manifest["capacity"] + 1}))
  with pytest.raises(ValueError, match="corrupt"):
    kvjax.load_context(tmp_path / "ctx", model)
  old = {k: v for k, v in manifest.items() if k != "crc32"} | {"version": 7}  # written before the checksum
  manifest_file.write_text(json.dumps(old))
  assert kvjax.decode(model, kvjax.load_context(tmp_path / "ctx", model), max_new_tokens=12).tokens == expected
  manifest_file.write_text(json.dumps(old | {"host": "../host.bin"}))
  with pytest.raises(ValueError, match="plain file name"):
    kvjax.load_context(tmp_path / "ctx", model)
  manifest_file.write_text(json.dumps(old | {"version": 6}))
  with pytest.raises(ValueError, match="version 6"):
    kvjax.load_context(tmp_path / "ctx", model)


def test_a_failed_load_leaves_no_runtime_behind(tmp_path, monkeypatch):
  from kvjax import host_runtime
  from kvjax.policies import retrieval

  model = tiny_model("llama")
  save_prefilled(tmp_path / "ctx", model, dict(index="roar", topk=6, bridge="per_step", **SMALL))
  before = set(host_runtime._RUNTIMES)

  def no_room(*args, **kwargs):
    raise MemoryError("no room")

  monkeypatch.setattr(retrieval.RetrievalAttention, "reserve_decode_room", no_room)
  with pytest.raises(MemoryError):
    kvjax.load_context(tmp_path / "ctx", model)
  monkeypatch.setattr(retrieval.RetrievalAttention, "_first_rows", no_room)  # fails inside attach_host
  with pytest.raises(MemoryError):
    kvjax.load_context(tmp_path / "ctx", model)
  assert set(host_runtime._RUNTIMES) == before


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
  assert spec.policy_stats["correction_rate"] == 1.0  # the copy decoded speculatively (tau 1 corrects every group)
  with pytest.raises(ValueError, match="window"):
    kvjax.copy_context(context, model, policy_options=dict(window=16))
  with pytest.raises(ValueError, match="made by model"):
    kvjax.copy_context(context, tiny_model("llama", norm_eps=1e-3))
  plain = kvjax.decode(model, context, max_new_tokens=12, return_logits=True)
  np.testing.assert_allclose(spec.logits, plain.logits, rtol=1e-4, atol=1e-4)  # tau 1 = not speculative
  with pytest.raises(ValueError, match="decoded already"):
    kvjax.copy_context(context, model)


def test_a_host_file_of_another_save_is_refused(tmp_path):
  """Same model, same prompt lengths, another prompt: its host file passed every check before
  (model identity, own checksums) and decoded other tokens. Each host file now carries its
  save's id and device index."""
  import shutil

  model = tiny_model("llama")
  options = dict(index="flat", topk=6, **SMALL)
  save_prefilled(tmp_path / "a", model, options)
  other = kvjax.prefill(model, [random_prompt(41, seed=8), random_prompt(29, seed=9)], max_new_tokens=12,
                        policy="retrieval", policy_options=options, prefill_chunk=16)
  kvjax.save_context(other, tmp_path / "b")
  other.close()
  shutil.copyfile(tmp_path / "b" / "host.bin", tmp_path / "a" / "host.bin")
  with pytest.raises(ValueError, match="save_id"):
    kvjax.load_context(tmp_path / "a", model)


@pytest.mark.parametrize("damage", ["no_state", "no_host", "truncated_state"])
def test_a_missing_or_damaged_part_is_a_value_error(tmp_path, damage):
  import shutil

  model = tiny_model("llama")
  save_prefilled(tmp_path / "ctx", model, dict(index="flat", topk=6, **SMALL))
  if damage == "no_state":
    shutil.rmtree(tmp_path / "ctx" / "state")
  elif damage == "no_host":
    (tmp_path / "ctx" / "host.bin").unlink()
  else:  # every file orbax wrote, cut in half
    for f in (tmp_path / "ctx" / "state").rglob("*"):
      if f.is_file() and f.stat().st_size > 64:
        f.write_bytes(f.read_bytes()[:f.stat().st_size // 2])
  with pytest.raises(ValueError, match="incomplete|unreadable|does not match"):
    kvjax.load_context(tmp_path / "ctx", model)


def test_a_load_after_an_interrupted_overwrite_names_the_context_left_aside(tmp_path):
  model = tiny_model("llama")
  save_prefilled(tmp_path / "ctx", model, dict(index="flat", topk=6, **SMALL))
  (tmp_path / "ctx").rename(tmp_path / ".ctx.old-1234abcd")  # as a crash between the fallback's two renames leaves it
  with pytest.raises(ValueError, match=r"interrupted overwrite.*\.ctx\.old-1234abcd"):
    kvjax.load_context(tmp_path / "ctx", model)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_the_weights_fingerprint_does_not_depend_on_the_layout(family):
  from models.decoder import decode_layout, weights_fingerprint

  params = tiny_model(family).params
  stacked = weights_fingerprint(params)
  assert stacked == weights_fingerprint(decode_layout(params, unroll=False))  # fused, stacked
  assert stacked == weights_fingerprint(decode_layout(params, unroll=True))  # fused, one dict a layer
  assert stacked != weights_fingerprint(tiny_model(family, seed=1).params)


def test_a_context_of_other_weights_is_refused(tmp_path):
  """Same name, architecture and dtype, other weights (another seed: as a fine-tune or another
  quantization of one model): it loaded and decoded other tokens before the fingerprint."""
  model, other = tiny_model("llama"), tiny_model("llama", seed=1)
  assert (model.cfg.name, model.cfg.config_hash()) == (other.cfg.name, other.cfg.config_hash())
  save_prefilled(tmp_path / "ctx", model, dict(index="flat", topk=6, **SMALL))
  with pytest.raises(ValueError, match="other weights"):
    kvjax.load_context(tmp_path / "ctx", other)
  kvjax.load_context(tmp_path / "ctx", model).close()  # its own model still loads it
  context = kvjax.prefill(model, prompts(), max_new_tokens=8, prefill_chunk=16)
  with pytest.raises(ValueError, match="other weights"):
    kvjax.decode(other, context, max_new_tokens=4)
