"""experiments/query_drift.py's metrics against direct NumPy computations, on synthetic vectors."""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "experiments"))

import query_drift as qd  # noqa: E402


def _vectors(rng, n, d, *, scale=1.0):
  return (scale * rng.standard_normal((n, d))).astype(np.float32)


def test_cosine_and_group_mean_match_the_runtime():
  from kvjax.host_runtime import group_mean_cosine

  rng = np.random.default_rng(0)
  a = _vectors(rng, 6 * 8, 16).reshape(6, 8, 16)  # [steps, Hq, D]
  b = a + 0.3 * _vectors(rng, 6 * 8, 16).reshape(6, 8, 16)
  np.testing.assert_allclose(qd.cosine(a, a), 1.0, rtol=1e-6)
  direct = np.einsum("shd,shd->sh", a, b) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))
  np.testing.assert_allclose(qd.cosine(a, b), direct, rtol=1e-5)
  # FreeKV's test as kvjax computes it: [B, Hq, D] -> [B, Hkv]; group_mean takes heads first.
  np.testing.assert_allclose(qd.group_mean(qd.cosine(a, b).T, 2).T, group_mean_cosine(a, b, 2), rtol=1e-5)
  with pytest.raises(ValueError, match="not a multiple"):
    qd.group_mean(np.zeros((7, 3)), 2)


def test_recovered_mass_of_exact_topk_is_the_topk_softmax_weights():
  rng = np.random.default_rng(1)
  scores = 3.0 * rng.standard_normal((5, 300))
  w = np.exp(scores - scores.max(1, keepdims=True))
  w /= w.sum(1, keepdims=True)
  np.testing.assert_allclose(qd.softmax(scores), w, rtol=1e-12)
  np.testing.assert_allclose(qd.logsumexp(scores), np.log(np.exp(scores).sum(1)), rtol=1e-12)
  for k in (1, 10, 300, 1000):
    ids = qd.topk_ids(scores, k)
    assert ids.shape == (5, min(k, 300))
    top = -np.sort(-w, axis=1)[:, :k]
    np.testing.assert_allclose(qd.recovered_mass(w, ids), top.sum(1), rtol=1e-12)
  ids = qd.topk_ids(scores, 10)
  padded = np.concatenate([ids, -np.ones((5, 3), np.int64)], axis=1)  # -1 = no key
  np.testing.assert_allclose(qd.recovered_mass(w, padded), qd.recovered_mass(w, ids))
  np.testing.assert_allclose(qd.hit_rate(ids, ids, 300), 1.0)
  np.testing.assert_allclose(qd.hit_rate(padded[:, 5:], ids, 300), 0.5)


def _head(rng, *, n=400, steps=5, d=16, sinks=8, window=32):
  q = _vectors(rng, steps + 2, d, scale=0.7)
  keys = _vectors(rng, n + steps, d)
  dev_pos = np.concatenate([np.arange(sinks), np.arange(n - window, n + steps)])
  return q, keys[sinks:n - window], keys[dev_pos], dev_pos, keys


def test_head_recovery_against_direct_attention():
  import host_index as hi

  rng = np.random.default_rng(2)
  n, steps, sinks, window, scale = 400, 5, 8, 32, 0.25
  q, host, dev, dev_pos, keys = _head(rng, n=n, steps=steps, sinks=sinks, window=window)
  flat = hi.build_index(host, kind="flat")
  out = qd.head_recovery(q, host, dev, dev_pos, n=n, scale=scale, ks=[10, 50], index=flat)
  for t in range(steps):
    full = scale * keys[:n + t + 1] @ q[t + 2]  # causal: keys [0, N + t]
    p = np.exp(full - full.max())
    p /= p.sum()
    assert out["host_share"][t] == pytest.approx(p[sinks:n - window].sum(), rel=1e-5)
    ph = p[sinks:n - window] / p[sinks:n - window].sum()
    for k in (10, 50):
      assert out[f"rec_exact@{k}"][t] == pytest.approx(np.sort(ph)[-k:].sum(), rel=1e-5)
      lag1 = np.argsort(-(host @ q[t + 1]))[:k]
      assert out[f"rec_lag1@{k}"][t] == pytest.approx(ph[lag1].sum(), rel=1e-5)
      assert out[f"hit_lag1@{k}"][t] == pytest.approx(len(set(lag1) & set(np.argsort(-ph)[:k])) / k)
      lag2 = np.argsort(-(host @ q[t]))[:k]
      assert out[f"rec_lag2@{k}"][t] == pytest.approx(ph[lag2].sum(), rel=1e-5)
  for k in (10, 50):  # an exact index in the roar slot returns the exact set
    np.testing.assert_allclose(out[f"rec_roar@{k}"], out[f"rec_exact@{k}"], rtol=1e-6)
    np.testing.assert_allclose(out[f"hit_roar@{k}"], 1.0)
    np.testing.assert_allclose(out[f"rec_roar_lag1@{k}"], out[f"rec_lag1@{k}"], rtol=1e-6)


