// Group-quantized matmul with int16 activations for steps of many rows on AVX2 (prefill chunks, large
// decode batches): y[M,N] = x[M,K] W[N,K]^T (+ bias) in qgemm.cpp's 4- and 8-bit formats, x rounded to
// int16 per run of 32 values as qgemm_i16.cpp rounds it (quantize_i16.h).
//
// Why: beyond a few dozen rows the products are bound by arithmetic, and on AVX2 a fused multiply-add
// does 8 products where vpmaddwd does 16 (pairs of int16 summed into int32). The fp32 panel kernel
// (qgemm_panel.cpp) and oneDNN's fp32 GEMM both top out near 16 products a cycle a core.
//
// Each thread widens NF features' weights once a call into a panel of int16 pairs, [K/2][NF] (pair j of
// a feature is its weights 2j and 2j+1, one int32 lane), so one vector load gives 8 features' pairs and a
// broadcast of a row's pair of activations multiplies them all. A micro-tile of MR rows by NF features
// keeps MR x NV int32 sums in registers over one segment (a run of 32 values, or a group of 16), then
// folds each into its fp32 sum: * scale[g] * d_r; after the last, + offset[g] * sum_g x group by group.
// Each output is that fixed sequence of fp32 steps from zero, plus the bias at the end, so a row's result
// does not depend on how many rows share the step or how they are tiled.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <vector>

#include "quantize_i16.h"
#include "qweights.h"

namespace {

constexpr int NV = 2;          // vectors of eight features a panel holds
constexpr int NF = 8 * NV;     // features a panel holds
constexpr int MR = 4;          // rows a micro-tile: MR x NV int32 sums, NV weight vectors, a broadcast

struct Panel {                      // one thread's NF features, widened once a call
    std::vector<int32_t> w;         // [K/2][NF] int16 pairs
    std::vector<float> scale, offset;   // [K/G][NF]
    std::vector<int16_t> row;       // [K] one feature's weights in k order, on the way in
};

// r[i]'s lane j into r[j]'s lane i, for eight vectors of eight int32.
__attribute__((target("avx2"))) inline void transpose8(__m256i r[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4)
        for (int h = 0; h < 2; ++h) {
            u[i + 2 * h] = _mm256_unpacklo_epi64(t[i + h], t[i + 2 + h]);
            u[i + 2 * h + 1] = _mm256_unpackhi_epi64(t[i + h], t[i + 2 + h]);
        }
    for (int i = 0; i < 4; ++i) {
        r[i] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x31);
    }
}

// Features n0+f0..n0+f0+7 into the panel's lanes f0..f0+7: each run of 32 weights is 16 pairs a feature,
// two vectors of eight; eight features' vectors transposed give eight pairs' vectors of eight features.
template <int BITS>
__attribute__((target("avx2,fma"))) void widen8(const Args& a, int n0, int f0, Panel& p) {
    const int value_bytes = BITS == 4 ? a.K / 2 : a.K;
    for (int k = 0; k < a.K; k += 32) {
        __m256i lo[8], hi[8];
        for (int i = 0; i < 8; ++i) {
            __m256i w[2];
            weight_words<BITS>(a.q + (int64_t)(n0 + f0 + i) * value_bytes, k, w);
            lo[i] = w[0], hi[i] = w[1];
        }
        transpose8(lo);
        transpose8(hi);
        int32_t* dst = p.w.data() + (size_t)(k / 2) * NF + f0;
        for (int j = 0; j < 8; ++j) {
            _mm256_storeu_si256((__m256i*)(dst + (size_t)j * NF), lo[j]);
            _mm256_storeu_si256((__m256i*)(dst + (size_t)(8 + j) * NF), hi[j]);
        }
    }
}

// One feature into lane f, pair by pair (a last block's features beyond its whole eights).
template <int BITS>
__attribute__((target("avx2,fma"))) void widen1(const Args& a, int64_t n, int f, Panel& p) {
    const uint8_t* q = a.q + n * (BITS == 4 ? a.K / 2 : a.K);
    for (int k = 0; k < a.K; k += 32) {
        __m256i w[2];
        weight_words<BITS>(q, k, w);
        _mm256_storeu_si256((__m256i*)(p.row.data() + k), w[0]);
        _mm256_storeu_si256((__m256i*)(p.row.data() + k + 16), w[1]);
    }
    int32_t pair;
    for (int j = 0; j < a.K / 2; ++j) {
        memcpy(&pair, p.row.data() + 2 * j, sizeof pair);
        p.w[(size_t)j * NF + f] = pair;
    }
}

