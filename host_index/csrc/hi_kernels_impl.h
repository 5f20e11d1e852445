/* Kernel bodies, included three times by hi_kernels.c: once per instruction
 * set (HI_SFX names the variant, HI_TARGET is its target attribute). Plain C
 * loops; the compiler vectorizes them for each target. */
#define HI_CAT2(a, b) a##_##b
#define HI_CAT(a, b) HI_CAT2(a, b)
#define HI_FN(name) HI_CAT(name, HI_SFX)

/* `omp simd reduction` licenses the compiler to reorder the sum across vector
 * lanes (what -ffast-math would do, but only here), so these loops vectorize
 * while the rest of the core keeps strict IEEE semantics. Rows go four at a
 * time: four independent FMA chains hide the FMA latency of one. */
#ifndef HI_DOT
#define HI_DOT(NAME, T, LOAD)                                                       \
  HI_INLINE void NAME(const float *restrict q, const T *const *r, int nr, int d,    \
                      float *out) {                                                 \
    if (nr == 4) {                                                                  \
      const T *restrict r0 = r[0], *restrict r1 = r[1], *restrict r2 = r[2],        \
                        *restrict r3 = r[3];                                        \
      float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;                                 \
      _Pragma("omp simd reduction(+:s0,s1,s2,s3)")                                  \
      for (int i = 0; i < d; i++) {                                                 \
        s0 += q[i] * LOAD(r0[i]);                                                   \
        s1 += q[i] * LOAD(r1[i]);                                                   \
        s2 += q[i] * LOAD(r2[i]);                                                   \
        s3 += q[i] * LOAD(r3[i]);                                                   \
      }                                                                             \
      out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;                           \
      return;                                                                       \
    }                                                                               \
    for (int j = 0; j < nr; j++) {                                                  \
      const T *restrict k = r[j];                                                   \
      float s = 0.f;                                                                \
      _Pragma("omp simd reduction(+:s)")                                            \
      for (int i = 0; i < d; i++) s += q[i] * LOAD(k[i]);                           \
      out[j] = s;                                                                   \
    }                                                                               \
  }
#define HI_L2(NAME, T, LOAD)                                                        \
  HI_INLINE void NAME(const float *restrict x, const T *const *r, int nr, int d,    \
                      float *out) {                                                 \
    if (nr == 4) {                                                                  \
      const T *restrict r0 = r[0], *restrict r1 = r[1], *restrict r2 = r[2],        \
                        *restrict r3 = r[3];                                        \
      float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;                                 \
      _Pragma("omp simd reduction(+:s0,s1,s2,s3)")                                  \
      for (int i = 0; i < d; i++) {                                                 \
        const float t0 = x[i] - LOAD(r0[i]), t1 = x[i] - LOAD(r1[i]);               \
        const float t2 = x[i] - LOAD(r2[i]), t3 = x[i] - LOAD(r3[i]);               \
        s0 += t0 * t0;                                                              \
        s1 += t1 * t1;                                                              \
        s2 += t2 * t2;                                                              \
        s3 += t3 * t3;                                                              \
      }                                                                             \
      out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;                           \
      return;                                                                       \
    }                                                                               \
    for (int j = 0; j < nr; j++) {                                                  \
      const T *restrict k = r[j];                                                   \
      float s = 0.f;                                                                \
      _Pragma("omp simd reduction(+:s)")                                            \
      for (int i = 0; i < d; i++) {                                                 \
        const float t = x[i] - LOAD(k[i]);                                          \
        s += t * t;                                                                 \
      }                                                                             \
      out[j] = s;                                                                   \
    }                                                                               \
  }
#define HI_ID(v) (v)
#endif

HI_DOT(HI_FN(dot_f32), float, HI_ID)
HI_DOT(HI_FN(dot_f16), uint16_t, hi_f16_to_f32)
HI_DOT(HI_FN(dot_bf16), uint16_t, hi_bf16_to_f32)
HI_L2(HI_FN(l2_f32), float, HI_ID)
HI_L2(HI_FN(l2_f16), uint16_t, hi_f16_to_f32)
HI_L2(HI_FN(l2_bf16), uint16_t, hi_bf16_to_f32)

/* Distances of rows in groups of four, one dtype switch outside the loop.
 * Rows are prefetched a group ahead: graph neighbours are scattered. */
#ifndef HI_ROWS_LOOP
#define HI_ROWS_LOOP(ROWEXPR, FN, T)                                        \
  for (int64_t i = 0; i < n; i += 4) {                                      \
    const int nr = n - i < 4 ? (int)(n - i) : 4;                            \
    for (int64_t j = i + 4; j < i + 8 && j < n; j++) {                      \
      const char *pf = (const char *)(ROWEXPR(j));                          \
      for (size_t b = 0; b < (size_t)d * sizeof(T); b += 64)                \
        __builtin_prefetch(pf + b, 0, 1);                                   \
    }                                                                       \
    const T *r[4];                                                          \
    for (int j = 0; j < nr; j++) r[j] = (const T *)(ROWEXPR(i + j));        \
    FN(x, r, nr, d, out + i);                                               \
  }

