"""Adapters made with peft at test time, served by the offline engine, against Hugging Face with each
adapter merged into the weights by peft: greedy output identical (fp32) under each adapter alone, in
batches that mix adapters and the base model, with one slot shared by two adapters, and with the
prefix cache on (hits within an adapter, none across)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from common.model_source import ModelSource
from loadtest.lora_adapters import build_adapter, merged_reference
from pagedserve import LLM, LoRARequest, SamplingParams
from tests.hf_reference import assert_mostly_identical, hf_greedy

pytestmark = pytest.mark.slow

TEXTS = ["The history of the printing press", "My favourite recipe for apple pie is", "Once upon a time, in a land",
         "Machine learning is"]
MAX_TOKENS = 16
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@dataclass
class Served:
    """A base model, two adapters (different ranks and target sets) and the HF references."""
    base: Path
    loras: dict[str, LoRARequest]
    prompts: list[list[int]]
    expected: dict[str | None, list[list[int]]]     # adapter name (None: base) -> HF greedy per prompt
    engine: dict
    models: dict                                    # adapter name (None: base) -> the HF reference model


def make_served(tmp: Path, base: Path, hf_base, prompts: list[list[int]], std: float, **engine) -> Served:
    a1 = build_adapter(hf_base, tmp / "a1", 8, ("q_proj", "v_proj", "down_proj"), seed=1, std=std)
    a2 = build_adapter(hf_base, tmp / "a2", 16, ("k_proj", "o_proj", "gate_proj", "up_proj"), seed=2, std=std,
                       use_rslora=True)
    loras = {"a1": LoRARequest("a1", 1, str(a1)), "a2": LoRARequest("a2", 2, str(a2))}
    refs = {None: hf_base, **{n: merged_reference(hf_base, Path(r.lora_path)) for n, r in loras.items()}}
    expected = {n: [hf_greedy(m, p, MAX_TOKENS, None).token_ids for p in prompts] for n, m in refs.items()}
    for name in loras:
        assert expected[name] != expected[None], f"adapter {name} does not change the output: the test is vacuous"
    return Served(base, loras, prompts, expected, engine, refs)


@pytest.fixture(scope="module")
def tiny_llama(tiny_model, default_tokenizer, tmp_path_factory) -> Served:
    from transformers import AutoModelForCausalLM
    base = tiny_model("llama")
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    prompts = [default_tokenizer.encode(t) for t in TEXTS]
    return make_served(tmp_path_factory.mktemp("lora-tiny"), base, hf, prompts, std=0.3, model=str(base))


@pytest.fixture(scope="module")
def default_model(default_tokenizer, tmp_path_factory) -> Served:
    from transformers import AutoModelForCausalLM
    src = ModelSource.resolve(None)
    hf = AutoModelForCausalLM.from_pretrained(str(src.path.parent), gguf_file=src.path.name,
                                              dtype=torch.float32).eval()
    prompts = [default_tokenizer.encode(t) for t in TEXTS]
    return make_served(tmp_path_factory.mktemp("lora-default"), src.path, hf, prompts, std=0.05,
                       quantization="none")


def llm_for(s: Served, **kw) -> LLM:
    opts = dict(dtype="float32", kv_cache_memory=0.05, swap_space=0, enable_lora=True, max_loras=2, **s.engine)
    opts.update(kw)
    return LLM(**opts)


def generate(llm: LLM, s: Served, names: list[str | None]) -> list[list[int]]:
    """Prompt i % len(prompts) under adapter names[i], all in one batch."""
    prompts = [s.prompts[i % len(s.prompts)] for i in range(len(names))]
    outs = llm.generate(prompts, PARAMS, use_tqdm=False,
                        lora_request=[s.loras[n] if n else None for n in names])
    return [o.outputs[0].token_ids for o in outs]


def expected(s: Served, names: list[str | None]) -> list[list[int]]:
    return [s.expected[n][i % len(s.prompts)] for i, n in enumerate(names)]


@pytest.fixture(params=["tiny_llama", "default_model"])
def served(request) -> Served:
    return request.getfixturevalue(request.param)


def test_each_adapter_alone_and_mixed_with_the_base_model_matches_hf(served: Served) -> None:
    llm = llm_for(served)
    for name in ("a1", "a2"):
        alone = [name] * len(served.prompts)
        assert generate(llm, served, alone) == expected(served, alone), f"adapter {name} alone"
    mixed = ["a1", "a2", None] * len(served.prompts)
    assert generate(llm, served, mixed) == expected(served, mixed), "one batch mixing both adapters and the base"


def test_one_slot_serves_two_adapters_by_swapping(tiny_llama: Served) -> None:
    llm = llm_for(tiny_llama, max_loras=1)
    names = ["a1", "a2", None, "a2", "a1", None, "a1", "a2"]
    assert generate(llm, tiny_llama, names) == expected(tiny_llama, names)
    slots = llm.engine.scheduler.lora_slots
    keys = {n: llm.engine.loras.by_name[n].key for n in ("a1", "a2")}
    # first come, first served across adapters: a1, a2, a1, a2 took turns in slot 0
    assert slots.num_loads == 4 and dict(slots.slot_of) == {keys["a2"]: 0}
    assert generate(llm, tiny_llama, ["a1"]) == expected(tiny_llama, ["a1"])
    assert slots.num_loads == 5, "a1 came back into the slot"


def test_prefix_cache_hits_within_an_adapter_and_never_across(tiny_llama: Served) -> None:
    llm = llm_for(tiny_llama, block_size=4)
    long_prompt = tiny_llama.prompts[0] * 3
    runs = [("a1", "first"), ("a1", "same adapter"), ("a2", "other adapter"), (None, "base model")]
    cached = {}
    for name, what in runs:
        out = llm.generate([long_prompt], PARAMS, use_tqdm=False,
                           lora_request=tiny_llama.loras[name] if name else None)[0]
        cached[what] = out.num_cached_tokens
        ref = hf_greedy(tiny_llama.models[name], long_prompt, MAX_TOKENS, None).token_ids
        assert out.outputs[0].token_ids == ref, f"{what}: a cached block served the wrong KV"
    assert cached["first"] == 0 and cached["same adapter"] > 0
    assert cached["other adapter"] == 0 and cached["base model"] == 0


def test_adapters_over_the_kept_quantized_gguf_weights(default_model: Served) -> None:
    """The default model with its Q4_1 blocks kept (the LoRA method wraps the packed one) against the same
    adapters over the fp32-expanded weights: identical on at least 75% of prompts, a first divergence
    being a near-tie, as tests/test_gguf_model.py asks of the base model."""
    names = ["a1", "a2"] * len(default_model.prompts)
    kept = llm_for(default_model, quantization="auto")
    assert kept.engine.weight_bytes < 0.35 * 4 * 135e6, "the GGUF blocks were not kept"
    prompts = [default_model.prompts[i % len(default_model.prompts)] for i in range(len(names))]
    loras = [default_model.loras[n] for n in names]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    got = kept.generate(prompts, params, use_tqdm=False, lora_request=loras)
    ref = llm_for(default_model).generate(prompts, params, use_tqdm=False, lora_request=loras)
    assert_mostly_identical(got, ref, 0.75)


def test_an_adapter_the_worker_cannot_read_fails_only_its_requests(tiny_llama: Served, tmp_path: Path) -> None:
    """Registered (checked) while its folder was whole, then gone by the time a worker loads it, as when the
    worker sees another filesystem: its request ends with an error, the rest of the batch is exact, the
    name is no longer served, and the engine goes on."""
    import shutil
    from scheduler.admission import RequestRejected
    folder = shutil.copytree(tiny_llama.loras["a1"].lora_path, tmp_path / "vanishing")
    llm = llm_for(tiny_llama)
    llm.engine.load_lora(LoRARequest("vanishing", 0, str(folder)))
    (folder / "adapter_model.safetensors").unlink()
    outs = llm.generate(tiny_llama.prompts[:2], PARAMS, use_tqdm=False,
                        lora_request=[LoRARequest("vanishing"), tiny_llama.loras["a2"]])
    assert outs[0].outputs[0].finish_reason == "error"
    assert outs[1].outputs[0].token_ids == tiny_llama.expected["a2"][1]
    with pytest.raises(RequestRejected, match="does not exist"):
        llm.generate(tiny_llama.prompts[:1], PARAMS, use_tqdm=False, lora_request=LoRARequest("vanishing"))
    assert generate(llm, tiny_llama, ["a1", None]) == expected(tiny_llama, ["a1", None])
