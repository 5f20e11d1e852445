/* Index lifecycle, scratch space and the kind dispatch. */
#define _POSIX_C_SOURCE 200809L
#include "hi_index.h"

#include <stdlib.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "hi_kernels.h"

int hi_threads(int requested) {
#ifdef _OPENMP
  return requested > 0 ? requested : omp_get_max_threads();
#else
  (void)requested;
  return 1;
#endif
}

double hi_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void hi_ws_free(hi_ws_t *ws) {
  free(ws->visited);
  free(ws->cand);
  free(ws->top);
  free(ws->pool);
  free(ws->ids);
  free(ws->dist);
  free(ws->row);
  free(ws->row2);
  memset(ws, 0, sizeof *ws);
}

static int grow(void **p, int64_t *cap, int64_t need, size_t elem) {
  if (need <= *cap) return HI_OK;
  int64_t c = *cap * 2 > need ? *cap * 2 : need;
  void *q = realloc(*p, (size_t)c * elem);
  if (!q) return HI_ENOMEM;
  *p = q;
  *cap = c;
  return HI_OK;
}

int hi_ws_ensure(hi_ws_t *ws, int64_t n_nodes, int64_t top, int64_t ids, int dim) {
  int64_t words = (n_nodes + 63) / 64 + 1;
  if (words > ws->visited_words) {
    free(ws->visited);
    ws->visited = calloc((size_t)words, sizeof(uint64_t));
    ws->visited_words = ws->visited ? words : 0;
    if (!ws->visited) return HI_ENOMEM;
  }
  if (grow((void **)&ws->top, &ws->top_cap, top + 1, sizeof(hi_pair))) return HI_ENOMEM;
  if (grow((void **)&ws->cand, &ws->cand_cap, top + 1, sizeof(hi_pair))) return HI_ENOMEM;
  /* ids / dist and row / row2 share a capacity: the second of each pair grows first, so a failed
   * growth never leaves the recorded capacity above either buffer's size. */
  int64_t ic = ws->ids_cap;
  if (grow((void **)&ws->dist, &ic, ids + 1, sizeof(float))) return HI_ENOMEM;
  if (grow((void **)&ws->ids, &ws->ids_cap, ids + 1, sizeof(int32_t))) return HI_ENOMEM;
  int64_t rc = ws->row_cap;
  if (grow((void **)&ws->row2, &rc, dim + 1, sizeof(float))) return HI_ENOMEM;
  if (grow((void **)&ws->row, &ws->row_cap, dim + 1, sizeof(float))) return HI_ENOMEM;
  return HI_OK;
}

int hi_index_init(hi_index_t *ix, int kind, int dim, const hi_params_t *p) {
  memset(ix, 0, sizeof *ix);
  ix->kind = kind;
  ix->dim = dim;
  ix->p = *p;
  ix->entry = -1;
  /* HNSW keeps 2M links on level 0; roar keeps M (projection, connectivity)
   * plus n_cooc co-occurrence links. */
  ix->R = kind == HI_GRAPH ? 2 * p->M : kind == HI_ROAR ? p->M + p->n_cooc : p->M;
  if (pthread_rwlock_init(&ix->lock, NULL) != 0) return HI_ENOMEM;
  return HI_OK;
}

void hi_index_free(hi_index_t *ix) {
  free(ix->hubs);
  ix->hubs = NULL;
  ix->nhubs = 0;
  free(ix->adj);
  free(ix->deg);
  free(ix->centroids);
  free(ix->assign);
  free(ix->list_off);
  free(ix->list_ids);
  pthread_rwlock_destroy(&ix->lock);
  ix->adj = NULL;
  ix->deg = NULL;
  ix->centroids = NULL;
  ix->assign = NULL;
  ix->list_off = NULL;
  ix->list_ids = NULL;
}

/* Grow the per-node arrays to hold cap nodes; new rows are zero-degree. */
int hi_index_reserve(hi_index_t *ix, int64_t cap) {
  if (cap <= ix->cap) return HI_OK;
  if (ix->kind == HI_GRAPH || ix->kind == HI_ROAR) {
    int32_t *a = realloc(ix->adj, (size_t)cap * (size_t)ix->R * sizeof(int32_t));
    if (!a) return HI_ENOMEM;
    ix->adj = a;
    int32_t *d = realloc(ix->deg, (size_t)cap * sizeof(int32_t));
    if (!d) return HI_ENOMEM;
    ix->deg = d;
    memset(d + ix->cap, 0, (size_t)(cap - ix->cap) * sizeof(int32_t));
  } else if (ix->kind == HI_IVF) {
    int32_t *a = realloc(ix->assign, (size_t)cap * sizeof(int32_t));
    if (!a) return HI_ENOMEM;
    ix->assign = a;
  }
  ix->cap = cap;
  return HI_OK;
}

size_t hi_index_nbytes(const hi_index_t *ix) {
  size_t b = sizeof *ix;
  if (ix->kind == HI_GRAPH || ix->kind == HI_ROAR)
    b += (size_t)ix->cap * ((size_t)ix->R + 1) * sizeof(int32_t) + (size_t)ix->nhubs * sizeof(int32_t);
  if (ix->kind == HI_IVF) {
    b += (size_t)ix->cap * sizeof(int32_t);
    b += (size_t)ix->nlist * ((size_t)ix->dim * sizeof(float) + sizeof(int64_t));
    b += (size_t)ix->n_built * sizeof(int32_t);
  }
  return b;
}

void hi_index_clear(hi_index_t *ix) {
  ix->n = 0;
  ix->entry = -1;
  ix->nhubs = 0;
  if (ix->kind == HI_IVF) { /* untrained: inserts refuse (nlist 0) until a build succeeds */
    free(ix->centroids);
    free(ix->list_off);
    free(ix->list_ids);
    ix->centroids = NULL;
    ix->list_off = NULL;
    ix->list_ids = NULL;
    ix->nlist = 0;
    ix->n_built = 0;
  }
}

