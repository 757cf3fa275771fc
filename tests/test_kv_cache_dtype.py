"""--kv-cache-dtype: an fp8 cache holds twice bf16's blocks in the same memory, every engine variant
(prefix caching, chunked prefill, block sizes, preemption by swap and by recompute) gives the fp8 engine's
own outputs, and on the default model the next-token choice stays that of an fp32 cache."""
from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, SamplingParams
from tests.test_correctness import ENGINE_VARIANTS, prompt_ids, run_greedy
from tests.test_gguf_model import ENGINE_CORE_TEXTS



@pytest.mark.unit
def test_an_unknown_kv_cache_dtype_fails_the_cli_at_once(capsys):
    from pagedserve.cli import main
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--kv-cache-dtype", "fp4"])
    assert exc.value.code == 2
    assert "--kv-cache-dtype 'fp4': expected one of auto, float32, bfloat16, float16, fp8" in capsys.readouterr().err


@pytest.mark.slow
def test_fp8_holds_twice_the_blocks_of_bf16(tiny_model):
    blocks = {kv: LLM(str(tiny_model("llama")), dtype="float32", kv_cache_memory=0.02, swap_space=0,
                      kv_cache_dtype=kv).engine.num_blocks for kv in ("bfloat16", "fp8", "fp8_e5m2", "auto")}
    assert blocks["fp8"] == blocks["fp8_e5m2"], blocks
    # the budget over a block's bytes, rounded down: twice (four times) the blocks, give or take the rounding
    assert 0 <= blocks["fp8"] - 2 * blocks["bfloat16"] <= 1 and 0 <= blocks["fp8"] - 4 * blocks["auto"] <= 3, blocks


@pytest.fixture(scope="module")
def fp8_case(tiny_model, default_tokenizer):
    folder = str(tiny_model("llama"))
    prompts = prompt_ids(default_tokenizer)
    base = LLM(folder, dtype="float32", kv_cache_memory=0.02, swap_space=0, kv_cache_dtype="fp8",
               enable_prefix_caching=False)
    return folder, prompts, [o.outputs[0].token_ids for o in run_greedy(base, prompts)]


VARIANTS = {**ENGINE_VARIANTS,
            "recompute": dict(num_gpu_blocks=12, swap_space=0, enable_prefix_caching=False),
            "swap": dict(num_gpu_blocks=12, swap_space=0.001, enable_prefix_caching=False)}


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_fp8_engine_variants_agree(variant, fp8_case):
    folder, prompts, want = fp8_case
    kwargs = dict(dtype="float32", kv_cache_memory=0.02, swap_space=0, kv_cache_dtype="fp8") | VARIANTS[variant]
    if variant == "budget-1":
        prompts, want = prompts[:3], want[:3]
    llm = LLM(folder, **kwargs)
    outs = run_greedy(llm, prompts)
    assert [o.outputs[0].token_ids for o in outs] == want
    if variant == "prefix-caching-on":
        assert llm.stats.prefix_cache_hits > 0
        assert [o.outputs[0].token_ids for o in run_greedy(llm, prompts)] == want
    if variant in ("recompute", "swap"):
        st = llm.stats
        assert (st.num_swap_preemptions if variant == "swap" else st.num_recompute_preemptions) > 0


