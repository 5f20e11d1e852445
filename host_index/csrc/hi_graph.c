/* Proximity graphs: a key-only HNSW-style graph ("graph", one layer) and the
 * attention-aware RoarGraph-style graph ("roar"), sharing one best-first
 * search, one RNG-style neighbour selection and one reachability repair.
 *
 * Build-time writers lock single nodes with spinlocks (concurrent inserts as
 * in hnswlib); query-time search runs lock-free under the index's read lock. */
#define _POSIX_C_SOURCE 200809L
#include <stdlib.h>

#include "hi_index.h"
#include "hi_kernels.h"

#define HI_MAX_R 512 /* adjacency stride limit; the Python layer checks M */

typedef _Atomic unsigned char spin_t;

static inline void spin_lock(spin_t *l) {
  while (atomic_exchange_explicit(l, 1, memory_order_acquire)) {
  }
}

static inline void spin_unlock(spin_t *l) { atomic_store_explicit(l, 0, memory_order_release); }

typedef struct {
  hi_index_t *ix;
  const hi_keys_t *keys; /* f32 copy while building; the store's keys on insert */
  spin_t *locks;         /* NULL: a single writer (insert under the write lock) */
  int metric;
  float alpha;
  int cap; /* out-degree limit of add_link / repair: M while building roar, else R */
  int keep_links; /* add_link into a full list swaps out its farthest link (roar inserts) */
  _Atomic int64_t ndist;
} gctx_t;

/* --- small helpers ------------------------------------------------------ */

static inline int vis_test_set(uint64_t *v, int32_t i) {
  const uint64_t m = 1ull << (i & 63);
  const uint64_t w = v[i >> 6];
  v[i >> 6] = w | m;
  return (w & m) != 0;
}

/* Distances from x to rows ids[0..n): L2 squared, or -inner product. */
static void dist_ids(const hi_keys_t *keys, int mode, const float *x, const int32_t *ids,
                     int64_t n, float *out) {
  if (mode == HI_L2) {
    hi_l2_ids(x, keys, ids, n, out);
  } else {
    hi_scores_ids(x, keys, ids, n, out);
    for (int64_t i = 0; i < n; i++) out[i] = -out[i];
  }
}

/* Row id as float32: a pointer into the keys when they are f32, else a copy. */
static const float *row_f32(const hi_keys_t *keys, int32_t id, float *buf) {
  if (keys->dtype == HI_F32) return (const float *)hi_row(keys, id);
  hi_convert(hi_row(keys, id), keys->dtype, buf, HI_F32, keys->dim);
  return buf;
}

/* A search waits on memory, not arithmetic: past the caches every neighbour's row and every
 * adjacency list is a DRAM miss. Asking for all of a node's neighbour rows, and for the next
 * candidate's list, before the first is read keeps many misses in flight instead of a few. */
static inline void prefetch_rows(const hi_keys_t *keys, const int32_t *ids, int m) {
  const size_t bytes = (size_t)keys->dim * hi_itemsize(keys->dtype);
  for (int j = 0; j < m; j++) {
    const char *r = hi_row(keys, ids[j]);
    for (size_t b = 0; b < bytes; b += 64) __builtin_prefetch(r + b, 0, 1);
  }
}

static inline void prefetch_nbrs(const hi_index_t *ix, int32_t u) {
  const char *a = (const char *)(ix->adj + (size_t)u * ix->R);
  for (size_t b = 0; b < (size_t)ix->R * sizeof(int32_t); b += 64) __builtin_prefetch(a + b, 0, 1);
  __builtin_prefetch(ix->deg + u, 0, 1);
}

static int read_nbrs(const hi_index_t *ix, spin_t *locks, int32_t u, int32_t *buf) {
  if (locks) spin_lock(&locks[u]);
  const int d = ix->deg[u];
  memcpy(buf, ix->adj + (size_t)u * ix->R, (size_t)d * sizeof(int32_t));
  if (locks) spin_unlock(&locks[u]);
  return d;
}

static int cmp_pair(const void *a, const void *b) {
  const hi_pair x = *(const hi_pair *)a, y = *(const hi_pair *)b;
  return hi_pair_lt(x, y) ? -1 : hi_pair_lt(y, x) ? 1 : 0;
}

static int cmp_i32(const void *a, const void *b) {
  const int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
  return (x > y) - (x < y);
}

static int ensure_pool(hi_ws_t *ws, int64_t n) {
  if (n <= ws->pool_cap) return HI_OK;
  int64_t c = ws->pool_cap * 2 > n ? ws->pool_cap * 2 : n;
  hi_pair *p = realloc(ws->pool, (size_t)c * sizeof(hi_pair));
  if (!p) return HI_ENOMEM;
  ws->pool = p;
  ws->pool_cap = c;
  return HI_OK;
}

/* --- best-first search --------------------------------------------------- */

/* Scores the m unvisited ids in nb and offers each to the beam (ws->top, ef
 * wide), the candidate queue (ws->cand, grown as needed) and, with kres, the
 * result pool. Returns HI_OK or HI_ENOMEM. */
static int score_and_offer(const hi_keys_t *keys, int mode, const float *q, const int32_t *nb,
                           int m, int ef, int kres, hi_ws_t *ws, int64_t *nt, int64_t *nc,
                           int64_t *nres) {
  dist_ids(keys, mode, q, nb, m, ws->dist);
  for (int j = 0; j < m; j++) {
    const hi_pair p = {ws->dist[j], nb[j]};
    if (kres) hi_maxheap_offer(ws->pool, nres, kres, p);
    if (*nt < ef || hi_pair_lt(p, ws->top[0])) {
      if (*nc + 1 > ws->cand_cap) {
        int64_t cc = ws->cand_cap * 2;
        hi_pair *np = realloc(ws->cand, (size_t)cc * sizeof(hi_pair));
        if (!np) return HI_ENOMEM;
        ws->cand = np;
        ws->cand_cap = cc;
      }
      hi_minheap_push(ws->cand, nc, p);
      hi_maxheap_offer(ws->top, nt, ef, p);
    }
  }
  return HI_OK;
}

