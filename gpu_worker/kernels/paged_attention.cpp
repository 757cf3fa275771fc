// Paged attention on the CPU straight from the KV cache, for decodes and for short query runs behind a
// context (speculative verification, small prefill chunks): a few query tokens per sequence.
//
// Why a kernel of our own: in torch each such sequence gathers its blocks into a contiguous copy and
// calls SDPA with a mask, per layer; at a handful of sequences those fixed costs outweigh the arithmetic.
// Here each sequence reads its keys through the block table in place, a chunk of 128 at a time (fp32
// and, with AVX2, bf16 entries where they are; fp16 / fp8 converted as they come), and the query rows of each kv head
// (its tokens times the query heads sharing it) read every key and value once for a group of rows.
//
// Layouts: q and out are fp32 [rows][Hq][D]; sequence b owns rows q_start[b] .. q_start[b + 1] - 1, its
// last n tokens, the last at position seq_lens[b] - 1 (all are written to the cache before attention);
// token j attends causally to positions up to seq_lens[b] - n + j. k and v caches are
// [blocks][block_size][Hkv][D] of `kv_dtype` (0 fp32, 1 bf16, 2 fp16, 3 fp8 e4m3fn, 4 fp8 e5m2);
// block_tables int32 [B][max_blocks]. Query head h reads kv head h / (Hq / Hkv). `scale` multiplies q.k
// (the caller folds the cache's k scale in); the v scale is applied by the caller. `window` > 0 limits
// each query to its last `window` keys (its own included: sliding-window layers); `softcap` > 0 caps each
// score at tanh(s / softcap) * softcap (Gemma 2); `sink`, when not null, [2][Hkv][D] fp32, is added to
// position 0's key and value as read (an fp8 cache stores that entry around its own centre): a score term
// q.dk and a weighted dv, so the entries themselves are read as they are.
//
// Each entry point takes an `isa` level (2 AVX-512, 1 AVX2+FMA, 0 portable): the same loops compiled
// for each target (GCC vector types lower to each one's registers), chosen at run time, so every path can
// be tested on one machine. Level 3 adds AMX-BF16 tiles for bf16 caches (see "AMX" below); the caller
// asks psq_amx_ready() first.
#include <cpuid.h>
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "amx.h"
#include "fp8.h"
#include "kv_prefetch.h"
#include "vec8.h"

namespace {

inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h >> 15) << 31, e = (h >> 10) & 31, m = h & 1023;
    float v;
    if (e == 0) v = ldexpf((float)m, -24);
    else if (e == 31) v = m ? NAN : INFINITY;
    else { uint32_t bits = ((e + 112) << 23) | (m << 13); memcpy(&v, &bits, 4); }
    uint32_t out;
    memcpy(&out, &v, 4);
    out |= sign;
    memcpy(&v, &out, 4);
    return v;
}

struct Args {
    const float* q; const void* k; const void* v; int kv_dtype;
    const int32_t* tables; int max_blocks; const int32_t* lens; const int32_t* q_start;
    int B, Hq, Hkv, D, bs; float scale; float* out; int window; float softcap;
    const float* sink;    // null, or [2][Hkv][D]: added to position 0's key and value as stored (an fp8
                          // cache centres that entry apart; gpu_worker/layers/kv_rotation.py)
};

// In hsum4's order, so a key's score is the same whichever of the two reduced it.
__attribute__((always_inline)) inline float hsum(v8 x) {
    return ((x[0] + x[4]) + (x[2] + x[6])) + ((x[1] + x[5]) + (x[3] + x[7]));
}

// Keys go by in chunks of CHUNK keys (at multiples of CHUNK), each a work item, whose sums are merged at
// the end. They are fixed by position alone, never by the batch, the thread count or the query run, so a
// token's attention is bit-identical whether it is decoded alone or verified among drafts, in any batch:
// speculation keeps greedy output exactly.
// 128 rather than 256: a batch of 64 decodes over 553 keys ran 1.13x faster with 128 (1.08x with 256),
// both with the prefetcher's distance (kv_prefetch.h), measured in the engine (loadtest/results/
// attention_experiments_2026-12-07_epyc.txt).
constexpr int CHUNK = 128;   // keys per chunk: a long sequence's chunks run in parallel
constexpr int TILE = 32;     // keys a prefetch runs ahead

// One cache row (D entries of a token and kv head) as fp32: fp32 rows are used in place.
__attribute__((always_inline)) inline const float* row_at(const Args& a, const void* cache, int64_t block, int off,
                                                            int h, float* buf) {
    const int64_t at = ((block * a.bs + off) * a.Hkv + h) * a.D;
    switch (a.kv_dtype) {
        case 0: return (const float*)cache + at;
        case 1: {
            const uint16_t* s = (const uint16_t*)cache + at;
            uint32_t* d = (uint32_t*)buf;
#pragma omp simd
            for (int i = 0; i < a.D; ++i) d[i] = (uint32_t)s[i] << 16;
            return buf;
        }
        case 2: {
            const uint16_t* s = (const uint16_t*)cache + at;
            for (int i = 0; i < a.D; ++i) buf[i] = half_to_float(s[i]);
            return buf;
        }
        default: {
            const uint8_t* s = (const uint8_t*)cache + at;
            const float* table = fp8_table.v[a.kv_dtype - 3];
            for (int i = 0; i < a.D; ++i) buf[i] = table[s[i]];
            return buf;
        }
    }
}

// The largest of m and sc[0:T] (sc has room past T: the tail is padded).
__attribute__((always_inline)) inline float max_of(float* sc, int T, float m) {
    for (int t = T; t < (T + 7) / 8 * 8; ++t) sc[t] = -INFINITY;
    v8 mx = (v8){} + m;
    for (int t = 0; t < T; t += 8) {
        const v8 x = load8(sc + t);
        mx = x > mx ? x : mx;
    }
    const float a = mx[0] > mx[1] ? mx[0] : mx[1], b = mx[2] > mx[3] ? mx[2] : mx[3];
    const float c = mx[4] > mx[5] ? mx[4] : mx[5], d = mx[6] > mx[7] ? mx[6] : mx[7];
    const float ab = a > b ? a : b, cd = c > d ? c : d;
    return ab > cd ? ab : cd;
}

