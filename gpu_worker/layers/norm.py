"""RMSNorm computed in fp32, as the reference implementations do, whatever the run dtype; contiguous fp32
rows on the CPU go through the native kernel (one pass a row, ~4x less than torch's composite op).

Gemma's variant scales by (1 + weight) and multiplies before casting back; it is kept as an fp32 weight
holding 1 + w, so in fp32 both variants are the same computation (and the same kernel).

A norm whose output only feeds matmuls that run on a bf16 copy of their weights in large steps can give
those steps its output in bf16 (`narrow_above`, set by the model: models/llama.py narrow_activations):
the kernel rounds as the matmul's own conversion would have, so the values are the same and a pass over
the step's activations is saved."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.kernels import native


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, gemma: bool = False):
        super().__init__()
        self.eps, self.gemma = eps, gemma
        self.weight = nn.Parameter(torch.ones(size, dtype=torch.float32 if gemma else dtype), requires_grad=False)
        self.narrow_above: int | None = None     # steps of more rows than this: the output in bf16

    def load(self, param: str, tensor: torch.Tensor, shard: str = "") -> None:
        if not isinstance(tensor, torch.Tensor):
            tensor = tensor.dequantize()
        if param != "weight" or tuple(tensor.shape) != tuple(self.weight.shape):
            raise ValueError(f"expected a norm weight of shape {tuple(self.weight.shape)}, got {param} "
                             f"{tuple(tensor.shape)}")
        self.weight.data.copy_(tensor.float() + 1.0 if self.gemma else tensor)

    def add_forward(self, residual: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + delta, the norm of that sum): a decoder layer's residual add and the norm after it,
        in one pass over each row where the native kernel takes them (fp32 rows on the CPU, delta fp32 or
        a bf16 matmul's output); the same floats as the add followed by forward()."""
        if self._native(residual) and delta.dtype in (torch.float32, torch.bfloat16) and delta.is_contiguous():
            lib, n = native.library(), residual.shape[-1]
            rows = residual.numel() // n
            total, y = torch.empty_like(residual), torch.empty_like(residual, dtype=self._out_dtype(rows))
            lib.psq_add_rms_norm(residual.data_ptr(), delta.data_ptr(), delta.dtype == torch.bfloat16, rows, n,
                                 self.weight.data_ptr(), self.eps, total.data_ptr(), y.data_ptr(),
                                 y.dtype == torch.bfloat16, native.cpu_isa())
            return total, y
        total = residual + delta
        return total, self(total)

    def _out_dtype(self, rows: int) -> torch.dtype:
        """The native kernel's output dtype for a step of `rows` rows (see the module's docstring)."""
        return torch.bfloat16 if self.narrow_above is not None and rows > self.narrow_above else torch.float32

    def _native(self, x: torch.Tensor) -> bool:
        return x.dtype == torch.float32 and self.weight.dtype == torch.float32 and x.device.type == "cpu" and \
            x.is_contiguous() and native.library() is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._native(x):
            n = x.shape[-1]
            rows = x.numel() // n
            y = torch.empty_like(x, dtype=self._out_dtype(rows))
            native.library().psq_rms_norm(x.data_ptr(), rows, n, self.weight.data_ptr(), self.eps, y.data_ptr(),
                                          y.dtype == torch.bfloat16, native.cpu_isa())
            return y
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # one fused op, bit-identical to the unfused fp32 formula below (tested) and ~5 us faster a call
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.gemma:
            return (xf * self.weight).to(dtype)
        return self.weight * xf.to(dtype)
