// Streaming the K/V rows ahead of the chunk computing into L2 while it computes.
//
// Why: a decode batch's attention reads every cached key and value once per layer, from blocks laid out
// anywhere in the cache (the hardware prefetchers cannot follow a block table). Prefetched all at once
// when an item starts, its rows arrive while the core waits: memory time and arithmetic add up (at batch
// 64 over 256 keys, 1.15 ms a layer from memory against 0.67 ms from the last-level cache). Here the
// thread claims its next item before computing the current one, queues the keys ahead of it, and the
// current chunk's inner loops issue a few lines per iteration (pump), so the two overlap. Prefetches are
// hints: the results are the same whatever arrives when.
//
// The queue is walked to a distance in keys, not chunk by chunk: each chunk issues lines until the cursor
// is `distance` keys past its own end. Planned a chunk ahead, a sequence's short last chunk (41 keys of
// 553) had to issue the next sequence's whole first chunk in its few iterations, and that burst made a
// batch of 64 decodes over 553 keys take 1.28x the time of 512 keys (loadtest/results/
// attention_experiments_2026-12-07_epyc.txt).
#pragma once

#include <stdint.h>


struct KvPrefetch {
    // Keys [lo, hi) of one sequence through its block table: kv heads from byte `first` of a token's
    // entry, `row` bytes of them.
    struct Segment {
        const int32_t* table;
        int first, row, lo, hi;
    };
    const char *k = nullptr, *v = nullptr;   // the caches
    int64_t block_bytes = 0, token_bytes = 0; // a block's entries, a token's (all its heads)
    int bs = 0;                              // tokens a block
    Segment queue[2];                        // keys still to issue, queue[0] being walked: at most the rest
    int queued = 0;                          // of the sequence now computing and the next one
    int t = 0, blk = 0, off = 0, line = 0;   // the cursor in queue[0]: key, its block and offset, next line
    int64_t issued = 0, target = 0;          // keys issued since setup; how many by the end of this chunk
    int step = 0;                            // lines (of K and of V) per pump
    bool ahead = false;                      // the chunk now computing was streamed in before it

    void setup(const void* k_cache, const void* v_cache, int bs_, int Hkv, int head_bytes) {
        k = (const char*)k_cache, v = (const char*)v_cache, bs = bs_;
        token_bytes = (int64_t)Hkv * head_bytes, block_bytes = token_bytes * bs;
        queued = 0, issued = target = 0, ahead = false;
    }

    // Queues keys [lo, hi) of kv heads [h0, h0 + nh) of a sequence (`head_bytes` per head).
    void extend(const int32_t* table, int head_bytes, int h0, int nh, int lo, int hi) {
        if (lo >= hi || queued == 2) return;
        queue[queued++] = Segment{table, h0 * head_bytes, nh * head_bytes, lo, hi};
        if (queued == 1) start();
    }

    // For the chunk about to run, which ends `end` queued keys from where the queue began: its loops issue
    // the lines up to `distance` keys past that end, over about `calls` pumps.
    void budget(int64_t end, int distance, int64_t calls) {
        target = end + distance;
        const int64_t keys = target - issued;
        step = keys > 0 && queued ? (int)(keys * ((queue[0].row + 63) / 64) / (calls > 0 ? calls : 1)) + 1 : 0;
    }

    // The cursor's line of K and of V, into L2.
    __attribute__((always_inline)) inline void issue() {
        const Segment& g = queue[0];
        const int64_t at = g.table[blk] * block_bytes + off * token_bytes + g.first + line;
        __builtin_prefetch(k + at, 0, 2);
        __builtin_prefetch(v + at, 0, 2);
        if ((line += 64) >= g.row) {
            line = 0, ++t, ++issued;
            if (++off == bs) off = 0, ++blk;
            if (t == g.hi) next();
        }
    }

    // A few of the chunk's lines.
    __attribute__((always_inline)) inline void pump() {
        for (int i = 0; i < step && queued && issued < target; ++i) issue();
    }

    // After a chunk: whatever of its share was not pumped yet; later chunks count as streamed in.
    void finish() {
        while (queued && issued < target) issue();
        ahead = true;
    }

  private:
    void start() { t = queue[0].lo, blk = t / bs, off = t % bs, line = 0; }
    void next() {
        queue[0] = queue[1];
        if (--queued) start();
    }
};
