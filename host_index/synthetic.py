"""Synthetic vectors and exact ground truth for tests, benchmarks and recall curves.

Keys are Gaussian clusters in a low-dimensional subspace plus noise (ANN search
works on them as on real keys); queries are drawn out of distribution (other
mean and spread), as decode queries are to keys. Nothing measured on these
says anything about real models.
"""

from __future__ import annotations

import numpy as np


def clustered(n: int, d: int, *, seed: int = 0, clusters: int = 24, latent: int = 8,
              shift: float = 0.0, spread: float = 1.0) -> np.ndarray:
    """[n, d] float32: Gaussian clusters in a `latent`-dim subspace plus noise.

    The subspace is fixed (seeded separately) so keys and queries share it.
    """
    rng = np.random.default_rng(seed)
    basis = np.random.default_rng(1234).standard_normal((latent, d)) / np.sqrt(latent)
    centers = rng.standard_normal((clusters, latent)) * 2.0
    z = centers[rng.integers(0, clusters, n)] + rng.standard_normal((n, latent)) * 0.6
    x = z @ basis * spread + 0.05 * rng.standard_normal((n, d)) + shift
    return x.astype(np.float32)


def keys_queries(n: int, d: int, q: int, *, seed: int = 0):
    """Keys [n, d] and out-of-distribution queries [q, d], float32."""
    keys = clustered(n, d, seed=seed)
    queries = clustered(q, d, seed=seed + 1, shift=0.5, spread=1.5)
    return keys, queries


def exact_topk(queries: np.ndarray, keys: np.ndarray, k: int) -> np.ndarray:
    """[Q, k] int64 ids of the largest q.k, best first (float64, stable ties)."""
    s = queries.astype(np.float64) @ keys.astype(np.float64).T
    return np.argsort(-s, axis=1, kind="stable")[:, :k]


def recall(ids: np.ndarray, truth: np.ndarray) -> float:
    """Mean |ids ∩ truth| / k over rows; ids [Q, >=k] (-1 ignored), truth [Q, k]."""
    k = truth.shape[1]
    return float(np.mean([len(set(a[a >= 0].tolist()) & set(b.tolist())) / k
                          for a, b in zip(ids, truth)]))


def hub_seeds(train_topk: np.ndarray, n: int, n_hubs: int, *, tail_rows: int = 64, strata: int = 8) -> np.ndarray:
    """[<= n_hubs] int32: roar's hub seeds in NumPy, the reference for hi_graph.c `pick_hubs`
    (the defaults are its rule) and for the hub-seed study (experiments/recall.py `study_hubs`).

    train_topk [m, N_q]: the training rows' exact top lists over n keys, rows and keys in prompt
    order. n_hubs // 2 keys most frequent in the last `tail_rows` rows' lists (0: none), the
    rest shared over `strata` equal key-id strata (the first strata take the remainder; 0: no
    strata), each stratum's most frequent in the last quarter's lists, then any shortfall from
    the last quarter overall. Counts > 0 only, ties by smaller id, no key twice."""
    m = len(train_topk)

    def most_frequent(rows, want, taken, lo=0, hi=n):
        cnt = np.bincount(rows[rows >= 0].ravel(), minlength=n)[:n].astype(np.int64)
        cnt[:lo] = 0
        cnt[hi:] = 0
        cnt[list(taken)] = 0
        return [int(v) for v in np.lexsort((np.arange(n), -cnt))[:want] if cnt[v] > 0]

    hubs = most_frequent(train_topk[max(0, m - tail_rows):], n_hubs // 2, []) if tail_rows else []
    quarter = train_topk[m - max(m // 4, 1):]
    left = n_hubs - len(hubs)
    for j in range(strata):
        hubs += most_frequent(quarter, left // strata + (j < left % strata), hubs, j * n // strata,
                              (j + 1) * n // strata)
    return np.asarray(hubs + most_frequent(quarter, n_hubs - len(hubs), hubs), np.int32)
