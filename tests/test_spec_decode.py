"""Speculative decoding with n-gram prompt lookup and with a draft model: the configuration, the proposers,
output that is identical with and without speculation under every engine variant that changes how work is
split (a model drafting for itself must then accept every draft, a random draft almost none), the draft's
own KV cache checked against a fresh forward, the target distribution kept for sampling (chi-square, with
one-hot and with spread-out draft distributions), seeded reproducibility, and the server path."""
from __future__ import annotations

import random

import pytest

from common.speculative import SpeculativeConfig
from gpu_worker.spec_decode.rejection import accepted_drafts
from gpu_worker.spec_decode.ngram import propose_ngram
from gpu_worker.spec_decode.proposer import fit_drafts
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
    ({"method": "draft_model", "num_speculative_tokens": 2}, 'needs a "model"'),
    ({"method": "ngram", "model": "/some/draft", "num_speculative_tokens": 2}, "takes no model"),
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


@pytest.mark.slow
def test_draft_with_another_vocabulary_fails_at_start_up(tiny_case, default_tokenizer, tmp_path, capsys) -> None:
    """One clear error naming both sizes, from LLM() and from the CLI (exit 2, before any process starts)."""
    import json

    from loadtest.tiny_model import build_tiny_model
    from pagedserve.cli import main
    folder, _ = tiny_case
    other = str(build_tiny_model(tmp_path / "wide", "llama", default_tokenizer, vocab_size=len(default_tokenizer) + 64))
    spec = {"model": other, "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match=f"vocabulary of {len(default_tokenizer) + 64} tokens, the target {len(default_tokenizer)}"):
        LLM(folder, dtype="float32", kv_cache_memory=0.05, swap_space=0, speculative_config=spec)
    with pytest.raises(SystemExit) as exc:
        main(["serve", folder, "--speculative-config", json.dumps(spec)])
    assert exc.value.code == 2
    assert "--speculative-config: speculative_config: the draft model" in capsys.readouterr().err


@pytest.mark.unit
def test_rows_ahead_see_min_tokens_lift() -> None:
    """Row j of a sequence with drafts samples as if j drafts were generated: with 3 outputs and min_tokens 4,
    only row 0 bans the end-of-sequence token."""
    import torch

    from gpu_worker.sampler import build_sampling_batch
    from gpu_worker.step_inputs import SequenceState, row_state
    st = SequenceState("s", [5, 6, 7, 8, 9], 2, SamplingParams(min_tokens=4), [0], 4, None)
    rows = [st] + [row_state(st, [11] * j) for j in (1, 2)]
    b = build_sampling_batch(rows, 16, {2}, torch.device("cpu"))
    assert b.ban_rows.tolist() == [0] and b.ban_cols.tolist() == [2]


@pytest.mark.unit
def test_ngram_proposes_what_followed_the_latest_longest_match() -> None:
    assert propose_ngram([1, 2, 3, 4, 5, 1, 2, 3], 2, 4, 3) == [4, 5, 1]
    assert propose_ngram([9, 1, 2, 8, 1, 2, 7, 5, 1, 2], 2, 2, 2) == [7, 5]      # latest of two matches
    assert propose_ngram([1, 2, 3, 9, 2, 3, 7, 1, 2, 3], 2, 3, 2) == [9, 2]      # longer match wins
    assert propose_ngram([1, 2, 3, 4], 1, 3, 2) == []                            # nothing repeats
    assert propose_ngram([5], 1, 3, 2) == []


@pytest.mark.unit
def test_ngram_drafts_one_token_after_a_one_token_match() -> None:
    assert propose_ngram([7, 1, 2, 3, 4, 5, 6, 1], 1, 4, 5) == [2]                # only "1" matched
    assert propose_ngram([1, 2, 3, 4, 5, 6, 7, 1, 2], 1, 4, 5) == [3, 4, 5, 6, 7]  # two tokens: all k
    assert propose_ngram([1, 2, 3, 4, 5, 6, 7, 1, 2], 2, 4, 5) == [3, 4, 5, 6, 7]
    assert propose_ngram([1, 2, 3, 4, 5, 6, 7, 1, 2], 1, 4, 3) == [3, 4, 5]        # k caps it


@pytest.mark.unit
def test_ngram_lookup_matches_a_plain_search() -> None:
    """The candidate-narrowing search against the definition, on short random sequences over small
    vocabularies (many repeats, overlaps and ties)."""
    def plain(toks: list[int], min_n: int, max_n: int, k: int) -> list[int]:
        for n in range(min(max_n, len(toks) - 1), min_n - 1, -1):
            for s in range(len(toks) - 1 - n, -1, -1):          # latest occurrence first
                if toks[s:s + n] == toks[len(toks) - n:]:
                    return toks[s + n:s + n + (1 if n == 1 else k)]
        return []
    rng = random.Random(0)
    for _ in range(3000):
        toks = [rng.randrange(rng.randint(1, 5)) for _ in range(rng.randint(0, 30))]
        min_n = rng.randint(1, 4)
        max_n, k = rng.randint(min_n, 9), rng.randint(1, 8)
        assert propose_ngram(toks, min_n, max_n, k) == plain(toks, min_n, max_n, k), (toks, min_n, max_n, k)


@pytest.mark.unit
def test_drafts_are_cut_evenly_to_the_row_budget() -> None:
    assert fit_drafts([4, 4, 0, 2], 10) == [4, 4, 0, 2]           # within the budget: untouched
    assert fit_drafts([4, 4, 4, 4], 10) == [3, 3, 2, 2]           # two each, the rest one more to the first
    assert fit_drafts([8, 1, 3], 6) == [3, 1, 2]                  # short drafts keep theirs, the long one is cut
    assert fit_drafts([4, 4], 0) == [0, 0] and fit_drafts([4, 4], -3) == [0, 0]
    for lengths, budget in (([5, 0, 7, 2, 2], 9), ([1] * 9, 4), ([6, 6, 6], 17)):
        keep = fit_drafts(lengths, budget)
        assert sum(keep) == min(budget, sum(lengths)) and all(0 <= k <= n for k, n in zip(keep, lengths))
        cut = [k for k, n in zip(keep, lengths) if k < n]
        assert all(k >= max(keep) - 1 for k in cut)                # a cut one is at most one short of any


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


def tiny_params(n: int, seeded: bool = True) -> list[SamplingParams]:
    """Greedy with various lengths, n = 2, and (n-gram, whose drafts are deterministic) one seeded sampled
    request in the mix: with deterministic drafts a seed gives the same tokens as without speculation."""
    out = []
    for i in range(n):
        if i % 8 == 5 and seeded:
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


@pytest.fixture(scope="module")
def draft_folder(tmp_path_factory, default_tokenizer) -> str:
    """A tiny random draft that shares the target's vocabulary and nothing else (another architecture, one
    layer, other weights): its greedy drafts are almost never right."""
    from loadtest.tiny_model import build_tiny_model
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-draft"), "qwen3", default_tokenizer, seed=1,
                                num_hidden_layers=1))


