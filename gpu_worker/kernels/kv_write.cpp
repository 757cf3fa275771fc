// A step's new keys and values into the paged cache, for fp32 rows and an fp32 or bf16 cache: one call
// a layer instead of torch's four ops (a dtype conversion and an index_copy_, for K and for V).
//
// Rows are `k_stride` / `v_stride` floats apart (views into the fused qkv projection's output), each
// [heads][d]; row r goes to cache slot slots[r], whose entries are [heads][d] at slots[r] * heads * d.
// bf16 is rounded to nearest even, as torch converts it (a NaN stays a NaN, as 0x7fc0).
#include <omp.h>
#include <stdint.h>
#include <string.h>

namespace {

__attribute__((always_inline)) inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

__attribute__((always_inline)) inline void store_row(const float* x, int n, void* dst, int bf16) {
    if (!bf16) {
        memcpy(dst, x, (size_t)n * 4);
        return;
    }
    uint16_t* o = (uint16_t*)dst;
#pragma omp simd
    for (int i = 0; i < n; ++i) o[i] = to_bf16(x[i]);
}

using Row = void (*)(const float*, int, void*, int);
__attribute__((target("avx512f,avx512bw"))) void row_avx512(const float* x, int n, void* dst, int bf16) {
    store_row(x, n, dst, bf16);
}
__attribute__((target("avx2"))) void row_avx2(const float* x, int n, void* dst, int bf16) { store_row(x, n, dst, bf16); }
void row_portable(const float* x, int n, void* dst, int bf16) { store_row(x, n, dst, bf16); }

}  // namespace

// cache_dtype: 0 fp32, 1 bf16 (the others stay with torch). Returns 0, or -1 for another dtype.
extern "C" int psq_kv_write(const float* k, int64_t k_stride, const float* v, int64_t v_stride, int rows, int n,
                            const int64_t* slots, void* k_cache, void* v_cache, int cache_dtype, int isa) {
    if (cache_dtype != 0 && cache_dtype != 1) return -1;
    const Row row = isa >= 2 ? row_avx512 : isa == 1 ? row_avx2 : row_portable;
    const int64_t entry = cache_dtype ? 2 : 4;
#pragma omp parallel for schedule(static) if ((int64_t)rows * n > (1 << 16))
    for (int r = 0; r < rows; ++r) {
        const int64_t at = slots[r] * n * entry;
        row(k + r * k_stride, n, (char*)k_cache + at, cache_dtype);
        row(v + r * v_stride, n, (char*)v_cache + at, cache_dtype);
    }
    return 0;
}