/* Search from ix->entry over nodes [0, n_nodes). Leaves the (at most ef)
 * nearest in ws->top as a max-heap of size *ntop; returns distance
 * computations, or a negative hi_err. mode: HI_IP (-q.k) or HI_L2.
 * kres > ef: the beam stays ef wide, but ws->top gets the kres nearest of
 * every node scanned (ws->pool holds them meanwhile). */
static int64_t search_core(const hi_index_t *ix, const hi_keys_t *keys, int64_t n_nodes,
                           const float *q, int mode, int ef, int kres, int seeds, hi_ws_t *ws,
                           spin_t *locks, int64_t *ntop) {
  *ntop = 0;
  int32_t e = ix->entry;
  if (e < 0 || e >= n_nodes || ef <= 0) return 0;
  if (kres <= ef) kres = 0;
  int err = hi_ws_ensure(ws, n_nodes, kres > ef ? kres : ef, ix->R, ix->dim);
  if (err) return err;
  if (kres && (err = ensure_pool(ws, kres + 1))) return err;
  int64_t nres = 0;
  memset(ws->visited, 0, (size_t)((n_nodes + 63) >> 6) * sizeof(uint64_t));
  int64_t nt = 0, nc = 0, scanned = 1;
  float d0;
  dist_ids(keys, mode, q, &e, 1, &d0);
  vis_test_set(ws->visited, e);
  hi_maxheap_push(ws->top, &nt, (hi_pair){d0, e});
  hi_minheap_push(ws->cand, &nc, (hi_pair){d0, e});
  if (kres) hi_maxheap_push(ws->pool, &nres, (hi_pair){d0, e});
  int32_t *nb = ws->ids;
  /* Seeds: the hub keys are scored too (counted), and join the lists like
   * neighbours of the entry. */
  for (int h0 = 0; seeds && h0 < ix->nhubs; h0 += ix->R) {
    int m = 0;
    for (int h = h0; h < ix->nhubs && h < h0 + ix->R; h++) {
      const int32_t v = ix->hubs[h];
      if (v >= 0 && v < n_nodes && !vis_test_set(ws->visited, v)) nb[m++] = v;
    }
    if (m == 0) continue;
    scanned += m;
    if ((err = score_and_offer(keys, mode, q, nb, m, ef, kres, ws, &nt, &nc, &nres))) return err;
  }
  while (nc > 0) {
    const hi_pair c = hi_minheap_pop(ws->cand, &nc);
    if (nt >= ef && c.d > ws->top[0].d) break;
    const int deg = read_nbrs(ix, locks, c.id, nb);
    int m = 0;
    for (int j = 0; j < deg; j++) {
      const int32_t v = nb[j];
      if (v < 0 || v >= n_nodes || vis_test_set(ws->visited, v)) continue;
      nb[m++] = v;
    }
    if (nc > 0) prefetch_nbrs(ix, ws->cand[0].id); /* likely the next expanded */
    if (m == 0) continue;
    prefetch_rows(keys, nb, m);
    scanned += m;
    if ((err = score_and_offer(keys, mode, q, nb, m, ef, kres, ws, &nt, &nc, &nres))) return err;
  }
  if (kres) {
    memcpy(ws->top, ws->pool, (size_t)nres * sizeof(hi_pair));
    nt = nres;
  }
  *ntop = nt;
  return scanned;
}

int hi_graph_search(const hi_index_t *ix, int64_t n, const hi_keys_t *keys, const float *q,
                    int k, int ef, hi_ws_t *ws, int64_t *ntop, int64_t *scanned) {
  if (ef <= 0) ef = 64 > k ? 64 : k;
  /* ef < k: a beam of ef, results the best k of every key scanned. */
  int64_t s = search_core(ix, keys, n, q, HI_IP, ef, k, 1, ws, NULL, ntop);
  if (s < 0) return (int)s;
  *scanned = s;
  return HI_OK;
}

/* --- neighbour selection -------------------------------------------------- */

/* RNG-style pruning (HNSW's heuristic; Vamana's with alpha > 1 under L2):
 * walk cands (ascending distance to the base node) and keep c unless an
 * already kept s is closer to c than the base is. out[0..npre) are kept
 * neighbours that take part in the test. Returns the new count (<= maxdeg). */
static int select_nbrs(gctx_t *g, const hi_pair *cands, int64_t nc, int32_t *out, int npre,
                       int maxdeg, hi_ws_t *ws) {
  float dsel[HI_MAX_R];
  int ns = npre;
  int64_t nd = 0;
  for (int64_t i = 0; i < nc && ns < maxdeg; i++) {
    const hi_pair c = cands[i];
    int dup = 0;
    for (int j = 0; j < ns && !dup; j++) dup = out[j] == c.id;
    if (dup) continue;
    if (ns > 0) {
      const float *x = row_f32(g->keys, c.id, ws->row);
      dist_ids(g->keys, g->metric, x, out, ns, dsel);
      nd += ns;
    }
    int good = 1;
    for (int j = 0; j < ns && good; j++) {
      const float dsc = g->metric == HI_L2 ? g->alpha * dsel[j] : dsel[j];
      if (dsc < c.d) good = 0;
    }
    if (good) out[ns++] = c.id;
  }
  atomic_fetch_add_explicit(&g->ndist, nd, memory_order_relaxed);
  return ns;
}