// sc[0:T] = e^(sc - mx); returns their sum. sc has room past T: the tail is padded with -inf (0 here).
__attribute__((always_inline)) inline float exp_shifted(float* sc, int T, float mx) {
    for (int t = T; t < (T + 7) / 8 * 8; ++t) sc[t] = -INFINITY;
    v8 sum = {};
    for (int t = 0; t < T; t += 8) {
        const v8 x = load8(sc + t);
        const v8 e = x == -INFINITY ? (v8){} : exp8(x - mx);
        store8(sc + t, e);
        sum += e;
    }
    return hsum(sum);
}

// Keys of a chunk as the kernel indexes them: from a multiple of 4 at or below its first, rounded up to
// fours (32s on the AMX path, whose value products take 32 keys at once, from a multiple of 32).
constexpr int CHUNK_KEYS = CHUNK + 32;
// Query rows an AMX pass takes: a tile's 16 columns (scores) and 16 rows (outputs).
constexpr int AMX_ROWS = 16;
// A row's scores: a chunk's keys, and the padding max_of / exp_shifted round a run up to.
constexpr int SCORE_STRIDE = CHUNK_KEYS + 8;

// Per-thread buffers, sized for the step's largest work item.
struct Scratch {
    std::vector<float> kbuf, vbuf, scores, acc, m, l, corr, qs, zero;
    std::vector<const void*> kp, vp, kh, vh;    // the chunk's key and value rows: first head, a later head
    std::vector<const float*> qp;               // per row: its pre-scaled query
    std::vector<float*> sp, ap;                 // per row: its scores, its output
    // AMX only: query pairs [D/32][16][AMX_ROWS], 16 gathered keys [16][D], 16 keys' scores [16][AMX_ROWS],
    // the chunk's values in key pairs [D/16][CHUNK_KEYS/2][32], weights [AMX_ROWS][CHUNK_KEYS] (all bf16)
    std::vector<uint32_t> qt;
    std::vector<uint16_t> kg, vv, pb;
    std::vector<float> cs;
    int tile_rows = -1;                         // rows of the tile configuration loaded, -1: none yet
    KvPrefetch pf;                              // the next item's rows, pumped by this one's loops
    Scratch(int rows, int D, int heads, bool converts, bool amx)  // converts: rows are converted into kbuf / vbuf
        : kbuf(converts ? (size_t)CHUNK_KEYS * D : 0), vbuf(converts ? (size_t)CHUNK_KEYS * D : 0),
          scores((size_t)rows * SCORE_STRIDE), acc((size_t)rows * D), m(rows), l(rows), corr(rows),
          qs((size_t)rows * D), zero((size_t)heads * D + 16), kp(CHUNK_KEYS), vp(CHUNK_KEYS), kh(CHUNK_KEYS),
          vh(CHUNK_KEYS), qp(rows), sp(rows), ap(rows), qt(amx ? (size_t)D / 2 * AMX_ROWS : 0),
          kg(amx ? (size_t)16 * D : 0), vv(amx ? (size_t)D * CHUNK_KEYS : 0),
          pb(amx ? (size_t)AMX_ROWS * CHUNK_KEYS : 0), cs(amx ? 16 * AMX_ROWS : 0) {}
};

typedef float v4 __attribute__((vector_size(16)));
typedef float v4u __attribute__((vector_size(16), aligned(4), may_alias));
typedef int32_t v4i __attribute__((vector_size(16)));

// The four horizontal sums of a, b, c, d in one vector: halves added, then two rounds of pairing.
__attribute__((always_inline)) inline v4 hsum4(v8 a8, v8 b8, v8 c8, v8 d8) {
    const v4 a = __builtin_shufflevector(a8, a8, 0, 1, 2, 3) + __builtin_shufflevector(a8, a8, 4, 5, 6, 7);
    const v4 b = __builtin_shufflevector(b8, b8, 0, 1, 2, 3) + __builtin_shufflevector(b8, b8, 4, 5, 6, 7);
    const v4 c = __builtin_shufflevector(c8, c8, 0, 1, 2, 3) + __builtin_shufflevector(c8, c8, 4, 5, 6, 7);
    const v4 d = __builtin_shufflevector(d8, d8, 0, 1, 2, 3) + __builtin_shufflevector(d8, d8, 4, 5, 6, 7);
    const v4i even = {0, 4, 1, 5}, odd = {2, 6, 3, 7}, first = {0, 1, 4, 5}, second = {2, 3, 6, 7};
    const v4 ab = __builtin_shuffle(a, b, even) + __builtin_shuffle(a, b, odd);
    const v4 cd = __builtin_shuffle(c, d, even) + __builtin_shuffle(c, d, odd);
    return __builtin_shuffle(ab, cd, first) + __builtin_shuffle(ab, cd, second);
}

// Vector types of W floats: 16 (one zmm) for AVX-512, 8 (one ymm) elsewhere; bf16 rows load as W
// uint16 and widen in registers (a bf16 is the top half of its fp32).
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4), may_alias));
typedef uint16_t h16u __attribute__((vector_size(32), aligned(2), may_alias));
typedef uint16_t h8u __attribute__((vector_size(16), aligned(2), may_alias));
typedef uint32_t u16 __attribute__((vector_size(64)));
typedef uint32_t u8 __attribute__((vector_size(32)));

template <int W> struct Vec;
template <> struct Vec<8> { typedef v8 F; typedef v8u Fu; typedef h8u Hu; typedef u8 U; };
template <> struct Vec<16> { typedef v16 F; typedef v16u Fu; typedef h16u Hu; typedef u16 U; };

struct Bytes16 { char b[16]; };

// W entries of a cache row from entry i: fp32 rows (KT 0, also rows converted into a buffer) or bf16 (KT 1).
// Eight bf16 are widened by one vpmovzxwd from memory and a shift: GCC 12 lowers the vector conversion
// into two 128-bit halves widened and joined (five instructions), and a bf16 cache's decodes ran 1.12-1.25x
// slower so (Zen3). The instruction needs AVX2: bf16 rows are read in place only by the AVX2 and AVX-512
// items (pick_kt; portable code converts them into a buffer first).
template <int W, int KT>
__attribute__((always_inline)) inline typename Vec<W>::F ld(const void* row, int i) {
    if (KT == 0) return *(const typename Vec<W>::Fu*)((const float*)row + i);
    if constexpr (W == 8) {
        typename Vec<8>::U u;
        asm("vpmovzxwd %1, %0" : "=x"(u) : "m"(*(const Bytes16*)((const uint16_t*)row + i)));
        return (typename Vec<8>::F)(u << 16);
    }
    const typename Vec<W>::U u = __builtin_convertvector(*(const typename Vec<W>::Hu*)((const uint16_t*)row + i),
                                                         typename Vec<W>::U);
    return (typename Vec<W>::F)(u << 16);
}
template <int W>
__attribute__((always_inline)) inline typename Vec<W>::F ldq(const float* p) { return *(const typename Vec<W>::Fu*)p; }
template <int W>
__attribute__((always_inline)) inline void stq(float* p, typename Vec<W>::F x) { *(typename Vec<W>::Fu*)p = x; }

