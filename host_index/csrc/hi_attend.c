/* Layer-wide work threaded over (sequence, head): host partial attention,
 * searches, inserts, and page gathers. */
#define _POSIX_C_SOURCE 200809L
#include "hi_attend.h"

#include <stdlib.h>

#include "hi_gate.h"
#include "hi_kernels.h"

int hi_team(int requested, int64_t tasks, int64_t work) {
  int64_t t = hi_threads(requested);
  const int64_t by_work = work / HI_MIN_WORK;
  if (t > tasks) t = tasks;
  if (t > by_work) t = by_work;
  return t < 1 ? 1 : (int)t;
}

/* o[:] = softmax(scale * sc[0..nv)) . vals[ids], *lse = log-sum-exp; an
 * empty set gives o = 0, lse = -inf. sc is overwritten. */
static void softmax_rows(float *sc, const int64_t *ids, int nv, const hi_keys_t *vals,
                         float scale, float *o, float *lse) {
  const int dim = vals->dim;
  memset(o, 0, (size_t)dim * sizeof(float));
  if (nv == 0) {
    *lse = -INFINITY;
    return;
  }
  float mx = -INFINITY;
  for (int j = 0; j < nv; j++) {
    sc[j] *= scale;
    if (sc[j] > mx) mx = sc[j];
  }
  float l = 0.f;
  for (int j = 0; j < nv; j++) {
    sc[j] = expf(sc[j] - mx);
    l += sc[j];
  }
  hi_accum_rows(sc, vals, ids, nv, o);
  const float inv = 1.f / l;
  for (int j = 0; j < dim; j++) o[j] *= inv;
  *lse = mx + logf(l);
}

/* Search of task t = b * Hq + h into ids/sc [k], under the index's read lock. */
static int search_task(hi_index_t *const *idx, const hi_keys_t *keys, int Hq, int Hkv,
                       int per_q, const float *q, int k, int ef, int64_t t, int64_t *ids,
                       float *sc, int64_t *scanned, hi_ws_t *ws) {
  const int G = Hq / Hkv, Hidx = per_q ? Hq : Hkv;
  const int64_t b = t / Hq;
  const int h = (int)(t % Hq), kvh = h / G;
  hi_index_t *ix = idx[b * Hidx + (per_q ? h : kvh)];
  pthread_rwlock_rdlock(&ix->lock);
  const int err = hi_index_search(ix, &keys[b * Hkv + kvh], q + t * keys[0].dim, k, ef, ids, sc,
                                  scanned, ws);
  pthread_rwlock_unlock(&ix->lock);
  return err;
}

