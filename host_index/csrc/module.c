/* CPython binding of the host_index C core (module host_index._core).
 *
 * Arrays cross as buffers (no NumPy C API, so the build needs no numpy
 * headers). The Python wrapper validates dtypes, shapes and values first;
 * this layer re-checks every buffer size so no call can read or write out of
 * bounds, releases the GIL around all computation, and maps hi_err codes to
 * exceptions. Index methods take the index's rwlock (shared for search,
 * exclusive for build/insert/restore) after releasing the GIL, so a thread
 * never blocks on the lock while holding the GIL. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "hi_attend.h"
#include "hi_gate.h"
#include "hi_index.h"
#include "hi_kernels.h"
#include "hi_slots.h"
#include "hi_topk.h"

#define RAW16_REFUSED \
  "dtype raw16 holds opaque 16-bit words: no search, attention or conversion reads it"

static int raise_err(int err) {
  switch (err) {
    case HI_OK: return 0;
    case HI_ENOMEM: PyErr_NoMemory(); break;
    case HI_ECONCUR:
      PyErr_SetString(PyExc_RuntimeError,
                      "index is larger than the key/value buffer it was given: the store "
                      "was modified while this call ran; lock appends against searches");
      break;
    case HI_ENONFINITE: PyErr_SetString(PyExc_ValueError, "non-finite value"); break;
    case HI_EDTYPE: PyErr_SetString(PyExc_ValueError, RAW16_REFUSED); break;
    default: PyErr_SetString(PyExc_ValueError, "invalid argument to host_index C core"); break;
  }
  return -1;
}

/* Sizes for get_buf: the product (sum) of non-negative operands, or -1 when an operand is
 * negative or the result overflows, which get_buf refuses (a wrapped size would let a short
 * buffer pass the check). */
static Py_ssize_t mul2(Py_ssize_t a, Py_ssize_t b) {
  Py_ssize_t r;
  if (a < 0 || b < 0 || __builtin_mul_overflow(a, b, &r)) return -1;
  return r;
}
static Py_ssize_t mul3(Py_ssize_t a, Py_ssize_t b, Py_ssize_t c) { return mul2(mul2(a, b), c); }
static Py_ssize_t mul4(Py_ssize_t a, Py_ssize_t b, Py_ssize_t c, Py_ssize_t d) { return mul2(mul3(a, b, c), d); }
static Py_ssize_t add2(Py_ssize_t a, Py_ssize_t b) {
  Py_ssize_t r;
  if (a < 0 || b < 0 || __builtin_add_overflow(a, b, &r)) return -1;
  return r;
}

/* C-contiguous buffer of at least `need` bytes (writable when asked); need < 0: a size that
 * overflowed (mul2...). */
static int get_buf(PyObject *o, Py_buffer *b, int writable, Py_ssize_t need, const char *what) {
  if (need < 0) {
    PyErr_Format(PyExc_ValueError, "%s: sizes out of range", what);
    return -1;
  }
  if (PyObject_GetBuffer(o, b, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0)
    return -1;
  if (b->len < need) {
    PyErr_Format(PyExc_ValueError, "%s: buffer has %zd bytes, needs %zd", what, b->len, need);
    PyBuffer_Release(b);
    return -1;
  }
  return 0;
}

/* The dtypes of a routine that reads values as numbers: not raw16. */
static int check_dtype(int dtype) {
  if (dtype == HI_F32 || dtype == HI_F16 || dtype == HI_BF16) return 0;
  if (dtype == HI_RAW16)
    PyErr_SetString(PyExc_ValueError, RAW16_REFUSED);
  else
    PyErr_Format(PyExc_ValueError, "unknown dtype code %d", dtype);
  return -1;
}

/* The dtypes of a copy (gather; convert and count_bad of equal dtypes): raw16 too. */
static int check_copy_dtype(int dtype) { return dtype == HI_RAW16 ? 0 : check_dtype(dtype); }

/* convert / count_bad pairs: raw16 goes only to raw16, as a plain copy. */
static int check_dtype_pair(int sdt, int ddt) {
  if (check_copy_dtype(sdt) < 0 || check_copy_dtype(ddt) < 0) return -1;
  if ((sdt == HI_RAW16) == (ddt == HI_RAW16)) return 0;
  PyErr_SetString(PyExc_ValueError, RAW16_REFUSED);
  return -1;
}

/* Keys of one head inside a [H, cap, dim] buffer, of which rows < nrows are
 * valid. */
static int keys_view(PyObject *o, Py_buffer *b, int dtype, int dim, Py_ssize_t head,
                     Py_ssize_t cap, Py_ssize_t nrows, hi_keys_t *kv) {
  if (check_dtype(dtype) < 0) return -1;
  if (head < 0 || head == PY_SSIZE_T_MAX || cap < 0 || dim <= 0 || nrows < 0 || nrows > cap) {
    PyErr_SetString(PyExc_ValueError, "bad head, capacity, length or dim");
    return -1;
  }
  const Py_ssize_t rowb = (Py_ssize_t)dim * (Py_ssize_t)hi_itemsize(dtype);
  if (get_buf(o, b, 0, mul3(head + 1, cap, rowb), "keys") < 0) return -1;
  kv->base = (const char *)b->buf + head * cap * rowb;
  kv->dtype = dtype;
  kv->dim = dim;
  kv->nrows = nrows;
  kv->room = cap;
  return 0;
}

/* ---- Index type ---------------------------------------------------------- */

typedef struct {
  PyObject_HEAD hi_index_t ix;
  int ready;
} IndexObject;

static void Index_dealloc(IndexObject *self) {
  if (self->ready) hi_index_free(&self->ix);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

static int Index_init(IndexObject *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"kind", "dim", "M", "ef_construction", "L", "n_q", "n_pivots",
                           "metric", "alpha", "nlist", "niter", "seed", "ef_insert", "n_cooc",
                           "n_hubs", NULL};
  int kind, dim, M = 16, efc = 200, L = 100, nq = 100, npv = 1, metric = HI_L2, nlist = 0,
                 niter = 10, efi = 0, ncooc = 0, nhubs = 0;
  float alpha = 1.f;
  unsigned long long seed = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "ii|$iiiiiifiiKiii", kwlist, &kind, &dim, &M,
                                   &efc, &L, &nq, &npv, &metric, &alpha, &nlist, &niter, &seed,
                                   &efi, &ncooc, &nhubs))
    return -1;
  if (kind < HI_FLAT || kind > HI_ROAR || dim <= 0 || dim > 2048 || M < 1 || M > 256 ||
      efc < 1 || L < 1 || nq < 1 || npv < 1 || efi < 0 || ncooc < 0 || ncooc > 256 || nhubs < 0 || nhubs > 4096 || (metric != HI_L2 && metric != HI_IP) ||
      nlist < 0 || niter < 0 || !(alpha >= 1.f)) {
    PyErr_SetString(PyExc_ValueError, "invalid index parameters");
    return -1;
  }
  if (self->ready) { /* freeing under a search running without the GIL would be a use after free */
    PyErr_SetString(PyExc_RuntimeError, "Index already initialized");
    return -1;
  }
  hi_params_t p = {.M = M, .ef_construction = efc, .ef_insert = efi, .L = L, .n_q = nq,
                   .n_pivots = npv, .n_cooc = ncooc, .n_hubs = nhubs, .metric = metric, .alpha = alpha, .nlist = nlist,
                   .niter = niter, .seed = seed};
  self->ready = 0;
  if (hi_index_init(&self->ix, kind, dim, &p) != HI_OK) {
    PyErr_NoMemory();
    return -1;
  }
  self->ready = 1;
  return 0;
}

static int ready(IndexObject *self) {
  if (self->ready) return 0;
  PyErr_SetString(PyExc_RuntimeError, "Index not initialized");
  return -1;
}

/* build(keys, dtype, head, cap, n, train_queries|None, m, train_topk|None, nq,
 *       connect_candidates|None, ncand, threads) */
