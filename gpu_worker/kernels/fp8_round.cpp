// Error-feedback rounding of keys into an fp8 cache (gpu_worker/attention/fp8_feedback.py says why):
// each (token, kv head) row is rounded channel by channel to the nearest fp8 value (ties to even, after
// saturating at the format's largest value), and channel i's error times a[h][i][j] is subtracted from
// every later channel j. The float32 operations and their order are the reference loop's
// (round_with_feedback_reference), and contraction into FMAs is off here, so both give the same bytes.
//
// x: [rows][heads][D] fp32 (already divided by the layer's scale); a: [heads][D][D] fp32 (strictly upper
// triangular); out: [rows][heads][D] fp8 bytes; kv_dtype 3 = e4m3fn, 4 = e5m2 (paged_attention.cpp's codes);
// isa: native.py's level (0 portable, 1 AVX2, 2 AVX-512). Each row's channels are a serial chain, so the
// vectors run across 16 rows of one head (each lane its own row), which makes the rounding vector work too.
#include <math.h>
#include <stdint.h>
#include <string.h>

#pragma GCC optimize("fp-contract=off")

namespace {

constexpr int LANES = 16;     // rows of one kv head rounded together, one per vector lane
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));

struct Format {
    int man_bits, min_exp;
    float top;
};

inline Format format_of(int kv_dtype) { return kv_dtype == 3 ? Format{3, -6, 448.0f} : Format{2, -14, 57344.0f}; }

// Sixteen rows' channel rounded at once: x (|x| <= top) to its nearest fp8 value, ties to even; *value gets
// the values, the result the codes. The exponent comes from the float's bits (fp8 subnormals and zero share
// the smallest step); |x| / step is exact (a power of two) and at most 2^(man_bits + 1), and adding and
// taking away 2^23 leaves the nearest integer, ties to even.
__attribute__((always_inline)) inline vi encode(vf x, const Format& f, vf* value) {
    const vi bits = (vi)x;
    const vi sign = (bits >> 31) & 1;
    vi e = ((bits >> 23) & 0xFF) - 127;
    e = e < f.min_exp ? f.min_exp : e;
    const vf step = (vf)((e - f.man_bits + 127) << 23);
    const vf y = (vf)(bits & 0x7FFFFFFF) / step;
    const vf r = (y + 8388608.0f) - 8388608.0f;
    const vf mag = r * step;
    *value = sign != 0 ? -mag : mag;
    return (sign << 7) | (((e - f.min_exp) << f.man_bits) + __builtin_convertvector(r, vi));
}

// Rows t0..t0+n-1 of head h (n <= LANES): x rows are `stride` floats apart, D channels each.
__attribute__((always_inline)) inline void round_rows(const float* x, const float* a, uint8_t* out, int n,
                                                      int stride, int D, const Format& f, float scale) {
    vf w[256];
    for (int j = 0; j < D; ++j)
        for (int l = 0; l < LANES; ++l) {
            const float v = l < n ? x[l * stride + j] : 0.0f;
            w[j][l] = scale == 1.0f ? v : v / scale;
        }
    for (int i = 0; i < D; ++i) {
        vf wi = w[i] < -f.top ? -f.top : w[i];
        wi = wi > f.top ? f.top : wi;
        vf qi;
        const vi code = encode(wi, f, &qi);
        for (int l = 0; l < n; ++l) out[l * stride + i] = (uint8_t)code[l];
        const vf err = wi - qi;
        const float* ai = a + (size_t)i * D;
        for (int j = i + 1; j < D; ++j) {
            const vf p = err * ai[j];
            w[j] = w[j] - p;
        }
    }
}

typedef void (*RoundRows)(const float*, const float*, uint8_t*, int, int, int, const Format&, float);

void round_rows_portable(const float* x, const float* a, uint8_t* out, int n, int stride, int D, const Format& f,
                         float scale) {
    round_rows(x, a, out, n, stride, D, f, scale);
}

__attribute__((target("avx2"))) void round_rows_avx2(     // no "fma": nothing may be contracted
        const float* x, const float* a, uint8_t* out, int n, int stride, int D, const Format& f, float scale) {
    round_rows(x, a, out, n, stride, D, f, scale);
}

__attribute__((target("avx512f,avx512bw,avx512vl"))) void round_rows_avx512(
        const float* x, const float* a, uint8_t* out, int n, int stride, int D, const Format& f, float scale) {
    round_rows(x, a, out, n, stride, D, f, scale);
}

}  // namespace

extern "C" int psq_fp8_round_feedback(const float* x, const float* a, uint8_t* out, int rows, int heads, int D,
                                      float scale, int kv_dtype, int isa) {
    if (D > 256 || (kv_dtype != 3 && kv_dtype != 4)) return 1;
    const Format f = format_of(kv_dtype);
    const RoundRows run = isa >= 2 ? round_rows_avx512 : isa == 1 ? round_rows_avx2 : round_rows_portable;
    const int blocks = (rows + LANES - 1) / LANES;
#pragma omp parallel for schedule(static) if (rows * heads >= 64)
    for (int b = 0; b < blocks * heads; ++b) {
        const int h = b % heads, t0 = b / heads * LANES, n = rows - t0 < LANES ? rows - t0 : LANES;
        const int64_t first = ((int64_t)t0 * heads + h) * D;
        run(x + first, a + (size_t)h * D * D, out + first, n, heads * D, D, f, scale);
    }
    return 0;
}
