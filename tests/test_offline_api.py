"""End to end through the offline `LLM` API on a tiny random-weight Llama built at test time, with
Hugging Face transformers (fp32) as the reference for logprobs, plus one chat turn on the default model.

The random model's logits are nearly flat (std ~0.16 over a 49k vocabulary), so greedy outputs rarely
repeat on their own; penalty tests first make one token dominant with a modest logit_bias, which gives a
repetitive baseline for the penalties to break up.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.llm import CompletionOutput, RequestOutput
from loadtest.tiny_model import build_tiny_model

pytestmark = pytest.mark.slow

PROMPT_TEXT = "The quick brown fox jumps over the lazy dog."
OTHER_TEXTS = [
    "In a small river town, the history of the mill began with a flood",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Paris is the capital of",
    "1, 2, 3, 4, 5, 6, 7, 8",
    "Once upon a time there was a king who had three daughters.",
    "你好，世界！",
    "a",
]
LOGPROB_TOL = 1e-4
DOMINANT = 1000          # a token id made the greedy choice by DOMINANT_BIAS in the penalty tests
DOMINANT_BIAS = 0.9


@dataclass
class Tiny:
    folder: Path
    tokenizer: object
    hf_model: torch.nn.Module
    llm: LLM
    prompt: list[int]
    others: list[list[int]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> Tiny:
    from transformers import AutoModelForCausalLM
    tokenizer = default_tokenizer
    folder = build_tiny_model(tmp_path_factory.mktemp("tiny-llama-offline"), "llama", tokenizer, widen=False,
                              max_position_embeddings=512)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(model=str(folder), dtype="float32", kv_cache_memory=0.02, swap_space=0)
    return Tiny(folder, tokenizer, model, llm, tokenizer.encode(PROMPT_TEXT),
                [tokenizer.encode(t) for t in OTHER_TEXTS])


def run(llm: LLM, prompt: list[int], **params) -> RequestOutput:
    return llm.generate(prompt, SamplingParams(**params), use_tqdm=False)[0]


def one(llm: LLM, prompt: list[int], **params) -> CompletionOutput:
    out = run(llm, prompt, **params)
    assert len(out.outputs) == 1
    return out.outputs[0]


@pytest.fixture(scope="module")
def greedy(tiny: Tiny) -> CompletionOutput:
    """The reference greedy continuation of the main prompt (24 tokens, eos ignored)."""
    return one(tiny.llm, tiny.prompt, temperature=0.0, max_tokens=24, ignore_eos=True)


def hf_log_softmax(tiny: Tiny, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] log_softmax of the HF model's logits at every position of `ids`."""
    with torch.no_grad():
        logits = tiny.hf_model(torch.tensor([ids])).logits[0].float()
    return logits.log_softmax(-1)


def assert_record_matches(rec, ref: torch.Tensor, token: int, k: int) -> None:
    """One Logprob record (chosen, rank, top_ids, top_vals) against a reference log_softmax row."""
    chosen, rank, top_ids, top_vals = rec
    assert chosen == pytest.approx(ref[token].item(), abs=LOGPROB_TOL)
    # rank up to float near-ties
    lo = int((ref > ref[token] + LOGPROB_TOL).sum()) + 1
    hi = int((ref > ref[token] - LOGPROB_TOL).sum()) + 1
    assert lo <= rank <= hi
    assert len(top_ids) == len(top_vals) == k
    assert top_vals == pytest.approx(ref.topk(k).values.tolist(), abs=LOGPROB_TOL)
    for tid, tv in zip(top_ids, top_vals):
        assert ref[tid].item() == pytest.approx(tv, abs=LOGPROB_TOL)


# ---- seeds and n --------------------------------------------------------------------------------------
SEEDED = dict(temperature=0.8, top_p=0.9, seed=1234, max_tokens=16)


