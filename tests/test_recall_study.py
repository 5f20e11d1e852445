"""experiments/recall.py end to end at a tiny size with a random model (real weights are not needed
to check the plumbing: capture, index, curves, summary, results files)."""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "experiments"))

import recall  # noqa: E402


def test_scanned_at_interpolates():
  pts = [(0.1, 0.5), (0.2, 0.9), (0.4, 1.0)]
  assert recall.scanned_at(pts, 0.9) == pytest.approx(0.2)
  assert recall.scanned_at(pts, 0.95) == pytest.approx(0.3)
  assert recall.scanned_at(pts, 0.4) == pytest.approx(0.1)  # least effort already there
  assert recall.scanned_at([(0.1, 0.5), (0.3, 0.8)], 0.9) is None


def test_recall_matrix_ignores_padding():
  truth = np.array([[0, 1, 2, 3], [4, 5, 6, 7]])
  ids = np.array([[3, 2, 9, -1], [7, 6, 5, 4]])
  np.testing.assert_allclose(recall.recall_matrix(ids, truth, 10), [0.5, 1.0])


def test_parse_kind():
  assert recall.parse_kind("ivf256") == ("ivf", {"nlist": 256})
  assert recall.parse_kind("ivf") == ("ivf", {})
  assert recall.parse_kind("graph_ip") == ("graph", {"metric": "ip"})
  with pytest.raises(ValueError, match="unknown kind"):
    recall.parse_kind("hnsw")


def test_study_end_to_end(tmp_path):
  import kvjax
  from models.registry import load_model

  model = load_model("random:tiny")
  kinds = ["flat", "ivf16", "graph", "graph_ip", "roar"]
  curves, summary, notes = recall.run_real(
      "random:tiny", n=400, decode_steps=3, text="docs", layers=[1], sinks=8, window=32, kinds=kinds,
      k_top=10, efs=[10, 20, 40, 80], nprobe_fracs=[0.1, 0.3, 1.0], train_queries=128, train_topk=10,
      kk_queries=16, seed=0, cache_dir=str(tmp_path / "cache"), name="recall_tiny", out_dir=str(tmp_path),
      make_plot=False, model=model, log=lambda s: None)
  doc = json.loads((tmp_path / "recall_tiny.json").read_text())
  assert {"device", "jax", "commit", "date", "command", "rows", "summary", "per_head_rows"} <= set(doc)
  md = (tmp_path / "recall_tiny.md").read_text()
  assert "**Q->K**" in md and "**K->K**" in md and "| layer | ivf16 | graph | graph_ip | roar |" in md
  flat = [r for r in curves if r["kind"] == "flat"]
  assert {r["mode"] for r in flat} == {"Q->K", "K->K"}
  assert all(r["recall"] == 1.0 and r["scanned_frac"] == pytest.approx(1.0) for r in flat)
  # Every kind reaches recall 1 once it scans everything (ivf with nprobe = nlist).
  ivf = [r for r in curves if r["kind"] == "ivf16" and r["effort"] == 16]
  assert all(r["recall"] == 1.0 for r in ivf)
  assert {(r["kind"], r["mode"]) for r in summary} == {(k, m) for k in kinds for m in ("Q->K", "K->K")}
  roar = [r for r in doc["per_head_rows"] if r["kind"] == "roar"]
  assert {r["q_head"] for r in roar} == {0, 1, 2, 3}  # one roar index per query head
  assert all(r["n_keys"] == 400 - 32 - 8 for r in roar)

  # The captured decode queries come from real greedy decode steps: the same tokens as generate().
  data = recall.load_or_capture("random:tiny", 400, decode_steps=3, text="docs", seed=0,
                                cache_dir=str(tmp_path / "cache"))
  assert data["meta"]["from_cache"]
  assert data["q"].shape == (2, 4, 403, 16) and data["k"].shape == (2, 2, 403, 16)
  prompt = data["tokens"][:400].tolist()
  ref = kvjax.generate(model, prompt, max_new_tokens=3, policy="full", stop_tokens=[])
  assert ref.tokens[0] == data["tokens"][400:].tolist()


