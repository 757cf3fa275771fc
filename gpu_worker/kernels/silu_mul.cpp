// SwiGLU's product silu(gate) * up for fp32 rows, from the fused gate_up projection's output: one pass
// instead of torch's two ops (silu into a new tensor, then the product into another), which read and
// write the step's widest activations twice.
//
// silu(g) = g / (1 + e^-g), as torch computes it, with e^x from vec8.h (about 1 ulp, like torch's
// vectorized exp: the result is within a few ulp of torch's, not bit for bit). Layout: gate_up rows `ld`
// floats apart, the gate in the first `inter` entries and up in the next; out [rows][inter].
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "vec8.h"

namespace {

__attribute__((always_inline)) inline v8 silu_mul8(v8 g, v8 u) { return g / (1.f + exp8(-g)) * u; }

__attribute__((always_inline)) inline void silu_mul_row(const float* g, const float* u, int n, float* o) {
    int i = 0;
    for (; i + 8 <= n; i += 8) store8(o + i, silu_mul8(load8(g + i), load8(u + i)));
    if (i < n) {                   // the tail through a padded vector, so every entry takes the same path
        alignas(32) float gt[8] = {}, ut[8] = {}, ot[8];
        memcpy(gt, g + i, (size_t)(n - i) * 4);
        memcpy(ut, u + i, (size_t)(n - i) * 4);
        store8(ot, silu_mul8(load8(gt), load8(ut)));
        memcpy(o + i, ot, (size_t)(n - i) * 4);
    }
}

using Row = void (*)(const float*, const float*, int, float*);
__attribute__((target("avx512f,fma"))) void row_avx512(const float* g, const float* u, int n, float* o) {
    silu_mul_row(g, u, n, o);
}
__attribute__((target("avx2,fma"))) void row_avx2(const float* g, const float* u, int n, float* o) {
    silu_mul_row(g, u, n, o);
}
void row_portable(const float* g, const float* u, int n, float* o) { silu_mul_row(g, u, n, o); }

}  // namespace

extern "C" void psq_silu_mul(const float* gate_up, int rows, int inter, int64_t ld, float* out, int isa) {
    const Row row = isa >= 2 ? row_avx512 : isa == 1 ? row_avx2 : row_portable;
#pragma omp parallel for schedule(static) if ((int64_t)rows * inter > (1 << 15))
    for (int r = 0; r < rows; ++r) {
        const float* g = gate_up + (int64_t)r * ld;
        row(g, g + inter, inter, out + (int64_t)r * inter);
    }
}
