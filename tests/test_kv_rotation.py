"""The fp8 KV cache's rotation, centres and gains (gpu_worker/layers/kv_rotation.py): an orthogonal R, a
shift of every key and value (position 0's its own), and a per-channel gain between keys and queries, all
exact in fp32 (the engine's outputs do not move), and less fp8 rounding error where keys and queries share
an outlier channel, keys a common part, or the first token is an attention sink, as trained models' do."""
from __future__ import annotations

import pytest
import torch

from gpu_worker.attention import to_cache
from gpu_worker.layers.kv_rotation import KVCentres, kv_rotation


@pytest.mark.unit
@pytest.mark.parametrize("d", [64, 128, 48, 80])
def test_the_rotation_is_orthogonal(d: int) -> None:
    r = kv_rotation(d, torch.device("cpu"), torch.float64)
    assert torch.allclose(r @ r.T, torch.eye(d, dtype=torch.float64), atol=1e-12)
    if d & (d - 1) == 0:                 # Hadamard: every entry +-1/sqrt(d)
        assert torch.allclose(r.abs(), torch.full_like(r, d ** -0.5))


@pytest.mark.unit
def test_rotation_shrinks_the_fp8_score_error_of_an_outlier_channel() -> None:
    g = torch.Generator().manual_seed(0)
    d = 64
    q, k = torch.randn(256, d, generator=g), torch.randn(512, d, generator=g)
    q[:, 3] += 12.0                          # the shared massive channel
    k[:, 3] += 12.0
    exact = q @ k.T
    fp8 = lambda x: to_cache(x, torch.float8_e4m3fn, 1.0).float()    # noqa: E731
    plain = (fp8(k) @ q.T).T - exact       # the cache rounds k; q stays fp32, as in the engine
    r = kv_rotation(d, torch.device("cpu"))
    rotated = (q @ r) @ fp8(k @ r).T - exact
    assert rotated.pow(2).mean() < 0.25 * plain.pow(2).mean(), (rotated.pow(2).mean(), plain.pow(2).mean())


@pytest.mark.unit
def test_centring_keys_keeps_the_attention_and_shrinks_the_fp8_error_of_a_common_part() -> None:
    g = torch.Generator().manual_seed(1)
    d = 64
    q, k = torch.randn(64, d, generator=g), torch.randn(300, d, generator=g)
    k += 6.0 * torch.randn(d, generator=g)         # every key's common part
    r = kv_rotation(d, torch.device("cpu"))
    mu = k.mean(0)
    exact = torch.softmax(q @ k.T / 8, -1)
    assert torch.allclose(torch.softmax(q @ (k - mu).T / 8, -1), exact, atol=1e-6)
    fp8 = lambda x: to_cache(x, torch.float8_e4m3fn, 1.0).float()    # noqa: E731
    rotated = torch.softmax((q @ r) @ fp8(k @ r).T / 8, -1) - exact
    centred = torch.softmax((q @ r) @ fp8((k - mu) @ r).T / 8, -1) - exact
    assert centred.abs().sum() < 0.5 * rotated.abs().sum(), (centred.abs().sum(), rotated.abs().sum())


def _attention(q, k, v, scale=0.125):
    """Causal attention of one sequence, q [T, Hq, D], k, v [T, Hkv, D], in fp64."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    s = torch.einsum("thd,shd->hts", q.double(), k) * scale
    s = s.masked_fill(torch.ones(q.shape[0], q.shape[0], dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hts,shd->thd", s.softmax(-1), v)


def _sink_sequence(seed: int, t: int = 96, hq: int = 6, hkv: int = 2, d: int = 64):
    """Queries, keys and values shaped like a trained model's: a common query direction that the first
    key (the sink) answers with a large, distinct key and a small value; keys with a common part."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, hq, d, generator=g) + 3.0 * torch.randn(1, hq, d, generator=g)
    k = torch.randn(t, hkv, d, generator=g) + 2.0 * torch.randn(1, hkv, d, generator=g)
    k[0] = 0.6 * q[0].reshape(hkv, -1, d).mean(1).sign() * q[1:].reshape(t - 1, hkv, -1, d).mean((0, 2)).abs() + 4.0
    v = torch.randn(t, hkv, d, generator=g)
    v[0] = 0.1 * torch.randn(hkv, d, generator=g) + 5.0
    return q, k, v


