"""The MLP activations by their Hugging Face config names (hidden_act / hidden_activation), and the gated
form the MLPs use: act(gate) * up."""
from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from gpu_worker.kernels import native

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),   # Gemma's GeGLU
    "gelu_new": partial(F.gelu, approximate="tanh"),
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported; expected one of {', '.join(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


def gated(name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """act(gate) * up. SwiGLU's gate and up, side by side in the fused gate_up projection's output, go
    through the native kernel in one pass (silu_mul.cpp: within a few ulp of torch's two ops; bf16 halves
    in fp32 arithmetic, rounded once)."""
    act = activation(name)
    return _silu_mul if act is F.silu else lambda gate, up: act(gate) * up


def exact_on_bf16(gated_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> bool:
    """Whether `gated_fn` (from gated()) gives the bf16 halves of a bf16 matmul's output the fp32 result it
    gives their fp32 copies, rounded to bf16 (what the next bf16 matmul would round it to): the native
    SwiGLU where the library is loaded. An MLP may then run large steps in bf16 (layers/norm.py)."""
    return native_swiglu(gated_fn) and native.available()


def native_swiglu(gated_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> bool:
    """Whether `gated_fn` (from gated()) is SwiGLU through silu_mul.cpp (models/native_stack.py calls it)."""
    return gated_fn is _silu_mul


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    lib = native.library_for(gate)
    if lib is not None and _halves_of_one_row(gate, up):
        rows, inter = gate.shape
        out = torch.empty(rows, inter, dtype=gate.dtype)
        lib.psq_silu_mul(gate.data_ptr(), rows, inter, gate.stride(0), out.data_ptr(), gate.dtype == torch.bfloat16,
                         native.cpu_isa())
        return out
    return F.silu(gate) * up


def _halves_of_one_row(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """gate and up fp32 or bf16 [rows, I], up the next I entries of each of gate's rows."""
    return gate.dtype == up.dtype and gate.dtype in (torch.float32, torch.bfloat16) and gate.dim() == 2 and \
        gate.shape == up.shape and gate.stride(1) == up.stride(1) == 1 and gate.stride(0) == up.stride(0) and \
        up.data_ptr() == gate.data_ptr() + gate.shape[1] * gate.element_size()