def test_lag_zero_recovers_exactly():
  rng = np.random.default_rng(3)
  q, host, dev, dev_pos, _ = _head(rng)
  same = np.repeat(q[-1:], len(q), axis=0)  # q_t = q_t-1 = q_t-2
  out = qd.head_recovery(same, host, dev, dev_pos, n=400, scale=0.25, ks=[20])
  np.testing.assert_allclose(out["rec_lag1@20"], out["rec_exact@20"])
  np.testing.assert_allclose(out["rec_lag2@20"], out["rec_exact@20"])
  np.testing.assert_allclose(out["hit_lag1@20"], 1.0)
  assert np.all((out["rec_exact@20"] > 0) & (out["rec_exact@20"] <= 1 + 1e-12))


def _capture(rng, *, L=2, Hq=4, Hkv=2, n=300, steps=6, d=16):
  base = _vectors(rng, Hq, d)
  q = (base[None, :, None, :] + 0.4 * rng.standard_normal((L, Hq, n + steps, d))).astype(np.float16)
  k = rng.standard_normal((L, Hkv, n + steps, d)).astype(np.float16)
  return {"q": q, "k": k, "meta": {"model": "synthetic", "source": "test", "layer_windows": [0] * L,
                                   "attn_scale": 0.25, "from_cache": None}}


def test_layer_study_and_speculation_bounds():
  rng = np.random.default_rng(4)
  cap = _capture(rng)
  m = qd.layer_study(cap["q"], cap["k"], 1, n=300, steps=6, sinks=8, window=32, scale=0.25, ks=[10])
  assert m["cos1"].shape == (4, 6) and m["gcos1"].shape == (2, 6) and m["rec_exact@10"].shape == (4, 6)
  q32 = cap["q"][1].astype(np.float32)
  np.testing.assert_allclose(m["cos1"][3, 0], qd.cosine(q32[3, 300], q32[3, 299]), rtol=1e-6)
  np.testing.assert_allclose(m["gcos2"][1], m["cos2"][2:].mean(0), rtol=1e-6)
  s = qd.summarize(m, taus=[1.5, -1.5])  # every group corrected / none
  assert s["corr@1.5"] == 1.0 and s["corr@-1.5"] == 0.0
  assert s["rec_spec1.5@10"] == pytest.approx(s["rec_exact@10"])
  assert s["rec_spec-1.5@10"] == pytest.approx(s["rec_lag1@10"])
  assert s["rec_exact@10"] >= s["rec_lag1@10"] and s["rec_exact@10"] >= s["rec_lag2@10"]
  assert s["gain_spec1.5@10"] == pytest.approx(1.0) and s["gain_oracle1.5@10"] == pytest.approx(1.0)
  assert s["gain_spec-1.5@10"] == 0.0 and s["gain_oracle-1.5@10"] == 0.0
  s = qd.summarize(m, taus=[float(np.median(m["gcos1"]))])  # half corrected
  tau = next(key for key in s if key.startswith("gain_spec"))[len("gain_spec"):-len("@10")]
  gain, oracle = s[f"gain_spec{tau}@10"], s[f"gain_oracle{tau}@10"]
  assert 0.0 <= gain <= oracle <= 1.0
  assert s[f"rec_spec{tau}@10"] == pytest.approx(s["rec_lag1@10"] + gain * (s["rec_exact@10"] - s["rec_lag1@10"]))
  both = qd.concat_layers({0: m, 1: m})
  assert qd.summarize(both, taus=[0.8])["rec_spec0.8@10"] == pytest.approx(qd.summarize(m, taus=[0.8])[
      "rec_spec0.8@10"])