// The four horizontal sums of 16-wide a, b, c, d: 256-bit halves added (a with b, c with d, in one
// vector each), then 128-bit quarters (all four in one vector), then pairs twice. Each input goes through
// the same additions, so a key's score does not depend on which of the four it was.
__attribute__((always_inline)) inline v4 hsum4(v16 a, v16 b, v16 c, v16 d) {
    const v16 ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                   __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    const v16 cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                   __builtin_shufflevector(c, d, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    const v16 q = __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                  __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    const v16 x = q + __builtin_shufflevector(q, q, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    const v16 y = x + __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    return __builtin_shufflevector(y, y, 0, 4, 8, 12);
}

// sc[r][t] = q[r] . k[t] for RB rows and the keys t in [lo, hi) (lo, hi multiples of 4 from the chunk's
// start; keys outside its range point at a zero row). Each key is read once for all RB rows; four keys go
// at once, their sums reduced together. A key's score depends only on its q row and key, never on RB or
// on which rows share the pass. q rows are pre-scaled; D = W * NV.
template <int W, int NV, int KT, int RB>
__attribute__((always_inline)) inline void dots(const float* const* q, const void* const* k, int lo, int hi,
                                                float* const* sc, KvPrefetch& pf) {
    typedef typename Vec<W>::F F;
    for (int t = lo; t < hi; t += 4) {
        pf.pump();
        F s[RB][4];
        {
            const F k0 = ld<W, KT>(k[t], 0), k1 = ld<W, KT>(k[t + 1], 0), k2 = ld<W, KT>(k[t + 2], 0),
                    k3 = ld<W, KT>(k[t + 3], 0);
            for (int r = 0; r < RB; ++r) {
                const F qv = ldq<W>(q[r]);
                s[r][0] = qv * k0, s[r][1] = qv * k1, s[r][2] = qv * k2, s[r][3] = qv * k3;
            }
        }
        for (int c = 1; c < NV; ++c) {
            const F k0 = ld<W, KT>(k[t], W * c), k1 = ld<W, KT>(k[t + 1], W * c), k2 = ld<W, KT>(k[t + 2], W * c),
                    k3 = ld<W, KT>(k[t + 3], W * c);
            for (int r = 0; r < RB; ++r) {
                const F qv = ldq<W>(q[r] + W * c);
                s[r][0] += qv * k0, s[r][1] += qv * k1, s[r][2] += qv * k2, s[r][3] += qv * k3;
            }
        }
        for (int r = 0; r < RB; ++r)
            *(v4u*)(sc[r] + t) = hsum4(s[r][0], s[r][1], s[r][2], s[r][3]);
    }
}

// acc[r][col:col + W * NV] = acc[r] * corr[r] + sum_t p[r][t] * v[t][same] for RB rows and t in [lo, hi):
// each value row's slab is read once for all RB rows, the RB x NV outputs stay in registers. p is 0 where
// a row sees no key.
template <int W, int NV, int KT, int RB>
__attribute__((always_inline)) inline void accumulate(float* const* acc, const float* corr, const float* const* p,
                                                      const void* const* v, int lo, int hi, int col) {
    typedef typename Vec<W>::F F;
    F o[RB][NV];
    for (int r = 0; r < RB; ++r)
        for (int c = 0; c < NV; ++c)
            o[r][c] = ldq<W>(acc[r] + col + W * c) * corr[r];
    for (int t = lo; t < hi; ++t)
        for (int c = 0; c < NV; ++c) {
            const F x = ld<W, KT>(v[t], col + W * c);
            for (int r = 0; r < RB; ++r) o[r][c] += p[r][t] * x;
        }
    for (int r = 0; r < RB; ++r)
        for (int c = 0; c < NV; ++c) stq<W>(acc[r] + col + W * c, o[r][c]);
}

// Any D (NV == 0): one row at a time, scalar tails; D % 4 == 0 is not assumed.
template <int KT>
__attribute__((always_inline)) inline float entry(const void* row, int i) {
    if (KT == 0) return ((const float*)row)[i];
    const uint32_t u = (uint32_t)((const uint16_t*)row)[i] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
template <int KT>
inline void dots_any(const float* q, const void* const* k, int lo, int hi, int D, float* sc) {
    for (int t = lo; t < hi; ++t) {
        const int nv = D / 8;
        v8 s0 = {};
        for (int c = 0; c < nv; ++c) s0 += load8(q + 8 * c) * ld<8, KT>(k[t], 8 * c);
        float x = hsum(s0);
        for (int i = nv * 8; i < D; ++i) x += q[i] * entry<KT>(k[t], i);
        sc[t] = x;
    }
}
template <int KT>
inline void accumulate_any(float* acc, float corr, const float* p, const void* const* v, int lo, int hi, int D) {
    for (int i = 0; i < D; ++i) acc[i] *= corr;
    for (int t = lo; t < hi; ++t)
        for (int i = 0; i < D; ++i) acc[i] += p[t] * entry<KT>(v[t], i);
}

// Registers: the dot products keep RB x 4 sums, the accumulation RB x NC outputs over a slab of NC
// vectors of the D columns; so they fit the ISA's 32 (AVX-512) or 16 registers, at most 4 rows. AVX2
// takes D 64 in two slabs of 4 vectors, 3 rows at a time, so that a decode's 3 query heads per kv head
// share each value load and bf16 widening: one row over all 8 vectors at a time, and dot products 2 rows
// at a time, made a batch of 64 decodes over 553 keys 1.31x slower on a bf16 cache, 1.01x on fp32
// (Zen3, loadtest/results/attention_avx2_2026-12-07.txt: with the widening below, 1.35-1.57x on bf16).
template <int W, int NV> constexpr int dot_rows() { return W == 16 ? 4 : 3; }
template <int W, int NV> constexpr int acc_cols() { return W == 16 ? NV : std::min(NV, 4); }
template <int W, int NV> constexpr int acc_rows() {
    return NV == 0 ? 1 : std::max(1, std::min(4, ((W == 16 ? 32 : 16) - 4) / acc_cols<W, NV>()));
}

// dots / accumulate over rows [0, R) in groups of RB, the last group smaller. (Templates, not a lambda: a
// lambda is a function of its own that would not inherit the caller's target ISA.)
template <int W, int NV, int KT, int RB>
__attribute__((always_inline)) inline void dots_rows(int R, const float* const* q, const void* const* k, int lo, int hi,
                                                     float* const* sc, KvPrefetch& pf) {
    int r0 = 0;
    for (; r0 + RB <= R; r0 += RB) dots<W, NV, KT, RB>(q + r0, k, lo, hi, sc + r0, pf);
    const int rest = R - r0;
    if constexpr (RB > 3) if (rest == 3) return dots<W, NV, KT, 3>(q + r0, k, lo, hi, sc + r0, pf);
    if constexpr (RB > 2) if (rest == 2) return dots<W, NV, KT, 2>(q + r0, k, lo, hi, sc + r0, pf);
    if constexpr (RB > 1) if (rest == 1) return dots<W, NV, KT, 1>(q + r0, k, lo, hi, sc + r0, pf);
}
template <int W, int NC, int KT, int RB>
__attribute__((always_inline)) inline void accumulate_group(int R, float* const* acc, const float* corr,
                                                            const float* const* p, const void* const* v, int lo,
                                                            int hi, int col) {
    int r0 = 0;
    for (; r0 + RB <= R; r0 += RB) accumulate<W, NC, KT, RB>(acc + r0, corr + r0, p + r0, v, lo, hi, col);
    const float* c = corr + r0;
    const int rest = R - r0;
    if constexpr (RB > 3) if (rest == 3) return accumulate<W, NC, KT, 3>(acc + r0, c, p + r0, v, lo, hi, col);
    if constexpr (RB > 2) if (rest == 2) return accumulate<W, NC, KT, 2>(acc + r0, c, p + r0, v, lo, hi, col);
    if constexpr (RB > 1) if (rest == 1) return accumulate<W, NC, KT, 1>(acc + r0, c, p + r0, v, lo, hi, col);
}
// The D columns in slabs of acc_cols vectors, each slab's rows in groups (see acc_rows).
template <int W, int NV, int KT, int RB>
__attribute__((always_inline)) inline void accumulate_rows(int R, float* const* acc, const float* corr,
                                                           const float* const* p, const void* const* v, int lo,
                                                           int hi) {
    constexpr int NC = acc_cols<W, NV>();
    for (int col = 0; col < W * NV; col += W * NC) accumulate_group<W, NC, KT, RB>(R, acc, corr, p, v, lo, hi, col);
}


// ---- AMX: bf16 caches on CPUs with AMX-BF16 ----------------------------------------------------
// A run of several query tokens (speculative verification: k + 1 tokens times the query heads of a kv
// head) costs the vector loops above a widening per entry and a horizontal sum per score for every row;
// the tiles take 16 rows a pass: 1.5-1.7x for runs of 7, the same as the loops for decodes (3 rows a kv
// head), whose fixed costs here (transposing scores, pairing values) match the loops' arithmetic
// (loadtest/results/attention_amx_2026-12-05.txt). The tile unit multiplies bf16 pairs into fp32 sums: scores as
// keys[16 x 32] x queries[32 x rows] (the keys are tile rows as the cache stores them, a block's 16
// tokens one stride apart), outputs as weights[rows x 32 keys] x values[32 keys x 16], the values
// interleaved in key pairs once per chunk. Queries and weights are rounded to bf16 (the products and
// sums stay fp32): this path runs only where the engine already keeps bf16 (`--dtype auto` on such a
// CPU). Every score and output element is a sum over the same pairs in the same order whatever the rows
// beside it, so a token's attention stays the same alone, among drafts and in any batch.

// Tiles: keys, query pairs, scores; weights, value pairs, two output tiles (16 columns each). Macros: GCC's
// tile intrinsics paste the number into the instruction's text.
#define T_K 0
#define T_Q 1
#define T_S 2
#define T_P 3
#define T_V 4
#define T_O0 5
#define T_O1 6

// The configuration for R query rows, loaded when R changes (loading one clears the tiles).
__attribute__((target(PSQ_AMX_TARGET))) inline void configure_tiles(Scratch& s, int R) {
    if (s.tile_rows == R) return;
    TileConfig c{};
    c.palette = 1;
    const int shapes[7][2] = {{16, 64}, {16, 4 * R}, {16, 4 * R}, {R, 64}, {16, 64}, {R, 64}, {R, 64}};
    for (int t = 0; t < 7; ++t) c.rows[t] = (uint8_t)shapes[t][0], c.colsb[t] = (uint16_t)shapes[t][1];
    load_tiles(c);
    s.tile_rows = R;
}

// sc[r][t] = q[r] . k[t] for R <= 16 rows from r0 and the keys t in [0, hi) (hi a multiple of 32; keys
// outside the chunk point at a zero row). kstride: bytes from a token's entry to the next in its block.
__attribute__((target(PSQ_AMX_TARGET), noinline)) void scores_amx(Scratch& s, const void* const* k, int r0, int R,
                                                                 int hi, int D, int64_t kstride) {
    configure_tiles(s, R);
    const int parts = D / 32;
    for (int r = 0; r < R; ++r) {              // qt[j][i][r]: row r's entries 32j + 2i, 32j + 2i + 1
        const float* q = s.qp[r0 + r];
        for (int j = 0; j < parts; ++j) {
            alignas(64) uint32_t pairs[16];
            _mm512_store_si512(pairs, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + 32 * j + 16),
                                                                    _mm512_loadu_ps(q + 32 * j)));
            for (int i = 0; i < 16; ++i) s.qt[(j * 16 + i) * R + r] = pairs[i];
        }
    }
    for (int t = 0; t < hi; t += 16) {
        s.pf.pump();
        const char* base = (const char*)k[t];
        int64_t stride = kstride;
        for (int i = 1; i < 16; ++i)
            if ((const char*)k[t + i] != base + i * kstride) { stride = 0; break; }
        if (stride == 0) {                     // not one run of a block (its edges, padding): gathered
            for (int i = 0; i < 16; ++i) memcpy(&s.kg[(size_t)i * D], k[t + i], (size_t)D * 2);
            base = (const char*)s.kg.data(), stride = D * 2;
        }
        _tile_zero(T_S);
        for (int j = 0; j < parts; ++j) {
            _tile_loadd(T_K, base + 64 * j, stride);
            _tile_loadd(T_Q, s.qt.data() + (size_t)j * 16 * R, R * 4);
            _tile_dpbf16ps(T_S, T_K, T_Q);
        }
        _tile_stored(T_S, s.cs.data(), R * 4);
        for (int r = 0; r < R; ++r) {
            float* sc = s.sp[r0 + r] + t;
            for (int i = 0; i < 16; ++i) sc[i] = s.cs[i * R + r];
        }
    }
}

// acc[r] = sum_t p[r][t] v[t] for R <= 16 rows from r0 over the keys [0, hi); with `build`, first the
// chunk's values in key pairs: vv[quarter][pair][d][2] = v[2 pair][16 quarter + d], v[2 pair + 1][...].
__attribute__((target(PSQ_AMX_TARGET), noinline)) void values_amx(Scratch& s, const void* const* v, int r0, int R,
                                                                 int hi, int D, bool build) {
    configure_tiles(s, R);
    const int pairs = hi / 2;
    if (build) {
        const __m512i first = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7,
                                               38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
        const __m512i second = _mm512_add_epi16(first, _mm512_set1_epi16(16));
        for (int p = 0; p < pairs; ++p) {
            s.pf.pump();
            const uint16_t *x = (const uint16_t*)v[2 * p], *y = (const uint16_t*)v[2 * p + 1];
            for (int h = 0; h < D / 32; ++h) {
                const __m512i a = _mm512_loadu_si512(x + 32 * h), b = _mm512_loadu_si512(y + 32 * h);
                _mm512_storeu_si512(&s.vv[((size_t)(2 * h) * pairs + p) * 32], _mm512_permutex2var_epi16(a, first, b));
                _mm512_storeu_si512(&s.vv[((size_t)(2 * h + 1) * pairs + p) * 32],
                                    _mm512_permutex2var_epi16(a, second, b));
            }
        }
    }
    for (int r = 0; r < R; ++r) {              // the weights in bf16, row r at pb + r * hi
        const float* p = s.sp[r0 + r];
        for (int t = 0; t < hi; t += 32)
            _mm512_storeu_si512(&s.pb[(size_t)r * hi + t], (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + t + 16),
                                                                                       _mm512_loadu_ps(p + t)));
    }
    for (int h = 0; h < D / 32; ++h) {
        _tile_zero(T_O0);
        _tile_zero(T_O1);
        for (int t = 0; t < hi; t += 32) {
            _tile_loadd(T_P, s.pb.data() + t, hi * 2);
            _tile_loadd(T_V, s.vv.data() + ((size_t)(2 * h) * pairs + t / 2) * 32, 64);
            _tile_dpbf16ps(T_O0, T_P, T_V);
            _tile_loadd(T_V, s.vv.data() + ((size_t)(2 * h + 1) * pairs + t / 2) * 32, 64);
            _tile_dpbf16ps(T_O1, T_P, T_V);
        }
        _tile_stored(T_O0, s.ap[r0] + 32 * h, D * 4);
        _tile_stored(T_O1, s.ap[r0] + 32 * h + 16, D * 4);
    }
}

