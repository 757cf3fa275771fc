"""A mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE) over the flat batch of a step.

The router picks top-k experts per token; the step's (token, expert) pairs are sorted by expert once,
so each expert that has tokens runs one gate/up and one down matmul over all of its rows, and the
weighted results are summed back with one index_add. The experts' weights are stacked as HF keeps them
in memory: gate_up [E, 2I, H] and down [E, H, I]; checkpoints name them per expert (Mixtral's w1/w3/w2,
Qwen's gate/up/down_proj) or stacked (GGUF's ffn_*_exps), and `load` takes either.

Expert weights stay in the model dtype: quantized checkpoints' expert tensors are expanded at load
(the quantized Linear methods cover the attention and the dense layers).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.layers.activation import activation
from gpu_worker.layers.linear import Linear

# checkpoint names of one expert's matrices -> (our stacked parameter, row half of gate_up: 0 gate, 1 up)
EXPERT_PARTS = {"w1": ("gate_up", 0), "gate_proj": ("gate_up", 0), "w3": ("gate_up", 1), "up_proj": ("gate_up", 1),
                "w2": ("down", None), "down_proj": ("down", None)}


class FusedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int, act: str, dtype: torch.dtype):
        super().__init__()
        self.num_experts, self.intermediate = num_experts, intermediate
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden, dtype=dtype), requires_grad=False)
        self.down = nn.Parameter(torch.empty(num_experts, hidden, intermediate, dtype=dtype), requires_grad=False)
        self.act = activation(act)

    def checkpoint_parts(self) -> list[tuple[str, str]]:
        """Every (param, shard) a checkpoint must fill: one per expert and matrix."""
        return [(p, f"{e}.{name}") for e in range(self.num_experts)
                for p, name in (("gate_up", "gate_proj"), ("gate_up", "up_proj"), ("down", "down_proj"))]

    def load(self, param: str, tensor: torch.Tensor, shard: str = "") -> None:
        """`param` is a checkpoint matrix name (w1, gate_proj, ...) and `shard` the expert ("3"), or
        shard "*" for all experts stacked [E, ...]. Loads are recorded under checkpoint_parts' names."""
        if not isinstance(tensor, torch.Tensor):     # a quantized checkpoint's expert: expanded
            tensor = tensor.dequantize()
        target, half = EXPERT_PARTS[param]
        dst = getattr(self, target).data
        if half is not None:
            dst = dst[:, half * self.intermediate:(half + 1) * self.intermediate]
        dst = dst if shard == "*" else dst[int(shard)]
        if tuple(tensor.shape) != tuple(dst.shape):
            raise ValueError(f"shape mismatch for experts.{param}[{shard}]: checkpoint {tuple(tensor.shape)}, "
                             f"expected {tuple(dst.shape)}")
        dst.copy_(tensor)

    def loaded_parts(self, param: str, shard: str) -> list[tuple[str, str]]:
        """The checkpoint_parts entries that load(param, tensor, shard) filled."""
        target, _ = EXPERT_PARTS[param]
        name = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}.get(param, param)
        experts = range(self.num_experts) if shard == "*" else [int(shard)]
        return [(target, f"{e}.{name}") for e in experts]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x [T, H]; weights and experts [T, k]: each token's chosen experts and their weights."""
        t, k = experts.shape
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token = order // k                          # the token of each sorted (token, expert) pair
        xs = x[token]
        ws = weights.reshape(-1)[order]
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if not n:
                continue
            rows = slice(start, start + n)
            gate, up = F.linear(xs[rows], self.gate_up[e]).chunk(2, dim=-1)
            y = F.linear(self.act(gate) * up, self.down[e])
            out.index_add_(0, token[rows], (y * ws[rows, None]).to(out.dtype))
            start += n
        return out


class SparseMoE(nn.Module):
    """Router + experts (+ Qwen2-MoE's gated shared expert). `norm_topk`: renormalize the chosen
    experts' probabilities (Mixtral always; Qwen by norm_topk_prob). `fp32_weights`: the routing weights
    multiply the experts' outputs in fp32 (Mixtral) rather than in the model dtype (Qwen), as HF does."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, norm_topk: bool, act: str,
                 dtype: torch.dtype, fp32_weights: bool, shared_expert: nn.Module | None = None):
        super().__init__()
        self.top_k, self.norm_topk, self.fp32_weights = top_k, norm_topk, fp32_weights
        self.gate = Linear(hidden, num_experts, dtype=dtype)
        self.experts = FusedExperts(num_experts, hidden, intermediate, act, dtype)
        self.shared_expert = shared_expert
        self.shared_expert_gate = Linear(hidden, 1, dtype=dtype) if shared_expert is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = self.experts(x, weights if self.fp32_weights else weights.to(x.dtype), experts)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
