// RMSNorm of fp32 rows on the CPU: y = (x * 1/sqrt(mean(x^2) + eps)) * w, HF's order of operations.
//
// Why a kernel of our own: torch's CPU rms_norm is a composite of several ops, ~20 us a call on a
// 576-wide row, and a decode step of a 30-layer model calls it 61 times: more than its share of a
// step whose matmuls read quantized weights. Here it is one pass over each row.
#include <math.h>
#include <omp.h>
#include <stdint.h>

namespace {

__attribute__((always_inline)) inline void norm_rows(const float* x, int rows, int n, const float* w, float eps,
                                                     float* y) {
#pragma omp parallel for schedule(static) if ((int64_t)rows * n > (1 << 16))
    for (int r = 0; r < rows; ++r) {
        const float* xr = x + (int64_t)r * n;
        float* yr = y + (int64_t)r * n;
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int i = 0; i < n; ++i) ss += xr[i] * xr[i];
        const float inv = 1.f / sqrtf(ss / (float)n + eps);
#pragma omp simd
        for (int i = 0; i < n; ++i) yr[i] = (xr[i] * inv) * w[i];
    }
}

__attribute__((target("avx512f,fma"))) void norm_avx512(const float* x, int rows, int n, const float* w, float eps,
                                                         float* y) { norm_rows(x, rows, n, w, eps, y); }
__attribute__((target("avx2,fma"))) void norm_avx2(const float* x, int rows, int n, const float* w, float eps,
                                                    float* y) { norm_rows(x, rows, n, w, eps, y); }

}  // namespace

extern "C" void psq_rms_norm(const float* x, int rows, int n, const float* w, float eps, float* y, int isa) {
    if (isa >= 2) norm_avx512(x, rows, n, w, eps, y);
    else if (isa == 1) norm_avx2(x, rows, n, w, eps, y);
    else norm_rows(x, rows, n, w, eps, y);
}
