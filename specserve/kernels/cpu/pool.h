// A small thread pool for the CPU kernels (pool.c), one per library, shared by its kernels: two pools would
// spin against each other on a small machine.
//
// pool_run(nth, n, block, fn, ctx) splits items [0, n) into blocks of `block` and runs fn(ctx, start, end) on
// them from up to nth threads, the calling thread included; it returns when every block is done. Threads claim
// blocks one at a time, so the caller never waits for a thread that has not started: on a busy machine, where a
// worker may be descheduled, the caller does the blocks itself. Calls from several threads are serialised.
#pragma once

typedef void (*pool_fn)(void* ctx, int start, int end);

__attribute__((visibility("hidden"))) void pool_run(int nth, int n, int block, pool_fn fn, void* ctx);

// A block size for n items on nth threads: ~4 blocks a thread, at least `least`. Fewer, longer blocks stream a
// matrix's rows further and claim less; more leave a slow or descheduled thread less to finish.
static inline int pool_block(int n, int nth, int least) {
    const int block = n / (4 * (nth > 0 ? nth : 1));
    return block > least ? block : least;
}
