/* One ANN index over one head's keys. Indexes hold ids only: the keys are
 * passed to every call (hi_keys_t), so the query heads of a GQA group share
 * one copy of the keys and the store may reallocate between calls.
 *
 * Thread safety: hi_index_search is read-only and may run concurrently with
 * other searches on the same index. build/insert mutate and must be exclusive;
 * the binding layer enforces that with the index's rwlock. */
#ifndef HI_INDEX_H
#define HI_INDEX_H

#include <pthread.h>
#include <stdatomic.h>

#include "hi_common.h"
#include "hi_heap.h"

typedef struct {
  int M;               /* graph: out-degree chosen for a new node; roar: max out-degree */
  int ef_construction; /* graph: candidate list while inserting */
  int L;               /* roar: candidate list of the connectivity pass and of inserts */
  int ef_insert;       /* graph/roar: candidate list of inserts after the build
                          (0: ef_construction for graph, L for roar) */
  int n_q;             /* roar: training neighbours per query when computed here */
  int n_pivots;        /* roar: how many of each query's top keys act as pivots */
  int n_cooc;          /* roar: extra out-edges per key to the keys that share the most
                          training queries' top-n_q lists with it (0: none) */
  int n_hubs;          /* roar: extra search seeds from the top lists of the last 64
                          training rows and of the last quarter's, spread over key
                          strata (hi_graph.c pick_hubs; 0: none) */
  int metric;          /* hi_metric: neighbour selection / build navigation */
  float alpha;         /* RNG pruning slack (>= 1 keeps more edges; L2 only) */
  int nlist;           /* ivf: number of lists (0: 4*sqrt(n)) */
  int niter;           /* ivf: k-means iterations */
  uint64_t seed;
} hi_params_t;

typedef struct {
  int64_t built_nodes;        /* nodes linked by the build */
  int64_t projected_pivots;   /* roar: distinct pivots */
  int64_t cooc_edges;         /* roar: edges added by the co-occurrence pass */
  int64_t unreachable_fixed;  /* graph/roar: nodes the repair pass linked */
  int64_t dist_build;         /* distance computations spent building */
  double t_topk, t_project, t_connect, t_repair, t_cooc, t_kmeans, t_assign; /* seconds */
} hi_stats_t;

typedef struct {
  int kind;
  int dim;
  hi_params_t p;
  int64_t n;   /* indexed keys: ids 0 .. n-1 */
  int64_t cap; /* rows allocated in the per-node arrays */
  /* graph / roar */
  int R;        /* adjacency stride (max out-degree) */
  int32_t *adj; /* [cap, R] */
  int32_t *deg; /* [cap] */
  int32_t entry;
  int32_t *hubs; /* roar: [nhubs] search seeds besides entry */
  int nhubs;
  /* ivf */
  int nlist;
  float *centroids;  /* [nlist, dim] */
  int32_t *assign;   /* [cap] list of each key */
  int64_t *list_off; /* [nlist + 1] CSR offsets over list_ids */
  int32_t *list_ids; /* [n_built] */
  int64_t n_built;   /* keys in the CSR; keys n_built..n-1 are the tail */
  hi_stats_t stats;
  pthread_rwlock_t lock;
} hi_index_t;

/* Per-thread scratch, grown on demand, reused across queries. */
typedef struct {
  uint64_t *visited;
  int64_t visited_words;
  hi_pair *cand, *top, *pool;
  int64_t cand_cap, top_cap, pool_cap;
  int32_t *ids;
  float *dist;
  int64_t ids_cap;
  float *row; /* dim floats */
  float *row2;
  int64_t row_cap;
} hi_ws_t;

void hi_ws_free(hi_ws_t *ws);
int hi_ws_ensure(hi_ws_t *ws, int64_t n_nodes, int64_t top, int64_t ids, int dim);

int hi_index_init(hi_index_t *ix, int kind, int dim, const hi_params_t *p);
void hi_index_free(hi_index_t *ix);
/* After a failed build: no keys, no entry; an IVF index untrained (its inserts refuse). */
void hi_index_clear(hi_index_t *ix);
int hi_index_reserve(hi_index_t *ix, int64_t cap);
size_t hi_index_nbytes(const hi_index_t *ix);

/* Build over keys 0..n-1 (replaces any previous content). tq/topk: roar's
 * training queries [m, dim] and/or their top-nq ids [m, nq] (either may be
 * NULL; topk ids are validated by the caller). cand: roar's connectivity
 * candidates [n, ncand] (ids, -1 padded; NULL: searched in the graph). */
int hi_index_build(hi_index_t *ix, const hi_keys_t *keys, int64_t n, const float *tq,
                   int64_t m, const int64_t *topk, int nq, const int32_t *cand, int ncand,
                   int threads);

/* Add keys ix->n .. n_total-1. queries [n_total - ix->n, dim] or NULL. ef: the graph
 * inserts' candidate list (0: the index's ef_insert; ivf and flat ignore it). */
int hi_index_insert(hi_index_t *ix, const hi_keys_t *keys, int64_t n_total,
                    const float *queries, int ef, int threads);

/* Top-k by inner product of one query over ids < min(ix->n, keys->nrows).
 * ids/scores [k], best first, padded with -1 / -inf. *scanned counts
 * distance computations. ef: graph/roar
 * candidate list (raised to k), ivf nprobe; <= 0 picks a default. */
int hi_index_search(const hi_index_t *ix, const hi_keys_t *keys, const float *q, int k,
                    int ef, int64_t *ids, float *scores, int64_t *scanned, hi_ws_t *ws);

/* Kind-specific parts (hi_flat.c, hi_ivf.c, hi_graph.c). */
/* Kind searches see nodes [0, n) only (n <= ix->n); results stay in ws->top. */
int hi_flat_search(int64_t n, const hi_keys_t *keys, const float *q, int k, hi_ws_t *ws,
                   int64_t *ntop, int64_t *scanned);
int hi_ivf_build(hi_index_t *ix, const hi_keys_t *keys, int64_t n, int threads);
int hi_ivf_insert(hi_index_t *ix, const hi_keys_t *keys, int64_t n_total);
int hi_ivf_rebuild_lists(hi_index_t *ix);
int hi_ivf_search(const hi_index_t *ix, int64_t n, const hi_keys_t *keys, const float *q, int k,
                  int nprobe, hi_ws_t *ws, int64_t *ntop, int64_t *scanned);
int hi_graph_build(hi_index_t *ix, const hi_keys_t *keys, int64_t n, int threads);
int hi_roar_build(hi_index_t *ix, const hi_keys_t *keys, int64_t n, const float *tq,
                  int64_t m, const int64_t *topk, int nq, const int32_t *cand, int ncand,
                  int threads);
int hi_graph_insert(hi_index_t *ix, const hi_keys_t *keys, int64_t n_total,
                    const float *queries, int ef);
int hi_graph_search(const hi_index_t *ix, int64_t n, const hi_keys_t *keys, const float *q,
                    int k, int ef, hi_ws_t *ws, int64_t *ntop, int64_t *scanned);

/* Exact top-k of many queries over keys 0..n-1, threaded over queries:
 * out [m, k] ids (-1 padded). Used for roar's training neighbours. */
int hi_exact_topk(const hi_keys_t *keys, int64_t n, const float *q, int64_t m, int k,
                  int32_t *out, int threads);

double hi_now(void);

#endif
