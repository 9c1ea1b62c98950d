// The thread pool of pool.h.
//
// Why not OpenMP: with OMP_WAIT_POLICY=PASSIVE (set by specserve for shared boxes) every parallel region wakes
// its threads through the kernel, ~80 us a call on a busy 2-core box, and a decode step makes ~120 calls; and a
// region waits for all of its threads, even one the machine has descheduled. Here a worker spins for a bounded
// time after each job (SPIN_NS: long enough to bridge the torch ops between two products of a step, short
// enough that an idle server sleeps), yielding the core between looks, then sleeps on a futex; and the caller
// waits only for blocks that a thread has claimed.
#include "pool.h"

#include <immintrin.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define POOL_MAX_THREADS 256
#define SPIN_NS 1000000L

static struct {
    pthread_mutex_t lock;
    int workers;          // threads started (tid 1..workers)
    uint32_t generation;  // the job's number (a futex word): bumped once per job
    uint64_t claim;       // generation << 32 | the next unclaimed block: a claim is one compare-and-swap
    int done;             // blocks of the current job finished
    int sleepers;         // workers inside futex_wait (the caller wakes them only then)
    int nth, n, block, n_blocks;
    pool_fn fn;
    void* ctx;
    int fork_handler;
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER};

static int64_t pool_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000L + t.tv_nsec;
}

// Claims and runs blocks of job `gen` until none is left or the job is over. A claim succeeds only while the job
// is current, and a job ends only when all of its blocks are done, so fn, ctx and the sizes read after a claim are
// that job's.
static void pool_work(uint32_t gen) {
    for (;;) {
        uint64_t c = __atomic_load_n(&pool.claim, __ATOMIC_ACQUIRE);
        if ((uint32_t)(c >> 32) != gen || (int)(uint32_t)c >= pool.n_blocks) return;
        if (!__atomic_compare_exchange_n(&pool.claim, &c, c + 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) continue;
        const int start = (int)(uint32_t)c * pool.block;
        const int end = start + pool.block < pool.n ? start + pool.block : pool.n;
        pool.fn(pool.ctx, start, end);
        __atomic_fetch_add(&pool.done, 1, __ATOMIC_RELEASE);
    }
}

// Returns the first generation != seen: spinning for SPIN_NS, then sleeping. The spin yields the core between
// looks (sched_yield returns at once when nothing else waits for it), so torch's own OpenMP threads, which a
// step's other ops wake, are not kept off a core by a worker that merely waits.
static uint32_t pool_wait(uint32_t seen) {
    uint32_t g;
    const int64_t until = pool_now_ns() + SPIN_NS;
    for (int i = 0;; ++i) {
        if ((g = __atomic_load_n(&pool.generation, __ATOMIC_ACQUIRE)) != seen) return g;
        if (i & 15) {
            _mm_pause();
            continue;
        }
        sched_yield();
        if (pool_now_ns() > until) break;
    }
    for (;;) {
        __atomic_fetch_add(&pool.sleepers, 1, __ATOMIC_SEQ_CST);
        // the futex sleeps only while generation still equals seen, so a bump in between is never missed
        if (__atomic_load_n(&pool.generation, __ATOMIC_SEQ_CST) == seen)
            syscall(SYS_futex, &pool.generation, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
        __atomic_fetch_sub(&pool.sleepers, 1, __ATOMIC_SEQ_CST);
        if ((g = __atomic_load_n(&pool.generation, __ATOMIC_ACQUIRE)) != seen) return g;
    }
}

typedef struct {
    int tid;
    uint32_t start;  // the generation when the worker was made: it takes part only in later jobs
} pool_worker_arg;

static pool_worker_arg pool_args[POOL_MAX_THREADS];

static void* pool_worker(void* p) {
    const pool_worker_arg* arg = (const pool_worker_arg*)p;
    uint32_t seen = arg->start;
    for (;;) {
        seen = pool_wait(seen);
        if (arg->tid < __atomic_load_n(&pool.nth, __ATOMIC_RELAXED)) pool_work(seen);
    }
    return NULL;
}

static void pool_after_fork(void) {
    // the child has only the forking thread: forget the workers (and a lock a parent thread may have held)
    pthread_mutex_init(&pool.lock, NULL);
    pool.workers = 0;
    pool.sleepers = 0;
}

void pool_run(int nth, int n, int block, pool_fn fn, void* ctx) {
    if (n <= 0) return;
    if (block < 1) block = 1;
    if (nth > POOL_MAX_THREADS) nth = POOL_MAX_THREADS;
    if (nth <= 1 || n <= block) {  // one block or one thread: no one to share with
        fn(ctx, 0, n);
        return;
    }
    pthread_mutex_lock(&pool.lock);
    if (!pool.fork_handler) {
        pthread_atfork(NULL, NULL, pool_after_fork);
        pool.fork_handler = 1;
    }
    while (pool.workers < nth - 1) {
        const int tid = pool.workers + 1;
        pool_args[tid] = (pool_worker_arg){tid, pool.generation};
        pthread_t t;
        if (pthread_create(&t, NULL, pool_worker, &pool_args[tid]) != 0) break;
        pthread_detach(t);
        pool.workers++;
    }
    pool.fn = fn;
    pool.ctx = ctx;
    pool.n = n;
    pool.block = block;
    pool.n_blocks = (n + block - 1) / block;
    __atomic_store_n(&pool.nth, nth, __ATOMIC_RELAXED);
    __atomic_store_n(&pool.done, 0, __ATOMIC_RELAXED);
    const uint32_t gen = pool.generation + 1;
    __atomic_store_n(&pool.claim, (uint64_t)gen << 32, __ATOMIC_RELEASE);
    __atomic_store_n(&pool.generation, gen, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&pool.sleepers, __ATOMIC_SEQ_CST) > 0)
        syscall(SYS_futex, &pool.generation, FUTEX_WAKE_PRIVATE, POOL_MAX_THREADS, NULL, NULL, 0);
    pool_work(gen);
    // only blocks that another thread claimed are left: wait for those
    for (int i = 0; __atomic_load_n(&pool.done, __ATOMIC_ACQUIRE) < pool.n_blocks; ++i) {
        _mm_pause();
        if ((i & 1023) == 1023) sched_yield();  // a preempted worker holding a block needs this core
    }
    pthread_mutex_unlock(&pool.lock);
}
