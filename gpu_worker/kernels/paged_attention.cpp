// Paged attention on the CPU straight from the KV cache, for decodes and for short query runs behind a
// context (speculative verification, small prefill chunks): a few query tokens per sequence.
//
// Why a kernel of our own: in torch each such sequence gathers its blocks into a contiguous copy and
// calls SDPA with a mask, per layer; at a handful of sequences those fixed costs outweigh the arithmetic.
// Here each (sequence, kv head) reads its keys through the block table in place, a tile at a time,
// converting fp32 / bf16 / fp16 / fp8 entries as it goes, and every query row of that sequence and kv
// head (its tokens times the query heads sharing the kv head) reads the tile while it sits in L1.
//
// Layouts: q and out are fp32 [rows][Hq][D]; sequence b owns rows q_start[b] .. q_start[b + 1] - 1, its
// last n tokens, the last at position seq_lens[b] - 1 (all are written to the cache before attention);
// token j attends causally to positions up to seq_lens[b] - n + j. k and v caches are
// [blocks][block_size][Hkv][D] of `kv_dtype` (0 fp32, 1 bf16, 2 fp16, 3 fp8 e4m3fn, 4 fp8 e5m2);
// block_tables int32 [B][max_blocks]. Query head h reads kv head h / (Hq / Hkv). `scale` multiplies q.k
// (the caller folds the cache's k scale in); the v scale is applied by the caller. `window` > 0 limits
// each query to its last `window` keys (its own included: sliding-window layers); `softcap` > 0 caps each
// score at tanh(s / softcap) * softcap (Gemma 2).
//
// Each entry point takes an `isa` level (2 AVX-512, 1 AVX2+FMA, 0 portable): the same loops compiled
// for each target (GCC vector types lower to each one's registers), chosen at run time, so every path can
// be tested on one machine.
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "fp8.h"

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
};

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4), may_alias));   // unaligned loads and stores

__attribute__((always_inline)) inline v8 load8(const float* p) { return *(const v8u*)p; }
__attribute__((always_inline)) inline void store8(float* p, v8 x) { *(v8u*)p = x; }
// In hsum4's order, so a key's score is the same whichever of the two reduced it.
__attribute__((always_inline)) inline float hsum(v8 x) {
    return ((x[0] + x[4]) + (x[2] + x[6])) + ((x[1] + x[5]) + (x[3] + x[7]));
}

typedef int32_t v8i __attribute__((vector_size(32)));

// Keys go by in tiles of TILE at fixed positions (multiples of TILE), and in chunks of CHUNK keys (at
// multiples of CHUNK) whose running sums are merged at the end. Both are fixed by position alone, never by
// the batch, the thread count or the query run, so a token's attention is bit-identical whether it is
// decoded alone or verified among drafts, in any batch: speculation keeps greedy output exactly.
constexpr int TILE = 32;     // keys per tile: their K/V rows (fp32) stay in L1 while every query row reads them
constexpr int CHUNK = 256;   // keys per chunk: a long sequence's chunks run in parallel

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

// e^x, 8 at a time, for the softmax's x <= 0: x = n ln2 + r with |r| <= ln2 / 2, e^r by Cephes' expf
// polynomial (about 1 ulp), times 2^n built in the exponent bits. Below -87 it gives e^-87, not 0: a
// weight that small changes no sum it joins.
__attribute__((always_inline)) inline v8 exp8(v8 x) {
    x = x < -87.f ? (v8){} - 87.f : x;
    const v8 n = (x * 1.44269504f + 12582912.f) - 12582912.f;          // round to nearest: 1.5 * 2^23
    const v8 r = (x - n * 0.693359375f) - n * -2.12194440e-4f;          // ln 2 in two parts
    v8 p = 1.9875691500e-4f * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    return p * (v8)((__builtin_convertvector(n, v8i) + 127) << 23);
}

// The largest of m and sc[0:T] (sc has room for TILE: the tail is padded).
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

// sc[0:T] = e^(sc - mx); returns their sum. sc has room for TILE: the tail is padded with -inf (0 here).
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

