"""Which page summary keeps a needle's page: freekv's min/max bound against quantized keys.

freekv (and quest) choose pages by an upper bound of q·k from each page's per-channel key
max and min (`kvjax.policies.page_selection.page_scores`). On RULER samples this study captures the
real post-RoPE queries and keys under full attention (experiments/recall.py's capture), then,
at every decode step, layer and KV head, scores the complete pages between the sinks and the
window with each variant below, pools them over the GQA group as freekv does (softmax per
query head, mean over the group), keeps the top `--pages` (each budget in the list), and reports:

- recovery: the share of full attention's mass on the candidate pages that the kept pages
  hold (mean over steps, layers and KV heads);
- retrieval heads: the (step, layer, KV head, answer) cases where some query head of the group
  puts more than `--needle_share` of its whole attention on the page holding an answer's first
  token, and how often each variant does not keep that page. Tasks with several answers
  (niah_multiquery, niah_multivalue) count each answer's page: the decode turns from one
  needle to the next, and a selection must follow it.

Variants: `minmax` (freekv's bound; checked against page_scores itself), `minmax_sub8` (the
same bound over 8-token sub-pages, max over them), `keys{1,2,4}bit` (every key quantized per
channel to 1/2/4 bits over the candidate range; page score = max over its tokens of q·k̂),
`oracle` (max of the exact q·k). Device memory per token and KV head, against bf16 K+V
(4·D bytes): min/max 1/32, 2-bit keys 1/16, 4-bit keys 1/8.

    python experiments/page_scores.py --task=niah_single_2 --length=4096 --seeds=30,31,32,33
    python experiments/page_scores.py --model=qwen2.5-0.5b --task=niah_multiquery --length=32000 \
        --seeds=1 --steps=48 --pages=32,64
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

import recall  # noqa: E402  (its capture; it defines flags of some of the names below)
import results_io  # noqa: E402

_O = {"allow_override": True}

flags.DEFINE_string("model", "smollm2", "Model name (kvjax.load_model).", **_O)
flags.DEFINE_string("task", "niah_single_2", "A kvjax.eval task whose answers stand in the context.", **_O)
flags.DEFINE_integer("length", 4096, "Prompt text tokens.", **_O)
flags.DEFINE_list("seeds", ["30", "31", "32", "33"], "Sample seeds.", **_O)
flags.DEFINE_integer("steps", 8, "Greedy decode steps captured per sample.", **_O)
flags.DEFINE_integer("page_size", 32, "Tokens per page (freekv's default).", **_O)
flags.DEFINE_integer("sinks", 512, "First tokens kept on the device (freekv's default).", **_O)
flags.DEFINE_integer("window", 512, "Last tokens kept on the device (freekv's default).", **_O)
flags.DEFINE_list("pages", ["32"], "Pages kept per KV head, one or more budgets (freekv's default: 32).", **_O)
flags.DEFINE_float("needle_share", 0.3, "Attention share on the answer's page that marks a retrieval head.", **_O)
flags.DEFINE_string("out_dir", None, "Results directory.", **_O)
flags.DEFINE_string("name", "page_scores_smollm2_4k_niah2", "Results stem.", **_O)
FLAGS = flags.FLAGS

VARIANTS = ("minmax", "minmax_sub8", "keys1bit", "keys2bit", "keys4bit", "oracle")


def softmax(x):
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def quantized(x, bits: int, lo, hi):
  """x rounded per channel to 2**bits levels over [lo, hi], dequantized."""
  levels = 2**bits - 1
  code = np.clip(np.round((x - lo) / np.maximum(hi - lo, 1e-9) * levels), 0, levels)
  return lo + code / levels * (hi - lo)


def variant_scores(qg, pages, scale: float) -> dict:
  """Per-query-head page scores {variant: [G, N]} for queries qg [G, D] and pages [N, P, D]."""
  bound = lambda hi, lo: scale * (np.maximum(qg, 0) @ hi.T + np.minimum(qg, 0) @ lo.T)
  n, p, d = pages.shape
  sub = pages.reshape(n * p // 8, 8, d)
  out = {"minmax": bound(pages.max(1), pages.min(1)),
         "minmax_sub8": bound(sub.max(1), sub.min(1)).reshape(len(qg), n, p // 8).max(-1)}
  flat = pages.reshape(-1, d)
  lo, hi = flat.min(0), flat.max(0)
  for bits in (1, 2, 4):
    out[f"keys{bits}bit"] = (scale * (quantized(flat, bits, lo, hi) @ qg.T)).T.reshape(len(qg), n, p).max(-1)
  out["oracle"] = (scale * (flat @ qg.T)).T.reshape(len(qg), n, p).max(-1)
  return out


def answer_span(tokenizer, ids: list[int], answer: str) -> tuple[int, int]:
  """[start, end): the prompt tokens holding the answer's characters (its first occurrence)."""
  ends = np.cumsum([len(tokenizer.decode([t])) for t in ids])
  at = "".join(tokenizer.decode([t]) for t in ids).find(answer)
  if at < 0:
    raise ValueError(f"answer {answer!r} is not in the prompt's tokens")
  first, last = np.searchsorted(ends, [at, at + len(answer) - 1], side="right")
  return int(first), int(last) + 1


def answer_token(tokenizer, ids: list[int], answer: str) -> int:
  """Index of the prompt token holding the answer's first character (its first occurrence)."""
  return answer_span(tokenizer, ids, answer)[0]


