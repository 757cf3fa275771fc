"""Speculative decoding with n-gram prompt lookup: the configuration, the proposer, output that is identical
with and without speculation (greedy, and seeded sampling) under every engine variant that changes how work
is split, the target distribution kept for unseeded sampling (chi-square), and the server path.

(The draft-model proposer, whose drafts are not deterministic and need the general rejection test, is not
built yet.)"""
from __future__ import annotations

import pytest

from common.speculative import SpeculativeConfig
from gpu_worker.model_runner import accepted_drafts
from gpu_worker.spec_decode.ngram import propose_ngram
from pagedserve import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
TEXTS = ["1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,", "The cat sat on the mat. The cat sat on the",
         "a b c a b c a b c a b", "def f(x):\n    return x + 1\n\ndef g(x):\n    return x + 2\n\ndef h(x):\n",
         "red green blue red green blue red", "Once upon a time", "你好，世界！你好，世界！", "x"]


# ---- configuration and proposer (unit) ----------------------------------------------------------------
@pytest.mark.unit
def test_config_parses_vllm_forms() -> None:
    assert SpeculativeConfig.parse(None) is None
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, '
                                '"prompt_lookup_max": 5}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 4, 2, 5)
    assert SpeculativeConfig.parse(NGRAM).num_speculative_tokens == 3


@pytest.mark.unit
@pytest.mark.parametrize("value,message", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "unknown method 'eagle'"),
    ({"method": "ngram", "num_speculative_tokens": 0}, ">= 1"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown field(s) lookahead"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "<="),
    ({"model": "/some/draft", "num_speculative_tokens": 2}, "not implemented yet"),
    ("[1, 2]", "JSON object"),
    ("{not json", "Expecting"),
])
def test_config_errors_are_clear(value, message) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SpeculativeConfig.parse(value)


@pytest.mark.unit
def test_bad_config_fails_the_cli_at_once() -> None:
    from pagedserve.cli import main
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": -1}'])
    assert exc.value.code == 2


@pytest.mark.unit
def test_ngram_proposes_what_followed_the_latest_longest_match() -> None:
    assert propose_ngram([1, 2, 3, 4, 5, 1, 2, 3], 2, 4, 3) == [4, 5, 1]
    assert propose_ngram([9, 1, 2, 8, 1, 2, 7, 5, 1, 2], 2, 2, 2) == [7, 5]      # latest of two matches
    assert propose_ngram([1, 2, 3, 9, 2, 3, 7, 1, 2, 3], 2, 3, 2) == [9, 2]      # longer match wins
    assert propose_ngram([1, 2, 3, 4], 1, 3, 2) == []                            # nothing repeats
    assert propose_ngram([5], 1, 3, 2) == []


@pytest.mark.unit
def test_accepted_drafts_is_the_confirmed_prefix() -> None:
    assert accepted_drafts([4, 5, 6], [4, 5, 9]) == 2
    assert accepted_drafts([4, 5, 6], [1, 5, 6]) == 0
    assert accepted_drafts([4, 5], [4, 5]) == 2
    assert accepted_drafts([], []) == 0