def proposer_config(proposer: str, target: str, draft: str) -> dict:
    return {"ngram": NGRAM, "self-draft": {"model": target, "num_speculative_tokens": 3},
            "random-draft": {"model": draft, "num_speculative_tokens": 3}}[proposer]


def check_acceptance(proposer: str, st) -> None:
    """What each proposer's acceptance must be: a model drafting for itself is always right (any corrupted
    draft KV would show here), a random draft almost never, n-gram lookup in between."""
    assert st.spec_num_drafts > 0
    if proposer == "self-draft":
        assert st.spec_num_accepted_tokens == st.spec_num_draft_tokens, vars(st)
    elif proposer == "random-draft":
        assert st.spec_num_accepted_tokens < 0.2 * st.spec_num_draft_tokens, vars(st)
    else:
        assert 0 < st.spec_num_accepted_tokens < st.spec_num_draft_tokens, vars(st)


_REFERENCE: dict[tuple[str, bool], list] = {}


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("proposer", ["ngram", "self-draft", "random-draft"])
def test_tiny_model_output_identical_with_speculation(tiny_case, draft_folder, proposer, variant) -> None:
    """32 requests at once (greedy, a seeded sampled one, n = 2): the same tokens and finish reasons with
    and without speculation, under every variant that changes how the work is split."""
    folder, base = tiny_case
    prompts = (base * 4)[:32]
    seeded = proposer == "ngram"
    params = tiny_params(len(prompts), seeded)
    opts = {"dtype": "float32", "kv_cache_memory": 0.05, "swap_space": 0, **VARIANTS[variant]}
    if (variant, seeded) not in _REFERENCE:
        _REFERENCE[variant, seeded] = generate(LLM(folder, **{**opts, "num_gpu_blocks": None}), prompts, params)
    llm = LLM(folder, speculative_config=proposer_config(proposer, folder, draft_folder), **opts)
    assert generate(llm, prompts, params) == _REFERENCE[variant, seeded]
    st = llm.stats
    check_acceptance(proposer, st)
    if "preemption" in variant:
        kind = st.num_swap_preemptions if variant.startswith("swap") else st.num_recompute_preemptions
        assert kind > 0, "the variant must really preempt"