def test_seeded_request_is_identical_alone_and_in_a_batch(tiny: Tiny) -> None:
    alone = one(tiny.llm, tiny.prompt, **SEEDED).token_ids
    assert len(alone) == 16 or alone[-1] == tiny.tokenizer.eos_token_id
    assert one(tiny.llm, tiny.prompt, **SEEDED).token_ids == alone       # and again, alone

    prompts: list[list[int]] = []
    params: list[SamplingParams] = []
    for i in range(32):
        prompts.append(tiny.others[i % len(tiny.others)] if i % 4 else tiny.prompt)   # some share its prompt
        params.append(SamplingParams(temperature=[0.0, 0.5, 1.0, 1.3][i % 4], top_p=[1.0, 0.8][i % 2],
                                     top_k=[-1, 20, -1][i % 3], seed=None if i % 3 == 0 else 1000 + i,
                                     presence_penalty=0.5 if i % 5 == 0 else 0.0, max_tokens=2 + i % 7,
                                     logprobs=2 if i % 7 == 0 else None))
    position = 13
    batch_prompts = prompts[:position] + [tiny.prompt] + prompts[position:]
    batch_params = params[:position] + [SamplingParams(**SEEDED)] + params[position:]
    outs = tiny.llm.generate(batch_prompts, batch_params, use_tqdm=False)
    assert outs[position].outputs[0].token_ids == alone
    assert all(o.outputs[0].finish_reason in ("stop", "length") and o.outputs[0].token_ids for o in outs)


def test_different_seeds_and_unseeded_requests_differ(tiny: Tiny) -> None:
    params = dict(temperature=1.0, max_tokens=3, ignore_eos=True)
    by_seed = {one(tiny.llm, tiny.prompt, seed=s, **params).token_ids[0] for s in range(6)}
    assert len(by_seed) > 1
    unseeded = [one(tiny.llm, tiny.prompt, **params).token_ids for _ in range(4)]
    assert any(u != unseeded[0] for u in unseeded[1:])


def test_n_choices_are_independent_and_reproducible_with_a_seed(tiny: Tiny) -> None:
    out = run(tiny.llm, tiny.prompt, n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    tokens = [c.token_ids for c in out.outputs]
    assert all(len(t) == 10 for t in tokens)
    assert all(c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(t) for t in tokens}) == 3
    assert [c.text for c in out.outputs] == [tiny.tokenizer.decode(t) for t in tokens]
    again = run(tiny.llm, tiny.prompt, n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    assert [c.token_ids for c in again.outputs] == tokens


def test_n_greedy_choices_all_equal_the_greedy_output(tiny: Tiny, greedy: CompletionOutput) -> None:
    out = run(tiny.llm, tiny.prompt, n=2, temperature=0.0, max_tokens=24, ignore_eos=True)
    assert len(out.outputs) == 2
    for c in out.outputs:
        assert c.token_ids == greedy.token_ids
        assert c.text == greedy.text


# ---- logprobs -----------------------------------------------------------------------------------------
def test_sample_logprobs_match_hf(tiny: Tiny) -> None:
    c = one(tiny.llm, tiny.prompt, temperature=0.8, seed=99, max_tokens=10, ignore_eos=True, logprobs=5)
    assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids) == 10
    ref = hf_log_softmax(tiny, tiny.prompt + c.token_ids)
    n = len(tiny.prompt)
    for i, (tok, rec) in enumerate(zip(c.token_ids, c.logprobs)):    # one record per generated token
        assert_record_matches(rec, ref[n - 1 + i], tok, 5)