# ---- identical greedy output (slow) -------------------------------------------------------------------
def generate(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def tiny_case(tiny_model, default_tokenizer):
    folder = str(tiny_model("llama"))
    prompts = [default_tokenizer.encode(t) for t in TEXTS]
    return folder, prompts


def tiny_params(n: int) -> list[SamplingParams]:
    """Greedy with various lengths, a stop token, n = 2, and one seeded sampled request in the mix."""
    out = []
    for i in range(n):
        if i % 8 == 5:
            out.append(SamplingParams(temperature=0.8, seed=i, max_tokens=20, ignore_eos=True))
        elif i % 8 == 6:
            out.append(SamplingParams(temperature=0, n=2, max_tokens=24, ignore_eos=True))
        else:
            out.append(SamplingParams(temperature=0, max_tokens=12 + 5 * (i % 5), ignore_eos=True))
    return out


VARIANTS = {
    "default": {},
    "no-prefix-caching": {"enable_prefix_caching": False},
    "chunked-prefill-8": {"max_num_batched_tokens": 8},
    "recompute-preemption": {"num_gpu_blocks": 14, "swap_space": 0},
    "swap-preemption": {"num_gpu_blocks": 14, "swap_space": 0.05},
    "block-size-8": {"block_size": 8},
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_tiny_model_output_identical_with_ngram(tiny_case, variant) -> None:
    folder, base = tiny_case
    prompts = (base * 4)[:32]
    params = tiny_params(len(prompts))
    opts = {"dtype": "float32", "kv_cache_memory": 0.05, "swap_space": 0, **VARIANTS[variant]}
    ref = generate(LLM(folder, **{**opts, "num_gpu_blocks": None}), prompts, params)
    llm = LLM(folder, speculative_config=NGRAM, **opts)
    assert generate(llm, prompts, params) == ref
    st = llm.stats
    assert st.spec_num_drafts > 0 and 0 < st.spec_num_accepted_tokens < st.spec_num_draft_tokens
    if "preemption" in variant:
        kind = st.num_swap_preemptions if variant.startswith("swap") else st.num_recompute_preemptions
        assert kind > 0, "the variant must really preempt"


@pytest.mark.slow
def test_batch_of_one_identical_and_logprobs_agree(tiny_case) -> None:
    folder, prompts = tiny_case
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2)
    plain = LLM(folder, dtype="float32", kv_cache_memory=0.05, swap_space=0)
    spec = LLM(folder, dtype="float32", kv_cache_memory=0.05, swap_space=0, speculative_config=NGRAM)
    for p in prompts[:4]:
        a = plain.generate([p], sp, use_tqdm=False)[0].outputs[0]
        b = spec.generate([p], sp, use_tqdm=False)[0].outputs[0]
        assert a.token_ids == b.token_ids
        assert len(b.logprobs) == len(b.token_ids)
        for ra, rb in zip(a.logprobs, b.logprobs):
            assert ra[2] == rb[2] and ra[0] == pytest.approx(rb[0], abs=1e-4)
    assert spec.stats.spec_num_drafts > 0


@pytest.mark.slow
def test_default_model_identical_with_ngram_and_drafts_are_accepted() -> None:
    """SmolLM2 copying text and code: the same greedy answer with and without n-gram drafts, a quarter or more
    of the drafts accepted (measured: 48 of 133, 36%), and the per-position counts add up."""
    code = "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n"
    convs = [[{"role": "user", "content": "Repeat this text exactly: the quick brown fox jumps over the lazy dog, "
                                          "and the dog sleeps."}],
             [{"role": "user", "content": "Copy this code exactly, without comments:\n" + code}],
             [{"role": "user", "content": "List the numbers from 1 to 30, separated by commas."}]]
    sp = SamplingParams(temperature=0, max_tokens=64)

    def answers(llm: LLM) -> list[tuple[list[int], str]]:
        return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in llm.chat(convs, sp, use_tqdm=False)]
    ref = answers(LLM(None, kv_cache_memory=0.1, swap_space=0))
    spec = LLM(None, kv_cache_memory=0.1, swap_space=0, speculative_config=NGRAM)
    assert answers(spec) == ref
    st = spec.stats
    assert st.spec_num_accepted_tokens >= 0.25 * st.spec_num_draft_tokens, vars(st)
    assert sum(st.spec_accepted_per_pos) == st.spec_num_accepted_tokens and st.spec_accepted_per_pos[0] > 0


# ---- through the server (e2e) -------------------------------------------------------------------------
def spec_counters(url: str) -> dict[str, float] | None:
    """The spec-decode counters on /metrics, once the scheduler has reported some drafts."""
    import urllib.request
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    counts = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("pagedserve:spec_decode_num_") and "_total{" in line and "per_pos" not in line}
    return counts if counts.get("pagedserve:spec_decode_num_drafts_total") else None


