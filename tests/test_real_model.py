"""SmolLM2-135M-Instruct with its real weights, end to end on the CPU."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

import kvjax

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def smollm2():
  return kvjax.load_model("smollm2", dtype="float32")


def test_capital_of_france(smollm2):
  result = kvjax.generate(smollm2, "What is the capital of France?", max_new_tokens=24)
  assert "Paris" in result.texts[0]


def test_decode_cli_default_run_finds_the_pass_key(tmp_path):
  """`python experiments/decode.py` with no flags: ~6K tokens, pass key at a random depth."""
  report = tmp_path / "report.json"
  env = dict(os.environ, PYTHONPATH=str(REPO))
  proc = subprocess.run([sys.executable, str(REPO / "experiments" / "decode.py"), f"--json_out={report}"],
                        capture_output=True, text=True, env=env, timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  data = json.loads(report.read_text())
  assert data["prompt_tokens"] > 5000
  assert data["passkey_found"], data["answer"]


PASSKEY_DEPTHS = (0.1, 0.5)


@pytest.fixture(scope="module")
def passkey_prompts():
  # ~1.6K tokens: both depths lie before the last 512 (the window): only the host's keys hold them
  return [kvjax.passkey_prompt(num_sentences=200, depth=d, seed=i) for i, d in enumerate(PASSKEY_DEPTHS)]


@pytest.fixture(scope="module")
def full_answers(smollm2, passkey_prompts):
  result = kvjax.generate(smollm2, [p.text for p in passkey_prompts], max_new_tokens=12)
  return [p.passkey in text for p, text in zip(passkey_prompts, result.texts)]


def test_retrieval_finds_the_pass_key_wherever_full_does(smollm2, passkey_prompts, full_answers, tmp_path):
  """One prefill and index build serves both the plain and the speculative decode."""
  assert any(full_answers), "full attention itself misses every pass key: the prompt is broken"
  texts = [p.text for p in passkey_prompts]
  context = kvjax.prefill(smollm2, texts, max_new_tokens=12, policy="retrieval",
                          policy_options=dict(index="roar", topk=100))
  kvjax.save_context(context, tmp_path / "ctx")
  runs = {"plain": kvjax.decode(smollm2, context, max_new_tokens=12)}
  speculative = kvjax.load_context(tmp_path / "ctx", smollm2, policy_options=dict(speculative=True, tau=0.8))
  runs["speculative"] = kvjax.decode(smollm2, speculative, max_new_tokens=12)
  for name, result in runs.items():
    found = [p.passkey in text for p, text in zip(passkey_prompts, result.texts)]
    assert all(f for f, ok in zip(found, full_answers) if ok), (name, found, full_answers, result.texts)
