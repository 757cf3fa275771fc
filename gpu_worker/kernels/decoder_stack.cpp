// A plain Llama decoder stack (RMSNorm, fused qkv, rope, paged attention, o, RMSNorm, fused gate_up,
// SwiGLU, down; packed weights) over one step in a single call, for the steps whose every sequence the
// attention kernel runs (decodes and short runs behind a context: speculative verification).
//
// Why: a decode step of SmolLM2 calls ten kernels a layer, 300 in all, and in Python each call costs
// 15-50 us of module dispatch, tensor allocation and ctypes marshalling around work that, at one row,
// takes a few microseconds. This file computes nothing of its own: it calls the same kernels in the same
// order on the same buffers as models/llama.py's layers do (psq_rms_norm, psq_add_rms_norm, psq_gemm,
// psq_gemm_amx, psq_gemm_panel, psq_gemm_i16 or psq_gemm_panel_i16, psq_rope, psq_kv_write,
// psq_paged_attention, psq_silu_mul),
// so every float equals the layered path's (tested). gpu_worker/models/native_stack.py says which steps
// and models it takes.
#include <stdint.h>
#include <string.h>

extern "C" {
void psq_gemm(const float* x, int M, int K, const uint8_t* q, const float* scale, const float* offset, int N, int G,
              int bits, const float* bias, float* y, int isa);
int psq_gemm_amx(const float* x, int M, int K, const uint8_t* q, const float* scale, const float* offset, int N,
                 int G, int bits, const float* bias, float* y, const uint16_t* pre);
void psq_gemm_panel(const float* x, int M, int K, const uint8_t* q, const float* scale, const float* offset, int N,
                    int G, int bits, const float* bias, float* y);
int psq_gemm_panel_i16(const float* x, int M, int K, const uint8_t* q, const float* scale, const float* offset,
                       int N, int G, int bits, const float* bias, float* y);
int psq_gemm_i16(const float* x, int M, int K, const uint8_t* q, const float* scale, const float* offset, int N,
                 int G, int bits, const float* bias, float* y);
void psq_rms_norm(const float* x, int rows, int n, const float* w, float eps, void* y, int y_bf16, int isa);
void psq_add_rms_norm(const float* x, const void* d, int d_bf16, int rows, int n, const float* w, float eps,
                      float* xo, void* y, int y_bf16, int isa);
int psq_rope(float* q, int64_t q_stride, int q_heads, float* k, int64_t k_stride, int k_heads, int rows, int d,
             const float* cos, const float* sin, int rot, int isa);
int psq_kv_write(const float* k, int64_t k_stride, const float* v, int64_t v_stride, int rows, int n,
                 const int64_t* slots, void* k_cache, void* v_cache, int cache_dtype, int isa);
int psq_paged_attention(const float* q, const void* k_cache, const void* v_cache, int kv_dtype, const int32_t* tables,
                        int max_blocks, const int32_t* seq_lens, const int32_t* q_start, int B, int Hq, int Hkv,
                        int D, int block_size, float scale, float* out, int window, float softcap, const float* sink,
                        int isa);
void psq_silu_mul(const void* gate_up, int rows, int inter, int64_t ld, void* out, int bf16, int isa);
}

// Field orders are mirrored by ctypes structures in models/native_stack.py.
struct StackWeight {            // a PackedWeight: y = x W^T (+ bias), W [n][k]
    const uint8_t* q;
    const float* scale;
    const float* offset;
    const float* bias;          // or null
    const uint16_t* tiles;      // psq_expand_amx's copy, or null (then every step is a psq_gemm step)
    int32_t n, k, group, bits;
};

struct StackLayer {
    const float* input_norm;
    const float* post_norm;
    StackWeight qkv, o, gate_up, down;
    void* k_cache;
    void* v_cache;
    int32_t window;             // 0: none
};

struct StackStep {
    int32_t rows, hidden, q_heads, kv_heads, head_dim, inter, rot;
    float eps, scale;
    const float* cos;           // [rows][rot]
    const float* sin;
    const int64_t* slots;       // [rows] each row's cache slot
    const int32_t* tables;      // [seqs][max_blocks]
    const int32_t* lens;        // [seqs]
    const int32_t* q_start;     // [seqs + 1]
    int32_t seqs, max_blocks, block_size, kv_dtype;
    int32_t kernel;             // every product's: 0 psq_gemm, 1 psq_gemm_amx (tiles), 2 psq_gemm_panel,
                                // 3 psq_gemm_i16, 4 psq_gemm_panel_i16
    int32_t tile_call_rows;     // the tiles' rows per call (packed.py's AMX_TILE_CALL_ROWS)
    int32_t isa, attention_isa;
    const float* x;             // [rows][hidden] the embeddings
    float* residual;            // out: the residual stream after the last layer
    float* out;                 // out: the last layer's MLP output (the stream is out + residual)
    float* scratch;             // psq_stack_scratch(...) floats
};

