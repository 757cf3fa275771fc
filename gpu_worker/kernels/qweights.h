// The packed weight formats of qgemm.cpp (its header says them) and their expansion into fp32 vectors,
// shared by the vector kernels (qgemm.cpp, qgemm_panel.cpp) and the AMX one (qgemm_amx.cpp), so all
// expand a weight to the same value bit for bit.
#pragma once
#include <immintrin.h>
#include <stdint.h>

#include <type_traits>

#include "fp8.h"

namespace {

constexpr int FP8 = 9;

struct Args {
    const float* x; int M; int K;
    const uint8_t* q; const float* scale; const float* offset; int N; int G; int bits;
    const float* bias; float* y;
    int gs;   // log2(G): G is a power of two, so group indices are shifts, not divisions
    const uint16_t* pre = nullptr;   // qgemm_amx.cpp: the weights expanded once, in its tile layout
};

inline int groups(const Args& a) { return a.K >> a.gs; }

// f(std::integral_constant<int, mt>) for a run-time tile height mt in 1..MAX (above MAX: MAX), so that a
// kernel's row count is a compile-time constant and its accumulators stay in registers.
template <int MAX, class F>
inline void with_rows(int mt, F&& f) {
    if constexpr (MAX > 1)
        if (mt < MAX) return with_rows<MAX - 1>(mt, f);
    f(std::integral_constant<int, MAX>{});
}

// ---- AVX-512 expansion -------------------------------------------------------------------
// 16 e4m3 bytes as floats: each byte's bits moved into fp16 position, converted, times 2^8 (exact).
__attribute__((target("avx512f,avx512bw,fma"))) inline __m512 fp8x16_avx512(__m128i b) {
    const __m256i h = _mm256_cvtepu8_epi16(b);
    const __m256i bits = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x80)), 8),
                                         _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x7F)), 7));
    return _mm512_mul_ps(_mm512_cvtph_ps(bits), _mm512_set1_ps(256.f));
}

// A run of 32 weights (k..k+31 of the row at `q`; groups g0 for the first 16, g1 for the rest) expanded
// into two float vectors, each w = scale * v + offset by one fused multiply-add.
//   4-bit: by table. The 16 weights the group can hold (v = 0..15, the same FMA, so bit for bit the
//     direct expansion's) are indexed by the values with one permute per 16; vpermps reads only an
//     index's low 4 bits, so the low nibbles need no mask and the high ones one shift. 5 vector operations
//     a run instead of 9 (mask, widen, convert, scale), which is most of the single-row cost.
//   8-bit and fp8: widen, convert, scale.
template <int BITS>
__attribute__((target("avx512f,avx512bw,fma"))) inline void weights_avx512(
        const uint8_t* q, int k, const float* sc, const float* of, int g0, int g1, __m512& w0, __m512& w1) {
    if constexpr (BITS == 4) {
        const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(q + k / 2)));
        const __m512 t0 = _mm512_fmadd_ps(iota, _mm512_set1_ps(sc[g0]), _mm512_set1_ps(of[g0]));
        const __m512 t1 = g1 == g0 ? t0 : _mm512_fmadd_ps(iota, _mm512_set1_ps(sc[g1]), _mm512_set1_ps(of[g1]));
        w0 = _mm512_permutexvar_ps(b, t0);
        w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), t1);
        return;
    }
    if constexpr (BITS == FP8) {
        w0 = fp8x16_avx512(_mm_loadu_si128((const __m128i*)(q + k)));
        w1 = fp8x16_avx512(_mm_loadu_si128((const __m128i*)(q + k + 16)));
    } else {
        w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + k))));
        w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + k + 16))));
    }
    w0 = _mm512_fmadd_ps(w0, _mm512_set1_ps(sc[g0]), _mm512_set1_ps(of[g0]));
    w1 = _mm512_fmadd_ps(w1, _mm512_set1_ps(sc[g1]), _mm512_set1_ps(of[g1]));
}

// Weights k..k+31 of row n, expanded into two vectors.
__attribute__((target("avx512f,avx512bw,fma"))) inline void expand_avx512(const Args& a, int n, int k,
                                                                          __m512& w0, __m512& w1) {
    const float* sc = a.scale + (int64_t)n * groups(a);
    const float* of = a.offset + (int64_t)n * groups(a);
    const int g0 = k >> a.gs, g1 = (k + 16) >> a.gs;
    if (a.bits == 4) weights_avx512<4>(a.q + (int64_t)n * (a.K / 2), k, sc, of, g0, g1, w0, w1);
    else if (a.bits == FP8) weights_avx512<FP8>(a.q + (int64_t)n * a.K, k, sc, of, g0, g1, w0, w1);
    else weights_avx512<8>(a.q + (int64_t)n * a.K, k, sc, of, g0, g1, w0, w1);
}

// ---- AVX2 expansion ----------------------------------------------------------------------
// Weights k..k+31 of row n, expanded into four vectors of eight (the vector kernel and the panels of
// qgemm_panel.cpp).
__attribute__((target("avx2,fma,f16c"))) inline void expand_avx2(const Args& a, int n, int k, __m256 w[4]) {
    if (a.bits == 4) {
        const __m128i b = _mm_loadu_si128((const __m128i*)(a.q + (int64_t)n * (a.K / 2) + k / 2));
        const __m128i lo = _mm_and_si128(b, _mm_set1_epi8(15));
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(15));
        w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
        w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
        w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
        w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
    } else if (a.bits == FP8) {
        const uint8_t* qr = a.q + (int64_t)n * a.K + k;
        for (int i = 0; i < 4; ++i) {
            const __m128i h = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)(qr + 8 * i)));
            const __m128i bits = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(h, _mm_set1_epi16(0x80)), 8),
                                              _mm_slli_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7F)), 7));
            w[i] = _mm256_mul_ps(_mm256_cvtph_ps(bits), _mm256_set1_ps(256.f));
        }
    } else {
        const int8_t* qr = reinterpret_cast<const int8_t*>(a.q) + (int64_t)n * a.K + k;
        for (int i = 0; i < 4; ++i)
            w[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(qr + 8 * i))));
    }
    const float* sc = a.scale + (int64_t)n * groups(a);
    const float* of = a.offset + (int64_t)n * groups(a);
    for (int i = 0; i < 4; ++i) {
        const int g = (k + 8 * i) >> a.gs;
        w[i] = _mm256_fmadd_ps(w[i], _mm256_set1_ps(sc[g]), _mm256_set1_ps(of[g]));
    }
}

// The bytes of feature n (values, scales, offsets) requested into the cache ahead of their use; the
// vector kernel asks for the feature PREFETCH_AHEAD ahead of the one it multiplies (qgemm.cpp says why).
constexpr int PREFETCH_AHEAD = 4;
__attribute__((always_inline)) inline void prefetch_lines(const void* p, int bytes) {
    const uintptr_t end = (uintptr_t)p + bytes;
    for (uintptr_t line = (uintptr_t)p & ~(uintptr_t)63; line < end; line += 64)
        _mm_prefetch((const char*)line, _MM_HINT_T0);
}
__attribute__((always_inline)) inline void prefetch_feature(const Args& a, int n, int value_bytes) {
    prefetch_lines(a.q + (int64_t)n * value_bytes, value_bytes);
    prefetch_lines(a.scale + (int64_t)n * groups(a), groups(a) * 4);
    prefetch_lines(a.offset + (int64_t)n * groups(a), groups(a) * 4);
}

}  // namespace
