"""Recall@k against scanned fraction for every host index kind.

The paper's Figures 3 and 6: per index kind and search effort, mean recall@k of
decode queries (Q->K) and of keys used as queries (K->K) against the share of
keys scanned. This file holds the data-independent core (`recall_rows`) and a
synthetic-data driver; dumping real post-RoPE queries and keys through
`models/` plugs into the same function (to do: --data smollm2 etc.).

Usage:
  python experiments/recall.py --data=synthetic --n_keys=32768 --out_dir=/tmp/recall
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
from absl import app
from absl import flags

import host_index as hi
from host_index import synthetic

_DATA = flags.DEFINE_string("data", "synthetic", "vector source: synthetic (real models: to do)")
_N = flags.DEFINE_integer("n_keys", 32768, "keys per head")
_D = flags.DEFINE_integer("dim", 128, "head_dim")
_Q = flags.DEFINE_integer("n_queries", 200, "decode queries evaluated")
_M = flags.DEFINE_integer("n_train", 8192, "prefill (training) queries for roar")
_K = flags.DEFINE_integer("k", 100, "recall@k")
_KINDS = flags.DEFINE_list("kinds", ["ivf", "graph", "graph_ip", "roar"], "kinds; graph_ip = graph with metric ip")
_EFS = flags.DEFINE_list("efs", ["100", "150", "200", "300", "500", "800"], "graph/roar ef values")
_NPROBES = flags.DEFINE_list("nprobes", ["4", "8", "16", "32", "64", "128"], "ivf nprobe values")
_OUT = flags.DEFINE_string("out_dir", "experiments/results", "where recall_<data>.{json,md} go")
_SEED = flags.DEFINE_integer("seed", 0, "data seed")


def recall_rows(keys, queries, *, k, kinds, efs, nprobes, train_queries=None, train_topk=None,
                mode="Q->K", label=""):
    """Recall@k and scanned fraction per (kind, effort).

    Args:
        keys: [N, D] float32/float16/bfloat16 keys of one head.
        queries: [Q, D] queries (decode queries for Q->K, keys for K->K).
        k: recall@k.
        kinds: "flat" | "ivf" | "graph" | "graph_ip" | "roar".
        efs: graph/roar candidate-list sizes; nprobes: ivf probes.
        train_queries: [M, D] prefill queries (roar), or train_topk [M, N_q].
        mode, label: copied into the rows.

    Returns:
        List of flat dicts: kind, effort, recall, scanned_frac, build_s, ...
    """
    k32 = np.asarray(keys).astype(np.float32)
    truth = synthetic.exact_topk(np.asarray(queries, np.float32), k32, k)
    rows = []
    for kind in kinds:
        params = {"metric": "ip"} if kind == "graph_ip" else {}
        base = "graph" if kind == "graph_ip" else kind
        train = {}
        if base == "roar":
            train = {"train_topk": train_topk} if train_topk is not None else {
                "train_queries": train_queries}
        t0 = time.perf_counter()
        ix = hi.build_index(keys, kind=base, **train, **params)
        build_s = time.perf_counter() - t0
        efforts = {"flat": [None], "ivf": nprobes}.get(base, efs)
        for ef in efforts:
            if ef is not None and base != "ivf" and ef < k:
                continue
            ids, _, scanned = ix.search(queries, k, ef=ef)
            rows.append({"data": label, "mode": mode, "kind": kind, "n_keys": len(k32), "k": k,
                         "effort": ef if ef is not None else "exact",
                         "recall": round(synthetic.recall(ids, truth), 4),
                         "scanned_frac": round(float(scanned.mean()) / len(k32), 5),
                         "build_s": round(build_s, 2)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv):
    del argv
    if _DATA.value != "synthetic":
        raise app.UsageError(f"--data={_DATA.value}: only 'synthetic' exists so far")
    n, d = _N.value, _D.value
    keys = synthetic.clustered(n, d, seed=_SEED.value)
    decode = synthetic.clustered(_Q.value, d, seed=_SEED.value + 1, shift=0.5, spread=1.5)
    train = synthetic.clustered(_M.value, d, seed=_SEED.value + 2, shift=0.5, spread=1.5)
    kq = keys[np.random.default_rng(_SEED.value).choice(n, _Q.value, replace=False)]
    efs = [int(e) for e in _EFS.value]
    nprobes = [int(e) for e in _NPROBES.value]
    rows = []
    for mode, q in (("Q->K", decode), ("K->K", kq)):
        rows += recall_rows(keys.astype(np.float16), q, k=_K.value, kinds=_KINDS.value, efs=efs,
                            nprobes=nprobes, train_queries=train, mode=mode, label="synthetic")
    os.makedirs(_OUT.value, exist_ok=True)
    stem = os.path.join(_OUT.value, f"recall_{_DATA.value}")
    with open(stem + ".json", "w") as f:
        json.dump({"rows": rows}, f, indent=1)
    cols = list(rows[0])
    with open(stem + ".md", "w") as f:
        f.write("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n")
        f.writelines("| " + " | ".join(str(r[c]) for c in cols) + " |\n" for r in rows)


if __name__ == "__main__":
    app.run(main)
