"""Heads sharded over several devices (kvjax.sharding): the same tokens and logits as one device.

The multi-device runs need JAX started with several CPU devices, which the rest of the suite
(one device) must not see: they run in a subprocess (tests/sharded_decode_check.py) with
XLA_FLAGS=--xla_force_host_platform_device_count=4. The checks that need no second device run here.
"""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.sharding import shard_model, split_state
from models.tensor_parallel import check_shardable, local_config, shard_major
from test_generate import tiny_model

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TOL = 1e-4  # float32 logits; sharding changes only the order of the psum's additions

# One case per policy, each against the unsharded decode of the same model: full on Qwen2
# shapes (q/k/v biases) with fused, unrolled weights; retrieval (roar, speculative) on Gemma 3
# shapes (QK norms, sandwich norms around the psum, a sliding-window layer kept dense) with
# fused stacked weights; retrieval's per_step bridge (lag 2: host work on a background thread,
# per device); freekv (speculative, and per_step lag 2: after_layers inside shard_map) on Llama
# shapes. Mostly compilation (272 s of CI with 7 sharded runs), so each case runs on one device
# count: full on 4, the rest on 2; the head split is the same code for every policy.
CASES = ["full_qwen2_fused_unrolled:4", "retrieval_gemma3_fused:2", "retrieval_per_step_lag2:2",
         "retrieval_per_step_lag0:2", "freekv:2", "freekv_per_step_lag2_keys2_int8:2"]
SAVED = "saved:2"  # a sharded context saved and loaded, and copied (sharded_decode_check.run_saved)


