// Eight floats as one GCC vector (a ymm register under AVX2 / AVX-512 targets, two xmm elsewhere), and
// e^x on them: shared by the attention softmax (paged_attention.cpp) and SwiGLU (silu_mul.cpp).
#pragma once

#include <stdint.h>

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4), may_alias));   // unaligned loads and stores
typedef int32_t v8i __attribute__((vector_size(32)));

__attribute__((always_inline)) inline v8 load8(const float* p) { return *(const v8u*)p; }
__attribute__((always_inline)) inline void store8(float* p, v8 x) { *(v8u*)p = x; }

// e^x, 8 at a time: x = n ln2 + r with |r| <= ln2 / 2, e^r by Cephes' expf polynomial (about 1 ulp),
// times 2^n built in the exponent bits. x is clamped to [-87, 88], where e^x is still a normal float:
// below, it gives e^-87, not 0 (a softmax weight that small changes no sum it joins; silu's g / (1 + e^-g)
// is g to within a float); above, e^88, not infinity (silu's is 0 to within a float).
__attribute__((always_inline)) inline v8 exp8(v8 x) {
    x = x < -87.f ? (v8){} - 87.f : x;
    x = x > 88.f ? (v8){} + 88.f : x;
    const v8 n = (x * 1.44269504f + 12582912.f) - 12582912.f;          // round to nearest: 1.5 * 2^23
    const v8 r = (x - n * 0.693359375f) - n * -2.12194440e-4f;          // ln 2 in two parts
    v8 p = 1.9875691500e-4f * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    return p * (v8)((__builtin_convertvector(n, v8i) + 127) << 23);
}

// bf16 (as uint16_t) <-> fp32, so a kernel can read or write the activations that oneDNN's bf16 GEMMs
// take and give without a separate conversion pass. Widening is exact (a bf16 is a float's high half);
// narrowing rounds to nearest even and makes NaN 0x7fc0, c10::BFloat16's rule, so a kernel's bf16 output
// equals its fp32 output followed by torch's .to(torch.bfloat16), bit for bit.
typedef uint16_t v8h __attribute__((vector_size(16), aligned(2), may_alias));
typedef uint32_t v8ui __attribute__((vector_size(32)));

__attribute__((always_inline)) inline v8 load8(const uint16_t* p) {
    return (v8)(__builtin_convertvector(*(const v8h*)p, v8ui) << 16);
}
__attribute__((always_inline)) inline void store8(uint16_t* p, v8 x) {
    const v8ui u = (v8ui)x;
    const v8ui r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    *(v8h*)p = __builtin_convertvector((v8ui)(x != x ? (v8i){} + 0x7fc0 : (v8i)r), v8h);
}
__attribute__((always_inline)) inline float load1(const float* p) { return *p; }
__attribute__((always_inline)) inline float load1(const uint16_t* p) {
    const uint32_t u = (uint32_t)*p << 16;
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
}
__attribute__((always_inline)) inline void store1(float* p, float x) { *p = x; }
__attribute__((always_inline)) inline void store1(uint16_t* p, float x) {
    uint32_t u;
    __builtin_memcpy(&u, &x, 4);
    *p = x != x ? (uint16_t)0x7fc0 : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
