"""A weight matrix kept group-quantized in memory, and the matmul that runs on it.

GGUF blocks today, and any 4/8-bit format with per-group scales and zero points, end up here as
w[n, k] = scale[n, g] * q[n, k] + offset[n, g]. Values 0..15 (with K a multiple of 32) are packed two to
a byte; anything else takes a byte. On the CPU the native kernel (gpu_worker/kernels) expands the values
in registers for steps of up to `GEMM_MAX_ROWS[isa]` rows, where reading fewer bytes is the whole win; larger
steps run on AVX2 the panel kernel up to PANEL_MAX_ROWS (with `--dtype auto`'s int16 activations, its int16
form at every size), else expand the weight once into fp32 and use the
BLAS GEMM, or, in `--dtype auto` on bf16 hardware, run on a bf16 copy held once (keep_expanded: oneDNN's
GEMM on it, or on AMX the tile kernel on its own bf16 copy for every step from AMX_NATIVE_MAX_ROWS);
`kernel_for` says which. Without the native library the same expansion is done in torch, slower, with the
same values. On CUDA a Triton GEMM (kernels/triton_qgemm) dequantizes each weight tile in registers.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch

from gpu_worker.kernels import native
from gpu_worker.layers.linear import low_precision_linear, prepack_bf16

# Per native ISA level, the largest step the native kernel runs (loadtest/qgemm_bench.py: where `direct` and
# `expand+gemm` cross). AVX2 (EPYC, 2 threads): direct wins up to 28-40 rows, 40 keeps a speculative step
# of 8 sequences x 5 rows on the kernel, so its rows stay bit-identical to plain decoding. AVX-512 (Xeon,
# loadtest/results/qgemm_bench_2026-12-02_avx512.txt): wins up to 32 rows (1.12x), loses at 48. Portable:
# expansion wins from 1 row, but 16 keeps speculative verification bit-identical to decoding there too.
GEMM_MAX_ROWS = {0: 16, 1: 40, 2: 32}
# With a bf16 expansion that oneDNN runs on AMX tiles, the expansion wins from 9 rows: SmolLM2's 120
# decoder products took 11.7 ms native against 12.2 ms bf16 at 8 rows, 13.0 against 12.5 at 9, 19.9 against
# 12.6 at 16, and bf16 stays at 15-17 ms up to 64 rows. With AVX512-BF16 dot products alone (oneDNN capped
# at AVX512_CORE_BF16) bf16 took 44 ms at 32 rows against native's 42, so GEMM_MAX_ROWS stays there
# (loadtest/results/packed_rows_2026-12-06.txt).
AMX_NATIVE_MAX_ROWS = 8
# With AMX tiles the native library's tile kernel (kernels/qgemm_amx.cpp) runs every step from there, on
# a bf16 copy of the weights in its own tile layout, expanded once at load (psq_expand_amx) in place of
# oneDNN's copy: the same bytes held, the same values. Expanding each weight at every step instead beat
# oneDNN's copy up to 128 rows (SmolLM2's 120 decoder products 11.3 ms against 20.1 at 16 rows, 37.9
# against 39.7 at 128; loadtest/results/packed_tiles_2026-12-06.txt); read expanded, they take 16.8 ms
# against 20.8 (per-step expansion) and 24.0 (oneDNN) at 64 rows, 27.5 / 34.6 / 36.2 at 128, 54.5 against
# oneDNN's 60.7 at 256 and 90.8 against 106.6 at 512 (loadtest/results/tiles_copy_2026-12-06.txt). The
# tiles beat the vector kernel from about 6 rows, but up to 8 stay on it so that a speculative step of
# k + 1 <= 8 rows reproduces plain decoding bit for bit. Steps of more than AMX_TILE_CALL_ROWS rows (a
# token budget beyond the default) go in calls of that many: each call keeps its rows' inputs in L2.
AMX_TILE_CALL_ROWS = 512
# On AVX2 without a bf16 copy, steps from GEMM_MAX_ROWS up to this many rows run the panel kernel
# (kernels/qgemm_panel.cpp: each weight expanded once a call into a cached panel, a 16x6 register-blocked
# micro-kernel); larger ones the fp32 expansion and torch's GEMM. SmolLM2's 120 products on a 2-core Zen3:
# 108.0 ms against 140.2 (expand+gemm) and 159.1 (direct) at 64 rows, 219.7 against 227.1 at 128, 352.5
# against 325.1 at 192 (loadtest/results/qgemm_panel_2026-12-07_avx2.txt). They beat the vector kernel
# from 16 rows too (60.5 against 77.5 at 32), but steps up to GEMM_MAX_ROWS stay there (bit-identical
# verification, above).
PANEL_MAX_ROWS = 128
FP8_BITS = 9         # q holds float8_e4m3fn bytes (the native kernel's code for them)
VECTOR, TILES, PANELS = "vector", "tiles", "panels"     # the native kernels of a step (kernel_for)
VECTOR_I16 = "vector_i16"   # the vector kernel's steps with int16 activations (kernels/qgemm_i16.cpp)
# With int16 activations, every larger step runs the int16 panel kernel (kernels/qgemm_panel_i16.cpp:
# vpmaddwd, 16 products an operation against an FMA's 8). SmolLM2's 120 products on the 2-core AMD EPYC,
# ms: 69.3 against 85.8 (vector int16) and 87.3 (fp32 panels) at 41 rows, 89.9 against 109.8 (panels) and
# 129.0 (fp32 GEMM) at 64, 159.9 / 225.0 (fp32 GEMM) at 128, 286.8 / 395.9 at 256, 562.5 / 752.3 at 512
# (loadtest/results/qgemm_panel_i16_2026-12-07_avx2.txt). It does not reproduce the vector kernel's sums
# bit for bit, so with speculation steps up to GEMM_MAX_ROWS stay on the vector kernel (verification).
PANELS_I16 = "panels_i16"
# Without speculation no step's rows need to match a single decode's bit for bit, so with int16 activations
# the vector kernel keeps only the steps it runs faster, per ISA level (measured on AVX2 only). SmolLM2's
# 120 products on the 2-core AMD EPYC, vector int16 against the int16 panels, ms, three runs: 18.7-19.9
# against 19.7-20.0 at 8 rows, 23.8-26.3 against 22.6-24.4 at 10, 27.2-31.8 against 24.4-26.3 at 12,
# 33.1-43.1 against 29.0-33.0 at 16, 52.0-72.1 against 36.8-46.2 at 24
# (loadtest/results/qgemm_i16_crossover_2026-12-07_epyc.txt).
I16_VECTOR_MAX_ROWS = {1: 8}


@dataclass
class GroupQuant:
    """Rows of integer values with per-group fp32 scale and offset: w = scale * q + offset.

    `perm`, when set, is the input order the columns are stored in (GPTQ act-order: its groups are
    contiguous only after sorting the input channels), so w[:, perm] is what q describes and the matmul
    permutes its input the same way."""
    q: np.ndarray          # integers [rows, K]
    scale: np.ndarray      # float32 [rows, K // group]
    offset: np.ndarray     # float32 [rows, K // group]
    group: int
    perm: np.ndarray | None = None

    def regroup(self, group: int) -> "GroupQuant":
        """The same weights with groups of `group` (a divisor of ours): scales repeat."""
        r = self.group // group
        return GroupQuant(self.q, np.repeat(self.scale, r, axis=1), np.repeat(self.offset, r, axis=1), group,
                          self.perm)

    @staticmethod
    def concat(parts: list["GroupQuant"]) -> "GroupQuant":
        """Stack row blocks (the shards of a fused layer), on their finest common grouping."""
        perm = parts[0].perm
        if any((p.perm is None) != (perm is None) or (perm is not None and not np.array_equal(p.perm, perm))
               for p in parts):
            raise ValueError("the shards store their inputs in different orders (act-order g_idx differs)")
        g = min(p.group for p in parts)
        parts = [p.regroup(g) for p in parts]
        return GroupQuant(np.concatenate([p.q for p in parts]), np.concatenate([p.scale for p in parts]),
                          np.concatenate([p.offset for p in parts]), g, perm)


class QuantizedTensor:
    """A checkpoint tensor still in its packed form. The loader hands these only to layers that keep
    weights packed (quantized Linear methods, the embedding); everything else gets plain tensors."""
    shape: tuple[int, int]

    def groups(self) -> GroupQuant:
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        raise NotImplementedError

    def pack(self, device: torch.device | str = "cpu") -> "PackedWeight":
        return PackedWeight.from_groups(self.groups(), device)


@dataclass
class PackedWeight:
    q: torch.Tensor         # uint8 [N, K/2] (bits 4), int8 [N, K] (bits 8) or e4m3 bytes [N, K] (FP8_BITS)
    scale: torch.Tensor     # float32 [N, K/group]
    offset: torch.Tensor    # float32 [N, K/group]
    bits: int
    group: int
    perm: torch.Tensor | None = None    # int64 [K]: the input order of the stored columns (GroupQuant.perm)
    expanded: torch.Tensor | None = None    # CPU: bf16, prepacked, for steps beyond the native kernel's rows
    native_max_rows: int | None = None      # the native kernel's last step size, if not GEMM_MAX_ROWS[isa]
    tiles: torch.Tensor | None = None       # AMX: bf16 bits in the tile kernel's layout, for steps beyond it
    int16_activations: bool = False         # the vector kernel's steps round x to int16 (cpu_precision.py)
    int16_vector_rows: int | None = None    # with them, the vector kernel's last step size if not max_native_rows()

    @property
    def shape(self) -> tuple[int, int]:
        n = self.q.shape[0]
        return n, self.q.shape[1] * (2 if self.bits == 4 else 1)

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.q, self.scale, self.offset) + tuple(t for t in (self.perm, self.expanded, self.tiles)
                                                         if t is not None)

    @classmethod
    def from_groups(cls, gq: GroupQuant, device: torch.device | str = "cpu") -> "PackedWeight":
        q = gq.q
        rows, k = q.shape
        if k % 32 or gq.group % 16:
            raise ValueError(f"packed weights need K a multiple of 32 and groups of 16n, got K={k}, "
                             f"group {gq.group}")
        if gq.group & (gq.group - 1):
            gq = gq.regroup(gq.group & -gq.group)     # the kernel finds groups by shifting: a power of two
        lo, hi = int(q.min()), int(q.max())
        if lo >= 0 and hi <= 15:
            runs = q.reshape(rows, k // 32, 2, 16).astype(np.uint8)
            packed, bits = (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(rows, k // 2), 4
        elif lo >= -128 and hi <= 127:
            packed, bits = q.astype(np.int8), 8
        elif lo >= 0 and hi <= 255:       # unsigned 8-bit (GPTQ): q - 128 in int8, the offset takes 128 scales
            packed, bits = (q.astype(np.int16) - 128).astype(np.int8), 8
            gq = GroupQuant(q, gq.scale, gq.offset + 128 * gq.scale, gq.group, gq.perm)
        else:
            raise ValueError(f"quantized values span {lo}..{hi}, beyond 8 bits")
        perm = None if gq.perm is None else torch.from_numpy(gq.perm.astype(np.int64)).to(device)
        return cls(torch.from_numpy(np.ascontiguousarray(packed)).to(device),
                   torch.from_numpy(np.ascontiguousarray(gq.scale, np.float32)).to(device),
                   torch.from_numpy(np.ascontiguousarray(gq.offset, np.float32)).to(device), bits, gq.group, perm)

    # ---- reading it back -----------------------------------------------------------------------
    def values(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The integer values of all rows (or of `rows`), as float32."""
        q = self.q if rows is None else self.q[rows]
        if self.bits == FP8_BITS:
            return q.view(torch.float8_e4m3fn).float()
        if self.bits == 8:
            return q.float()
        runs = q.reshape(q.shape[0], -1, 1, 16)
        return torch.cat([runs & 15, runs >> 4], dim=2).reshape(q.shape[0], -1).float()

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 weights of all rows (or of the rows `rows`, e.g. the tokens of an embedding lookup), in the
        stored column order (see `perm`)."""
        scale = self.scale if rows is None else self.scale[rows]
        offset = self.offset if rows is None else self.offset[rows]
        v = self.values(rows)
        n, k = v.shape
        w = torch.addcmul(offset[:, :, None], v.reshape(n, -1, self.group), scale[:, :, None])
        return w.reshape(n, k)

    # ---- the matmul ----------------------------------------------------------------------------
    def __post_init__(self) -> None:
        # Fixed per weight, so the per-call path (121 calls a decode step) only adds the activations.
        self._call = (self.q.data_ptr(), self.scale.data_ptr(), self.offset.data_ptr(), self.shape[0],
                      self.group, self.bits)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W^T (+ bias) for x of any leading shape; computed in fp32, returned in x's dtype. A bf16 x
        in a step the bf16 copy runs goes in as it is, and the product comes back in bf16 (fp32 with a
        bias): layers/norm.py's narrow_above."""
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        if self.perm is not None:
            x2 = x2.index_select(1, self.perm)
        if x.device.type == "cuda":        # Triton: each tile dequantized in registers, in x's dtype
            from gpu_worker.kernels import triton_qgemm     # imports triton: only where it runs
            y = triton_qgemm.packed_matmul(x2, self.q, self.scale, self.offset, self.bits, self.group, bias)
            return y.reshape(*lead, -1) if len(lead) != 1 else y
        rows = x2.shape[0]
        if x2.dtype == torch.bfloat16 and self.expanded is not None and self.expanded.dtype == torch.bfloat16 and \
                rows > (self.copy_rows() or 0):
            y = low_precision_linear(x2.contiguous(), self.expanded, bias)
            return y.reshape(*lead, -1) if len(lead) != 1 else y
        if x2.dtype != torch.float32 or not x2.is_contiguous():
            x2 = x2.float().contiguous()
        if bias is not None and bias.dtype != torch.float32:
            bias = bias.float()
        lib = native.library_for(x)
        kernel = self.kernel_for(rows) if lib is not None else None
        if kernel == VECTOR:
            y = self._native_gemm(lib, x2, bias)
        elif kernel == VECTOR_I16:
            y = self._i16_gemm(lib, x2, bias)
        elif kernel == TILES:
            y = self._tiles_gemm(lib, x2, bias)
        elif kernel == PANELS:
            y = self._panel_gemm(lib, x2, bias)
        elif kernel == PANELS_I16:
            y = self._panel_i16_gemm(lib, x2, bias)
        elif self.expanded is not None:
            y = low_precision_linear(x2, self.expanded, bias)
        else:
            y = torch.nn.functional.linear(x2, self._dequantize_fast(lib, scratch=True), bias)
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        return y.reshape(*lead, -1) if len(lead) != 1 else y

    def kernel_for(self, rows: int) -> str | None:
        """Which native kernel runs an fp32 step of `rows` rows on the CPU (the library loaded): VECTOR
        (qgemm.cpp) up to max_native_rows(), or VECTOR_I16 there with int16 activations on AVX2 (up to
        int16_vector_rows where that is set: no speculation), then TILES
        where the AMX copy is held, PANELS_I16 with int16 activations, else PANELS on AVX2 without a bf16
        copy up to PANEL_MAX_ROWS; None: oneDNN on the bf16 copy, or the fp32 expansion and torch's GEMM."""
        i16 = self._int16()
        if i16 and rows <= min(self.max_native_rows(), self.int16_vector_rows or rows):
            return VECTOR_I16
        if not i16 and rows <= self.max_native_rows():
            return VECTOR
        if self.tiles is not None:
            return TILES
        if i16 and self.expanded is None:
            return PANELS_I16
        if self.expanded is None and rows <= PANEL_MAX_ROWS and native.cpu_isa() == native.ISA_LEVELS["avx2"]:
            return PANELS
        return None

    def _int16(self) -> bool:
        """Whether this weight's products take int16 activations here: the flag, values the int16 kernels
        take (4 or 8 bits; from_groups made K whole runs of 32 and groups of 16n) and AVX2."""
        return self.int16_activations and self.bits in (4, 8) and native.cpu_isa() >= native.ISA_LEVELS["avx2"]

    def copy_rows(self) -> int | None:
        """With a low-precision copy (keep_expanded) on the CPU: the largest step the packed kernels run,
        larger ones running on the copy (0 without the native library); None without a copy."""
        if self.expanded is None or self.expanded.dtype == torch.float32 or self.q.device.type != "cpu":
            return None
        if native.library() is None:
            return 0
        return self.max_native_rows()

    def max_native_rows(self) -> int:
        """The largest step the native kernel runs on this weight; larger ones take the expansion."""
        isa_rows = GEMM_MAX_ROWS[native.cpu_isa()]
        return isa_rows if self.native_max_rows is None else min(isa_rows, self.native_max_rows)

    def keep_expanded(self, dtype: torch.dtype, native_max_rows: int | None = None, tiles: bool = False) -> None:
        """Hold a `dtype` expansion of the weights (on the CPU) for the steps the native kernel does not
        run: with bf16 matrix hardware a bf16 GEMM beats expanding to fp32 at every call by 3-4x
        (gpu_worker/cpu_precision.py). The packed copy stays for the small steps, where reading half a
        byte a weight is the win; `native_max_rows`, when given, is the largest step the kernel keeps
        because the expansion is faster beyond it (AMX_NATIVE_MAX_ROWS). `tiles` (bf16, and only where
        native.uses_amx()): the expansion is the AMX tile kernel's, which then runs every larger step,
        instead of oneDNN's. A table shared by the embedding and the lm_head is expanded once."""
        if self.q.device.type != "cpu":
            return
        self.native_max_rows = native_max_rows
        if tiles and dtype == torch.bfloat16 and native.uses_amx():
            if self.tiles is None:
                self.tiles = self._expand_for_tiles(native.library())
            self.expanded = None
        elif self.expanded is None or self.expanded.dtype != dtype:
            self.expanded = prepack_bf16(self._dequantize_fast(native.library()).to(dtype))

    def _expand_for_tiles(self, lib: ctypes.CDLL) -> torch.Tensor:
        q, scale, offset, n, group, bits = self._call
        k = self.shape[1]
        out = torch.empty((n + 31) // 32 * 32 * k, dtype=torch.int16)       # bf16 bits
        if lib.psq_expand_amx(q, scale, offset, n, k, group, bits, out.data_ptr()) != 0:
            raise ValueError(f"the AMX tiles cannot take K = {k}")
        return out

    def _kernel_call(self, fn, x: torch.Tensor, bias: torch.Tensor | None, *extra) -> torch.Tensor:
        """y = x W^T (+ bias) by one of the native kernels that share psq_gemm's arguments."""
        q, scale, offset, n, group, bits = self._call
        y = torch.empty(x.shape[0], n, dtype=torch.float32)
        fn(x.data_ptr(), x.shape[0], x.shape[1], q, scale, offset, n, group, bits,
           None if bias is None else bias.data_ptr(), y.data_ptr(), *extra)
        return y

    def _native_gemm(self, lib: ctypes.CDLL, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self._kernel_call(lib.psq_gemm, x, bias, native.cpu_isa())

    def _i16_gemm(self, lib: ctypes.CDLL, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ W^T with x rounded to int16 per run of 32 values (kernels/qgemm_i16.cpp; kernel_for checked
        the format and the CPU)."""
        return self._kernel_call(lib.psq_gemm_i16, x, bias)

    def _panel_gemm(self, lib: ctypes.CDLL, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self._kernel_call(lib.psq_gemm_panel, x, bias)

    def _panel_i16_gemm(self, lib: ctypes.CDLL, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The panels with x rounded to int16 as _i16_gemm rounds it (kernels/qgemm_panel_i16.cpp)."""
        return self._kernel_call(lib.psq_gemm_panel_i16, x, bias)

    def _tiles_gemm(self, lib: ctypes.CDLL, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ W^T on AMX tiles: x and each weight rounded to bf16 as the copy holds them, sums in fp32;
        in calls of at most AMX_TILE_CALL_ROWS rows, each row's sums the same whatever the call."""
        q, scale, offset, n, group, bits = self._call
        rows, k = x.shape
        y = torch.empty(rows, n, dtype=torch.float32)
        bias_ptr = None if bias is None else bias.data_ptr()
        pre = None if self.tiles is None else self.tiles.data_ptr()
        for r0 in range(0, rows, AMX_TILE_CALL_ROWS):       # one call up to the default token budget
            m = min(AMX_TILE_CALL_ROWS, rows - r0)
            lib.psq_gemm_amx(x.data_ptr() + r0 * k * 4, m, k, q, scale, offset, n, group, bits, bias_ptr,
                             y.data_ptr() + r0 * n * 4, pre)
        return y

    def _dequantize_fast(self, lib: ctypes.CDLL | None, scratch: bool = False) -> torch.Tensor:
        """The fp32 weights, expanded by the native kernel when it is there. scratch: into the process's
        one expansion buffer, valid until the next call (a large step's matmul reads it at once): a fresh
        100 MB tensor a call is fresh pages a call, whose first-touch faults cost more than the expansion."""
        if lib is None:
            return self.dequantize()
        q, scale, offset, n, group, bits = self._call
        k = self.shape[1]
        w = _scratch(n * k).view(n, k) if scratch else torch.empty(n, k, dtype=torch.float32)
        lib.psq_dequantize(q, scale, offset, n, k, group, bits, w.data_ptr(), native.cpu_isa())
        return w


_expansion: list[torch.Tensor] = []       # the expansion buffer, grown to the largest weight expanded


def _scratch(numel: int) -> torch.Tensor:
    if not _expansion or _expansion[0].numel() < numel:
        _expansion[:] = [torch.empty(numel, dtype=torch.float32)]
    return _expansion[0][:numel]
