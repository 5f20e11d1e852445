"""Benchmark of ops' decode attention (and prefill) against XLA and JAX's bundled Pallas kernel.

Usage (H200):  PYTHONPATH=. python3 experiments/bench_attention.py --out_dir=$OUT [--sweep]

Decode times are GPU device time read from a profiler trace (experiments/gpu_trace.py): the
summed kernel time of one call, mean over calls that cycle through R distinct input buffers
(R chosen so the buffers together exceed the 60 MB L2), so neither the cache nor launch and
dispatch gaps flatter or penalize small sizes; every kernel an implementation launches
(e.g. the split combine) is counted. The copy ceiling is timed the same way.
Effective bandwidth = K+V bytes that must be read / time; the ceiling is a large
device-to-device copy in the same run, (bytes read + written) / time.
Writes bench_attention.json (device, jax, commit, date, command, rows) and
bench_attention.md into --out_dir.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import sys
import time
import traceback
import warnings

import jax
import jax.numpy as jnp
import numpy as np

import gpu_trace
import ops
import results_io

L2_BYTES = 60 * 2**20
Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
DTYPE = jnp.bfloat16


def _median_time(fn, args, reps):
  """Median seconds of fn(*args) over reps (after one warm-up / compile)."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def _copies(nbytes_one):
  """Distinct buffers so that together they exceed L2 (rotation)."""
  return int(min(24, max(2, math.ceil(4 * L2_BYTES / max(nbytes_one, 1)))))


def _time_per_call(op, args, reps):
  """Device seconds per call of op(q, k, v), cycling over the distinct buffers in `args`."""
  arg_sets = list(zip(*args))
  return gpu_trace.device_seconds_per_call(op, arg_sets, calls=max(reps, len(arg_sets)))


def _rand(key, shape, dtype=DTYPE):
  return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def copy_bandwidth(reps):
  """Best (bytes read + written) / time over a few large device-to-device copies."""
  results = {}
  x = _rand(jax.random.PRNGKey(0), (2**20, 1024))  # 2 GiB of bf16
  y = jax.random.normal(jax.random.PRNGKey(1), (2**19, 1024), jnp.float32)  # 2 GiB of f32
  variants = {
      "bf16_negate_2GiB": (jax.jit(lambda x: -x), x),
      "f32_scale_2GiB": (jax.jit(lambda y: y * 1.5), y),
      "bf16_copy_2GiB": (jax.jit(lambda x: jnp.copy(x) + 0), x),
  }
  for name, (fn, arg) in variants.items():
    t = gpu_trace.device_seconds_per_call(fn, [(arg,)], reps)
    results[name] = (2 * arg.nbytes / t, t)
  return results


