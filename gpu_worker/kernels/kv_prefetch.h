// Streaming the next work item's K/V rows into L2 while the current one computes.
//
// Why: a decode batch's attention reads every cached key and value once per layer, from blocks laid out
// anywhere in the cache (the hardware prefetchers cannot follow a block table). Prefetched all at once
// when an item starts, its rows arrive while the core waits: memory time and arithmetic add up (at batch
// 64 over 256 keys, 1.15 ms a layer from memory against 0.67 ms from the last-level cache). Here the
// thread claims its next item before computing the current one, lists the next item's cache lines, and
// the current item's inner loops issue a few of them per iteration (pump), so the two overlap. Prefetches
// are hints: the results are the same whatever arrives when.
#pragma once

#include <stdint.h>


struct KvPrefetch {
    const char *k = nullptr, *v = nullptr;   // the caches
    const int32_t* table = nullptr;          // the next item's block table
    int64_t block_bytes = 0, token_bytes = 0; // a block's entries, a token's (all its heads)
    int first = 0, row = 0;                  // bytes into a token's entry where the item's heads start; their bytes
    int bs = 0, hi = 0;                      // tokens a block; the item's last key + 1
    int t = 0, blk = 0, off = 0, line = 0;   // the cursor: the next key, its block and offset, the next line
    int step = 0;                            // lines (of K and of V) per pump
    bool planned = false;                    // a next item is listed
    bool ahead = false;                      // the item now computing was streamed in by the one before

    // Lists keys [lo, hi) of kv heads [h0, h0 + nh) through `table` (entries of `head_bytes` per head,
    // `Hkv` heads a token, `bs` tokens a block), to be issued over about `calls` pumps. The lines are
    // walked from a cursor as they are issued: a list of their addresses, built per item, cost as much as
    // the prefetches (Zen3).
    void plan(const void* k_cache, const void* v_cache, const int32_t* tbl, int bs_, int Hkv, int head_bytes, int h0,
              int nh, int lo, int hi_, int64_t calls) {
        k = (const char*)k_cache, v = (const char*)v_cache, table = tbl, bs = bs_, hi = hi_;
        token_bytes = (int64_t)Hkv * head_bytes, block_bytes = token_bytes * bs;
        first = h0 * head_bytes, row = nh * head_bytes;
        t = lo, blk = lo / bs, off = lo % bs, line = 0;
        const int64_t lines = (int64_t)(hi - lo) * ((row + 63) / 64);
        step = (int)(lines / (calls > 0 ? calls : 1)) + 1;
        planned = true;
    }

    // The cursor's line of K and of V, into L2 (the item that reads them starts after this one ends).
    __attribute__((always_inline)) inline void issue() {
        const int64_t at = table[blk] * block_bytes + off * token_bytes + first + line;
        __builtin_prefetch(k + at, 0, 2);
        __builtin_prefetch(v + at, 0, 2);
        if ((line += 64) >= row) {
            line = 0, ++t;
            if (++off == bs) off = 0, ++blk;
        }
    }

    // A few of the listed lines.
    __attribute__((always_inline)) inline void pump() {
        for (int i = 0; i < step && t < hi; ++i) issue();
    }

    // After an item: whatever was not pumped yet, then the next item counts as streamed in.
    void finish() {
        while (t < hi) issue();
        ahead = planned;
        planned = false;
    }
};
