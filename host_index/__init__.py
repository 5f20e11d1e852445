"""kvjax's host side: a CPU KV store, per-head ANN indexes and host partial attention.

The compute lives in C (host_index._core, OpenMP, GIL released); this package
validates arguments and owns the object model. It imports nothing from
kvjax, models or ops.

Public API:
  build_index(keys, *, kind, ...) -> Index   standalone index over [N, D] keys
  Index.search / insert / len                 one API for flat, ivf, graph, roar
  KVStore                                     per (seq, layer) head-major K/V store
  assign_slots(held, wanted)                  slot writes that keep held ids in place
  count_common(a, b)                          per row, ids of a found in b
  select_slots(held, layers, found, ...)      assign_slots of rows composed from search results
  key_neighbours(keys, count)                 each key's nearest keys (roar's connect candidates)
  topk_rows(scores, k)                        each row's k largest scores' columns (exact, threaded)
  HostContext                                 store + per-(seq, layer, head) indexes:
                                              build_layer, reserve, insert / insert_many, attend,
                                              search, attend_ids, fetch_pages, save / load
"""

import os


def _libgomp_loaded() -> bool:
    try:
        with open("/proc/self/maps") as maps:
            return any(line.rstrip().rsplit("/", 1)[-1].startswith("libgomp.so") for line in maps)
    except OSError:  # not Linux
        return False


# libgomp's threads spin after each parallel region before they sleep (~300K spins by default: 7.7
# ms of CPU per idle thread on the dev box; tests/test_host_index_threads.py measures it). Two
# thread teams (the decode exchange's and the background indexing's) then keep every core busy
# spinning while the other team works and while the main thread launches the device's kernels.
# PASSIVE: idle threads sleep at once (a parallel call then wakes its team: tens of microseconds).
# Set before the imports below load the C core and libgomp, which reads it then; a policy or spin
# count the user set is kept. Measured: the exchange 6.9 / 9.0 -> 6.3 / 7.2 ms on the 2-core dev
# box; on the 16-core H100 host at 128K the decode step was within one run's noise of the spinning
# default (7.57 / 7.89 against 7.79 / 7.38 ms,
# experiments/results/bench_scale_smollm2shapes_synthetic_128k_passive.md, ..._spinning.md).
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    if _libgomp_loaded():
        import warnings

        warnings.warn("libgomp was loaded before host_index, so its idle threads spin (~8 ms of a "
                      "core after every parallel call); set OMP_WAIT_POLICY=PASSIVE before Python "
                      "starts",
                      RuntimeWarning, stacklevel=2)
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

from host_index._context import HostContext
from host_index._index import DEFAULT_PARAMS
from host_index._index import Index
from host_index._index import build_index
from host_index._persist import CorruptFileError
from host_index._slots import assign_slots
from host_index._slots import count_common
from host_index._slots import select_slots
from host_index._store import KVStore
from host_index._store import StoreFullError
from host_index._topk import topk_rows
from host_index.neighbours import key_neighbours

__all__ = [
    "CorruptFileError",
    "DEFAULT_PARAMS",
    "HostContext",
    "Index",
    "KVStore",
    "StoreFullError",
    "assign_slots",
    "build_index",
    "count_common",
    "key_neighbours",
    "select_slots",
    "topk_rows",
]
