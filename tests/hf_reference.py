"""Hugging Face transformers as the correctness reference: greedy generate with per-step logits."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class HFGreedy:
    token_ids: list[int]
    logprobs: list[torch.Tensor]     # per generated position: log_softmax over the vocabulary


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None) -> HFGreedy:
    model.generation_config.eos_token_id = eos_token_id    # None: run to max_new_tokens, like ignore_eos
    with torch.no_grad():
        dev = model.device
        out = model.generate(torch.tensor([prompt_ids], device=dev),
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long, device=dev),
                             do_sample=False, max_new_tokens=max_new_tokens,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True,
                             temperature=None, top_p=None, top_k=None)
    gen = out.sequences[0, len(prompt_ids):].tolist()
    return HFGreedy(gen, [lg[0].float().cpu().log_softmax(-1) for lg in out.logits][:len(gen)])


@dataclass
class Comparison:
    exact: bool
    flips: int            # near-tie flips accepted by the top-5 rule
    max_logprob_err: float


def compare_greedy(ours: list[int], our_logprobs: list[float] | None, ref: HFGreedy, top: int = 5) -> Comparison:
    """Token-for-token equality; at a first mismatch our token must be in HF's top-5 there (a near-tie
    flipped by float noise), after which the sequences legitimately diverge and comparison stops."""
    max_err = 0.0
    for i, (a, b) in enumerate(zip(ours, ref.token_ids)):
        if our_logprobs is not None:
            max_err = max(max_err, abs(our_logprobs[i] - float(ref.logprobs[i][a])))
        if a != b:
            top_ids = ref.logprobs[i].topk(top).indices.tolist()
            assert a in top_ids, f"position {i}: ours {a} not in HF top-{top} {top_ids} (HF chose {b})"
            return Comparison(False, 1, max_err)
    assert len(ours) == len(ref.token_ids), f"lengths differ: ours {len(ours)}, HF {len(ref.token_ids)}"
    return Comparison(True, 0, max_err)


def assert_mostly_identical(outs: list, refs: list, min_share: float = 0.75) -> None:
    """Two runs' RequestOutputs (the reference's with logprobs=5): greedy tokens identical on at least
    `min_share` of the prompts, and where they differ, the first divergence is a near-tie (our token in
    the reference's top-5 there)."""
    identical = 0
    for a, b in zip(outs, refs, strict=True):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        if ta == tb:
            identical += 1
            continue
        i = next(i for i, (x, y) in enumerate(zip(ta, tb)) if x != y)
        assert ta[i] in b.outputs[0].logprobs[i], f"position {i}: {ta[i]} not in the reference's top-5"
    assert identical >= min_share * len(refs), f"{identical} of {len(refs)} identical"