def test_position_recall_matches_brute_force():
  rng = np.random.default_rng(0)
  n, q, k, n_prompt, lo, bins = 50, 7, 6, 64, 5, 10
  positions = np.arange(lo, lo + n)
  truth = np.stack([rng.choice(n, k, replace=False) for _ in range(q)])
  ids = np.stack([rng.choice(n, k, replace=False) for _ in range(q)])
  ids[0, -2:] = -1  # padding is never a hit
  hits, true = recall.position_recall(ids, truth, positions, n_prompt=n_prompt, bins=bins)
  want_h, want_t = np.zeros(bins, int), np.zeros(bins, int)
  for i in range(q):
    got = {int(x) for x in ids[i] if x >= 0}
    for t in truth[i]:
      b = min(bins - 1, int(positions[t]) * bins // n_prompt)
      want_t[b] += 1
      want_h[b] += int(t) in got
  np.testing.assert_array_equal(hits, want_h)
  np.testing.assert_array_equal(true, want_t)
  assert hits.sum() / true.sum() == pytest.approx(recall.recall_matrix(ids, truth, n).mean())


def test_mass_recall_matches_brute_force():
  rng = np.random.default_rng(1)
  keys, qs = rng.normal(size=(40, 8)).astype(np.float32), rng.normal(size=(5, 8)).astype(np.float32)
  k, scale = 6, 0.7
  truth = recall.exact_topk_np(qs, keys, k)
  ids = np.stack([rng.choice(40, k, replace=False) for _ in range(5)])
  ids[1, 0] = -1
  scores = np.where(ids >= 0, np.einsum("qd,qkd->qk", qs, keys[np.maximum(ids, 0)]), -np.inf)
  got = recall.mass_recall(ids, scores, np.einsum("qd,qkd->qk", qs, keys[truth]), scale)
  for i in range(5):
    p = np.exp(scale * (qs[i] @ keys.T))
    p /= p.sum()
    assert got[i] == pytest.approx(sum(p[j] for j in ids[i] if j >= 0) / p[truth[i]].sum(), rel=1e-5)
  assert (got <= 1 + 1e-9).all()
  np.testing.assert_allclose(recall.mass_recall(truth, np.einsum("qd,qkd->qk", qs, keys[truth]),
                                                np.einsum("qd,qkd->qk", qs, keys[truth]), scale), 1.0)


def test_study_hubs_variants():
  rng = np.random.default_rng(2)
  n, m = 200, 64
  topk = np.stack([rng.choice(n, 10, replace=False) for _ in range(m)])
  q4 = recall.study_hubs(topk, n, "q4_h8")
  cnt = np.bincount(topk[m - m // 4:].ravel(), minlength=n)
  np.testing.assert_array_equal(q4, np.lexsort((np.arange(n), -cnt))[:8])
  tail = recall.study_hubs(topk, n, "tail4_h8")
  cnt4 = np.bincount(topk[-4:].ravel(), minlength=n)
  np.testing.assert_array_equal(tail[:4], np.lexsort((np.arange(n), -cnt4))[:4])
  assert len(set(tail.tolist())) == 8 and set(tail[4:].tolist()) <= set(np.flatnonzero(cnt).tolist())
  strat = recall.study_hubs(topk, n, "strat4_h8")
  assert len(set(strat.tolist())) == 8
  assert [sum(j * n // 4 <= h < (j + 1) * n // 4 for h in strat) for j in range(4)] == [2, 2, 2, 2]
  with pytest.raises(ValueError):
    recall.parse_hub_variant("tailx")


def test_study_position_breakdown_and_hub_variants(tmp_path):
  from models.registry import load_model

  model = load_model("random:tiny")
  curves, summary, notes = recall.run_real(
      "random:tiny", n=400, decode_steps=3, text="docs", layers=[1], sinks=8, window=32, kinds=["roar"],
      k_top=10, efs=[10, 40], nprobe_fracs=[1.0], train_queries=128, train_topk=10, kk_queries=16, seed=0,
      cache_dir=str(tmp_path / "cache"), name="recall_pos", out_dir=str(tmp_path), make_plot=False, model=model,
      log=lambda s: None, hub_variants=["q4", "tail64strat8", "tail8"])
  assert {r["kind"] for r in curves} == {"roar", "roar:q4", "roar:tail64strat8", "roar:tail8"}
  for r in curves:
    assert sum(r["pos_true"]) == 10 * 4 * (3 if r["mode"] == "Q->K" else 16)  # 4 query-head indexes: 3 steps, 16 keys
    assert sum(r["pos_hits"]) / sum(r["pos_true"]) == pytest.approx(r["recall"], abs=1e-4)
    assert 0 < r["mass_recall"] <= 1 + 1e-9
  # tail64strat8 is what the C build picks (q4 before): the same searches.
  by = {(r["kind"], r["mode"], r["effort"]): r for r in curves}
  for (kind, mode, ef), r in by.items():
    if kind == "roar":
      assert by[("roar:tail64strat8", mode, ef)]["recall"] == r["recall"]
      assert by[("roar:tail64strat8", mode, ef)]["scanned_frac"] == r["scanned_frac"]
  md = (tmp_path / "recall_pos.md").read_text()
  assert recall.POSITION_MARK in md and "| roar:tail8 |" in md


def test_needle_tokens_place_the_needle_and_keep_the_question():
  from kvjax.prompts import PASSKEY_QUESTION

  class Chars:  # one token per character
    def encode(self, s):
      return [ord(c) for c in s]

  ids, (a, b) = recall.needle_tokens(Chars(), 3000, 0.1, seed=0)
  text = "".join(map(chr, ids))
  assert len(ids) == 3000 and text.endswith(PASSKEY_QUESTION)
  assert a == 300 and text[a:b].strip().startswith("The pass key is") and text.count("The pass key is") == 2  # the needle and the question


def test_curve_rows_focus_span_counts_its_true_keys():
  class Fixed:  # an "index" returning fixed ids
    def search(self, queries, k, ef=None, threads=None):
      ids = np.array([[0, 1, 2], [3, 4, 9]])
      return ids, np.zeros(ids.shape, np.float32), np.full(len(ids), 5)

  truth = np.array([[0, 5, 6], [3, 4, 5]])
  detail = {"positions": np.arange(10, 20), "n_prompt": 20, "scale": 1.0, "focus": (13, 16),
            "truth_scores": {"Q->K": np.zeros((2, 3), np.float32)}}
  (row,) = recall.curve_rows(Fixed(), "graph", {"Q->K": np.zeros((2, 4))}, {"Q->K": truth}, 10, k=3, efs=[8],
                             nprobe_fracs=[], detail=detail)
  # keys 3, 4, 5 sit at positions 13-15: true there are 5 (row 0) and 3, 4, 5 (row 1); found: 3, 4.
  assert (row["focus_hits"], row["focus_true"]) == (2, 4)
  assert sum(row["pos_true"]) == 6 and sum(row["pos_hits"]) == 3
