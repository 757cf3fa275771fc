// Group-quantized matmul for the CPU: y[M,N] = x[M,K] (fp32) times W[N,K]^T, where
// W[n,k] = scale[n,g] * q[n,k] + offset[n,g] with g = k / G.
//
// Why a kernel of our own: a decode step multiplies one (or a few) rows by every weight, so it is bound
// by the bytes it reads; keeping 4-bit or 8-bit weights and expanding them in registers reads 3-5x fewer
// bytes than an fp32 GEMM. torch's own int4 CPU path is either scalar (fp32 inputs) or rounds through
// bf16, which would change our outputs.
//
// Layouts (one row of W per output feature, K a multiple of 32, G a power of two >= 16):
//   bits 8: q is int8 [N][K];
//   bits 4: q is uint8 [N][K/2]; within each run of 32 values, byte j holds value j in its low nibble
//           and value j+16 in its high nibble (the GGUF Q4 order), values 0..15;
//   bits 9 (FP8): q is float8_e4m3fn bytes [N][K]. An e4m3 byte shifted left by 7 (sign by 8) is the fp16
//           of its value / 2^8, subnormals included, so the vector paths expand it with one fp16
//           conversion and an exact multiply by 256.
// scale and offset are fp32 [N][K/G]. The expansion is one fused multiply-add, so W matches a reference
// that computes scale*q + offset in fp32 bit for bit.
//
// Each entry point takes an `isa` level (2 AVX-512, 1 AVX2+FMA, 0 portable C++); the caller detects
// what the CPU has and may force a lower level to test every path on one machine.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include <algorithm>

#include "qweights.h"

namespace {

// ---- portable --------------------------------------------------------------------------------
inline float weight_at(const Args& a, int n, int k) {
    int g = n * groups(a) + (k >> a.gs);
    int v;
    if (a.bits == FP8) return __builtin_fmaf(fp8_table.v[0][a.q[(int64_t)n * a.K + k]], a.scale[g], a.offset[g]);
    if (a.bits == 8) {
        v = reinterpret_cast<const int8_t*>(a.q)[(int64_t)n * a.K + k];
    } else {
        const uint8_t b = a.q[(int64_t)n * (a.K / 2) + (k / 32) * 16 + (k % 16)];
        v = (k % 32) < 16 ? (b & 15) : (b >> 4);
    }
    return __builtin_fmaf((float)v, a.scale[g], a.offset[g]);
}

void row_portable(const Args& a, int n, int m0, int mt) {
    for (int m = m0; m < m0 + mt; ++m) {
        float acc = 0.f;
        for (int k = 0; k < a.K; ++k) acc += weight_at(a, n, k) * a.x[(int64_t)m * a.K + k];
        a.y[(int64_t)m * a.N + n] = acc + (a.bias ? a.bias[n] : 0.f);
    }
}

// ---- AVX-512 ---------------------------------------------------------------------------------
// One run of 32 weights (k..k+31 of the row at `q`) expanded once and multiplied into MT input rows,
// whose accumulators for this run are acc[m][P], acc[m][P + 1]. The format, the group size and P are
// compile-time, so every accumulator stays in a register (a run-time P had them spilled to the stack,
// which made each extra row cost as much as the first).
template <int BITS, bool G16, int MT, int P>
__attribute__((target("avx512f,avx512bw,fma"))) inline void run_avx512(
        const uint8_t* q, const float* sc, const float* of, const float* const* x, int k, int gs,
        __m512 (&acc)[MT][4]) {
    __m512 w0, w1;
    const int g0 = k >> gs, g1 = G16 ? g0 + 1 : g0;
    weights_avx512<BITS>(q, k, sc, of, g0, g1, w0, w1);
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) {
        acc[m][P] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x[m] + k), acc[m][P]);
        acc[m][P + 1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x[m] + k + 16), acc[m][P + 1]);
    }
}

// The bytes of feature n (its values, scales and offsets: three streams) requested ahead of use. Without
// it the loads of a feature's weights waited behind the FMAs of the one before: 120 products at 1 row
// took 6.2-6.4 ms, 5 rows 10.9-11.0 ms; 4 features ahead, 4.9-5.1 and 8.0-8.7 ms (2, 8 and 16 were no
// better). Inlined: a call here makes the caller spill its accumulators, which cost all of that gain.

