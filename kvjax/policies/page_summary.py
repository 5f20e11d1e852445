"""What the device keeps about each host page to score it against a query (freekv's selection).

Two kinds, named by freekv's `page_summary` option:

- "minmax" (FreeKV's and Quest's): the per-channel max and min key of each page; a page scores
  the upper bound Σ_d max(q_d·max_d, q_d·min_d) of q·k over its keys. 1/32 of the page's bf16
  K+V at 32-token pages.
- "keys2" / "keys4": every key of the page, quantized per channel to 2 or 4 bits over the range
  of the prompt's host keys (per layer, sequence and KV head; later keys are clipped to it) and
  packed 4 or 2 to a byte (channel planes); a page scores max over its keys of q·k̂. 1/16 or 1/8
  of the bf16 K+V.

Why keys: on RULER niah_single_2 (SmolLM2, 4K; experiments/results/page_scores_smollm2_4k_niah2.md)
the min/max bound left the answer's page out of the top 32 in 5.6% of the cases where a head
put more than 30% of its attention on it (ranked as low as 88 of 97), and freekv then wrote a
partial number; 2-bit keys missed 0.9% of them, 4-bit keys none.

A summary is a tuple: (kmax, kmin), each [B, Hkv, N, D], or (codes [B, Hkv, N, P, D / per_byte],
lo [B, Hkv, D], step [B, Hkv, D]); the functions here take one layer's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import ops
from ops.key_scores import unpack_planes as unpack

SUMMARIES = ("minmax", "keys2", "keys4")


def bits_of(summary: str) -> int:
  """Bits per key channel of a "keys<bits>" summary (0 for "minmax")."""
  return 0 if summary == "minmax" else int(summary[len("keys"):])


def quantize(
    k,  # [..., D] keys
    lo,  # [..., D] f32: the range's low end, broadcast against k
    step,  # [..., D] f32: one code level
    bits: int,
):
  """Codes of `k`, packed 8 // bits to a byte in planes: byte j holds channels j, j + D/per_byte,
  j + 2·D/per_byte, ... at bits 0, bits, 2·bits, ... ([..., D // per_byte] uint8). Planes keep a
  byte's channels apart, so unpacking is one shift and mask per plane, no interleaving."""
  per_byte = 8 // bits
  code = jnp.clip(jnp.round((k.astype(jnp.float32) - lo) / step), 0, 2**bits - 1).astype(jnp.uint8)
  planes = code.reshape(code.shape[:-1] + (per_byte, code.shape[-1] // per_byte))
  shifts = (jnp.arange(per_byte, dtype=jnp.uint8) * bits)[:, None]
  return jnp.sum(planes << shifts, axis=-2, dtype=jnp.uint8)


def key_range(
    keys,  # [B, H, T, D]
    valid,  # [B, 1, T, 1] bool: which keys count
    bits: int,
):
  """(lo, step) [B, H, D] f32 over the valid keys (lo 0, step 1 where none is valid)."""
  k = keys.astype(jnp.float32)
  lo = jnp.min(jnp.where(valid, k, jnp.inf), axis=2)
  hi = jnp.max(jnp.where(valid, k, -jnp.inf), axis=2)
  some = jnp.isfinite(lo)
  lo = jnp.where(some, lo, 0.0)
  step = jnp.where(some, (hi - lo) / (2**bits - 1), 1.0)
  return lo, jnp.maximum(step, 1e-6)  # a constant channel: any code decodes to lo


def minmax_scores(
    q,  # [B, Hq, D] unscaled
    kmax,  # [B, Hkv, N, D]
    kmin,  # [B, Hkv, N, D]
    *,
    scale: float,
):
  """Per query head the bound scale · Σ_d max(q_d·max_d, q_d·min_d): [B, Hkv, G, N] f32."""
  B, Hq, D = q.shape
  H = kmax.shape[1]
  qg = q.astype(jnp.float32).reshape(B, H, Hq // H, D)
  hp = jax.lax.Precision.HIGHEST
  # Σ_d max(q_d·max_d, q_d·min_d) = relu(q)·max + min(q, 0)·min (max_d >= min_d).
  return (jnp.einsum("BHGD,BHND->BHGN", jnp.maximum(qg, 0), kmax.astype(jnp.float32), precision=hp)
          + jnp.einsum("BHGD,BHND->BHGN", jnp.minimum(qg, 0), kmin.astype(jnp.float32), precision=hp)) * scale


def key_scores(
    q,  # [B, Hq, D] unscaled
    codes,  # [B, Hkv, N, P, D // per_byte] uint8
    lo,  # [B, Hkv, D] f32
    step,  # [B, Hkv, D] f32
    *,
    scale: float,
    implementation: str = "xla",
):
  """Per query head max over each page's keys of scale · q·k̂ (k̂ = lo + code · step):
  [B, Hkv, G, N] f32 (ops.key_page_scores: a Pallas kernel or its XLA twin)."""
  bits = 8 * codes.shape[-1] // q.shape[-1]
  return ops.key_page_scores(q, codes, lo, step, bits=bits, scale=scale, implementation=implementation)


def scores(q, summary: tuple, *, scale: float, implementation: str = "xla"):
  """minmax_scores for a (kmax, kmin) summary, key_scores for (codes, lo, step)."""
  if len(summary) == 2:
    return minmax_scores(q, *summary, scale=scale)
  return key_scores(q, *summary, scale=scale, implementation=implementation)


# -- the prompt's summaries (freekv's finish_prefill / offload_layer) ------------------------


def _stored_keys(
    k,  # [B, Hkv, capacity, D]: one layer's dense prefill keys
    host_len,  # [B] int32: store tokens of each sequence
    sinks: int,
    slots: int,  # num_pages * page_size
):
  """The keys in the store's page slots [B, Hkv, slots, D] (zero-padded past the capacity) and
  which hold a stored key [B, 1, slots, 1]."""
  need = sinks + slots
  if need > k.shape[2]:
    k = jnp.pad(k, ((0, 0), (0, 0), (0, need - k.shape[2]), (0, 0)))
  valid = (jnp.arange(slots)[None] < host_len[:, None])[:, None, :, None]
  return k[:, :, sinks:need], valid


@functools.partial(jax.jit, static_argnames=("sinks", "page_size", "num_pages"))
def prompt_minmax(
    k,  # [B, Hkv, capacity, D]: one layer's dense prefill keys
    host_len,  # [B] int32: store tokens of each sequence
    *,
    sinks: int,
    page_size: int,
    num_pages: int,
):
  """Per store page (min, max) of the stored keys: two [B, Hkv, num_pages, D]; (+inf, -inf) for
  empty pages."""
  B, H, _, D = k.shape
  stored, valid = _stored_keys(k, host_len, sinks, num_pages * page_size)
  pages = stored.reshape(B, H, num_pages, page_size, D)
  valid = valid.reshape(B, 1, num_pages, page_size, 1)
  hi = jnp.max(jnp.where(valid, pages, -jnp.inf), axis=3)
  lo = jnp.min(jnp.where(valid, pages, jnp.inf), axis=3)
  some = jnp.any(valid, axis=3)
  # An empty page's (min, max) is (+inf, -inf), so decode folds its first key in by min/max alone.
  return jnp.where(some, lo, jnp.inf).astype(k.dtype), jnp.where(some, hi, -jnp.inf).astype(k.dtype)


@functools.partial(jax.jit, static_argnames=("sinks", "page_size", "num_pages", "bits"))
def prompt_codes(
    k,  # [B, Hkv, capacity, D]: one layer's dense prefill keys
    host_len,  # [B] int32: store tokens of each sequence
    *,
    sinks: int,
    page_size: int,
    num_pages: int,
    bits: int,
):
  """The stored keys quantized over their own per-channel range: (codes [B, Hkv, num_pages,
  page_size, D // (8 // bits)] uint8, lo [B, Hkv, D], step [B, Hkv, D]); empty slots hold code 0."""
  B, H = k.shape[:2]
  stored, valid = _stored_keys(k, host_len, sinks, num_pages * page_size)
  lo, step = key_range(stored, valid, bits)
  codes = jnp.where(valid, quantize(stored, lo[:, :, None], step[:, :, None], bits), 0)
  return codes.reshape(B, H, num_pages, page_size, -1), lo, step
