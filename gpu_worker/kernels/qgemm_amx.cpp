// The packed-weight matmul of qgemm.cpp on AMX-BF16 tiles, for steps of a few to a few dozen rows in
// `--dtype auto` on a CPU that has them: y[M,N] = x[M,K] W^T (+ bias), W in any of qgemm.cpp's formats.
//
// Why: between the native vector kernel (its cost grows with every row: each weight is multiplied in
// fp32 once per row) and oneDNN's bf16 GEMM on the expanded copy (which reads 2 bytes a weight, 2.4x the
// packed bytes, and is bound by them up to ~64 rows), a kernel can expand each weight once per step into
// bf16, as the copy holds it, and multiply it into every row on the tiles, reading only the packed bytes.
//
// How: output features go in blocks, 48 (three tiles of 16) for up to 16 rows, else 32, and a block's
// sums stay in tiles across all of K (stream_48x16, stream_32x32 and block_32xM: the three step shapes).
// A block's weights are expanded by the same code as qgemm.cpp's (qweights.h: one fused multiply-add in
// fp32, so each weight equals the expansion's bit for bit), rounded to bf16 to nearest even as torch's
// conversion does, and laid out as tile rows: a feature's 32 consecutive inputs are one 64-byte row, so
// the weights are the tiles' left operand as they come. The inputs are the right operand: x rounded to
// bf16 once per call and interleaved in input pairs, 16 rows to a tile (rows past M are zeros). Each
// 16 x 16 block of sums comes out with features as rows; a register transpose writes it into y's rows.
// The sums stay fp32 and are not rounded to bf16 (oneDNN's bf16 product is), and a row's outputs are the
// same pairs summed in the same order whatever the other rows, so a sequence's result does not depend on
// the batch beside it.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include <algorithm>
#include <vector>

#include "amx.h"
#include "qweights.h"

namespace {

constexpr int TILE = 16;          // features (or input rows) a tile holds
constexpr int TILE_WORDS = TILE * TILE;   // 32-bit words (bf16 pairs) in a tile

__attribute__((target(PSQ_AMX_TARGET))) void configure() {
    TileConfig c{};
    c.palette = 1;
    for (int t = 0; t < 8; ++t) c.rows[t] = TILE, c.colsb[t] = 64;
    load_tiles(c);
}

// x's rows m0..m0+15 (zeros past M), inputs k..k+31, as one tile of input pairs: row j holds, for each
// of the 16 rows, the bf16 pair (2j, 2j+1) from k. `out` is that tile (16 rows of 64 bytes).
__attribute__((target(PSQ_AMX_TARGET))) void pair_inputs(const Args& a, int m0, int k, uint32_t* out) {
    const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(TILE));
    for (int r = 0; r < TILE; ++r) {
        const int m = m0 + r;
        __m512i pairs = _mm512_setzero_si512();
        if (m < a.M) {
            const float* x = a.x + (int64_t)m * a.K + k;
            pairs = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 16), _mm512_loadu_ps(x));
        }
        _mm512_i32scatter_epi32(out + r, rows, pairs, 4);
    }
}