/* u's full list takes x in place of its link farthest from u, when x is closer than that link
 * or `force` is set. Why not re-select (add_link's default) for roar's decode-time inserts:
 * the re-selection keeps a diverse few of u's links by distance and so drops its co-occurrence
 * links, which carry roar's recall, and it costs ~R^2 / 2 distances where this costs R + 1.
 * `force` (the new key's nearest neighbour) gives every new key an in-link: a key of large
 * norm, which tops inner-product searches, is far from its neighbours and would otherwise be
 * closer than none of their links. */
static void swap_farthest(gctx_t *g, int32_t *a, int d, int32_t u, int32_t x, int force,
                          hi_ws_t *ws) {
  int32_t ids[HI_MAX_R + 1];
  float dd[HI_MAX_R + 1];
  memcpy(ids, a, (size_t)d * sizeof(int32_t));
  ids[d] = x;
  dist_ids(g->keys, g->metric, row_f32(g->keys, u, ws->row2), ids, d + 1, dd);
  atomic_fetch_add_explicit(&g->ndist, d + 1, memory_order_relaxed);
  int far = 0;
  for (int j = 1; j < d; j++)
    if (dd[j] > dd[far]) far = j;
  if (force || dd[d] < dd[far]) a[far] = x;
}

/* Add the edge u -> x; when u is full, re-select u's neighbours among its
 * current ones plus x (hnswlib's "shrink connections"), or with keep_links
 * swap_farthest (forced: see there). */
static void add_link(gctx_t *g, int32_t u, int32_t x, int force, hi_ws_t *ws) {
  hi_index_t *ix = g->ix;
  hi_pair pairs[HI_MAX_R + 1];
  int32_t ids[HI_MAX_R + 1];
  if (g->locks) spin_lock(&g->locks[u]);
  int32_t *a = ix->adj + (size_t)u * ix->R;
  const int d = ix->deg[u];
  int present = 0;
  for (int j = 0; j < d && !present; j++) present = a[j] == x;
  if (!present && u != x) {
    if (d < g->cap) {
      a[d] = x;
      ix->deg[u] = d + 1;
    } else if (g->keep_links) {
      swap_farthest(g, a, d, u, x, force, ws);
    } else {
      memcpy(ids, a, (size_t)d * sizeof(int32_t));
      ids[d] = x;
      const float *ur = row_f32(g->keys, u, ws->row2);
      float dd[HI_MAX_R + 1];
      dist_ids(g->keys, g->metric, ur, ids, d + 1, dd);
      for (int j = 0; j <= d; j++) pairs[j] = (hi_pair){dd[j], ids[j]};
      qsort(pairs, (size_t)d + 1, sizeof(hi_pair), cmp_pair);
      atomic_fetch_add_explicit(&g->ndist, d + 1, memory_order_relaxed);
      ix->deg[u] = select_nbrs(g, pairs, d + 1, a, 0, g->cap, ws);
    }
  }
  if (g->locks) spin_unlock(&g->locks[u]);
}

/* Link node x (already counted in ix->n): candidates from a search with x's
 * key (build metric), plus, when qv is given, from a search with that query
 * by inner product (roar's decode-time insert: the token's own query is its
 * training query). Select up to M, then add the reverse edges. */
static int link_node(gctx_t *g, int32_t x, const float *xv, const float *qv, int64_t n_nodes,
                     int ef, int maxdeg, hi_ws_t *ws) {
  hi_index_t *ix = g->ix;
  int64_t nt;
  int err = hi_ws_ensure(ws, n_nodes, ef, ef + ix->R, ix->dim);
  if (err) return err;
  int64_t s = search_core(ix, g->keys, n_nodes, xv, g->metric, ef, 0, 0, ws, g->locks, &nt);
  if (s < 0) return (int)s;
  int64_t nd = s;
  err = ensure_pool(ws, nt + (qv ? ef : 0) + 1);
  if (err) return err;
  int64_t np = 0;
  for (int64_t i = 0; i < nt; i++)
    if (ws->top[i].id != x) ws->pool[np++] = ws->top[i];
  if (qv) {
    s = search_core(ix, g->keys, n_nodes, qv, HI_IP, ef, 0, 0, ws, g->locks, &nt);
    if (s < 0) return (int)s;
    nd += s;
    /* Re-measure the query's results from x, in the build metric. */
    int32_t *ids = ws->ids;
    int64_t m = 0;
    for (int64_t i = 0; i < nt; i++)
      if (ws->top[i].id != x) ids[m++] = ws->top[i].id;
    float *dd = ws->dist;
    for (int64_t i0 = 0; i0 < m; i0 += ix->R) {
      int64_t b = m - i0 < ix->R ? m - i0 : ix->R;
      dist_ids(g->keys, g->metric, xv, ids + i0, b, dd);
      for (int64_t i = 0; i < b; i++) ws->pool[np++] = (hi_pair){dd[i], ids[i0 + i]};
    }
    nd += m;
  }
  qsort(ws->pool, (size_t)np, sizeof(hi_pair), cmp_pair);
  int32_t sel[HI_MAX_R];
  const int ns = select_nbrs(g, ws->pool, np, sel, 0, maxdeg, ws);
  if (g->locks) spin_lock(&g->locks[x]);
  memcpy(ix->adj + (size_t)x * ix->R, sel, (size_t)ns * sizeof(int32_t));
  ix->deg[x] = ns;
  if (g->locks) spin_unlock(&g->locks[x]);
  for (int j = 0; j < ns; j++) add_link(g, sel[j], x, j == 0, ws);  /* sel[0]: x's nearest */
  atomic_fetch_add_explicit(&g->ndist, nd, memory_order_relaxed);
  return HI_OK;
}

/* --- shared build steps ---------------------------------------------------- */