@pytest.fixture(scope="module")
def sharded_rows():
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "experiments"), HERE]))
  proc = subprocess.run([sys.executable, os.path.join(HERE, "sharded_decode_check.py"), *CASES, SAVED], env=env,
                        capture_output=True, text=True, timeout=600, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def _decode_rows(rows):
  return [r for r in rows if r["case"] != "saved_retrieval_per_step"]


def test_sharded_decode_equals_unsharded(sharded_rows):
  sharded_rows = _decode_rows(sharded_rows)
  expected = {(c.split(":")[0], int(n)) for c in CASES for n in c.split(":")[1].split(",")}
  assert {(r["case"], r["devices"]) for r in sharded_rows} == expected
  for row in sharded_rows:
    assert row["max_abs"] < TOL, row
    assert row["tokens_equal"], row  # greedy tokens, up to the first step with a top-2 margin <= TOL
    assert row["runtimes_left"] == 0, row  # every device's host runtime released


def test_one_host_exchange_per_layer_or_step_per_device(sharded_rows):
  sharded_rows = _decode_rows(sharded_rows)
  host_backed = [r for r in sharded_rows if r["ref_host_calls"] is not None]
  assert {r["case"] for r in host_backed} == {"retrieval_gemma3_fused", "retrieval_per_step_lag2",
                                              "retrieval_per_step_lag0", "freekv", "freekv_per_step_lag2_keys2_int8"}
  for row in host_backed:
    assert row["ref_host_calls"] > 0, row  # freekv per_step: exchanges, not callbacks (0 == 0 passed before)
    assert row["host_calls"] == row["devices"] * row["ref_host_calls"], row


def test_sharded_stats_merge_per_policy(sharded_rows):
  """The step count is the decode's, not the devices' sum; per-step figures add up each device's
  heads (they were averaged before, and freekv's decode_steps doubled on two devices)."""
  freekv_rows = [r for r in _decode_rows(sharded_rows) if r["case"].startswith("freekv")]
  assert len(freekv_rows) == 2
  for row in freekv_rows:
    assert row["decode_steps"] == row["ref_decode_steps"] > 0, row
    assert row["per_step_summed"], row


def test_saved_sharded_context_decodes_token_for_token(sharded_rows):
  saved = [r for r in sharded_rows if r["case"] == "saved_retrieval_per_step"]
  assert len(saved) == 1
  row = saved[0]
  assert row["tokens_equal"] and row["max_abs"] < TOL, row  # each device got back its own heads and host share
  assert row["copy_tokens_equal"] and row["copy_max_abs"] < TOL, row  # so did each device's in-memory copy
  assert row["refused_other_device_count"], row  # onto one device: a clear ValueError
  assert row["runtimes_left"] == 0, row


@pytest.mark.parametrize("kv_heads, devices", [(3, 2), (2, 4), (1, 2)])  # SmolLM2, Qwen2.5, Gemma-3 shapes
def test_device_count_must_divide_the_kv_heads(kv_heads, devices):
  base = tiny_model("llama")  # 6 query heads
  model = dataclasses.replace(base, cfg=dataclasses.replace(base.cfg, num_kv_heads=kv_heads))
  with pytest.raises(ValueError, match=f"{devices} devices do not divide the {kv_heads} KV heads"):
    shard_model(model, devices)
  with pytest.raises(ValueError, match=f"num_kv_heads={kv_heads}"):
    check_shardable(model.cfg, devices)


def test_load_model_refuses_a_bad_device_count():
  with pytest.raises(ValueError, match="4 devices do not divide the 2 KV heads"):
    kvjax.load_model("random:tiny", devices=4)


def test_one_device_is_the_unsharded_path():
  model = tiny_model("llama")
  assert shard_model(model, 1) is model


def test_local_config_splits_heads_and_mlp():
  cfg = tiny_model("llama").cfg  # 6 q / 2 kv heads, MLP 96
  local = local_config(cfg, 2)
  assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (3, 1, 48)
  assert local.attn_scale == cfg.attn_scale and local.hidden_size == cfg.hidden_size


def test_shard_major_puts_each_devices_blocks_together():
  q, k, v = np.arange(4), 10 + np.arange(2), 20 + np.arange(2)
  w = jnp.asarray(np.concatenate([q, k, v]))[None]  # [1, 8]: columns [q | k | v]
  np.testing.assert_array_equal(shard_major(w, (4, 2, 2), 2)[0], [0, 1, 10, 20, 2, 3, 11, 21])


def test_split_state_gives_each_device_its_scalar():
  from kvjax.sharding import ShardedPolicy, head_mesh
  from kvjax.policies import RetrievalAttention

  model = tiny_model("llama")
  policy = ShardedPolicy(RetrievalAttention(index="flat", sinks=2, window=4), head_mesh(1))
  state = policy.init_state(model.cfg, 1, 32, jnp.float32)
  try:
    assert state.runtime_id.shape == (1,) and state.ring_k.shape[2] == model.cfg.num_kv_heads
    (local,) = split_state(state, policy.mesh)
    assert local.runtime_id.shape == () and policy.inner.runtime(local) is not None
  finally:
    policy.release_fn(state)()


def test_decode_refuses_a_context_from_other_devices():
  from kvjax.sharding import ShardedModel, head_mesh
  from models.tensor_parallel import shard_params

  model = tiny_model("llama")
  mesh = head_mesh(1)  # the sharded program on this process's one device
  sharded = ShardedModel(cfg=model.cfg, params=shard_params(model.params, model.cfg, mesh), tokenizer=None,
                         mesh=mesh)
  context = kvjax.prefill(model, [1, 2, 3], max_new_tokens=2)
  with pytest.raises(ValueError, match="prefilled on one device but the model is on 1 devices"):
    kvjax.decode(sharded, context, max_new_tokens=2)


def test_freekv_merges_device_stats_from_its_counters():
  """Rates from the summed counters (not a mean of rates), per-step figures summed, the step
  count kept, the slowest exchange the slowest device's."""
  from kvjax.freekv_host import FreeKVStats
  from kvjax.policies.freekv import FreeKVAttention, _stats_dict

  a = FreeKVStats(exchanges=4, decided_heads=2, corrected_heads=1, sync_pages=8, page_bytes=64, slowest_exchange_ms=3.0)
  b = FreeKVStats(exchanges=4, decided_heads=8, corrected_heads=0, sync_pages=4, page_bytes=64, slowest_exchange_ms=5.0)
  merged = FreeKVAttention().merge_device_stats([_stats_dict(a, 4, 100), _stats_dict(b, 4, 300)])
  assert merged["decode_steps"] == 4
  assert merged["correction_rate"] == 1 / 10  # a mean of the devices' rates would say 0.25
  assert merged["recalled_pages_per_step"] == 3.0 and merged["recalled_bytes_per_step"] == 3.0 * 64
  assert merged["host_slowest_exchange_ms"] == 5.0 and merged["host_page_bytes"] == 64
  assert merged["resident_bytes"] == 400 and merged["host_exchanges"] == 8
  with pytest.raises(ValueError, match="step counts"):
    FreeKVAttention().merge_device_stats([_stats_dict(a, 4, 100), _stats_dict(b, 5, 300)])


def test_retrieval_merges_device_stats_from_its_counters():
  from kvjax.host_runtime import HostStats, PrefillTimes
  from kvjax.policies.retrieval import RetrievalAttention

  def stats(**counters):
    return HostStats(**counters).as_dict() | PrefillTimes(offload=1.5).as_dict() | {"resident_bytes": 10}

  merged = RetrievalAttention().merge_device_stats([
      stats(callbacks=3, speculated_groups=1, corrected_groups=1, reused_hits=9, reused_total=10, repeated_steps=2),
      stats(callbacks=3, speculated_groups=7, corrected_groups=1, reused_hits=1, reused_total=10, repeated_steps=1)])
  assert merged["callbacks"] == 6 and merged["resident_bytes"] == 20 and merged["prefill_offload_s"] == 3.0
  assert merged["correction_rate"] == 2 / 10 and merged["hit_rate"] == 10 / 20
  assert merged["repeated_steps"] == 2


@pytest.mark.parametrize("devices, error", [(0, ValueError), (-2, ValueError), (2.0, TypeError), ("2", TypeError),
                                            (True, TypeError), ([], ValueError)])
def test_bad_devices_are_refused_by_name(devices, error):
  with pytest.raises(error, match="devices="):
    shard_model(tiny_model("llama"), devices)
  with pytest.raises(error, match="devices="):
    kvjax.load_model("random:tiny", devices=devices)


def test_a_device_listed_twice_is_refused():
  device = jax.devices()[0]
  with pytest.raises(ValueError, match="distinct"):
    shard_model(tiny_model("llama"), [device, device])
