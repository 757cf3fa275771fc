"""The int8 linear method (an opt-in CPU speed mode): close to fp32 per layer, and a model run with it
still answers sensibly."""
from __future__ import annotations

import pytest
import torch

from gpu_worker.layers.linear import Linear
from gpu_worker.quantization import linear_method, set_linear_method
from pagedserve import LLM, SamplingParams

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_int8_linear_is_close_to_fp32(rows):
    torch.manual_seed(0)
    ref = Linear(96, {"a": 64, "b": 32}, bias=True)
    ref.weight.data.normal_(0, 0.1)
    ref.bias.data.normal_(0, 0.1)
    q = Linear(96, {"a": 64, "b": 32}, bias=True, method=linear_method("int8"))
    q.weight.data.copy_(ref.weight)
    q.bias.data.copy_(ref.bias)
    q.method.process_weights_after_loading(q)
    x = torch.randn(rows, 96)
    want, got = ref(x), q(x)
    rel = (got - want).norm() / want.norm()
    assert rel < 0.02, f"relative error {rel:.4f}"
    assert not torch.equal(got, want), "the int8 path must really quantize"


def test_unknown_quantization_is_refused():
    with pytest.raises(ValueError, match="unknown quantization"):
        set_linear_method(Linear(2, 2), "fp4")


def test_int8_model_still_answers(tiny_model):
    """Greedy tokens of a small model mostly agree with fp32 (quantization noise flips some near-ties)."""
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [100, 200, 300, 400], [5] * 20]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = {}
    for q in ("none", "int8"):
        llm = LLM(str(tiny_model("llama")), dtype="float32", kv_cache_memory=0.01, swap_space=0, quantization=q)
        outs[q] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    first = [a[0] == b[0] for a, b in zip(outs["none"], outs["int8"])]
    assert sum(first) >= 2, (outs["none"], outs["int8"])