static PyObject *Index_build(IndexObject *self, PyObject *args) {
  PyObject *ko, *tqo, *tko, *cco;
  int dtype, nq, ncand, threads;
  Py_ssize_t head, cap, n, m;
  if (!PyArg_ParseTuple(args, "OinnnOnOiOii", &ko, &dtype, &head, &cap, &n, &tqo, &m, &tko, &nq,
                        &cco, &ncand, &threads) ||
      ready(self) < 0)
    return NULL;
  if (n < 0 || n > cap || m < 0 || nq < 0 || ncand < 0) {
    PyErr_SetString(PyExc_ValueError, "invalid sizes");
    return NULL;
  }
  Py_buffer kb, qb = {0}, tb = {0}, cb = {0};
  hi_keys_t kv;
  if (keys_view(ko, &kb, dtype, self->ix.dim, head, cap, n, &kv) < 0) return NULL;
  const float *tq = NULL;
  const int64_t *tk = NULL;
  const int32_t *cand = NULL;
  if (tqo != Py_None) {
    if (get_buf(tqo, &qb, 0, mul3(m, self->ix.dim, 4), "train_queries") < 0) goto fail;
    tq = qb.buf;
  }
  if (tko != Py_None) {
    if (get_buf(tko, &tb, 0, mul3(m, nq, 8), "train_topk") < 0) goto fail;
    tk = tb.buf;
    for (Py_ssize_t i = 0; i < m * nq; i++)
      if (tk[i] < -1 || tk[i] >= n) {
        PyErr_SetString(PyExc_ValueError, "train_topk id out of range");
        goto fail;
      }
  }
  if (cco != Py_None && ncand > 0) { /* ids outside [0, n) are skipped by the build */
    if (get_buf(cco, &cb, 0, mul3(n, ncand, 4), "connect_candidates") < 0) goto fail;
    cand = cb.buf;
  }
  int err;
  Py_BEGIN_ALLOW_THREADS pthread_rwlock_wrlock(&self->ix.lock);
  err = hi_index_build(&self->ix, &kv, n, tq, m, tk, nq, cand, cand ? ncand : 0, threads);
  if (err) hi_index_clear(&self->ix); /* a failed build leaves an empty index (IVF: untrained) */
  pthread_rwlock_unlock(&self->ix.lock);
  Py_END_ALLOW_THREADS PyBuffer_Release(&kb);
  if (qb.obj) PyBuffer_Release(&qb);
  if (tb.obj) PyBuffer_Release(&tb);
  if (cb.obj) PyBuffer_Release(&cb);
  if (raise_err(err) < 0) return NULL;
  Py_RETURN_NONE;
fail:
  PyBuffer_Release(&kb);
  if (qb.obj) PyBuffer_Release(&qb);
  if (cb.obj) PyBuffer_Release(&cb);
  if (tb.obj) PyBuffer_Release(&tb);
  return NULL;
}

/* search(keys, dtype, head, cap, nrows, queries, nqry, k, ef, out_ids, out_scores,
 *        out_scanned, threads) */
static PyObject *Index_search(IndexObject *self, PyObject *args) {
  PyObject *ko, *qo, *io, *so, *co;
  int dtype, k, ef, threads;
  Py_ssize_t head, cap, nrows, nqry;
  if (!PyArg_ParseTuple(args, "OinnnOniiOOOi", &ko, &dtype, &head, &cap, &nrows, &qo, &nqry, &k,
                        &ef, &io, &so, &co, &threads) ||
      ready(self) < 0)
    return NULL;
  if (nqry < 0 || k < 0) {
    PyErr_SetString(PyExc_ValueError, "negative query count or k");
    return NULL;
  }
  const int dim = self->ix.dim;
  Py_buffer kb, qb, ib, sb, cb;
  hi_keys_t kv;
  if (keys_view(ko, &kb, dtype, dim, head, cap, nrows, &kv) < 0) return NULL;
  if (get_buf(qo, &qb, 0, mul3(nqry, dim, 4), "queries") < 0) goto f0;
  if (get_buf(io, &ib, 1, mul3(nqry, k, 8), "ids") < 0) goto f1;
  if (get_buf(so, &sb, 1, mul3(nqry, k, 4), "scores") < 0) goto f2;
  if (get_buf(co, &cb, 1, mul2(nqry, 8), "scanned") < 0) goto f3;
  int err = HI_OK;
  Py_BEGIN_ALLOW_THREADS pthread_rwlock_rdlock(&self->ix.lock);
  const float *q = qb.buf;
  int64_t *ids = ib.buf, *scn = cb.buf;
  float *sc = sb.buf;
  hi_index_t *ix = &self->ix;
#pragma omp parallel num_threads(hi_threads(threads))
  {
    hi_ws_t ws = {0};
    int lerr = HI_OK;
#pragma omp for schedule(dynamic, 1)
    for (Py_ssize_t i = 0; i < nqry; i++)
      if (!lerr) lerr = hi_index_search(ix, &kv, q + i * dim, k, ef, ids + i * k, sc + i * k, scn + i, &ws);
    if (lerr) {
#pragma omp atomic write
      err = lerr;
    }
    hi_ws_free(&ws);
  }
  pthread_rwlock_unlock(&self->ix.lock);
  Py_END_ALLOW_THREADS PyBuffer_Release(&cb);
  PyBuffer_Release(&sb);
  PyBuffer_Release(&ib);
  PyBuffer_Release(&qb);
  PyBuffer_Release(&kb);
  if (raise_err(err) < 0) return NULL;
  Py_RETURN_NONE;
f3:
  PyBuffer_Release(&sb);
f2:
  PyBuffer_Release(&ib);
f1:
  PyBuffer_Release(&qb);
f0:
  PyBuffer_Release(&kb);
  return NULL;
}

/* insert(keys, dtype, head, cap, n_total, queries|None, threads) */
static PyObject *Index_insert(IndexObject *self, PyObject *args) {
  PyObject *ko, *qo;
  int dtype, threads;
  Py_ssize_t head, cap, n_total;
  if (!PyArg_ParseTuple(args, "OinnnOi", &ko, &dtype, &head, &cap, &n_total, &qo, &threads) ||
      ready(self) < 0)
    return NULL;
  if (n_total < 0 || n_total > cap) {
    PyErr_SetString(PyExc_ValueError, "n_total out of range");
    return NULL;
  }
  Py_buffer kb, qb = {0};
  hi_keys_t kv;
  if (keys_view(ko, &kb, dtype, self->ix.dim, head, cap, n_total, &kv) < 0) return NULL;
  const float *q = NULL;
  if (qo != Py_None) {
    /* Rows for the keys not yet indexed; size re-checked under the lock. */
    if (PyObject_GetBuffer(qo, &qb, PyBUF_C_CONTIGUOUS) < 0) {
      PyBuffer_Release(&kb);
      return NULL;
    }
    q = qb.buf;
  }
  int err;
  Py_BEGIN_ALLOW_THREADS pthread_rwlock_wrlock(&self->ix.lock);
  if (q && qb.len < (Py_ssize_t)((n_total - self->ix.n) * self->ix.dim * 4))
    err = HI_EINVAL;
  else
    err = hi_index_insert(&self->ix, &kv, n_total, q, 0, threads);
  pthread_rwlock_unlock(&self->ix.lock);
  Py_END_ALLOW_THREADS PyBuffer_Release(&kb);
  if (qb.obj) PyBuffer_Release(&qb);
  if (raise_err(err) < 0) return NULL;
  Py_RETURN_NONE;
}

