"""Benchmark of host_index on the host CPU: one layer's search + attention, and index builds.

Measures, for one layer of Llama-3-8B shapes (32 query heads, 8 KV heads,
head_dim 128, N keys per KV head, float16 store):
  * HostContext.attend time per layer (all 32 query heads in one threaded C
    call: search, gather, softmax, output) for top-100 and top-2000, with the
    recall@k against exact search and the scanned fraction;
  * build time per head at 32K and 128K keys, split into phases.

Vectors are SYNTHETIC (labelled so in every row): keys are Gaussian clusters in
a low-dimensional subspace plus noise and a few large-magnitude channels;
decode queries are drawn out of distribution (another mixture, mean and scale),
as real queries are to keys. Times are meaningful; recall and scan fractions on
synthetic vectors say nothing about real models (see experiments/recall.py).

To keep the run short, `roar` builds one index per KV head from the pooled
training queries of its 4 query heads and the context shares it across the
group; the search cost per query head is unchanged.

Usage:
  python experiments/bench_host.py --out_dir experiments/results
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import numpy as np

import host_index as hi
from host_index import _core
import results_io


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n_keys", type=int, default=131072, help="keys per KV head (layer bench)")
    p.add_argument("--build_sizes", default="32768,131072", help="keys per head for build rows")
    p.add_argument("--q_heads", type=int, default=32)
    p.add_argument("--kv_heads", type=int, default=8)
    p.add_argument("--head_dim", type=int, default=128)
    p.add_argument("--dtype", default="float16")
    p.add_argument("--kinds", default="flat,ivf,graph,roar")
    p.add_argument("--topk", default="100,2000")
    p.add_argument("--ef_100", default="100,200,400",
                   help="ef values for top-100 (graph, roar; ivf probes nlist / 64, / 32 and / 16)")
    p.add_argument("--steps", type=int, default=20, help="decode steps timed per config")
    p.add_argument("--train_frac", type=float, default=0.25,
                   help="training (prefill) queries per head, as a fraction of n_keys")
    p.add_argument("--threads", type=int, default=0, help="OpenMP threads (0: all)")
    p.add_argument("--out_dir", default="experiments/results")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time_limit", type=float, default=240.0,
                   help="seconds after which remaining layer configs are skipped")
    return p.parse_args(argv)


# -- synthetic vectors ---------------------------------------------------------

def synth_keys(n, d, rng, *, latent=24, clusters=128):
    """[n, d] float32 keys: clustered, low intrinsic dimension, a few outlier channels."""
    basis = rng.standard_normal((latent, d)) / np.sqrt(latent)
    centers = rng.standard_normal((clusters, latent)) * 2.0
    z = centers[rng.integers(0, clusters, n)] + 0.7 * rng.standard_normal((n, latent))
    x = z @ basis + 0.1 * rng.standard_normal((n, d))
    x[:, :4] += 4.0  # large-magnitude channels, as in real keys
    return x.astype(np.float32), basis, centers


def synth_queries(m, d, rng, basis, centers):
    """[m, d] float32 queries out of distribution of the keys: other mixture,
    mean and scale, but in the keys' subspace so inner products are peaked."""
    latent = basis.shape[0]
    mix = rng.standard_normal((centers.shape[0], latent)) * 0.5 + centers * 1.5
    z = mix[rng.integers(0, len(mix), m)] + 0.9 * rng.standard_normal((m, latent))
    q = z @ basis * 1.5 + 0.2 * rng.standard_normal((m, d)) - 1.0
    return q.astype(np.float32)


def exact_topk(q, keys, k, *, chunk=2048):
    """[m, k] ids of the largest q.k, best first (GPU via JAX when present)."""
    try:
        import jax
        if jax.default_backend() == "gpu":
            kd = jax.device_put(keys)
            f = jax.jit(lambda a, b: jax.lax.top_k(a @ b.T, k)[1])
            return np.concatenate([np.asarray(f(q[i:i + chunk], kd))
                                   for i in range(0, len(q), chunk)])
    except ImportError:
        pass
    out = []
    for i in range(0, len(q), chunk):
        s = q[i:i + chunk] @ keys.T
        part = np.argpartition(-s, k - 1, axis=1)[:, :k]
        order = np.argsort(-np.take_along_axis(s, part, 1), axis=1, kind="stable")
        out.append(np.take_along_axis(part, order, 1))
    return np.concatenate(out)


# -- benchmarks ------------------------------------------------------------------

