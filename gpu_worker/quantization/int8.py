"""Dynamic int8 matmuls: an opt-in CPU speed mode for large steps."""
from __future__ import annotations

import torch

from gpu_worker.layers.linear import Linear, LinearMethod


class Int8LinearMethod(LinearMethod):
    """int8 weights (one scale per output channel) times int8 activations (one scale per token, taken at
    each call) with int32 accumulation (torch._int_mm), rescaled to the run dtype.

    On this AVX2 CPU the int8 product runs at several times fp32's rate, so large steps (prefill) gain
    most; per-token activation scales keep outlier tokens from degrading the others. An opt-in speed mode
    (`--quantization int8`), never the reference for correctness tests.
    """

    def process_weights_after_loading(self, layer: Linear) -> None:
        w = layer.weight.detach().float()
        del layer.weight                  # only the int8 copy stays resident (a tied table stays with the embedding)
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-8)
        layer.register_buffer("w_int8", (w / scale[:, None]).round().to(torch.int8).t(), persistent=False)  # [in, out]
        layer.register_buffer("w_scale", scale, persistent=False)

    def use_matmul_dtype(self, layer: Linear, dtype: torch.dtype) -> None:
        """int8 products already: the weights stay int8."""

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        xf = x.reshape(-1, x.shape[-1]).float()
        xs = (xf.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=1e-8)
        xq = (xf / xs).round_().to(torch.int8)
        y = torch._int_mm(xq, layer.w_int8).float() * xs * layer.w_scale
        if layer.bias is not None:
            y = y + layer.bias.float()
        return y.to(x.dtype).reshape(*lead, -1)
