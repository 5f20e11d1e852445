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
  host_backed = [r for r in sharded_rows if r["ref_callbacks"] is not None]
  assert {r["case"] for r in host_backed} == {"retrieval_gemma3_fused", "retrieval_per_step_lag2",
                                              "retrieval_per_step_lag0", "freekv", "freekv_per_step_lag2_keys2_int8"}
  for row in host_backed:
    assert row["callbacks"] == row["devices"] * row["ref_callbacks"], row


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