/* Copy of the state arrays as bytes, for persistence. */
static PyObject *Index_export(IndexObject *self, PyObject *unused) {
  (void)unused;
  if (ready(self) < 0) return NULL;
  hi_index_t *ix = &self->ix;
  Py_BEGIN_ALLOW_THREADS pthread_rwlock_rdlock(&ix->lock);
  Py_END_ALLOW_THREADS PyObject *d = NULL;
  const int graph = ix->kind == HI_GRAPH || ix->kind == HI_ROAR;
  const Py_ssize_t n = (Py_ssize_t)ix->n;
  /* Slots past a node's degree are scratch: write them as -1 so a saved
   * file is a deterministic function of the graph. */
  PyObject *adj = PyBytes_FromStringAndSize(NULL, graph ? n * ix->R * 4 : 0);
  if (adj && graph) {
    int32_t *a = (int32_t *)PyBytes_AS_STRING(adj);
    for (Py_ssize_t i = 0; i < n; i++)
      for (int j = 0; j < ix->R; j++)
        a[i * ix->R + j] = j < ix->deg[i] ? ix->adj[(size_t)i * ix->R + j] : -1;
  }
  PyObject *deg = PyBytes_FromStringAndSize(graph ? (const char *)ix->deg : "", graph ? n * 4 : 0);
  const int ivf = ix->kind == HI_IVF && ix->nlist > 0;
  PyObject *cen = PyBytes_FromStringAndSize(ivf ? (const char *)ix->centroids : "",
                                            ivf ? (Py_ssize_t)ix->nlist * ix->dim * 4 : 0);
  PyObject *asg = PyBytes_FromStringAndSize(ivf ? (const char *)ix->assign : "", ivf ? n * 4 : 0);
  PyObject *hub = PyBytes_FromStringAndSize(ix->nhubs ? (const char *)ix->hubs : "",
                                            (Py_ssize_t)ix->nhubs * 4);
  if (adj && deg && cen && asg && hub)
    d = Py_BuildValue("{s:n,s:i,s:i,s:i,s:O,s:O,s:O,s:O,s:O}", "n", n, "entry", ix->entry, "R",
                      ix->R, "nlist", ix->nlist, "adj", adj, "deg", deg, "centroids", cen,
                      "assign", asg, "hubs", hub);
  pthread_rwlock_unlock(&ix->lock);
  Py_XDECREF(adj);
  Py_XDECREF(deg);
  Py_XDECREF(cen);
  Py_XDECREF(asg);
  Py_XDECREF(hub);
  return d;
}

/* restore(n, entry, nlist, adj, deg, centroids, assign): inverse of export. */
static PyObject *Index_restore(IndexObject *self, PyObject *args) {
  Py_ssize_t n;
  int entry, nlist;
  Py_buffer adj, deg, cen, asg, hub = {0};
  if (ready(self) < 0) return NULL;
  if (!PyArg_ParseTuple(args, "niiy*y*y*y*|y*", &n, &entry, &nlist, &adj, &deg, &cen, &asg,
                        &hub))
    return NULL;
  const Py_ssize_t nh = hub.buf ? hub.len / 4 : 0;
  hi_index_t *ix = &self->ix;
  const int graph = ix->kind == HI_GRAPH || ix->kind == HI_ROAR;
  const int ivf = ix->kind == HI_IVF;
  int err = HI_OK;
  const char *why = NULL;
  if (n < 0 || n > INT32_MAX - 1) why = "bad n";
  else if (graph && (adj.len != n * ix->R * 4 || deg.len != n * 4)) why = "bad graph arrays";
  else if (graph && (entry < -1 || entry >= n || (n > 0 && entry < 0))) why = "bad entry";
  else if (ivf && (nlist < 0 || nlist > n + 1 || cen.len != (Py_ssize_t)nlist * ix->dim * 4 ||
                   asg.len != (nlist > 0 ? n * 4 : 0)))
    why = "bad ivf arrays";
  else if (hub.buf && (hub.len % 4 || nh > 4096 || (nh > 0 && ix->kind != HI_ROAR)))
    why = "bad hubs";
  if (!why && nh > 0) {
    const int32_t *hb = hub.buf;
    for (Py_ssize_t i = 0; i < nh && !why; i++)
      if (hb[i] < 0 || hb[i] >= n) why = "hub out of range";
  }
  if (!why && graph) {
    const int32_t *a = adj.buf, *dg = deg.buf;
    for (Py_ssize_t i = 0; i < n && !why; i++) {
      if (dg[i] < 0 || dg[i] > ix->R) why = "bad degree";
      for (int j = 0; j < (why ? 0 : dg[i]); j++)
        if (a[i * ix->R + j] < 0 || a[i * ix->R + j] >= n) why = "edge out of range";
    }
  }
  if (!why && ivf) {
    const int32_t *as = asg.buf;
    for (Py_ssize_t i = 0; i < (nlist > 0 ? n : 0) && !why; i++)
      if (as[i] < 0 || as[i] >= nlist) why = "list id out of range";
    if (!why && nlist == 0 && n > 0) why = "ivf without lists";
  }
  if (!why) {
    Py_BEGIN_ALLOW_THREADS pthread_rwlock_wrlock(&ix->lock);
    ix->n = 0;
    err = hi_index_reserve(ix, n > 0 ? n : 1);
    if (!err && graph) {
      memcpy(ix->adj, adj.buf, (size_t)adj.len);
      memcpy(ix->deg, deg.buf, (size_t)deg.len);
      ix->entry = entry;
      free(ix->hubs);
      ix->hubs = NULL;
      ix->nhubs = 0;
      if (nh > 0) {
        ix->hubs = malloc((size_t)nh * sizeof(int32_t));
        if (!ix->hubs) err = HI_ENOMEM;
        else {
          memcpy(ix->hubs, hub.buf, (size_t)nh * sizeof(int32_t));
          ix->nhubs = (int)nh;
        }
      }
    }
    if (!err && ivf) {
      free(ix->centroids);
      ix->centroids = malloc((size_t)(cen.len > 0 ? cen.len : 1));
      if (!ix->centroids) err = HI_ENOMEM;
      if (!err) {
        memcpy(ix->centroids, cen.buf, (size_t)cen.len);
        memcpy(ix->assign, asg.buf, (size_t)asg.len);
        ix->nlist = nlist;
      }
    }
    if (!err) ix->n = n;
    if (!err && ivf && nlist > 0) err = hi_ivf_rebuild_lists(ix);
    if (err) ix->n = 0;
    pthread_rwlock_unlock(&ix->lock);
    Py_END_ALLOW_THREADS
  }
  PyBuffer_Release(&adj);
  PyBuffer_Release(&deg);
  PyBuffer_Release(&cen);
  PyBuffer_Release(&asg);
  if (hub.buf) PyBuffer_Release(&hub);
  if (why) {
    PyErr_Format(PyExc_ValueError, "corrupt index state: %s", why);
    return NULL;
  }
  if (raise_err(err) < 0) return NULL;
  Py_RETURN_NONE;
}

/* reserve(n): node arrays for n keys, so inserts up to n do not grow (copy) them. */
static PyObject *Index_reserve(IndexObject *self, PyObject *args) {
  Py_ssize_t n;
  if (ready(self) < 0) return NULL;
  if (!PyArg_ParseTuple(args, "n", &n)) return NULL;
  if (n < 0 || n > INT32_MAX - 1) {
    PyErr_SetString(PyExc_ValueError, "reserve: n out of range");
    return NULL;
  }
  int err;
  Py_BEGIN_ALLOW_THREADS pthread_rwlock_wrlock(&self->ix.lock);
  err = hi_index_reserve(&self->ix, n > 0 ? n : 1);
  pthread_rwlock_unlock(&self->ix.lock);
  Py_END_ALLOW_THREADS
  if (raise_err(err) < 0) return NULL;
  Py_RETURN_NONE;
}

