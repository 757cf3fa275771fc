// Group-quantized matmul with int16 activations, for decode-sized steps on AVX2: y[M,N] = x[M,K] W[N,K]^T
// (+ bias) in qgemm.cpp's 4- and 8-bit formats (groups of 16 or more), with x rounded to int16 per run of
// 32 values first.
//
// Why: at a few rows qgemm.cpp's fp32 kernel is bound by expanding each weight to a float (widen,
// convert, scale: 21 vector operations a run of 32 on AVX2), not by the bytes it reads (SmolLM2's 120
// products took 9.1 ms at one row, 80 MB: 9 GB/s of the 2-core Zen3's 33). Multiplying integers instead,
// vpmaddwd sums 16 products in one operation and the weights need only widening, so a run costs about 13
// operations at one row: the 120 products took 5.8 ms against 10.7 (loadtest/qgemm_bench.py, `int16`).
// int16 rather than llama.cpp's int8 (vpmaddubsw, 32 products an operation): int8 activations took
// teacher-forced top-1 agreement with fp32 down to 95.4% on the shared workload (mean KL 0.014 nats),
// int16's rounding (at most 1/65534 of a run's largest value) is 250x smaller and measured no slower at
// one row.
//
// The rounding and its arithmetic: quantize_i16.h. Each row is computed alone, in the same order whatever the
// step's other rows (speculative verification reproduces decoding bit for bit).
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include <algorithm>
#include <vector>

#include "quantize_i16.h"
#include "qweights.h"

namespace {

// The scales of dot_run's lanes: one group's, or with groups of 16 the first half's in lanes 0, 1, 4, 5
// and the second's in 2, 3, 6, 7.
template <bool G16>
__attribute__((target("avx2,fma"))) inline __m256 scale_at(const float* sc, int k, int gs) {
    const int g = k >> gs;
    if constexpr (G16) {
        const float a = sc[g], b = sc[g + 1];
        return _mm256_setr_ps(a, a, b, b, a, a, b, b);
    }
    return _mm256_set1_ps(sc[g]);
}

// Eight int32 partial sums of w * xq over the run (exact: |w| <= 128, |xq| <= 32767, 32 terms). With
// groups of 16 the halves stay apart (scale_at's lanes), else they are added lane by lane.
template <bool G16>
__attribute__((target("avx2,fma"))) inline __m256i dot_run(const __m256i w[2], const int16_t* xq) {
    const __m256i a = _mm256_madd_epi16(w[0], _mm256_loadu_si256((const __m256i*)xq));
    const __m256i b = _mm256_madd_epi16(w[1], _mm256_loadu_si256((const __m256i*)(xq + 16)));
    return G16 ? _mm256_hadd_epi32(a, b) : _mm256_add_epi32(a, b);
}

// sum_i a[i] * b[i] over n floats, eight lanes then the tail, in a fixed order.
__attribute__((target("avx2,fma"))) inline float dot(const float* a, const float* b, int n) {
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float s = hsum(acc);
    for (; i < n; ++i) s = __builtin_fmaf(a[i], b[i], s);
    return s;
}

// One run of 32 weights (w) into the MT rows' accumulators acc[m][P].
template <bool G16, int MT, int P>
__attribute__((target("avx2,fma"))) inline void run(const __m256i w[2], __m256 step, const Quantized& x, int K,
                                                    int runs, int m0, int r, __m256 (&acc)[MT][2]) {
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) {
        const int64_t row = m0 + m;
        const __m256 p = _mm256_cvtepi32_ps(dot_run<G16>(w, x.q + row * K + r * 32));
        acc[m][P] = _mm256_fmadd_ps(p, _mm256_mul_ps(step, _mm256_set1_ps(x.d[row * runs + r])), acc[m][P]);
    }
}