// Per-thread buffers, sized for the step's largest work item.
struct Scratch {
    std::vector<float> kbuf, vbuf, scores, acc, m, l;
    std::vector<const float*> kp, vp;
    Scratch(int rows, int D)
        : kbuf((size_t)TILE * D), vbuf((size_t)TILE * D), scores((size_t)rows * TILE), acc((size_t)rows * D),
          m(rows), l(rows), kp(TILE), vp(TILE) {}
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

// sc[t] = scale * q . k[t] for t < T. NV > 0 fixes D = 8 * NV at compile time: q (times scale) sits in
// registers and four keys go at once (four independent sums, reduced together); NV == 0 takes any D.
template <int NV>
__attribute__((always_inline)) inline void dots(const float* q, float scale, const float* const* k, int T, int D,
                                                float* sc) {
    if (NV) {
        constexpr int R = NV ? NV : 1;
        v8 qv[R];
        for (int c = 0; c < R; ++c) qv[c] = load8(q + 8 * c) * scale;
        int t = 0;
        for (; t + 4 <= T; t += 4) {
            v8 s0 = qv[0] * load8(k[t]), s1 = qv[0] * load8(k[t + 1]), s2 = qv[0] * load8(k[t + 2]),
               s3 = qv[0] * load8(k[t + 3]);
            for (int c = 1; c < R; ++c) {
                s0 += qv[c] * load8(k[t] + 8 * c);
                s1 += qv[c] * load8(k[t + 1] + 8 * c);
                s2 += qv[c] * load8(k[t + 2] + 8 * c);
                s3 += qv[c] * load8(k[t + 3] + 8 * c);
            }
            *(v4u*)(sc + t) = hsum4(s0, s1, s2, s3);
        }
        for (; t < T; ++t) {
            v8 s0 = qv[0] * load8(k[t]);
            for (int c = 1; c < R; ++c) s0 += qv[c] * load8(k[t] + 8 * c);
            sc[t] = hsum(s0);
        }
        return;
    }
    const int nv = D / 8;
    for (int t = 0; t < T; ++t) {
        v8 s0 = {};
        for (int c = 0; c < nv; ++c) s0 += load8(q + 8 * c) * load8(k[t] + 8 * c);
        float x = hsum(s0);
        for (int i = nv * 8; i < D; ++i) x += q[i] * k[t][i];
        sc[t] = x * scale;
    }
}

// acc[0:D] = acc * corr + sum_t p[t] * v[t][0:D]
template <int NV>
__attribute__((always_inline)) inline void accumulate(float* acc, float corr, const float* p, const float* const* v,
                                                      int T, int D) {
    const int nv = NV ? NV : D / 8;
    constexpr int R = NV ? NV : 1;
    if (NV) {
        v8 o[R];
        for (int c = 0; c < R; ++c) o[c] = load8(acc + 8 * c) * corr;
        for (int t = 0; t < T; ++t)
            for (int c = 0; c < R; ++c) o[c] += p[t] * load8(v[t] + 8 * c);
        for (int c = 0; c < R; ++c) store8(acc + 8 * c, o[c]);
        return;
    }
    for (int i = 0; i < D; ++i) acc[i] *= corr;
    for (int t = 0; t < T; ++t) {
        for (int c = 0; c < nv; ++c) store8(acc + 8 * c, load8(acc + 8 * c) + p[t] * load8(v[t] + 8 * c));
        for (int i = nv * 8; i < D; ++i) acc[i] += p[t] * v[t][i];
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

// Attention of sequence b's query rows over kv head h and the keys [k_lo, k_hi) (within one chunk): its
// n query tokens (the last n positions of its lens[b] keys, causal among themselves) times the G query
// heads sharing h. Each row keeps a running max, sum and unnormalized output (online softmax) in s.m,
// s.l, s.acc, which Parts::merge_into combines over chunks.
template <int NV>
__attribute__((always_inline)) inline void attend(const Args& a, int b, int h, int k_lo, int k_hi, Scratch& s) {
    const int G = a.Hq / a.Hkv, D = NV ? 8 * NV : a.D;
    const int n = a.q_start[b + 1] - a.q_start[b], R = n * G, p0 = a.lens[b] - n;
    for (int r = 0; r < R; ++r) { s.m[r] = -INFINITY; s.l[r] = 0.f; }
    memset(s.acc.data(), 0, sizeof(float) * R * D);
    const int32_t* table = a.tables + (int64_t)b * a.max_blocks;
    for (int t0 = k_lo - k_lo % TILE; t0 < k_hi; t0 += TILE) {
        // keys [ts, te) of the tile [t0, t0 + TILE) are in range; kp / vp are indexed from t0
        const int ts = k_lo > t0 ? k_lo : t0, te = k_hi < t0 + TILE ? k_hi : t0 + TILE;
        for (int t = ts, blk = ts / a.bs, off = ts % a.bs; t < te; ++t) {
            s.kp[t - t0] = row_at(a, a.k, table[blk], off, h, s.kbuf.data() + (int64_t)(t - t0) * D);
            s.vp[t - t0] = row_at(a, a.v, table[blk], off, h, s.vbuf.data() + (int64_t)(t - t0) * D);
            if (++off == a.bs) { off = 0; ++blk; }
        }
        for (int r = 0; r < R; ++r) {
            const int pos = p0 + r / G, lo = window_start(a, pos);      // query token r / G at position pos
            const float* q = a.q + row_offset(a, b, h, r);
            // the keys of this tile the row sees are one run: from its window's start to itself
            const int vlo = lo > ts ? lo : ts, vhi = pos + 1 < te ? pos + 1 : te, n_keys = vhi - vlo;
            if (n_keys <= 0) continue;
            float* sc = s.scores.data() + (int64_t)r * TILE;
            dots<NV>(q, a.scale, s.kp.data() + (vlo - t0), n_keys, D, sc);
            if (a.softcap > 0.f)
                for (int t = 0; t < n_keys; ++t) sc[t] = tanhf(sc[t] / a.softcap) * a.softcap;
            const float mx = max_of(sc, n_keys, s.m[r]);
            const float sum = exp_shifted(sc, n_keys, mx);
            const float corr = s.m[r] == -INFINITY ? 0.f : expf(s.m[r] - mx);
            s.l[r] = s.l[r] * corr + sum;
            s.m[r] = mx;
            accumulate<NV>(s.acc.data() + (int64_t)r * D, corr, sc, s.vp.data() + (vlo - t0), n_keys, D);
        }
    }
}

// The per-ISA entry of one work item. The ISA must be on this function, not on a caller: the body of an
// `omp parallel` region is outlined into a function of its own, which would not inherit the target.
using Item = void (*)(const Args&, int, int, int, int, Scratch&);
template <int NV>
__attribute__((target("avx512f,avx512bw,fma"))) void item_avx512(const Args& a, int b, int h, int lo, int hi,
                                                                 Scratch& s) {
    attend<NV>(a, b, h, lo, hi, s);
}
template <int NV>
__attribute__((target("avx2,fma"))) void item_avx2(const Args& a, int b, int h, int lo, int hi, Scratch& s) {
    attend<NV>(a, b, h, lo, hi, s);
}
template <int NV>
void item_portable(const Args& a, int b, int h, int lo, int hi, Scratch& s) { attend<NV>(a, b, h, lo, hi, s); }

// Head sizes of the models we serve get a compile-time D (registers, unrolled loops); any other D runs
// the generic loops.
Item pick(int isa, int D) {
#define PSQ_PICK(NV) (isa >= 2 ? item_avx512<NV> : isa == 1 ? item_avx2<NV> : item_portable<NV>)
    switch (D) {
        case 64: return PSQ_PICK(8);
        case 128: return PSQ_PICK(16);
        case 32: return PSQ_PICK(4);
        case 16: return PSQ_PICK(2);
        default: return PSQ_PICK(0);
    }
#undef PSQ_PICK
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
    // The outputs of sequence b's rows over kv head h from its chunks, parts first .. first + count - 1,
    // in order: each chunk weighted by e^(its max - the overall max); a chunk with no key the row sees
    // (max -inf) is skipped.
    void merge_into(const Args& a, int b, int h, int64_t first, int count) const {
        const int rows = (a.q_start[b + 1] - a.q_start[b]) * (a.Hq / a.Hkv);
        for (int r = 0; r < rows; ++r) {
            float mx = -INFINITY, total = 0.f;
            for (int64_t p = first; p < first + count; ++p) mx = m[p * R + r] > mx ? m[p * R + r] : mx;
            float* out = a.out + row_offset(a, b, h, r);
            for (int i = 0; i < D; ++i) out[i] = 0.f;
            for (int64_t p = first; p < first + count; ++p) {
                if (m[p * R + r] == -INFINITY) continue;
                const float w = expf(m[p * R + r] - mx);
                total += l[p * R + r] * w;
                const float* x = &acc[(p * R + r) * D];
                for (int i = 0; i < D; ++i) out[i] += x[i] * w;
            }
            for (int i = 0; i < D; ++i) out[i] /= total;
        }
    }
};

// Chunk c of sequence b: keys [max(c * CHUNK, first), min((c + 1) * CHUNK, lens)).
inline int chunk_lo(const Args& a, int b, int c) { return std::max(c * CHUNK, first_key(a, b)); }
inline int chunk_hi(const Args& a, int b, int c) { return std::min((c + 1) * CHUNK, a.lens[b]); }

// Work items: with at least four (sequence, kv head) pairs per thread, one pair each, its chunks in turn;
// with fewer, one (pair, chunk) each, so a single stream's 2-8 kv heads still use every core. The chunks
// and their merge are the same either way.
void attend_all(const Args& a, Item item) {
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
    const int G = a.Hq / a.Hkv, R = most * G, pairs = a.B * a.Hkv;
    work *= (int64_t)a.Hq * a.D;
    const bool parallel = work > (1 << 15);
    const bool per_pair = pairs >= (parallel ? 4 * omp_get_max_threads() : 1);
    Parts shared;                                        // per (pair, chunk), when chunks are items
    if (!per_pair) shared.resize(start[a.B] * a.Hkv, R, a.D);
#pragma omp parallel if (parallel)
    {
        Scratch s(R, a.D);
        if (per_pair) {
            Parts own;
#pragma omp for schedule(dynamic)
            for (int pair = 0; pair < pairs; ++pair) {
                const int b = pair / a.Hkv, h = pair % a.Hkv, rows = (a.q_start[b + 1] - a.q_start[b]) * G;
                own.resize(chunks[b], R, a.D);
                for (int c = 0; c < chunks[b]; ++c) {
                    item(a, b, h, chunk_lo(a, b, chunk0[b] + c), chunk_hi(a, b, chunk0[b] + c), s);
                    own.keep(c, s, rows);
                }
                own.merge_into(a, b, h, 0, chunks[b]);
            }
        } else {
#pragma omp for schedule(dynamic)
            for (int64_t w = 0; w < start[a.B] * a.Hkv; ++w) {
                // item w: pair (b, h) = its sequence's chunks times kv heads, chunk c of b
                int b = 0;
                while (start[b + 1] * a.Hkv <= w) ++b;
                const int64_t off = w - start[b] * a.Hkv;
                const int h = (int)(off / chunks[b]), c = (int)(off % chunks[b]);
                item(a, b, h, chunk_lo(a, b, chunk0[b] + c), chunk_hi(a, b, chunk0[b] + c), s);
                shared.keep(w, s, (a.q_start[b + 1] - a.q_start[b]) * G);
            }
#pragma omp for schedule(static)
            for (int pair = 0; pair < pairs; ++pair) {
                const int b = pair / a.Hkv, h = pair % a.Hkv;
                shared.merge_into(a, b, h, start[b] * a.Hkv + (int64_t)h * chunks[b], chunks[b]);
            }
        }
    }
}

}  // namespace

extern "C" {

// Returns 0, or -1 when the shapes are beyond the kernel.
int psq_paged_attention(const float* q, const void* k_cache, const void* v_cache, int kv_dtype, const int32_t* tables,
                        int max_blocks, const int32_t* seq_lens, const int32_t* q_start, int B, int Hq, int Hkv, int D,
                        int block_size, float scale, float* out, int window, float softcap, int isa) {
    if (Hkv <= 0 || Hq % Hkv || kv_dtype < 0 || kv_dtype > 4 || D <= 0) return -1;
    if (B <= 0) return 0;
    const Args a{q, k_cache, v_cache, kv_dtype, tables, max_blocks, seq_lens, q_start, B, Hq, Hkv, D, block_size,
                 scale, out, window, softcap};
    attend_all(a, pick(isa, D));
    return 0;
}

}  // extern "C"
