// RMSNorm of fp32 rows on the CPU: y = (x * 1/sqrt(mean(x^2) + eps)) * w, HF's order of operations.
//
// Why a kernel of our own: torch's CPU rms_norm is a composite of several ops, ~20 us a call on a
// 576-wide row, and a decode step of a 30-layer model calls it 61 times: more than its share of a
// step whose matmuls read quantized weights. Here it is one pass over each row.
#include <math.h>
#include <omp.h>
#include <stdint.h>

namespace {

__attribute__((always_inline)) inline void norm_row(const float* xr, int n, const float* w, float eps, float* yr) {
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int i = 0; i < n; ++i) ss += xr[i] * xr[i];
    const float inv = 1.f / sqrtf(ss / (float)n + eps);
#pragma omp simd
    for (int i = 0; i < n; ++i) yr[i] = (xr[i] * inv) * w[i];
}

// The ISA sits on the per-row functions, not on a caller of the `omp parallel` loop: the loop's body is
// outlined into a function of its own, which would not inherit the caller's target.
using Row = void (*)(const float*, int, const float*, float, float*);
__attribute__((target("avx512f,fma"))) void row_avx512(const float* x, int n, const float* w, float eps, float* y) {
    norm_row(x, n, w, eps, y);
}
__attribute__((target("avx2,fma"))) void row_avx2(const float* x, int n, const float* w, float eps, float* y) {
    norm_row(x, n, w, eps, y);
}
void row_portable(const float* x, int n, const float* w, float eps, float* y) { norm_row(x, n, w, eps, y); }

}  // namespace

extern "C" void psq_rms_norm(const float* x, int rows, int n, const float* w, float eps, float* y, int isa) {
    const Row row = isa >= 2 ? row_avx512 : isa == 1 ? row_avx2 : row_portable;
#pragma omp parallel for schedule(static) if ((int64_t)rows * n > (1 << 16))
    for (int r = 0; r < rows; ++r) row(x + (int64_t)r * n, n, w, eps, y + (int64_t)r * n);
}

// The residual add fused with the norm that follows it: xo = x + d, y = rms_norm(xo) * w, in one pass
// over each row (a decoder layer adds a sublayer's output to the residual stream, then normalizes the
// sum for the next sublayer: two ops and an extra read of the row in torch). The sum is fp32 x + d, the
// same float as torch's add, and the norm is norm_row's, so the result equals add-then-psq_rms_norm.
namespace {

__attribute__((always_inline)) inline void add_norm_row(const float* xr, const float* dr, int n, const float* w,
                                                        float eps, float* xo, float* yr) {
#pragma omp simd
    for (int i = 0; i < n; ++i) xo[i] = xr[i] + dr[i];
    norm_row(xo, n, w, eps, yr);
}

using AddRow = void (*)(const float*, const float*, int, const float*, float, float*, float*);
__attribute__((target("avx512f,fma"))) void add_row_avx512(const float* x, const float* d, int n, const float* w,
                                                           float eps, float* xo, float* y) {
    add_norm_row(x, d, n, w, eps, xo, y);
}
__attribute__((target("avx2,fma"))) void add_row_avx2(const float* x, const float* d, int n, const float* w,
                                                      float eps, float* xo, float* y) {
    add_norm_row(x, d, n, w, eps, xo, y);
}
void add_row_portable(const float* x, const float* d, int n, const float* w, float eps, float* xo, float* y) {
    add_norm_row(x, d, n, w, eps, xo, y);
}

}  // namespace

extern "C" void psq_add_rms_norm(const float* x, const float* d, int rows, int n, const float* w, float eps,
                                 float* xo, float* y, int isa) {
    const AddRow row = isa >= 2 ? add_row_avx512 : isa == 1 ? add_row_avx2 : add_row_portable;
#pragma omp parallel for schedule(static) if ((int64_t)rows * n > (1 << 16))
    for (int r = 0; r < rows; ++r) {
        const int64_t o = (int64_t)r * n;
        row(x + o, d + o, n, w, eps, xo + o, y + o);
    }
}
