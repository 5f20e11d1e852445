#define _POSIX_C_SOURCE 200809L
/* The foreground gate (hi_gate.h): a count of running foreground calls and a
 * condition variable the waiting inserts sleep on (they hold no core). */
#include "hi_gate.h"

#include <pthread.h>
#include <stdatomic.h>
#include <time.h>

static pthread_mutex_t mutex = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t idle = PTHREAD_COND_INITIALIZER;
static atomic_int running; /* foreground calls */

void hi_gate_enter(void) { atomic_fetch_add_explicit(&running, 1, memory_order_acq_rel); }

void hi_gate_exit(void) {
  if (atomic_fetch_sub_explicit(&running, 1, memory_order_acq_rel) == 1) {
    /* Under the mutex: a waiter that saw running > 0 is inside pthread_cond_wait by now. */
    pthread_mutex_lock(&mutex);
    pthread_cond_broadcast(&idle);
    pthread_mutex_unlock(&mutex);
  }
}

int hi_gate_running(void) { return atomic_load_explicit(&running, memory_order_acquire); }

static int64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

int64_t hi_gate_pass(void) {
  if (atomic_load_explicit(&running, memory_order_acquire) <= 0) return 0;
  const int64_t t0 = now_ns();
  pthread_mutex_lock(&mutex);
  while (atomic_load_explicit(&running, memory_order_acquire) > 0) pthread_cond_wait(&idle, &mutex);
  pthread_mutex_unlock(&mutex);
  return now_ns() - t0;
}
