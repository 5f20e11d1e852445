/* The foreground gate: background index inserts pause while an exchange's C
 * calls (searches, slot selection, row gathers, host attention) run.
 *
 * Why: on a 16-core host the decode exchange's row gather took 0.39 ms alone
 * and 2.37 ms beside the background indexing's OpenMP team
 * (experiments/results/bench_prefetch_smollm2shapes_32k_pinned16_select.md),
 * and the exchange's gather section took 4.8 ms at 128K whether it ran at a
 * lower nice value than the indexing or at the same one
 * (bench_scale_smollm2shapes_synthetic_128k_select_after.md): OS priorities do
 * not order two OpenMP teams. A yielding insert loop (hi_insert_many with
 * yield) waits here between its tasks, holding no lock (a foreground search
 * may wait for an index's write lock, never the reverse), so it runs in the
 * exchange's gaps (its Python, the copy to the device, the wait for the next
 * step). Opt-in (retrieval's index_yields): on the H100 host at 128K it cut the
 * gather section from 3.1-3.5 to 2.1 ms, but the decode step (7.8-8.1 ms) did
 * not separate from the non-yielding one in one run each
 * (bench_scale_smollm2shapes_synthetic_128k_passive.md). */
#ifndef HI_GATE_H
#define HI_GATE_H

#include <stdint.h>

/* A foreground call starts / ends (any thread; calls may overlap). */
void hi_gate_enter(void);
void hi_gate_exit(void);

/* The foreground calls running now. */
int hi_gate_running(void);

/* Blocks while any foreground call runs; returns the nanoseconds waited. */
int64_t hi_gate_pass(void);

/* `call` (an int expression) as a foreground call, its result in err. */
#define HI_FOREGROUND(err, call) \
  do {                           \
    hi_gate_enter();             \
    (err) = (call);              \
    hi_gate_exit();              \
  } while (0)

#endif