def test_run_writes_results(tmp_path, monkeypatch):
  rng = np.random.default_rng(5)
  cap = _capture(rng, L=5)
  monkeypatch.setattr(qd.recall, "load_or_capture", lambda *a, **kw: cap)
  rows, summaries, notes = qd.run("synthetic", n=300, steps=6, text="docs", layers=[], sinks=8, window=32,
                                  ks=[10, 40], taus=[0.8, 0.9], roar=True, train_queries=64, train_topk=10,
                                  threads=1, cache_dir="", seed=0, name="qd_tiny", out_dir=str(tmp_path),
                                  make_plot=False, log=lambda s: None)
  assert [r["layer"] for r in rows] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, "all", "all"]
  doc = json.loads((tmp_path / "qd_tiny.json").read_text())
  assert doc["meta"]["layers"] == [0, 1, 2, 3, 4] and "rec_roar_lag1" in doc["rows"][0]
  assert "Spearman" in notes and "shared by each KV group" in notes
  assert 0.0 < doc["rows"][0]["rec_group"] <= 1.0 and 0.5 <= doc["rows"][0]["union"] <= 1.0
  assert 0.0 <= summaries["all"]["hit_roar@10"] <= 1.0
  assert "corr@0.8" in (tmp_path / "qd_tiny.md").read_text() and "tau = 0.8" in notes


def test_spearman():
  assert qd.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
  assert qd.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)


def test_group_recovery_against_direct_pooling():
  rng = np.random.default_rng(6)
  group, steps, n_host, d, scale, k = 3, 4, 200, 16, 0.25, 10
  q = _vectors(rng, group * (steps + 2), d, scale=0.7).reshape(group, steps + 2, d)
  host = _vectors(rng, n_host, d)
  out = qd.group_recovery(q, host, scale=scale, ks=[k, 100])
  assert out[f"rec_group@{k}"].shape == (group, steps)
  for t in range(steps):
    w = np.stack([qd.softmax(scale * host @ q[h, t + 2]) for h in range(group)])  # [G, n_host]
    shared = np.argsort(-w.mean(0))[:group * k]
    small = np.argsort(-w.mean(0))[:k]
    meanq = np.argsort(-(host @ q[:, t + 2].mean(0)))[:group * k]
    w2 = np.stack([qd.softmax(scale * host @ q[h, t]) for h in range(group)])
    lag2 = np.argsort(-w2.mean(0))[:group * k]
    own = {int(i) for h in range(group) for i in np.argsort(-w[h])[:k]}
    own_lag2 = sorted({int(i) for h in range(group) for i in np.argsort(-w2[h])[:k]})
    for h in range(group):
      assert out[f"rec_group@{k}"][h, t] == pytest.approx(w[h, shared].sum(), rel=1e-6)
      assert out[f"rec_group_small@{k}"][h, t] == pytest.approx(w[h, small].sum(), rel=1e-6)
      assert out[f"rec_group_meanq@{k}"][h, t] == pytest.approx(w[h, meanq].sum(), rel=1e-6)
      assert out[f"rec_group_lag2@{k}"][h, t] == pytest.approx(w[h, lag2].sum(), rel=1e-6)
      assert out[f"union@{k}"][h, t] == pytest.approx(len(own) / (group * k))
      assert out[f"rec_union@{k}"][h, t] == pytest.approx(w[h, sorted(own)].sum(), rel=1e-6)
      assert out[f"rec_union_lag2@{k}"][h, t] == pytest.approx(w[h, own_lag2].sum(), rel=1e-6)
      assert out[f"rec_union@{k}"][h, t] >= np.sort(w[h])[-k:].sum() - 1e-9  # holds the head's own top-k
      # the shared set of G k rows holds at least the mass of the head's own top-k where it contains it
      if set(np.argsort(-w[h])[:k]) <= set(shared):
        assert out[f"rec_group@{k}"][h, t] >= np.sort(w[h])[-k:].sum() - 1e-9
  # a shared set as large as the host part holds everything
  np.testing.assert_allclose(out["rec_group@100"], 1.0, rtol=1e-9)


def test_group_recovery_of_one_head_groups_is_its_own_topk():
  rng = np.random.default_rng(7)
  q, host, dev, dev_pos, _ = _head(rng)
  own = qd.head_recovery(q, host, dev, dev_pos, n=400, scale=0.25, ks=[20])
  shared = qd.group_recovery(q[None], host, scale=0.25, ks=[20])
  np.testing.assert_allclose(shared["rec_group@20"][0], own["rec_exact@20"], rtol=1e-9)
  np.testing.assert_allclose(shared["rec_group_meanq@20"][0], own["rec_exact@20"], rtol=1e-9)
  np.testing.assert_allclose(shared["rec_group_lag2@20"][0], own["rec_lag2@20"], rtol=1e-9)
  np.testing.assert_allclose(shared["union@20"], 1.0)
  np.testing.assert_allclose(shared["rec_union@20"][0], own["rec_exact@20"], rtol=1e-9)
  np.testing.assert_allclose(shared["rec_union_lag2@20"][0], own["rec_lag2@20"], rtol=1e-9)
