"""Page scores from quantized keys: per query head, max over each page's keys of q·k̂.

Keys are codes of `bits` bits per channel, k̂ = lo + code · step, packed 8 / bits to a byte in
channel planes (byte j holds channels j, j + D/per_byte, ... at bits 0, bits, ...; the layout
of kvjax.policies.page_summary). Since q·k̂ = q·lo + Σ_d (q_d step_d) code_d, the kernel only
takes the dot of the levels with q·step, plane by plane, and the max over the page: it reads
the packed codes once (1/8 or 1/16 of bf16 keys) and never writes unpacked levels to memory,
which the XLA twin does (f32 levels: 4 bytes per channel and key).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ops.partial_attention import _pad_groups

# Code bytes per program (rows * Dc): 8 KiB was the fastest of 4-64 KiB with 2-8 warps on the
# H200 (experiments/results/bench_key_scores_sweep_8b_128k.md). One page must fit in 16 KiB,
# which bounds the unpacked tile's registers.
_BLOCK_BYTES = 8192
_MAX_PAGE_BYTES = 16384
_MIN_DOT_K = 16  # Triton's dot needs K >= 16: the bytes per key (D * bits / 8)


def _kernel(
    qs_hi_ref,  # [Gp, D] bf16: q · step rounded (pad rows zero)
    qs_lo_ref,  # [Gp, D] bf16: q · step - qs_hi, rounded
    codes_ref,  # [B, Hkv, N * P, Dc] uint8: every page's keys as rows (the whole array)
    out_ref,  # [B, Hkv, Gp, N] f32 (the whole array)
    *,
    bits: int,
    page_size: int,
    pages_per_block: int,
):
  b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  num_pages = out_ref.shape[-1]
  dc = codes_ref.shape[-1]
  gp = qs_hi_ref.shape[0]
  rows = pages_per_block * page_size
  # The last block is shifted back inside the buffer (no padded copy of the codes, no masked
  # loads); the pages it shares with the block before are written twice with equal values.
  first = jnp.minimum(j * pages_per_block, num_pages - pages_per_block)
  codes = codes_ref[b, h, pl.ds(first * page_size, rows), :]  # [R, Dc]
  acc = jnp.zeros((gp, rows), jnp.float32)
  dims = (((1,), (1,)), ((), ()))
  for plane in range(8 // bits):
    # Levels (< 256) are exact in bf16 and q·step is split into two bf16 terms, so two
    # tensor-core dots with f32 accumulation give the f32 product to ~2^-16.
    levels = ((codes >> jnp.uint8(plane * bits)) & jnp.uint8(2**bits - 1)).astype(jnp.bfloat16)  # [R, Dc]
    for qs_ref in (qs_hi_ref, qs_lo_ref):
      q_plane = qs_ref[:, pl.ds(plane * dc, dc)]  # [Gp, Dc]
      acc += lax.dot_general(q_plane, levels, dims, preferred_element_type=jnp.float32)
  # 2-D tiles and a max over the minor axis: the forms Triton lowers.
  out_ref[b, h, :, pl.ds(first, pages_per_block)] = jnp.max(acc.reshape(gp, pages_per_block, page_size), axis=-1)


def pallas_supported(page_size: int, head_dim: int, bits: int) -> bool:
  """Whether the kernel compiles for a GPU: power-of-two pages and byte rows of >= 16 bytes."""
  dc = head_dim * bits // 8
  pow2 = lambda n: pl.next_power_of_2(n) == n
  return pow2(page_size) and pow2(dc) and dc >= _MIN_DOT_K and page_size * dc <= _MAX_PAGE_BYTES


@functools.partial(jax.jit, static_argnames=("bits", "interpret", "block_bytes", "num_warps"))
def _key_scores_pallas(qs, codes, *, bits: int, interpret: bool, block_bytes: int | None, num_warps: int | None):
  """qs [B, Hkv, G, D] f32, codes [B, Hkv, N, P, Dc] -> Σ_d qs_d · level_d maxed per page [B, Hkv, G, N]."""
  B, H, G, D = qs.shape
  N, P, Dc = codes.shape[2:]
  if N == 0:
    return jnp.zeros((B, H, G, 0), jnp.float32)
  gp = _pad_groups(G)
  # Pages per program: a power of two, at most block_bytes of codes (at least one page) and at
  # most N (the shifted last block must fit in the buffer).
  nb = 1 << (max(1, min((block_bytes or _BLOCK_BYTES) // (P * Dc), N)).bit_length() - 1)
  if gp != G:
    qs = jnp.pad(qs, ((0, 0), (0, 0), (0, gp - G), (0, 0)))
  qs_hi, qs_lo = split_bf16(qs)
  out = pl.pallas_call(
      functools.partial(_kernel, bits=bits, page_size=P, pages_per_block=nb),
      grid=(B, H, pl.cdiv(N, nb)),
      in_specs=[pl.BlockSpec((None, None, gp, D), lambda b, h, j: (b, h, 0, 0)),
                pl.BlockSpec((None, None, gp, D), lambda b, h, j: (b, h, 0, 0)),
                pl.no_block_spec],
      out_specs=pl.no_block_spec,
      out_shape=jax.ShapeDtypeStruct((B, H, gp, N), jnp.float32),
      interpret=interpret,
      compiler_params=None if interpret else plgpu.CompilerParams(num_warps=num_warps or 4),
      name=f"kvjax_key_scores_b{bits}_p{P}",
  )(qs_hi, qs_lo, codes.reshape(B, H, N * P, Dc))  # pages' keys as rows: a free reshape
  return out[:, :, :G]


def split_bf16(x):
  """x f32 -> (hi, lo) bf16 with hi + lo = x to ~2^-16 relative.

  hi is x with its low 16 bits cleared (exact in bf16), so x - hi is exact in f32. Rounding
  through `x.astype(bf16).astype(f32)` instead would not survive XLA's excess-precision
  simplification, which drops that round trip on GPUs: lo came out zero and the scores lost
  q·step's low bits (errors of ~2e-4 relative, up to 6e-3 absolute on scores
  near 4, on the H200)."""
  bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
  hi = lax.bitcast_convert_type(bits & jnp.uint32(0xFFFF0000), jnp.float32)
  return hi.astype(jnp.bfloat16), (x - hi).astype(jnp.bfloat16)


def _check(q, codes, lo, step, bits: int, implementation: str) -> None:
  if implementation not in ("pallas", "xla"):
    raise ValueError(f"implementation={implementation!r}; expected pallas or xla")
  if bits not in (1, 2, 4, 8):
    raise ValueError(f"bits={bits!r}; expected 1, 2, 4 or 8")
  if q.ndim != 3 or codes.ndim != 5 or lo.shape != codes.shape[:2] + q.shape[-1:] or step.shape != lo.shape:
    raise ValueError(f"shapes q {q.shape}, codes {codes.shape}, lo {lo.shape}, step {step.shape}: expected "
                     "[B, Hq, D], [B, Hkv, N, P, D * bits / 8], [B, Hkv, D], [B, Hkv, D]")
  if q.shape[0] != codes.shape[0]:
    raise ValueError(f"q batch {q.shape[0]} (q.shape={tuple(q.shape)}) must equal codes batch {codes.shape[0]}")
  if codes.dtype != jnp.uint8:
    raise TypeError(f"codes.dtype={codes.dtype} must be uint8")
  for name, x in (("q", q), ("lo", lo), ("step", step)):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"{name}.dtype={x.dtype} must be a float dtype")
  if codes.shape[-1] * (8 // bits) != q.shape[-1] or q.shape[1] % codes.shape[1]:
    raise ValueError(f"codes {codes.shape} do not hold {bits}-bit channels of head_dim {q.shape[-1]}, or q "
                     f"heads {q.shape[1]} are not a multiple of KV heads {codes.shape[1]}")


def key_page_scores(
    q: jax.Array,  # [B, Hq, D] unscaled
    codes: jax.Array,  # [B, Hkv, N, P, D * bits / 8] uint8, channel planes
    lo: jax.Array,  # [B, Hkv, D] f32
    step: jax.Array,  # [B, Hkv, D] f32
    *,
    bits: int,
    scale: float,
    implementation: str = "pallas",
    interpret: bool = False,
    block_bytes: int | None = None,
    num_warps: int | None = None,
) -> jax.Array:
  """scale · max over each page's keys of q·k̂, per query head: [B, Hkv, G, N] float32.

  implementation "pallas" (the kernel above; interpret=True on a CPU) or "xla" (the float32
  reference, unpacking every level). block_bytes (code bytes per program, rounded down to a
  power-of-two number of pages) and num_warps tune the kernel (defaults: 8 KiB, 4).
  """
  _check(q, codes, lo, step, bits, implementation)
  B, Hq, D = q.shape
  if implementation == "pallas" and not interpret and not pallas_supported(codes.shape[3], D, bits):
    raise ValueError(f"the Pallas kernel needs power-of-two pages (page_size={codes.shape[3]}) and >= "
                     f"{_MIN_DOT_K} power-of-two bytes per key (head_dim {D} at {bits} bits); use implementation='xla'")
  H = codes.shape[1]
  qg = q.astype(jnp.float32).reshape(B, H, Hq // H, D)
  offset = jnp.einsum("BHGD,BHD->BHG", qg, lo, precision=lax.Precision.HIGHEST)
  qs = qg * step[:, :, None]
  if implementation == "xla":
    per_key = jnp.einsum("BHGD,BHNPD->BHGNP", qs, unpack_planes(codes, bits), precision=lax.Precision.HIGHEST)
    raw = jnp.max(per_key, axis=-1)
  else:
    raw = _key_scores_pallas(qs, codes, bits=bits, interpret=interpret, block_bytes=block_bytes, num_warps=num_warps)
  return (raw + offset[..., None]) * scale


def key_page_scores_reference(q, codes, lo, step, *, bits: int, scale: float, **unused) -> jax.Array:
  """The float32 XLA twin of `key_page_scores`."""
  del unused
  return key_page_scores(q, codes, lo, step, bits=bits, scale=scale, implementation="xla")


def unpack_planes(
    codes,  # [..., D // per_byte] uint8, channel planes
    bits: int,
):
  """The codes as f32 levels [..., D]."""
  mask = jnp.uint8(2**bits - 1)
  planes = [(codes >> jnp.uint8(i * bits)) & mask for i in range(8 // bits)]
  return jnp.concatenate(planes, axis=-1).astype(jnp.float32)
