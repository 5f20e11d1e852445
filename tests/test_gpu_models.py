"""GPU only: whole models with the Pallas kernels (prefill flash, decode split-K) against the
XLA path on the same device — the kernels' own tests cover shapes, this covers how the
models call them (SmolLM2's head_dim 64 with groups of 3, Gemma-3's sliding-window layers,
ragged batches, a prompt longer than one chunk)."""

import jax
import numpy as np
import pytest

import kvjax
from kvjax.policies import FullAttention, RetrievalAttention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")]


def _prompts(vocab, lengths, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(1, vocab, size=n).tolist() for n in lengths]


@pytest.mark.parametrize("name", ["random:smollm2", "random:gemma3-tiny", "random:qwen2-tiny"])
def test_pallas_model_matches_xla(name):
  model = kvjax.load_model(name, dtype="float32")
  prompts = _prompts(model.cfg.vocab_size, [700, 333])
  run = dict(max_new_tokens=6, prefill_chunk=256, return_logits=True, chat=False)
  xla = kvjax.generate(model, prompts, policy=FullAttention(implementation="xla"), **run)
  pallas = kvjax.generate(model, prompts, policy=FullAttention(implementation="pallas"), **run)
  # f32 weights, TF32-free kernels on both sides: differences are summation order only.
  np.testing.assert_allclose(pallas.logits, xla.logits, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("bridge", [dict(), dict(bridge="per_step"), dict(bridge="per_step", lag=2)],
                         ids=["per_layer", "per_step", "per_step_lag2"])
def test_retrieval_on_gpu_matches_full(bridge):
  """Retrieval's prefill runs the Pallas flash kernel and its decode the Pallas ring kernel (and,
  per_step, rows copied from reused host buffers): with a covering top-k it must equal full."""
  model = kvjax.load_model("random:smollm2", dtype="float32")
  prompts = _prompts(model.cfg.vocab_size, [900, 500])
  run = dict(max_new_tokens=8, prefill_chunk=256, return_logits=True, chat=False)  # every step evicts a token
  full = kvjax.generate(model, prompts, policy=FullAttention(implementation="pallas"), **run)
  sparse = kvjax.generate(model, prompts, policy=RetrievalAttention(index="flat", topk=1024, sinks=16, window=64,
                                                                    **bridge), **run)
  np.testing.assert_allclose(sparse.logits, full.logits, rtol=2e-3, atol=2e-3)