@pytest.mark.unit
def test_centres_and_gains_are_exact_and_shrink_the_fp8_error_of_a_sink() -> None:
    """In fp64, the cache's q, k, v (centred, position 0 around its own centres, keys divided and queries
    multiplied by the gains, rotated), read back with the sink added and the output restored, give the
    attention of the original q, k, v; rounded to e4m3, the error is well under plain rotation's."""
    q, k, v = _sink_sequence(0)
    r = kv_rotation(64, torch.device("cpu"), torch.float64)
    c = KVCentres.measure(q, k, v)
    c = KVCentres(*(x.double() for x in (c.k_mean, c.k_first, c.v_mean, c.v_first, c.gain)))
    first = torch.arange(q.shape[0]) == 0
    exact = _attention(q, k, v)

    def through_cache(round_to):
        qc, kc, vc = c.apply(q.double(), k.double(), v.double(), first, r)
        kc, vc = round_to(kc), round_to(vc)
        sink = c.sink(r, 1.0, 1.0).double()
        kc[0] += sink[0]
        vc[0] += sink[1]
        return c.restore(_attention(qc, kc, vc) @ r.T)

    assert (through_cache(lambda x: x) - exact).abs().max() < 1e-9
    fp8 = lambda x: to_cache(x.float(), torch.float8_e4m3fn, 1.0).double()     # noqa: E731
    rotated = (_attention(q.double() @ r, fp8(k.double() @ r), fp8(v.double() @ r)) @ r.T - exact).abs().mean()
    centred = (through_cache(fp8) - exact).abs().mean()
    assert centred < 0.5 * rotated, (centred, rotated)
    assert c.gain.shape == (2, 64) and torch.allclose(c.gain.log().mean(-1), torch.zeros(2, dtype=c.gain.dtype),
                                                      atol=1e-6)


@pytest.mark.unit
def test_soft_capped_layers_keep_their_keys_unshifted() -> None:
    q, k, v = _sink_sequence(1)
    c = KVCentres.measure(q, k, v, shift_keys=False)
    assert not c.k_mean.any() and not c.k_first.any() and c.v_first.abs().sum() > 0


@pytest.mark.slow
def test_an_fp8_engine_centres_its_cache_at_start_up(tiny_model) -> None:
    from pagedserve import LLM
    for rotation in (True, False):
        llm = LLM(str(tiny_model("llama")), dtype="float32", kv_cache_memory=0.02, swap_space=0, kv_cache_dtype="fp8",
                  kv_cache_rotation=rotation)
        centres = [layer.self_attn.kv_centres for layer in llm.engine.executor.runner.model.layers]
        if not rotation:
            assert centres == [None, None]
            continue
        for c in centres:
            assert c.k_mean.abs().sum() > 0 and c.v_mean.abs().sum() > 0 and not torch.equal(c.k_first, c.k_mean)
            assert not torch.equal(c.gain, torch.ones_like(c.gain))
            assert c.key_feedback.shape == (c.gain.shape[0], c.gain.shape[1], c.gain.shape[1])   # fp8_feedback.py


@pytest.mark.slow
@pytest.mark.parametrize("budget", [None, 4], ids=["whole-prompts", "chunks-of-4"])
def test_rotating_and_centring_every_layer_leaves_fp32_outputs_unchanged(tiny_model, budget) -> None:
    """Forced on with an fp32 cache (where the engine would not rotate): prompt logprobs within 1e-4 of the
    unrotated engine's, greedy tokens identical, with random centres and gains too (the sink added back by
    decodes, fresh prefills and, in chunks of 4, prefills behind a context); a wrong rotation (not
    orthogonal) moves them."""
    from pagedserve import LLM, SamplingParams
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [40, 41, 42, 43, 44, 45, 46]]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
    extra = {} if budget is None else dict(max_num_batched_tokens=budget)

    def run(rotation, centres=None):
        llm = LLM(str(tiny_model("llama")), dtype="float32", kv_cache_memory=0.02, swap_space=0, **extra)
        for layer in llm.engine.executor.runner.model.layers:
            layer.self_attn.kv_rotation = rotation(layer.self_attn.head_dim)
            layer.self_attn.kv_centres = centres
        outs = llm.generate(prompts, sp, use_tqdm=False)
        return ([o.outputs[0].token_ids for o in outs],
                torch.tensor([rec[0] for o in outs for rec in o.prompt_logprobs[1:]]))
    tokens, lps = run(lambda d: None)
    rot_tokens, rot_lps = run(lambda d: kv_rotation(d, torch.device("cpu")))
    assert rot_tokens == tokens and (rot_lps - lps).abs().max() < 1e-4
    g = torch.Generator().manual_seed(3)
    centres = KVCentres(*(torch.randn(2, 16, generator=g) for _ in range(4)), gain=torch.rand(2, 16, generator=g) + 0.5)
    centred_tokens, centred_lps = run(lambda d: kv_rotation(d, torch.device("cpu")), centres)
    assert centred_tokens == tokens and (centred_lps - lps).abs().max() < 1e-4
    _, bad_lps = run(lambda d: 1.1 * kv_rotation(d, torch.device("cpu")))
    assert (bad_lps - lps).abs().max() > 1e-3