/* Keys as float32 (the build measures many key-key distances). */
static int keys_f32(const hi_keys_t *keys, int64_t n, int threads, float **buf, hi_keys_t *out) {
  *out = *keys;
  out->nrows = n;
  out->room = n;
  *buf = NULL;
  if (keys->dtype == HI_F32) return HI_OK;
  float *b = malloc((size_t)(n > 0 ? n : 1) * (size_t)keys->dim * sizeof(float));
  if (!b) return HI_ENOMEM;
#pragma omp parallel for schedule(static) num_threads(hi_threads(threads))
  for (int64_t i = 0; i < n; i++)
    hi_convert(hi_row(keys, i), keys->dtype, b + i * keys->dim, HI_F32, keys->dim);
  *buf = b;
  out->base = b;
  out->dtype = HI_F32;
  return HI_OK;
}

/* The key nearest (L2) to the mean of keys 0..n-1: a central entry point. */
static int32_t nearest_to_mean(const hi_keys_t *k32, int64_t n, int threads) {
  const int d = k32->dim;
  double acc[HI_MAX_R * 4] = {0}; /* dim <= 2048 is checked in Python */
  float mean[HI_MAX_R * 4];
  for (int64_t i = 0; i < n; i++) {
    const float *r = hi_row(k32, i);
    for (int j = 0; j < d; j++) acc[j] += r[j];
  }
  for (int j = 0; j < d; j++) mean[j] = (float)(acc[j] / (double)n);
  int32_t best = 0;
  float bestd = INFINITY;
#pragma omp parallel num_threads(hi_threads(threads))
  {
    float dd[256];
    int32_t lb = -1;
    float ld = INFINITY;
#pragma omp for schedule(static)
    for (int64_t s = 0; s < n; s += 256) {
      int64_t b = n - s < 256 ? n - s : 256;
      hi_l2_range(mean, k32, s, b, dd);
      for (int64_t i = 0; i < b; i++)
        if (dd[i] < ld) {
          ld = dd[i];
          lb = (int32_t)(s + i);
        }
    }
#pragma omp critical
    if (lb >= 0 && (ld < bestd || (ld == bestd && lb < best))) {
      bestd = ld;
      best = lb;
    }
  }
  return best;
}

static void bfs_mark(const hi_index_t *ix, int32_t start, unsigned char *reach, int32_t *queue) {
  if (reach[start]) return;
  int64_t h = 0, t = 0;
  reach[start] = 1;
  queue[t++] = start;
  while (h < t) {
    const int32_t u = queue[h++];
    const int32_t *a = ix->adj + (size_t)u * ix->R;
    for (int j = 0; j < ix->deg[u]; j++) {
      const int32_t v = a[j];
      if (!reach[v]) {
        reach[v] = 1;
        queue[t++] = v;
      }
    }
  }
}

/* Make every node reachable from the entry: link each unreachable node from
 * its nearest reachable node (a free slot, else replacing that node's
 * farthest neighbour). Sequential and deterministic; usually touches few. */
static int repair(gctx_t *g, int64_t n, int ef, hi_ws_t *ws) {
  hi_index_t *ix = g->ix;
  if (n == 0 || ix->entry < 0) return HI_OK;
  unsigned char *reach = calloc((size_t)n, 1);
  int32_t *queue = malloc((size_t)n * sizeof(int32_t));
  if (!reach || !queue) {
    free(reach);
    free(queue);
    return HI_ENOMEM;
  }
  spin_t *saved = g->locks;
  g->locks = NULL;
  bfs_mark(ix, ix->entry, reach, queue);
  int err = HI_OK;
  for (int64_t u = 0; u < n && !err; u++) {
    if (reach[u]) continue;
    int64_t nt;
    const float *uv = row_f32(g->keys, (int32_t)u, ws->row2);
    int64_t s = search_core(ix, g->keys, n, uv, g->metric, ef, 0, 0, ws, NULL, &nt);
    if (s < 0) {
      err = (int)s;
      break;
    }
    hi_maxheap_sort(ws->top, nt);
    int32_t v = -1;
    for (int64_t i = 0; i < nt && v < 0; i++)
      if (reach[ws->top[i].id] && ix->deg[ws->top[i].id] < g->cap) v = ws->top[i].id;
    if (v < 0) v = nt > 0 ? ws->top[0].id : ix->entry;
    if (ix->deg[v] < g->cap) {
      ix->adj[(size_t)v * ix->R + ix->deg[v]++] = (int32_t)u;
    } else {
      int32_t *a = ix->adj + (size_t)v * ix->R;
      float dd[HI_MAX_R];
      const float *vv = row_f32(g->keys, v, ws->row);
      dist_ids(g->keys, g->metric, vv, a, ix->deg[v], dd);
      int far = 0;
      for (int j = 1; j < ix->deg[v]; j++)
        if (dd[j] > dd[far]) far = j;
      a[far] = (int32_t)u;
    }
    ix->stats.unreachable_fixed++;
    bfs_mark(ix, (int32_t)u, reach, queue);
  }
  g->locks = saved;
  free(reach);
  free(queue);
  return err;
}

/* --- graph (key-only, HNSW-style single layer) ----------------------------- */

