/* IVF: k-means (L2) on the keys, lists in CSR form plus an unsorted tail of
 * keys inserted since the last rebuild; queries probe the nprobe lists whose
 * centroids have the largest inner product (faiss IVF-IP's rule). */
#define _POSIX_C_SOURCE 200809L
#include <stdlib.h>

#include "hi_index.h"
#include "hi_kernels.h"

/* Nearest centroid (L2) of x. */
static int32_t nearest_list(const hi_index_t *ix, const float *x, float *dd) {
  const hi_keys_t c = {ix->centroids, HI_F32, ix->dim, ix->nlist, 0};
  hi_l2_range(x, &c, 0, ix->nlist, dd);
  int32_t b = 0;
  for (int32_t j = 1; j < ix->nlist; j++)
    if (dd[j] < dd[b]) b = j;
  return b;
}

int hi_ivf_rebuild_lists(hi_index_t *ix) {
  int64_t *off = calloc((size_t)ix->nlist + 1, sizeof(int64_t));
  int32_t *ids = malloc((size_t)(ix->n > 0 ? ix->n : 1) * sizeof(int32_t));
  if (!off || !ids) {
    free(off);
    free(ids);
    return HI_ENOMEM;
  }
  for (int64_t i = 0; i < ix->n; i++) off[ix->assign[i] + 1]++;
  for (int j = 0; j < ix->nlist; j++) off[j + 1] += off[j];
  int64_t *pos = calloc((size_t)ix->nlist, sizeof(int64_t));
  if (!pos) {
    free(off);
    free(ids);
    return HI_ENOMEM;
  }
  for (int64_t i = 0; i < ix->n; i++) {
    const int32_t l = ix->assign[i];
    ids[off[l] + pos[l]++] = (int32_t)i;
  }
  free(pos);
  free(ix->list_off);
  free(ix->list_ids);
  ix->list_off = off;
  ix->list_ids = ids;
  ix->n_built = ix->n;
  return HI_OK;
}