// Features n0..n0+features-1 into the panel with their scales and offsets.
template <int BITS>
void widen(const Args& a, int n0, int features, Panel& p) {
    const int ng = groups(a);
    if (features < NF) {             // a last, narrower block: the missing features multiply as zeros
        memset(p.w.data(), 0, sizeof(int32_t) * p.w.size());
        memset(p.scale.data(), 0, sizeof(float) * p.scale.size());
        memset(p.offset.data(), 0, sizeof(float) * p.offset.size());
    }
    int f = 0;
    for (; f + 8 <= features; f += 8) widen8<BITS>(a, n0, f, p);
    for (; f < features; ++f) widen1<BITS>(a, n0 + f, f, p);
    for (f = 0; f < features; ++f)
        for (int g = 0; g < ng; ++g) {
            p.scale[(size_t)g * NF + f] = a.scale[(int64_t)(n0 + f) * ng + g];
            p.offset[(size_t)g * NF + f] = a.offset[(int64_t)(n0 + f) * ng + g];
        }
}

// One step of the segment loop below: row R's pair at byte offset OFF of k times both weight vectors.
#define PSQ_ROW(R, OFF)                                                                                 \
    "vpbroadcastd " #OFF "(%[x" #R "],%[k]), %%ymm14\n\t"                                             \
    "vpmaddwd %%ymm12, %%ymm14, %%ymm15\n\t"                                                           \
    "vpaddd %%ymm15, %[a" #R "], %[a" #R "]\n\t"                                                      \
    "vpmaddwd %%ymm13, %%ymm14, %%ymm14\n\t"                                                           \
    "vpaddd %%ymm14, %[b" #R "], %[b" #R "]\n\t"
#define PSQ_PAIR(WOFF, XOFF)                                                                            \
    "vmovdqu " #WOFF "(%[w]), %%ymm12\n\t"                                                             \
    "vmovdqu " #WOFF "+32(%[w]), %%ymm13\n\t"                                                          \
    PSQ_ROW(0, XOFF) PSQ_ROW(1, XOFF) PSQ_ROW(2, XOFF) PSQ_ROW(3, XOFF)

// One segment's int32 sums of four rows (xr) against the panel's 16 features from pair wp on: `pairs`
// pairs (an even number), from value k0. In assembly because GCC 12's allocation of the same loop in
// intrinsics kept some of the eight sums on the stack, or copied each after its add: the whole kernel ran
// at about 11 products a cycle a core on the EPYC, against 17.5 with this loop (a bare loop of these
// pairs measures 25); here the eight sums stay in registers and each multiply-add is two operations. acc[m][v]: row m, features 8v..8v+7.
__attribute__((target("avx2"))) inline void segment(const int16_t* const (&xr)[MR], const int32_t* wp, int k0,
                                                   int pairs, __m256i (&acc)[MR][NV]) {
    static_assert(MR == 4 && NV == 2 && NF == 16, "the assembly below is for 4 rows of 16 features");
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    int64_t k = (int64_t)k0 * 2;                 // byte offset into each row of x
    const int64_t end = k + (int64_t)pairs * 4;
    const int32_t* w = wp;
    asm volatile(
        "1:\n\t"
        PSQ_PAIR(0, 0) PSQ_PAIR(64, 4)
        "add $128, %[w]\n\t"
        "add $8, %[k]\n\t"
        "cmp %[end], %[k]\n\t"
        "jne 1b\n\t"
        : [a0] "+x"(a0), [a1] "+x"(a1), [a2] "+x"(a2), [a3] "+x"(a3), [b0] "+x"(b0), [b1] "+x"(b1),
          [b2] "+x"(b2), [b3] "+x"(b3), [w] "+r"(w), [k] "+r"(k)
        : [x0] "r"(xr[0]), [x1] "r"(xr[1]), [x2] "r"(xr[2]), [x3] "r"(xr[3]), [end] "r"(end)
        : "xmm12", "xmm13", "xmm14", "xmm15", "cc", "memory");
    acc[0][0] = a0, acc[1][0] = a1, acc[2][0] = a2, acc[3][0] = a3;
    acc[0][1] = b0, acc[1][1] = b1, acc[2][1] = b2, acc[3][1] = b3;
}
#undef PSQ_PAIR
#undef PSQ_ROW