// Features n0..n0+nf-1 (zeros past N), input chunks c0..c1-1 (32 inputs each), as tile rows: tile
// (f / 16, c - c0) holds 16 features' 32 inputs, a 64-byte row each. The format and group size are
// compile-time and a feature's pointers locals, as in qgemm.cpp's tiles: read through `a` at every run
// (the stores into `w` might alias it, for all GCC knows) the expansion took 3x the vector kernel's time.
template <int BITS, bool G16>
__attribute__((target(PSQ_AMX_TARGET))) inline void expand_rows(const Args& a, int n0, int nf, int c0, int c1,
                                                                 uint16_t* w, bool prefetch = false) {
    const int gs = a.gs, ng = groups(a), value_bytes = BITS == 4 ? a.K / 2 : a.K, span = c1 - c0;
    for (int f = 0; f < nf; ++f) {
        uint16_t* row = w + ((size_t)(f / TILE) * span * TILE + f % TILE) * 32;
        const int n = n0 + f;
        if (n >= a.N) {
            for (int c = 0; c < span; ++c) _mm512_storeu_si512(row + (size_t)c * TILE_WORDS * 2, _mm512_setzero_si512());
            continue;
        }
        const uint8_t* q = a.q + (int64_t)n * value_bytes;
        const float* sc = a.scale + (int64_t)n * ng;
        const float* of = a.offset + (int64_t)n * ng;
        if (prefetch && n + PREFETCH_AHEAD < a.N) prefetch_feature(a, n + PREFETCH_AHEAD, value_bytes);
        for (int c = c0; c < c1; ++c) {
            __m512 w0, w1;
            const int k = c * 32, g0 = k >> gs;
            weights_avx512<BITS>(q, k, sc, of, g0, G16 ? g0 + 1 : g0, w0, w1);
            _mm512_storeu_si512(row + (size_t)(c - c0) * TILE_WORDS * 2, (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
        }
    }
}

// Streaming a block chunk by chunk reads a few bytes of each of its features' rows at a time, a pattern
// the hardware prefetchers miss: so while it runs, the next block's rows (nf features from n0) are
// requested, spread over its chunks, chunk c asking for features c * nf / chunks onward.
__attribute__((always_inline)) inline void prefetch_next(const Args& a, int n0, int nf, int c, int chunks) {
    const int value_bytes = a.bits == 4 ? a.K / 2 : a.K;
    for (int f = c * nf / chunks; f < (c + 1) * nf / chunks && n0 + f < a.N; ++f)
        prefetch_feature(a, n0 + f, value_bytes);
}

// Transpose 16 x 16 floats in registers: r[i][j] -> r[j][i].
__attribute__((target(PSQ_AMX_TARGET))) inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; ++i) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
    }
    for (int i = 0; i < 8; ++i) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
    }
}

// sums [16 features][16 rows] -> y[m0 + r][n0 + f] (+ bias) for the rows below M and features below N.
__attribute__((target(PSQ_AMX_TARGET))) void write_sums(const Args& a, const float* sums, int n0, int m0) {
    if (n0 >= a.N) return;
    __m512 r[16];
    for (int f = 0; f < TILE; ++f) r[f] = _mm512_loadu_ps(sums + f * TILE);
    transpose16(r);
    const int live = a.N - n0 < TILE ? a.N - n0 : TILE;
    const __mmask16 mask = (__mmask16)((1u << live) - 1);
    const __m512 bias = a.bias ? _mm512_maskz_loadu_ps(mask, a.bias + n0) : _mm512_setzero_ps();
    for (int i = 0; i < TILE && m0 + i < a.M; ++i)
        _mm512_mask_storeu_ps(a.y + (int64_t)(m0 + i) * a.N + n0, mask, _mm512_add_ps(r[i], bias));
}

// Tile numbers are macros: GCC's tile intrinsics paste them into the instruction's text. A tile's sums
// depend on the one before over the input chunks (a dot product's latency is ~3x its issue interval), so
// each shape keeps three or four sum tiles in flight.
#define STORE_SUMS(T, n0, m0) do { _tile_stored(T, sums, 64); write_sums(a, sums, n0, m0); } while (0)

// Up to 16 rows: 48 features (three sum tiles 0-2, weight tiles 3-5, input tile 6). Each chunk's weights
// are expanded (into alternate halves of `w`) one chunk ahead of their products, so the vector expansion
// of one chunk overlaps the tiles' products of the one before, and a tile never loads bytes whose stores
// may still be in flight: a tile load waits for them, which had cost a quarter of the time.
template <int BITS, bool G16>
__attribute__((target(PSQ_AMX_TARGET))) void stream_48x16(const Args& a, int n0, const uint32_t* xp, uint16_t* w,
                                                          float* sums) {
    const int chunks = a.K / 32;
    const size_t half = 3 * TILE_WORDS * 2;
    _tile_zero(0); _tile_zero(1); _tile_zero(2);
    expand_rows<BITS, G16>(a, n0, 3 * TILE, 0, 1, w);
    for (int c = 0; c < chunks; ++c) {
        const uint16_t* wc = w + (c & 1) * half;
        if (c + 1 < chunks) {
            prefetch_next(a, n0 + 3 * TILE, 3 * TILE, c, chunks);
            expand_rows<BITS, G16>(a, n0, 3 * TILE, c + 1, c + 2, w + ((c + 1) & 1) * half);
        }
        _tile_loadd(6, xp + (size_t)c * TILE_WORDS, 64);
        _tile_loadd(3, wc, 64);
        _tile_dpbf16ps(0, 3, 6);
        _tile_loadd(4, wc + TILE_WORDS * 2, 64);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(5, wc + TILE_WORDS * 4, 64);
        _tile_dpbf16ps(2, 5, 6);
    }
    STORE_SUMS(0, n0, 0); STORE_SUMS(1, n0 + TILE, 0); STORE_SUMS(2, n0 + 2 * TILE, 0);
}