// Output features n0..n1-1 against input rows m0..m0+MT-1. Run r feeds accumulator pair r % 2 and each
// row reduces as (a0 + a1) + (a2 + a3), the same whatever MT: a row's result does not depend on how many
// rows share the step, so speculative verification of k+1 rows reproduces single-row decoding bit for
// bit. The features loop sits here, with the odd last run inside the K loop, so the accumulators live in
// registers from start to end (with a tail after the K loop GCC kept a stack copy of them all, which
// measured no slower alone), and the features ahead can be prefetched.
template <int BITS, bool G16, int MT>
__attribute__((target("avx512f,avx512bw,fma"))) void tile_avx512(const Args& a, int n0, int n1, int m0) {
    const float* x[MT];
    for (int m = 0; m < MT; ++m) x[m] = a.x + (int64_t)(m0 + m) * a.K;
    const int value_bytes = BITS == 4 ? a.K / 2 : a.K;                    // 8-bit and fp8: a byte a value
    for (int n = n0; n < n1; ++n) {
        const uint8_t* q = a.q + (int64_t)n * value_bytes;
        const float* sc = a.scale + (int64_t)n * groups(a);
        const float* of = a.offset + (int64_t)n * groups(a);
        __m512 acc[MT][4];
        for (int m = 0; m < MT; ++m)
            for (int i = 0; i < 4; ++i) acc[m][i] = _mm512_setzero_ps();
        if (n + PREFETCH_AHEAD < a.N) prefetch_feature(a, n + PREFETCH_AHEAD, value_bytes);
        for (int k = 0; k < a.K; k += 64) {
            run_avx512<BITS, G16, MT, 0>(q, sc, of, x, k, a.gs, acc);
            if (k + 32 < a.K) run_avx512<BITS, G16, MT, 2>(q, sc, of, x, k + 32, a.gs, acc);
        }
        const float bias = a.bias ? a.bias[n] : 0.f;
        for (int m = 0; m < MT; ++m)
            a.y[(int64_t)(m0 + m) * a.N + n] = _mm512_reduce_add_ps(_mm512_add_ps(
                _mm512_add_ps(acc[m][0], acc[m][1]), _mm512_add_ps(acc[m][2], acc[m][3]))) + bias;
    }
}

template <int MT>
__attribute__((target("avx512f,avx512bw,fma"))) void rows_avx512(const Args& a, int n0, int n1, int m0) {
    const bool g16 = a.G == 16;
    if (a.bits == 4) (g16 ? tile_avx512<4, true, MT> : tile_avx512<4, false, MT>)(a, n0, n1, m0);
    else if (a.bits == FP8) (g16 ? tile_avx512<FP8, true, MT> : tile_avx512<FP8, false, MT>)(a, n0, n1, m0);
    else (g16 ? tile_avx512<8, true, MT> : tile_avx512<8, false, MT>)(a, n0, n1, m0);
}

__attribute__((target("avx512f,avx512bw,fma"))) void dequant_avx512(const Args& a, int n, float* out) {
    for (int k = 0; k < a.K; k += 32) {
        __m512 w0, w1;
        expand_avx512(a, n, k, w0, w1);
        _mm512_storeu_ps(out + k, w0);
        _mm512_storeu_ps(out + k + 16, w1);
    }
}

// ---- AVX2 ------------------------------------------------------------------------------------
__attribute__((target("avx2,fma,f16c"))) inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

template <int MT>
__attribute__((target("avx2,fma,f16c"))) void row_avx2(const Args& a, int n, int m0) {
    __m256 acc[MT][2];
    for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    const float* x = a.x + (int64_t)m0 * a.K;
    for (int k = 0; k < a.K; k += 32) {
        __m256 w[4];
        expand_avx2(a, n, k, w);
        for (int m = 0; m < MT; ++m) {
            const float* xr = x + (int64_t)m * a.K + k;
            acc[m][0] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xr), acc[m][0]);
            acc[m][1] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xr + 8), acc[m][1]);
            acc[m][0] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xr + 16), acc[m][0]);
            acc[m][1] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xr + 24), acc[m][1]);
        }
    }
    const float bias = a.bias ? a.bias[n] : 0.f;
    for (int m = 0; m < MT; ++m)
        a.y[(int64_t)(m0 + m) * a.N + n] = hsum256(_mm256_add_ps(acc[m][0], acc[m][1])) + bias;
}

