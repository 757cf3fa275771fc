// Decode attention on the CPU straight from the paged KV cache: one query token per sequence.
//
// Why a kernel of our own: in torch a decode step gathers each sequence's blocks into a contiguous
// copy and calls SDPA with a padding mask, per layer; at a handful of sequences that is a few small
// ops whose fixed costs outweigh the arithmetic. Here each (sequence, kv head) reads its tokens through
// the block table in place, converting fp32 / bf16 / fp16 / fp8 entries as it goes.
//
// Layouts: q and out are fp32 [B][Hq][D]; k and v caches are [blocks][block_size][Hkv][D] of `kv_dtype`
// (0 fp32, 1 bf16, 2 fp16, 3 fp8 e4m3fn, 4 fp8 e5m2); block_tables int32 [B][max_blocks]; seq_lens int32
// [B] counts the tokens to attend to, the current one included (it is written before attention). Query
// head h reads kv head h / (Hq / Hkv). `scale` multiplies q.k (the caller folds the cache's k scale in);
// the v scale is applied by the caller. `window` > 0 limits each query to its last `window` keys (its own
// included: sliding-window layers); `softcap` > 0 caps each score at tanh(s / softcap) * softcap (Gemma 2).
//
// Each entry point takes an `isa` level (2 AVX-512, 1 AVX2+FMA, 0 portable): the same loops compiled
// for each target, chosen at run time, so every path can be tested on one machine.
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

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
    const int32_t* tables; int max_blocks; const int32_t* lens;
    int B, Hq, Hkv, D, bs; float scale; float* out; int window; float softcap;
};

// One cache row (D entries of a token and kv head) as fp32: fp32 rows are used in place.
__attribute__((always_inline)) inline const float* row_at(const Args& a, const void* cache, int b, int t, int h,
                                                            float* buf) {
    const int64_t block = a.tables[(int64_t)b * a.max_blocks + t / a.bs];
    const int64_t at = ((block * a.bs + t % a.bs) * a.Hkv + h) * a.D;
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

// Softmax attention of the G query heads that share kv head h, for sequence b: scores, then weights,
// then the weighted sum of V rows (two passes over the cache, no rescaling per token).
__attribute__((always_inline)) inline void attend(const Args& a, int b, int h, float* scores, float* buf,
                                                  float* acc) {
    const int G = a.Hq / a.Hkv, D = a.D;
    const int first = a.window > 0 && a.lens[b] > a.window ? a.lens[b] - a.window : 0;
    const int L = a.lens[b] - first;      // keys attended to: positions first .. lens[b] - 1
    const float* q = a.q + ((int64_t)b * a.Hq + (int64_t)h * G) * D;
    for (int t = 0; t < L; ++t) {
        const float* k = row_at(a, a.k, b, first + t, h, buf);
        for (int g = 0; g < G; ++g) {
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int i = 0; i < D; ++i) s += q[g * D + i] * k[i];
            s *= a.scale;
            scores[g * L + t] = a.softcap > 0.f ? tanhf(s / a.softcap) * a.softcap : s;
        }
    }
    float total[64];
    for (int g = 0; g < G; ++g) {
        float* s = scores + (int64_t)g * L;
        float mx = -INFINITY, sum = 0.f;
        for (int t = 0; t < L; ++t) mx = s[t] > mx ? s[t] : mx;
        for (int t = 0; t < L; ++t) { s[t] = expf(s[t] - mx); sum += s[t]; }
        total[g] = sum;
    }
    memset(acc, 0, sizeof(float) * G * D);
    for (int t = 0; t < L; ++t) {
        const float* v = row_at(a, a.v, b, first + t, h, buf);
        for (int g = 0; g < G; ++g) {
            const float p = scores[(int64_t)g * L + t];
            float* o = acc + g * D;
#pragma omp simd
            for (int i = 0; i < D; ++i) o[i] += p * v[i];
        }
    }
    float* out = a.out + ((int64_t)b * a.Hq + (int64_t)h * G) * D;
    for (int g = 0; g < G; ++g)
        for (int i = 0; i < D; ++i) out[g * D + i] = acc[g * D + i] / total[g];
}

__attribute__((always_inline)) inline void decode_all(const Args& a) {
    int longest = 1;
    for (int b = 0; b < a.B; ++b) longest = a.lens[b] > longest ? a.lens[b] : longest;
    const int G = a.Hq / a.Hkv;
    const int64_t work = (int64_t)a.B * a.Hq * longest * a.D;
#pragma omp parallel if (work > (1 << 15))
    {
        std::vector<float> scores((size_t)G * longest), buf(a.D), acc((size_t)G * a.D);
#pragma omp for schedule(dynamic) collapse(2)
        for (int b = 0; b < a.B; ++b)
            for (int h = 0; h < a.Hkv; ++h) attend(a, b, h, scores.data(), buf.data(), acc.data());
    }
}

__attribute__((target("avx512f,avx512bw,fma"))) void decode_avx512(const Args& a) { decode_all(a); }
__attribute__((target("avx2,fma"))) void decode_avx2(const Args& a) { decode_all(a); }
void decode_portable(const Args& a) { decode_all(a); }

}  // namespace

extern "C" {

// Returns 0, or -1 when the shapes are beyond the kernel (more than 64 query heads per kv head).
int psq_paged_decode(const float* q, const void* k_cache, const void* v_cache, int kv_dtype, const int32_t* tables,
                     int max_blocks, const int32_t* seq_lens, int B, int Hq, int Hkv, int D, int block_size,
                     float scale, float* out, int window, float softcap, int isa) {
    if (Hkv <= 0 || Hq % Hkv || Hq / Hkv > 64 || kv_dtype < 0 || kv_dtype > 4) return -1;
    const Args a{q, k_cache, v_cache, kv_dtype, tables, max_blocks, seq_lens, B, Hq, Hkv, D, block_size, scale, out,
                 window, softcap};
    if (isa >= 2) decode_avx512(a);
    else if (isa == 1) decode_avx2(a);
    else decode_portable(a);
    return 0;
}

}  // extern "C"