// The first key a query at position pos sees: its window's start, 0 without one.
inline int window_start(const Args& a, int pos) {
    return a.window > 0 && pos - a.window + 1 > 0 ? pos - a.window + 1 : 0;
}

// The first key sequence b's first query token sees.
inline int first_key(const Args& a, int b) { return window_start(a, a.lens[b] - (a.q_start[b + 1] - a.q_start[b])); }

// Where row r of sequence b and kv head h sits in q and out: query token r / G, head h * G + r % G.
inline int64_t row_offset(const Args& a, int b, int h, int r) {
    const int G = a.Hq / a.Hkv;
    return ((int64_t)(a.q_start[b] + r / G) * a.Hq + (int64_t)h * G + r % G) * a.D;
}

// Bytes of one cache entry, by kv_dtype.
inline int entry_bytes(int kv_dtype) { return kv_dtype == 0 ? 4 : kv_dtype <= 2 ? 2 : 1; }

// Asks for the K and V rows (heads [h0, h0 + nh)) of keys [t_lo, t_hi), a tile ahead of the chunk's
// gather: the blocks sit anywhere in the cache, so the hardware prefetcher cannot follow a sequence from
// block to block.
inline void prefetch_tile(const Args& a, const int32_t* table, int h0, int nh, int t_lo, int t_hi) {
    const int head = a.D * entry_bytes(a.kv_dtype), row = head * nh;
    for (int t = t_lo, blk = t_lo / a.bs, off = t_lo % a.bs; t < t_hi; ++t) {
        const int64_t at = (((int64_t)table[blk] * a.bs + off) * a.Hkv + h0) * head;
        for (int line = 0; line < row; line += 64) {
            __builtin_prefetch((const char*)a.k + at + line);
            __builtin_prefetch((const char*)a.v + at + line);
        }
        if (++off == a.bs) { off = 0; ++blk; }
    }
}

