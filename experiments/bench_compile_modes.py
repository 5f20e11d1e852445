"""One decode step compiled three ways: where its time goes when the step is launch-bound.

    python experiments/bench_compile_modes.py --model=random:llama3-8b --context_len=8192 --batches=1,4 \\
        --policies=full,freekv_step

Modes (default three): `unrolled_cb_off` (unrolled layers, XLA command buffers off: kvjax.engine's
choice for unrolled layers), `unrolled_cb_on` (unrolled, XLA's
default command buffers) and `stacked` (stacked layers under lax.scan, XLA defaults); on request,
`unrolled_cb_*` variants with XLA's command-buffer update and graph-size options (MODES). For each mode,
policy and batch a context of random token ids is prefilled and `--steps` steps decoded through a
jit of `engine.decode_step` built here with that mode's options, so the policy's own preference
is bypassed. Rows (medians over the steps after two warm-up steps):

  call_ms: until the jitted call returns. XLA launches a step's kernels on the calling thread, so
    this is the host's launch time when it is close to jitted_ms;
  jitted_ms: until the step's token is ready;
  after_ms: the policy's host work between steps (freekv per_step: its exchange).

Real-model speed needs a GPU; on a CPU this only proves the program runs.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import kvjax
import results_io
from kvjax import engine
from kvjax.sampling import SamplingConfig
from models.rope import rope_tables

# mode -> (layer layout, jit compiler options). The unrolled_cb_* variants beyond on/off try XLA's
# command-buffer knobs on a launch-bound step: re-recording a graph whose argument addresses changed
# (SKIP_TEMP: not for temporaries), the exclusive-lock fast path of graph updates, graphs of any size.
MODES = {
    "unrolled_cb_off": ("unrolled", {"xla_gpu_enable_command_buffer": ""}),
    "unrolled_cb_on": ("unrolled", None),
    "unrolled_cb_skip_temp": ("unrolled", {"xla_gpu_command_buffer_update_mode": "SKIP_TEMP"}),
    "unrolled_cb_exclusive": ("unrolled", {"xla_gpu_require_exclusive_lock": True}),
    "unrolled_cb_min1": ("unrolled", {"xla_gpu_graph_min_graph_size": 1}),
    "unrolled_cb_tuned": ("unrolled", {"xla_gpu_command_buffer_update_mode": "SKIP_TEMP",
                                       "xla_gpu_require_exclusive_lock": True, "xla_gpu_graph_min_graph_size": 1}),
    "stacked": ("stacked", None),
}
DEFAULT_MODES = ("unrolled_cb_off", "unrolled_cb_on", "stacked")
POLICIES = {"full": ("full", {}), "freekv_step": ("freekv", {"bridge": "per_step"}),
            "freekv_step_lag2": ("freekv", {"bridge": "per_step", "lag": 2}),
            "retrieval_step_lag2": ("retrieval", {"bridge": "per_step", "lag": 2, "index": "flat"})}

flags.DEFINE_string("model", "random:llama3-8b", "Model name.")
flags.DEFINE_integer("context_len", 8192, "Prompt tokens per sequence.")
flags.DEFINE_list("batches", ["1"], "Sequences decoded together.")
flags.DEFINE_list("modes", list(DEFAULT_MODES), f"Compile modes, from {list(MODES)}.")
flags.DEFINE_list("policies", ["full", "freekv_step"], f"Policies, from {list(POLICIES)}.")
flags.DEFINE_integer("steps", 10, "Decode steps (the first two are not counted).")
flags.DEFINE_string("dtype", "bfloat16", "Weight and KV dtype.")
flags.DEFINE_string("out_dir", None, "Results directory.")
flags.DEFINE_string("name", "bench_compile_modes", "Results file name.")
FLAGS = flags.FLAGS


def step_fn(mode: str):
  return jax.jit(engine.decode_step.__wrapped__, static_argnames=("cfg", "policy", "sampling"),
                 donate_argnames=("state",), compiler_options=MODES[mode][1])


def measure(model, mode: str, key: str, batch: int) -> dict:
  name, options = POLICIES[key]
  rng = np.random.default_rng(batch)
  prompts = [[int(t) for t in rng.integers(0, model.cfg.vocab_size, size=FLAGS.context_len)] for _ in range(batch)]
  context = kvjax.prefill(model, prompts, max_new_tokens=FLAGS.steps + 2, policy=name, policy_options=options,
                          prefill_chunk=4096)
  cfg, policy, state = model.cfg, context.policy, engine.committed(context.state)
  context.state = None
  rope = tuple(jnp.asarray(t) for t in rope_tables(cfg, context.capacity))
  step = step_fn(mode)
  tokens = jnp.zeros((batch,), jnp.int32)
  positions = np.asarray(context.prompt_lengths, np.int32)
  calls, readies, afters = [], [], []
  for i in range(FLAGS.steps):
    t0 = time.perf_counter()
    tokens, _, state = step(model.params, rope, tokens, jnp.asarray(positions), state, jax.random.key(i), cfg=cfg,
                            policy=policy, sampling=SamplingConfig())
    t1 = time.perf_counter()
    tokens.block_until_ready()
    t2 = time.perf_counter()
    state = policy.after_step(cfg, state)
    t3 = time.perf_counter()
    positions = positions + 1
    if i >= 2:
      calls.append(t1 - t0), readies.append(t2 - t0), afters.append(t3 - t2)
  context.close()
  ms = lambda xs: round(1e3 * float(np.median(xs)), 2)
  return dict(call_ms=ms(calls), jitted_ms=ms(readies), after_ms=ms(afters))


def main(argv):
  del argv
  bad = sorted(set(FLAGS.modes) - set(MODES)) + sorted(set(FLAGS.policies) - set(POLICIES))
  if bad:
    raise app.UsageError(f"unknown --modes / --policies {bad}; known: {list(MODES)}, {list(POLICIES)}")
  batches = [int(b) for b in FLAGS.batches]
  rows = []
  for layout in dict.fromkeys(MODES[m][0] for m in FLAGS.modes):
    model = kvjax.load_model(FLAGS.model, dtype=FLAGS.dtype, layout=layout)
    for mode in [m for m in FLAGS.modes if MODES[m][0] == layout]:
      for batch in batches:
        for key in FLAGS.policies:
          row = dict(model=model.cfg.name, mode=mode, policy=key, batch=batch, context=FLAGS.context_len)
          try:
            row |= measure(model, mode, key, batch)
          except Exception as e:  # e.g. out of memory: the other cases still get measured
            row["error"] = f"{type(e).__name__}: {e}"[:300]
          print(row, flush=True)
          rows.append(row)
          results_io.write_results(FLAGS.name, rows, out_dir=FLAGS.out_dir, notes=__doc__.split("\n\n", 2)[2])
    del model


if __name__ == "__main__":
  app.run(main)