// 32 features against row tiles t0 and t0 + 1: sum tiles 0-3 (feature tile, row tile), weight tiles 4-5,
// input tiles 6-7. `w` holds the block's weights for chunks c0..c1-1 (expand_rows' layout).
__attribute__((target(PSQ_AMX_TARGET))) inline void multiply_32x32(const Args& a, const uint16_t* w, const uint32_t* xp,
                                                                   int t0, int c0, int c1) {
    const int chunks = a.K / 32, span = c1 - c0;
    for (int c = c0; c < c1; ++c) {
        _tile_loadd(4, w + (size_t)(c - c0) * TILE_WORDS * 2, 64);
        _tile_loadd(5, w + ((size_t)span + c - c0) * TILE_WORDS * 2, 64);
        _tile_loadd(6, xp + ((size_t)t0 * chunks + c) * TILE_WORDS, 64);
        _tile_loadd(7, xp + ((size_t)(t0 + 1) * chunks + c) * TILE_WORDS, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
}

__attribute__((target(PSQ_AMX_TARGET))) inline void store_32x32(const Args& a, float* sums, int n0, int t0) {
    const int m0 = t0 * TILE;
    STORE_SUMS(0, n0, m0); STORE_SUMS(2, n0 + TILE, m0);
    if (m0 + TILE < a.M) { STORE_SUMS(1, n0, m0 + TILE); STORE_SUMS(3, n0 + TILE, m0 + TILE); }
}

// 17-32 rows: 32 features, the expansion streamed chunk by chunk as in stream_48x16.
template <int BITS, bool G16>
__attribute__((target(PSQ_AMX_TARGET))) void stream_32x32(const Args& a, int n0, const uint32_t* xp, uint16_t* w,
                                                          float* sums) {
    const int chunks = a.K / 32;
    const size_t half = 2 * TILE_WORDS * 2;
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    expand_rows<BITS, G16>(a, n0, 2 * TILE, 0, 1, w);
    for (int c = 0; c < chunks; ++c) {
        if (c + 1 < chunks) {
            prefetch_next(a, n0 + 2 * TILE, 2 * TILE, c, chunks);
            expand_rows<BITS, G16>(a, n0, 2 * TILE, c + 1, c + 2, w + ((c + 1) & 1) * half);
        }
        multiply_32x32(a, w + (c & 1) * half, xp, 0, c, c + 1);
    }
    store_32x32(a, sums, n0, 0);
}

// More rows: the block's weights are expanded once for every chunk (or were, once for all steps:
// psq_expand_amx), then multiplied into the row tiles two at a time (a pass per pair would expand them
// again).
template <int BITS, bool G16>
__attribute__((target(PSQ_AMX_TARGET))) void block_32xM(const Args& a, int n0, const uint32_t* xp, uint16_t* w,
                                                        float* sums) {
    const int chunks = a.K / 32, row_tiles = (a.M + TILE - 1) / TILE;
    if (a.pre)
        w = (uint16_t*)a.pre + (size_t)n0 * a.K;
    else
        expand_rows<BITS, G16>(a, n0, 2 * TILE, 0, chunks, w, true);
    for (int t = 0; t < row_tiles; t += 2) {
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        multiply_32x32(a, w, xp, t, 0, chunks);
        store_32x32(a, sums, n0, t);
    }
}

using Block = void (*)(const Args&, int, const uint32_t*, uint16_t*, float*);

// The block kernel for this call's shape and format, and the features it covers.
// With the weights expanded beforehand, every step above 16 rows takes block_32xM: nothing to stream.
template <int BITS, bool G16>
Block pick_for(int M, bool pre, int& features) {
    features = M <= TILE ? 3 * TILE : 2 * TILE;
    return M <= TILE ? stream_48x16<BITS, G16> : M <= 2 * TILE && !pre ? stream_32x32<BITS, G16> : block_32xM<BITS, G16>;
}

Block pick(const Args& a, int& features) {
    const bool g16 = a.G == 16, pre = a.pre != nullptr;
    if (a.bits == 4) return g16 ? pick_for<4, true>(a.M, pre, features) : pick_for<4, false>(a.M, pre, features);
    if (a.bits == FP8)
        return g16 ? pick_for<FP8, true>(a.M, pre, features) : pick_for<FP8, false>(a.M, pre, features);
    return g16 ? pick_for<8, true>(a.M, pre, features) : pick_for<8, false>(a.M, pre, features);
}

template <int BITS, bool G16>
void expand_all(const Args& a, uint16_t* out) {
    const int blocks = (a.N + 2 * TILE - 1) / (2 * TILE), chunks = a.K / 32;
#pragma omp parallel for schedule(static)
    for (int b = 0; b < blocks; ++b)
        expand_rows<BITS, G16>(a, b * 2 * TILE, 2 * TILE, 0, chunks, out + (size_t)b * 2 * TILE * a.K);
}

}  // namespace

extern "C" {

// y = x W^T (+ bias) on AMX tiles; only after psq_amx_ready(). Returns 0, or -1 for a K the tiles cannot
// take (K must be a multiple of 32, as for every packed weight).
// The weights in block_32xM's tile layout, once: out holds ceil(N / 32) * 32 * K bf16 (features past N
// zeros), each 32-feature block's K inputs as expand_rows lays them out; psq_gemm_amx reads them as `pre`.
int psq_expand_amx(const uint8_t* q, const float* scale, const float* offset, int N, int K, int G, int bits,
                   uint16_t* out) {
    if (K % 32) return -1;
    const Args a{nullptr, 0, K, q, scale, offset, N, G, bits, nullptr, nullptr, __builtin_ctz(G)};
    const bool g16 = G == 16;
    if (bits == 4) g16 ? expand_all<4, true>(a, out) : expand_all<4, false>(a, out);
    else if (bits == FP8) g16 ? expand_all<FP8, true>(a, out) : expand_all<FP8, false>(a, out);
    else g16 ? expand_all<8, true>(a, out) : expand_all<8, false>(a, out);
    return 0;
}

// `pre`, when not null, is psq_expand_amx's output for these weights: steps above 16 rows then read it
// instead of expanding the weights again.
int psq_gemm_amx(const float* x, int M, int K, const uint8_t* q, const float* scale, const float* offset, int N,
                 int G, int bits, const float* bias, float* y, const uint16_t* pre) {
    if (K % 32) return -1;
    if (M <= 0 || N <= 0) return 0;
    const Args a{x, M, K, q, scale, offset, N, G, bits, bias, y, __builtin_ctz(G), pre};
    const int row_tiles = (M + TILE - 1) / TILE, chunks = K / 32;
    int features = 0;
    const Block block = pick(a, features);
    const int blocks = (N + features - 1) / features;
    // [row tile][chunk][pair][row]; a row-tile count rounded up to even, the last one zeros when odd
    std::vector<uint32_t> xp((size_t)(row_tiles + 1) / 2 * 2 * chunks * TILE_WORDS);
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int i = 0; i < row_tiles * chunks; ++i)
            pair_inputs(a, i / chunks * TILE, i % chunks * 32, xp.data() + (size_t)i * TILE_WORDS);
        std::vector<uint16_t> w((size_t)std::max(3 * TILE * 64, 2 * TILE * K));
        float sums[TILE_WORDS];
        TileConfig found{};
        tiles_save(&found);
        configure();
#pragma omp for schedule(static)
        for (int b = 0; b < blocks; ++b) block(a, b * features, xp.data(), w.data(), sums);
        tiles_restore(&found);
    }
    return 0;
}

}  // extern "C"
