"""gpu_worker/sampler.py against plain per-row reference implementations on small random logits.

Filters are checked by what sampling can produce: a batch of many rows holding the same logits is many
independent draws in one call, so the set of drawn tokens must equal the reference's kept set (never a
token outside it, and with moderately flat logits every kept token shows up).
"""
from __future__ import annotations

import math

import pytest
import torch

from common.sampling_params import SamplingParams
from gpu_worker.sampler import (SamplingBatch, apply_penalties, build_sampling_batch, prompt_logprobs, row_argmax,
                                sample)
from gpu_worker.step_inputs import SequenceState

pytestmark = pytest.mark.unit

VOCAB = 64
NEG_INF = float("-inf")


# ---- helpers -----------------------------------------------------------------------------------------
def random_logits(rows: int, vocab: int = VOCAB, scale: float = 2.0, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * scale


def repeat_rows(row: torch.Tensor, times: int) -> torch.Tensor:
    return row[None, :].repeat(times, 1)


def plain_batch(rows: int, temperature: float = 1.0, **kw) -> SamplingBatch:
    return SamplingBatch(temperature=torch.full((rows,), float(temperature)), all_greedy=temperature == 0.0, **kw)


def draw_set(logits_row: torch.Tensor, draws: int, seed: int = 0, **kw) -> set[int]:
    """Token ids drawn from `draws` independent samples of one row's distribution."""
    batch = plain_batch(draws, **{k: v for k, v in kw.items() if k == "temperature"})
    for name in ("top_k", "top_p", "min_p"):
        if name in kw:
            dtype = torch.long if name == "top_k" else torch.float32
            setattr(batch, name, torch.full((draws,), kw[name], dtype=dtype))
    torch.manual_seed(seed)
    ids, _ = sample(repeat_rows(logits_row, draws), batch)
    return set(ids.tolist())


def ref_softmax(row: list[float]) -> list[float]:
    m = max(row)
    exps = [math.exp(x - m) if x != NEG_INF else 0.0 for x in row]
    total = sum(exps)
    return [e / total for e in exps]


def ref_top_k_keep(row: list[float], k: int) -> set[int]:
    order = sorted(range(len(row)), key=lambda i: -row[i])
    return set(order[:k])


def ref_top_p_keep(row: list[float], p: float) -> set[int]:
    """Smallest set of most likely tokens whose total mass is >= p (the token crossing p is included)."""
    probs = ref_softmax(row)
    order = sorted(range(len(row)), key=lambda i: -probs[i])
    kept, mass = set(), 0.0
    for i in order:
        kept.add(i)
        mass += probs[i]
        if mass >= p:
            break
    return kept


def ref_min_p_keep(row: list[float], min_p: float) -> set[int]:
    probs = ref_softmax(row)
    top = max(probs)
    return {i for i, q in enumerate(probs) if q >= min_p * top}


def ref_log_softmax(row: list[float]) -> list[float]:
    m = max(row)
    lse = m + math.log(sum(math.exp(x - m) for x in row))
    return [x - lse for x in row]


# ---- greedy and temperature ------------------------------------------------------------------------
def test_all_greedy_is_rowwise_argmax() -> None:
    logits = random_logits(8)
    ids, lps = sample(logits.clone(), plain_batch(8, temperature=0.0))
    assert lps is None
    for r in range(8):
        row = logits[r].tolist()
        assert ids[r].item() == max(range(VOCAB), key=lambda i: row[i])


def test_row_argmax_takes_the_first_maximum_like_argmax() -> None:
    """Ties (integer logits over a few values), -inf rows, NaN rows and a vocabulary-sized row: the index
    argmax gives, the first maximum, because a greedy token must not depend on which of the two ran."""
    g = torch.Generator().manual_seed(1)
    for rows, vocab in ((7, 49152), (3, 5), (1, 1), (5, 300)):
        x = torch.randint(0, 3, (rows, vocab), generator=g).float()
        x[0] = NEG_INF
        if rows > 2:
            x[2, vocab // 2] = float("nan")
        assert torch.equal(row_argmax(x), x.argmax(-1))
        first_max = [max(range(vocab), key=lambda i: (x[r, i].item(), -i)) for r in range(1, rows) if r != 2]
        assert [row_argmax(x)[r].item() for r in range(1, rows) if r != 2] == first_max


def test_greedy_rows_stay_greedy_inside_a_sampled_batch() -> None:
    logits = random_logits(6, scale=0.3)          # flat: a sampled row would rarely hit its argmax
    temps = torch.tensor([0.0, 1.0, 0.0, 1.5, 0.0, 1.0])
    torch.manual_seed(0)
    for _ in range(20):
        ids, _ = sample(logits.clone(), SamplingBatch(temperature=temps))
        for r in (0, 2, 4):
            assert ids[r].item() == int(logits[r].argmax())


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_empirical_frequencies_match_softmax_of_scaled_logits(temperature: float) -> None:
    base = torch.tensor([1.0, 0.5, 0.0, -1.0])
    draws = 4000
    torch.manual_seed(123)
    ids, _ = sample(repeat_rows(base, draws), plain_batch(draws, temperature=temperature))
    counts = torch.bincount(ids, minlength=4).double() / draws
    expected = ref_softmax([x / temperature for x in base.tolist()])
    for tok in range(4):
        assert abs(counts[tok].item() - expected[tok]) < 0.03, (tok, counts.tolist(), expected)


def test_temperature_changes_the_distribution() -> None:
    """Low temperature concentrates mass on the argmax, high temperature spreads it."""
    base = torch.tensor([1.0, 0.0, -0.5, -1.0])
    draws = 4000

    def top_share(t: float) -> float:
        torch.manual_seed(7)
        ids, _ = sample(repeat_rows(base, draws), plain_batch(draws, temperature=t))
        return (ids == 0).double().mean().item()

    cold, warm, hot = top_share(0.25), top_share(1.0), top_share(2.0)
    assert cold > 0.9 and cold > warm + 0.2 and warm > hot + 0.05, (cold, warm, hot)


# ---- top-k, top-p, min-p -----------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 3, 7])
def test_top_k_keeps_exactly_k_candidates(k: int) -> None:
    row = random_logits(1, scale=0.5, seed=k)[0]
    drawn = draw_set(row, 3000, seed=k, top_k=k)
    assert drawn == ref_top_k_keep(row.tolist(), k)


def test_top_k_with_per_row_seeds_never_leaves_the_top_k() -> None:
    row = random_logits(1, scale=0.5, seed=11)[0]
    rows, k = 400, 4
    gens = {i: torch.Generator().manual_seed(10_000 + i) for i in range(rows)}
    batch = plain_batch(rows, top_k=torch.full((rows,), k), generators=gens)
    ids, _ = sample(repeat_rows(row, rows), batch)
    assert set(ids.tolist()) == ref_top_k_keep(row.tolist(), k)


@pytest.mark.parametrize("p", [0.3, 0.6, 0.85])
def test_top_p_keeps_the_smallest_set_reaching_p(p: float) -> None:
    row = random_logits(1, vocab=16, scale=0.7, seed=3)[0]
    kept = ref_top_p_keep(row.tolist(), p)
    probs = sorted(ref_softmax(row.tolist()), reverse=True)
    # keep the case away from float ties at the boundary
    assert all(abs(sum(probs[:j]) - p) > 1e-4 for j in range(1, 17))
    assert 1 < len(kept) < 16
    assert draw_set(row, 4000, seed=5, top_p=p) == kept


def test_top_p_includes_the_boundary_token() -> None:
    row = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    assert draw_set(row, 2000, top_p=0.6) == {0, 1}          # 0.4 < 0.6 <= 0.7: token 1 crosses p
    assert draw_set(row, 2000, top_p=0.75) == {0, 1, 2}      # 0.7 < 0.75 <= 0.9
    assert draw_set(row, 2000, top_p=0.35) == {0}            # the top token alone already covers p
    assert draw_set(row, 2000, top_p=1.0) == {0, 1, 2, 3}


def test_top_p_is_taken_over_the_temperature_scaled_distribution() -> None:
    row = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    t = 2.0
    expected = ref_top_p_keep([x / t for x in row.tolist()], 0.65)
    assert expected == {0, 1, 2}            # flatter: 0.325 + 0.282 < 0.65
    assert ref_top_p_keep(row.tolist(), 0.65) == {0, 1}
    assert draw_set(row, 3000, top_p=0.65, temperature=t) == expected


def test_top_k_then_top_p_renormalises_over_the_top_k() -> None:
    row = torch.tensor([0.3, 0.25, 0.2, 0.15, 0.1]).log()
    # over the top 3 (mass 0.75): 0.4, 0.333, 0.267 -> p=0.7 needs tokens 0 and 1 (0.733)
    assert draw_set(row, 3000, top_k=3, top_p=0.7) == {0, 1}
    # over the full distribution 0.3 + 0.25 < 0.7 would need a third token
    assert ref_top_p_keep(row.tolist(), 0.7) == {0, 1, 2}


@pytest.mark.parametrize("min_p", [0.05, 0.2, 0.5])
def test_min_p_keeps_tokens_above_a_fraction_of_the_top_probability(min_p: float) -> None:
    row = random_logits(1, vocab=24, scale=1.0, seed=4)[0]
    probs = ref_softmax(row.tolist())
    top = max(probs)
    assert all(abs(q - min_p * top) > 1e-4 for q in probs)
    kept = ref_min_p_keep(row.tolist(), min_p)
    assert 1 < len(kept) < 24
    assert draw_set(row, 4000, seed=9, min_p=min_p) == kept


def test_mixed_filters_apply_per_row() -> None:
    """One batch where each row uses a different filter; a row's 'off' value must not filter it."""
    row = random_logits(1, vocab=12, scale=0.4, seed=21)[0]
    copies = 1500
    # rows [0, copies): top_k=2; [copies, 2c): top_p=0.5; [2c, 3c): min_p=0.9; [3c, 4c): nothing
    n = 4 * copies
    top_k = torch.full((n,), 12)
    top_k[:copies] = 2
    top_p = torch.ones(n)
    top_p[copies:2 * copies] = 0.5
    min_p = torch.zeros(n)
    min_p[2 * copies:3 * copies] = 0.9
    batch = SamplingBatch(temperature=torch.ones(n), top_k=top_k, top_p=top_p, min_p=min_p)
    torch.manual_seed(2)
    ids, _ = sample(repeat_rows(row, n), batch)
    groups = [set(ids[i * copies:(i + 1) * copies].tolist()) for i in range(4)]
    lst = row.tolist()
    assert groups[0] == ref_top_k_keep(lst, 2)
    assert groups[1] == ref_top_p_keep(lst, 0.5)
    assert groups[2] == ref_min_p_keep(lst, 0.9)
    assert groups[3] == set(range(12))


# ---- penalties, bias, min_tokens -------------------------------------------------------------------
def penalty_inputs(rows: int = 5, vocab: int = 40, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 2
    counts = torch.randint(0, 4, (rows, vocab), generator=g).float() * (torch.rand(rows, vocab, generator=g) < 0.3)
    prompt_mask = torch.rand(rows, vocab, generator=g) < 0.2
    return logits, counts, prompt_mask


def test_presence_and_frequency_penalties_follow_the_openai_formula() -> None:
    logits, counts, prompt_mask = penalty_inputs()
    presence = torch.tensor([0.0, 0.5, -1.0, 2.0, 0.3])
    frequency = torch.tensor([0.0, 0.0, 0.7, -0.5, 1.5])
    b = SamplingBatch(temperature=torch.zeros(5), presence=presence, frequency=frequency,
                      repetition=torch.ones(5), output_counts=counts, prompt_mask=prompt_mask)
    got = apply_penalties(logits.clone(), b)
    for r in range(5):
        for t in range(logits.shape[1]):
            c = counts[r, t].item()
            want = logits[r, t].item() - frequency[r].item() * c - presence[r].item() * (1.0 if c > 0 else 0.0)
            assert got[r, t].item() == pytest.approx(want, abs=1e-5)


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    logits, counts, prompt_mask = penalty_inputs(seed=2)
    repetition = torch.tensor([1.0, 1.3, 2.0, 0.7, 1.1])
    b = SamplingBatch(temperature=torch.zeros(5), presence=torch.zeros(5), frequency=torch.zeros(5),
                      repetition=repetition, output_counts=counts, prompt_mask=prompt_mask)
    got = apply_penalties(logits.clone(), b)
    changed = 0
    for r in range(5):
        rep = repetition[r].item()
        for t in range(logits.shape[1]):
            x = logits[r, t].item()
            seen = bool(prompt_mask[r, t]) or counts[r, t].item() > 0    # prompt and output tokens alike
            want = (x / rep if x > 0 else x * rep) if seen else x
            assert got[r, t].item() == pytest.approx(want, abs=1e-5)
            changed += want != x
    assert changed > 20


def test_penalties_and_bias_combine_in_order() -> None:
    """logit_bias, then repetition, then frequency/presence (vLLM's order)."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    b = SamplingBatch(temperature=torch.zeros(1), presence=torch.tensor([0.5]), frequency=torch.tensor([0.25]),
                      repetition=torch.tensor([2.0]), output_counts=torch.tensor([[2.0, 1.0, 0.0, 0.0]]),
                      prompt_mask=torch.tensor([[False, False, True, False]]),
                      bias_rows=torch.tensor([0, 0]), bias_cols=torch.tensor([1, 3]),
                      bias_vals=torch.tensor([3.0, -4.0]))
    got = apply_penalties(logits.clone(), b)[0].tolist()
    want = [2.0 / 2 - 0.25 * 2 - 0.5, (-1.0 + 3.0) / 2 - 0.25 - 0.5, 0.5 / 2, 3.0 - 4.0]
    assert got == pytest.approx(want)


def test_penalties_change_the_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0]] * 3)
    counts = torch.zeros(3, 4)
    counts[:, 0] = 1.0
    b = SamplingBatch(temperature=torch.zeros(3), all_greedy=True, presence=torch.tensor([0.0, 0.5, 0.0]),
                      frequency=torch.tensor([0.0, 0.0, 0.0]), repetition=torch.tensor([1.0, 1.0, 1.2]),
                      output_counts=counts, prompt_mask=torch.zeros(3, 4, dtype=torch.bool))
    ids, _ = sample(logits.clone(), b)
    assert ids.tolist() == [0, 1, 1]


def test_logit_bias_is_added_per_row_and_can_force_a_token() -> None:
    logits = random_logits(3, vocab=30, seed=5)
    rows, cols, vals = [0, 0, 2], [7, 11, 29], [100.0, -3.5, 2.25]
    b = SamplingBatch(temperature=torch.zeros(3), all_greedy=True, bias_rows=torch.tensor(rows),
                      bias_cols=torch.tensor(cols), bias_vals=torch.tensor(vals))
    got = apply_penalties(logits.clone(), b)
    want = logits.clone()
    for r, c, v in zip(rows, cols, vals):
        want[r, c] += v
    assert torch.allclose(got, want)
    ids, _ = sample(logits.clone(), b)
    assert ids[0].item() == 7
    assert ids[1].item() == int(logits[1].argmax())
    # +100 forces the token under sampling too, whatever the temperature
    n = 500
    sampled = SamplingBatch(temperature=torch.full((n,), 2.0), bias_rows=torch.arange(n),
                            bias_cols=torch.full((n,), 13), bias_vals=torch.full((n,), 100.0))
    ids, _ = sample(repeat_rows(logits[1], n), sampled)
    assert set(ids.tolist()) == {13}


def test_banned_tokens_are_never_chosen() -> None:
    """min_tokens: eos/stop ids are forced to -inf, even where they are the most likely tokens."""
    row = torch.zeros(10)
    row[3], row[8] = 5.0, 4.0               # the two banned ids dominate
    n = 2000
    ban_rows = torch.arange(n).repeat_interleave(2)
    ban_cols = torch.tensor([3, 8]).repeat(n)
    b = SamplingBatch(temperature=torch.ones(n), ban_rows=ban_rows, ban_cols=ban_cols)
    torch.manual_seed(0)
    ids, _ = sample(repeat_rows(row, n), b)
    assert set(ids.tolist()) == set(range(10)) - {3, 8}
    greedy = SamplingBatch(temperature=torch.zeros(1), all_greedy=True, ban_rows=torch.tensor([0, 0]),
                           ban_cols=torch.tensor([3, 8]))
    ids, _ = sample(row[None].clone(), greedy)
    assert ids.item() not in (3, 8)
    # without the ban, token 3 wins
    ids, _ = sample(row[None].clone(), plain_batch(1, temperature=0.0))
    assert ids.item() == 3


# ---- logprobs ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [0, 1, 5])
def test_logprobs_come_from_raw_logits(k: int) -> None:
    """Chosen logprob, rank and top-k are the raw model distribution, not the penalised/scaled one."""
    logits = random_logits(6, seed=8)
    n = 6
    counts = torch.zeros(n, VOCAB)
    counts[:, :10] = 1
    b = SamplingBatch(temperature=torch.tensor([0.0, 0.7, 1.0, 1.3, 0.0, 1.0]), top_k=torch.full((n,), 20),
                      presence=torch.full((n,), 1.0), frequency=torch.full((n,), 0.5), repetition=torch.full((n,), 1.5),
                      output_counts=counts, prompt_mask=torch.zeros(n, VOCAB, dtype=torch.bool),
                      bias_rows=torch.arange(n), bias_cols=torch.full((n,), 40), bias_vals=torch.full((n,), 3.0),
                      max_logprobs=k)
    torch.manual_seed(4)
    ids, recs = sample(logits.clone(), b)
    assert recs is not None and len(recs) == n
    for r in range(n):
        ref = ref_log_softmax(logits[r].tolist())
        assert len(recs[r]) == 1
        chosen, rank, top_ids, top_vals = recs[r][0]
        tok = ids[r].item()
        assert chosen == pytest.approx(ref[tok], abs=1e-5)
        assert rank == 1 + sum(1 for x in ref if x > ref[tok])
        want_ids = sorted(range(VOCAB), key=lambda i: -ref[i])[:k]
        assert top_ids == want_ids
        assert top_vals == pytest.approx([ref[i] for i in want_ids], abs=1e-5)


def test_no_logprobs_unless_asked() -> None:
    _, recs = sample(random_logits(2), plain_batch(2))
    assert recs is None


def test_prompt_logprobs_match_reference() -> None:
    logits = random_logits(7, seed=12)
    next_ids = torch.tensor([3, 0, 63, 17, 17, 40, 5])
    recs = prompt_logprobs(logits.clone(), next_ids, 3)
    assert len(recs) == 7
    for r, (lp, rank, top_ids, top_vals) in enumerate(recs):
        ref = ref_log_softmax(logits[r].tolist())
        tok = next_ids[r].item()
        assert lp == pytest.approx(ref[tok], abs=1e-5)
        assert rank == 1 + sum(1 for x in ref if x > ref[tok])
        assert top_ids == sorted(range(VOCAB), key=lambda i: -ref[i])[:3]
        assert top_vals == pytest.approx(sorted(ref, reverse=True)[:3], abs=1e-5)


# ---- seeded generators ------------------------------------------------------------------------------
def seeded_draws(target: torch.Tensor, seed: int, steps: int, batch: int, target_row: int) -> list[int]:
    """Draws of `target` (seeded) over `steps` steps, alone (batch 0) or at `target_row` among `batch` others."""
    gen = torch.Generator().manual_seed(seed)
    others = random_logits(batch, seed=seed + 1) if batch else None
    out = []
    for step in range(steps):
        if not batch:
            logits = target[None].clone()
            b = SamplingBatch(temperature=torch.tensor([0.9]), generators={0: gen})
            row = 0
        else:
            logits = torch.cat([others[:target_row], target[None], others[target_row:]]).clone()
            n = batch + 1
            g2 = torch.Generator().manual_seed(999 + step)
            temps = torch.rand(n, generator=g2) * 1.5
            temps[::5] = 0.0
            temps[target_row] = 0.9
            top_k = torch.randint(1, VOCAB + 1, (n,), generator=g2)
            top_k[target_row] = VOCAB
            top_p = 0.5 + 0.5 * torch.rand(n, generator=g2)
            top_p[target_row] = 1.0
            min_p = 0.2 * torch.rand(n, generator=g2)
            min_p[target_row] = 0.0
            gens = {i: torch.Generator().manual_seed(seed * 31 + i + step) for i in range(0, n, 3) if i != target_row}
            gens[target_row] = gen
            b = SamplingBatch(temperature=temps, top_k=top_k, top_p=top_p, min_p=min_p, generators=gens,
                              max_logprobs=2)
            row = target_row
        torch.manual_seed(step * 7 + batch)      # the unseeded rows' draws change with the batch
        ids, _ = sample(logits, b)
        out.append(ids[row].item())
    return out


def test_seeded_row_draws_the_same_alone_and_inside_a_batch() -> None:
    target = random_logits(1, scale=0.8, seed=77)[0]      # flat enough that draws vary
    all_draws = []
    for seed in (0, 1, 1234, 2**40 + 5):
        alone = seeded_draws(target, seed, steps=6, batch=0, target_row=0)
        for target_row in (0, 17, 32):
            assert seeded_draws(target, seed, steps=6, batch=32, target_row=target_row) == alone, (seed, target_row)
        all_draws.append(tuple(alone))
    assert len(set(all_draws)) > 1                       # different seeds give different sequences
    assert len(set(all_draws[0])) > 1                    # a generator advances from step to step


def test_unseeded_rows_vary_between_calls() -> None:
    row = random_logits(1, scale=0.5, seed=3)[0]
    draws = {sample(row[None].clone(), plain_batch(1))[0].item() for _ in range(30)}
    assert len(draws) > 3


# ---- batch construction from the worker's sequence states -------------------------------------------
def state(params: SamplingParams, prompt: list[int], output: list[int], seed: int | None = None) -> SequenceState:
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return SequenceState("r", prompt + output, len(prompt), params, [], len(prompt) + len(output), gen)


def build(states: list[SequenceState], eos: frozenset[int] = frozenset({2}), vocab: int = 20) -> SamplingBatch:
    return build_sampling_batch(states, vocab, set(eos), torch.device("cpu"))


def test_sampling_batch_min_tokens_bans_eos_and_stop_ids_until_reached() -> None:
    sp = SamplingParams(min_tokens=3, stop_token_ids=[5, 6], max_tokens=10)
    b = build([state(sp, [1, 4], [9, 9])])                          # 2 outputs < 3: the 3rd may not stop
    assert sorted(zip(b.ban_rows.tolist(), b.ban_cols.tolist())) == [(0, 2), (0, 5), (0, 6)]
    b = build([state(sp, [1, 4], [9, 9, 9])])                       # min_tokens reached
    assert b.ban_rows is None
    ignore = SamplingParams(min_tokens=3, stop_token_ids=[5], ignore_eos=True, max_tokens=10)
    plain = SamplingParams(max_tokens=10)
    b = build([state(plain, [1], []), state(ignore, [1], [])])
    assert sorted(zip(b.ban_rows.tolist(), b.ban_cols.tolist())) == [(1, 2), (1, 5)]   # EOS too: ignore_eos
    # only lets a sequence run past EOS; min_tokens still keeps EOS from being sampled (vLLM, HF)


def test_sampling_batch_penalty_tensors() -> None:
    sp = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.2)
    plain = SamplingParams()
    b = build([state(sp, [3, 4, 3], [7, 7, 8]), state(plain, [1], [2])])
    assert b.output_counts[0].tolist() == [2.0 if t == 7 else 1.0 if t == 8 else 0.0 for t in range(20)]
    assert b.output_counts[1, 2].item() == 1.0
    assert b.prompt_mask[0].nonzero().flatten().tolist() == [3, 4]
    assert b.presence.tolist() == [0.5, 0.0]
    assert b.frequency.tolist() == [0.25, 0.0]
    assert b.repetition.tolist() == pytest.approx([1.2, 1.0])
    assert build([state(plain, [1], [2])]).repetition is None


def test_sampling_batch_filters_generators_bias_and_logprobs() -> None:
    greedy_seeded = SamplingParams(temperature=0.0, seed=1, logprobs=2)
    seeded = SamplingParams(temperature=0.8, top_k=5, seed=2, logit_bias={4: 1.5})
    topp = SamplingParams(top_p=0.9, min_p=0.1, logprobs=4)
    states = [state(greedy_seeded, [1], [], seed=1), state(seeded, [1], [], seed=2), state(topp, [1], [])]
    b = build(states)
    assert not b.all_greedy
    assert b.temperature.tolist() == pytest.approx([0.0, 0.8, 1.0])
    assert b.top_k.tolist() == [20, 5, 20]
    assert b.top_p.tolist() == pytest.approx([1.0, 1.0, 0.9])
    assert b.min_p.tolist() == pytest.approx([0.0, 0.0, 0.1])
    assert set(b.generators) == {1} and b.generators[1] is states[1].generator
    assert (b.bias_rows.tolist(), b.bias_cols.tolist(), b.bias_vals.tolist()) == ([1], [4], [1.5])
    assert b.max_logprobs == 4
    only_greedy = build([state(greedy_seeded, [1], [], seed=1)])
    assert only_greedy.all_greedy and only_greedy.top_k is None and only_greedy.generators == {}
    assert build([state(SamplingParams(), [1], [])]).max_logprobs == -1
