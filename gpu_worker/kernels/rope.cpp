// Rotary position embedding of q and k in place, for fp32 rows: one call a layer instead of torch's
// eight ops (a multiply, a concatenation, a multiply and an add, for q and for k), which at a decode
// step's few rows cost more in dispatch than in arithmetic.
//
// Each head's first `rot` entries x become x * cos + swap_halves(x) * sin, where the caller's sin has its
// first half negated (layers/rotary.py): the two products and their sum are rounded one at a time, as
// torch's three ops round them, so the result is theirs bit for bit. Hence fp-contract=off: a fused
// multiply-add would skip a rounding. Entries past `rot` (partial rotary) pass through.
//
// Layouts: q rows are `q_stride` floats apart, each [q_heads][d]; k likewise; cos and sin [rows][rot].
#include <omp.h>
#include <stdint.h>

namespace {

constexpr int MAX_ROT = 512;

__attribute__((always_inline)) inline void rotate_heads(float* x, int heads, int d, const float* c,
                                                        const float* s, int rot) {
    const int half = rot / 2;
    float t[MAX_ROT];
    for (int h = 0; h < heads; ++h) {
        float* p = x + (int64_t)h * d;
#pragma omp simd
        for (int i = 0; i < rot; ++i) t[i] = p[i];
#pragma omp simd
        for (int i = 0; i < half; ++i) {
            const float a = t[i] * c[i], b = t[i + half] * s[i];
            p[i] = a + b;
        }
#pragma omp simd
        for (int i = half; i < rot; ++i) {
            const float a = t[i] * c[i], b = t[i - half] * s[i];
            p[i] = a + b;
        }
    }
}

using Rows = void (*)(float*, int, int, const float*, const float*, int);
__attribute__((target("avx512f"), optimize("fp-contract=off"))) void heads_avx512(float* x, int h, int d,
                                                                                  const float* c, const float* s,
                                                                                  int rot) {
    rotate_heads(x, h, d, c, s, rot);
}
__attribute__((target("avx2"), optimize("fp-contract=off"))) void heads_avx2(float* x, int h, int d, const float* c,
                                                                             const float* s, int rot) {
    rotate_heads(x, h, d, c, s, rot);
}
__attribute__((optimize("fp-contract=off"))) void heads_portable(float* x, int h, int d, const float* c,
                                                                 const float* s, int rot) {
    rotate_heads(x, h, d, c, s, rot);
}

}  // namespace

// Returns 0, or -1 when rot is odd, larger than d or than MAX_ROT (the caller keeps torch's ops).
extern "C" int psq_rope(float* q, int64_t q_stride, int q_heads, float* k, int64_t k_stride, int k_heads, int rows,
                        int d, const float* cos, const float* sin, int rot, int isa) {
    if (rot % 2 || rot > d || rot > MAX_ROT) return -1;
    const Rows f = isa >= 2 ? heads_avx512 : isa == 1 ? heads_avx2 : heads_portable;
#pragma omp parallel for schedule(static) if ((int64_t)rows * (q_heads + k_heads) * rot > (1 << 16))
    for (int r = 0; r < rows; ++r) {
        const float* c = cos + (int64_t)r * rot;
        const float* s = sin + (int64_t)r * rot;
        f(q + r * q_stride, q_heads, d, c, s, rot);
        f(k + r * k_stride, k_heads, d, c, s, rot);
    }
    return 0;
}