int hi_graph_build(hi_index_t *ix, const hi_keys_t *keys, int64_t n, int threads) {
  ix->n = n;
  memset(ix->deg, 0, (size_t)ix->cap * sizeof(int32_t));
  if (n == 0) return HI_OK;
  double t0 = hi_now();
  float *buf;
  hi_keys_t k32;
  int err = keys_f32(keys, n, threads, &buf, &k32);
  if (err) return err;
  spin_t *locks = calloc((size_t)n, sizeof(spin_t));
  if (!locks) {
    free(buf);
    return HI_ENOMEM;
  }
  gctx_t g = {.ix = ix, .keys = &k32, .locks = locks, .metric = ix->p.metric,
              .alpha = ix->p.alpha, .cap = ix->R};
  ix->entry = nearest_to_mean(&k32, n, threads);
#pragma omp parallel num_threads(hi_threads(threads))
  {
    hi_ws_t ws = {0};
    int lerr = HI_OK;
#pragma omp for schedule(dynamic, 16)
    for (int64_t i = 0; i < n; i++) {
      if (lerr || i == ix->entry) continue;
      lerr = link_node(&g, (int32_t)i, hi_row(&k32, i), NULL, n, ix->p.ef_construction,
                       ix->p.M, &ws);
    }
    if (lerr) {
#pragma omp atomic write
      err = lerr;
    }
    hi_ws_free(&ws);
  }
  ix->stats.t_connect = hi_now() - t0;
  if (!err) {
    t0 = hi_now();
    hi_ws_t ws = {0};
    g.locks = NULL;
    err = repair(&g, n, ix->p.ef_construction, &ws);
    hi_ws_free(&ws);
    ix->stats.t_repair = hi_now() - t0;
  }
  ix->stats.built_nodes = n;
  ix->stats.dist_build = g.ndist;
  free(locks);
  free(buf);
  return err;
}

/* --- roar (attention-aware, RoarGraph-style) -------------------------------- */

/* Larger score first, then smaller id: a total order, so the pass is
 * deterministic for any thread count. */
static inline int cooc_better(float ca, int32_t ia, float cb, int32_t ib) {
  return ca > cb || (ca == cb && ia < ib);
}

/* The `want` keys of [lo, hi) with the largest cnt (> 0) not yet taken, appended to
 * out[*nout..] in descending count, ties by smaller id; each is marked taken. */
static void top_by_count(const int32_t *cnt, int64_t lo, int64_t hi, int want, unsigned char *taken,
                         int32_t *out, int *nout) {
  int32_t *sel = out + *nout;
  int ns = 0;
  for (int64_t v = lo; v < hi && want > 0; v++) {
    const int32_t c = cnt[v];
    if (c <= 0 || taken[v] || (ns == want && c <= cnt[sel[ns - 1]])) continue;
    int pos = ns < want ? ns++ : want - 1;
    while (pos > 0 && c > cnt[sel[pos - 1]]) { /* ascending v: ties keep the smaller id */
      sel[pos] = sel[pos - 1];
      pos--;
    }
    sel[pos] = (int32_t)v;
  }
  for (int j = 0; j < ns; j++) taken[sel[j]] = 1;
  *nout += ns;
}

static void count_rows(int32_t *cnt, int64_t n, const int32_t *tk, int64_t from, int64_t m, int nq) {
  memset(cnt, 0, (size_t)n * sizeof(int32_t));
  for (int64_t i = from * nq; i < m * nq; i++)
    if (tk[i] >= 0) cnt[tk[i]]++;
}

/* Hub seeds (n_hubs of them), scored with the entry at every search and seeding the beam:
 *  - n_hubs / 2: the keys most frequent in the top lists of the last HUB_TAIL_ROWS training rows
 *    (the prompt's last queries -- the question -- which decoding continues from);
 *  - the rest shared over HUB_STRATA equal strata of the key range (prompt order; the first
 *    strata get the remainder), each stratum's keys most frequent in the top lists of the last
 *    quarter of the rows, so every part of the prompt has an entry into the co-occurrence graph;
 *  - any shortfall (a stratum with too few keys seen): the last quarter's most frequent overall.
 * Counts > 0 only, ties by smaller id, no key twice. Until the far-key study in NOTES_roar.md all
 * hubs were the last quarter's most frequent keys; far keys that only the last queries rank high
 * (a needle early in a long prompt) were then often not reached at ef 100. */
#define HUB_TAIL_ROWS 64
#define HUB_STRATA 8
static int pick_hubs(hi_index_t *ix, int64_t n, const int32_t *tk, int64_t m, int nq) {
  const int nh = ix->p.n_hubs;
  int32_t *cnt = malloc((size_t)n * sizeof(int32_t));
  unsigned char *taken = calloc((size_t)n, 1);
  int32_t *hubs = malloc((size_t)nh * sizeof(int32_t));
  if (!cnt || !taken || !hubs) {
    free(cnt);
    free(taken);
    free(hubs);
    return HI_ENOMEM;
  }
  int got = 0;
  if (HUB_TAIL_ROWS > 0) {
    count_rows(cnt, n, tk, m > HUB_TAIL_ROWS ? m - HUB_TAIL_ROWS : 0, m, nq);
    top_by_count(cnt, 0, n, nh / 2, taken, hubs, &got);
  }
  count_rows(cnt, n, tk, m - (m / 4 > 0 ? m / 4 : 1), m, nq);
  if (HUB_STRATA > 0) {
    const int left = nh - got, s = HUB_STRATA;
    for (int j = 0; j < s; j++)
      top_by_count(cnt, j * n / s, (j + 1) * n / s, left / s + (j < left % s), taken, hubs, &got);
  }
  top_by_count(cnt, 0, n, nh - got, taken, hubs, &got);
  free(cnt);
  free(taken);
  free(ix->hubs);
  ix->hubs = hubs;
  ix->nhubs = got;
  return HI_OK;
}

/* Co-occurrence links: for every key u, count c(u, v), how many training
 * queries have both u and v among their top-nq keys, and append to u's list
 * (after its projection / connectivity neighbours, up to R = M + n_cooc) the
 * n_cooc keys v it does not already link with the largest
 * c(u, v) / sqrt(f(v)), f(v) the number of top lists holding v (a cosine
 * between the two keys' query sets: raw counts would fill every list with
 * the few keys that nearly every query ranks high). Such v are what a query
 * that ranks u high tends to rank high too, so a search that reaches one
 * finds the others in one hop. Each key writes only its own list. */
