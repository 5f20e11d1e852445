"""What a decode variant of a shared prefill costs to set up: save + load against copy_context.

    python experiments/bench_context_copy.py --model=qwen2.5-0.5b --length=32000

One real prefill (a niah_multiquery prompt of `--length` tokens) under `--policy`, then, side
by side in one process, `--repeats` times each: kvjax.save_context to a scratch directory,
kvjax.load_context from it, and kvjax.copy_context in memory (what the eval CLIs now do for
every member of a prefill group after the first). The copy and a loaded context then decode
`--tokens` greedy tokens each, and the row says whether their tokens agree (they must: a copy
is what a save and a load give).
"""

from __future__ import annotations

import pathlib
import shutil
import statistics
import tempfile
import time

from absl import app, flags

import kvjax
from kvjax import eval as kveval
import eval_common
import results_io

flags.DEFINE_string("model", "qwen2.5-0.5b", "Model name or path (kvjax.load_model); it needs a tokenizer.")
flags.DEFINE_string("dtype", "auto", "auto (bfloat16 on GPU, float32 on CPU), float32, bfloat16 or float16.")
flags.DEFINE_integer("length", 8000, "Prompt text tokens.")
flags.DEFINE_string("policy", "retrieval:index=roar:topk=100:bridge=per_step:lag=2:roar_heads=kv:speculative=true",
                    "Policy spec name[:option=value]... (kvjax.eval.PolicySpec.parse).")
flags.DEFINE_integer("repeats", 3, "Saves, loads and copies timed (medians reported).")
flags.DEFINE_integer("tokens", 8, "Tokens decoded from a copy and from a loaded context.")
flags.DEFINE_string("out_dir", None, "Results directory (default experiments/results).")
flags.DEFINE_string("name", "bench_context_copy", "Results file name.")
FLAGS = flags.FLAGS


def _timed(fn) -> tuple[float, object]:
  t0 = time.perf_counter()
  out = fn()
  return time.perf_counter() - t0, out


def main(argv):
  del argv
  model = eval_common.load_model(FLAGS.model, FLAGS.dtype)
  spec = kveval.PolicySpec.parse(FLAGS.policy)
  sample = kveval.make_sample("niah_multiquery", model.tokenizer, length=FLAGS.length, seed=0)
  ids = kveval.prompt_ids(model.tokenizer, sample)
  prefill_s, context = _timed(lambda: kvjax.prefill(model, ids, max_new_tokens=FLAGS.tokens, policy=spec.policy,
                                                    policy_options=spec.options, prefill_chunk=2048))
  scratch = pathlib.Path(tempfile.mkdtemp(prefix="kvjax_copy_"))
  try:
    saves, loads, copies = [], [], []
    for i in range(FLAGS.repeats):
      saves.append(_timed(lambda: kvjax.save_context(context, scratch / f"c{i}"))[0])
      seconds, loaded = _timed(lambda: kvjax.load_context(scratch / f"c{i}", model))
      loads.append(seconds)
      seconds, copy = _timed(lambda: kvjax.copy_context(context, model))
      copies.append(seconds)
      if i < FLAGS.repeats - 1:
        loaded.close()
        copy.close()
    disk_bytes = sum(f.stat().st_size for f in (scratch / "c0").rglob("*") if f.is_file())
    decode = lambda c: kvjax.decode(model, c, max_new_tokens=FLAGS.tokens, temperature=0.0).tokens
    same = decode(copy) == decode(loaded)
  finally:
    shutil.rmtree(scratch, ignore_errors=True)
  median = lambda xs: round(statistics.median(xs), 4)
  row = {"model": model.cfg.name, "dtype": model.cfg.dtype, "policy": FLAGS.policy, "prompt_tokens": len(ids),
         "prefill_s": round(prefill_s, 2), "saved_mb": round(disk_bytes / 2**20, 1), "repeats": FLAGS.repeats,
         "save_s": median(saves), "load_s": median(loads), "copy_s": median(copies),
         "save_load_over_copy": round((median(saves) + median(loads)) / median(copies), 1),
         "copy_decodes_as_loaded": same}
  print(row)
  results_io.write_results(FLAGS.name, [row], out_dir=FLAGS.out_dir, notes=(
      "One real prefill, then side by side in one process: kvjax.save_context (to a scratch directory "
      "on the local disk), kvjax.load_context, kvjax.copy_context, each timed `repeats` times (medians). "
      "copy_decodes_as_loaded: a copy and a loaded context decode the same greedy tokens."))


if __name__ == "__main__":
  app.run(main)