def decode_rows(seqs, batches, impls, reps, copy_bw, configs=None):
  rows = []
  for batch in batches:
    for seq in seqs:
      kv_bytes = 2 * batch * KV_HEADS * seq * HEAD_DIM * jnp.dtype(DTYPE).itemsize
      n = _copies(kv_bytes)
      keys = jax.random.split(jax.random.PRNGKey(seq + batch), 3 * n)
      qs = [_rand(keys[3 * i], (batch, Q_HEADS, HEAD_DIM)) for i in range(n)]
      ks = [_rand(keys[3 * i + 1], (batch, KV_HEADS, seq, HEAD_DIM)) for i in range(n)]
      vs = [_rand(keys[3 * i + 2], (batch, KV_HEADS, seq, HEAD_DIM)) for i in range(n)]
      lengths = jnp.full((batch,), seq, jnp.int32)
      ref = None
      for impl in impls:
        for cfg in (configs or [{}]) if impl == "pallas" else [{}]:
          name = impl + ("" if not cfg else "[" + ",".join(f"{k}={v}" for k, v in cfg.items()) + "]")
          try:
            if impl in ("pallas", "xla"):
              op = functools.partial(ops.partial_attention, lengths=lengths,
                                     implementation=impl, **cfg)
              op_ = lambda q, k, v, op=op: op(q, k, v)
              args = (qs, ks, vs)
            elif impl == "bundled":
              with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                from jax.experimental.pallas.ops.gpu import decode_attention as da
              # Its native layout is seq-major [B, S, Hkv, D]: give it that.
              ks_t = [jnp.swapaxes(k, 1, 2) for k in ks]
              vs_t = [jnp.swapaxes(v, 1, 2) for v in vs]
              def op_(q, k, v, da=da):
                o, (l, m) = da.gqa(q, k, v, kv_seq_len=lengths, return_residuals=True,
                                   k_splits=max(1, min(16, seq // 128)))
                return o.astype(jnp.float32), m + jnp.log(l)
              args = (qs, ks_t, vs_t)
            t = _time_per_call(op_, args, reps)
            o, lse = op_(qs[0], *(args[1][0], args[2][0]))
            err = None
            if impl == "xla" and ref is None:
              ref = (o, lse)
            if ref is not None:
              err = float(jnp.max(jnp.abs(o - ref[0])))
            bw = kv_bytes / t
            rows.append(dict(kind="decode", impl=name, batch=batch, tokens=seq, copies=n,
                             us=round(t * 1e6, 2), GBps=round(bw / 1e9, 1),
                             pct_copy_bw=round(100 * bw / copy_bw, 1),
                             max_abs_err_vs_xla=err))
          except Exception as e:  # keep the rest of the run
            traceback.print_exc()
            rows.append(dict(kind="decode", impl=name, batch=batch, tokens=seq,
                             error=f"{type(e).__name__}: {str(e)[:300]}"))
          print(rows[-1], flush=True)
      del qs, ks, vs
  for r in rows:
    xla = [x for x in rows if x.get("impl") == "xla" and x["batch"] == r["batch"]
           and x["tokens"] == r["tokens"] and "us" in x]
    if xla and "us" in r:
      r["speedup_vs_xla"] = round(xla[0]["us"] / r["us"], 2)
  return rows


def stacked_rows(seqs, impls, reps, copy_bw, layers=32):
  """Dense `full` pattern: [L,B,Hkv,S,D] cache in a lax.scan carry, traced layer."""
  rows = []
  for seq in seqs:
    batch = 1
    kv_bytes = 2 * batch * KV_HEADS * seq * HEAD_DIM * 2
    keys = jax.random.split(jax.random.PRNGKey(7), 3)
    q = _rand(keys[0], (layers, batch, Q_HEADS, HEAD_DIM))
    k = _rand(keys[1], (layers, batch, KV_HEADS, seq, HEAD_DIM))
    v = _rand(keys[2], (layers, batch, KV_HEADS, seq, HEAD_DIM))
    lengths = jnp.full((batch,), seq, jnp.int32)
    for impl in impls:
      @jax.jit
      def run(q, k, v, impl=impl):
        def step(carry, xs):
          ck, cv = carry
          layer, ql = xs
          o, lse = ops.partial_attention(ql, ck, cv, lengths, layer=layer, implementation=impl)
          return carry, o[0, 0, 0] + lse[0, 0]
        _, out = jax.lax.scan(step, (k, v), (jnp.arange(layers, dtype=jnp.int32), q))
        return out.sum()
      try:
        t = gpu_trace.device_seconds_per_call(run, [(q, k, v)], reps) / layers
        bw = kv_bytes / t
        rows.append(dict(kind="decode_stacked_L32", impl=impl, batch=batch, tokens=seq,
                         us=round(t * 1e6, 2), GBps=round(bw / 1e9, 1),
                         pct_copy_bw=round(100 * bw / copy_bw, 1)))
      except Exception as e:
        traceback.print_exc()
        rows.append(dict(kind="decode_stacked_L32", impl=impl, tokens=seq,
                         error=f"{type(e).__name__}: {str(e)[:300]}"))
      print(rows[-1], flush=True)
    del q, k, v
  return rows


def paged_rows(batches, reps, copy_bw, budget=2048, page=32, slots=256):
  rows = []
  for batch in batches:
    pages = budget // page
    kv_bytes = 2 * batch * KV_HEADS * budget * HEAD_DIM * 2
    pool_bytes = 2 * batch * KV_HEADS * slots * page * HEAD_DIM * 2
    n = _copies(pool_bytes)
    keys = jax.random.split(jax.random.PRNGKey(11), 3 * n + 1)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(np.stack([np.stack([rng.permutation(slots)[:pages] for _ in range(KV_HEADS)])
                                for _ in range(batch)]), jnp.int32)
    counts = jnp.full((batch, KV_HEADS), pages, jnp.int32)
    qs = [_rand(keys[3 * i], (batch, Q_HEADS, HEAD_DIM)) for i in range(n)]
    ks = [_rand(keys[3 * i + 1], (batch, KV_HEADS, slots, page, HEAD_DIM)) for i in range(n)]
    vs = [_rand(keys[3 * i + 2], (batch, KV_HEADS, slots, page, HEAD_DIM)) for i in range(n)]
    for impl in ("pallas", "xla"):
      op = lambda q, k, v, impl=impl: ops.paged_partial_attention(q, k, v, ids, counts,
                                                                  implementation=impl)
      try:
        t = _time_per_call(op, (qs, ks, vs), reps)
        bw = kv_bytes / t
        rows.append(dict(kind="paged", impl=impl, batch=batch, tokens=budget, page_size=page,
                         copies=n, us=round(t * 1e6, 2), GBps=round(bw / 1e9, 1),
                         pct_copy_bw=round(100 * bw / copy_bw, 1)))
      except Exception as e:
        traceback.print_exc()
        rows.append(dict(kind="paged", impl=impl, batch=batch,
                         error=f"{type(e).__name__}: {str(e)[:300]}"))
      print(rows[-1], flush=True)
  return rows


def prefill_rows(reps):
  """Blockwise XLA prefill vs JAX's bundled Pallas flash attention (mha, causal)."""
  rows = []
  batch = 1
  for t_len, seq, offset in ((8192, 8192, 0), (4096, 32768, 28672)):
    keys = jax.random.split(jax.random.PRNGKey(3), 3)
    q = _rand(keys[0], (batch, t_len, Q_HEADS, HEAD_DIM))
    k = _rand(keys[1], (batch, KV_HEADS, seq, HEAD_DIM))
    v = _rand(keys[2], (batch, KV_HEADS, seq, HEAD_DIM))
    pos = (offset + jnp.arange(t_len, dtype=jnp.int32))[None]
    kvl = jnp.array([offset + t_len], jnp.int32)
    # Causal FLOPs actually needed: 4 * D * Hq * (visible pairs).
    pairs = sum(min(offset + i + 1, seq) for i in range(0, t_len, 1))
    flops = 4 * HEAD_DIM * Q_HEADS * pairs * batch
    fn = jax.jit(lambda q, k, v: ops.prefill_attention(q, k, v, pos, kvl))
    rows += _prefill_impl_rows(fn, q, k, v, pos, kvl, flops, t_len, seq, reps)
    if offset == 0:
      try:
        with warnings.catch_warnings():
          warnings.simplefilter("ignore")
          from jax.experimental.pallas.ops.gpu import attention as fa
        g = Q_HEADS // KV_HEADS
        def bundled(q, k, v):
          kr = jnp.repeat(jnp.swapaxes(k, 1, 2), g, axis=2)  # [B, S, Hq, D]
          vr = jnp.repeat(jnp.swapaxes(v, 1, 2), g, axis=2)
          return fa.mha(q, kr, vr, None, sm_scale=HEAD_DIM ** -0.5, causal=True)
        fnb = jax.jit(bundled)
        t = _median_time(fnb, (q, k, v), reps)
        o_ref, _ = fn(q, k, v)
        err = float(jnp.max(jnp.abs(fnb(q, k, v).astype(jnp.float32) - o_ref)))
        rows.append(dict(kind="prefill", impl="bundled_pallas_mha", batch=batch, chunk=t_len,
                         tokens=seq, us=round(t * 1e6, 1), TFLOPs=round(flops / t / 1e12, 1),
                         max_abs_err_vs_xla=err))
      except Exception as e:
        traceback.print_exc()
        rows.append(dict(kind="prefill", impl="bundled_pallas_mha", chunk=t_len, tokens=seq,
                         error=f"{type(e).__name__}: {str(e)[:300]}"))
      print(rows[-1], flush=True)
  # Chunked 128K-style: one 2K chunk at the end of a 128K cache (feasibility).
  t_len, seq = 2048, 131072
  keys = jax.random.split(jax.random.PRNGKey(4), 3)
  q = _rand(keys[0], (1, t_len, Q_HEADS, HEAD_DIM))
  k = _rand(keys[1], (1, KV_HEADS, seq, HEAD_DIM))
  v = _rand(keys[2], (1, KV_HEADS, seq, HEAD_DIM))
  pos = (seq - t_len + jnp.arange(t_len, dtype=jnp.int32))[None]
  kvl = jnp.array([seq], jnp.int32)
  fn = jax.jit(lambda q, k, v: ops.prefill_attention(q, k, v, pos, kvl))
  flops = 4 * HEAD_DIM * Q_HEADS * t_len * seq
  rows += _prefill_impl_rows(fn, q, k, v, pos, kvl, flops, t_len, seq, max(3, reps // 4))
  return rows


def _prefill_impl_rows(fn_xla, q, k, v, pos, kvl, flops, t_len, seq, reps):
  """Rows for the XLA blockwise path and the Pallas kernel on the same inputs."""
  rows, o_ref = [], None
  fn_pallas = jax.jit(lambda q, k, v: ops.prefill_attention(q, k, v, pos, kvl, implementation="pallas"))
  for impl, fn in (("xla_blockwise", fn_xla), ("pallas", fn_pallas)):
    try:
      t = _median_time(fn, (q, k, v), reps)
      o = fn(q, k, v)[0]
      err = None if o_ref is None else float(jnp.max(jnp.abs(o - o_ref)))
      o_ref = o if o_ref is None else o_ref
      rows.append(dict(kind="prefill", impl=impl, batch=q.shape[0], chunk=t_len, tokens=seq,
                       us=round(t * 1e6, 1), TFLOPs=round(flops / t / 1e12, 1), max_abs_err_vs_xla=err))
    except Exception as e:
      traceback.print_exc()
      rows.append(dict(kind="prefill", impl=impl, chunk=t_len, tokens=seq,
                       error=f"{type(e).__name__}: {str(e)[:300]}"))
    print(rows[-1], flush=True)
  return rows


def topk_rows(reps):
  rows = []
  for m, n in ((4096, 32768), (4096, 131072)):
    keys = jax.random.split(jax.random.PRNGKey(5), 2)
    qu = _rand(keys[0], (Q_HEADS, m, HEAD_DIM))
    ke = _rand(keys[1], (KV_HEADS, n, HEAD_DIM))
    fn = jax.jit(lambda a, b: ops.exact_topk(a, b, 100))
    t = _median_time(fn, (qu, ke), max(3, reps // 4))
    rows.append(dict(kind="exact_topk", impl="xla_chunked", queries=m, tokens=n, k=100,
                     q_heads=Q_HEADS, us=round(t * 1e6, 1),
                     extrapolated_128Kx128K_s=round(t * (131072 / m) * (131072 / n), 2)))  # queries and keys
    print(rows[-1], flush=True)
  return rows


def to_markdown(meta, rows):
  lines = ["# bench_attention\n", f"device: {meta['device']}  \njax: {meta['jax']}  \n"
           f"commit: {meta['commit']}  \ndate: {meta['date']}  \ncommand: `{meta['command']}`  \n"
           f"copy bandwidth (read+write): {meta['copy_GBps']} GB/s\n"]
  kinds = []
  for r in rows:
    if r["kind"] not in kinds:
      kinds.append(r["kind"])
  for kind in kinds:
    sub = [r for r in rows if r["kind"] == kind]
    cols = []
    for r in sub:
      for c in r:
        if c not in cols and c != "kind":
          cols.append(c)
    lines.append(f"\n## {kind}\n")
    lines.append("| " + " | ".join(cols) + " |")
    lines.append("|" + "---|" * len(cols))
    for r in sub:
      lines.append("| " + " | ".join("" if r.get(c) is None else str(r.get(c)) for c in cols) + " |")
  return "\n".join(lines) + "\n"


def main():
  # The Pallas Triton backend and the bundled kernels warn on every lowering.
  warnings.filterwarnings("ignore", category=DeprecationWarning)
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out_dir", default="experiments/results")
  parser.add_argument("--reps", type=int, default=30)
  parser.add_argument("--sweep", action="store_true", help="also sweep kernel configs")
  parser.add_argument("--skip", default="", help="comma list of sections to skip")
  args = parser.parse_args()
  skip = set(filter(None, args.skip.split(",")))
  commit = results_io.stamp()["commit"]
  copies = copy_bandwidth(args.reps)
  copy_name = max(copies, key=lambda k: copies[k][0])
  copy_bw = copies[copy_name][0]
  meta = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__, commit=commit,
              date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              command=" ".join(["python3"] + sys.argv), copy_GBps=round(copy_bw / 1e9, 1))
  print(meta, flush=True)
  rows = [dict(kind="copy", impl=name, us=round(t * 1e6, 1), GBps=round(bw / 1e9, 1),
               used_as_ceiling=name == copy_name) for name, (bw, t) in copies.items()]
  def save():
    os.makedirs(args.out_dir, exist_ok=True)
    results_io.write_text_atomic(os.path.join(args.out_dir, "bench_attention.json"),
                                 json.dumps(dict(meta, rows=rows), indent=1))
    results_io.write_text_atomic(os.path.join(args.out_dir, "bench_attention.md"), to_markdown(meta, rows))

  if args.sweep:
    sweep = [(131072, 1, [dict(block_k=bk, num_stages=st, num_splits=ns)
                          for bk in (64, 128) for st in (2, 3) for ns in (32, 64, 128)]),
             (8192, 1, [dict(block_k=64, num_splits=ns) for ns in (8, 16, 32, 64)]),
             (2048, 1, [dict(block_k=bk, num_splits=ns) for bk in (64, 128) for ns in (4, 8, 16)]),
             (2048, 8, [dict(block_k=64, num_splits=ns) for ns in (1, 2, 4, 8)])]
    for seq, batch, configs in sweep:
      rows += [dict(r, kind="sweep") for r in decode_rows([seq], [batch], ["pallas"], 10,
                                                            copy_bw, configs)]
    save()
  if "decode" not in skip:
    rows += decode_rows([640, 2048, 8192, 32768, 131072], [1, 8], ["xla", "pallas", "bundled"],
                        args.reps, copy_bw)
  save()
  if "stacked" not in skip:
    rows += stacked_rows([32768, 131072], ["pallas", "xla"], max(5, args.reps // 3), copy_bw)
  save()
  if "paged" not in skip:
    rows += paged_rows([1, 8], args.reps, copy_bw)
  save()
  if "prefill" not in skip:
    rows += prefill_rows(max(5, args.reps // 3))
  save()
  if "topk" not in skip:
    rows += topk_rows(max(5, args.reps // 3))
  save()
  print(to_markdown(meta, rows))


if __name__ == "__main__":
  main()
