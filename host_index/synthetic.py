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