static PyObject *Index_stats(IndexObject *self, PyObject *unused) {
  (void)unused;
  if (ready(self) < 0) return NULL;
  const hi_stats_t *s = &self->ix.stats;
  return Py_BuildValue("{s:L,s:L,s:L,s:L,s:L,s:d,s:d,s:d,s:d,s:d,s:d,s:d}", "built_nodes",
                       (long long)s->built_nodes, "projected_pivots",
                       (long long)s->projected_pivots, "cooc_edges", (long long)s->cooc_edges,
                       "unreachable_fixed",
                       (long long)s->unreachable_fixed, "dist_build", (long long)s->dist_build,
                       "t_topk", s->t_topk, "t_project", s->t_project, "t_connect",
                       s->t_connect, "t_repair", s->t_repair, "t_cooc", s->t_cooc, "t_kmeans", s->t_kmeans,
                       "t_assign", s->t_assign);
}

static PyObject *Index_get_n(IndexObject *self, void *c) {
  (void)c;
  return PyLong_FromLongLong(self->ready ? (long long)self->ix.n : 0);
}
static PyObject *Index_get_nbytes(IndexObject *self, void *c) {
  (void)c;
  return PyLong_FromSize_t(self->ready ? hi_index_nbytes(&self->ix) : 0);
}
static PyObject *Index_get_nlist(IndexObject *self, void *c) {
  (void)c;
  return PyLong_FromLong(self->ready ? self->ix.nlist : 0);
}

static PyMethodDef Index_methods[] = {
    {"build", (PyCFunction)Index_build, METH_VARARGS, "Build over keys 0..n-1."},
    {"search", (PyCFunction)Index_search, METH_VARARGS, "Top-k by inner product."},
    {"insert", (PyCFunction)Index_insert, METH_VARARGS, "Index keys n..n_total-1."},
    {"export", (PyCFunction)Index_export, METH_NOARGS, "State arrays as bytes."},
    {"restore", (PyCFunction)Index_restore, METH_VARARGS, "Inverse of export."},
    {"reserve", (PyCFunction)Index_reserve, METH_VARARGS, "Node arrays for n keys."},
    {"stats", (PyCFunction)Index_stats, METH_NOARGS, "Build statistics."},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef Index_getset[] = {
    {"n", (getter)Index_get_n, NULL, "indexed keys", NULL},
    {"nbytes", (getter)Index_get_nbytes, NULL, "bytes allocated", NULL},
    {"nlist", (getter)Index_get_nlist, NULL, "ivf lists", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyTypeObject IndexType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "host_index._core.Index",
    .tp_basicsize = sizeof(IndexObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One ANN index over one head's keys (ids only; keys passed per call).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Index_init,
    .tp_dealloc = (destructor)Index_dealloc,
    .tp_methods = Index_methods,
    .tp_getset = Index_getset,
};

/* ---- module functions ---------------------------------------------------- */

/* Per-sequence [Hkv, cap, dim] key (and value) buffers of one layer as
 * B * Hkv views: the buffers are acquired into bufs[*nb...] (released by the
 * caller). vbs may be NULL (keys only). */
static int layer_views(PyObject *kbs, PyObject *vbs, PyObject *caps, PyObject *lens, int dtype,
                       int Hkv, int dim, int B, Py_buffer *bufs, int *nb, hi_keys_t *kv,
                       hi_keys_t *vv) {
  for (int b = 0; b < B; b++) {
    Py_ssize_t cap = PyLong_AsSsize_t(PyTuple_GET_ITEM(caps, b));
    Py_ssize_t len = PyLong_AsSsize_t(PyTuple_GET_ITEM(lens, b));
    if (cap < 0 || len < 0) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "negative capacity");
      return -1;
    }
    for (int w = 0; w < (vbs ? 2 : 1); w++) {
      PyObject *o = PyTuple_GET_ITEM(w ? vbs : kbs, b);
      hi_keys_t tmp;
      if (keys_view(o, &bufs[*nb], dtype, dim, Hkv - 1, cap, len, &tmp) < 0) return -1;
      (*nb)++;
      for (int h = 0; h < Hkv; h++) {
        hi_keys_t *t = w ? &vv[b * Hkv + h] : &kv[b * Hkv + h];
        *t = tmp;
        t->base = (const char *)bufs[*nb - 1].buf + (size_t)h * cap * dim * hi_itemsize(dtype);
      }
    }
  }
  return 0;
}

/* The index objects of a tuple, each of this dim, into idx[]. */
static int index_ptrs(PyObject *ixs, int dim, hi_index_t **idx, const char *who) {
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(ixs); i++) {
    PyObject *o = PyTuple_GET_ITEM(ixs, i);
    if (!PyObject_TypeCheck(o, &IndexType) || !((IndexObject *)o)->ready ||
        ((IndexObject *)o)->ix.dim != dim) {
      PyErr_Format(PyExc_TypeError, "%s: indexes must be Index objects of this dim", who);
      return -1;
    }
    idx[i] = &((IndexObject *)o)->ix;
  }
  return 0;
}

/* attend(indexes, kbufs, vbufs, caps, lens, dtype, Hkv, dim, queries, B, Hq, per_q, k, ef,
 *        scale, out_o, out_lse, out_scanned, out_ids|None, threads) */
static PyObject *py_attend(PyObject *mod, PyObject *args) {
  (void)mod;
  PyObject *ixs, *kbs, *vbs, *caps, *lens, *qo, *oo, *lo, *so, *io;
  int dtype, Hkv, dim, B, Hq, per_q, k, ef, threads;
  float scale;
  if (!PyArg_ParseTuple(args, "O!O!O!O!O!iiiOiipiifOOOOi", &PyTuple_Type, &ixs, &PyTuple_Type,
                        &kbs, &PyTuple_Type, &vbs, &PyTuple_Type, &caps, &PyTuple_Type, &lens,
                        &dtype, &Hkv, &dim, &qo, &B, &Hq, &per_q, &k, &ef, &scale, &oo, &lo, &so,
                        &io, &threads))
    return NULL;
  if (B < 1 || Hkv < 1 || Hq < Hkv || Hq % Hkv || k < 0 || dim < 1 ||
      PyTuple_GET_SIZE(ixs) != (Py_ssize_t)B * (per_q ? Hq : Hkv) ||
      PyTuple_GET_SIZE(kbs) != B || PyTuple_GET_SIZE(vbs) != B || PyTuple_GET_SIZE(caps) != B ||
      PyTuple_GET_SIZE(lens) != B ||
      check_dtype(dtype) < 0) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "attend: inconsistent arguments");
    return NULL;
  }
  const Py_ssize_t nix = PyTuple_GET_SIZE(ixs);
  hi_index_t **idx = PyMem_Calloc((size_t)nix, sizeof *idx);
  hi_keys_t *kv = PyMem_Calloc((size_t)B * Hkv, sizeof *kv);
  hi_keys_t *vv = PyMem_Calloc((size_t)B * Hkv, sizeof *vv);
  Py_buffer *bufs = PyMem_Calloc((size_t)2 * B + 5, sizeof(Py_buffer));
  int nb = 0;
  PyObject *ret = NULL;
  if (!idx || !kv || !vv || !bufs) {
    PyErr_NoMemory();
    goto out;
  }
  if (index_ptrs(ixs, dim, idx, "attend") < 0) goto out;
  if (layer_views(kbs, vbs, caps, lens, dtype, Hkv, dim, B, bufs, &nb, kv, vv) < 0) goto out;
  const Py_ssize_t T = (Py_ssize_t)B * Hq;
  if (get_buf(qo, &bufs[nb], 0, mul3(T, dim, 4), "queries") < 0) goto out;
  const float *q = bufs[nb++].buf;
  if (get_buf(oo, &bufs[nb], 1, mul3(T, dim, 4), "o") < 0) goto out;
  float *o = bufs[nb++].buf;
  if (get_buf(lo, &bufs[nb], 1, mul2(T, 4), "lse") < 0) goto out;
  float *lse = bufs[nb++].buf;
  if (get_buf(so, &bufs[nb], 1, mul2(T, 8), "scanned") < 0) goto out;
  int64_t *scn = bufs[nb++].buf;
  int64_t *ids = NULL;
  if (io != Py_None) {
    if (get_buf(io, &bufs[nb], 1, mul3(T, k, 8), "ids") < 0) goto out;
    ids = bufs[nb++].buf;
  }
  int err;
  Py_BEGIN_ALLOW_THREADS HI_FOREGROUND(err, hi_attend(idx, kv, vv, B, Hq, Hkv, per_q, q, k, ef, scale,
                                                     o, lse, scn, ids, threads));
  Py_END_ALLOW_THREADS if (raise_err(err) == 0) ret = Py_NewRef(Py_None);
