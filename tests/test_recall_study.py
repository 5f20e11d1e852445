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
