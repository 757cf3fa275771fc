"""Error-feedback rounding of keys into an fp8 cache on CUDA, as a Triton kernel
(gpu_worker/attention/fp8_feedback.py says why the keys are rounded this way).

It gives the same bytes as round_with_feedback_reference: each (token, kv head) row is rounded channel by
channel, saturated at the format's largest value and rounded to nearest-even, and channel i's error times
a[h, i, j] is subtracted from every later channel j, with the same float32 operations in the same order
(a multiply, then a subtract). One program rounds one row; the D channels are a serial chain, so the row
stays in registers and the loop runs over i.

The rounding to fp8 is arithmetic (bit fields of the float32 and a power-of-two step), not a cast: the
Triton interpreter (the CPU tests) rounds a cast to fp8 wrongly (measured: a tie rounding up into the next
binade loses its carry, and ties among subnormals do not go to even), and the codes built here are exact
by construction on every backend. The kernel writes the codes as uint8 and the
result is a view as `dtype`. Channel i is picked out of the row by an integer sum of its bit pattern, so a
-0.0 keeps its sign (a float sum of zeros would turn it into +0.0, which torch codes as 0x00, not 0x80).

The launch turns floating-point fusion off (enable_fp_fusion=False): contracting the multiply and the
subtract into an FMA would round once instead of twice and move a rare byte. One warp per row (num_warps=1):
D <= 128 fits it, and the per-channel reductions then need no shared memory. The interpreter ignores both.
"""
from __future__ import annotations

import torch

from gpu_worker.kernels.triton_jit import jitted, tl

# dtype -> (mantissa bits, exponent bias): e4m3fn saturates at 448, e5m2 at 57344 (torch.finfo(...).max).
FORMATS = {torch.float8_e4m3fn: (3, 7), torch.float8_e5m2: (2, 15)}


def _fp8_round_kernel(
    x_ptr, a_ptr, out_ptr, H,
    D: tl.constexpr, MAN_BITS: tl.constexpr, BIAS: tl.constexpr, TOP: tl.constexpr,
):
    """Program (row = t * H + h): round x[t, h, :] channel by channel with a[h]'s feedback."""
    row = tl.program_id(0)
    h = row % H
    offs = tl.arange(0, D)
    w = tl.load(x_ptr + row.to(tl.int64) * D + offs)
    a_rows = a_ptr + h.to(tl.int64) * D * D
    codes = tl.zeros([D], dtype=tl.int32)
    min_exp = 1 - BIAS
    for i in range(D):
        bits = tl.sum(tl.where(offs == i, w.to(tl.int32, bitcast=True), 0), axis=0)
        wi = tl.minimum(tl.maximum(bits.to(tl.float32, bitcast=True), -TOP), TOP)   # -0.0 stays -0.0
        wbits = wi.to(tl.int32, bitcast=True)
        sign = (wbits >> 31) & 1
        e = tl.maximum(((wbits >> 23) & 0xFF) - 127, min_exp)      # fp8 subnormals and zero: min_exp
        step = ((e - MAN_BITS + 127) << 23).to(tl.float32, bitcast=True)
        inv_step = ((127 - e + MAN_BITS) << 23).to(tl.float32, bitcast=True)
        y = (wbits & 0x7FFFFFFF).to(tl.float32, bitcast=True) * inv_step    # |wi| / step, exact
        f = y.to(tl.int32)                                                   # floor: y >= 0
        d = y - f.to(tl.float32)
        r = tl.where((d > 0.5) | ((d == 0.5) & ((f & 1) == 1)), f + 1, f)  # nearest, ties to even
        code = (sign << 7) | (((e - min_exp) << MAN_BITS) + r)             # r = 2^(mb+1) carries
        mag = r.to(tl.float32) * step
        qi = tl.where(sign == 1, -mag, mag)
        codes = tl.where(offs == i, code, codes)
        later = offs > i
        ai = tl.load(a_rows + i * D + offs, mask=later, other=0.0)
        p = (wi - qi) * ai
        w = tl.where(later, w - p, w)
    tl.store(out_ptr + row.to(tl.int64) * D + offs, codes.to(tl.uint8))


def round_with_feedback_triton(x: torch.Tensor, a: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [T, H, D] fp32 rounded to fp8 `dtype` against a [H, D, D] (feedback_matrix): the bytes of
    round_with_feedback_reference(x, a, dtype), as a [T, H, D] tensor of `dtype`."""
    if dtype not in FORMATS:
        raise ValueError(f"dtype must be float8_e4m3fn or float8_e5m2, got {dtype}")
    if x.dim() != 3:
        raise ValueError(f"x must be [T, H, D], got {tuple(x.shape)}")
    t, h, d = x.shape
    if d < 2 or d & (d - 1) or tuple(a.shape) != (h, d, d):
        raise ValueError(f"need a power-of-two D and a [{h}, {d}, {d}], got x {tuple(x.shape)}, a {tuple(a.shape)}")
    x = x.float().contiguous()
    a = a.float().contiguous()
    out = torch.empty(t, h, d, dtype=torch.uint8, device=x.device)
    if t * h:
        man_bits, bias = FORMATS[dtype]
        jitted(_fp8_round_kernel, "fp8 key rounding")[(t * h,)](
            x, a, out, h, D=d, MAN_BITS=man_bits, BIAS=bias, TOP=float(torch.finfo(dtype).max),
            num_warps=1, enable_fp_fusion=False,
        )
    return out.view(dtype)