int hi_attend(hi_index_t *const *idx, const hi_keys_t *keys, const hi_keys_t *vals, int B,
              int Hq, int Hkv, int per_q, const float *q, int k, int ef, float scale,
              float *o, float *lse, int64_t *scanned, int64_t *ids_out, int threads) {
  const int G = Hq / Hkv;
  const int dim = keys[0].dim;
  const int64_t T = (int64_t)B * Hq;
  if (keys[0].dtype == HI_RAW16 || vals[0].dtype == HI_RAW16) return HI_EDTYPE;
  int err = HI_OK;
#pragma omp parallel num_threads(hi_team(threads, T, T * HI_MIN_WORK))
  {
    hi_ws_t ws = {0};
    int64_t *ids = malloc((size_t)(k > 0 ? k : 1) * sizeof(int64_t));
    float *sc = malloc((size_t)(k > 0 ? k : 1) * sizeof(float));
    int lerr = ids && sc ? HI_OK : HI_ENOMEM;
    /* One task per (b, h): a search is 10-1000 us, so dynamic scheduling
     * balances uneven search lengths across threads. */
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < T; t++) {
      if (lerr) continue;
      const hi_keys_t *vv = &vals[(t / Hq) * Hkv + (int)(t % Hq) / G];
      lerr = search_task(idx, keys, Hq, Hkv, per_q, q, k, ef, t, ids, sc, &scanned[t], &ws);
      /* Keys and values come from one snapshot, so this never fires. */
      for (int j = 0; j < k && !lerr; j++)
        if (ids[j] >= vv->nrows) lerr = HI_ECONCUR;
      if (lerr) continue;
      int nv = 0;
      while (nv < k && ids[nv] >= 0) nv++;
      if (ids_out) memcpy(ids_out + t * k, ids, (size_t)k * sizeof(int64_t));
      softmax_rows(sc, ids, nv, vv, scale, o + t * dim, &lse[t]);
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

int hi_search_layer(hi_index_t *const *idx, const hi_keys_t *keys, int B, int Hq, int Hkv,
                    int per_q, const float *q, int k, int ef, const uint8_t *mask,
                    int64_t *ids_out, int64_t *scanned, int threads) {
  const int64_t T = (int64_t)B * Hq;
  int64_t active = 0;
  for (int64_t t = 0; t < T; t++) active += !mask || mask[t];
  int err = HI_OK;
#pragma omp parallel num_threads(hi_team(threads, active, active * HI_MIN_WORK))
  {
    hi_ws_t ws = {0};
    float *sc = malloc((size_t)(k > 0 ? k : 1) * sizeof(float));
    int lerr = sc ? HI_OK : HI_ENOMEM;
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < T; t++) {
      int64_t *ids = ids_out + t * k;
      if (lerr || (mask && !mask[t])) {
        for (int j = 0; j < k; j++) ids[j] = -1;
        scanned[t] = 0;
        continue;
      }
      lerr = search_task(idx, keys, Hq, Hkv, per_q, q, k, ef, t, ids, sc, &scanned[t], &ws);
    }
    if (lerr) {
#pragma omp atomic write
      err = lerr;
    }
    free(sc);
    hi_ws_free(&ws);
  }
  return err;
}

int hi_attend_ids(const hi_keys_t *keys, const hi_keys_t *vals, int B, int Hq, int Hkv,
                  const float *q, const int64_t *ids, int64_t n, float scale, float *o,
                  float *lse, int threads) {
  const int G = Hq / Hkv;
  const int dim = keys[0].dim;
  const int64_t T = (int64_t)B * Hq;
  if (n < 0 || n > INT32_MAX) return HI_EINVAL;
  if (keys[0].dtype == HI_RAW16 || vals[0].dtype == HI_RAW16) return HI_EDTYPE;
  int err = HI_OK;
  /* A task is ~2 n dim flops: small layers run on the calling thread. */
#pragma omp parallel num_threads(hi_team(threads, T, T * n * dim * 2))
  {
    int32_t *id32 = malloc((size_t)(n > 0 ? n : 1) * sizeof(int32_t));
    int64_t *id64 = malloc((size_t)(n > 0 ? n : 1) * sizeof(int64_t));
    float *sc = malloc((size_t)(n > 0 ? n : 1) * sizeof(float));
    int lerr = id32 && id64 && sc ? HI_OK : HI_ENOMEM;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; t++) {
      if (lerr) continue;
      const int64_t kv = (t / Hq) * Hkv + (int)(t % Hq) / G;
      const hi_keys_t *kk = &keys[kv], *vv = &vals[kv];
      /* Keys and values come from one snapshot: the same valid rows. */
      const int64_t nrows = kk->nrows < vv->nrows ? kk->nrows : vv->nrows;
      const int64_t *it = ids + t * n;
      int nv = 0;
      for (int64_t j = 0; j < n; j++)
        if (it[j] >= 0 && it[j] < nrows) {
          id32[nv] = (int32_t)it[j];
          id64[nv++] = it[j];
        }
      hi_scores_ids(q + t * dim, kk, id32, nv, sc);
      softmax_rows(sc, id64, nv, vv, scale, o + t * dim, &lse[t]);
    }
    if (lerr) {
#pragma omp atomic write
      err = lerr;
    }
    free(id32);
    free(id64);
    free(sc);
  }
  return err;
}