@pytest.mark.slow
@pytest.mark.parametrize("proposer", ["self-draft", "random-draft"])
def test_drafts_cut_to_the_row_budget_keep_output_identical(tiny_case, draft_folder, proposer) -> None:
    """With packed weights on the CPU the worker cuts drafts so a step stays within GEMM_MAX_ROWS rows; the
    tiny model has plain weights, so the budget is set by hand: 32 sequences and 40 rows leave 8 drafts a
    step, spread over the batch. Output stays identical, and a draft model's cut drafts (its KV written
    for all k) stay exactly right."""
    folder, base = tiny_case
    prompts = (base * 4)[:32]
    params = tiny_params(len(prompts), False)
    opts = {"dtype": "float32", "kv_cache_memory": 0.05, "swap_space": 0}
    if ("default", False) not in _REFERENCE:
        _REFERENCE["default", False] = generate(LLM(folder, **opts), prompts, params)
    llm = LLM(folder, speculative_config=proposer_config(proposer, folder, draft_folder), **opts)
    assert llm.engine.executor.runner.spec_max_rows is None          # plain weights: no cap of its own
    llm.engine.executor.runner.spec_max_rows = 40
    assert generate(llm, prompts, params) == _REFERENCE["default", False]
    st = llm.stats
    check_acceptance(proposer, st)
    assert st.spec_num_draft_tokens < 2 * st.spec_num_drafts, vars(st)     # k = 3, cut to about 1 each


@pytest.mark.slow
@pytest.mark.parametrize("proposer", ["ngram", "self-draft", "random-draft"])
def test_batch_of_one_identical_and_logprobs_agree(tiny_case, draft_folder, proposer) -> None:
    folder, prompts = tiny_case
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2)
    plain = LLM(folder, dtype="float32", kv_cache_memory=0.05, swap_space=0)
    spec = LLM(folder, dtype="float32", kv_cache_memory=0.05, swap_space=0,
               speculative_config=proposer_config(proposer, folder, draft_folder))
    for p in prompts[:4]:
        a = plain.generate([p], sp, use_tqdm=False)[0].outputs[0]
        b = spec.generate([p], sp, use_tqdm=False)[0].outputs[0]
        assert a.token_ids == b.token_ids
        assert len(b.logprobs) == len(b.token_ids)
        for ra, rb in zip(a.logprobs, b.logprobs):
            assert ra[2] == rb[2] and ra[0] == pytest.approx(rb[0], abs=1e-4)
    check_acceptance(proposer, spec.stats)