static int cooc_pass(hi_index_t *ix, int64_t n, const int32_t *tk, int64_t m, int nq,
                     int threads) {
  int64_t *off = calloc((size_t)n + 1, sizeof(int64_t));
  int32_t *occ = malloc((size_t)(m * nq > 0 ? m * nq : 1) * sizeof(int32_t));
  float *root = malloc((size_t)n * sizeof(float)); /* sqrt(f(v)), once per key, not per pair */
  int err = HI_OK;
  if (!off || !occ || !root) {
    free(off);
    free(occ);
    free(root);
    return HI_ENOMEM;
  }
  /* CSR: for each key, the training queries whose top-nq lists hold it. */
  for (int64_t i = 0; i < m * nq; i++)
    if (tk[i] >= 0) off[tk[i] + 1]++;
  for (int64_t u = 0; u < n; u++) off[u + 1] += off[u];
  {
    int64_t *fill = calloc((size_t)n, sizeof(int64_t));
    if (!fill) {
      free(off);
      free(occ);
      free(root);
      return HI_ENOMEM;
    }
    for (int64_t i = 0; i < m; i++)
      for (int j = 0; j < nq; j++) {
        const int32_t v = tk[i * nq + j];
        if (v >= 0) occ[off[v] + fill[v]++] = (int32_t)i;
      }
    free(fill);
  }
  for (int64_t v = 0; v < n; v++) root[v] = sqrtf((float)(off[v + 1] - off[v]));
  const int want = ix->p.n_cooc;
  int64_t added = 0;
#pragma omp parallel num_threads(hi_threads(threads)) reduction(+ : added)
  {
    int32_t *cnt = calloc((size_t)n, sizeof(int32_t));
    /* + 1: the branchless append's spare write */
    int32_t *touched = malloc(((size_t)n + 1) * sizeof(int32_t));
    int lerr = cnt && touched ? HI_OK : HI_ENOMEM;
#pragma omp for schedule(dynamic, 64)
    for (int64_t u = 0; u < n; u++) {
      if (lerr || off[u + 1] == off[u]) continue;
      int64_t nt = 0;
      for (int64_t b = off[u]; b < off[u + 1]; b++) {
        const int32_t *row = tk + (int64_t)occ[b] * nq;
        /* Branchless: whether v is new is a coin flip the predictor misses; the store is
         * always made and kept only for a first count. u itself is counted too and skipped
         * below with the linked keys. With the prefilter below and sqrt(f) computed once: the
         * same links, 2.2 -> 1.15 s a graph on spread-out lists (31K keys, 28,672 lists, one
         * dev-box core), 0.44 -> 0.39 s on clustered keys' exact lists. */
        for (int j = 0; j < nq; j++) {
          const int32_t v = row[j];
          if (v < 0) continue;
          touched[nt] = v;
          nt += cnt[v]++ == 0;
        }
      }
      int32_t *a = ix->adj + (size_t)u * ix->R;
      const int d0 = ix->deg[u];
      cnt[u] = -1; /* itself */
      for (int j = 0; j < d0; j++) cnt[a[j]] = -1; /* already linked: skip */
      /* Bounded selection of the `want` best by (count, id): insertion into a
       * sorted array of at most `want` entries. */
      int32_t bid[256];
      float bc[256];
      int nb = 0;
      for (int64_t t = 0; t < nt; t++) {
        const int32_t v = touched[t];
        if (cnt[v] <= 0) continue;
        /* Most keys fall short of a full list's last: rejected by a product with a margin
         * (1e-4 against float rounding of 6e-8) before the exact quotient decides. */
        if (nb == want && (float)cnt[v] < bc[nb - 1] * root[v] * 0.9999f) continue;
        const float c = (float)cnt[v] / root[v];
        if (nb == want && !cooc_better(c, v, bc[nb - 1], bid[nb - 1])) continue;
        int pos = nb < want ? nb++ : want - 1;
        while (pos > 0 && cooc_better(c, v, bc[pos - 1], bid[pos - 1])) {
          bc[pos] = bc[pos - 1];
          bid[pos] = bid[pos - 1];
          pos--;
        }
        bc[pos] = c;
        bid[pos] = v;
      }
      for (int64_t t = 0; t < nt; t++) cnt[touched[t]] = 0;
      for (int j = 0; j < d0; j++) cnt[a[j]] = 0; /* u: reset above (its rows all hold it) */
      int d = d0;
      for (int j = 0; j < nb && d < ix->R; j++) a[d++] = bid[j];
      ix->deg[u] = d;
      added += d - d0;
    }
    if (lerr) {
#pragma omp atomic write
      err = lerr;
    }
    free(cnt);
    free(touched);
  }
  ix->stats.cooc_edges = added;
  free(off);
  free(occ);
  free(root);
  return err;
}