out:
  for (int i = 0; i < nb; i++) PyBuffer_Release(&bufs[i]);
  PyMem_Free(idx);
  PyMem_Free(kv);
  PyMem_Free(vv);
  PyMem_Free(bufs);
  return ret;
}

/* search(indexes, kbufs, caps, lens, dtype, Hkv, dim, queries, B, Hq, per_q, k, ef,
 *        mask|None, out_ids, out_scanned, threads) */
static PyObject *py_search(PyObject *mod, PyObject *args) {
  (void)mod;
  PyObject *ixs, *kbs, *caps, *lens, *qo, *mo, *io, *so;
  int dtype, Hkv, dim, B, Hq, per_q, k, ef, threads;
  if (!PyArg_ParseTuple(args, "O!O!O!O!iiiOiipiiOOOi", &PyTuple_Type, &ixs, &PyTuple_Type, &kbs,
                        &PyTuple_Type, &caps, &PyTuple_Type, &lens, &dtype, &Hkv, &dim, &qo, &B,
                        &Hq, &per_q, &k, &ef, &mo, &io, &so, &threads))
    return NULL;
  if (B < 1 || Hkv < 1 || Hq < Hkv || Hq % Hkv || k < 0 || dim < 1 ||
      PyTuple_GET_SIZE(ixs) != (Py_ssize_t)B * (per_q ? Hq : Hkv) ||
      PyTuple_GET_SIZE(kbs) != B || PyTuple_GET_SIZE(caps) != B || PyTuple_GET_SIZE(lens) != B ||
      check_dtype(dtype) < 0) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "search: inconsistent arguments");
    return NULL;
  }
  hi_index_t **idx = PyMem_Calloc((size_t)PyTuple_GET_SIZE(ixs), sizeof *idx);
  hi_keys_t *kv = PyMem_Calloc((size_t)B * Hkv, sizeof *kv);
  Py_buffer *bufs = PyMem_Calloc((size_t)B + 4, sizeof(Py_buffer));
  int nb = 0;
  PyObject *ret = NULL;
  if (!idx || !kv || !bufs) {
    PyErr_NoMemory();
    goto out;
  }
  if (index_ptrs(ixs, dim, idx, "search") < 0) goto out;
  if (layer_views(kbs, NULL, caps, lens, dtype, Hkv, dim, B, bufs, &nb, kv, NULL) < 0) goto out;
  const Py_ssize_t T = (Py_ssize_t)B * Hq;
  if (get_buf(qo, &bufs[nb], 0, mul3(T, dim, 4), "queries") < 0) goto out;
  const float *q = bufs[nb++].buf;
  const uint8_t *mask = NULL;
  if (mo != Py_None) {
    if (get_buf(mo, &bufs[nb], 0, T, "mask") < 0) goto out;
    mask = bufs[nb++].buf;
  }
  if (get_buf(io, &bufs[nb], 1, mul3(T, k, 8), "ids") < 0) goto out;
  int64_t *ids = bufs[nb++].buf;
  if (get_buf(so, &bufs[nb], 1, mul2(T, 8), "scanned") < 0) goto out;
  int64_t *scn = bufs[nb++].buf;
  int err;
  Py_BEGIN_ALLOW_THREADS HI_FOREGROUND(err, hi_search_layer(idx, kv, B, Hq, Hkv, per_q, q, k, ef, mask,
                                                           ids, scn, threads));
  Py_END_ALLOW_THREADS if (raise_err(err) == 0) ret = Py_NewRef(Py_None);
out:
  for (int i = 0; i < nb; i++) PyBuffer_Release(&bufs[i]);
  PyMem_Free(idx);
  PyMem_Free(kv);
  PyMem_Free(bufs);
  return ret;
}

/* attend_ids(kbufs, vbufs, caps, lens, dtype, Hkv, dim, queries, B, Hq, ids, n, scale,
 *            out_o, out_lse, threads) */
static PyObject *py_attend_ids(PyObject *mod, PyObject *args) {
  (void)mod;
  PyObject *kbs, *vbs, *caps, *lens, *qo, *io, *oo, *lo;
  int dtype, Hkv, dim, B, Hq, threads;
  Py_ssize_t n;
  float scale;
  if (!PyArg_ParseTuple(args, "O!O!O!O!iiiOiiOnfOOi", &PyTuple_Type, &kbs, &PyTuple_Type, &vbs,
                        &PyTuple_Type, &caps, &PyTuple_Type, &lens, &dtype, &Hkv, &dim, &qo, &B,
                        &Hq, &io, &n, &scale, &oo, &lo, &threads))
    return NULL;
  if (B < 1 || Hkv < 1 || Hq < Hkv || Hq % Hkv || n < 0 || n > INT32_MAX || dim < 1 ||
      PyTuple_GET_SIZE(kbs) != B || PyTuple_GET_SIZE(vbs) != B || PyTuple_GET_SIZE(caps) != B ||
      PyTuple_GET_SIZE(lens) != B || check_dtype(dtype) < 0) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "attend_ids: inconsistent arguments");
    return NULL;
  }
  hi_keys_t *kv = PyMem_Calloc((size_t)B * Hkv, sizeof *kv);
  hi_keys_t *vv = PyMem_Calloc((size_t)B * Hkv, sizeof *vv);
  Py_buffer *bufs = PyMem_Calloc((size_t)2 * B + 4, sizeof(Py_buffer));
  int nb = 0;
  PyObject *ret = NULL;
  if (!kv || !vv || !bufs) {
    PyErr_NoMemory();
    goto out;
  }
  if (layer_views(kbs, vbs, caps, lens, dtype, Hkv, dim, B, bufs, &nb, kv, vv) < 0) goto out;
  const Py_ssize_t T = (Py_ssize_t)B * Hq;
  if (get_buf(qo, &bufs[nb], 0, mul3(T, dim, 4), "queries") < 0) goto out;
  const float *q = bufs[nb++].buf;
  if (get_buf(io, &bufs[nb], 0, mul3(T, n, 8), "ids") < 0) goto out;
  const int64_t *ids = bufs[nb++].buf;
  if (get_buf(oo, &bufs[nb], 1, mul3(T, dim, 4), "o") < 0) goto out;
  float *o = bufs[nb++].buf;
  if (get_buf(lo, &bufs[nb], 1, mul2(T, 4), "lse") < 0) goto out;
  float *lse = bufs[nb++].buf;
  int err;
  Py_BEGIN_ALLOW_THREADS HI_FOREGROUND(
      err, hi_attend_ids(kv, vv, B, Hq, Hkv, q, ids, n, scale, o, lse, threads));
  Py_END_ALLOW_THREADS if (raise_err(err) == 0) ret = Py_NewRef(Py_None);
out:
  for (int i = 0; i < nb; i++) PyBuffer_Release(&bufs[i]);
  PyMem_Free(kv);
  PyMem_Free(vv);
  PyMem_Free(bufs);
  return ret;
}

/* insert_many(indexes, kbufs, heads, caps, n_totals, q_starts, queries, dtype, ef, threads, yield):
 * index i (distinct) reads head heads[i] of kbufs[i] ([Hkv, cap, dim]) and is
 * extended to n_totals[i]; queries[i] is None or [rows, dim] float32, the own
 * queries of rows q_starts[i] ... (see hi_insert_many); ef: the graph inserts' candidate
 * list (0: each index's ef_insert). With yield, each index
 * waits for running foreground calls first (hi_gate.h). Returns the seconds
 * waited so, summed over the threads. */
