/* Vector kernels with run-time instruction-set dispatch.
 *
 * hi_kernels_impl.h holds the plain-C bodies; it is compiled here once per
 * target (AVX-512, AVX2+FMA+F16C, baseline x86-64 or whatever the compiler
 * targets elsewhere) and the best variant the CPU supports is picked once, so
 * no -march flag is baked into the build. (GCC's target_clones("arch=...")
 * would not inline the row kernels into the clones, losing the vector code.)
 * No -ffast-math anywhere: it would break the exact half-float conversions
 * and the -inf handling; reductions vectorize through `omp simd` instead. */
#include "hi_kernels.h"

#include <pthread.h>

#define HI_INLINE static inline __attribute__((always_inline))

#define HI_SFX base
#define HI_TARGET
#include "hi_kernels_impl.h"
#undef HI_SFX
#undef HI_TARGET

#if defined(__x86_64__) && defined(__GNUC__) && !defined(HI_NO_DISPATCH)
#define HI_X86 1
#define HI_SFX avx2
#define HI_TARGET __attribute__((target("avx2,fma,f16c")))
#include "hi_kernels_impl.h"
#undef HI_SFX
#undef HI_TARGET
#define HI_SFX avx512
#define HI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
#include "hi_kernels_impl.h"
#undef HI_SFX
#undef HI_TARGET
#endif

typedef struct {
  void (*scores_ids)(const float *, const hi_keys_t *, const int32_t *, int64_t, float *);
  void (*scores_range)(const float *, const hi_keys_t *, int64_t, int64_t, float *);
  void (*l2_ids)(const float *, const hi_keys_t *, const int32_t *, int64_t, float *);
  void (*l2_range)(const float *, const hi_keys_t *, int64_t, int64_t, float *);
  void (*accum_rows)(const float *, const hi_keys_t *, const int64_t *, int64_t, float *);
  void (*convert)(const void *, int, void *, int, int64_t);
  int64_t (*count_bad)(const void *, int, int, int64_t);
  const char *name;
} hi_ktab_t;

#define HI_TABLE(S) \
  {scores_ids_##S, scores_range_##S, l2_ids_##S, l2_range_##S, accum_rows_##S, convert_##S, \
   count_bad_##S, #S}

static hi_ktab_t K = HI_TABLE(base);
static pthread_once_t once = PTHREAD_ONCE_INIT;

static void pick(void) {
#ifdef HI_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
    K = (hi_ktab_t)HI_TABLE(avx512);
  } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    /* Every AVX2+FMA CPU also has F16C (it predates both). */
    K = (hi_ktab_t)HI_TABLE(avx2);
  }
#endif
}

static inline const hi_ktab_t *kt(void) {
  pthread_once(&once, pick);
  return &K;
}

const char *hi_kernels_isa(void) { return kt()->name; }

void hi_scores_ids(const float *q, const hi_keys_t *k, const int32_t *ids, int64_t n, float *o) {
  kt()->scores_ids(q, k, ids, n, o);
}
void hi_scores_range(const float *q, const hi_keys_t *k, int64_t s, int64_t n, float *o) {
  kt()->scores_range(q, k, s, n, o);
}
void hi_l2_ids(const float *x, const hi_keys_t *k, const int32_t *ids, int64_t n, float *o) {
  kt()->l2_ids(x, k, ids, n, o);
}
void hi_l2_range(const float *x, const hi_keys_t *k, int64_t s, int64_t n, float *o) {
  kt()->l2_range(x, k, s, n, o);
}
void hi_accum_rows(const float *w, const hi_keys_t *v, const int64_t *ids, int64_t n, float *a) {
  kt()->accum_rows(w, v, ids, n, a);
}
void hi_convert(const void *src, int sdt, void *dst, int ddt, int64_t n) {
  kt()->convert(src, sdt, dst, ddt, n);
}
int64_t hi_count_bad(const void *src, int sdt, int ddt, int64_t n) {
  return kt()->count_bad(src, sdt, ddt, n);
}