def test_greedy_logprobs_have_rank_one(tiny: Tiny, greedy: CompletionOutput) -> None:
    c = one(tiny.llm, tiny.prompt, temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    assert c.token_ids == greedy.token_ids[:6]
    ref = hf_log_softmax(tiny, tiny.prompt + c.token_ids)
    for i, (tok, rec) in enumerate(zip(c.token_ids, c.logprobs)):
        assert_record_matches(rec, ref[len(tiny.prompt) - 1 + i], tok, 0)
        assert rec[1] == 1
    assert one(tiny.llm, tiny.prompt, temperature=0.0, max_tokens=2).logprobs is None


def check_prompt_logprobs(tiny: Tiny, prompt: list[int], out: RequestOutput, k: int) -> None:
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == len(prompt)
    assert plp[0] is None
    ref = hf_log_softmax(tiny, prompt)
    for i in range(1, len(prompt)):
        assert_record_matches(plp[i], ref[i - 1], prompt[i], k)


def test_prompt_logprobs_match_hf(tiny: Tiny) -> None:
    out = run(tiny.llm, tiny.prompt, temperature=0.0, max_tokens=2, prompt_logprobs=3)
    check_prompt_logprobs(tiny, tiny.prompt, out, 3)
    # the same prompt again (its blocks are now in the prefix cache) reports the same values
    again = run(tiny.llm, tiny.prompt, temperature=0.0, max_tokens=2, prompt_logprobs=3)
    check_prompt_logprobs(tiny, tiny.prompt, again, 3)
    assert run(tiny.llm, tiny.prompt, temperature=0.0, max_tokens=2).prompt_logprobs is None


def test_prompt_logprobs_across_prefill_chunks(tiny: Tiny) -> None:
    """A prompt longer than the token budget is prefilled in chunks; records stay one per prompt token."""
    llm = LLM(model=str(tiny.folder), dtype="float32", kv_cache_memory=0.02, swap_space=0,
              max_num_batched_tokens=16, block_size=8)
    prompt = tiny.tokenizer.encode(" ".join(OTHER_TEXTS))
    assert len(prompt) > 40
    out = llm.generate([prompt, tiny.prompt], SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2),
                       use_tqdm=False)
    check_prompt_logprobs(tiny, prompt, out[0], 2)
    check_prompt_logprobs(tiny, tiny.prompt, out[1], 2)


def test_prompt_logprobs_survive_preemption_by_recompute(tiny: Tiny) -> None:
    """A recomputed prompt reports its records again; the output keeps exactly one per prompt token."""
    llm = LLM(model=str(tiny.folder), dtype="float32", num_gpu_blocks=8, block_size=4, swap_space=0)
    prompts = [tiny.tokenizer.encode("The quick brown fox jumps over"), tiny.tokenizer.encode("In a small river town")]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=1),
                        use_tqdm=False)
    assert llm.stats.num_recompute_preemptions >= 1
    for prompt, out in zip(prompts, outs):
        check_prompt_logprobs(tiny, prompt, out, 1)


def test_one_token_prompt_has_a_single_none_prompt_logprob(tiny: Tiny) -> None:
    out = run(tiny.llm, tiny.prompt[:1], temperature=0.0, max_tokens=2, prompt_logprobs=2)
    assert out.prompt_logprobs == [None]


# ---- stopping -----------------------------------------------------------------------------------------
def test_stop_string_truncates_text(tiny: Tiny, greedy: CompletionOutput) -> None:
    text = greedy.text
    mid = len(text) // 2
    stop = next(text[i:i + 3] for i in range(mid, len(text) - 3) if text[i:i + 3].strip() == text[i:i + 3])
    cut = text.index(stop)
    c = one(tiny.llm, tiny.prompt, temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])
    assert c.finish_reason == "stop"
    assert c.stop_reason == stop
    assert c.text == text[:cut]
    assert c.token_ids == greedy.token_ids[:len(c.token_ids)]
    assert len(c.token_ids) < len(greedy.token_ids)
    kept = one(tiny.llm, tiny.prompt, temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop],
               include_stop_str_in_output=True)
    assert kept.text == text[:cut + len(stop)]


def test_stop_token_id_ends_with_that_id(tiny: Tiny, greedy: CompletionOutput) -> None:
    stop_id = greedy.token_ids[5]
    first = greedy.token_ids.index(stop_id)
    c = one(tiny.llm, tiny.prompt, temperature=0.0, max_tokens=24, stop_token_ids=[stop_id])
    assert c.finish_reason == "stop"
    assert c.stop_reason == stop_id
    assert c.token_ids == greedy.token_ids[:first + 1]


def test_max_tokens_gives_length(tiny: Tiny) -> None:
    for max_tokens in (1, 7):
        c = one(tiny.llm, tiny.prompt, temperature=1.0, seed=3, max_tokens=max_tokens, ignore_eos=True)
        assert c.finish_reason == "length"
        assert c.stop_reason is None
        assert len(c.token_ids) == max_tokens


