"""experiments/tail_estimate.py against direct NumPy attention, on synthetic vectors."""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "experiments"))

import tail_estimate as te  # noqa: E402


def _softmax_out(logits, values):
  """Direct softmax attention: logits [S, M], values [M, D] -> [S, D] (float64)."""
  w = np.exp(logits - logits.max(axis=1, keepdims=True))
  return (w / w.sum(axis=1, keepdims=True)) @ values


def test_kmeans_recovers_separated_blobs_and_refuses_too_many_clusters():
  rng = np.random.default_rng(0)
  centres = 20.0 * rng.standard_normal((4, 8))
  truth = rng.integers(0, 4, 200)
  x = centres[truth] + 0.1 * rng.standard_normal((200, 8))
  labels = te.kmeans(x, 4, iters=10, seed=3)
  # the same partition up to renaming: each true blob maps to one label and back
  assert len({(int(t), int(lab)) for t, lab in zip(truth, labels)}) == 4
  with pytest.raises(ValueError, match="clusters=201"):
    te.kmeans(x, 201, iters=1, seed=0)


def test_cluster_summaries_match_direct_per_label_statistics():
  rng = np.random.default_rng(1)
  keys, values = rng.standard_normal((50, 6)), rng.standard_normal((50, 6))
  labels = rng.integers(0, 7, 50)
  labels[labels == 3] = 4  # cluster 3 empty
  c = te.Clusters(keys, values, labels, 7)
  assert c.counts[3] == 0 and c.counts.sum() == 50
  for j in (0, 4, 6):
    members = labels == j
    np.testing.assert_allclose(c.key_sum[j], keys[members].sum(0), rtol=1e-5)
    np.testing.assert_allclose(c.value_sum[j], values[members].sum(0), rtol=1e-5)
    np.testing.assert_allclose(c.key_var[j], keys[members].var(0), rtol=1e-4, atol=1e-6)
  row = rng.standard_normal((3, 50))[:, np.argsort(labels, kind="stable")]  # a row in cluster order
  np.testing.assert_allclose(c.per_cluster(row)[:, 4], row[:, c.labels == 4].sum(1), rtol=1e-6)


def test_merged_partials_equal_softmax_over_the_union():
  rng = np.random.default_rng(2)
  logits, values = 3.0 * rng.standard_normal((5, 40)), rng.standard_normal((40, 4))
  a = te.partial(logits[:, :15], values[:15])
  b = te.partial(logits[:, 15:], values[15:])
  np.testing.assert_allclose(te.merge(a, b), _softmax_out(logits, values), rtol=1e-10)
  empty = te.partial(np.full((5, 3), -np.inf), values[:3])
  assert np.all(empty[0] == -np.inf) and np.all(empty[1] == 0)
  np.testing.assert_allclose(te.merge(a, b, empty), _softmax_out(logits, values), rtol=1e-10)


@pytest.mark.parametrize("k", [0, 7, 30])
def test_singleton_clusters_make_the_tail_estimate_exact(k):
  """Every key its own cluster: the pseudo-keys are the unselected keys themselves."""
  rng = np.random.default_rng(3)
  n, d, scale = 30, 8, 0.5
  keys, values, q = rng.standard_normal((n, d)), rng.standard_normal((n, d)), rng.standard_normal((4, d))
  c = te.Clusters(keys, values, np.arange(n)[::-1].copy(), n)
  logits = scale * (q @ c.keys.T)
  selected = te.selection_mask(logits, k)
  assert selected.sum() == 4 * min(k, n)
  for variance in (False, True):  # a singleton's variance is 0
    tail = te.tail_partial(q, logits, selected, c, scale=scale, variance=variance)
    chosen = te.partial(np.where(selected, logits, -np.inf), c.values)
    np.testing.assert_allclose(te.merge(chosen, tail), _softmax_out(logits, c.values), rtol=1e-9, atol=1e-12)


def test_tail_estimate_against_direct_pseudo_keys():
  """Clusters of several keys: logit scale q.c' + log(n - r) [+ variance term], value u' per cluster."""
  rng = np.random.default_rng(4)
  n, d, scale, clusters = 60, 8, 0.4, 5
  keys, values, q = rng.standard_normal((n, d)), rng.standard_normal((n, d)), rng.standard_normal((3, d))
  c = te.Clusters(keys, values, rng.integers(0, clusters, n), clusters)
  logits = scale * (q @ c.keys.T)
  selected = te.selection_mask(logits, 9)
  for variance in (False, True):
    lse, out = te.tail_partial(q, logits, selected, c, scale=scale, variance=variance)
    for s in range(3):
      pseudo_logits, pseudo_values = [], []
      for j in range(clusters):
        rest = (c.labels == j) & ~selected[s]
        if rest.any():
          extra = 0.5 * scale ** 2 * (q[s] ** 2) @ c.keys[c.labels == j].var(0) if variance else 0.0
          pseudo_logits.append(scale * q[s] @ c.keys[rest].mean(0) + np.log(rest.sum()) + extra)
          pseudo_values.append(c.values[rest].mean(0))
      pl = np.asarray(pseudo_logits)
      np.testing.assert_allclose(lse[s], np.log(np.exp(pl - pl.max()).sum()) + pl.max(), rtol=1e-5)
      np.testing.assert_allclose(out[s], _softmax_out(pl[None], np.asarray(pseudo_values))[0], rtol=1e-5, atol=1e-9)