// One kv head's rows [r0, r0 + Rh) over the chunk's keys (see attend): every row's scores over the keys
// [lo, hi) (rows in groups that share each key's load), each row's softmax over the keys it sees, then
// the outputs (rows in groups that share each value's load).
template <int W, int NV, int KT, bool X>
__attribute__((always_inline)) inline void head_chunk(const Args& a, Scratch& s, const void* const* kp,
                                                      const void* const* vp, int r0, int Rh, int G, int p0, int c0,
                                                      int k_lo, int k_hi, int lo, int hi, int D, int h) {
    // position 0 in this chunk (then c0 = 0): its key as stored plus the sink's, as a score term q.dk
    const float* sink_k = a.sink && k_lo == 0 ? a.sink + (int64_t)h * D : nullptr;
    if constexpr (X)
        for (int g = r0; g < r0 + Rh; g += AMX_ROWS)
            scores_amx(s, kp, g, std::min(AMX_ROWS, r0 + Rh - g), hi, D, (int64_t)a.Hkv * D * 2);
    else if constexpr (NV > 0) dots_rows<W, NV, KT, dot_rows<W, NV>()>(Rh, &s.qp[r0], kp, lo, hi, &s.sp[r0], s.pf);
    int live = 0;
    for (int r = r0; r < r0 + Rh; ++r) {
        const int pos = p0 + (r - r0) / G, wlo = window_start(a, pos);      // query token (r - r0) / G
        // the keys of this chunk the row sees are one run: from its window's start to itself
        const int vlo = (wlo > k_lo ? wlo : k_lo) - c0, vhi = (pos + 1 < k_hi ? pos + 1 : k_hi) - c0;
        float* sc = s.sp[r];
        s.corr[r] = 0.f;                  // the output starts from nothing in every chunk
        if (vhi <= vlo) {                 // sees nothing here: weights 0, max -inf (the merge skips it)
            for (int t = lo; t < hi; ++t) sc[t] = 0.f;
            continue;
        }
        ++live;
        if constexpr (NV == 0) dots_any<KT>(s.qp[r], kp, vlo, vhi, D, sc);
        if (sink_k && vlo == 0) {
            float extra = 0.f;
            for (int i = 0; i < D; ++i) extra += s.qp[r][i] * sink_k[i];
            sc[0] += extra;
        }
        if (a.softcap > 0.f)
            for (int t = vlo; t < vhi; ++t) sc[t] = tanhf(sc[t] / a.softcap) * a.softcap;
        s.m[r] = max_of(sc + vlo, vhi - vlo, -INFINITY);
        s.l[r] = exp_shifted(sc + vlo, vhi - vlo, s.m[r]);
        for (int t = lo; t < vlo; ++t) sc[t] = 0.f;
        for (int t = vhi; t < hi; ++t) sc[t] = 0.f;
    }
    if (!live) return;
    if constexpr (X)
        for (int g = r0; g < r0 + Rh; g += AMX_ROWS)
            values_amx(s, vp, g, std::min(AMX_ROWS, r0 + Rh - g), hi, D, g == r0);
    else if constexpr (NV > 0)
        accumulate_rows<W, NV, KT, acc_rows<W, NV>()>(Rh, &s.ap[r0], &s.corr[r0], &s.sp[r0], vp, lo, hi);
    else
        for (int r = r0; r < r0 + Rh; ++r) accumulate_any<KT>(s.ap[r], s.corr[r], s.sp[r], vp, lo, hi, D);
    if (sink_k) {          // and its value plus the sink's: weight (0 where unseen) times dv
        const float* sink_v = a.sink + ((int64_t)a.Hkv + h) * D;
        for (int r = r0; r < r0 + Rh; ++r)
            for (int i = 0; i < D; ++i) s.ap[r][i] += s.sp[r][0] * sink_v[i];
    }
}