@pytest.mark.e2e
def test_server_streams_accepted_drafts_and_counts_them(default_tokenizer, tmp_path) -> None:
    """`--speculative-config` as vLLM spells it, on the default model copying code: the stream carries several
    tokens in a chunk when drafts are accepted, its text equals the non-streamed answer, and the
    spec-decode counters move."""
    import json
    import urllib.request

    from tests.server_utils import run_server, wait_until
    code = "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n"
    body = {"messages": [{"role": "user", "content": "Copy this code exactly, without comments:\n" + code}],
            "max_tokens": 64, "temperature": 0}

    def post(payload: dict) -> bytes:
        req = urllib.request.Request(f"{srv.url}/v1/chat/completions", data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.read()
    with run_server("--kv-cache-memory", "0.1", "--swap-space", "0", "--num-threads", "1",
                    "--speculative-config", json.dumps(NGRAM), log_dir=tmp_path) as srv:
        full = json.loads(post(body))["choices"][0]["message"]["content"]
        events = [json.loads(line[6:]) for line in post({**body, "stream": True}).decode().splitlines()
                  if line.startswith("data: {")]
        counts = wait_until(lambda: spec_counters(srv.url), 10, "spec-decode counters on /metrics (sent every heartbeat)")
    texts = [e["choices"][0]["delta"].get("content", "") for e in events if e["choices"]]
    assert "".join(texts) == full and "return a * b" in full
    assert 0 < counts["pagedserve:spec_decode_num_accepted_tokens_total"] <= \
        counts["pagedserve:spec_decode_num_draft_tokens_total"]
    token_counts = [len(default_tokenizer.encode(t, add_special_tokens=False)) for t in texts]
    assert max(token_counts) > 1, "no chunk carried more than one token"


# ---- sampled requests keep the target distribution (slow, statistical) --------------------------------
# chi-square critical values at significance 0.001, by degrees of freedom
CHI2_CRIT_P001 = [None, 10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88, 29.59, 31.26, 32.91, 34.53,
                  36.12, 37.70]


def chi2_homogeneity(a: list, b: list) -> tuple[float, int]:
    """Pearson's statistic for 'both samples come from one distribution', and its degrees of freedom."""
    cats = sorted(set(a) | set(b))
    stat = 0.0
    for sample, other in ((a, b), (b, a)):
        for c in cats:
            pooled = (sample.count(c) + other.count(c)) / (len(a) + len(b))
            expected = pooled * len(sample)
            stat += (sample.count(c) - expected) ** 2 / expected
    return stat, len(cats) - 1


@pytest.mark.slow
def test_sampled_outputs_keep_the_target_distribution(tiny_case) -> None:
    """Unseeded sampling at temperature 1 over four tokens that the prompt repeats (so n-gram drafts exist
    and are partly accepted): the joint distribution of (token i-1, token i) at the first drafted position
    (output index 1) and at a later one (index 3) is the same with and without speculation, by a chi-square
    homogeneity test at significance 0.001 (up to 15 degrees of freedom) on 600 samples per arm. Pairs, not
    single tokens: a verifier that kept every draft makes token i a function of token i-1, which the
    marginal of token i alone can hide. Seeded requests are covered exactly by the identical-output tests
    above: a seed draws by output index, with or without drafts."""
    folder, _ = tiny_case
    four = [1000, 1001, 1002, 1003]
    prompt = [1000, 1001, 1002, 1003, 1000, 1002, 1001, 1003, 1000, 1003, 1001, 1002] * 2
    sp = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, logit_bias={t: 30.0 for t in four})
    samples = {}
    for arm, spec in (("plain", None), ("ngram", NGRAM)):
        llm = LLM(folder, dtype="float32", kv_cache_memory=0.05, swap_space=0, speculative_config=spec)
        outs = llm.generate([prompt] * 600, sp, use_tqdm=False)
        samples[arm] = [o.outputs[0].token_ids for o in outs]
        if spec:
            st = llm.stats
            assert st.spec_num_accepted_tokens > 100 and st.spec_num_draft_tokens > st.spec_num_accepted_tokens
    assert all(t in four for toks in samples["plain"] + samples["ngram"] for t in toks)
    for index in (1, 3):
        a, b = ([tuple(toks[index - 1:index + 1]) for toks in samples[arm]] for arm in ("plain", "ngram"))
        assert len(set(a)) > 4, "the pairs must really be random"
        stat, df = chi2_homogeneity(a, b)
        assert stat < CHI2_CRIT_P001[df], (index, stat, df)