int hi_index_build(hi_index_t *ix, const hi_keys_t *keys, int64_t n, const float *tq,
                   int64_t m, const int64_t *topk, int nq, const int32_t *cand, int ncand,
                   int threads) {
  if (keys->dtype == HI_RAW16) return HI_EDTYPE;
  if (n < 0 || n > keys->nrows || n > INT32_MAX - 1) return HI_EINVAL;
  memset(&ix->stats, 0, sizeof ix->stats);
  ix->n = 0;
  ix->entry = -1;
  ix->nhubs = 0;
  const int64_t room = keys->room > n ? keys->room : n;
  int err = hi_index_reserve(ix, room > 0 ? room : 1);
  if (err) return err;
  switch (ix->kind) {
    case HI_FLAT: ix->n = n; return HI_OK;
    case HI_IVF: return hi_ivf_build(ix, keys, n, threads);
    case HI_GRAPH: return hi_graph_build(ix, keys, n, threads);
    case HI_ROAR: return hi_roar_build(ix, keys, n, tq, m, topk, nq, cand, ncand, threads);
    default: return HI_EINVAL;
  }
}

int hi_index_insert(hi_index_t *ix, const hi_keys_t *keys, int64_t n_total,
                    const float *queries, int ef, int threads) {
  (void)threads;
  if (ef < 0) return HI_EINVAL;
  if (keys->dtype == HI_RAW16) return HI_EDTYPE;
  if (n_total < ix->n || n_total > keys->nrows || n_total > INT32_MAX - 1) return HI_EINVAL;
  if (n_total == ix->n) return HI_OK;
  int64_t cap = ix->cap;
  while (cap < n_total) cap = cap < 1024 ? 1024 : cap + cap / 2; /* amortized growth */
  int err = hi_index_reserve(ix, cap);
  if (err) return err;
  switch (ix->kind) {
    case HI_FLAT: ix->n = n_total; return HI_OK;
    case HI_IVF: return hi_ivf_insert(ix, keys, n_total);
    case HI_GRAPH:
    case HI_ROAR: return hi_graph_insert(ix, keys, n_total, queries, ef);
    default: return HI_EINVAL;
  }
}

int hi_index_search(const hi_index_t *ix, const hi_keys_t *keys, const float *q, int k,
                    int ef, int64_t *ids, float *scores, int64_t *scanned, hi_ws_t *ws) {
  int64_t ntop = 0;
  *scanned = 0;
  if (keys->dtype == HI_RAW16) return HI_EDTYPE;
  int err = HI_OK;
  /* keys->nrows is the store's length when the caller took its buffers: a
   * search sees the index as of that snapshot, ignoring nodes inserted since
   * (their rows may live only in a newer buffer). */
  const int64_t n = ix->n < keys->nrows ? ix->n : keys->nrows;
  if (k > 0 && n > 0) {
    switch (ix->kind) {
      case HI_FLAT: err = hi_flat_search(n, keys, q, k, ws, &ntop, scanned); break;
      case HI_IVF: err = hi_ivf_search(ix, n, keys, q, k, ef, ws, &ntop, scanned); break;
      default: err = hi_graph_search(ix, n, keys, q, k, ef, ws, &ntop, scanned); break;
    }
  }
  if (err) return err;
  hi_maxheap_sort(ws->top, ntop); /* ascending distance = descending score */
  for (int64_t i = 0; i < k; i++) {
    if (i < ntop) {
      ids[i] = ws->top[i].id;
      scores[i] = -ws->top[i].d;
    } else {
      ids[i] = -1;
      scores[i] = -INFINITY;
    }
  }
  return HI_OK;
}

int hi_flat_search(int64_t n, const hi_keys_t *keys, const float *q, int k, hi_ws_t *ws,
                   int64_t *ntop, int64_t *scanned) {
  enum { BLOCK = 256 };
  int err = hi_ws_ensure(ws, 0, k, BLOCK, keys->dim);
  if (err) return err;
  int64_t nt = 0;
  for (int64_t s = 0; s < n; s += BLOCK) {
    int64_t b = n - s < BLOCK ? n - s : BLOCK;
    hi_scores_range(q, keys, s, b, ws->dist);
    for (int64_t i = 0; i < b; i++)
      hi_maxheap_offer(ws->top, &nt, k, (hi_pair){-ws->dist[i], (int32_t)(s + i)});
  }
  *ntop = nt;
  *scanned = n;
  return HI_OK;
}

int hi_exact_topk(const hi_keys_t *keys, int64_t n, const float *q, int64_t m, int k,
                  int32_t *out, int threads) {
  int err = HI_OK;
  hi_index_t flat;
  memset(&flat, 0, sizeof flat);
  flat.kind = HI_FLAT;
  flat.dim = keys->dim;
  flat.n = n;
#pragma omp parallel num_threads(hi_threads(threads))
  {
    hi_ws_t ws = {0};
    int64_t *ids = malloc((size_t)(k > 0 ? k : 1) * sizeof(int64_t));
    float *sc = malloc((size_t)(k > 0 ? k : 1) * sizeof(float));
    int lerr = ids && sc ? HI_OK : HI_ENOMEM;
#pragma omp for schedule(dynamic, 4)
    for (int64_t i = 0; i < m; i++) {
      if (lerr) continue;
      int64_t scanned;
      lerr = hi_index_search(&flat, keys, q + i * keys->dim, k, 0, ids, sc, &scanned, &ws);
      for (int j = 0; j < k && !lerr; j++) out[i * k + j] = (int32_t)ids[j];
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
