"""AWQ checkpoints in AutoAWQ's GEMM format (`quant_method: awq`, `version: gemm`), 4-bit with zero points.

Per layer: `qweight` int32 [K, N/8] and `qzeros` int32 [K/group, N/8] hold eight 4-bit values a word
along the output features, in AutoAWQ's interleaved order (word nibble i is output column ORDER[i] of
its eight); `scales` fp16 [K/group, N]. w = scales * (q - zeros), per group of `group` input features.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gpu_worker.quantization.checkpoint import (CheckpointFormat, ZeroPointTensor, expect_dtype, expect_shape,
                                                unpack_int32)

ORDER = (0, 2, 4, 6, 1, 3, 5, 7)          # AutoAWQ's pack order: nibble i holds column ORDER[i]
UNORDER = tuple(int(i) for i in np.argsort(ORDER))   # column j is nibble UNORDER[j]
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def unpack_awq(packed: torch.Tensor) -> np.ndarray:
    """[R, N/8] int32 words -> [R, N] values 0..15 in column order."""
    v = unpack_int32(packed, 4, axis=1)
    return np.ascontiguousarray(v.reshape(v.shape[0], -1, 8)[:, :, UNORDER].reshape(v.shape[0], -1))


@dataclass
class AWQFormat(CheckpointFormat):
    group: int
    method = "awq"
    markers = ("qweight",)
    parts = ("qweight", "qzeros", "scales")
    required = parts

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> "AWQFormat":
        bits = int(cfg.get("bits", cfg.get("w_bit", 4)))
        group = int(cfg.get("group_size", cfg.get("q_group_size", 128)))
        version = str(cfg.get("version", "gemm")).lower()
        if bits != 4 or version != "gemm" or not cfg.get("zero_point", True) or group <= 0:
            raise ValueError(f"AWQ checkpoint with bits={bits}, version={version!r}, zero_point="
                             f"{cfg.get('zero_point', True)}, group_size={group}: only 4-bit GEMM with zero points "
                             "and a positive group size is supported")
        if cfg.get("modules_to_not_convert"):
            raise ValueError(f"AWQ modules_to_not_convert {cfg['modules_to_not_convert']} is not supported")
        return cls(group)

    def build(self, prefix: str, parts: dict[str, torch.Tensor]) -> ZeroPointTensor:
        qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
        for suffix in ("qweight", "qzeros"):
            expect_dtype(f"{prefix}.{suffix}", parts[suffix], (torch.int32,))
        expect_dtype(f"{prefix}.scales", scales, SCALE_DTYPES)
        k, n = qweight.shape[0], qweight.shape[1] * 8
        if k % self.group:
            raise ValueError(f"checkpoint tensor {prefix + '.qweight'!r}: {k} input features are not a multiple "
                             f"of group_size {self.group}")
        why = f"{k} inputs and {n} outputs from qweight, groups of {self.group}"
        expect_shape(f"{prefix}.qzeros", qzeros, (k // self.group, n // 8), why)
        expect_shape(f"{prefix}.scales", scales, (k // self.group, n), why)
        return ZeroPointTensor(np.ascontiguousarray(unpack_awq(qweight).T), unpack_awq(qzeros), scales, self.group)