static PyObject *py_insert_many(PyObject *mod, PyObject *args) {
  (void)mod;
  PyObject *ixs, *kbs, *hs, *caps, *nts, *qss, *qs;
  int dtype, ef, threads, yield;
  if (!PyArg_ParseTuple(args, "O!O!O!O!O!O!O!iiip", &PyTuple_Type, &ixs, &PyTuple_Type, &kbs,
                        &PyTuple_Type, &hs, &PyTuple_Type, &caps, &PyTuple_Type, &nts,
                        &PyTuple_Type, &qss, &PyTuple_Type, &qs, &dtype, &ef, &threads, &yield) ||
      check_dtype(dtype) < 0)
    return NULL;
  if (ef < 0) {
    PyErr_SetString(PyExc_ValueError, "insert_many: ef must be >= 0");
    return NULL;
  }
  const Py_ssize_t C = PyTuple_GET_SIZE(ixs);
  if (PyTuple_GET_SIZE(kbs) != C || PyTuple_GET_SIZE(hs) != C || PyTuple_GET_SIZE(caps) != C ||
      PyTuple_GET_SIZE(nts) != C || PyTuple_GET_SIZE(qss) != C || PyTuple_GET_SIZE(qs) != C) {
    PyErr_SetString(PyExc_ValueError, "insert_many: tuples differ in length");
    return NULL;
  }
  const Py_ssize_t n1 = C > 0 ? C : 1;
  hi_index_t **idx = PyMem_Calloc((size_t)n1, sizeof *idx);
  hi_keys_t *kv = PyMem_Calloc((size_t)n1, sizeof *kv);
  int64_t *nt = PyMem_Calloc((size_t)n1, sizeof *nt);
  int64_t *q0 = PyMem_Calloc((size_t)n1, sizeof *q0);
  int64_t *qr = PyMem_Calloc((size_t)n1, sizeof *qr);
  const float **qp = PyMem_Calloc((size_t)n1, sizeof *qp);
  Py_buffer *bufs = PyMem_Calloc((size_t)2 * n1, sizeof(Py_buffer));
  int nb = 0;
  PyObject *ret = NULL;
  if (!idx || !kv || !nt || !q0 || !qr || !qp || !bufs) {
    PyErr_NoMemory();
    goto out;
  }
  int dim = 0;
  for (Py_ssize_t i = 0; i < C; i++) {
    PyObject *o = PyTuple_GET_ITEM(ixs, i);
    if (!PyObject_TypeCheck(o, &IndexType) || !((IndexObject *)o)->ready) {
      PyErr_SetString(PyExc_TypeError, "insert_many: indexes must be Index objects");
      goto out;
    }
    idx[i] = &((IndexObject *)o)->ix;
    for (Py_ssize_t j = 0; j < i; j++)
      if (idx[j] == idx[i]) {
        PyErr_SetString(PyExc_ValueError, "insert_many: an index appears twice");
        goto out;
      }
    dim = idx[i]->dim;
    Py_ssize_t head = PyLong_AsSsize_t(PyTuple_GET_ITEM(hs, i));
    Py_ssize_t cap = PyLong_AsSsize_t(PyTuple_GET_ITEM(caps, i));
    nt[i] = PyLong_AsSsize_t(PyTuple_GET_ITEM(nts, i));
    q0[i] = PyLong_AsSsize_t(PyTuple_GET_ITEM(qss, i));
    if (PyErr_Occurred()) goto out;
    if (keys_view(PyTuple_GET_ITEM(kbs, i), &bufs[nb], dtype, dim, head, cap, nt[i], &kv[i]) < 0)
      goto out;
    nb++;
    PyObject *q = PyTuple_GET_ITEM(qs, i);
    if (q != Py_None) {
      if (q0[i] < 0 || q0[i] > nt[i]) {
        PyErr_SetString(PyExc_ValueError, "insert_many: query start out of range");
        goto out;
      }
      if (get_buf(q, &bufs[nb], 0, mul3(nt[i] - q0[i], dim, 4), "queries") < 0) goto out;
      qp[i] = bufs[nb].buf;
      qr[i] = bufs[nb++].len / ((Py_ssize_t)dim * 4);
    }
  }
  int err;
  int64_t waited = 0;
  Py_BEGIN_ALLOW_THREADS err = hi_insert_many(idx, kv, nt, q0, qp, qr, C, ef, threads, yield, &waited);
  Py_END_ALLOW_THREADS if (raise_err(err) == 0) ret = PyFloat_FromDouble((double)waited * 1e-9);
out:
  for (int i = 0; i < nb; i++) PyBuffer_Release(&bufs[i]);
  PyMem_Free(idx);
  PyMem_Free(kv);
  PyMem_Free(nt);
  PyMem_Free(q0);
  PyMem_Free(qr);
  PyMem_Free(qp);
  PyMem_Free(bufs);
  return ret;
}

/* convert(src, sdt, src_off, src_stride, dst, ddt, dst_off, dst_stride, nblocks, block, threads)
 * copies nblocks blocks of `block` elements (offsets and strides in elements). */
static PyObject *py_convert(PyObject *mod, PyObject *args) {
  (void)mod;
  PyObject *so, *dobj;
  int sdt, ddt, threads;
  Py_ssize_t soff, sst, doff, dst, nbk, blk;
  if (!PyArg_ParseTuple(args, "OinnOinnnni", &so, &sdt, &soff, &sst, &dobj, &ddt, &doff, &dst,
                        &nbk, &blk, &threads) ||
      check_dtype_pair(sdt, ddt) < 0)
    return NULL;
  if (soff < 0 || sst < 0 || doff < 0 || dst < 0 || nbk < 0 || blk < 0) {
    PyErr_SetString(PyExc_ValueError, "convert: negative offset");
    return NULL;
  }
  const Py_ssize_t need_s = nbk ? mul2(add2(add2(soff, mul2(nbk - 1, sst)), blk), hi_itemsize(sdt)) : 0;
  const Py_ssize_t need_d = nbk ? mul2(add2(add2(doff, mul2(nbk - 1, dst)), blk), hi_itemsize(ddt)) : 0;
  Py_buffer sb, db;
  if (get_buf(so, &sb, 0, need_s, "src") < 0) return NULL;
  if (get_buf(dobj, &db, 1, need_d, "dst") < 0) {
    PyBuffer_Release(&sb);
    return NULL;
  }
  Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for schedule(static) num_threads(hi_team(threads, nbk, nbk * blk))
  for (Py_ssize_t i = 0; i < nbk; i++)
    hi_convert((const char *)sb.buf + (soff + i * sst) * hi_itemsize(sdt), sdt,
               (char *)db.buf + (doff + i * dst) * hi_itemsize(ddt), ddt, blk);
  Py_END_ALLOW_THREADS PyBuffer_Release(&sb);
  PyBuffer_Release(&db);
  Py_RETURN_NONE;
}

/* count_bad(src, sdt, ddt, n): NaN/inf in src or overflow into ddt. */
static PyObject *py_count_bad(PyObject *mod, PyObject *args) {
  (void)mod;
  PyObject *so;
  int sdt, ddt;
  Py_ssize_t n;
  if (!PyArg_ParseTuple(args, "Oiin", &so, &sdt, &ddt, &n) || check_dtype_pair(sdt, ddt) < 0)
    return NULL;
  if (n < 0) {
    PyErr_SetString(PyExc_ValueError, "negative n");
    return NULL;
  }
  Py_buffer sb;
  if (get_buf(so, &sb, 0, mul2(n, hi_itemsize(sdt)), "src") < 0) return NULL;
  int64_t bad;
  Py_BEGIN_ALLOW_THREADS bad = hi_count_bad(sb.buf, sdt, ddt, n);
  Py_END_ALLOW_THREADS PyBuffer_Release(&sb);
  return PyLong_FromLongLong((long long)bad);
}

/* Buffers objs[0..count) of at least need[i] bytes, those from first_writable on writable;
 * returns how many were acquired (count on success; the caller releases that many). */
