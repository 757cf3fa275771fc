"""Random-weight PEFT LoRA adapters written at test time, and the Hugging Face reference with an adapter
merged through peft: the one builder the LoRA tests and the multi-LoRA benchmark use."""
from __future__ import annotations

from pathlib import Path

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_adapter(hf_model, folder: Path, rank: int, targets: tuple[str, ...] = ALL_TARGETS, alpha: int | None = None,
                  seed: int = 0, std: float = 0.05, use_rslora: bool = False) -> Path:
    """Save a LoRA adapter of `hf_model` (left unchanged) with random, non-zero A and B of standard
    deviation `std`, so the adapter visibly changes the outputs."""
    import peft
    cfg = peft.LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, target_modules=list(targets),
                          init_lora_weights=False, use_rslora=use_rslora)
    torch.manual_seed(seed)
    wrapped = peft.get_peft_model(hf_model, cfg)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_" in name:
                p.normal_(0, std)
    wrapped.save_pretrained(folder)
    wrapped.unload()            # hf_model is plain again
    return folder


def merged_reference(hf_model, adapter: Path):
    """A copy of `hf_model` with `adapter` merged into its weights by peft (hf_model is left as it is)."""
    import copy

    import peft
    return peft.PeftModel.from_pretrained(copy.deepcopy(hf_model), str(adapter)).merge_and_unload().eval()