def check_against_freekv(qg, pages, scale: float, pooled) -> None:
  """The NumPy min/max pooling equals kvjax.policies.page_selection.page_scores on this case."""
  import jax.numpy as jnp

  from kvjax.policies.page_selection import page_scores

  got = page_scores(jnp.asarray(qg[None]), jnp.asarray(pages.max(1)[None, None]),
                    jnp.asarray(pages.min(1)[None, None]), jnp.asarray([len(pages)]), scale=scale)
  np.testing.assert_allclose(np.asarray(got)[0, 0], pooled, rtol=1e-4, atol=1e-6)


def new_tally(budgets) -> dict:
  return {(v, b): dict(recovery=[], cases=0, missed=0, ranks=[]) for v in VARIANTS for b in budgets}


def score_case(tally: dict, qg, pages, mass, needle_pages, scale: float, share: float) -> None:
  """Adds one (step, layer, KV head) to `tally` (new_tally's): queries qg [G, D], candidate
  pages [N, P, D], full attention's mass mass [G, N] on them, the answers' pages needle_pages
  (indices into the N pages; out of range = not a candidate yet)."""
  n = len(pages)
  hot = [p for p in needle_pages if 0 <= p < n and mass[:, p].max() > share]  # retrieval-head cases
  budgets = sorted({b for _, b in tally})
  for v, s in variant_scores(qg, pages, scale).items():
    pooled = softmax(s).mean(0)
    order = np.argsort(-pooled)
    ranks = [int((pooled > pooled[p]).sum()) for p in hot]
    for budget in budgets:
      t = tally[v, budget]
      t["recovery"].append(mass[:, order[:budget]].sum() / max(mass.sum(), 1e-30))
      t["cases"] += len(hot)
      t["missed"] += sum(r >= budget for r in ranks)
      t["ranks"] += ranks


def study_sample(model, seed: int, budgets: list[int]) -> list[dict]:
  from kvjax.eval import tasks
  from kvjax.eval.runner import prompt_ids

  sample = tasks.make_sample(FLAGS.task, model.tokenizer, length=FLAGS.length, seed=seed)
  ids = prompt_ids(model.tokenizer, sample)
  q, k, _, generated, _ = recall.capture_vectors(model, ids, decode_steps=FLAGS.steps)
  q, k = q.astype(np.float32), k.astype(np.float32)  # [L, Hq, T, D], [L, Hkv, T, D]
  L, Hq, _, D = q.shape
  Hkv, G, n = k.shape[1], Hq // k.shape[1], len(ids)
  P, S, W = FLAGS.page_size, FLAGS.sinks, FLAGS.window
  needle_pages = [(answer_token(model.tokenizer, ids, a) - S) // P for a in sample.answers]
  scale = model.cfg.attn_scale
  tally = new_tally(budgets)
  checked = False
  for t in range(FLAGS.steps):
    pos = n + t  # decode step t's query; it attends keys 0..pos
    num_pages = (pos - W - S) // P  # complete pages before the window
    for layer in range(L):
      if model.cfg.layer_windows[layer]:
        continue  # sliding-window layers stay dense in freekv
      for h in range(Hkv):
        qg, keys = q[layer, h * G:(h + 1) * G, pos], k[layer, h, :pos + 1]
        pages = keys[S:S + num_pages * P].reshape(num_pages, P, D)
        mass = softmax(scale * qg @ keys.T)[:, S:S + num_pages * P].reshape(G, num_pages, P).sum(-1)
        if not checked:  # the NumPy bound is freekv's own, once per sample
          check_against_freekv(qg, pages, scale, softmax(variant_scores(qg, pages, scale)["minmax"]).mean(0))
          checked = True
        score_case(tally, qg, pages, mass, needle_pages, scale, FLAGS.needle_share)
  text = model.tokenizer.decode(generated.tolist())
  return [dict(seed=seed, variant=v, pages=b, full_generation=text, full_score=sample.score(text),
               needle_pages=" ".join(map(str, needle_pages)), recovery=round(float(np.mean(r["recovery"])), 4),
               retrieval_head_cases=r["cases"], needle_page_missed=r["missed"],
               median_needle_rank=float(np.median(r["ranks"])) if r["ranks"] else None)
          for (v, b), r in tally.items()]


def summarize(rows: list[dict]) -> list[dict]:
  out = []
  for v, b in dict.fromkeys((r["variant"], r["pages"]) for r in rows):
    mine = [r for r in rows if (r["variant"], r["pages"]) == (v, b)]
    cases = sum(r["retrieval_head_cases"] for r in mine)
    missed = sum(r["needle_page_missed"] for r in mine)
    out.append(dict(variant=v, pages=b, samples=len(mine),
                    recovery=round(float(np.mean([r["recovery"] for r in mine])), 4),
                    retrieval_head_cases=cases, needle_page_missed=missed,
                    missed_share=round(missed / cases, 3) if cases else None))
  return out


def main(argv):
  del argv
  import kvjax

  budgets = [int(b) for b in FLAGS.pages]
  if not budgets or min(budgets) < 1:
    raise app.UsageError(f"--pages={FLAGS.pages}: budgets must be positive page counts")
  results_io.commit()
  model = kvjax.load_model(FLAGS.model, dtype="float32")
  rows = []
  for seed in (int(s) for s in FLAGS.seeds):
    mine = study_sample(model, seed, budgets)
    rows += mine
    print(*[f"{r['variant']} {r['pages']} pages: recovery {r['recovery']}, missed "
            f"{r['needle_page_missed']}/{r['retrieval_head_cases']}" for r in mine], sep="\n", flush=True)
    results_io.write_results(FLAGS.name, rows, out_dir=FLAGS.out_dir, notes=__doc__.split("\n\n")[1],
                             summary=summarize(rows))


if __name__ == "__main__":
  app.run(main)
