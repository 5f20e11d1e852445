"""The main job: load a model, prefill a long prompt, decode, report speed and memory.

    python experiments/decode.py                       # SmolLM2 finds a pass key hidden in ~6K tokens
    python experiments/decode.py --prompt="What is the capital of France?"
    python experiments/decode.py --model=random:llama3-8b --context_len=131072 --max_new_tokens=32
"""

from __future__ import annotations

import dataclasses
import json
import math
import resource
import sys

from absl import app, flags, logging

import kvjax
from kvjax import cli, context_cache
from kvjax.policies import make_policy
import results_io

cli.define_flags()
flags.DEFINE_string("json_out", None, "Also write the report as JSON to this file.")
flags.DEFINE_bool("deterministic", False, "Set XLA's deterministic GPU flags (kvjax.use_deterministic_xla): the "
                  "same text in every process, at a cost in speed (off: XLA's fastest kernels).")
FLAGS = flags.FLAGS

SENTENCES_PER_TOKEN = 1 / 8.5  # the built-in filler's sentence length in SmolLM2 tokens


def _prompt(model):
  """(prompt, expected pass key or None) from the flags."""
  if FLAGS.prompt is not None and FLAGS.prompt_file is not None:
    raise app.UsageError("give --prompt or --prompt_file, not both")
  if FLAGS.prompt is not None:
    return FLAGS.prompt, None
  if FLAGS.prompt_file is not None:
    with open(FLAGS.prompt_file, encoding="utf-8") as f:
      return f.read(), None
  if model.tokenizer is None:  # random weights: random token ids of the asked length
    import numpy as np

    length = FLAGS.context_len or 6000
    ids = np.random.default_rng(FLAGS.seed).integers(0, model.cfg.vocab_size, size=length)
    return [int(t) for t in ids], None
  sentences = max(1, round((FLAGS.context_len or 6000) * SENTENCES_PER_TOKEN))
  built = kvjax.passkey_prompt(num_sentences=sentences, seed=FLAGS.seed)
  return built.text, built.passkey


def _progress(done: int, total: int) -> None:
  if total >= 4096:
    print(f"\rprefill {done}/{total} tokens", end="" if done < total else "\n", file=sys.stderr, flush=True)


def _index_progress(done: int, total: int) -> None:
  print(f"\roffloaded and indexed layer {done}/{total}", end="" if done < total else "\n", file=sys.stderr,
        flush=True)


