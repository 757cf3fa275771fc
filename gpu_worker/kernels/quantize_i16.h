// Activations rounded to int16 per run of 32 values, and the packed weights widened to int16, for the
// kernels that multiply them as integers (qgemm_i16.cpp: decode-sized steps; qgemm_panel_i16.cpp: larger ones).
//
// Per run r of 32 values in group g:  sum_k w x = scale[g] * d_r * sum_k q_k xq_k + offset[g] * sum_k x_k,
// with xq = round(x / d_r), d_r = max|x| / 32767 over the run. The integer sums are exact; the offset's
// sum is of x itself in fp32. Both kernels round a row the same way whatever the step's other rows.
#pragma once
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include <vector>

namespace {

constexpr float LEVELS = 32767.f;     // x / d in -LEVELS..LEVELS

struct Quantized {             // the rows of x as the kernels read them
    const int16_t* q;          // [M][K]
    const float* d;            // [M][K/32] each run's step
    const float* s;            // [M][K/G] each group's sum of x
};

__attribute__((target("avx2,fma"))) inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

// One run of 32 values: q (rounded to nearest even, as torch.round), its step d and two half sums.
__attribute__((target("avx2,fma"))) inline void quantize_run(const float* x, int16_t* q, float* d, float* s) {
    const __m256 v[4] = {_mm256_loadu_ps(x), _mm256_loadu_ps(x + 8), _mm256_loadu_ps(x + 16),
                         _mm256_loadu_ps(x + 24)};
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 m = _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1]));
    m = _mm256_max_ps(m, _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
    const float amax = _mm_cvtss_f32(h);
    *d = amax / LEVELS;
    const __m256 inv = _mm256_set1_ps(amax > 0.f ? LEVELS / amax : 0.f);
    __m256i i[4];
    for (int j = 0; j < 4; ++j) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));
    // packs works within 128-bit lanes: its quadwords come out in the order 0 2 1 3
    _mm256_storeu_si256((__m256i*)q, _mm256_permute4x64_epi64(_mm256_packs_epi32(i[0], i[1]), 0xD8));
    _mm256_storeu_si256((__m256i*)(q + 16), _mm256_permute4x64_epi64(_mm256_packs_epi32(i[2], i[3]), 0xD8));
    s[0] = hsum(_mm256_add_ps(v[0], v[1]));
    s[1] = hsum(_mm256_add_ps(v[2], v[3]));
}

// Row m of x [M][K] into the buffers: its runs, then each group's sum from its halves in order (G is 16
// or a multiple of 32, so no group straddles a half). `halves` holds K / 16 floats.
__attribute__((target("avx2,fma"))) inline void quantize_row(const float* x, int K, int G, int m, int16_t* q,
                                                            float* d, float* s, float* halves) {
    const int runs = K / 32, ng = K / G;
    for (int r = 0; r < runs; ++r)
        quantize_run(x + (int64_t)m * K + r * 32, q + (int64_t)m * K + r * 32, d + (int64_t)m * runs + r,
                     halves + 2 * r);
    for (int g = 0; g < ng; ++g) {
        float sum = 0.f;
        for (int h = g * (G / 16); h < (g + 1) * (G / 16); ++h) sum += halves[h];
        s[(int64_t)m * ng + g] = sum;
    }
}

// All rows of x, in thread-local buffers that live until the calling thread's next call; rows are
// split over the threads when there are enough to pay for the fork.
inline Quantized quantize_rows(const float* x, int M, int K, int G) {
    static thread_local std::vector<int16_t> xq;
    static thread_local std::vector<float> xd, xs;
    xq.resize((size_t)M * K);
    xd.resize((size_t)M * (K / 32));
    xs.resize((size_t)M * (K / G));
    int16_t* q = xq.data();
    float *d = xd.data(), *s = xs.data();
#pragma omp parallel if ((int64_t)M * K >= (1 << 15))
    {
        std::vector<float> halves((size_t)K / 16);
#pragma omp for schedule(static)
        for (int m = 0; m < M; ++m) quantize_row(x, K, G, m, q, d, s, halves.data());
    }
    return Quantized{q, d, s};
}

// The 32 weights of run k of a row as int16, in k order: w[0] values 0-15, w[1] 16-31.
template <int BITS>
__attribute__((target("avx2,fma"))) inline void weight_words(const uint8_t* q, int k, __m256i w[2]) {
    if constexpr (BITS == 4) {
        const __m128i b = _mm_loadu_si128((const __m128i*)(q + k / 2));
        w[0] = _mm256_cvtepu8_epi16(_mm_and_si128(b, _mm_set1_epi8(15)));
        w[1] = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(15)));
    } else {
        w[0] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(q + k)));
        w[1] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(q + k + 16)));
    }
}

}  // namespace