// Attention of sequence b's query rows over kv heads [h0, h0 + nh) and the keys [k_lo, k_hi) of one
// chunk: per head, its n query tokens (the last n positions of its lens[b] keys, causal among
// themselves) times the G query heads sharing it; row hh * n * G + r is head h0 + hh's row r. Each row
// leaves its max, sum and unnormalized output over the chunk in s.m, s.l, s.acc, which Parts::merge_into
// combines over chunks. The chunk's scores are all taken before its softmax, so each row needs one max
// and one exponential pass per chunk. A row's arithmetic is the same in any group, any query run and any
// head range, so a token's attention is bit-identical decoded alone or verified among drafts.
// nh > 1 only for caches read in place (fp32, bf16): a key's heads are one contiguous entry, read together.
template <int W, int NV, int KT, bool X = false>
__attribute__((always_inline)) inline void attend(const Args& a, int b, int h0, int nh, int k_lo, int k_hi,
                                                  Scratch& s) {
    const int G = a.Hq / a.Hkv, D = NV ? W * NV : a.D;
    const int n = a.q_start[b + 1] - a.q_start[b], Rh = n * G, R = nh * Rh, p0 = a.lens[b] - n;
    for (int r = 0; r < R; ++r) {
        s.m[r] = -INFINITY, s.l[r] = 0.f;
        const float* q = a.q + row_offset(a, b, h0 + r / Rh, r % Rh);
        for (int i = 0; i < D; ++i) s.qs[(int64_t)r * D + i] = q[i] * a.scale;
        s.qp[r] = s.qs.data() + (int64_t)r * D;
        s.sp[r] = s.scores.data() + (int64_t)r * SCORE_STRIDE;
        s.ap[r] = s.acc.data() + (int64_t)r * D;
    }
    memset(s.acc.data(), 0, sizeof(float) * R * D);
    const int32_t* table = a.tables + (int64_t)b * a.max_blocks;
    const bool in_place = a.kv_dtype == KT;       // fp32 or bf16 rows are read where they are
    const int64_t head_bytes = (int64_t)a.D * (KT ? 2 : 4);
    // kp / vp / scores are indexed from c0; [lo, hi) is [k_lo, k_hi) rounded out to fours (the extra keys
    // read a zero row)
    // the AMX path's 32-key value products start at multiples of 32 by position, so a key always shares
    // one with the same others whatever the chunk's first key (a window's start moves with the query run)
    const int c0 = X ? k_lo & ~31 : k_lo & ~3, lo = 0, hi = X ? (k_hi - c0 + 31) & ~31 : (k_hi - c0 + 3) & ~3;
    for (int t = lo; t < hi; ++t) s.kp[t] = s.vp[t] = s.zero.data();
    const bool fetch = !s.pf.ahead;               // else earlier chunks streamed these rows in
    if (fetch) prefetch_tile(a, table, h0, nh, k_lo, std::min(k_hi, k_lo + TILE));
    for (int t = k_lo, blk = k_lo / a.bs, off = k_lo % a.bs; t < k_hi; ++t) {
        const int64_t at = ((int64_t)table[blk] * a.bs + off) * a.Hkv + h0;
        if (in_place) {
            s.kp[t - c0] = (const char*)a.k + at * head_bytes;
            s.vp[t - c0] = (const char*)a.v + at * head_bytes;
            if (fetch && (t - k_lo) % TILE == 0) prefetch_tile(a, table, h0, nh, t + TILE, std::min(k_hi, t + 2 * TILE));
        } else {
            s.kp[t - c0] = row_at(a, a.k, table[blk], off, h0, s.kbuf.data() + (int64_t)(t - c0) * D);
            s.vp[t - c0] = row_at(a, a.v, table[blk], off, h0, s.vbuf.data() + (int64_t)(t - c0) * D);
        }
        if (++off == a.bs) { off = 0; ++blk; }
    }
    for (int hh = 0; hh < nh; ++hh) {
        const void* const* kp = s.kp.data();
        const void* const* vp = s.vp.data();
        if (hh > 0) {             // head h0 + hh: the same entries, hh heads further (zero rows stay zero)
            for (int t = lo; t < hi; ++t) {
                s.kh[t] = (const char*)s.kp[t] + hh * head_bytes;
                s.vh[t] = (const char*)s.vp[t] + hh * head_bytes;
            }
            kp = s.kh.data(), vp = s.vh.data();
        }
        head_chunk<W, NV, KT, X>(a, s, kp, vp, hh * Rh, Rh, G, p0, c0, k_lo, k_hi, lo, hi, D, h0 + hh);
    }
}

