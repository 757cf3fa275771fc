"""GPTQ checkpoints as AutoGPTQ (v1, `checkpoint_format: gptq`) and GPTQModel (`gptq_v2`) write them.

Per layer: `qweight` int32 [K*bits/32, N] packs the values along the input features, `qzeros` int32
[G, N*bits/32] along the outputs (v1 stores zero - 1, v2 the zero itself), `scales` fp16 [G, N] and
`g_idx` int32 [K], the group of each input feature: k // group, or with `desc_act` (act-order) a
permutation of that, which PackedWeight serves by permuting the activations. `sym` only changes which
zeros were written (2^(bits-1)); reading is the same.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gpu_worker.quantization.awq import SCALE_DTYPES
from gpu_worker.quantization.checkpoint import (CheckpointFormat, ZeroPointTensor, expect_dtype, expect_shape,
                                                unpack_int32)


@dataclass
class GPTQFormat(CheckpointFormat):
    bits: int
    group: int            # -1: one group per row
    desc_act: bool
    zero_bias: int        # added to the stored zeros: 1 for v1, 0 for v2
    method = "gptq"
    markers = ("qweight",)
    parts = ("qweight", "qzeros", "scales", "g_idx")
    required = ("qweight", "qzeros", "scales")

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> "GPTQFormat":
        bits, group = int(cfg.get("bits", 4)), int(cfg.get("group_size", 128))
        fmt = str(cfg.get("checkpoint_format", "gptq")).lower()
        if bits not in (4, 8) or fmt not in ("gptq", "gptq_v2") or not (group == -1 or group > 0):
            raise ValueError(f"GPTQ checkpoint with bits={bits}, checkpoint_format={fmt!r}, group_size={group}: "
                             "supported are 4 and 8 bits, formats gptq and gptq_v2, group_size -1 or positive")
        return cls(bits, group, bool(cfg.get("desc_act", False)), 1 if fmt == "gptq" else 0)

    def build(self, prefix: str, parts: dict[str, torch.Tensor]) -> ZeroPointTensor:
        if self.desc_act and "g_idx" not in parts:
            raise ValueError(f"checkpoint layer {prefix!r} has no g_idx, which desc_act (act-order) needs")
        qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
        for suffix in ("qweight", "qzeros"):
            expect_dtype(f"{prefix}.{suffix}", parts[suffix], (torch.int32,))
        expect_dtype(f"{prefix}.scales", scales, SCALE_DTYPES)
        per_word = 32 // self.bits
        k, n = qweight.shape[0] * per_word, qweight.shape[1]
        group = k if self.group == -1 else self.group
        if k % group:
            raise ValueError(f"checkpoint tensor {prefix + '.qweight'!r}: {k} input features are not a multiple "
                             f"of group_size {group}")
        why = f"{k} inputs and {n} outputs from qweight, {self.bits}-bit groups of {group}"
        expect_shape(f"{prefix}.qzeros", qzeros, (k // group, n // per_word), why)
        expect_shape(f"{prefix}.scales", scales, (k // group, n), why)
        g_idx = None
        if "g_idx" in parts:
            expect_shape(f"{prefix}.g_idx", parts["g_idx"], (k,), why)
            g_idx = parts["g_idx"].numpy().astype(np.int64)
            if g_idx.min() < 0 or g_idx.max() >= k // group:
                raise ValueError(f"checkpoint tensor {prefix + '.g_idx'!r} names groups {g_idx.min()}..{g_idx.max()}, "
                                 f"expected 0..{k // group - 1}")
        q = np.ascontiguousarray(unpack_int32(qweight, self.bits, axis=0).T)
        zeros = unpack_int32(qzeros, self.bits, axis=1).astype(np.int32) + self.zero_bias
        return ZeroPointTensor(q, zeros, scales, group, g_idx)