int hi_ivf_build(hi_index_t *ix, const hi_keys_t *keys, int64_t n, int threads) {
  const int d = ix->dim;
  int nlist = ix->p.nlist > 0 ? ix->p.nlist : (int)(4.0 * sqrt((double)n) + 0.5);
  if (nlist > n) nlist = (int)n;
  if (nlist < 1) nlist = 1;
  free(ix->centroids);
  ix->centroids = calloc((size_t)nlist * (size_t)d, sizeof(float));
  if (!ix->centroids) return HI_ENOMEM;
  ix->nlist = nlist;
  ix->n = n;
  if (n == 0) return hi_ivf_rebuild_lists(ix);

  /* Training sample: up to 64 keys per list, drawn with a seeded shuffle. */
  double t0 = hi_now();
  const int64_t ntrain = n < (int64_t)nlist * 64 ? n : (int64_t)nlist * 64;
  int32_t *perm = malloc((size_t)n * sizeof(int32_t));
  float *x = malloc((size_t)ntrain * (size_t)d * sizeof(float));
  int32_t *asg = malloc((size_t)ntrain * sizeof(int32_t));
  double *sums = malloc((size_t)nlist * (size_t)d * sizeof(double));
  int64_t *cnt = malloc((size_t)nlist * sizeof(int64_t));
  int err = HI_OK;
  if (!perm || !x || !asg || !sums || !cnt) {
    err = HI_ENOMEM;
    goto done;
  }
  uint64_t rng = ix->p.seed ^ 0x1F0A5EEDull;
  for (int64_t i = 0; i < n; i++) perm[i] = (int32_t)i;
  for (int64_t i = 0; i < ntrain; i++) {
    const int64_t j = i + (int64_t)(hi_rng_next(&rng) % (uint64_t)(n - i));
    const int32_t t = perm[i];
    perm[i] = perm[j];
    perm[j] = t;
  }
  for (int64_t i = 0; i < ntrain; i++)
    hi_convert(hi_row(keys, perm[i]), keys->dtype, x + i * d, HI_F32, d);
  for (int j = 0; j < nlist; j++) memcpy(ix->centroids + (size_t)j * d, x + (size_t)j * d, (size_t)d * sizeof(float));

  /* Lloyd iterations; sums run in a fixed order so results do not depend on
   * the thread count. */
  for (int it = 0; it < ix->p.niter && !err; it++) {
#pragma omp parallel num_threads(hi_threads(threads))
    {
      float *dd = malloc((size_t)nlist * sizeof(float));
      if (!dd) {
#pragma omp atomic write
        err = HI_ENOMEM;
      }
#pragma omp for schedule(static)
      for (int64_t i = 0; i < ntrain; i++) asg[i] = dd ? nearest_list(ix, x + i * d, dd) : 0;
      free(dd);
    }
    if (err) break;
    memset(sums, 0, (size_t)nlist * (size_t)d * sizeof(double));
    memset(cnt, 0, (size_t)nlist * sizeof(int64_t));
    for (int64_t i = 0; i < ntrain; i++) {
      cnt[asg[i]]++;
      for (int t = 0; t < d; t++) sums[(size_t)asg[i] * d + t] += x[i * d + t];
    }
    for (int j = 0; j < nlist; j++)
      if (cnt[j] > 0)
        for (int t = 0; t < d; t++) ix->centroids[(size_t)j * d + t] = (float)(sums[(size_t)j * d + t] / (double)cnt[j]);
    /* Empty list: split the largest one (faiss's rule). */
    for (int j = 0; j < nlist; j++) {
      if (cnt[j] > 0) continue;
      int big = 0;
      for (int t = 1; t < nlist; t++)
        if (cnt[t] > cnt[big]) big = t;
      for (int t = 0; t < d; t++) {
        const float v = ix->centroids[(size_t)big * d + t];
        const float eps = (t % 2 ? 1.f : -1.f) * 1e-3f * (fabsf(v) + 1e-6f);
        ix->centroids[(size_t)j * d + t] = v + eps;
        ix->centroids[(size_t)big * d + t] = v - eps;
      }
      cnt[j] = cnt[big] / 2;
      cnt[big] -= cnt[j];
    }
  }
  ix->stats.t_kmeans = hi_now() - t0;
  if (err) goto done;

  /* Assign every key. */
  t0 = hi_now();
#pragma omp parallel num_threads(hi_threads(threads))
  {
    float *dd = malloc((size_t)nlist * sizeof(float));
    float *row = malloc((size_t)d * sizeof(float));
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; i++) {
      if (!dd || !row) continue;
      hi_convert(hi_row(keys, i), keys->dtype, row, HI_F32, d);
      ix->assign[i] = nearest_list(ix, row, dd);
    }
    if (!dd || !row) {
#pragma omp atomic write
      err = HI_ENOMEM;
    }
    free(dd);
    free(row);
  }
  if (!err) err = hi_ivf_rebuild_lists(ix);
  ix->stats.t_assign = hi_now() - t0;
  ix->stats.built_nodes = n;
  ix->stats.dist_build = (int64_t)ix->p.niter * ntrain * nlist + n * nlist;
done:
  free(perm);
  free(x);
  free(asg);
  free(sums);
  free(cnt);
  return err;
}

int hi_ivf_insert(hi_index_t *ix, const hi_keys_t *keys, int64_t n_total) {
  if (ix->nlist == 0) return HI_EINVAL; /* never built: the Python layer builds first */
  float *dd = malloc((size_t)ix->nlist * sizeof(float));
  float *row = malloc((size_t)ix->dim * sizeof(float));
  int err = dd && row ? HI_OK : HI_ENOMEM;
  for (int64_t i = ix->n; i < n_total && !err; i++) {
    hi_convert(hi_row(keys, i), keys->dtype, row, HI_F32, ix->dim);
    ix->assign[i] = nearest_list(ix, row, dd);
  }
  free(dd);
  free(row);
  if (err) return err;
  ix->n = n_total;
  /* The tail is scanned linearly by every search: fold it into the lists once
   * it grows past an eighth of the index (amortized O(1) per insert). */
  const int64_t tail = ix->n - ix->n_built;
  if (tail > 1024 && tail > ix->n_built / 8) return hi_ivf_rebuild_lists(ix);
  return HI_OK;
}

