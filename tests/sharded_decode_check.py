"""Sharded decode against unsharded decode, run as a script in its own process.

JAX fixes the CPU device count when it first starts, and the test suite runs on one device, so
tests/test_sharding.py runs this file with XLA_FLAGS=--xla_force_host_platform_device_count=4.
Each case decodes one tiny random model unsharded and over 2 and 4 devices and prints one JSON
line per comparison:

    {"case": ..., "devices": N, "max_abs": float, "tokens_equal": bool, "ambiguous_steps": int, ...}

Usage: python tests/sharded_decode_check.py [case[:devices,...] ...]   (default: every case on 2 and 4)
       "saved[:devices]" saves and loads a sharded context instead (run_saved).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import kvjax  # noqa: E402
from kvjax import host_runtime  # noqa: E402
from kvjax.sharding import shard_model  # noqa: E402
from models.config import param_shapes  # noqa: E402
from models.decoder import decode_layout  # noqa: E402
from test_generate import TinyModel, random_prompt, tiny_model  # noqa: E402

STEPS = 12
SMALL = dict(sinks=4, window=8)  # tokens leave the device window during decode


def tiny(family="llama", *, num_heads=8, num_kv_heads=4, vocab_size=97, seed=0, layout="stacked") -> TinyModel:
  """tests/test_generate.py's tiny model with 4 KV heads (divisible by 2 and 4)."""
  base = tiny_model(family, seed=seed)
  cfg = dataclasses.replace(base.cfg, num_heads=num_heads, num_kv_heads=num_kv_heads, vocab_size=vocab_size)
  paths, treedef = jax.tree.flatten_with_path(param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
  keys = jax.random.split(jax.random.key(seed), len(paths))
  leaves = [0.15 * jax.random.normal(k, shape) + (1.0 if "norm" in jax.tree_util.keystr(path) else 0.0)
            for k, (path, shape) in zip(keys, paths)]
  params = jax.tree.unflatten(treedef, leaves)
  if layout != "stacked":
    params = decode_layout(params, unroll=layout == "fused_unrolled")
  return TinyModel(cfg, params)


# name -> (model kwargs, generate kwargs)
CASES = {
    "full": (dict(), dict(policy="full")),
    "full_qwen2_fused_unrolled": (dict(family="qwen2", layout="fused_unrolled"), dict(policy="full")),
    "full_gemma3_fused_stacked": (dict(family="gemma3", layout="fused_stacked"), dict(policy="full")),
    "retrieval": (dict(), dict(policy="retrieval", policy_options=dict(index="flat", topk=6, **SMALL))),
    "retrieval_gemma3_fused": (dict(family="gemma3", layout="fused_stacked"), dict(
        policy="retrieval", policy_options=dict(index="roar", topk=6, speculative=True, tau=0.5, **SMALL))),
    "retrieval_roar_speculative": (dict(), dict(policy="retrieval", policy_options=dict(
        index="roar", topk=6, speculative=True, tau=0.5, **SMALL))),
    # bridge="per_step": the host work between steps runs per device (ShardedPolicy.after_step);
    # lag 2 runs it on a background thread, which must copy each update to its own device.
    "retrieval_per_step_lag2": (dict(), dict(policy="retrieval", policy_options=dict(
        index="roar", topk=6, bridge="per_step", lag=2, **SMALL))),
    # lag 0: each step runs twice, the exchange between the passes per device (repeat_step)
    "retrieval_per_step_lag0": (dict(), dict(policy="retrieval", policy_options=dict(
        index="roar", topk=6, bridge="per_step", lag=0, **SMALL))),
    # vocab 96: the untied lm_head is vocabulary-sharded (logits gathered by XLA outside shard_map)
    "freekv": (dict(vocab_size=96), dict(policy="freekv", policy_options=dict(
        budget=12, page_size=2, sinks=2, window=4, dense_layers=(), speculative=True, tau=0.5))),
    # per_step: the step's bookkeeping runs once per device after its last layer (after_layers,
    # inside shard_map), the exchange between steps per device on a background thread (lag 2);
    # pages scored from key codes, one layer at a time (the min/max summary is the case above);
    # host K/V as int8, encoded and decoded per device.
    "freekv_per_step_lag2_keys2_int8": (dict(), dict(policy="freekv", policy_options=dict(
        budget=12, page_size=2, sinks=2, window=4, dense_layers=(0,), bridge="per_step", lag=2,
        page_summary="keys2", host_codec="int8"))),
    "streaming": (dict(), dict(policy="streaming", policy_options=dict(sinks=4, window=8))),
    "quest": (dict(), dict(policy="quest", policy_options=dict(budget=16, page_size=4, sinks=4, window=4))),
}


def greedy_ambiguous(logits, tol: float) -> np.ndarray:
  """[steps, batch] bool: the top-2 margin is within `tol` (greedy may differ there)."""
  top2 = np.sort(logits, axis=-1)[..., -2:]
  return (top2[..., 1] - top2[..., 0]) <= tol


def host_calls(stats: dict) -> int | None:
  """Host callbacks plus per_step exchanges (retrieval counts its exchanges as callbacks, freekv
  apart); None for a device-only policy."""
  if not stats:
    return None
  return stats.get("callbacks", stats.get("host_callbacks", 0)) + stats.get("host_exchanges", 0)


def per_step_summed(stats: dict) -> bool:
  """Each merged per-step figure is the devices' sum (each recalls its own heads' pages every step)."""
  per_device = stats.get("devices", [])
  return all(np.isclose(v, sum(d[k] for d in per_device)) for k, v in stats.items() if k.endswith("_per_step"))


def run_case(name: str, device_counts=(2, 4), tol: float = 1e-4) -> list[dict]:
  model_kw, gen_kw = CASES[name]
  model = tiny(**model_kw)
  vocab = model.cfg.vocab_size
  prompts = [random_prompt(37, seed=1, vocab=vocab), random_prompt(29, seed=2, vocab=vocab)]  # ragged batch
  kw = dict(max_new_tokens=STEPS, prefill_chunk=16, return_logits=True) | gen_kw
  ref = kvjax.generate(model, prompts, **kw)
  rows = []
  for n in device_counts:
    t0 = time.perf_counter()
    sharded_model = shard_model(model, n)
    out = kvjax.generate(sharded_model, prompts, **kw)
    seconds = time.perf_counter() - t0
    diff = np.abs(out.logits - ref.logits)
    ambiguous = greedy_ambiguous(ref.logits, tol)
    # Greedy tokens must agree wherever no earlier step was ambiguous.
    tokens_equal = True
    for b in range(len(prompts)):
      first_ambiguous = int(np.argmax(ambiguous[:, b])) if ambiguous[:, b].any() else STEPS
      k = min(first_ambiguous, len(ref.tokens[b]))
      tokens_equal &= out.tokens[b][:k] == ref.tokens[b][:k]
    stats, ref_stats = out.policy_stats, ref.policy_stats
    rows.append(dict(case=name, devices=n, max_abs=float(diff.max()), tokens_equal=bool(tokens_equal),
                     ambiguous_steps=int(ambiguous.sum()), seconds=round(seconds, 2),
                     host_calls=host_calls(stats), ref_host_calls=host_calls(ref_stats),
                     decode_steps=stats.get("decode_steps"), ref_decode_steps=ref_stats.get("decode_steps"),
                     per_step_summed=per_step_summed(stats),
                     runtimes_left=len(host_runtime._RUNTIMES), policy=out.policy))
    print(json.dumps(rows[-1]), flush=True)
  return rows


def run_saved(devices: int = 2) -> dict:
  """A retrieval (per_step) context prefilled over `devices`, saved and loaded, and copied in
  memory: decode of the loaded context and of the copy equals decode right after prefill, token
  for token; a model on another device count is refused."""
  import tempfile

  model = tiny()
  prompts = [random_prompt(37, seed=1), random_prompt(29, seed=2)]
  options = dict(index="roar", topk=6, bridge="per_step", **SMALL)
  sharded = shard_model(model, devices)
  ctx = kvjax.prefill(sharded, prompts, max_new_tokens=STEPS, prefill_chunk=16, policy="retrieval",
                      policy_options=options)
  with tempfile.TemporaryDirectory() as tmp:
    kvjax.save_context(ctx, f"{tmp}/c")
    copied = kvjax.decode(sharded, kvjax.copy_context(ctx, sharded), max_new_tokens=STEPS, return_logits=True)
    direct = kvjax.decode(sharded, ctx, max_new_tokens=STEPS, return_logits=True)
    loaded = kvjax.decode(sharded, kvjax.load_context(f"{tmp}/c", sharded), max_new_tokens=STEPS,
                          return_logits=True)
    try:
      kvjax.load_context(f"{tmp}/c", model)
      refused = False
    except ValueError as e:
      refused = f"prefilled over {devices} device(s)" in str(e)
  row = dict(case="saved_retrieval_per_step", devices=devices, tokens_equal=loaded.tokens == direct.tokens,
             max_abs=float(np.abs(loaded.logits - direct.logits).max()), refused_other_device_count=refused,
             copy_tokens_equal=copied.tokens == direct.tokens,
             copy_max_abs=float(np.abs(copied.logits - direct.logits).max()),
             runtimes_left=len(host_runtime._RUNTIMES))
  print(json.dumps(row), flush=True)
  return row


def main(argv):
  """Arguments: case names, each optionally with its device counts ("freekv:2,4"; default 2 and 4)."""
  if len(jax.devices()) < 4:
    raise SystemExit(f"needs 4 devices (XLA_FLAGS=--xla_force_host_platform_device_count=4), has {jax.devices()}")
  for arg in argv[1:] or list(CASES):
    name, _, counts = arg.partition(":")
    if name == "saved":
      run_saved(int(counts or 2))
      continue
    run_case(name, tuple(int(c) for c in counts.split(",")) if counts else (2, 4))


if __name__ == "__main__":
  main(sys.argv)