def main(argv):
  logging.set_verbosity(logging.WARNING)  # orbax and XLA log every save at INFO
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if FLAGS.deterministic:
    kvjax.use_deterministic_xla()  # before resolve_dtype starts the backend
  dtype = cli.resolve_dtype(FLAGS.dtype)
  try:  # every flag checked before any model is loaded or any prompt prefilled
    kvjax.SamplingConfig(temperature=FLAGS.temperature, top_p=FLAGS.top_p)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  if FLAGS.top_p != 1.0 and FLAGS.temperature == 0:
    raise app.UsageError(f"--top_p={FLAGS.top_p} needs --temperature > 0 (temperature 0 is greedy)")
  if FLAGS["context_len"].present and FLAGS.context_len < 1:
    raise app.UsageError(f"--context_len={FLAGS.context_len} must be >= 1")
  if FLAGS["context_len"].present and (FLAGS.prompt is not None or FLAGS.prompt_file is not None):
    raise app.UsageError("--context_len sizes the built-in prompt; it does not apply with --prompt / --prompt_file")
  for name in ("batch", "max_new_tokens", "prefill_chunk"):
    if FLAGS[name].value < 1:
      raise app.UsageError(f"--{name}={FLAGS[name].value} must be >= 1")
  if FLAGS.seed < 0:
    raise app.UsageError(f"--seed={FLAGS.seed} must be >= 0")
  if FLAGS.load_context and FLAGS.save_context:
    raise app.UsageError("give --save_context or --load_context, not both")
  if FLAGS.load_context:
    # --rope_scaling stays allowed: it is part of the model identity the context checks.
    given = [f for f in ("prompt", "prompt_file", "context_len", "batch", "prefill_chunk", "layer_major")
             if FLAGS[f].present]
    if given:
      raise app.UsageError(f"--{given[0]} does not apply with --load_context (the context holds the prompt)")
    try:
      saved = context_cache.read_manifest(FLAGS.load_context)["policy"]["name"]
    except ValueError as e:
      raise app.UsageError(str(e)) from None
    if FLAGS["policy"].present and FLAGS.policy != saved:
      raise app.UsageError(f"--policy={FLAGS.policy} but the saved context was prefilled with {saved}")
  try:  # a policy refuses its options (a budget below its sinks + window, say) at construction
    if FLAGS.load_context:
      overrides = cli.policy_options(type(make_policy(saved)), FLAGS, policy_name=saved)
    else:
      policy = make_policy(FLAGS.policy, **cli.policy_options(type(make_policy(FLAGS.policy)), FLAGS))
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  model = kvjax.load_model(FLAGS.model, dtype=dtype, layout=FLAGS.layout)
  if FLAGS.rope_scaling:
    scaling = cli.parse_rope_scaling(FLAGS.rope_scaling, model.cfg.max_position)
    model = dataclasses.replace(model, cfg=model.cfg.with_rope_scaling(scaling))
  if FLAGS.load_context:
    try:
      context = kvjax.load_context(FLAGS.load_context, model, policy_options=overrides)
    except ValueError as e:  # another model, a corrupt file, or a layout option changed
      raise app.UsageError(str(e)) from None
    passkey = context.metadata.get("passkey")
  else:
    prompt, passkey = _prompt(model)
    context = kvjax.prefill(model, [prompt] * FLAGS.batch, max_new_tokens=FLAGS.max_new_tokens, policy=policy,
                            prefill_chunk=FLAGS.prefill_chunk, on_prefill_progress=_progress,
                            on_index_progress=_index_progress, layer_major=FLAGS.layer_major)
    context.metadata["passkey"] = passkey
    if FLAGS.save_context:
      kvjax.save_context(context, FLAGS.save_context)
  result = kvjax.decode(model, context, max_new_tokens=FLAGS.max_new_tokens, temperature=FLAGS.temperature,
                        top_p=FLAGS.top_p, seed=FLAGS.seed)

  answer = result.texts[0] if result.texts is not None else " ".join(map(str, result.tokens[0]))
  report = {
      "model": model.cfg.name,
      "dtype": dtype,
      "policy": result.policy,
      "batch": len(result.tokens),
      "prompt_tokens": result.prompt_lengths[0],
      "generated_tokens": len(result.tokens[0]),
      "context": f"loaded from {FLAGS.load_context}" if FLAGS.load_context else "prefilled",
      "prefill_seconds": round(result.prefill_seconds, 3),
      "prefill_tokens_per_second": round(result.prefill_tokens_per_second, 1),
      # None, not NaN (invalid JSON), when no decode step ran (--max_new_tokens=1).
      "decode_ms_per_token": None if math.isnan(result.ms_per_token) else round(result.ms_per_token, 3),
      "kv_cache_bytes": result.kv_bytes,
      "peak_device_bytes": result.peak_device_bytes,
      "peak_host_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
  }
  steps = max(1, result.decode_steps)
  for key, value in result.policy_stats.items():  # host-side breakdown of sparse policies
    name = key if key.startswith("host_") else f"host_{key}"
    if key.endswith("_seconds"):
      report[f"{name[:-8]}_ms_per_step"] = round(1e3 * value / steps, 3)
    elif value is not None:
      report[name] = round(value, 4) if isinstance(value, float) else value
  print(f"answer: {answer!r}")
  if passkey is not None:
    found = passkey in answer
    report["passkey"] = passkey
    report["passkey_found"] = found
    print(f"pass key {passkey}: {'found' if found else 'NOT found'}")
  for key, value in report.items():
    print(f"{key}: {value}")
  if FLAGS.json_out:
    with open(FLAGS.json_out, "w") as f:
      json.dump(results_io.stamp() | report | {"answer": answer}, f, indent=2)


if __name__ == "__main__":
  app.run(main)
