// SwiGLU's product silu(gate) * up for fp32 rows, from the fused gate_up projection's output: one pass
// instead of torch's two ops (silu into a new tensor, then the product into another), which read and
// write the step's widest activations twice.
//
// silu(g) = g / (1 + e^-g), as torch computes it, with e^x from vec8.h (about 1 ulp, like torch's
// vectorized exp: the result is within a few ulp of torch's, not bit for bit). Layout: gate_up rows `ld`
// entries apart, the gate in the first `inter` entries and up in the next; out [rows][inter]. With bf16
// set, gate_up and out are bf16 (a large step's bf16 GEMM output in, the next GEMM's input out): the same
// fp32 arithmetic on the widened values, rounded as torch rounds (vec8.h).
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "vec8.h"

namespace {

__attribute__((always_inline)) inline v8 silu_mul8(v8 g, v8 u) { return g / (1.f + exp8(-g)) * u; }

template <typename T>
__attribute__((always_inline)) inline void silu_mul_row(const T* g, const T* u, int n, T* o) {
    int i = 0;
    for (; i + 8 <= n; i += 8) store8(o + i, silu_mul8(load8(g + i), load8(u + i)));
    if (i < n) {                   // the tail through a padded vector, so every entry takes the same path
        alignas(32) T gt[8] = {}, ut[8] = {}, ot[8];
        memcpy(gt, g + i, (size_t)(n - i) * sizeof(T));
        memcpy(ut, u + i, (size_t)(n - i) * sizeof(T));
        store8(ot, silu_mul8(load8(gt), load8(ut)));
        memcpy(o + i, ot, (size_t)(n - i) * sizeof(T));
    }
}

template <typename T>
struct SiluMulRows {
    using Row = void (*)(const T*, const T*, int, T*);
    __attribute__((target("avx512f,fma"))) static void avx512(const T* g, const T* u, int n, T* o) {
        silu_mul_row(g, u, n, o);
    }
    __attribute__((target("avx2,fma"))) static void avx2(const T* g, const T* u, int n, T* o) {
        silu_mul_row(g, u, n, o);
    }
    static void portable(const T* g, const T* u, int n, T* o) { silu_mul_row(g, u, n, o); }

    static void run(const T* gate_up, int rows, int inter, int64_t ld, T* out, int isa) {
        const Row row = isa >= 2 ? avx512 : isa == 1 ? avx2 : portable;
#pragma omp parallel for schedule(static) if ((int64_t)rows * inter > (1 << 15))
        for (int r = 0; r < rows; ++r) {
            const T* g = gate_up + (int64_t)r * ld;
            row(g, g + inter, inter, out + (int64_t)r * inter);
        }
    }
};

}  // namespace

extern "C" void psq_silu_mul(const void* gate_up, int rows, int inter, int64_t ld, void* out, int bf16, int isa) {
    if (bf16)
        SiluMulRows<uint16_t>::run((const uint16_t*)gate_up, rows, inter, ld, (uint16_t*)out, isa);
    else
        SiluMulRows<float>::run((const float*)gate_up, rows, inter, ld, (float*)out, isa);
}