static int get_bufs(PyObject *const *objs, const Py_ssize_t *need, int count, int first_writable,
                    Py_buffer *b, const char *what) {
  int nb = 0;
  for (; nb < count; nb++)
    if (get_buf(objs[nb], &b[nb], nb >= first_writable, need[nb], what) < 0) break;
  return nb;
}

/* gather_pages_multi(ks, vs, dtype, Hkv, dim, page, caps, lens, group, heads, page_ids, P,
 * out_k, out_v, threads): ks, vs sequences of G stores [Hkv, caps[g], dim]; page 1 gathers
 * rows, page id -1 a zero page. */
static PyObject *py_gather_pages_multi(PyObject *mod, PyObject *args) {
  (void)mod;
  PyObject *kso, *vso, *co, *lo, *go, *ho, *po, *oko, *ovo;
  int dtype, Hkv, dim, page, threads;
  Py_ssize_t P;
  if (!PyArg_ParseTuple(args, "OOiiiiOOOOOnOOi", &kso, &vso, &dtype, &Hkv, &dim, &page, &co, &lo,
                        &go, &ho, &po, &P, &oko, &ovo, &threads) ||
      check_copy_dtype(dtype) < 0)
    return NULL;
  PyObject *ks = PySequence_Fast(kso, "gather_pages_multi: ks must be a sequence");
  PyObject *vs = ks ? PySequence_Fast(vso, "gather_pages_multi: vs must be a sequence") : NULL;
  if (!vs) {
    Py_XDECREF(ks);
    return NULL;
  }
  const Py_ssize_t G = PySequence_Fast_GET_SIZE(ks);
  const Py_ssize_t isz = (Py_ssize_t)hi_itemsize(dtype);
  if (G != PySequence_Fast_GET_SIZE(vs) || Hkv < 1 || dim < 1 || page < 1 || P < 0) {
    PyErr_SetString(PyExc_ValueError, "gather_pages_multi: bad sizes");
    Py_DECREF(ks);
    Py_DECREF(vs);
    return NULL;
  }
  Py_buffer ib[7];
  PyObject *iobjs[7] = {co, lo, go, ho, po, oko, ovo};
  const Py_ssize_t ineed[7] = {mul2(G, 8), mul2(G, 8), mul2(P, 8), mul2(P, 8), mul2(P, 8),
                               mul4(P, page, dim, isz), mul4(P, page, dim, isz)};
  const int ni = get_bufs(iobjs, ineed, 7, 5, ib, "gather_pages_multi");
  Py_buffer *sb = ni == 7 ? (Py_buffer *)PyMem_Calloc((size_t)(2 * G + 1), sizeof(Py_buffer)) : NULL;
  const void **kp = sb ? (const void **)PyMem_Calloc((size_t)(2 * G + 1), sizeof(void *)) : NULL;
  Py_ssize_t ns = 0;
  int err = HI_OK, ok = kp != NULL;
  if (ni == 7 && !ok) PyErr_NoMemory();
  const int64_t *caps = ni == 7 ? (const int64_t *)ib[0].buf : NULL;
  for (Py_ssize_t g = 0; ok && g < 2 * G; g++) {
    PyObject *o = g < G ? PySequence_Fast_GET_ITEM(ks, g) : PySequence_Fast_GET_ITEM(vs, g - G);
    const int64_t c = caps[g % G];
    if (c < 0 || get_buf(o, &sb[ns], 0, mul4(Hkv, c, dim, isz), "gather_pages_multi store") < 0) {
      if (c < 0) PyErr_SetString(PyExc_ValueError, "gather_pages_multi: negative capacity");
      ok = 0;
      break;
    }
    kp[g] = sb[ns++].buf;
  }
  if (ok) {
    Py_BEGIN_ALLOW_THREADS HI_FOREGROUND(err, hi_gather_pages_multi(
        kp, kp + G, caps, (const int64_t *)ib[1].buf, G, dtype, Hkv, dim, page,
        (const int64_t *)ib[2].buf, (const int64_t *)ib[3].buf, (const int64_t *)ib[4].buf, P,
        ib[5].buf, ib[6].buf, threads));
    Py_END_ALLOW_THREADS
  }
  for (Py_ssize_t i = 0; i < ns; i++) PyBuffer_Release(&sb[i]);
  for (int i = 0; i < ni; i++) PyBuffer_Release(&ib[i]);
  PyMem_Free(sb);
  PyMem_Free(kp);
  Py_DECREF(ks);
  Py_DECREF(vs);
  if (!ok || ni < 7 || raise_err(err) < 0) return NULL;
  Py_RETURN_NONE;
}

/* assign_slots(held, wanted, R, S, writes, threads) */
static PyObject *py_assign_slots(PyObject *mod, PyObject *args) {
  (void)mod;
  PyObject *ho, *wo, *oo;
  Py_ssize_t R, S;
  int threads;
  if (!PyArg_ParseTuple(args, "OOnnOi", &ho, &wo, &R, &S, &oo, &threads)) return NULL;
  if (R < 0 || S < 0) {
    PyErr_SetString(PyExc_ValueError, "assign_slots: bad sizes");
    return NULL;
  }
  Py_buffer b[3];
  PyObject *objs[3] = {ho, wo, oo};
  const Py_ssize_t need[3] = {mul3(R, S, 8), mul3(R, S, 8), mul3(R, S, 8)};
  const int nb = get_bufs(objs, need, 3, 2, b, "assign_slots");
  int err = HI_OK;
  if (nb == 3) {
    Py_BEGIN_ALLOW_THREADS HI_FOREGROUND(
        err, hi_assign_slots(b[0].buf, b[1].buf, R, S, b[2].buf, threads));
    Py_END_ALLOW_THREADS
  }
  for (int i = 0; i < nb; i++) PyBuffer_Release(&b[i]);
  if (nb < 3 || raise_err(err) < 0) return NULL;
  Py_RETURN_NONE;
}

/* count_common(a, n, b, m, R, counts, threads) */
static PyObject *py_count_common(PyObject *mod, PyObject *args) {
  (void)mod;
  PyObject *ao, *bo, *co;
  Py_ssize_t n, m, R;
  int threads;
  if (!PyArg_ParseTuple(args, "OnOnnOi", &ao, &n, &bo, &m, &R, &co, &threads)) return NULL;
  if (n < 0 || m < 0 || R < 0) {
    PyErr_SetString(PyExc_ValueError, "count_common: bad sizes");
    return NULL;
  }
  Py_buffer b[3];
  PyObject *objs[3] = {ao, bo, co};
  const Py_ssize_t need[3] = {mul3(R, n, 8), mul3(R, m, 8), mul2(R, 8)};
  const int nb = get_bufs(objs, need, 3, 2, b, "count_common");
  int err = HI_OK;
  if (nb == 3) {
    Py_BEGIN_ALLOW_THREADS HI_FOREGROUND(
        err, hi_count_common(b[0].buf, n, b[1].buf, m, R, b[2].buf, threads));
    Py_END_ALLOW_THREADS
  }
  for (int i = 0; i < nb; i++) PyBuffer_Release(&b[i]);
  if (nb < 3 || raise_err(err) < 0) return NULL;
  Py_RETURN_NONE;
}

/* topk_rows(scores, R, N, k, ids, threads): scores [R, N] float32, ids [R, k] int64 out. */
static PyObject *py_topk_rows(PyObject *mod, PyObject *args) {
  (void)mod;
  PyObject *so, *io;
  Py_ssize_t R, N, k;
  int threads;
  if (!PyArg_ParseTuple(args, "OnnnOi", &so, &R, &N, &k, &io, &threads)) return NULL;
  if (R < 0 || k < 0 || k > N || N > INT32_MAX) {
    PyErr_SetString(PyExc_ValueError, "topk_rows: bad sizes");
    return NULL;
  }
  Py_buffer b[2];
  PyObject *objs[2] = {so, io};
  const Py_ssize_t need[2] = {mul3(R, N, 4), mul3(R, k, 8)};
  const int nb = get_bufs(objs, need, 2, 1, b, "topk_rows");
  int err = HI_OK;
  if (nb == 2) {
    Py_BEGIN_ALLOW_THREADS err = hi_topk_rows(b[0].buf, R, N, k, b[1].buf, threads);
    Py_END_ALLOW_THREADS
  }
  for (int i = 0; i < nb; i++) PyBuffer_Release(&b[i]);
  if (nb < 2 || raise_err(err) < 0) return NULL;
  Py_RETURN_NONE;
}

