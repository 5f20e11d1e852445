/* Vector kernels: dot products, squared L2, conversions, weighted row sums.
 * Each is compiled several times (AVX-512, AVX2+FMA+F16C, baseline) and the
 * best one the CPU supports is picked on first use, so no -march flag is
 * baked into the build. */
#ifndef HI_KERNELS_H
#define HI_KERNELS_H

#include "hi_common.h"

/* out[i] = q . keys[ids[i]] for i < n. */
void hi_scores_ids(const float *q, const hi_keys_t *keys, const int32_t *ids, int64_t n,
                   float *out);
/* out[i] = q . keys[start + i] for i < n. */
void hi_scores_range(const float *q, const hi_keys_t *keys, int64_t start, int64_t n,
                     float *out);
/* out[i] = |x - keys[ids[i]]|^2 for i < n. */
void hi_l2_ids(const float *x, const hi_keys_t *keys, const int32_t *ids, int64_t n,
               float *out);
/* out[i] = |x - keys[start + i]|^2 for i < n. */
void hi_l2_range(const float *x, const hi_keys_t *keys, int64_t start, int64_t n,
                 float *out);
/* acc[:] += sum_i w[i] * vals[ids[i]][:]. */
void hi_accum_rows(const float *w, const hi_keys_t *vals, const int64_t *ids, int64_t n,
                   float *acc);
/* dst[i] = convert(src[i]) for i < n, between any two float hi_dtype; raw16 only to raw16
 * (a copy: callers check). */
void hi_convert(const void *src, int src_dtype, void *dst, int dst_dtype, int64_t n);
/* Number of src elements that are NaN/inf or become inf in dst_dtype; raw16 to raw16: 0,
 * raw16 to or from anything else: n. */
int64_t hi_count_bad(const void *src, int src_dtype, int dst_dtype, int64_t n);

/* Name of the instruction set in use: "avx512", "avx2" or "base". */
const char *hi_kernels_isa(void);

#endif