@pytest.mark.slow
def test_draft_cache_holds_exactly_the_verified_tokens(tiny_case, draft_folder) -> None:
    """After every step, at each position the draft model counts as computed, its cache holds the K/V that a
    fresh forward of the draft over the verified tokens gives: drafts it fed and the target rejected are never
    counted, accepted ones are kept (sampled requests over four tokens, so acceptance is partial)."""
    import torch

    from gpu_worker.attention import allocate_kv_cache
    from gpu_worker.step_inputs import SequenceState, build_step_inputs
    folder, _ = tiny_case
    four = [1000, 1001, 1002, 1003]
    llm = LLM(folder, dtype="float32", kv_cache_memory=0.05, swap_space=0,
              speculative_config={"model": draft_folder, "num_speculative_tokens": 3})
    proposer = llm.engine.executor.runner.proposer
    observe, checked, bs = proposer.observe, [], proposer.block_size

    def check(st: SequenceState) -> None:
        n = st.proposer_state.computed
        nb = -(-n // bs)
        mc = proposer.model_config
        ref, _ = allocate_kv_cache(mc, nb, 0, bs, torch.float32, torch.device("cpu"))
        fresh = SequenceState("ref", st.token_ids[:n], n, SamplingParams(), list(range(nb)), 0, None)
        inputs = build_step_inputs({"ref": fresh}, [("ref", n)], bs, torch.device("cpu"))
        with torch.inference_mode():
            proposer.model(inputs.input_ids, inputs.positions, ref, proposer.backend.prepare(inputs.attn),
                           proposer.backend)
        for got, want in zip((c for pair in proposer.kv_caches for c in pair), (c for pair in ref for c in pair)):
            torch.testing.assert_close(got[st.block_ids[:nb]].flatten(0, 1)[:n], want.flatten(0, 1)[:n],
                                       atol=1e-4, rtol=1e-4)
        checked.append(n)

    def checked_observe(seqs, ends):
        observe(seqs, ends)
        for st in seqs:
            check(st)
    proposer.observe = checked_observe
    prompt = [1000, 1001, 1002, 1003, 1000, 1002, 1001, 1003] * 2
    # seeded, so the acceptance does not hang on the process's random state
    sps = [SamplingParams(temperature=1.0, seed=i, max_tokens=40, ignore_eos=True, logit_bias={t: 30.0 for t in four})
           for i in range(6)]
    llm.generate([prompt] * 6, sps, use_tqdm=False)
    st = llm.stats
    assert 0.2 * st.spec_num_draft_tokens < st.spec_num_accepted_tokens < 0.8 * st.spec_num_draft_tokens, vars(st)
    assert len(checked) > 50 and max(checked) > len(prompt) + 30


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


@pytest.mark.slow
def test_default_model_drafting_for_itself_accepts_every_draft() -> None:
    """SmolLM2 as its own draft: the same greedy answers as without speculation and every draft accepted, as
    the counters behind the spec-decode metrics show."""
    convs = [[{"role": "user", "content": "Write a haiku about the sea."}],
             [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]]
    sp = SamplingParams(temperature=0, max_tokens=40)

    def answers(llm: LLM) -> list[tuple[list[int], str]]:
        return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in llm.chat(convs, sp, use_tqdm=False)]
    ref = answers(LLM(None, kv_cache_memory=0.1, swap_space=0))
    spec = LLM(None, kv_cache_memory=0.1, swap_space=0,
               speculative_config={"model": "default", "num_speculative_tokens": 4})
    assert answers(spec) == ref
    st = spec.stats
    assert st.spec_num_draft_tokens > 30 and st.spec_num_accepted_tokens == st.spec_num_draft_tokens, vars(st)
    assert st.spec_accepted_per_pos[0] == st.spec_num_drafts


@pytest.mark.slow
def test_seeded_sampling_with_a_draft_model_is_reproducible(tiny_case, draft_folder) -> None:
    """A seeded request sampled through a draft model gives the same tokens alone, in a batch and in another
    engine, and a model drafting for itself reproduces the plain engine's seeded samples."""
    folder, prompts = tiny_case
    sp = SamplingParams(temperature=0.9, seed=11, max_tokens=30, ignore_eos=True)
    opts = {"dtype": "float32", "kv_cache_memory": 0.05, "swap_space": 0}
    first = lambda outs: outs[0].outputs[0].token_ids  # noqa: E731
    for draft in (draft_folder, folder):
        spec = {"model": draft, "num_speculative_tokens": 3}
        alone = first(LLM(folder, speculative_config=spec, **opts).generate([prompts[0]], sp, use_tqdm=False))
        other = LLM(folder, speculative_config=spec, **opts)
        batch = [sp] + [SamplingParams(temperature=1.0, max_tokens=20 + i, ignore_eos=True) for i in range(5)]
        assert first(other.generate(prompts[:6], batch, use_tqdm=False)) == alone
        assert other.stats.spec_num_accepted_tokens > 0
    plain = first(LLM(folder, **opts).generate([prompts[0]], sp, use_tqdm=False))
    assert alone == plain


# ---- through the server (e2e) -------------------------------------------------------------------------
def spec_counters(url: str, min_generated: int = 1) -> dict[str, float] | None:
    """The spec-decode counters on /metrics, once a heartbeat has reported some drafts and at least
    `min_generated` tokens: drafts are counted when scheduled and accepted ones when verified, so only a
    snapshot taken after the last step has both."""
    import urllib.request
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    counts = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(("pagedserve:spec_decode_num_", "pagedserve:generation_tokens_total"))
              and "_total{" in line and "per_pos" not in line}
    done = counts.get("pagedserve:generation_tokens_total", 0) >= min_generated
    return counts if done and counts.get("pagedserve:spec_decode_num_drafts_total") else None


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


