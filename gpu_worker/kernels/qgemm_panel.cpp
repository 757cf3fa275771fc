// Group-quantized matmul for steps of many rows on AVX2: y[M,N] = x[M,K] W[N,K]^T (+ bias), in
// qgemm.cpp's formats, for the steps beyond its rows (packed.py's GEMM_MAX_ROWS) on CPUs without bf16
// matrix hardware.
//
// Why: qgemm.cpp expands every weight again for each tile of 5 rows and sums each output across a vector
// (a decode's shape), and the alternative, expanding the whole weight into fp32 for the BLAS GEMM, writes
// and reads 4 bytes a weight at every call: on a 2-core Zen3, 40-64 rows ran at 60-80 GFLOP/s either way.
// Here each thread expands the weights of NR features once into a panel that stays in its cache, and a
// register-blocked micro-kernel multiplies it into every row of the step: 16 rows (two vectors) against
// 6 features, 12 accumulators, each a broadcast weight times a vector of rows; the input is transposed
// once per call so those rows are adjacent.
//
// Each output is a plain running sum over k (one fused multiply-add a term, from zero, plus the bias at
// the end), so a row's result does not depend on how many rows share the step or how they are tiled.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <vector>

#include "qweights.h"

namespace {

constexpr int NR = 6;       // features a micro-tile multiplies
constexpr int MR = 16;      // rows a micro-tile multiplies: two vectors of eight

// Rows m0.. (NV vectors of eight, adjacent in xT [K][Mp]) against the NR features of the panel [NR][K]
// (a last block of fewer features has zero rows there). The accumulators are named, not an array: GCC
// kept an array of them on the stack, a store and a load around every multiply-add.
template <int NV>
__attribute__((target("avx2,fma"))) void micro(const float* xT, int Mp, const float* panel, int K,
                                               float out[NR][MR]) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;
    __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0, b4 = a0, b5 = a0;
    const float *w0 = panel, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K, *w4 = w3 + K, *w5 = w4 + K;
#pragma GCC unroll 4
    for (int k = 0; k < K; ++k) {
        const float* xr = xT + (int64_t)k * Mp;
        const __m256 x0 = _mm256_loadu_ps(xr);
        __m256 w = _mm256_broadcast_ss(w0 + k);
        a0 = _mm256_fmadd_ps(w, x0, a0);
        if constexpr (NV > 1) b0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(xr + 8), b0);
#define PSQ_FEATURE(i)                                                             \
        w = _mm256_broadcast_ss(w##i + k);                                         \
        a##i = _mm256_fmadd_ps(w, x0, a##i);                                       \
        if constexpr (NV > 1) b##i = _mm256_fmadd_ps(w, _mm256_loadu_ps(xr + 8), b##i);
        PSQ_FEATURE(1) PSQ_FEATURE(2) PSQ_FEATURE(3) PSQ_FEATURE(4) PSQ_FEATURE(5)
#undef PSQ_FEATURE
    }
    const __m256 as[NR] = {a0, a1, a2, a3, a4, a5}, bs[NR] = {b0, b1, b2, b3, b4, b5};
    for (int f = 0; f < NR; ++f) {
        _mm256_storeu_ps(out[f], as[f]);
        if constexpr (NV > 1) _mm256_storeu_ps(out[f] + 8, bs[f]);
    }
}

__attribute__((target("avx2,fma,f16c"))) void expand_panel(const Args& a, int n0, int features, float* panel) {
    memset(panel + (int64_t)features * a.K, 0, sizeof(float) * (NR - features) * a.K);
    for (int f = 0; f < features; ++f)
        for (int k = 0; k < a.K; k += 32) {
            __m256 w[4];
            expand_avx2(a, n0 + f, k, w);
            for (int i = 0; i < 4; ++i) _mm256_storeu_ps(panel + (int64_t)f * a.K + k + 8 * i, w[i]);
        }
}

// Features n0..n0+features-1 for every row.
void block(const Args& a, int n0, int features, const float* xT, int Mp, float* panel) {
    expand_panel(a, n0, features, panel);
    float out[NR][MR];
    for (int m0 = 0; m0 < a.M; m0 += MR) {
        const int rows = a.M - m0 < MR ? a.M - m0 : MR;
        if (rows > 8) micro<2>(xT + m0, Mp, panel, a.K, out);
        else micro<1>(xT + m0, Mp, panel, a.K, out);
        for (int f = 0; f < features; ++f) {
            const float bias = a.bias ? a.bias[n0 + f] : 0.f;
            for (int r = 0; r < rows; ++r) a.y[(int64_t)(m0 + r) * a.N + n0 + f] = out[f][r] + bias;
        }
    }
}

}  // namespace

extern "C" {

// y = x W^T (+ bias) for an AVX2 CPU (the caller checks). Parallel over blocks of NR output features.
void psq_gemm_panel(const float* x, int M, int K, const uint8_t* q, const float* scale, const float* offset, int N,
                    int G, int bits, const float* bias, float* y) {
    if (M <= 0 || N <= 0) return;
    const Args a{x, M, K, q, scale, offset, N, G, bits, bias, y, __builtin_ctz(G)};
    const int Mp = (M + 7) / 8 * 8;               // rows padded to whole vectors (zeros, results dropped)
    std::vector<float> xT((size_t)K * Mp + 8, 0.f);
    for (int m = 0; m < M; ++m)
        for (int k = 0; k < K; ++k) xT[(size_t)k * Mp + m] = x[(int64_t)m * K + k];
    const int blocks = (N + NR - 1) / NR;
#pragma omp parallel
    {
        std::vector<float> panel((size_t)NR * K);
#pragma omp for schedule(static)
        for (int b = 0; b < blocks; ++b)
            block(a, b * NR, N - b * NR < NR ? N - b * NR : NR, xT.data(), Mp, panel.data());
    }
}

}  // extern "C"