int hi_insert_many(hi_index_t *const *idx, const hi_keys_t *keys, const int64_t *n_total,
                   const int64_t *q_start, const float *const *queries, const int64_t *q_rows,
                   int64_t count, int ef, int threads, int yield, int64_t *waited_ns) {
  int err = HI_OK;
  int64_t waited = 0;
  /* A graph insert is 0.1-1 ms: every index is worth a thread. */
#pragma omp parallel for schedule(dynamic, 1) reduction(+ : waited) \
    num_threads(hi_team(threads, count, count * HI_MIN_WORK))
  for (int64_t i = 0; i < count; i++) {
    hi_index_t *ix = idx[i];
    const int64_t nt = n_total[i];
    int e = HI_OK;
    if (yield) waited += hi_gate_pass(); /* holding no lock: see hi_gate.h */
    pthread_rwlock_wrlock(&ix->lock);
    if (ix->n < nt) {
      const float *qq = NULL;
      if (queries[i]) {
        const int64_t qs = q_start[i];
        if (qs < 0 || qs > nt || nt - qs > q_rows[i]) e = HI_EINVAL;
        if (!e && ix->n < qs) e = hi_index_insert(ix, &keys[i], qs, NULL, ef, 1);
        if (!e) qq = queries[i] + (ix->n - qs) * (int64_t)ix->dim;
      }
      if (!e) e = hi_index_insert(ix, &keys[i], nt, qq, ef, 1);
    }
    pthread_rwlock_unlock(&ix->lock);
    if (e) {
#pragma omp atomic write
      err = e;
    }
  }
  if (waited_ns) *waited_ns = waited;
  return err;
}

int hi_gather_pages_multi(const void *const *k, const void *const *v, const int64_t *cap,
                          const int64_t *len, int64_t G, int dtype, int Hkv, int dim, int page,
                          const int64_t *group, const int64_t *heads, const int64_t *page_ids,
                          int64_t P, void *out_k, void *out_v, int threads) {
  const size_t row = (size_t)dim * hi_itemsize(dtype);
  if (page < 1) return HI_EINVAL;
  for (int64_t g = 0; g < G; g++)
    if (len[g] < 0 || len[g] > cap[g]) return HI_EINVAL;
  for (int64_t p = 0; p < P; p++) {
    const int64_t g = group[p];
    /* page id < ceil(len / page), not id * page < len: the product overflows for huge ids */
    if (g < 0 || g >= G || heads[p] < 0 || heads[p] >= Hkv || page_ids[p] < -1 ||
        page_ids[p] >= (len[g] + page - 1) / page)
      return HI_EINVAL;
  }
  /* Single rows sit at random places in the store: their copy waits on memory latency, not
   * on bandwidth, so a thread per 16 KiB of rows (sizing by bytes / 4 gave 2 threads for 2K
   * rows of 256 B, the 8B shapes' per-layer gather); pages are contiguous runs. */
  const int64_t work = page == 1 ? P * (int64_t)row * 4 : P * page * (int64_t)row / 4;
  /* Dynamic chunks (16 KiB of single rows, ~32 KiB of pages at SmolLM2's shapes): beside
   * other busy threads a descheduled thread's static share held up the whole call. */
  const int chunk = page == 1 ? 64 : 4;
#pragma omp parallel for schedule(dynamic, chunk) num_threads(hi_team(threads, P, work))
  for (int64_t p = 0; p < P; p++) {
    const int64_t g = group[p];
    char *dk = (char *)out_k + (size_t)p * page * row;
    char *dv = (char *)out_v + (size_t)p * page * row;
    if (page_ids[p] < 0) {
      memset(dk, 0, (size_t)page * row);
      memset(dv, 0, (size_t)page * row);
      continue;
    }
    const int64_t start = page_ids[p] * page;
    const int64_t nrow = len[g] - start < page ? len[g] - start : page;
    const size_t src = ((size_t)heads[p] * (size_t)cap[g] + (size_t)start) * row;
    memcpy(dk, (const char *)k[g] + src, (size_t)nrow * row);
    memcpy(dv, (const char *)v[g] + src, (size_t)nrow * row);
    memset(dk + nrow * row, 0, (size_t)(page - nrow) * row);
    memset(dv + nrow * row, 0, (size_t)(page - nrow) * row);
  }
  return HI_OK;
}

/* Per-row id sets for assign_slots and count_common: open addressing over one row's ids,
 * table[] holding indices into that row (-1 = empty); a repeated id keeps its first index. */