/* select_slots(held, held_rows, S, layers, T, B, H, stored, found, k, seen, tail, age|None,
 *              sources, successors, pins|None, pinned, span, score|None, used|None, n_used,
 *              retrieved|None, dest, ids, src, threads) -> (count, hits, total): the
 * hi_selection_t fields; held is rewritten in place. */
static PyObject *py_select_slots(PyObject *mod, PyObject *args) {
  (void)mod;
  PyObject *ho, *lo, *so, *fo, *eo, *ao, *po, *sco, *uo, *ro, *dso, *io, *sro;
  Py_ssize_t held_rows, S, T, B, H, k, tail, sources, successors, pinned, span, n_used;
  int threads;
  if (!PyArg_ParseTuple(args, "OnnOnnnOOnOnOnnOnnOOnOOOOi", &ho, &held_rows, &S, &lo, &T, &B, &H,
                        &so, &fo, &k, &eo, &tail, &ao, &sources, &successors, &po, &pinned, &span,
                        &sco, &uo, &n_used, &ro, &dso, &io, &sro, &threads))
    return NULL;
  if (held_rows < 0 || S < 0 || T < 0 || B < 0 || H < 0 || k < 0 || tail < 0 || sources < 0 ||
      successors < 0 || pinned < 0 || span < 1 || n_used < 0 || (successors && ao == Py_None) ||
      (pinned && po == Py_None) || ((sco == Py_None) != (uo == Py_None))) {
    PyErr_SetString(PyExc_ValueError, "select_slots: bad sizes");
    return NULL;
  }
  const Py_ssize_t R = mul3(T, B, H), rows_room = mul3(R, S, 8);
  /* read-only first (layers, stored, found, seen, then age, pins, score, used as given), then
   * held and the outputs */
  PyObject *objs[13] = {lo, so, fo, eo};
  Py_ssize_t need[13] = {mul2(T, 8), mul3(T, B, 8), mul3(R, k, 8), mul2(R, 8)};
  int n = 4;
  const int has_age = ao != Py_None, has_pins = po != Py_None, has_score = sco != Py_None;
  const int has_ret = ro != Py_None;
  if (has_age) objs[n] = ao, need[n++] = mul2(R, 8);
  if (has_pins) objs[n] = po, need[n++] = mul3(R, pinned, 8);
  if (has_score) {
    objs[n] = sco, need[n++] = R;
    objs[n] = uo, need[n++] = mul3(R, n_used, 8);
  }
  const int first_writable = n;
  objs[n] = ho, need[n++] = mul3(held_rows, S, 8);
  if (has_ret) objs[n] = ro, need[n++] = mul3(R, add2(k, tail), 8);
  objs[n] = dso, need[n++] = rows_room;
  objs[n] = io, need[n++] = rows_room;
  objs[n] = sro, need[n++] = rows_room;
  Py_buffer b[13];
  const int nb = get_bufs(objs, need, n, first_writable, b, "select_slots");
  int err = HI_OK;
  hi_select_out_t out = {0};
  if (nb == n) {
    int at = 4;
    hi_selection_t sel = {.T = T, .B = B, .H = H, .layers = b[0].buf, .stored = b[1].buf,
                          .found = b[2].buf, .k = k, .seen = b[3].buf, .tail = tail,
                          .sources = sources, .successors = successors, .pinned = pinned,
                          .span = span, .n_used = n_used};
    if (has_age) sel.age = b[at++].buf;
    if (has_pins) sel.pins = b[at++].buf;
    if (has_score) {
      sel.score = b[at++].buf;
      sel.used = b[at++].buf;
    }
    int64_t *held = b[at++].buf;
    out.retrieved = has_ret ? b[at++].buf : NULL;
    out.dest = b[at].buf;
    out.ids = b[at + 1].buf;
    out.src = b[at + 2].buf;
    Py_BEGIN_ALLOW_THREADS HI_FOREGROUND(
        err, hi_select_slots(held, held_rows, S, &sel, &out, threads));
    Py_END_ALLOW_THREADS
  }
  for (int i = 0; i < nb; i++) PyBuffer_Release(&b[i]);
  if (nb < n) return NULL;
  if (err == HI_EINVAL) {
    PyErr_SetString(PyExc_ValueError,
                    "select_slots: ids out of range (held, pins or used ids below -1, found ids "
                    "outside [-1, stored), negative seen, stored or age) or layers repeated or "
                    "out of range");
    return NULL;
  }
  if (raise_err(err) < 0) return NULL;
  return Py_BuildValue("(LLL)", (long long)out.count, (long long)out.hits, (long long)out.total);
}

static PyObject *py_isa(PyObject *mod, PyObject *unused) {
  (void)mod;
  (void)unused;
  return PyUnicode_FromString(hi_kernels_isa());
}

/* foreground_enter() / foreground_exit(): marks a foreground call from Python (hi_gate.h), as
 * the C calls above mark themselves; for tests of yielding inserts. */
static PyObject *py_foreground_enter(PyObject *mod, PyObject *unused) {
  (void)mod;
  (void)unused;
  hi_gate_enter();
  Py_RETURN_NONE;
}

static PyObject *py_foreground_exit(PyObject *mod, PyObject *unused) {
  (void)mod;
  (void)unused;
  if (hi_gate_running() < 1) {
    PyErr_SetString(PyExc_RuntimeError, "foreground_exit: no foreground call is running");
    return NULL;
  }
  hi_gate_exit();
  Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"isa", py_isa, METH_NOARGS, "Instruction set of the kernels in use."},
    {"attend", py_attend, METH_VARARGS, "Host partial attention for one layer."},
    {"search", py_search, METH_VARARGS, "Searches of one layer, ids only."},
    {"attend_ids", py_attend_ids, METH_VARARGS, "Host partial attention over given ids."},
    {"insert_many", py_insert_many, METH_VARARGS, "Extends several indexes, one task each."},
    {"convert", py_convert, METH_VARARGS, "Blockwise dtype conversion."},
    {"count_bad", py_count_bad, METH_VARARGS, "Count non-finite / overflowing values."},
    {"gather_pages_multi", py_gather_pages_multi, METH_VARARGS, "Copy K/V pages of several stores."},
    {"assign_slots", py_assign_slots, METH_VARARGS, "Slot writes from held to wanted ids, per row."},
    {"count_common", py_count_common, METH_VARARGS, "Per row, entries of a found in b."},
    {"select_slots", py_select_slots, METH_VARARGS, "Compose rows' wanted ids, assign them slots."},
    {"topk_rows", py_topk_rows, METH_VARARGS, "Each row's k largest scores' columns, best first."},
    {"foreground_enter", py_foreground_enter, METH_NOARGS, "A foreground call starts (hi_gate.h)."},
    {"foreground_exit", py_foreground_exit, METH_NOARGS, "A foreground call ends (hi_gate.h)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, .m_name = "host_index._core", .m_doc = "host_index C core",
    .m_size = -1, .m_methods = module_methods};

PyMODINIT_FUNC PyInit__core(void) {
  if (PyType_Ready(&IndexType) < 0) return NULL;
  PyObject *m = PyModule_Create(&moduledef);
  if (!m) return NULL;
  if (PyModule_AddObjectRef(m, "Index", (PyObject *)&IndexType) < 0) {
    Py_DECREF(m);
    return NULL;
  }
  return m;
}