def bench_builds(args, rng, rows):
    d = args.head_dim
    for n in [int(x) for x in args.build_sizes.split(",")]:
        keys, basis, centers = synth_keys(n, d, rng)
        kh = keys.astype(np.float16).astype(np.float32)
        tq = synth_queries(int(n * args.train_frac), d, rng, basis, centers)
        t0 = time.perf_counter()
        topk = exact_topk(tq, kh, hi.DEFAULT_PARAMS["roar"]["n_q"])
        t_topk = time.perf_counter() - t0
        for kind in ("ivf", "graph", "roar"):
            extra = {"train_topk": topk} if kind == "roar" else {}
            t0 = time.perf_counter()
            ix = hi.build_index(keys.astype(np.float16), kind=kind, threads=args.threads or None,
                                **extra)
            total = time.perf_counter() - t0
            st = ix.stats()
            row = {"bench": "build", "data": "synthetic", "kind": kind, "n_keys": n,
                   "build_s": round(total, 3), "index_MB": round(ix.nbytes / 2**20, 1),
                   "dist_build": st["dist_build"]}
            for ph in ("t_kmeans", "t_assign", "t_project", "t_connect", "t_repair"):
                if st[ph]:
                    row[ph.replace("t_", "s_")] = round(st[ph], 3)
            if kind == "roar":
                row["train_queries"] = len(tq)
                row["s_train_topk_outside"] = round(t_topk, 3)
                row["pivots"] = st["projected_pivots"]
            row["repaired_nodes"] = st["unreachable_fixed"]
            rows.append(row)
            print(json.dumps(row), flush=True)


