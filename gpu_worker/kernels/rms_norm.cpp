// RMSNorm of fp32 rows on the CPU: y = (x * 1/sqrt(mean(x^2) + eps)) * w, HF's order of operations.
//
// Why a kernel of our own: torch's CPU rms_norm is a composite of several ops, ~20 us a call on a
// 576-wide row, and a decode step of a 30-layer model calls it 61 times: more than its share of a
// step whose matmuls read quantized weights. Here it is one pass over each row.
//
// y may be written in bf16 (y_bf16): a large step whose next matmul runs on oneDNN's bf16 GEMM takes
// the norm's output as it is, instead of a conversion pass over it (gpu_worker/layers/norm.py); the
// values are the fp32 result rounded as torch rounds (vec8.h's store1).
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "vec8.h"

namespace {

template <typename Y>
__attribute__((always_inline)) inline void norm_row(const float* xr, int n, const float* w, float eps, Y* yr) {
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int i = 0; i < n; ++i) ss += xr[i] * xr[i];
    const float inv = 1.f / sqrtf(ss / (float)n + eps);
#pragma omp simd
    for (int i = 0; i < n; ++i) store1(yr + i, (xr[i] * inv) * w[i]);
}

// The residual add fused with the norm that follows it: xo = x + d, y = rms_norm(xo) * w, in one pass
// over each row (a decoder layer adds a sublayer's output to the residual stream, then normalizes the
// sum for the next sublayer: two ops and an extra read of the row in torch). The sum is fp32 x + d, the
// same float as torch's add, and the norm is norm_row's, so the result equals add-then-psq_rms_norm.
// d may be bf16 (a bf16 GEMM's output, widened exactly).
template <typename D, typename Y>
__attribute__((always_inline)) inline void add_norm_row(const float* xr, const D* dr, int n, const float* w,
                                                        float eps, float* xo, Y* yr) {
#pragma omp simd
    for (int i = 0; i < n; ++i) xo[i] = xr[i] + load1(dr + i);
    norm_row(xo, n, w, eps, yr);
}

// The ISA sits on the per-row functions, not on a caller of the `omp parallel` loop: the loop's body is
// outlined into a function of its own, which would not inherit the caller's target.
template <typename Y>
struct NormRows {
    using Row = void (*)(const float*, int, const float*, float, Y*);
    __attribute__((target("avx512f,fma"))) static void avx512(const float* x, int n, const float* w, float eps, Y* y) {
        norm_row(x, n, w, eps, y);
    }
    __attribute__((target("avx2,fma"))) static void avx2(const float* x, int n, const float* w, float eps, Y* y) {
        norm_row(x, n, w, eps, y);
    }
    static void portable(const float* x, int n, const float* w, float eps, Y* y) { norm_row(x, n, w, eps, y); }

    static void run(const float* x, int rows, int n, const float* w, float eps, Y* y, int isa) {
        const Row row = isa >= 2 ? avx512 : isa == 1 ? avx2 : portable;
#pragma omp parallel for schedule(static) if ((int64_t)rows * n > (1 << 16))
        for (int r = 0; r < rows; ++r) row(x + (int64_t)r * n, n, w, eps, y + (int64_t)r * n);
    }
};

template <typename D, typename Y>
struct AddNormRows {
    using Row = void (*)(const float*, const D*, int, const float*, float, float*, Y*);
    __attribute__((target("avx512f,fma"))) static void avx512(const float* x, const D* d, int n, const float* w,
                                                              float eps, float* xo, Y* y) {
        add_norm_row(x, d, n, w, eps, xo, y);
    }
    __attribute__((target("avx2,fma"))) static void avx2(const float* x, const D* d, int n, const float* w,
                                                         float eps, float* xo, Y* y) {
        add_norm_row(x, d, n, w, eps, xo, y);
    }
    static void portable(const float* x, const D* d, int n, const float* w, float eps, float* xo, Y* y) {
        add_norm_row(x, d, n, w, eps, xo, y);
    }

    static void run(const float* x, const D* d, int rows, int n, const float* w, float eps, float* xo, Y* y,
                    int isa) {
        const Row row = isa >= 2 ? avx512 : isa == 1 ? avx2 : portable;
#pragma omp parallel for schedule(static) if ((int64_t)rows * n > (1 << 16))
        for (int r = 0; r < rows; ++r) {
            const int64_t o = (int64_t)r * n;
            row(x + o, d + o, n, w, eps, xo + o, y + o);
        }
    }
};

}  // namespace

extern "C" void psq_rms_norm(const float* x, int rows, int n, const float* w, float eps, void* y, int y_bf16,
                             int isa) {
    if (y_bf16)
        NormRows<uint16_t>::run(x, rows, n, w, eps, (uint16_t*)y, isa);
    else
        NormRows<float>::run(x, rows, n, w, eps, (float*)y, isa);
}

extern "C" void psq_add_rms_norm(const float* x, const void* d, int d_bf16, int rows, int n, const float* w,
                                 float eps, float* xo, void* y, int y_bf16, int isa) {
    if (d_bf16 && y_bf16)
        AddNormRows<uint16_t, uint16_t>::run(x, (const uint16_t*)d, rows, n, w, eps, xo, (uint16_t*)y, isa);
    else if (d_bf16)
        AddNormRows<uint16_t, float>::run(x, (const uint16_t*)d, rows, n, w, eps, xo, (float*)y, isa);
    else if (y_bf16)
        AddNormRows<float, uint16_t>::run(x, (const float*)d, rows, n, w, eps, xo, (uint16_t*)y, isa);
    else
        AddNormRows<float, float>::run(x, (const float*)d, rows, n, w, eps, xo, (float*)y, isa);
}
