/* Host partial attention and page gathers, threaded over (sequence, head). */
#define _POSIX_C_SOURCE 200809L
#include "hi_attend.h"

#include <stdlib.h>

#include "hi_kernels.h"

int hi_attend(hi_index_t *const *idx, const hi_keys_t *keys, const hi_keys_t *vals, int B,
              int Hq, int Hkv, int per_q, const float *q, int k, int ef, float scale,
              float *o, float *lse, int64_t *scanned, int64_t *ids_out, int threads) {
  const int G = Hq / Hkv;
  const int Hidx = per_q ? Hq : Hkv;
  const int dim = keys[0].dim;
  int err = HI_OK;
#pragma omp parallel num_threads(hi_threads(threads))
  {
    hi_ws_t ws = {0};
    int64_t *ids = malloc((size_t)(k > 0 ? k : 1) * sizeof(int64_t));
    float *sc = malloc((size_t)(k > 0 ? k : 1) * sizeof(float));
    int lerr = ids && sc ? HI_OK : HI_ENOMEM;
    /* One task per (b, h): a search is 10-1000 us, so dynamic scheduling
     * balances uneven search lengths across threads. */
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < (int64_t)B * Hq; t++) {
      if (lerr) continue;
      const int b = (int)(t / Hq), h = (int)(t % Hq), kvh = h / G;
      hi_index_t *ix = idx[(int64_t)b * Hidx + (per_q ? h : kvh)];
      const hi_keys_t *kk = &keys[(int64_t)b * Hkv + kvh];
      const hi_keys_t *vv = &vals[(int64_t)b * Hkv + kvh];
      pthread_rwlock_rdlock(&ix->lock);
      lerr = hi_index_search(ix, kk, q + t * dim, k, ef, ids, sc, &scanned[t], &ws);
      pthread_rwlock_unlock(&ix->lock);
      /* Keys and values come from one snapshot, so this never fires. */
      for (int j = 0; j < k && !lerr; j++)
        if (ids[j] >= vv->nrows) lerr = HI_ECONCUR;
      if (lerr) continue;
      float *ot = o + t * dim;
      memset(ot, 0, (size_t)dim * sizeof(float));
      int nv = 0;
      float mx = -INFINITY;
      while (nv < k && ids[nv] >= 0) {
        sc[nv] *= scale;
        if (sc[nv] > mx) mx = sc[nv];
        nv++;
      }
      if (ids_out) memcpy(ids_out + t * k, ids, (size_t)k * sizeof(int64_t));
      if (nv == 0) {
        lse[t] = -INFINITY;
        continue;
      }
      float l = 0.f;
      for (int j = 0; j < nv; j++) {
        sc[j] = expf(sc[j] - mx);
        l += sc[j];
      }
      hi_accum_rows(sc, vv, ids, nv, ot);
      const float inv = 1.f / l;
      for (int j = 0; j < dim; j++) ot[j] *= inv;
      lse[t] = mx + logf(l);
    }
    if (lerr) {
#pragma omp atomic write
      err = lerr;
    }
    free(ids);
    free(sc);
    hi_ws_free(&ws);
  }
  return err;
}

int hi_gather_pages(const void *k, const void *v, int dtype, int Hkv, int64_t cap,
                    int64_t len, int dim, int page, const int64_t *heads,
                    const int64_t *page_ids, int64_t P, void *out_k, void *out_v,
                    int threads) {
  const size_t row = (size_t)dim * hi_itemsize(dtype);
  for (int64_t p = 0; p < P; p++)
    if (heads[p] < 0 || heads[p] >= Hkv || page_ids[p] < 0 || page_ids[p] * page >= len)
      return HI_EINVAL;
  if (len > cap) return HI_EINVAL;
#pragma omp parallel for schedule(static) num_threads(hi_threads(threads))
  for (int64_t p = 0; p < P; p++) {
    const int64_t start = page_ids[p] * page;
    const int64_t nrow = len - start < page ? len - start : page;
    const size_t src = ((size_t)heads[p] * (size_t)cap + (size_t)start) * row;
    char *dk = (char *)out_k + (size_t)p * page * row;
    char *dv = (char *)out_v + (size_t)p * page * row;
    memcpy(dk, (const char *)k + src, (size_t)nrow * row);
    memcpy(dv, (const char *)v + src, (size_t)nrow * row);
    memset(dk + nrow * row, 0, (size_t)(page - nrow) * row);
    memset(dv + nrow * row, 0, (size_t)(page - nrow) * row);
  }
  return HI_OK;
}