def test_eos_stops_unless_ignored(tiny: Tiny) -> None:
    eos = tiny.tokenizer.eos_token_id
    force_eos = {eos: 100.0}
    c = one(tiny.llm, tiny.prompt, temperature=0.0, max_tokens=8, logit_bias=force_eos)
    assert (c.token_ids, c.finish_reason, c.stop_reason) == ([eos], "stop", None)
    c = one(tiny.llm, tiny.prompt, temperature=0.0, max_tokens=8, logit_bias=force_eos, ignore_eos=True)
    assert (c.token_ids, c.finish_reason) == ([eos] * 8, "length")


def test_min_tokens_defers_eos_and_stop_ids(tiny: Tiny, greedy: CompletionOutput) -> None:
    eos = tiny.tokenizer.eos_token_id
    c = one(tiny.llm, tiny.prompt, temperature=0.0, max_tokens=8, logit_bias={eos: 100.0}, min_tokens=3)
    assert len(c.token_ids) == 4 and eos not in c.token_ids[:3] and c.token_ids[3] == eos
    assert c.finish_reason == "stop"
    first = greedy.token_ids[0]
    assert one(tiny.llm, tiny.prompt, temperature=0.0, max_tokens=8, stop_token_ids=[first]).token_ids == [first]
    c = one(tiny.llm, tiny.prompt, temperature=0.0, max_tokens=8, stop_token_ids=[first], min_tokens=4)
    assert len(c.token_ids) >= 4
    assert first not in c.token_ids[:4]
    assert c.finish_reason == "length" or (c.token_ids[-1] == first and c.stop_reason == first)


# ---- penalties and bias ------------------------------------------------------------------------------
def dominated(tiny: Tiny, prompt: list[int] | None = None, **penalty) -> list[int]:
    """Greedy output while DOMINANT is pushed up by DOMINANT_BIAS (so it repeats unless penalised)."""
    return one(tiny.llm, prompt or tiny.prompt, temperature=0.0, max_tokens=10, ignore_eos=True,
               logit_bias={DOMINANT: DOMINANT_BIAS}, **penalty).token_ids


def test_penalties_break_up_a_repeated_token(tiny: Tiny) -> None:
    base = dominated(tiny)
    assert base.count(DOMINANT) >= 8              # without penalties it repeats
    for penalty in (dict(presence_penalty=2.0), dict(frequency_penalty=2.0), dict(repetition_penalty=2.0)):
        out = dominated(tiny, **penalty)
        assert out != base, penalty
        assert out[0] == DOMINANT, penalty        # nothing is penalised before it is generated once
        assert out.count(DOMINANT) <= 2, (penalty, out)
    mild = dominated(tiny, frequency_penalty=0.1).count(DOMINANT)
    assert 1 < mild < base.count(DOMINANT)       # a frequency penalty grows with the count


def test_repetition_penalty_also_counts_prompt_tokens(tiny: Tiny) -> None:
    prompt = tiny.prompt + [DOMINANT]
    assert dominated(tiny, prompt, presence_penalty=2.0)[0] == DOMINANT      # presence: output tokens only
    assert DOMINANT not in dominated(tiny, prompt, repetition_penalty=2.0)[:1]


def test_logit_bias_forces_a_token(tiny: Tiny, greedy: CompletionOutput) -> None:
    forced = 4242
    assert forced not in greedy.token_ids
    c = one(tiny.llm, tiny.prompt, temperature=0.0, max_tokens=5, ignore_eos=True, logit_bias={forced: 100.0})
    assert c.token_ids == [forced] * 5
    c = one(tiny.llm, tiny.prompt, temperature=1.5, seed=5, max_tokens=5, ignore_eos=True, logit_bias={forced: 100.0})
    assert c.token_ids == [forced] * 5
    # a strong negative bias removes the greedy choice
    c = one(tiny.llm, tiny.prompt, temperature=0.0, max_tokens=1, logit_bias={greedy.token_ids[0]: -100.0})
    assert c.token_ids[0] != greedy.token_ids[0]


# ---- the default model --------------------------------------------------------------------------------
def test_chat_on_the_default_model_knows_paris() -> None:
    llm = LLM(kv_cache_memory=0.1, swap_space=0)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
    assert len(out) == 1
    assert out[0].prompt is not None and "What is the capital of France?" in out[0].prompt
    assert "Paris" in out[0].outputs[0].text, out[0].outputs[0].text