// The per-ISA entry of one work item. The ISA must be on this function, not on a caller: the body of an
// `omp parallel` region is outlined into a function of its own, which would not inherit the target.
using Item = void (*)(const Args&, int, int, int, int, int, Scratch&);
template <int NV, int KT>
__attribute__((target("avx512f,avx512bw,avx512vl,fma"))) void item_avx512(const Args& a, int b, int h0, int nh,
                                                                          int lo, int hi, Scratch& s) {
    attend<16, NV, KT>(a, b, h0, nh, lo, hi, s);
}
template <int NV>
__attribute__((target(PSQ_AMX_TARGET))) void item_amx(const Args& a, int b, int h0, int nh, int lo, int hi,
                                                      Scratch& s) {
    attend<16, NV, 1, true>(a, b, h0, nh, lo, hi, s);
}
template <int NV, int KT>
__attribute__((target("avx2,fma"))) void item_avx2(const Args& a, int b, int h0, int nh, int lo, int hi, Scratch& s) {
    attend<8, NV, KT>(a, b, h0, nh, lo, hi, s);
}
template <int NV, int KT>
void item_portable(const Args& a, int b, int h0, int nh, int lo, int hi, Scratch& s) {
    attend<8, NV, KT>(a, b, h0, nh, lo, hi, s);
}

// Head sizes of the models we serve get a compile-time D (registers, unrolled loops); any other D runs
// the generic loops. NV counts 8-float vectors here; AVX-512 takes half as many of 16.
template <int KT>
Item pick_kt(int isa, int D) {
#define PSQ_PICK(NV) (isa >= 2 ? item_avx512<(NV) / 2, KT> : isa == 1 ? item_avx2<NV, KT> : item_portable<NV, 0>)
    switch (D) {
        case 64: return PSQ_PICK(8);
        case 128: return PSQ_PICK(16);
        case 32: return PSQ_PICK(4);
        case 16: return PSQ_PICK(2);
        default: return PSQ_PICK(0);
    }
#undef PSQ_PICK
}
// isa 3: AVX-512 with AMX-BF16, whose tiles take bf16 caches of head sizes in 32s (the others run AVX-512).
bool takes_amx(int isa, int D, int kv_dtype) { return isa >= 3 && kv_dtype == 1 && (D == 32 || D == 64 || D == 128); }
// Whether rows are converted into fp32 buffers as they are gathered: fp16 and fp8 caches, and bf16 ones in
// portable code (ld's widening needs AVX2); fp32 and other bf16 rows are read in place.
bool converts(int isa, int kv_dtype) { return kv_dtype > 1 || (kv_dtype == 1 && isa == 0); }
Item pick(int isa, int D, int kv_dtype) {
    if (takes_amx(isa, D, kv_dtype)) return D == 32 ? item_amx<2> : D == 64 ? item_amx<4> : item_amx<8>;
    return kv_dtype == 1 && !converts(isa, kv_dtype) ? pick_kt<1>(isa, D) : pick_kt<0>(isa, D);
}

// A chunk's running sums, kept for the merge: [rows] maxima, [rows] sums, [rows][D] outputs.
struct Parts {
    std::vector<float> m, l, acc;
    int R = 0, D = 0;
    void resize(int64_t parts, int rows, int d) {
        R = rows, D = d;
        m.resize(parts * rows), l.resize(parts * rows), acc.resize(parts * rows * d);
    }
    void keep(int64_t part, const Scratch& s, int rows) {
        memcpy(&m[part * R], s.m.data(), sizeof(float) * rows);
        memcpy(&l[part * R], s.l.data(), sizeof(float) * rows);
        memcpy(&acc[part * R * D], s.acc.data(), sizeof(float) * rows * D);
    }
    // The outputs of sequence b's rows over kv head h (kept from row `base` of each part) from its chunks,
    // parts first .. first + count - 1, in order: each chunk weighted by e^(its max - the overall max); a
    // chunk with no key the row sees (max -inf) is skipped.
    void merge_into(const Args& a, int b, int h, int base, int64_t first, int count) const {
        const int rows = (a.q_start[b + 1] - a.q_start[b]) * (a.Hq / a.Hkv);
        for (int r = 0; r < rows; ++r) {
            float mx = -INFINITY, total = 0.f;
            const int64_t at = base + r;
            for (int64_t p = first; p < first + count; ++p) mx = m[p * R + at] > mx ? m[p * R + at] : mx;
            float* out = a.out + row_offset(a, b, h, r);
            for (int i = 0; i < D; ++i) out[i] = 0.f;
            for (int64_t p = first; p < first + count; ++p) {
                if (m[p * R + at] == -INFINITY) continue;
                const float w = expf(m[p * R + at] - mx);
                total += l[p * R + at] * w;
                const float* x = &acc[(p * R + at) * D];
                for (int i = 0; i < D; ++i) out[i] += x[i] * w;
            }
            for (int i = 0; i < D; ++i) out[i] /= total;
        }
    }
};

// Chunk c of sequence b: keys [max(c * CHUNK, first), min((c + 1) * CHUNK, lens)).
inline int chunk_lo(const Args& a, int b, int c) { return std::max(c * CHUNK, first_key(a, b)); }
inline int chunk_hi(const Args& a, int b, int c) { return std::min((c + 1) * CHUNK, a.lens[b]); }