#define HI_DISPATCH(ROWEXPR, F32FN, F16FN, BF16FN)                  \
  const int d = keys->dim;                                          \
  switch (keys->dtype) {                                            \
    case HI_F16: HI_ROWS_LOOP(ROWEXPR, F16FN, uint16_t) break;      \
    case HI_BF16: HI_ROWS_LOOP(ROWEXPR, BF16FN, uint16_t) break;    \
    default: HI_ROWS_LOOP(ROWEXPR, F32FN, float) break;             \
  }
#endif

HI_TARGET static void HI_FN(scores_ids)(const float *x, const hi_keys_t *keys, const int32_t *ids,
                             int64_t n, float *out) {
#define ROW(i) hi_row(keys, ids[i])
  HI_DISPATCH(ROW, HI_FN(dot_f32), HI_FN(dot_f16), HI_FN(dot_bf16))
#undef ROW
}

HI_TARGET static void HI_FN(scores_range)(const float *x, const hi_keys_t *keys, int64_t start,
                               int64_t n, float *out) {
#define ROW(i) hi_row(keys, start + (i))
  HI_DISPATCH(ROW, HI_FN(dot_f32), HI_FN(dot_f16), HI_FN(dot_bf16))
#undef ROW
}

HI_TARGET static void HI_FN(l2_ids)(const float *x, const hi_keys_t *keys, const int32_t *ids,
                         int64_t n, float *out) {
#define ROW(i) hi_row(keys, ids[i])
  HI_DISPATCH(ROW, HI_FN(l2_f32), HI_FN(l2_f16), HI_FN(l2_bf16))
#undef ROW
}

HI_TARGET static void HI_FN(l2_range)(const float *x, const hi_keys_t *keys, int64_t start, int64_t n,
                           float *out) {
#define ROW(i) hi_row(keys, start + (i))
  HI_DISPATCH(ROW, HI_FN(l2_f32), HI_FN(l2_f16), HI_FN(l2_bf16))
#undef ROW
}

HI_TARGET static void HI_FN(accum_rows)(const float *w, const hi_keys_t *vals, const int64_t *ids,
                             int64_t n, float *acc) {
  const int d = vals->dim;
  for (int64_t r = 0; r < n; r++) {
    const float wr = w[r];
    const void *row = hi_row(vals, ids[r]);
    switch (vals->dtype) {
      case HI_F16: {
        const uint16_t *v = row;
        for (int j = 0; j < d; j++) acc[j] += wr * hi_f16_to_f32(v[j]);
        break;
      }
      case HI_BF16: {
        const uint16_t *v = row;
        for (int j = 0; j < d; j++) acc[j] += wr * hi_bf16_to_f32(v[j]);
        break;
      }
      default: {
        const float *v = row;
        for (int j = 0; j < d; j++) acc[j] += wr * v[j];
        break;
      }
    }
  }
}

HI_TARGET static void HI_FN(convert)(const void *src, int sdt, void *dst, int ddt, int64_t n) {
  if (sdt == ddt) {
    memcpy(dst, src, (size_t)n * hi_itemsize(sdt));
    return;
  }
  if (ddt == HI_F32) {
    float *o = dst;
    const uint16_t *s = src;
    if (sdt == HI_F16)
      for (int64_t i = 0; i < n; i++) o[i] = hi_f16_to_f32(s[i]);
    else
      for (int64_t i = 0; i < n; i++) o[i] = hi_bf16_to_f32(s[i]);
    return;
  }
  uint16_t *o = dst;
  if (sdt == HI_F32) {
    const float *s = src;
    if (ddt == HI_F16)
      for (int64_t i = 0; i < n; i++) o[i] = hi_f32_to_f16(s[i]);
    else
      for (int64_t i = 0; i < n; i++) o[i] = hi_f32_to_bf16(s[i]);
    return;
  }
  /* half <-> bfloat16 goes through float, which holds both exactly. */
  const uint16_t *s = src;
  if (sdt == HI_F16)
    for (int64_t i = 0; i < n; i++) o[i] = hi_f32_to_bf16(hi_f16_to_f32(s[i]));
  else
    for (int64_t i = 0; i < n; i++) o[i] = hi_f32_to_f16(hi_bf16_to_f32(s[i]));
}

HI_TARGET static int64_t HI_FN(count_bad)(const void *src, int sdt, int ddt, int64_t n) {
  /* raw16 bits are never numbers: none is bad copied as is, all are if asked to convert. */
  if (sdt == HI_RAW16 || ddt == HI_RAW16) return sdt == ddt ? 0 : n;
  int64_t bad = 0;
  for (int64_t i = 0; i < n; i++) {
    const float v = hi_load(src, sdt, i);
    int b = !(fabsf(v) <= 3.40282347e38f); /* NaN or inf */
    /* Finite values can still round to inf in a narrower type. */
    if (ddt == HI_F16) b |= (hi_f32_to_f16(v) & 0x7C00u) == 0x7C00u;
    if (ddt == HI_BF16) b |= (hi_f32_to_bf16(v) & 0x7F80u) == 0x7F80u;
    bad += b;
  }
  return bad;
}