namespace {

void gemm(const StackStep& s, const StackWeight& w, const float* x, float* y) {
    if (s.kernel == 0) {
        psq_gemm(x, s.rows, w.k, w.q, w.scale, w.offset, w.n, w.group, w.bits, w.bias, y, s.isa);
        return;
    }
    if (s.kernel == 2) {
        psq_gemm_panel(x, s.rows, w.k, w.q, w.scale, w.offset, w.n, w.group, w.bits, w.bias, y);
        return;
    }
    if (s.kernel == 3) {        // the caller checked the formats (PackedWeight.kernel_for)
        psq_gemm_i16(x, s.rows, w.k, w.q, w.scale, w.offset, w.n, w.group, w.bits, w.bias, y);
        return;
    }
    if (s.kernel == 4) {        // likewise
        psq_gemm_panel_i16(x, s.rows, w.k, w.q, w.scale, w.offset, w.n, w.group, w.bits, w.bias, y);
        return;
    }
    for (int r0 = 0; r0 < s.rows; r0 += s.tile_call_rows) {     // as PackedWeight._tiles_gemm splits them
        const int m = s.rows - r0 < s.tile_call_rows ? s.rows - r0 : s.tile_call_rows;
        psq_gemm_amx(x + (int64_t)r0 * w.k, m, w.k, w.q, w.scale, w.offset, w.n, w.group, w.bits, w.bias,
                     y + (int64_t)r0 * w.n, w.tiles);
    }
}

// Where each of a step's scratch buffers starts, in floats, laid out in one place for the layer and for
// psq_stack_scratch: the norm's output, the qkv product, q made contiguous, attention's output, o's
// product, gate_up, SwiGLU's output; `end` is the total.
struct Layout {
    int64_t h, qkv, q, attn, delta, gate_up, act, end;
};

Layout layout(int64_t rows, int64_t hidden, int64_t qd, int64_t kvd, int64_t inter) {
    Layout o;
    o.h = 0;
    o.qkv = o.h + rows * hidden;
    o.q = o.qkv + rows * (qd + 2 * kvd);
    o.attn = o.q + rows * qd;
    o.delta = o.attn + rows * qd;
    o.gate_up = o.delta + rows * hidden;
    o.act = o.gate_up + rows * 2 * inter;
    o.end = o.act + rows * inter;
    return o;
}

int layer(const StackStep& s, const StackLayer& l, bool first) {
    const int rows = s.rows, hd = s.head_dim;
    const int64_t qd = (int64_t)s.q_heads * hd, kvd = (int64_t)s.kv_heads * hd, width = qd + 2 * kvd;
    const Layout o = layout(rows, s.hidden, qd, kvd, s.inter);
    float *h = s.scratch + o.h, *qkv = s.scratch + o.qkv, *q = s.scratch + o.q, *attn = s.scratch + o.attn;
    float *delta = s.scratch + o.delta, *gate_up = s.scratch + o.gate_up, *act = s.scratch + o.act;
    if (first) {                       // the first layer: the stream is the embeddings themselves
        memcpy(s.residual, s.x, sizeof(float) * rows * s.hidden);
        psq_rms_norm(s.x, rows, s.hidden, l.input_norm, s.eps, h, 0, s.isa);
    } else {
        psq_add_rms_norm(s.residual, s.out, 0, rows, s.hidden, l.input_norm, s.eps, s.residual, h, 0, s.isa);
    }
    gemm(s, l.qkv, h, qkv);
    if (psq_rope(qkv, width, s.q_heads, qkv + qd, width, s.kv_heads, rows, hd, s.cos, s.sin, s.rot, s.isa)) return 1;
    if (psq_kv_write(qkv + qd, width, qkv + qd + kvd, width, rows, (int)kvd, s.slots, l.k_cache, l.v_cache,
                     s.kv_dtype, s.isa))
        return 2;
    for (int r = 0; r < rows; ++r) memcpy(q + r * qd, qkv + r * width, sizeof(float) * qd);
    if (psq_paged_attention(q, l.k_cache, l.v_cache, s.kv_dtype, s.tables, s.max_blocks, s.lens, s.q_start, s.seqs,
                            s.q_heads, s.kv_heads, hd, s.block_size, s.scale, attn, l.window, 0.f, nullptr,
                            s.attention_isa))
        return 3;
    gemm(s, l.o, attn, delta);
    psq_add_rms_norm(s.residual, delta, 0, rows, s.hidden, l.post_norm, s.eps, s.residual, h, 0, s.isa);
    gemm(s, l.gate_up, h, gate_up);
    psq_silu_mul(gate_up, rows, s.inter, 2LL * s.inter, act, 0, s.isa);
    gemm(s, l.down, act, s.out);
    return 0;
}

}  // namespace

extern "C" {

// The floats of scratch a step of `rows` rows needs.
int64_t psq_stack_scratch(int rows, int hidden, int q_heads, int kv_heads, int head_dim, int inter) {
    return layout(rows, hidden, (int64_t)q_heads * head_dim, (int64_t)kv_heads * head_dim, inter).end;
}

// Runs layers[0..n_layers) over the step. Returns 0, or layer index * 4 + the call that refused its
// shapes (1 rope, 2 KV write, 3 attention); the caller checks them first, so that is a bug.
int psq_decoder_stack(const StackStep* s, const StackLayer* layers, int n_layers) {
    for (int i = 0; i < n_layers; ++i) {
        const int rc = layer(*s, layers[i], i == 0);
        if (rc) return i * 4 + rc;
    }
    return 0;
}

}  // extern "C"