static int64_t *slot_probe(int64_t *table, int64_t mask, const int64_t *ids, int64_t id) {
  uint64_t h = (uint64_t)id * 0x9E3779B97F4A7C15ull;
  for (int64_t at = (int64_t)(h >> 32) & mask;; at = (at + 1) & mask)
    if (table[at] < 0 || ids[table[at]] == id) return &table[at];
}

static int64_t id_table_size(int64_t m) { /* a power of two >= 2m: short probe runs */
  int64_t size = 2;
  while (size < 2 * m) size *= 2;
  return size;
}

static void id_table_fill(int64_t *table, int64_t size, const int64_t *ids, int64_t m) {
  for (int64_t i = 0; i < size; i++) table[i] = -1;
  for (int64_t j = 0; j < m; j++) {
    if (ids[j] < 0) continue;
    int64_t *e = slot_probe(table, size - 1, ids, ids[j]);
    if (*e < 0) *e = j;
  }
}

static int ids_valid(const int64_t *ids, int64_t n) { /* -1 = none; anything lower is an error */
  for (int64_t i = 0; i < n; i++)
    if (ids[i] < -1) return 0;
  return 1;
}

int hi_assign_slots(const int64_t *held, const int64_t *wanted, int64_t R, int64_t S, int64_t *writes,
                    int threads) {
  if (!ids_valid(held, R * S) || !ids_valid(wanted, R * S)) return HI_EINVAL;
  const int64_t size = id_table_size(S);
  int err = HI_OK;
#pragma omp parallel num_threads(hi_team(threads, R, R * S * 8))
  {
    /* per thread: the hash table, then a "present in held" flag per wanted entry */
    int64_t *table = malloc((size_t)(size + S) * sizeof(int64_t));
    if (!table) {
#pragma omp atomic write
      err = HI_ENOMEM;
    }
#pragma omp for schedule(static)
    for (int64_t r = 0; r < R; r++) {
      if (!table) continue;
      const int64_t *h = held + r * S, *w = wanted + r * S;
      int64_t *out = writes + r * S, *kept = table + size;
      id_table_fill(table, size, w, S);
      for (int64_t j = 0; j < S; j++) kept[j] = 0;
      for (int64_t s = 0; s < S; s++) { /* held ids still wanted stay put; the rest is free (-3) */
        out[s] = -3;
        if (h[s] < 0) continue;
        const int64_t *e = slot_probe(table, size - 1, w, h[s]);
        if (*e >= 0 && !kept[*e]) {
          kept[*e] = 1;
          out[s] = -2;
        }
      }
      int64_t s = 0;
      for (int64_t j = 0; j < S; j++) { /* entering ids take the free slots, first free first */
        if (w[j] < 0 || kept[j] || *slot_probe(table, size - 1, w, w[j]) != j) continue;
        while (out[s] != -3) s++; /* |wanted| <= S: a free slot is left */
        out[s] = w[j];
      }
      for (int64_t t = 0; t < S; t++) /* free slots left over: emptied if they held an id */
        if (out[t] == -3) out[t] = h[t] >= 0 ? -1 : -2;
    }
    free(table);
  }
  return err;
}

int hi_count_common(const int64_t *a, int64_t n, const int64_t *b, int64_t m, int64_t R, int64_t *counts,
                    int threads) {
  if (!ids_valid(a, R * n) || !ids_valid(b, R * m)) return HI_EINVAL;
  const int64_t size = id_table_size(m);
  int err = HI_OK;
#pragma omp parallel num_threads(hi_team(threads, R, R * (n + m) * 8))
  {
    int64_t *table = malloc((size_t)size * sizeof(int64_t)); /* indices into the row of b, -1 = empty */
    if (!table) {
#pragma omp atomic write
      err = HI_ENOMEM;
    }
#pragma omp for schedule(static)
    for (int64_t r = 0; r < R; r++) {
      if (!table) continue;
      const int64_t *x = a + r * n, *y = b + r * m;
      id_table_fill(table, size, y, m);
      int64_t count = 0;
      for (int64_t i = 0; i < n; i++)
        if (x[i] >= 0 && *slot_probe(table, size - 1, y, x[i]) >= 0) count++;
      counts[r] = count;
    }
    free(table);
  }
  return err;
}