int hi_ivf_search(const hi_index_t *ix, int64_t n, const hi_keys_t *keys, const float *q, int k,
                  int nprobe, hi_ws_t *ws, int64_t *ntop, int64_t *scanned) {
  enum { CHUNK = 256 };
  const int nlist = ix->nlist;
  if (nprobe <= 0) nprobe = nlist / 8 > 1 ? nlist / 8 : 1;
  if (nprobe > nlist) nprobe = nlist;
  const int64_t top = k > nprobe ? k : nprobe;
  int err = hi_ws_ensure(ws, nlist, top, nlist > CHUNK ? nlist : CHUNK, ix->dim);
  if (err) return err;
  /* Probe the lists with the largest q . centroid. */
  const hi_keys_t cv = {ix->centroids, HI_F32, ix->dim, nlist, 0};
  hi_scores_range(q, &cv, 0, nlist, ws->dist);
  int64_t nc = 0;
  for (int32_t j = 0; j < nlist; j++)
    hi_maxheap_offer(ws->cand, &nc, nprobe, (hi_pair){-ws->dist[j], j});
  uint64_t *probed = ws->visited;
  memset(probed, 0, (size_t)((nlist + 63) >> 6) * sizeof(uint64_t));
  int64_t nt = 0, cnt = nlist;
  for (int64_t c = 0; c < nc; c++) {
    const int32_t l = ws->cand[c].id;
    probed[l >> 6] |= 1ull << (l & 63);
    const int32_t *li = ix->list_ids + ix->list_off[l];
    const int64_t len = ix->list_off[l + 1] - ix->list_off[l];
    for (int64_t s = 0; s < len; s += CHUNK) {
      const int64_t b = len - s < CHUNK ? len - s : CHUNK;
      const int32_t *ids = li + s;
      if (n < ix->n_built) { /* snapshot older than the lists: drop newer ids */
        int64_t m = 0;
        for (int64_t i = 0; i < b; i++)
          if (li[s + i] < n) ws->ids[m++] = li[s + i];
        ids = ws->ids;
        hi_scores_ids(q, keys, ids, m, ws->dist);
        for (int64_t i = 0; i < m; i++) hi_maxheap_offer(ws->top, &nt, k, (hi_pair){-ws->dist[i], ids[i]});
        cnt += m;
        continue;
      }
      hi_scores_ids(q, keys, ids, b, ws->dist);
      for (int64_t i = 0; i < b; i++) hi_maxheap_offer(ws->top, &nt, k, (hi_pair){-ws->dist[i], ids[i]});
      cnt += b;
    }
  }
  /* Tail: keys inserted since the lists were last rebuilt. */
  int64_t m = 0;
  for (int64_t i = ix->n_built; i <= n; i++) {
    if (m == CHUNK || (i == n && m > 0)) {
      hi_scores_ids(q, keys, ws->ids, m, ws->dist);
      for (int64_t j = 0; j < m; j++) hi_maxheap_offer(ws->top, &nt, k, (hi_pair){-ws->dist[j], ws->ids[j]});
      cnt += m;
      m = 0;
    }
    if (i < n) {
      const int32_t l = ix->assign[i];
      if (probed[l >> 6] >> (l & 63) & 1) ws->ids[m++] = (int32_t)i;
    }
  }
  *ntop = nt;
  *scanned = cnt;
  return HI_OK;
}
