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

#include <vector>

struct KvPrefetch {
    std::vector<const char*> lines;    // the next item's cache lines, K and V interleaved by key
    size_t pos = 0;                    // lines issued so far
    int step = 0;                      // lines per pump
    bool planned = false;              // a next item is listed
    bool ahead = false;                // the item now computing was streamed in by the one before

    // Lists keys [lo, hi) of kv heads [h0, h0 + nh) through `table` (entries of `head_bytes` per head,
    // `Hkv` heads a token, `bs` tokens a block), to be issued over about `calls` pumps.
    void plan(const void* k, const void* v, const int32_t* table, int bs, int Hkv, int head_bytes, int h0, int nh,
              int lo, int hi, int64_t calls) {
        lines.clear();
        pos = 0;
        const int row = head_bytes * nh;
        for (int t = lo; t < hi; ++t) {
            const int64_t at = (((int64_t)table[t / bs] * bs + t % bs) * Hkv + h0) * head_bytes;
            for (int line = 0; line < row; line += 64) {
                lines.push_back((const char*)k + at + line);
                lines.push_back((const char*)v + at + line);
            }
        }
        step = (int)((int64_t)lines.size() / (calls > 0 ? calls : 1)) + 1;
        planned = true;
    }

    void clear() { lines.clear(), pos = 0, planned = false; }

    // A few of the listed lines, into L2 (the item that reads them starts after this one ends).
    __attribute__((always_inline)) inline void pump() {
        for (int i = 0; i < step && pos < lines.size(); ++i) __builtin_prefetch(lines[pos++], 0, 2);
    }

    // After an item: whatever was not pumped yet, then the next item counts as streamed in.
    void finish() {
        while (pos < lines.size()) __builtin_prefetch(lines[pos++], 0, 2);
        ahead = planned;
        planned = false;
    }
};