// Work items: with at least four (sequence, kv head) pairs per thread, one sequence each, its chunks in
// turn, every kv head of a key read together (caches read in place: a key's heads are one contiguous
// entry, which streams from memory far better than one head's slice of it; other caches one pair each);
// with fewer pairs, one (pair, chunk) each, so a single stream's 2-8 kv heads still use every core. The
// chunks and their merge are the same either way.
void attend_all(const Args& a, Item item, bool amx, bool convert) {
    int most = 1;
    int64_t work = 0;
    std::vector<int> chunk0(a.B), chunks(a.B);
    std::vector<int64_t> start(a.B + 1, 0);             // sequence b's chunks are items start[b] ..
    for (int b = 0; b < a.B; ++b) {
        const int n = a.q_start[b + 1] - a.q_start[b];
        most = n > most ? n : most;
        work += (int64_t)n * a.lens[b];
        chunk0[b] = first_key(a, b) / CHUNK;
        chunks[b] = (a.lens[b] - 1) / CHUNK - chunk0[b] + 1;
        start[b + 1] = start[b] + chunks[b];
    }
    const int G = a.Hq / a.Hkv, pairs = a.B * a.Hkv;
    work *= (int64_t)a.Hq * a.D;
    const bool parallel = work > (1 << 15);
    const bool per_pair = pairs >= (parallel ? 4 * omp_get_max_threads() : 1);
    const int nh = per_pair && !convert ? a.Hkv : 1, groups = a.Hkv / nh;   // kv heads per item
    const int R = most * G * nh;
    Parts shared;                                        // per (pair, chunk), when chunks are items
    if (!per_pair) shared.resize(start[a.B] * a.Hkv, R, a.D);
    std::atomic<int64_t> claimed{0};                     // work items handed out (dynamic scheduling)
    const int head_bytes = a.D * entry_bytes(a.kv_dtype);
    // Queues keys [lo, hi) of sequence b, kv heads [h0, h0 + n), on s's prefetcher.
    auto queue = [&](Scratch& s, int b, int h0, int n, int lo, int hi) {
        s.pf.extend(a.tables + (int64_t)b * a.max_blocks, head_bytes, h0, n, lo, hi);
    };
    // Before a chunk of `keys` keys over n heads: `end` moves to its end among the queued keys (unless it
    // is the thread's first chunk, the queue's origin), and the prefetcher gets its share: the lines up to
    // a chunk's worth of keys past that end, pumped once per 16 keys and key pair (AMX) or 4 keys a head.
    auto advance = [&](Scratch& s, int64_t& end, bool origin, int n, int keys) {
        if (!origin) end += keys;
        s.pf.budget(end, CHUNK, (int64_t)n * keys * (amx ? 9 : 4) / 16);
    };
#pragma omp parallel if (parallel)
    {
        Scratch s(R, a.D, nh, convert, amx);
        s.pf.setup(a.k, a.v, a.bs, a.Hkv, head_bytes);
        int64_t end = 0;            // keys queued on the prefetcher up to the end of the chunk computing
        TileConfig found{};
        if (amx) tiles_save(&found);
        if (per_pair) {
            Parts own;
            int it = claimed++;
            for (bool first = true; it < a.B * groups; first = false) {
                const int next = claimed++;      // claimed now, so its rows stream in while `it` computes
                const int b = it / groups, h0 = it % groups * nh, rows = (a.q_start[b + 1] - a.q_start[b]) * G;
                own.resize(chunks[b], R, a.D);
                for (int c = 0; c < chunks[b]; ++c) {
                    const int lo = chunk_lo(a, b, chunk0[b] + c), hi = chunk_hi(a, b, chunk0[b] + c);
                    if (c == 0) {                // the queue: the thread's first sequence after its first
                        if (first) queue(s, b, h0, nh, hi, a.lens[b]);      // chunk, then each next one
                        if (next < a.B * groups) {
                            const int nb = next / groups;
                            queue(s, nb, next % groups * nh, nh, chunk_lo(a, nb, chunk0[nb]), a.lens[nb]);
                        }
                    }
                    advance(s, end, first && c == 0, nh, hi - lo);
                    item(a, b, h0, nh, lo, hi, s);
                    s.pf.finish();
                    own.keep(c, s, rows * nh);
                }
                for (int hh = 0; hh < nh; ++hh) own.merge_into(a, b, h0 + hh, hh * rows, 0, chunks[b]);
                it = next;
            }
        } else {
            const int64_t items = start[a.B] * a.Hkv;
            // item w: pair (b, h) = its sequence's chunks times kv heads, chunk c of b
            auto unit = [&](int64_t w, int& b, int& h, int& c) {
                b = 0;
                while (start[b + 1] * a.Hkv <= w) ++b;
                const int64_t off = w - start[b] * a.Hkv;
                h = (int)(off / chunks[b]), c = chunk0[b] + (int)(off % chunks[b]);
            };
            int64_t w = claimed++;
            for (bool first = true; w < items; first = false) {
                const int64_t next = claimed++;
                int b, h, c;
                unit(w, b, h, c);
                const int lo = chunk_lo(a, b, c), hi = chunk_hi(a, b, c);
                if (next < items) {
                    int nb, nh_, nc;
                    unit(next, nb, nh_, nc);
                    queue(s, nb, nh_, 1, chunk_lo(a, nb, nc), chunk_hi(a, nb, nc));
                }
                advance(s, end, first, 1, hi - lo);
                item(a, b, h, 1, lo, hi, s);
                s.pf.finish();
                shared.keep(w, s, (a.q_start[b + 1] - a.q_start[b]) * G);
                w = next;
            }
#pragma omp barrier
#pragma omp for schedule(static)
            for (int pair = 0; pair < pairs; ++pair) {
                const int b = pair / a.Hkv, h = pair % a.Hkv;
                shared.merge_into(a, b, h, 0, start[b] * a.Hkv + (int64_t)h * chunks[b], chunks[b]);
            }
        }
        if (amx) tiles_restore(&found);
    }
}

}  // namespace

extern "C" {

// Returns 0, or -1 when the shapes are beyond the kernel.
int psq_paged_attention(const float* q, const void* k_cache, const void* v_cache, int kv_dtype, const int32_t* tables,
                        int max_blocks, const int32_t* seq_lens, const int32_t* q_start, int B, int Hq, int Hkv, int D,
                        int block_size, float scale, float* out, int window, float softcap, const float* sink,
                        int isa) {
    if (Hkv <= 0 || Hq % Hkv || kv_dtype < 0 || kv_dtype > 4 || D <= 0) return -1;
    if (B <= 0) return 0;
    const Args a{q, k_cache, v_cache, kv_dtype, tables, max_blocks, seq_lens, q_start, B, Hq, Hkv, D, block_size,
                 scale, out, window, softcap, sink};
    attend_all(a, pick(isa, D, kv_dtype), takes_amx(isa, D, kv_dtype), converts(isa, kv_dtype));
    return 0;
}

// Keys per chunk: the AMX path rounds each chunk's weights to bf16 apart (tests follow it).
int psq_attention_chunk() { return CHUNK; }

// 1 when this CPU has AMX-BF16 (with AVX512-BF16) and the kernel lets this process use the tiles (Linux
// grants their state on request, once per process); 0 otherwise. Run before any call with isa 3.
int psq_amx_ready() {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 22) & 1) || !((d >> 24) & 1)) return 0;
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !((a >> 5) & 1)) return 0;
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

}  // extern "C"
