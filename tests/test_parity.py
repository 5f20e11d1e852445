"""The Flax decoders against transformers' PyTorch models (fixtures from make_parity_fixtures.py).

Prefill logits at every position and 16 teacher-forced decode steps through the `full`
policy's KV cache must match the PyTorch logits within rtol 1e-4 in float32.
"""

import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import engine
from kvjax.policies import FullAttention
from kvjax.sampling import SamplingConfig
from models.decoder import forward_hidden, logits_from_hidden
from models.hf_weights import config_from_hf, params_from_hf_state_dict
from models.rope import rope_tables

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
NAMES = sorted(p.stem for p in FIXTURES.glob("*.npz"))
RTOL = ATOL = 1e-4


def load_fixture(name):
  data = np.load(FIXTURES / f"{name}.npz")
  hf_config = json.loads(str(data["hf_config"]))
  cfg = config_from_hf(hf_config, name=f"fixture-{name}")
  state = {k: data[k] for k in data.files if k.startswith(("model.", "lm_head."))}
  params = jax.tree.map(jnp.asarray, params_from_hf_state_dict(state, cfg))
  return cfg, params, data


def prefill_all_logits(cfg, params, tokens, chunk, capacity):
  """Chunked prefill through the full policy, keeping the logits of every position."""
  policy = FullAttention(implementation="xla")
  state = policy.init_state(cfg, tokens.shape[0], capacity, jnp.float32)
  rope = tuple(jnp.asarray(t) for t in rope_tables(cfg, capacity))
  run = jax.jit(functools.partial(forward_hidden, cfg=cfg, rope=rope, attention_fn=functools.partial(policy.attend, cfg)))
  logits = []
  for begin in range(0, tokens.shape[1], chunk):
    part = jnp.asarray(tokens[:, begin : begin + chunk])
    positions = jnp.broadcast_to(jnp.arange(begin, begin + part.shape[1], dtype=jnp.int32), part.shape)
    hidden, state = run(params, part, positions, attention_state=state)
    logits.append(logits_from_hidden(params, cfg, hidden))
  return np.concatenate(logits, axis=1), state, rope, policy


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("chunk", [5, 1000])
def test_prefill_and_decode_match_transformers(name, chunk):
  cfg, params, data = load_fixture(name)
  tokens = data["input_ids"]
  capacity = 64
  logits, state, rope, policy = prefill_all_logits(cfg, params, tokens, chunk, capacity)
  np.testing.assert_allclose(logits, data["prefill_logits"], rtol=RTOL, atol=ATOL)

  feed, expected = data["decode_tokens"], data["decode_logits"]
  positions = np.full(tokens.shape[0], tokens.shape[1], np.int32)
  for step in range(feed.shape[1]):
    _, step_logits, state = engine.decode_step(
        params, rope, jnp.asarray(feed[:, step]), jnp.asarray(positions + step), state, jax.random.key(0),
        cfg=cfg, policy=policy, sampling=SamplingConfig())
    np.testing.assert_allclose(np.asarray(step_logits), expected[:, step], rtol=RTOL, atol=ATOL,
                               err_msg=f"{name} decode step {step}")


def test_fixtures_cover_every_family():
  families = {load_fixture(n)[0].family for n in NAMES}
  assert families == {"llama", "qwen2", "gemma3"}
  assert {"mistral", "llama_rope_llama3", "llama_rope_yarn", "llama_rope_linear"} <= set(NAMES)