# Measured here (2026-12-05) with rotation, centres (position 0 its own), gains, start-up scales
# (layers/kv_rotation.py) and keys rounded with error feedback (attention/fp8_feedback.py): e4m3 249, e5m2 243
# and e4m3 with --calculate-kv-scales 247 of 256 positions (97.3%, 94.9%, 96.5%; with nearest rounding 245, 248,
# 248). The whole-workload figures and #9's 97% are in loadtest/results/fp8_kv_feedback_served_2026-12-05.txt;
# these bounds guard what we have, a few positions below.
TOP1_FLOOR = {("fp8", False): 0.955, ("fp8_e5m2", False): 0.94, ("fp8", True): 0.955}


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype,calculate", list(TOP1_FLOOR))
def test_fp8_top_token_agreement_with_an_fp32_cache(default_tokenizer, kv_dtype, calculate):
    """Teacher-forced on the engine-core prompts and 32 tokens of the fp32 engine's own greedy
    continuation: how often the most likely next token is the fp32 cache's."""
    prompts = [default_tokenizer.encode(t) for t in ENGINE_CORE_TEXTS]
    ref = LLM(dtype="float32", kv_cache_memory=0.1, swap_space=0)
    cont = ref.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    forced = [p + o.outputs[0].token_ids for p, o in zip(prompts, cont)]
    sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    fp8 = LLM(dtype="float32", kv_cache_memory=0.1, swap_space=0, kv_cache_dtype=kv_dtype,
              calculate_kv_scales=calculate)
    top, lps = {}, {}
    for name, llm in (("fp32", ref), ("fp8", fp8)):
        outs = llm.generate(forced, sp, use_tqdm=False)
        top[name] = [[rec[2][0] for rec in o.prompt_logprobs[len(p):]] for o, p in zip(outs, prompts)]
        lps[name] = [rec[0] for o, p in zip(outs, prompts) for rec in o.prompt_logprobs[len(p):]]
    pairs = [(a, b) for ra, rb in zip(top["fp32"], top["fp8"]) for a, b in zip(ra, rb)]
    agree = sum(a == b for a, b in pairs) / len(pairs)
    assert len(pairs) == 8 * 32
    print(f"{kv_dtype} calculate={calculate}: top-1 agreement {agree:.2%} ({sum(a == b for a, b in pairs)} of {len(pairs)})")
    assert agree >= TOP1_FLOOR[kv_dtype, calculate], f"top-1 agreement {agree:.1%}"
    assert max(abs(a - b) for a, b in zip(lps["fp32"], lps["fp8"])) > 1e-3, "the fp8 cache must really round"
    # set by the start-up calibration pass (the calibration text's largest entries at a quarter of the
    # format's range), or with --calculate-kv-scales by the first real step: never left at 1
    scales = [(layer.self_attn.k_scale, layer.self_attn.v_scale) for layer in fp8.engine.executor.runner.model.layers]
    assert all(k != 1.0 and v != 1.0 for k, v in scales)


@pytest.mark.slow
def test_calculated_kv_scales_come_from_the_first_forward_pass(tiny_model):
    """The scales put the first batch's largest |K| and |V| at e4m3's 448, are kept after it, and the
    same first batch gives the same scales and outputs."""
    prompts = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22]]
    runs = []
    for _ in range(2):
        llm = LLM(str(tiny_model("llama")), dtype="float32", kv_cache_memory=0.02, swap_space=0,
                  kv_cache_dtype="fp8", calculate_kv_scales=True)
        attn = llm.engine.executor.runner.model.layers[0].self_attn
        seen = {}
        hook = attn.qkv_proj.register_forward_hook(lambda m, i, o: [seen.setdefault("kv", m.split(o)[1:])] and None)
        out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        hook.remove()
        k, v = seen["kv"]
        runs.append(([o.outputs[0].token_ids for o in out], attn.k_scale, attn.v_scale))
        assert attn.kv_calibration_max is None
        # fp8 caches hold V centred (each prompt's first row around its own centre) and rotated
        first = torch.tensor([i == 0 for p in prompts for i in range(len(p))])
        v3 = v.reshape(v.shape[0], -1, attn.head_dim)
        rotated = attn.kv_centres.apply(torch.zeros_like(v3), torch.zeros_like(v3), v3, first, attn.kv_rotation)[2]
        assert attn.v_scale == pytest.approx(float(rotated.abs().max()) / 448, rel=1e-5)
        assert 0 < attn.k_scale != 1.0      # K is taken after rope, so not the raw projection's amax
    assert runs[0] == runs[1]


@pytest.mark.slow
def test_checkpoint_kv_scales_are_loaded_and_used(tiny_model, tmp_path):
    """Per-layer k/v scales from the checkpoint (`self_attn.k_scale` / `v_scale`) reach the attention
    layers and the engine runs with them (what a scaled fp8 cache stores: test_triton_attention)."""
    import shutil

    import torch
    from safetensors.torch import save_file
    folder = tmp_path / "scaled"
    shutil.copytree(tiny_model("llama"), folder)
    scales = {f"model.layers.{i}.self_attn.{n}": torch.tensor(s) for i in range(2)
              for n, s in (("k_scale", 0.5 + i), ("v_scale", 2.0))}
    save_file(scales, str(folder / "kv_scales.safetensors"))
    llm = LLM(str(folder), dtype="float32", kv_cache_memory=0.02, swap_space=0, kv_cache_dtype="fp8")
    runner = llm.engine.executor.runner
    attn = [layer.self_attn for layer in runner.model.layers]
    assert [(a.k_scale, a.v_scale) for a in attn[:2]] == [(0.5, 2.0), (1.5, 2.0)]
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