def bench_layer(args, rng, rows):
    Hq, Hkv, d, n = args.q_heads, args.kv_heads, args.head_dim, args.n_keys
    G = Hq // Hkv
    keys, queries, topks = [], [], []
    for h in range(Hkv):
        k, basis, centers = synth_keys(n, d, rng)
        keys.append(k)
        # decode queries of the group's 4 query heads, [steps + 2, G, d]
        queries.append(synth_queries((args.steps + 2) * G, d, rng, basis, centers)
                       .reshape(args.steps + 2, G, d))
        tq = synth_queries(int(n * args.train_frac), d, rng, basis, centers)
        topks.append(exact_topk(tq, k.astype(np.float16).astype(np.float32),
                                hi.DEFAULT_PARAMS["roar"]["n_q"]))
    K = np.stack(keys)  # [Hkv, n, d]
    V = rng.standard_normal(K.shape).astype(np.float32)
    Q = np.concatenate(queries, axis=1)  # [steps + 2, Hq, d], q head h -> kv head h // G
    Kh = stored_keys(K, args.dtype)  # the truth ranks the keys as the store holds them
    ks = [int(x) for x in args.topk.split(",")]
    # Exact top-k sets per (step, q head), computed once for every config.
    truth = {k: [[set(np.argpartition(-(Kh[h // G] @ Q[s, h]), k - 1)[:k].tolist())
                  for h in range(Hq)] for s in range(len(Q))] for k in ks}
    deadline = time.monotonic() + args.time_limit
    for kind in args.kinds.split(","):
        ctx = hi.HostContext(1, 1, Hq, Hkv, d, dtype=args.dtype, kind=kind)
        ctx.append(0, 0, 0, K, V)
        t0 = time.perf_counter()
        if kind == "roar":
            # One build per KV head (pooled training queries), shared by its group.
            shared = []
            for h in range(Hkv):
                ix = ctx.index(0, 0, h * G)
                ix.build(n, train_topk=topks[h], threads=args.threads or None)
                shared += [ix] * G
            ctx._ix[0][0] = tuple(shared)
        else:
            ctx.build_layer(0, threads=args.threads or None)
        build_s = time.perf_counter() - t0
        for k in ks:
            if kind == "flat":
                efs = [None]
            elif k == 100:
                efs = [int(x) for x in args.ef_100.split(",")]
                if kind == "ivf":
                    nlist = ctx.index(0, 0, 0)._c.nlist
                    efs = [max(1, nlist // 64), max(1, nlist // 32), max(1, nlist // 16)]
            else:
                efs = [None] if kind == "ivf" else [k, 2 * k]
            for ef in efs:
                if time.monotonic() > deadline:
                    print(f"time limit: skipping {kind} k={k} ef={ef}", flush=True)
                    continue
                steps = 3 if kind == "flat" else args.steps
                times, recs, scans = [], [], []
                for s in range(steps + 2):
                    q = Q[s % len(Q)][None]
                    t0 = time.perf_counter()
                    o, lse, scanned, ids = ctx.attend(0, q, k=k, ef=ef, return_ids=True,
                                                      threads=args.threads or None)
                    dt = time.perf_counter() - t0
                    if s < 2:
                        continue  # warm-up
                    times.append(dt)
                    scans.append(scanned.mean() / n)
                    for h in range(Hq):
                        got = truth[k][s % len(Q)][h]
                        recs.append(len(got.intersection(ids[0, h].tolist())) / k)
                row = {"bench": "layer_attend", "data": "synthetic", "kind": kind, "n_keys": n,
                       "q_heads": Hq, "kv_heads": Hkv, "head_dim": d, "dtype": args.dtype,
                       "k": k, "ef": ef if ef is not None else "default",
                       "ms_median": round(1e3 * float(np.median(times)), 3),
                       "ms_p90": round(1e3 * float(np.percentile(times, 90)), 3),
                       "recall": round(float(np.mean(recs)), 4),
                       "scanned_frac": round(float(np.mean(scans)), 5),
                       "layer_build_s": round(build_s, 2), "steps": steps}
                rows.append(row)
                print(json.dumps(row), flush=True)


def stored_keys(keys, dtype: str):
    """keys [Hkv, n, d] float32 as a store of `dtype` holds them, read back as float32."""
    store = hi.HostContext(1, 1, keys.shape[0], keys.shape[0], keys.shape[2], dtype=dtype, kind="flat").store
    store.append(0, 0, 0, keys, keys)
    ids = np.arange(keys.shape[1])
    return np.stack([store.to_float32(store.gather_rows(0, 0, h, ids)[0]) for h in range(keys.shape[0])])


def environment(args, *, with_jax: bool):
    """The stamp; the JAX version and accelerator only `with_jax` (after the timing: JAX's
    device query starts threads of its own)."""
    commit = results_io.commit()  # KVJAX_COMMIT where given (the GPU machine's .git is stale)
    jax_version, device = None, f"{os.cpu_count()} host cores"
    if with_jax:
        try:
            import jax
            jax_version = jax.__version__
            device += f"; accelerator {jax.devices()[0].device_kind}"
        except Exception:  # noqa: BLE001 - the bench runs without JAX too
            pass
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"device": f"{cpu}; {device}; kernels {_core.isa()}; "
                      f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}",
            "jax": jax_version, "commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join([os.path.basename(sys.executable)] + sys.argv)}


def to_markdown(doc) -> str:
    lines = [f"# bench_host ({doc['date'] or 'partial run'})", "",
             f"device: {doc['device']}  ", f"commit: {doc['commit']}  ",
             f"command: `{doc['command']}`", "",
             "Vectors are synthetic (out-of-distribution queries): times are meaningful, "
             "recall/scan are not evidence about real models.", ""]
    for bench in ("layer_attend", "build"):
        rows = [r for r in doc["rows"] if r["bench"] == bench]
        if not rows:
            continue
        cols = []
        for r in rows:
            cols += [c for c in r if c not in cols and c not in ("bench", "data")]
        lines += [f"## {bench}", "", "| " + " | ".join(cols) + " |",
                  "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    rng = np.random.default_rng(args.seed)
    os.makedirs(args.out_dir, exist_ok=True)
    doc = environment(args, with_jax=False)  # stamped from the start: a run cut short keeps its stamp
    rows = Rows(lambda: write(args.out_dir, doc))
    doc["rows"] = rows
    bench_builds(args, rng, rows)
    bench_layer(args, rng, rows)
    doc.update(environment(args, with_jax=True))
    print(json.dumps({k: v for k, v in doc.items() if k != "rows"}), flush=True)
    write(args.out_dir, doc)


class Rows(list):
    """A list of result rows that saves the results file on every append, so a
    run cut short keeps what it measured."""

    def __init__(self, on_append):
        super().__init__()
        self._on_append = on_append

    def append(self, row):
        super().append(row)
        self._on_append()


def write(out_dir, doc):
    """Both files replaced atomically: a run killed mid-write keeps the previous rows."""
    results_io.write_text_atomic(os.path.join(out_dir, "bench_host.json"), json.dumps(doc, indent=1))
    results_io.write_text_atomic(os.path.join(out_dir, "bench_host.md"), to_markdown(doc))


if __name__ == "__main__":
    main()