# ---- vLLM's forms ------------------------------------------------------------------------------------
def test_min_tokens_holds_back_eos_even_with_ignore_eos(tiny: Tiny) -> None:
    """vLLM and HF's min_new_tokens mask EOS until min_tokens whatever ignore_eos says."""
    eos = tiny.tokenizer.eos_token_id
    c = one(tiny.llm, tiny.prompt, temperature=0.0, max_tokens=6, logit_bias={eos: 100.0}, min_tokens=3,
            ignore_eos=True)
    assert eos not in c.token_ids[:3] and c.token_ids[3:] == [eos] * 3 and c.finish_reason == "length"


def test_vllm_prompt_dicts(tiny: Tiny, greedy: CompletionOutput) -> None:
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    text = tiny.tokenizer.decode(tiny.prompt)
    outs = tiny.llm.generate([{"prompt_token_ids": tiny.prompt}, {"prompt": text}, text], sp, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == greedy.token_ids
    assert outs[1].outputs[0].token_ids == outs[2].outputs[0].token_ids and outs[1].prompt == text
    with pytest.raises(ValueError, match="multi_modal_data"):
        tiny.llm.generate({"prompt": text, "multi_modal_data": {}}, sp, use_tqdm=False)


def test_generation_config_defaults_when_no_params_are_given(tiny: Tiny, greedy: CompletionOutput,
                                                             tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.0, "max_new_tokens": 5}')
    llm = LLM(str(tiny.folder), generation_config=str(tmp_path), kv_cache_memory=0.05, swap_space=0)
    assert llm.get_default_sampling_params().max_tokens == 5
    out = llm.generate({"prompt_token_ids": tiny.prompt}, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == greedy.token_ids[:5]


def test_colliding_block_digests_never_serve_another_prompts_kv(tiny: Tiny, monkeypatch) -> None:
    """Issue #14: every block digest forced to one value (a forged collision). A second prompt whose
    blocks all collide with the first's must get no cached tokens and its own output (as computed with
    prefix caching off); the first prompt sent again still hits its blocks and reproduces its output."""
    from scheduler import block_hash
    monkeypatch.setattr(block_hash, "_digest_fn", lambda algo: (lambda data: b"\x5a" * 32))
    llm = LLM(model=str(tiny.folder), dtype="float32", kv_cache_memory=0.02, swap_space=0, block_size=16)
    a = tiny.tokenizer.encode(" ".join(OTHER_TEXTS[:3]))[:40]
    b = list(reversed(a))           # the same tokens, so the same length, in other blocks
    ref = LLM(model=str(tiny.folder), dtype="float32", kv_cache_memory=0.02, swap_space=0, block_size=16,
              enable_prefix_caching=False)
    want_a, want_b = (run(ref, p, max_tokens=8, temperature=0).outputs[0].token_ids for p in (a, b))
    first, second, again = (run(llm, p, max_tokens=8, temperature=0) for p in (a, b, a))
    assert second.num_cached_tokens == 0
    assert again.num_cached_tokens == 32
    assert first.outputs[0].token_ids == want_a == again.outputs[0].token_ids
    assert second.outputs[0].token_ids == want_b


def test_chat_renders_tools_and_continues_a_final_message(tiny: Tiny) -> None:
    """vLLM's LLM.chat(tools=..., continue_final_message=...): the template sees the tools; the last
    assistant turn is continued rather than closed."""
    template = ("{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
                "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% if not loop.last %}</>{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}</><assistant>{% endif %}")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    out = tiny.llm.chat([{"role": "user", "content": "Hi"}], sp, use_tqdm=False, chat_template=template, tools=tools)
    assert out[0].prompt == "[tool get_weather]<user>Hi</><assistant>"
    out = tiny.llm.chat([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}], sp,
                        use_tqdm=False, chat_template=template, add_generation_prompt=False,
                        continue_final_message=True)
    assert out[0].prompt.endswith("<assistant>Hel") and len(out[0].outputs[0].token_ids) == 2