int hi_roar_build(hi_index_t *ix, const hi_keys_t *keys, int64_t n, const float *tq,
                  int64_t m, const int64_t *topk, int nq, const int32_t *cand, int ncand,
                  int threads) {
  ix->n = n;
  memset(ix->deg, 0, (size_t)ix->cap * sizeof(int32_t));
  if (n == 0) return HI_OK;
  float *buf = NULL;
  hi_keys_t k32;
  int32_t *tk = NULL, *bucket = NULL;
  int64_t *boff = NULL;
  spin_t *locks = NULL;
  int err = keys_f32(keys, n, threads, &buf, &k32);
  if (err) return err;
  const int M = ix->p.M;
  gctx_t g = {.ix = ix, .keys = &k32, .metric = ix->p.metric, .alpha = ix->p.alpha, .cap = M};

  /* 1. Training neighbours: the caller's (device-computed) or exact here. */
  double t0 = hi_now();
  if (!topk && tq && m > 0) {
    nq = ix->p.n_q < n ? ix->p.n_q : (int)n;
    tk = malloc((size_t)m * (size_t)nq * sizeof(int32_t));
    if (!tk) goto oom;
    err = hi_exact_topk(&k32, n, tq, m, nq, tk, threads);
    if (err) goto done;
    g.ndist += m * n;
  } else if (topk && m > 0 && nq > 0) {
    tk = malloc((size_t)m * (size_t)nq * sizeof(int32_t));
    if (!tk) goto oom;
    for (int64_t i = 0; i < m * nq; i++) tk[i] = (int32_t)topk[i];
  } else {
    m = 0;
  }
  ix->stats.t_topk = hi_now() - t0;

  /* 2. Projection: each pivot (a training query's nearest key, or its first
   * n_pivots keys) is linked to the pooled neighbours of all queries that
   * share it, pruned to M; then the reverse edges. */
  t0 = hi_now();
  locks = calloc((size_t)n, sizeof(spin_t));
  boff = calloc((size_t)n + 1, sizeof(int64_t));
  if (!locks || !boff) goto oom;
  const int npv = ix->p.n_pivots < nq ? ix->p.n_pivots : nq;
  for (int64_t i = 0; i < m; i++)
    for (int j = 0; j < npv; j++) {
      const int32_t p = tk[i * nq + j];
      if (p >= 0) boff[p + 1]++;
    }
  for (int64_t p = 0; p < n; p++) boff[p + 1] += boff[p];
  bucket = malloc((size_t)(boff[n] > 0 ? boff[n] : 1) * sizeof(int32_t));
  int64_t *fill = calloc((size_t)n, sizeof(int64_t));
  if (!bucket || !fill) {
    free(fill);
    goto oom;
  }
  for (int64_t i = 0; i < m; i++)
    for (int j = 0; j < npv; j++) {
      const int32_t p = tk[i * nq + j];
      if (p >= 0) bucket[boff[p] + fill[p]++] = (int32_t)i;
    }
  free(fill);
  int64_t npivots = 0;
  for (int64_t p = 0; p < n; p++) npivots += boff[p + 1] > boff[p];
  ix->stats.projected_pivots = npivots;
#pragma omp parallel num_threads(hi_threads(threads))
  {
    hi_ws_t ws = {0};
    int lerr = hi_ws_ensure(&ws, 0, 1, 1, ix->dim);
    int32_t *ids = NULL;
    int64_t ids_cap = 0;
#pragma omp for schedule(dynamic, 1)
    for (int64_t p = 0; p < n; p++) {
      const int64_t nb = boff[p + 1] - boff[p];
      if (lerr || nb == 0) continue;
      const int64_t need = nb * nq;
      if (need > ids_cap) {
        int32_t *t = realloc(ids, (size_t)need * sizeof(int32_t));
        if (!t) {
          lerr = HI_ENOMEM;
          continue;
        }
        ids = t;
        ids_cap = need;
      }
      int64_t c = 0;
      for (int64_t b = boff[p]; b < boff[p + 1]; b++)
        for (int j = 0; j < nq; j++) {
          const int32_t v = tk[(int64_t)bucket[b] * nq + j];
          if (v >= 0 && v != p) ids[c++] = v;
        }
      qsort(ids, (size_t)c, sizeof(int32_t), cmp_i32);
      int64_t u = 0;
      for (int64_t i = 0; i < c; i++)
        if (u == 0 || ids[u - 1] != ids[i]) ids[u++] = ids[i];
      if ((lerr = ensure_pool(&ws, u + 1))) continue;
      const float *pv = hi_row(&k32, p);
      float dd[256];
      for (int64_t i0 = 0; i0 < u; i0 += 256) {
        int64_t b = u - i0 < 256 ? u - i0 : 256;
        dist_ids(&k32, g.metric, pv, ids + i0, b, dd);
        for (int64_t i = 0; i < b; i++) ws.pool[i0 + i] = (hi_pair){dd[i], ids[i0 + i]};
      }
      g.ndist += u;
      qsort(ws.pool, (size_t)u, sizeof(hi_pair), cmp_pair);
      ix->deg[p] = select_nbrs(&g, ws.pool, u, ix->adj + (size_t)p * ix->R, 0, M, &ws);
    }
    free(ids);
    if (lerr) {
#pragma omp atomic write
      err = lerr;
    }
    hi_ws_free(&ws);
  }
  if (err) goto done;
  g.locks = locks;
  /* Reverse edges of the projection: snapshot the pivots' lists first, since
   * add_link may rewrite a full list while we walk it. */
  {
    int32_t *snap = malloc((size_t)n * (size_t)ix->R * sizeof(int32_t));
    int32_t *sdeg = malloc((size_t)n * sizeof(int32_t));
    if (!snap || !sdeg) {
      free(snap);
      free(sdeg);
      goto oom;
    }
    memcpy(snap, ix->adj, (size_t)n * (size_t)ix->R * sizeof(int32_t));
    memcpy(sdeg, ix->deg, (size_t)n * sizeof(int32_t));
#pragma omp parallel num_threads(hi_threads(threads))
    {
      hi_ws_t ws = {0};
      if (hi_ws_ensure(&ws, 0, 1, 1, ix->dim) == HI_OK) {
#pragma omp for schedule(dynamic, 64)
        for (int64_t p = 0; p < n; p++)
          for (int j = 0; j < sdeg[p]; j++) add_link(&g, snap[(size_t)p * ix->R + j], (int32_t)p, 0, &ws);
      } else {
#pragma omp atomic write
        err = HI_ENOMEM;
      }
      hi_ws_free(&ws);
    }
    free(snap);
    free(sdeg);
    if (err) goto done;
  }
  ix->stats.t_project = hi_now() - t0;

  /* 3. Connectivity enhancement: every key searches the graph for its own
   * neighbours (list L) and fills its free slots with RNG-selected ones,
   * adding reverse edges, so keys the projection missed become reachable.
   * With `cand` ([n, ncand] ids, -1 padded: e.g. each key's exact nearest
   * keys, computed on the device) those candidates replace the search, which
   * is most of a build's time. */
  t0 = hi_now();
  ix->entry = nearest_to_mean(&k32, n, threads);
#pragma omp parallel num_threads(hi_threads(threads))
  {
    hi_ws_t ws = {0};
    int lerr = HI_OK;
#pragma omp for schedule(dynamic, 16)
    for (int64_t x = 0; x < n; x++) {
      if (lerr) continue;
      int32_t sel[HI_MAX_R];
      int npre = read_nbrs(ix, locks, (int32_t)x, sel);
      if (npre >= M) continue;
      const float *xv = hi_row(&k32, x);
      int64_t np = 0;
      if (cand) {
        if ((lerr = ensure_pool(&ws, ncand + 1))) continue;
        const int32_t *row = cand + (size_t)x * (size_t)ncand;
        for (int i0 = 0; i0 < ncand; i0 += 256) {
          int32_t ids[256];
          float dd[256];
          int b = 0;
          for (int i = i0; i < ncand && i < i0 + 256; i++)
            if (row[i] >= 0 && row[i] < n && row[i] != x) ids[b++] = row[i];
          dist_ids(&k32, g.metric, xv, ids, b, dd);
          for (int i = 0; i < b; i++) ws.pool[np++] = (hi_pair){dd[i], ids[i]};
        }
        g.ndist += np;
      } else {
        int64_t nt;
        int64_t s = search_core(ix, &k32, n, xv, g.metric, ix->p.L, 0, 0, &ws, locks, &nt);
        if (s < 0) {
          lerr = (int)s;
          continue;
        }
        g.ndist += s;
        if ((lerr = ensure_pool(&ws, nt + 1))) continue;
        for (int64_t i = 0; i < nt; i++)
          if (ws.top[i].id != x) ws.pool[np++] = ws.top[i];
      }
      qsort(ws.pool, (size_t)np, sizeof(hi_pair), cmp_pair);
      const int ns = select_nbrs(&g, ws.pool, np, sel, npre, M, &ws);
      spin_lock(&locks[x]);
      int32_t *a = ix->adj + (size_t)x * ix->R;
      for (int j = npre; j < ns; j++) {
        int present = 0;
        for (int t = 0; t < ix->deg[x] && !present; t++) present = a[t] == sel[j];
        if (!present && ix->deg[x] < M) a[ix->deg[x]++] = sel[j];
      }
      spin_unlock(&locks[x]);
      for (int j = npre; j < ns; j++) add_link(&g, sel[j], (int32_t)x, 0, &ws);
    }
    if (lerr) {
#pragma omp atomic write
      err = lerr;
    }
    hi_ws_free(&ws);
  }
  ix->stats.t_connect = hi_now() - t0;
  if (err) goto done;
  t0 = hi_now();
  {
    hi_ws_t ws = {0};
    g.locks = NULL;
    err = repair(&g, n, ix->p.L, &ws);
    hi_ws_free(&ws);
  }
  ix->stats.t_repair = hi_now() - t0;
  if (err) goto done;
  t0 = hi_now();
  if (ix->p.n_cooc > 0 && m > 0) err = cooc_pass(ix, n, tk, m, nq, threads);
  if (!err && ix->p.n_hubs > 0 && m > 0) err = pick_hubs(ix, n, tk, m, nq);
  ix->stats.t_cooc = hi_now() - t0;
  ix->stats.built_nodes = n;
  goto done;
oom:
  err = HI_ENOMEM;
done:
  ix->stats.dist_build = g.ndist;
  free(locks);
  free(boff);
  free(bucket);
  free(tk);
  free(buf);
  return err;
}

