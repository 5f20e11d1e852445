"""Which needles retrieval's pinned spans hold, chosen by the prompt's last query or by a window.

retrieval `bridge=per_step` pins, after the prefill, each query head's best `pinned` ids for
the prompt's last query, each with the `span - 1` tokens after it
(kvjax.prefetch_runtime.PrefetchRuntime.pin). On niah_multiquery (four keys asked at once)
the pinned decode still repeats some needles' numbers and never writes others'. This study
asks whether the pins hold every asked needle, and whether the last `window` prompt queries
together (SnapKV's observation window: each query's attention summed, ids ranked by the sum)
would. It captures the real post-RoPE queries and keys under full attention (recall.py's
capture), ranks the host-resident ids (past the sinks, before the window) exactly, and counts,
per layer and query head, the asked needles whose whole value (every token of the number)
lies inside the pinned spans (a value in the sinks or the window is on the device: held).

Rows, per sample, pinned count and query window: `heads_all` / `heads_none` the share of
(layer, query head)s whose spans hold every / none of the asked values, `mean_held` the mean
number held, `held_by_any_head` the asked values some head of some layer holds, `layers_all`
the share of layers whose heads together hold every value. Exact ranking: the policy's roar
search approximates the window-1 rows.

    python experiments/pin_study.py --model=qwen2.5-0.5b --task=niah_multiquery --length=8000 --seeds=0,1
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

import page_scores  # noqa: E402  (its answer_span; it defines the shared flags below)
import recall  # noqa: E402
import results_io  # noqa: E402

_O = {"allow_override": True}

flags.DEFINE_string("model", "qwen2.5-0.5b", "Model name (kvjax.load_model).", **_O)
flags.DEFINE_string("task", "niah_multiquery", "A kvjax.eval task whose answers stand in the context.", **_O)
flags.DEFINE_integer("length", 8000, "Prompt text tokens.", **_O)
flags.DEFINE_list("seeds", ["0", "1"], "Sample seeds.", **_O)
flags.DEFINE_integer("sinks", 128, "First tokens kept on the device (retrieval's default).", **_O)
flags.DEFINE_integer("window", 512, "Last tokens kept on the device (retrieval's default).", **_O)
flags.DEFINE_list("pinned", ["8", "16"], "Pinned ids per query head, one or more counts.", **_O)
flags.DEFINE_integer("span", 16, "Tokens kept from each pinned id on (retrieval's pinned_span).", **_O)
flags.DEFINE_list("windows", ["1", "8", "32", "64"], "Last prompt queries whose attention ranks the ids.", **_O)
flags.DEFINE_string("out_dir", None, "Results directory.", **_O)
flags.DEFINE_string("name", "pin_study_qwen_8k_multiquery", "Results stem.", **_O)
FLAGS = flags.FLAGS


def window_votes(q, k, scale: float, windows: list[int]) -> dict[int, np.ndarray]:
  """q [W, D]: the last W prompt queries (positions n - W .. n - 1), k [n, D] -> {w: [n] the
  attention the last w of them give each key, summed}. Causal: query i attends keys <= n - W + i."""
  W, n = len(q), len(k)
  logits = scale * (q @ k.T)  # [W, n]
  logits[np.arange(n)[None, :] > (n - W + np.arange(W))[:, None]] = -np.inf
  weights = np.exp(logits - logits.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  return {w: weights[W - w:].sum(0) for w in windows}


def held(pins, span: int, values: list[tuple[int, int]], resident) -> np.ndarray:
  """[len(values)] bool: each value's token range [start, end) lies inside the union of the
  device-resident tokens (`resident` [n] bool: the sinks and the window) and the spans
  [p, p + span) of `pins`."""
  kept = np.array(resident, bool)
  for p in pins:
    kept[p:p + span] = True
  return np.array([kept[start:end].all() for start, end in values])


def study_sample(model, seed: int, counts: list[int], windows: list[int]) -> list[dict]:
  from kvjax.eval import tasks
  from kvjax.eval.runner import prompt_ids

  sample = tasks.make_sample(FLAGS.task, model.tokenizer, length=FLAGS.length, seed=seed)
  ids = prompt_ids(model.tokenizer, sample)
  q, k, _, _, _ = recall.capture_vectors(model, ids, decode_steps=1)
  n = len(ids)
  L, Hq, _, _ = q.shape
  G = Hq // k.shape[1]
  lo, hi = FLAGS.sinks, n - FLAGS.window  # host-resident ids after the prefill
  values = [page_scores.answer_span(model.tokenizer, ids, a) for a in sample.answers]
  resident = np.ones(n, bool)
  resident[lo:hi] = False
  found = {(c, w): np.zeros((L, Hq, len(values)), bool) for c in counts for w in windows}
  for layer in range(L):
    if model.cfg.layer_windows[layer]:
      continue  # sliding-window layers stay dense
    for h in range(Hq):
      votes = window_votes(q[layer, h, n - max(windows):n].astype(np.float32),
                           k[layer, h // G, :n].astype(np.float32), model.cfg.attn_scale, windows)
      for w, vote in votes.items():
        order = lo + np.argsort(-vote[lo:hi], kind="stable")
        for c in counts:
          found[(c, w)][layer, h] = held(order[:c], FLAGS.span, values, resident)
  sparse = [l for l in range(L) if not model.cfg.layer_windows[l]]
  rows = []
  for (c, w), f in found.items():
    f = f[sparse]  # [layers, Hq, values]
    per_head = f.sum(-1)
    rows.append(dict(seed=seed, pinned=c, window=w, span=FLAGS.span, values=len(values),
                     heads_all=round(float((per_head == len(values)).mean()), 4),
                     heads_none=round(float((per_head == 0).mean()), 4),
                     mean_held=round(float(per_head.mean()), 3),
                     held_by_any_head=int(f.any(axis=(0, 1)).sum()),
                     layers_all=round(float(f.any(axis=1).all(-1).mean()), 4),
                     answer_tokens=" ".join(f"{s}-{e}" for s, e in values)))
  return rows


def summarize(rows: list[dict]) -> list[dict]:
  out = []
  for c, w in dict.fromkeys((r["pinned"], r["window"]) for r in rows):
    mine = [r for r in rows if (r["pinned"], r["window"]) == (c, w)]
    out.append(dict(pinned=c, window=w, samples=len(mine),
                    **{key: round(float(np.mean([r[key] for r in mine])), 4)
                       for key in ("heads_all", "heads_none", "mean_held", "held_by_any_head", "layers_all")}))
  return out


def main(argv):
  del argv
  import kvjax

  counts = [int(c) for c in FLAGS.pinned]
  windows = [int(w) for w in FLAGS.windows]
  if not counts or min(counts) < 1 or not windows or min(windows) < 1 or FLAGS.span < 1:
    raise app.UsageError(f"--pinned={FLAGS.pinned}, --windows={FLAGS.windows}, --span={FLAGS.span}: "
                         "each must be a positive int")
  results_io.commit()
  model = kvjax.load_model(FLAGS.model, dtype="float32")
  rows = []
  for seed in (int(s) for s in FLAGS.seeds):
    rows += study_sample(model, seed, counts, windows)
    results_io.write_results(FLAGS.name, rows, out_dir=FLAGS.out_dir, notes=__doc__.split("\n\n")[2],
                             summary=summarize(rows))
    print(results_io.markdown_table(summarize(rows)), flush=True)


if __name__ == "__main__":
  app.run(main)
