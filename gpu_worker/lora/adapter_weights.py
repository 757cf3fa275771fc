"""A PEFT adapter's tensors, checked (common/lora.py) and arranged for our fused layers: per module of
ours and shard, (A [r, in], B^T [r, out] times the adapter's scaling), in host memory."""
from __future__ import annotations

from pathlib import Path

import torch

from common.lora import WEIGHTS_FILE, LoRATargets, read_adapter, split_tensor_name
from gpu_worker.weight_loader import hf_to_param

# our module path -> shard ("" for an unfused layer) -> (A, scaled B^T)
AdapterTensors = dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]]


def load_adapter_tensors(path: str, targets: LoRATargets, num_layers: int, max_rank: int,
                         dtype: torch.dtype) -> AdapterTensors:
    from safetensors.torch import load_file
    info = read_adapter(path, targets, num_layers, max_rank)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in load_file(str(Path(path) / WEIGHTS_FILE)).items():
        module, ab = split_tensor_name(name)          # read_adapter has checked every name
        pairs.setdefault(module, {})[ab] = tensor
    out: AdapterTensors = {}
    for module, ab in pairs.items():
        ours, _, shard = hf_to_param(module + ".weight")
        a = ab["A"].to(dtype)
        bt = (ab["B"].to(torch.float32) * info.scaling).t().contiguous().to(dtype)
        out.setdefault(ours, {})[shard] = (a, bt)
    return out