def _capture(rng, *, L=2, Hq=4, Hkv=2, n=300, steps=5, d=16):
  base = rng.standard_normal((Hq, d))
  q = (base[None, :, None, :] + 0.4 * rng.standard_normal((L, Hq, n + steps, d))).astype(np.float16)
  k = rng.standard_normal((L, Hkv, n + steps, d)).astype(np.float16)
  v = rng.standard_normal((L, Hkv, n + steps, d)).astype(np.float16)
  return {"q": q, "k": k, "v": v, "meta": {"model": "synthetic", "source": "test", "layer_windows": [0] * L,
                                           "attn_scale": 0.25, "from_cache": None}}


def test_layer_errors_vanish_when_the_selection_covers_the_host_part():
  rng = np.random.default_rng(5)
  cap = _capture(rng)
  n_host = 300 - 32 - 8
  m = te.layer_errors(cap["q"], cap["k"], cap["v"], 1, n=300, steps=5, sinks=8, window=32, scale=0.25,
                      ks=[0, 10, n_host], groupings=["km1", "km20", "pg1", "pg32"], iters=3, seed=0,
                      variants=(("tail", False),))
  assert m["sparse_fresh@10"].shape == (4, 5)
  for sel in te.SELECTIONS:
    assert np.all(m[f"sparse_{sel}@{n_host}"] < 1e-12)
    assert np.all(m[f"tail_km20_{sel}@{n_host}"] < 1e-12) and np.all(m[f"tail_pg32_{sel}@{n_host}"] < 1e-12)
    for single in ("km1", "pg1"):  # singleton clusters: exact without any selection
      assert np.all(m[f"tail_{single}_{sel}@0"] < 1e-9)
    assert np.all(m[f"tail_pg32_{sel}@0"] < m[f"sparse_{sel}@0"])  # what the pages add is not nothing
    assert np.all(m[f"sparse_{sel}@0"] > 0)
  # the fresh selection is the exact top-k: its sparse error is at most lag 2's on average
  assert m["sparse_fresh@10"].mean() <= m["sparse_lag2@10"].mean()
  # one direct check: head 3, step 2, top-10 fresh, against full attention written out
  q = cap["q"][1, 3, 302].astype(np.float64)
  keys, values = cap["k"][1, 1, :303].astype(np.float64), cap["v"][1, 1, :303].astype(np.float64)
  logits = 0.25 * keys @ q
  full = _softmax_out(logits[None], values)[0]
  host = np.arange(8, 268)
  top = host[np.argsort(-logits[host])[:10]]
  attended = np.concatenate([np.arange(8), top, np.arange(268, 303)])
  sparse = _softmax_out(logits[attended][None], values[attended])[0]
  assert m["sparse_fresh@10"][3, 2] == pytest.approx(np.linalg.norm(sparse - full) / np.linalg.norm(full), rel=1e-4)


def test_run_writes_results_and_refuses_bad_sizes(tmp_path, monkeypatch):
  rng = np.random.default_rng(6)
  cap = _capture(rng, L=3)
  monkeypatch.setattr(te.recall, "load_or_capture", lambda *a, **kw: cap)
  kw = dict(n=300, steps=5, text="docs", layers=[], sinks=8, window=32, iters=2, cache_dir="", seed=0,
            out_dir=str(tmp_path), log=lambda s: None)
  rows, notes = te.run("synthetic", ks=[0, 10, 50], groupings=["km4", "pg16"], name="te_tiny", **kw)
  assert len(rows) == (3 + 1) * 2 * 3 and rows[-1]["layer"] == "all"
  doc = json.loads((tmp_path / "te_tiny.json").read_text())
  assert doc["meta"]["groupings"] == ["km4", "pg16"] and "tailvar_pg16_p90" in doc["rows"][0]
  assert "Mean relative error" in notes and (tmp_path / "te_tiny.md").exists()
  with pytest.raises(ValueError, match="260 host keys"):
    te.run("synthetic", ks=[300], groupings=["km4"], name="x", **kw)
  for bad in ("km0", "pages32", "pg"):
    with pytest.raises(ValueError, match=repr(bad)):
      te.run("synthetic", ks=[10], groupings=[bad], name="x", **kw)
  with pytest.raises(ValueError, match="ks=.-1"):
    te.run("synthetic", ks=[-1], groupings=["km4"], name="x", **kw)


def test_capture_without_values_is_taken_again_when_values_are_needed(tmp_path):
  import recall

  first = recall.load_or_capture("random:tiny", 200, decode_steps=2, text="docs", seed=0, cache_dir=str(tmp_path))
  assert first["v"].shape == first["k"].shape == (2, 2, 202, 16)
  path = next(tmp_path.glob("*.npz"))
  with np.load(path) as z:  # a cache file written before values were captured
    old = {key: z[key] for key in z.files if key != "v"}
  np.savez(path, **old)
  assert "v" not in recall.load_or_capture("random:tiny", 200, decode_steps=2, text="docs", seed=0,
                                           cache_dir=str(tmp_path))
  again = recall.load_or_capture("random:tiny", 200, decode_steps=2, text="docs", seed=0, cache_dir=str(tmp_path),
                                 need_values=True)
  np.testing.assert_array_equal(again["v"], first["v"])
  np.testing.assert_array_equal(again["k"], first["k"])