// Features n0..n1-1 against rows m0..m0+MT-1. Even runs feed accumulator 0, odd ones 1 (two dependency
// chains; the run pair is unrolled by hand so that both stay in registers). The offsets' share is one dot
// product a row: offset row against the row's per-group sums.
template <int BITS, bool G16, int MT>
__attribute__((target("avx2,fma"))) void tile(const Args& a, const Quantized& x, int n0, int n1, int m0) {
    const int value_bytes = BITS == 4 ? a.K / 2 : a.K, runs = a.K / 32, ng = groups(a);
    for (int n = n0; n < n1; ++n) {
        const uint8_t* q = a.q + (int64_t)n * value_bytes;
        const float* sc = a.scale + (int64_t)n * ng;
        __m256 acc[MT][2];
        for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
        for (int r = 0; r < runs; r += 2) {
            __m256i w[2];
            weight_words<BITS>(q, r * 32, w);
            run<G16, MT, 0>(w, scale_at<G16>(sc, r * 32, a.gs), x, a.K, runs, m0, r, acc);
            if (r + 1 < runs) {
                weight_words<BITS>(q, r * 32 + 32, w);
                run<G16, MT, 1>(w, scale_at<G16>(sc, r * 32 + 32, a.gs), x, a.K, runs, m0, r + 1, acc);
            }
        }
        const float* of = a.offset + (int64_t)n * ng;
        const float bias = a.bias ? a.bias[n] : 0.f;
        for (int m = 0; m < MT; ++m)
            a.y[(int64_t)(m0 + m) * a.N + n] = hsum(_mm256_add_ps(acc[m][0], acc[m][1])) +
                                               dot(of, x.s + (int64_t)(m0 + m) * ng, ng) + bias;
    }
}

template <int MT>
void rows(const Args& a, const Quantized& x, int n0, int n1, int m0) {
    const bool g16 = a.G == 16;
    if (a.bits == 4) (g16 ? tile<4, true, MT> : tile<4, false, MT>)(a, x, n0, n1, m0);
    else (g16 ? tile<8, true, MT> : tile<8, false, MT>)(a, x, n0, n1, m0);
}

// Rows sharing one widening of the weights: 5, as qgemm.cpp's AVX2 tiles (10 accumulators).
constexpr int TILE = 5;

void rows_any(const Args& a, const Quantized& x, int n0, int n1, int m0, int mt) {
    with_rows<TILE>(mt, [&](auto MT) { rows<MT>(a, x, n0, n1, m0); });
}

}  // namespace

extern "C" {

// y = x W^T (+ bias) with x rounded to int16 per run of 32, for an AVX2 CPU (the caller checks). Returns
// 1 without computing for a format it does not take (fp8 weights, groups under 16), else 0.
int psq_gemm_i16(const float* x, int M, int K, const uint8_t* q, const float* scale, const float* offset, int N,
                 int G, int bits, const float* bias, float* y) {
    if ((bits != 4 && bits != 8) || G < 16) return 1;
    if (M <= 0 || N <= 0) return 0;
    const Args a{x, M, K, q, scale, offset, N, G, bits, bias, y, __builtin_ctz(G)};
    const Quantized xv = quantize_rows(x, M, K, G);
    const int64_t work = (int64_t)N * K * std::min(M, TILE);
    const int block = std::max(4, std::min(16, N / (4 * omp_get_max_threads())));   // as psq_gemm's
    // guided, not static: large contiguous claims first (the weights stream in order), smaller ones at the
    // end, so a core slowed for a while by the shared VM does not leave the other waiting: 1.01-1.16x at
    // 1-8 rows, alternated call by call (dynamic 2: 0.91-1.03x; loadtest/results/omp_schedule_*.txt).
#pragma omp parallel for schedule(guided) if (work > (1 << 16))
    for (int n0 = 0; n0 < N; n0 += block)
        for (int m0 = 0; m0 < M; m0 += TILE)
            rows_any(a, xv, n0, std::min(n0 + block, N), m0, std::min(M - m0, TILE));
    return 0;
}

}  // extern "C"