__attribute__((target("avx2,fma,f16c"))) void dequant_avx2(const Args& a, int n, float* out) {
    for (int k = 0; k < a.K; k += 32) {
        __m256 w[4];
        expand_avx2(a, n, k, w);
        for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + k + 8 * i, w[i]);
    }
}

// ---- dispatch --------------------------------------------------------------------------------
// Input rows sharing one expansion of the weights: AVX-512 has 32 vector registers, room for 7 rows'
// four accumulators, the two weight vectors and the expansion's temporaries (checked in the assembly: no
// spills in the 4- and 8-bit 7-row tiles; the fp8 one keeps one accumulator on the stack); AVX2's 16
// hold 5 (10 accumulators and 4 weight vectors, x read by the FMAs from memory).
// 5 rather than 4 measured 0.77x the time at 5 rows and 0.87x at 9 (one expansion fewer; a speculative
// step verifies k+1 rows), the same at 1 and 4 (2-core Zen3 VM, /tmp-free harness in loadtest/qgemm_bench.py).
inline int tile_rows(int isa) { return isa >= 2 ? 7 : 5; }

// Features n0..n1-1 against the MT rows from m0.
template <int MT>
void rows(const Args& a, int n0, int n1, int m0, int isa) {
    if (isa >= 2) return rows_avx512<MT>(a, n0, n1, m0);
    for (int n = n0; n < n1; ++n) {
        if (isa == 1) row_avx2<MT>(a, n, m0);
        else row_portable(a, n, m0, MT);
    }
}

void rows_any(const Args& a, int n0, int n1, int m0, int mt, int isa) {
    with_rows<7>(mt, [&](auto MT) { rows<MT>(a, n0, n1, m0, isa); });
}

}  // namespace

extern "C" {

int psq_abi_version() { return 17; }

// y = x W^T (+ bias). Parallel over output features: each thread streams its own slice of W.
void psq_gemm(const float* x, int M, int K, const uint8_t* q, const float* scale, const float* offset,
              int N, int G, int bits, const float* bias, float* y, int isa) {
    const Args a{x, M, K, q, scale, offset, N, G, bits, bias, y, __builtin_ctz(G)};
    const int tile = tile_rows(isa);
    const int64_t work = (int64_t)N * K * (M < tile ? M : tile);
    // Features a call runs: 16 (8% faster than 4 at 32 rows on 2 Xeon cores, the row tiles reusing the
    // block's weights from cache), fewer where there would be under 4 blocks a thread to balance.
    const int block = std::max(4, std::min(16, N / (4 * omp_get_max_threads())));
    // guided for the reason psq_gemm_i16 gives (1.02-1.08x at 1-40 rows, loadtest/results/omp_schedule_*).
#pragma omp parallel for schedule(guided) if (work > (1 << 16))
    for (int n0 = 0; n0 < N; n0 += block)
        for (int m0 = 0; m0 < M; m0 += tile)
            rows_any(a, n0, n0 + block < N ? n0 + block : N, m0, M - m0 < tile ? M - m0 : tile, isa);
}

// W in fp32 [N][K] (for large steps, which hand the expanded tile to the BLAS GEMM).
void psq_dequantize(const uint8_t* q, const float* scale, const float* offset, int N, int K, int G, int bits,
                    float* out, int isa) {
    const Args a{nullptr, 0, K, q, scale, offset, N, G, bits, nullptr, nullptr, __builtin_ctz(G)};
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; ++n) {
        float* row = out + (int64_t)n * K;
        if (isa >= 2) dequant_avx512(a, n, row);
        else if (isa == 1) dequant_avx2(a, n, row);
        else for (int k = 0; k < K; ++k) row[k] = weight_at(a, n, k);
    }
}

}  // extern "C"