/* --- decode-time insert (single writer: the caller holds the write lock) --- */

int hi_graph_insert(hi_index_t *ix, const hi_keys_t *keys, int64_t n_total,
                    const float *queries, int ef_override) {
  gctx_t g = {.ix = ix, .keys = keys, .locks = NULL, .metric = ix->p.metric,
              .alpha = ix->p.alpha, .cap = ix->R, .keep_links = ix->kind == HI_ROAR};
  hi_ws_t ws = {0};
  int err = hi_ws_ensure(&ws, n_total, 1, 1, ix->dim);
  const int64_t n0 = ix->n;
  const int ef = ef_override > 0             ? ef_override
                 : ix->p.ef_insert > 0          ? ix->p.ef_insert
                 : ix->kind == HI_GRAPH ? ix->p.ef_construction
                                        : ix->p.L;
  float *xv = malloc((size_t)ix->dim * sizeof(float));
  if (!xv) err = HI_ENOMEM;
  for (int64_t x = n0; x < n_total && !err; x++) {
    ix->deg[x] = 0;
    ix->n = x + 1;
    if (ix->entry < 0) {
      ix->entry = (int32_t)x;
      continue;
    }
    hi_convert(hi_row(keys, x), keys->dtype, xv, HI_F32, ix->dim);
    const float *qv = ix->kind == HI_ROAR && queries ? queries + (x - n0) * ix->dim : NULL;
    err = link_node(&g, (int32_t)x, xv, qv, x + 1, ef, ix->p.M, &ws);
  }
  free(xv);
  hi_ws_free(&ws);
  return err;
}
