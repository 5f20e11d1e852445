/* Shared types, error codes and scalar conversions of the host_index C core.
 *
 * Nothing in the C core raises, aborts or touches Python: every function that
 * can fail returns an hi_err code (0 = success) and the binding layer
 * (module.c) turns it into a Python exception after re-acquiring the GIL.
 */
#ifndef HI_COMMON_H
#define HI_COMMON_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* Storage / input element types. The numeric values are part of the Python
 * wrapper's contract (host_index/_dtypes.py). HI_RAW16 is a caller's encoded
 * rows as opaque 16-bit words: only ever copied (to raw16, or gathered), since
 * every routine that reads a number (hi_load, the distance and attention
 * kernels) would misread them, or read 4 bytes per 2-byte element. */
enum hi_dtype { HI_F32 = 0, HI_F16 = 1, HI_BF16 = 2, HI_RAW16 = 3 };

enum hi_err {
  HI_OK = 0,
  HI_ENOMEM = -1,     /* allocation failed */
  HI_EINVAL = -2,     /* argument out of range (ids, sizes) */
  HI_ECONCUR = -3,    /* index larger than the key buffer it was handed:
                         the store was modified concurrently */
  HI_ENONFINITE = -4, /* NaN or inf in a vector */
  HI_EDTYPE = -5,     /* raw16 bits handed to a routine that reads numbers */
};

/* Index kinds; values shared with host_index/_index.py. */
enum hi_kind { HI_FLAT = 0, HI_IVF = 1, HI_GRAPH = 2, HI_ROAR = 3 };

/* Metric used to select (prune) graph neighbours and to navigate while
 * building. Query-time search always maximises the inner product. */
enum hi_metric { HI_L2 = 0, HI_IP = 1 };

/* A read-only view of one head's keys: row i lives at
 * base + i * dim * itemsize. nrows bounds every id the core may touch. room
 * (0 = nrows) is how many rows the buffer has space for: a build sizes its
 * node arrays for them, so the decode-time inserts that fill that space do not
 * grow (copy) the index on their first call. */
typedef struct {
  const void *base;
  int dtype;
  int dim;
  int64_t nrows;
  int64_t room;
} hi_keys_t;

static inline size_t hi_itemsize(int dtype) { return dtype == HI_F32 ? 4 : 2; }

static inline float hi_bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static inline uint32_t hi_f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

/* IEEE half -> float, branch-free so loops over it vectorize (after
 * Maratos' FP16 library, MIT). Handles subnormals, inf and NaN. */
static inline float hi_f16_to_f32(uint16_t h) {
  const uint32_t w = (uint32_t)h << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = hi_bits_f32((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = hi_bits_f32((two_w >> 17) | (126u << 23)) - 0.5f;
  /* A mask, not a ?: select, so GCC vectorizes loops over this function. */
  const uint32_t denorm = 0u - (uint32_t)(two_w < (1u << 27));
  const uint32_t result =
      sign | (hi_f32_bits(denormalized) & denorm) | (hi_f32_bits(normalized) & ~denorm);
  return hi_bits_f32(result);
}

/* float -> IEEE half, round to nearest even; overflow gives inf. Relies on
 * strict IEEE float arithmetic: never compile this file with -ffast-math. */
static inline uint16_t hi_f32_to_f16(float f) {
  float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = hi_f32_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = hi_bits_f32((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = hi_f32_bits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

static inline float hi_bf16_to_f32(uint16_t h) { return hi_bits_f32((uint32_t)h << 16); }

/* float -> bfloat16, round to nearest even, NaN kept quiet. */
static inline uint16_t hi_f32_to_bf16(float f) {
  uint32_t u = hi_f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

/* Load element i of a vector of the given dtype as float. */
static inline float hi_load(const void *p, int dtype, int64_t i) {
  switch (dtype) {
    case HI_F16: return hi_f16_to_f32(((const uint16_t *)p)[i]);
    case HI_BF16: return hi_bf16_to_f32(((const uint16_t *)p)[i]);
    default: return ((const float *)p)[i];
  }
}

static inline const void *hi_row(const hi_keys_t *k, int64_t i) {
  return (const char *)k->base + (size_t)i * (size_t)k->dim * hi_itemsize(k->dtype);
}

/* Resolve a thread-count argument: <= 0 means "OpenMP's default". */
int hi_threads(int requested);

/* splitmix64: tiny seeded PRNG so builds are reproducible without libc rand. */
static inline uint64_t hi_rng_next(uint64_t *s) {
  uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

#endif /* HI_COMMON_H */