@pytest.mark.e2e
def test_server_runs_a_draft_model_in_its_worker(tiny_case, default_tokenizer, tmp_path) -> None:
    """`--speculative-config '{"model": ...}'` through the CLI: the worker process loads the draft beside the
    target (here the tiny model drafting for itself), the stream carries several tokens per chunk and
    matches the non-streamed text, and the counters show every draft accepted."""
    import json
    import urllib.request

    from tests.server_utils import run_server, wait_until
    folder, _ = tiny_case
    body = {"prompt": "The cat sat on the", "max_tokens": 24, "temperature": 0, "ignore_eos": True}

    def post(payload: dict) -> bytes:
        req = urllib.request.Request(f"{srv.url}/v1/completions", data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.read()
    spec = {"model": folder, "num_speculative_tokens": 3}
    with run_server(folder, "--dtype", "float32", "--kv-cache-memory", "0.05", "--swap-space", "0",
                    "--num-threads", "1", "--speculative-config", json.dumps(spec), log_dir=tmp_path) as srv:
        full = json.loads(post(body))["choices"][0]["text"]
        events = [json.loads(line[6:]) for line in post({**body, "stream": True}).decode().splitlines()
                  if line.startswith("data: {")]
        counts = wait_until(lambda: spec_counters(srv.url, 2 * 24), 10,
                            "spec-decode counters on /metrics after both requests (sent every heartbeat)")
    texts = [e["choices"][0].get("text", "") for e in events if e["choices"]]
    assert "".join(texts) == full
    assert counts["pagedserve:spec_decode_num_accepted_tokens_total"] == \
        counts["pagedserve:spec_decode_num_draft_tokens_total"] > 0
    assert max(len(default_tokenizer.encode(t, add_special_tokens=False)) for t in texts) > 1


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
def test_sampled_outputs_keep_the_target_distribution(tiny_case, draft_folder) -> None:
    """Unseeded sampling at temperature 1 over four tokens that the prompt repeats: n-gram drafts (one-hot q)
    and a deliberately different draft model (another architecture and weights: a spread-out q unlike p, so
    the general min(1, p/q) test and the residual norm(max(0, p - q)) both run) are partly accepted, and the
    joint distribution of (token i-1, token i) at the first drafted position (output index 1) and at a later
    one (index 3) is the same as without speculation, by a chi-square homogeneity test at significance 0.001
    (up to 15 degrees of freedom) on 600 samples per arm. Pairs, not single tokens: a verifier that kept
    every draft makes token i a function of token i-1, which the marginal of token i alone can hide."""
    folder, _ = tiny_case
    four = [1000, 1001, 1002, 1003]
    prompt = [1000, 1001, 1002, 1003, 1000, 1002, 1001, 1003, 1000, 1003, 1001, 1002] * 2
    sp = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, logit_bias={t: 30.0 for t in four})
    samples = {}
    arms = {"plain": None, "ngram": NGRAM, "draft": {"model": draft_folder, "num_speculative_tokens": 3}}
    for arm, spec in arms.items():
        llm = LLM(folder, dtype="float32", kv_cache_memory=0.05, swap_space=0, speculative_config=spec)
        outs = llm.generate([prompt] * 600, sp, use_tqdm=False)
        samples[arm] = [o.outputs[0].token_ids for o in outs]
        if spec:
            st = llm.stats
            assert st.spec_num_accepted_tokens > 100 and st.spec_num_draft_tokens > 1.5 * st.spec_num_accepted_tokens, \
                (arm, vars(st))
    assert all(t in four for arm in arms for toks in samples[arm] for t in toks)
    for arm in ("ngram", "draft"):
        for index in (1, 3):
            a, b = ([tuple(toks[index - 1:index + 1]) for toks in samples[name]] for name in ("plain", arm))
            assert len(set(a)) > 4, "the pairs must really be random"
            stat, df = chi2_homogeneity(a, b)
            assert stat < CHI2_CRIT_P001[df], (arm, index, stat, df)