// Rows m0..m0+MT-1 against the panel: out[m][f], before the bias. SEG values a segment: 32 (a run), or 16
// where groups are of 16 (two segments a run, each with its group's scale and the run's step). The fp32
// sums live in `out` (L1), touched once a segment, so the registers hold the segment's int32 sums; the
// offsets' share (offset[g] * the group's sum of x) is added after the last segment, group by group.
template <int MT, int SEG>
__attribute__((target("avx2,fma"))) void micro(const Args& a, const Quantized& x, const Panel& p, int m0,
                                               float (&out)[MR][NF]) {
    const int K = a.K, runs = K / 32, ng = groups(a);
    const int16_t* xr[MR];           // a tile of fewer rows repeats its first: those sums are dropped
    for (int m = 0; m < MR; ++m) xr[m] = x.q + (int64_t)(m0 + (m < MT ? m : 0)) * K;
    for (int m = 0; m < MT; ++m)
        for (int v = 0; v < NV; ++v) _mm256_storeu_ps(out[m] + 8 * v, _mm256_setzero_ps());
    for (int k0 = 0; k0 < K; k0 += SEG) {
        __m256i acc[MR][NV];
        segment(xr, p.w.data() + (size_t)(k0 / 2) * NF, k0, SEG / 2, acc);
        const float* sp = p.scale.data() + (size_t)(k0 >> a.gs) * NF;
        const __m256 sc0 = _mm256_loadu_ps(sp), sc1 = _mm256_loadu_ps(sp + 8);
        const float* d = x.d + (int64_t)m0 * runs + (k0 >> 5);
        for (int m = 0; m < MT; ++m) {
            const __m256 dm = _mm256_broadcast_ss(d + (int64_t)m * runs);
            _mm256_storeu_ps(out[m], _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m][0]), _mm256_mul_ps(sc0, dm),
                                                     _mm256_loadu_ps(out[m])));
            _mm256_storeu_ps(out[m] + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m][1]), _mm256_mul_ps(sc1, dm),
                                                         _mm256_loadu_ps(out[m] + 8)));
        }
    }
    for (int m = 0; m < MT; ++m) {
        __m256 s0 = _mm256_loadu_ps(out[m]), s1 = _mm256_loadu_ps(out[m] + 8);
        const float* xs = x.s + (int64_t)(m0 + m) * ng;
        for (int g = 0; g < ng; ++g) {
            const __m256 sm = _mm256_broadcast_ss(xs + g);
            s0 = _mm256_fmadd_ps(_mm256_loadu_ps(p.offset.data() + (size_t)g * NF), sm, s0);
            s1 = _mm256_fmadd_ps(_mm256_loadu_ps(p.offset.data() + (size_t)g * NF + 8), sm, s1);
        }
        _mm256_storeu_ps(out[m], s0);
        _mm256_storeu_ps(out[m] + 8, s1);
    }
}

// Features n0..n0+features-1 for every row.
template <int BITS, int SEG>
void block(const Args& a, const Quantized& x, int n0, int features, Panel& p) {
    widen<BITS>(a, n0, features, p);
    alignas(32) float out[MR][NF];
    for (int m0 = 0; m0 < a.M; m0 += MR) {
        const int mt = a.M - m0 < MR ? a.M - m0 : MR;
        with_rows<MR>(mt, [&](auto MT) { micro<MT, SEG>(a, x, p, m0, out); });
        for (int r = 0; r < mt; ++r) {
            float* yr = a.y + (int64_t)(m0 + r) * a.N + n0;
            for (int f = 0; f < features; ++f) yr[f] = out[r][f] + (a.bias ? a.bias[n0 + f] : 0.f);
        }
    }
}

}  // namespace

extern "C" {

// y = x W^T (+ bias) with x rounded to int16 per run of 32, for an AVX2 CPU (the caller checks), parallel
// over blocks of NF features. Returns 1 without computing for a format it does not take (fp8 weights,
// groups under 16, rows not whole runs of 32), else 0.
int psq_gemm_panel_i16(const float* x, int M, int K, const uint8_t* q, const float* scale, const float* offset,
                       int N, int G, int bits, const float* bias, float* y) {
    if ((bits != 4 && bits != 8) || G < 16 || K % 32 != 0) return 1;
    if (M <= 0 || N <= 0) return 0;
    const Args a{x, M, K, q, scale, offset, N, G, bits, bias, y, __builtin_ctz(G)};
    const Quantized xv = quantize_rows(x, M, K, G);
    const int blocks = (N + NF - 1) / NF;
#pragma omp parallel
    {
        Panel p;
        p.w.resize((size_t)K / 2 * NF);
        p.scale.resize((size_t)(K / G) * NF);
        p.offset.resize((size_t)(K / G) * NF);
        p.row.resize(K);
        auto run = bits == 4 ? (G == 16 ? block<4, 16> : block<4, 32>) : (G == 16 ? block<8, 16> : block<8, 32>);
        // Blocks are claimed two at a time, not split in halves up front: on this shared VM one core often
        // runs slower than the other for a while, and a static split left the faster one waiting at the
        // end of every product. The 120 products, alternated call by call with the static build: 1.03-1.18x
        // at 12-512 rows (dynamic 4: 0.98x of dynamic 2; guided: the same). Each block's outputs are the
        // same whichever thread computes them (loadtest/results/omp_schedule_2026-12-08_epyc.txt).
#pragma omp for schedule(dynamic, 2)
        for (int b = 0; b < blocks; ++b) run(a, xv, b * NF, N - b * NF < NF ? N - b * NF : NF, p);
    }
    return 0;
}

}  // extern "C"
