"""The fp8 KV cache's rotation and key centring (gpu_worker/layers/kv_rotation.py): an orthogonal R and a
shift of every key, both exact in fp32 (the engine's outputs do not move), and less fp8 rounding error in
the scores when keys and queries share an outlier channel, or keys a common part, as trained models' do."""
from __future__ import annotations

import pytest
import torch

from gpu_worker.attention import to_cache
from gpu_worker.layers.kv_rotation import kv_rotation


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


@pytest.mark.slow
def test_an_fp8_engine_centres_its_keys_at_start_up(tiny_model) -> None:
    from pagedserve import LLM
    for rotation in (True, False):
        llm = LLM(str(tiny_model("llama")), dtype="float32", kv_cache_memory=0.02, swap_space=0, kv_cache_dtype="fp8",
                  kv_cache_rotation=rotation)
        shifts = [layer.self_attn.k_shift for layer in llm.engine.executor.runner.model.layers]
        assert all(s is not None and s.abs().sum() > 0 for s in shifts) if rotation else shifts == [None, None]


@pytest.mark.slow
def test_rotating_every_layer_leaves_fp32_outputs_unchanged(tiny_model) -> None:
    """Forced on with an fp32 cache (where the engine would not rotate): prompt logprobs within 1e-4 of the
    unrotated engine's, greedy tokens identical; a wrong rotation (not orthogonal) moves them."""
    from pagedserve import LLM, SamplingParams
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [40, 41, 42, 43, 44, 45, 46]]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)

    def run(rotation, k_shift=None):
        llm = LLM(str(tiny_model("llama")), dtype="float32", kv_cache_memory=0.02, swap_space=0)
        for layer in llm.engine.executor.runner.model.layers:
            layer.self_attn.kv_rotation = rotation(layer.self_attn.head_dim)
            layer.self_attn.k_shift = k_shift
        outs = llm.generate(prompts, sp, use_tqdm=False)
        return ([o.outputs[0].token_ids for o in outs],
                torch.tensor([rec[0] for o in outs for rec in o.prompt_logprobs[1:]]))
    tokens, lps = run(lambda d: None)
    rot_tokens, rot_lps = run(lambda d: kv_rotation(d, torch.device("cpu")))
    assert rot_tokens == tokens and (rot_lps - lps).abs().max() < 1e-4
    shift = torch.randn(2, 16, generator=torch.Generator().manual_seed(3))     # a key shift, as centring sets
    _, shifted_lps = run(lambda d: kv_rotation(d, torch.device("cpu")), k_shift=shift)
    assert (shifted_lps - lps).abs().max() < 1e-4
    _, bad_lps = run(lambda d: 1.1 * kv_rotation(d, torch.device("cpu")))
    assert (bad_lps - lps).abs().max() > 1e-3
